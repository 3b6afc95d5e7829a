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
#   then:    give_back; unpack $OUT/results.tgz here into docs/results/, commit, note on the issue.
#
# The argument is the seconds this call may spend on steps. The steps run in the order below,
# each in its own processes (fresh engines, as every result here is measured) under a `timeout`
# no longer than what is left; one that fails or runs out is logged and the rest go on. A step
# that needs SmolLM2 waits for the call that brings the GGUF's last piece; a step that finished
# in an earlier call of the same warm machine is not run again. After every step the results so
# far (from all calls) and the logs are packed into $OUT/results.tgz, so whatever ran comes back
# even when a call is cut off.
#
# The order is the CUDA issue's, cheapest news first: the decode step against its floor of the
# stages that differ most (a ladder on the post's model shape) and where the worker's time goes
# under post 052's load (`worker-probe`); SmolLM2 parity in fp32 and bf16, the posts' three
# effects (052, 004, 000) and `make bench` on SmolLM2; then the other stages' decode steps,
# decode profiles and post 052's shape on gpt2-random, the 32-request ladder against
# transformers, the tests that need the GGUF, and the rest of the CPU set's commands
# (`rerun_results.py --like cpu --resume`) for as long as there is time. Every engine is a fresh
# process, and one costs about 25 s on the H200 before it measures anything: a call of 470 s
# holds about twenty of them.
#
# Rehearse it here, on the CPU, in a scratch copy of the tree (it writes into docs/results/):
#   STAGEWISE_SESSION_DEVICE=cpu OUT=/tmp/out bash scripts/gpu_session.sh 120
set -uo pipefail
BUDGET=${1:?usage: gpu_session.sh SECONDS}
DEVICE=${STAGEWISE_SESSION_DEVICE:-cuda}
source scripts/gpu_env.sh
OUT=${OUT:-$STASH/out}
mkdir -p "$OUT" "$STASH/results" "$STASH/logs"
DONE=$STASH/done.${STAGEWISE_GIT_COMMIT:-unknown}  # steps finished at this commit, in any call
touch "$DONE" "$STASH/marker"
cp -p "$STASH"/results/* docs/results/ 2>/dev/null  # an earlier call's results: --resume sees them
START=$SECONDS
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader

pack() {  # everything written under docs/results/ since the first call, and the logs, as one file
    find docs/results -maxdepth 1 -type f -newer "$STASH/marker" -exec cp -p {} "$STASH/results/" \;
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

# Item 5: every stage's decode step against its floor, on the post's model shape. Each engine
# is a fresh process, about 25 s each on the H200 (imports, CUDA, the model, the floor), so the
# stages come in two ladders: the ones that differ most, with transformers, first.
step ladder-decode-step-$G2 - 170 $PY -m common.cli ladder --workload decode-step --stages 2,3,9,11 \
    --model $G2 --device $DEVICE --rounds 1 --repeat-runs 1 --tag decode-step.$G2 --out docs/results
# Item 5: post 052's shape gives a token every ~20 ms against a 4.3 ms decode step alone: where
# the worker's time goes under that load, and with the 64 consumer threads woken once, not every 8 tokens.
step probe-s09-$G2 - 60 $PY -m common.cli worker-probe --stage 9 --preset post-052 --model $G2 --device $DEVICE \
    --json docs/results/worker-probe.s09_batched_worker_lookups.post-052.$G2.$DEVICE.json
step probe-s09-stream-128-$G2 - 60 $PY -m common.cli worker-probe --stage 9 --preset post-052 --model $G2 \
    --device $DEVICE --stream-interval 128 \
    --json docs/results/worker-probe.s09_batched_worker_lookups.post-052.stream-128.$G2.$DEVICE.json
# Item 3: greedy parity with transformers on the GPU (the CPU files' own commands).
step parity-fp32 smollm2 180 $RERUN --only parity.fp32
step parity-bf16 smollm2 150 $RERUN --only parity.bf16
# Item 4: the posts' effects on SmolLM2 (052: stage 08 vs 09; 004: 07 vs 08; 000: 06 vs 07) and make bench.
step bench-s09 smollm2 100 $RERUN --only s09_batched_worker_lookups.cpu
step bench-s08 smollm2 80 $RERUN --only s08_token_id_cache_keys.cpu
step bench-s07 smollm2 80 $RERUN --only s07_admission_knob.cpu
step make-bench-smollm2 smollm2 80 $RERUN --only make-bench
# Item 5 again: the other stages' decode steps; where a step's time goes (kernels vs launches);
# post 052's shape on its model.
step ladder-decode-step-rest-$G2 - 170 $PY -m common.cli ladder --workload decode-step --stages 4,5,6,7,8,10 \
    --no-hf --model $G2 --device $DEVICE --rounds 1 --repeat-runs 1 --tag decode-step-rest.$G2 --out docs/results
for s in 2:s02_kv_cache 3:s03_paged_attention 9:s09_batched_worker_lookups 11:s11_chunked_prefill; do
    step profile-${s#*:}-$G2 - 60 $PY -m common.cli profile-decode --stage ${s%%:*} --model $G2 --device $DEVICE \
        --batch 64 --prompt-len 64 --steps 20 --json docs/results/profile.${s#*:}.b64.$G2.$DEVICE.json
done
for s in s09_batched_worker_lookups s11_chunked_prefill; do
    step make-bench-$s-$G2 - 80 $PY -m stages.$s.bench --preset post-052 --model $G2 --device $DEVICE \
        --json docs/results/make-bench.$s.$G2.$DEVICE.json
done
step ladder-random-lengths-32x16-$G2 - 200 $PY -m common.cli ladder --workload random-lengths --num-requests 32 \
    --max-batch-size 16 --max-new-tokens 64 --stages 2,3,9 --model $G2 --device $DEVICE --rounds 1 \
    --tag random-lengths-32x16.$G2 --out docs/results
step tests-smollm2 smollm2 150 env STAGEWISE_TEST_DEVICE=$DEVICE $PY -m pytest -q -p no:cacheprovider \
    tests/test_smollm2.py tests/test_loader.py tests/test_model.py
# Item 4: the rest of the CPU set's commands, as long as time allows (the stability runs and the
# serving comparisons last longest and come last).
step rest smollm2 600 $RERUN --resume --skip stability --skip serve
step rest-serve smollm2 300 $RERUN --resume --skip stability
pack
echo "gpu_session: $(wc -l <"$DONE") steps done at ${STAGEWISE_GIT_COMMIT:0:10}, $((SECONDS - START))s in this call;" \
     "$(ls "$STASH/results" | wc -l) files in $OUT/results.tgz"
cat "$STASH/logs/summary.txt"
