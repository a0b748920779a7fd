"""Linear layers whose few-row inference products on the CPU go to OpenBLAS (numpy's) instead of PyTorch's
MKL.

Decoding multiplies one token's activations (a row, or one per sequence in a batch) by every weight matrix:
a matrix-vector product that only reads memory. PyTorch's CPU build sends it to MKL's sgemm, which runs it
on one thread at 8-13 GB/s on an AVX2 AMD EPYC, while the OpenBLAS that numpy ships reads the same matrix
with both threads at 16-37 GB/s (docs/LOG.md#2026-11-25-decode-time-mkl-openblas). So a product goes to
OpenBLAS when all of these hold, and to F.linear otherwise:

- inside `decode_threads()` (a decoding step that pays for it, below), with no gradient recorded;
- float32 on the CPU, at most MAX_ROWS rows (decoding steps; a prompt's prefill stays with PyTorch), and a
  weight matrix of at least MIN_WEIGHTS entries;
- numpy's OpenBLAS was found, and $CODEFORGE_CPU_MATMUL is not `torch`.

OpenBLAS runs as many threads as PyTorch's intra-op pool (device.thread_policy chose it), set through
threadpoolctl. Outside a decoding step every product stays with PyTorch: OpenBLAS's threads beside
PyTorch's, both wanting every core, made a 5M model's batch-8 decoding 2.4x slower (285 against 676
tokens/s, docs/LOG.md#2026-11-25-openblas-final-rule). Its idle threads sleep almost at once
(OPENBLAS_THREAD_TIMEOUT, set in codeforge/__init__.py before anything loads OpenBLAS), for the same reason
OpenMP's do.

A decoding step runs inside `decode_threads()`: OpenBLAS keeps the pool's thread count for the products and
PyTorch's own operations (norms, attention over one query, sampling) run on one thread. Two pools that both
want every core wake each other's sleeping threads dozens of times a token: 8.3 tokens/s at 128M
parameters with both at 2 threads, 17-20 with PyTorch at 1 and OpenBLAS at 2
(docs/LOG.md#2026-11-25-openblas-decode-products).

The two libraries add in different orders, so logits differ in the last bits (about 1e-6 relative); the
tests compare both paths.
"""

from __future__ import annotations

import contextlib
import os
import threading

import torch
import torch.nn as nn
import torch.nn.functional as F

MAX_ROWS = 16  # up to a batch of 16 sequences decoding one token each
# smaller matrices (2 MB) stay with PyTorch: waking OpenBLAS's threads costs more than it saves there (a
# 5M-parameter model decoded slower through OpenBLAS on every product,
# docs/LOG.md#2026-11-25-openblas-decode-products)
MIN_WEIGHTS = 1 << 19
MATMUL_ENV = "CODEFORGE_CPU_MATMUL"  # "torch": never OpenBLAS; "auto" or unset: the rule above

_state: dict = {}
_local = threading.local()  # .decoding: inside decode_threads() on this thread


def _openblas():
    """(numpy, threadpoolctl controller of numpy's OpenBLAS) or None where there
    is none, or it is turned off."""
    if "blas" not in _state:
        _state["blas"] = None
        choice = os.environ.get(MATMUL_ENV, "auto").strip().lower() or "auto"
        if choice not in ("auto", "torch", "openblas"):
            raise ValueError(f"${MATMUL_ENV}={choice!r}: use auto (the default), openblas or torch")
        if choice != "torch":
            try:
                import numpy as np
                from threadpoolctl import ThreadpoolController
                ctl = ThreadpoolController().select(internal_api="openblas")
                if ctl.lib_controllers:
                    _state["blas"] = (np, ctl)
            except ImportError:
                pass
    return _state["blas"]


def backend() -> str:
    """The library few-row float32 inference products use on the CPU: "openblas" or "torch"."""
    return "openblas" if _openblas() is not None else "torch"


def _set_blas_threads(ctl, n: int) -> None:
    if _state.get("threads") != n:
        ctl.limit(limits=n)
        _state["threads"] = n


def openblas_share(model: nn.Module) -> float:
    """The share of `model`'s linear weights in matrices large enough for OpenBLAS (MIN_WEIGHTS)."""
    sizes = [m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear)]
    return sum(n for n in sizes if n >= MIN_WEIGHTS) / max(1, sum(sizes))


def openblas_pays(model: nn.Module, rows: int) -> bool:
    """Whether a decoding step of `rows` sequences of `model` is worth OpenBLAS: one row, or a model whose
    linear weights are mostly in matrices OpenBLAS multiplies (openblas_share >= 0.5)."""
    if rows <= 1:
        return True
    share = model.__dict__.get("_openblas_share")
    if share is None:
        share = model.__dict__["_openblas_share"] = openblas_share(model)
    return share >= 0.5


@contextlib.contextmanager
def decode_threads(model: nn.Module | None = None, rows: int = 1):
    """Around one decoding step of `rows` sequences on the CPU: PyTorch on one thread, OpenBLAS on the pool's
    count (see above). Only where that pays: one row, or a model whose weights are mostly in matrices that
    OpenBLAS multiplies (with 8 rows, a 5M-parameter model's small products are worth PyTorch's threads:
    727 tokens/s with them against 459 without, docs/LOG.md#2026-11-25-openblas-final-rule). Does nothing
    where OpenBLAS is not used; with a pool of one thread it only holds OpenBLAS to one too (the numpy
    decoding step multiplies through it, models/cpu_decode.py, and its default is every core)."""
    n = torch.get_num_threads()
    if n == 1 and not getattr(_local, "decoding", False) and _openblas() is not None:
        _set_blas_threads(_openblas()[1], 1)
    blas = _openblas() if n > 1 and not getattr(_local, "decoding", False) else None
    if blas is not None and model is not None and not openblas_pays(model, rows):
        blas = None
    if blas is None:
        yield
        return
    _set_blas_threads(blas[1], n)
    _local.decoding = True
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)
        _local.decoding = False


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias), through OpenBLAS where the module's rule allows it."""
    # the thread-local flag first: outside a decoding step (training among them) nothing else is looked at;
    # decode_threads sets it only where OpenBLAS was found
    if (getattr(_local, "decoding", False) and not torch.is_grad_enabled() and x.device.type == "cpu"
            and x.dtype == torch.float32 and weight.dtype == torch.float32 and weight.numel() >= MIN_WEIGHTS
            and 0 < x.numel() <= MAX_ROWS * x.shape[-1] and not torch.compiler.is_compiling()):
        np = _openblas()[0]
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        out = torch.empty(rows.shape[0], weight.shape[0], dtype=torch.float32)
        np.matmul(rows.numpy(), weight.detach().numpy().T, out=out.numpy())
        if bias is not None:
            out += bias.detach()
        return out.view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear (same parameters, state dict and initialisation) whose forward is `linear` above."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
