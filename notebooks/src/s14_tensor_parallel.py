# %% [markdown]
# # Stage 14 — tensor parallelism
# One model split across ranks, Megatron-style: each rank holds the rows of q/k/v and gate/up
# for its heads and its slice of the MLP (column-parallel), and the matching columns of the output
# and down projections (row-parallel), whose partial sums one all-reduce adds. This notebook
# checks the arithmetic in one process, then runs the real thing: two processes on gloo.

# %% include _setup.py

# %% [markdown]
# ## The split, by hand
# Take the first layer of `tiny` (4 query heads, 2 KV heads) and split its MLP in two the way
# `sharding.py` does: rank r gets rows r of gate and of up, and columns r of down. Each half
# gives a partial sum of the MLP's output; added, they are the whole layer's output.

# %%
import subprocess, torch

layer = loaded.model.layers[0]
x = torch.randn(3, loaded.config.hidden_size)
I = loaded.config.intermediate_size
gate, up = layer.gate_up_weight[:I], layer.gate_up_weight[I:]
full = (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ layer.down_weight.T

parts = []
for r in range(2):
    rows = slice(r * I // 2, (r + 1) * I // 2)  # this rank's slice of the inner width
    h = torch.nn.functional.silu(x @ gate[rows].T) * (x @ up[rows].T)  # column-parallel: no communication
    parts.append(h @ layer.down_weight[:, rows].T)  # row-parallel: a partial sum of the output
print("partial sums add up to the layer's output:", torch.allclose(parts[0] + parts[1], full, atol=1e-5))
print("each rank's MLP weights:", gate[: I // 2].numel() * 3, "of", gate.numel() * 3)

# %% [markdown]
# ## Two ranks, for real
# `--tensor-parallel-size 2` starts a second process, forms a gloo group with it, and splits the
# model. The text is the one rank did alone (greedy): the two ranks computed the same function.

# %%
cmd = [sys.executable, "-m", "stages.s14_tensor_parallel", "The capital of France is", "--model", "tiny",
       "--device", "cpu", "--max-new-tokens", "8", "--no-chat"]
alone = subprocess.run(cmd, capture_output=True, text=True, cwd=root).stdout
split = subprocess.run(cmd + ["--tensor-parallel-size", "2"], capture_output=True, text=True, cwd=root).stdout
print(split)
print("same text on 1 and 2 ranks:", alone == split)
