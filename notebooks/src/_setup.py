# The cells every stage notebook starts with, after its title: notebooks/build.py puts them where
# a source says `# %% include _setup.py`, so each generated notebook still runs on its own.

# %% [markdown]
# ## Load a model
# `tiny` is a small random-weight model that loads in a second, so the outputs are gibberish
# but every code path runs. For real text, change `"tiny"` to `"smollm2-135m"` (the default
# model; slower on a CPU).

# %%
# Put the repository root on sys.path: walk up from the working directory until common/ and stages/ appear.
import importlib, sys, time
from pathlib import Path

root = Path.cwd().resolve()
while not ((root / "common").is_dir() and (root / "stages").is_dir()):
    if root.parent == root:
        raise RuntimeError("start this notebook from inside the stagewise repository")
    root = root.parent
sys.path.insert(0, str(root))

from common.loader import load_model
from common.requests import Request, SamplingParams, prepare_prompt

loaded = load_model("tiny", device="cpu")  # swap "tiny" for "smollm2-135m" to use the real model
PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):"]
def requests(n_tokens=8, prompts=PROMPTS):
    return [Request(prompt=p, params=SamplingParams(max_new_tokens=n_tokens)) for p in prompts]
