"""The HTTP layer: `stagewise serve`, an OpenAI-compatible server over any streaming stage, and
the tools that measure it.

From the ground up (each imports only those above it, the measuring kit in `common.bench` and
the engine's parts in `common/`):

- `protocol`, `transport`, `metrics`, `sse_client`: OpenAI's fields and shapes, what reaches the
  wire, the Prometheus counters, and a standard-library client;
- `engine`: the stage's manager that `serve`'s flags build; `engine_process`: the same manager
  in a process of its own; `tokenization`: `/tokenize` and `/detokenize`;
- `app`: the routes; `server`: `stagewise serve` itself;
- `bench` (`stagewise bench-serve`), `overhead` (`serve-overhead`) and `compare`
  (`serve-compare`): the same workloads over HTTP.
"""
