#!/usr/bin/env bash
# Rehearse a GPU session on this CPU, before one is lent:   bash scripts/gpu_rehearsal.sh
#
# Why: a GPU machine is lent to about one session in five, for 15 minutes of device time, and its
# image differs from `make venv` (Python 3.12, torch 2.11, transformers 5.17, numpy 2.5, no
# package index, no .git, the serving stack's wheels on PYTHONPATH). Whatever breaks only there
# (a test that rebuilds PYTHONPATH, a variable the tests did not expect, an API of a newer
# transformers) would be found with the GPU's clock running. This runs the calls scripts/README.md gives
# here, the same way: a venv of the image's Python and versions (torch's CUDA build runs on the
# CPU), a copy of the working tree without .git, `.device/` carried one GGUF piece per call (the
# wheels with the first), each call a fresh shell that starts with `source scripts/gpu_env.sh`. What it cannot rehearse is
# CUDA itself: tests/test_cuda.py skips, and everything runs on the CPU.
#
# Costs about 5 GB of downloads once (torch's CUDA wheels; kept in $REHEARSAL_DIR/image) and
# 10-15 minutes. PY312 names a Python 3.12 (default: python3.12 on the PATH, else pyenv's).
# It packs .device/ with scripts/gpu_bundle.py if there is none: delete .device/ after changing
# the dependencies, so the bundle rehearsed is the one a GPU session would carry.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
DIR=${REHEARSAL_DIR:-/tmp/stagewise-rehearsal}
if [ -z "${PY312:-}" ]; then  # the first that really is 3.12 (pyenv's shims answer for versions not selected)
    for py in python3.12 "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3; do
        if "$py" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then PY312=$py; break; fi
    done
fi
# The image's versions of what it has (the device tool's KINDS.md, as sessions there saw them)
IMAGE="torch==2.11.0 transformers==5.17.0 tokenizers==0.23.2 safetensors==0.8.0 huggingface_hub==1.33.0
       numpy==2.5.2 accelerate==1.15.0 pyyaml tqdm requests regex filelock fsspec packaging jinja2
       markupsafe sympy networkx uvloop pytest httpx anyio h11 httpcore psutil matplotlib typing-extensions"

[ -n "${PY312:-}" ] || { echo "gpu_rehearsal: no Python 3.12 found; set PY312" >&2; exit 1; }
if [ ! -x "$DIR/image/bin/python3" ]; then
    "$PY312" -m venv "$DIR/image"
    "$DIR/image/bin/pip" install -q $IMAGE
fi
cd "$REPO"
[ -d .device/whl ] || .venv/bin/python scripts/gpu_bundle.py  # (an older .device/ kept the wheels in base/)
rm -rf "$DIR/tree" "$DIR/stash"
mkdir -p "$DIR/tree"
git ls-files -z --cached --others --exclude-standard | xargs -0 cp --parents -t "$DIR/tree"

export PATH="$DIR/image/bin:$PATH" STAGEWISE_DEVICE_STASH="$DIR/stash"
STAGEWISE_GIT_COMMIT=$(git rev-parse HEAD)
STAGEWISE_GIT_DIRTY=$([ -z "$(git status --porcelain --untracked-files=no)" ] && echo 0 || echo 1)
export STAGEWISE_GIT_COMMIT STAGEWISE_GIT_DIRTY
unset VIRTUAL_ENV PYTHONPATH
cd "$DIR/tree"

call() {  # call N COMMAND: what the Nth call to the GPU machine would run, carrying base and gguf-N
    rm -rf .device && mkdir .device && cp -r "$REPO/.device/base" .device/
    [ "$1" = 1 ] && cp -r "$REPO/.device/whl" .device/
    [ -d "$REPO/.device/gguf-$1" ] && cp -r "$REPO/.device/gguf-$1" .device/
    echo "=== call $1: $2"
    bash -c "source scripts/gpu_env.sh && $2"
}

# scripts/README.md: the same calls in the same order, on the CPU (STAGEWISE_TEST_DEVICE unset),
# with a short gpt2-random bench in place of the CUDA results, which need a GPU.
pieces=$(ls -d "$REPO"/.device/gguf-* | wc -l)
call 1 "python3 -m pytest -q stages tests/test_cuda.py tests/test_parity.py tests/test_prefill.py"
call 2 "python3 -m pytest -q tests $(printf -- '--ignore=tests/test_%s.py ' notebooks smollm2 loader model cuda parity prefill)"
for i in $(seq 3 "$pieces"); do call "$i" true; done
call "$pieces" "python3 -m pytest -q tests/test_smollm2.py tests/test_loader.py tests/test_model.py"
call "$pieces" "python3 -m common.cli parity --dtype float32 --stages 2,9 --json $DIR/parity.json"
call "$pieces" "python3 -m stages.s11_chunked_prefill.bench --preset post-052 --model gpt2-random --num-requests 8 --max-new-tokens 8 --warmup-runs 0 --repeat-runs 1 --json $DIR/make-bench.json | tail -3"
echo "gpu_rehearsal: every call passed (on the CPU; $DIR/parity.json names commit $STAGEWISE_GIT_COMMIT)"
