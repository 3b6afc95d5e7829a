"""The measuring kit: how every number in the docs is made.

Nothing here is part of an engine; every stage's `bench.py` enters through one door,
`common.bench.harness.bench_main`. The modules, from the ground up (each imports only
those above it in this list, and the engine's parts in `common/`):

- `envinfo`, `metrics`, `report`, `floor`, `workloads`: where a result ran, the posts' metrics,
  the printed report, the matmul floor, the requests every engine gets;
- `knobs`, `flags`: the engines' knobs and the benches' flags, one definition for the benches, the
  ladder and the server;
- `results`: a result written as JSON with its command and environment;
- `engines`, `streaming`: the engines of a comparison and how each is run, offline or through
  a `SchedulerManager`; `hf_baseline` and `hf_continuous`, transformers' two as engines;
- `child` (the fresh process that runs one engine) and `spawn` (the parent that starts it):
  the child imports the engines, never the parent;
- `harness` (`python -m stages.<stage>.bench`), `ladder` with `ladder_rungs`,
  `ladder_workloads` and `ladder_report`, and the tools that reuse them: `stability`,
  `profiling` (what the two profilers share), `profile_decode`, `profile_prefill`, `parity`,
  `worker_probe`, `floor_curve`.
"""
