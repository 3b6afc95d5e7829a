"""Small tensors built on the host (token ids, block ids) sent to the device without a wait.

Why this exists: on CUDA, `torch.tensor(values, device="cuda")` copies out of ordinary (pageable)
host memory, and such a copy makes the host wait until the GPU has finished everything queued
before it: a host-device sync, the very stall a decode step is built to avoid (it may wait once,
to read the sampled tokens it decides with). Copied out of pinned (page-locked) memory, the same
few bytes are queued like a kernel and the host goes on. PyTorch keeps a pinned buffer from being
reused until its copy has run, so the temporary may be dropped at once. vLLM prepares its inputs
in pinned buffers for the same reason. On the CPU this is plain `torch.tensor`.
"""
from __future__ import annotations

from typing import Any

import torch


def to_device(values: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`torch.tensor(values, dtype=dtype)` on `device`; on CUDA through pinned memory, no sync."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
