#!/usr/bin/env bash
# A GPU session's work, prepared here so the device time goes to measuring, not to typing.
#
# A session that is lent a GPU gets 15 minutes of device time, all of it counted: the machine's
# start (about a minute), every call, and the 30 s it stays warm after one. SmolLM2's GGUF needs
# two calls to arrive (scripts/gpu_bundle.py), so the session is two calls, the second sent as soon
# as the first returns (the machine, and what the first left in its stash, goes back 30 s later):
#
#   here:    make venv && .venv/bin/python scripts/gpu_bundle.py       # once; writes .device/
#   call 1:  carry [".device/base", ".device/whl", ".device/gguf-1"], timeout_s 280
#            export STAGEWISE_GIT_COMMIT=<HEAD here> STAGEWISE_GIT_DIRTY=0; bash scripts/gpu_session.sh 230
#   call 2:  carry [".device/base", ".device/gguf-2"], timeout_s 520
#            export STAGEWISE_GIT_COMMIT=<HEAD here> STAGEWISE_GIT_DIRTY=0; bash scripts/gpu_session.sh 470
# (about 75 s to start + 280 + 520: 14 minutes with the gap, inside the 15; a slow start or a
# late second call costs the second call's last steps, not the session)
#   then:    give_back; unpack $OUT/results.tgz here, its results/ into docs/results/cuda/, commit,
#            note on the issue.
#
# The argument is the seconds this call may spend on steps. The steps run in the order below,
# each in its own processes (fresh engines, as every result here is measured) under a `timeout`
# no longer than what is left; one that fails or runs out is logged and the rest go on. A step
# that needs SmolLM2 waits for the call that brings the GGUF's last piece; a step that finished
# in an earlier call of the same warm machine is not run again. After every step the results so
# far (from all calls) and the logs are packed into $OUT/results.tgz, so whatever ran comes back
# even when a call is cut off.
#
# The order is the CUDA issue's, cheapest news first, what has never been measured before what
# has: where the worker's time goes under post 052's load (`worker-probe`), the decode steps of
# the stages not yet on the GPU's ladder, `make bench` and the GGUF's tests on SmolLM2, decode
# profiles and post 052's shape on gpt2-random, the 32-request ladder against transformers; then
# again what an earlier session measured (SmolLM2 parity, the posts' three effects, the first
# decode-step ladder), and the rest of the CPU set's commands (`rerun_results.py --like cpu
# --resume`) for as long as there is time. Every engine is a fresh
# process, and one costs about 25 s on the H200 before it measures anything: a call of 470 s
# holds about twenty of them.
#
# Rehearse it here, on the CPU, in a scratch copy of the tree (it writes into docs/results/cpu/):
#   STAGEWISE_SESSION_DEVICE=cpu OUT=/tmp/out bash scripts/gpu_session.sh 120
set -uo pipefail
BUDGET=${1:?usage: gpu_session.sh SECONDS}
DEVICE=${STAGEWISE_SESSION_DEVICE:-cuda}
source scripts/gpu_env.sh
OUT=${OUT:-$STASH/out}
mkdir -p "$OUT" "$STASH/results" "$STASH/logs"
DONE=$STASH/done.${STAGEWISE_GIT_COMMIT:-unknown}  # steps finished at this commit, in any call
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
    local name=$1 needs=$2 limit=$3 left rc t
    shift 3
    if grep -qx "$name" "$DONE"; then return; fi
    if [ "$needs" = smollm2 ] && [[ "$gguf_state" != ready* ]]; then
        echo "--- $name: waits for SmolLM2 (gguf: $gguf_state)"; return
    fi
    left=$((BUDGET - (SECONDS - START)))
    if [ "$left" -lt 30 ]; then echo "--- $name: no time left"; return; fi
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

PY=python3
RERUN="$PY scripts/rerun_results.py --like cpu --device $DEVICE"
G2=gpt2-random

# What ran on the H200 at e5514d9 (docs/results/cuda/) comes last here, to be measured
# again at the newest commit; what never ran comes first.
#
# Item 2: where the worker's time goes under post 052's load. At e5514d9 the worker was in decode
# 96 % of the time, its median step 9.2 ms and its mean 23.8: a few slow steps. The probe now
# lists the slowest with their batch; the second run turns off SDPA's cuDNN backend, whose plans
# are built per new shape (batch and K/V width change as requests arrive).
step probe-s09-$G2 - 60 $PY -m common.cli worker-probe --stage 9 --preset post-052 --model $G2 --device $DEVICE \
    --json $RESULTS/worker-probe.s09_batched_worker_lookups.post-052.$G2.$DEVICE.json
step probe-s09-no-cudnn-$G2 - 60 $PY -m common.cli worker-probe --stage 9 --preset post-052 --model $G2 \
    --device $DEVICE --no-cudnn-attention \
    --json $RESULTS/worker-probe.s09_batched_worker_lookups.post-052.no-cudnn.$G2.$DEVICE.json
# Item 5: the stages not yet on the GPU's decode-step ladder (each engine a fresh process, ~25 s).
step ladder-decode-step-rest-$G2 - 170 $PY -m common.cli ladder --workload decode-step --stages 4,5,6,7,8,10 \
    --no-hf --model $G2 --device $DEVICE --rounds 1 --repeat-runs 1 --tag decode-step-rest.$G2 --out $RESULTS
# Item 4: make bench on SmolLM2, and the tests that need its GGUF.
step make-bench-smollm2 smollm2 80 $RERUN --only make-bench
step tests-smollm2 smollm2 150 env STAGEWISE_TEST_DEVICE=$DEVICE $PY -m pytest -q -p no:cacheprovider \
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
step parity-fp32 smollm2 180 $RERUN --only parity.fp32
step parity-bf16 smollm2 150 $RERUN --only parity.bf16
step bench-s09 smollm2 100 $RERUN --only s09_batched_worker_lookups.cpu
step bench-s08 smollm2 80 $RERUN --only s08_token_id_cache_keys.cpu
step bench-s07 smollm2 90 $RERUN --only s07_admission_knob.cpu
# Item 4: the rest of the CPU set's commands, as long as time allows (the stability runs and the
# serving comparisons last longest and come last).
step rest smollm2 600 $RERUN --resume --skip stability --skip serve
step rest-serve smollm2 300 $RERUN --resume --skip stability
pack
echo "gpu_session: $(wc -l <"$DONE") steps done at ${STAGEWISE_GIT_COMMIT:0:10}, $((SECONDS - START))s in this call;" \
     "$(ls "$STASH/results" | wc -l) files in $OUT/results.tgz"
cat "$STASH/logs/summary.txt"
