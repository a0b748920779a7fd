"""Wrapping the model for speed and for data parallelism, in one place (torchtitan's `parallelize` idea).

The trainer calls `wrap` once; what it returns is what the loss function runs (the wrapped model), while
the optimizer, checkpoints and evaluation use the bare model.
"""

from __future__ import annotations

import torch


def wrap(model: torch.nn.Module, device: torch.device, compile: bool = False, ddp: bool = False) -> torch.nn.Module:
    """torch.compile (if asked), then DistributedDataParallel when running under torchrun with world > 1
    (each rank reads disjoint batches; gradients are averaged in backward)."""
    fwd = torch.compile(model) if compile else model
    if ddp:
        from torch.nn.parallel import DistributedDataParallel as DDP
        fwd = DDP(fwd, device_ids=[device.index] if device.type == "cuda" else None)
    return fwd
