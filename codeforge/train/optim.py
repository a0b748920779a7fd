"""Optimizers and learning-rate schedules. Schedules are pure functions of the step."""

from __future__ import annotations

import math

import torch

from .. import CodeforgeError
from ..device import cpu_native_bf16


class OptimizerError(CodeforgeError, ValueError):
    """An optimizer that cannot serve this model or device; the message says what to use instead."""


def lr_at(step: int, *, base_lr: float, warmup: int, total: int, schedule: str = "cosine",
          min_ratio: float = 0.1, decay_fraction: float = 0.2) -> float:
    """Learning rate for optimizer step `step` (0-based) of `total`.

    Linear warm-up from base_lr/warmup to base_lr over `warmup` steps, then
      cosine:   half-cosine from base_lr down to the floor min_ratio * base_lr at `total`;
      linear:   straight line down to the floor;
      constant: base_lr;
      wsd:      warmup-stable-decay (Hu et al. 2024, MiniCPM): flat, then linear to the floor over the last
                decay_fraction of the run.
    """
    floor = base_lr * min_ratio
    if warmup > 0 and step < warmup:
        return base_lr * (step + 1) / warmup
    if schedule == "constant" or total <= warmup:
        return base_lr
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if schedule == "cosine":
        return floor + (base_lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if schedule == "linear":
        return base_lr - (base_lr - floor) * progress
    if schedule == "wsd":
        decay_start = 1.0 - decay_fraction
        if progress < decay_start:
            return base_lr
        return base_lr - (base_lr - floor) * (progress - decay_start) / max(decay_fraction, 1e-12)
    raise ValueError(f"unknown schedule {schedule!r}")


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    """Every group's lr is the schedule's `lr` times the group's "lr_scale" (1 when absent): a model with
    per-module rates (models/hrm.py) keeps their ratios through warm-up and decay."""
    for g in opt.param_groups:
        g["lr"] = lr * g.get("lr_scale", 1.0)


def orthogonalised(m: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float,
                   dtype: torch.dtype) -> torch.Tensor:
    """Muon's Newton-Schulz orthogonalisation of a 2-D update, computed in `dtype`: scaled to spectral norm
    at most 1 (by its Frobenius norm), then `steps` quintic iterations X <- aX + (bA + cA^2)X with A = XX^T,
    on the wide orientation (fewer rows than columns) so that A is the small Gram matrix."""
    a, b, c = coefficients
    tall = m.size(0) > m.size(1)
    x = (m.T if tall else m).to(dtype)
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


class CpuMuon(torch.optim.Muon):
    """torch.optim.Muon with its Newton-Schulz iterations in float32 instead of bfloat16, for a CPU that
    multiplies bfloat16 only in emulation (AVX2 without AVX512-BF16 or AMX): there the bfloat16 products cost
    more than the whole forward and backward pass (docs/LOG.md#2026-11-25-cpu-muon-float32). Same update rule,
    hyperparameters and state (one "momentum_buffer" per matrix), so checkpoints move between the two."""

    ns_dtype = torch.float32

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise OptimizerError("CpuMuon takes no closure")
        for group in self.param_groups:
            lr, mu, decay = group["lr"], group["momentum"], group["weight_decay"]
            if group["adjust_lr_fn"] not in (None, "original"):
                raise OptimizerError(f"CpuMuon scales the rate as Muon's \"original\" does; adjust_lr_fn "
                                     f"{group['adjust_lr_fn']!r} is torch.optim.Muon's only")
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(g, memory_format=torch.preserve_format)
                buf = state["momentum_buffer"]
                buf.lerp_(g, 1 - mu)
                update = g.lerp(buf, mu) if group["nesterov"] else buf
                update = orthogonalised(update, group["ns_coefficients"], group["ns_steps"], group["eps"],
                                        self.ns_dtype)
                rows, cols = p.shape[:2]
                scale = math.sqrt(max(1, rows / cols))  # adjust_lr_fn "original", as MuonAdamW asks for
                p.mul_(1 - lr * decay)
                p.add_(update.to(p.dtype), alpha=-lr * scale)


class MuonAdamW:
    """Muon (Jordan et al. 2024; torch.optim.Muon) for the hidden weight matrices, AdamW for everything else
    (embeddings, the output head, gains, biases), stepped together as one optimizer, as nanochat and the
    modded-nanogpt speedrun do. Muon orthogonalises each matrix's momentum with a few Newton-Schulz
    iterations, so every direction of the update moves at the same rate; its learning rate is scaled by
    sqrt(max(1, rows/cols)) per matrix ("original"). Groups keep their "lr_scale" (set_lr), so the one
    schedule drives both at their own peaks. The surface the trainer and GradScaler use: param_groups, step,
    zero_grad, add_param_group (to AdamW), state_dict/load_state_dict."""

    def __init__(self, groups: list[dict], lr: float, betas: tuple[float, float], momentum: float,
                 fused: bool, float32_ns: bool = False):
        muon = [{k: v for k, v in g.items() if k != "muon"} for g in groups if g.get("muon")]
        rest = [{k: v for k, v in g.items() if k != "muon"} for g in groups if not g.get("muon")]
        if not muon:
            raise OptimizerError("optimizer muon: the model has no hidden weight matrices for Muon")
        self.adamw = torch.optim.AdamW(rest, lr=lr, betas=betas, fused=fused)
        kind = CpuMuon if float32_ns else torch.optim.Muon
        self.muon = kind(muon, lr=lr, momentum=momentum, nesterov=True, adjust_lr_fn="original")

    @property
    def param_groups(self) -> list[dict]:
        # AdamW's first: the trainer logs group 0's lr
        return self.adamw.param_groups + self.muon.param_groups

    def add_param_group(self, group: dict) -> None:
        self.adamw.add_param_group(group)

    @torch.no_grad()
    def step(self, closure=None) -> None:
        self.adamw.step()
        self.muon.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.adamw.zero_grad(set_to_none=set_to_none)
        self.muon.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"adamw": self.adamw.state_dict(), "muon": self.muon.state_dict()}

    def load_state_dict(self, sd: dict) -> None:
        if set(sd) != {"adamw", "muon"}:
            raise ValueError("the checkpoint's optimizer state is not Muon+AdamW's; resume with the "
                             "optimizer the run was started with (--set optimizer=...)")
        self.adamw.load_state_dict(sd["adamw"])
        self.muon.load_state_dict(sd["muon"])


def build_optimizer(model, name: str, lr: float, weight_decay: float, betas: tuple[float, float],
                    device: torch.device, muon_lr: float = 0.02, muon_momentum: float = 0.95,
                    muon_weight_decay: float = 0.0):
    """AdamW over the model's decay/no-decay groups; fused kernel on CUDA and CPU (one launch per step instead
    of one per tensor). adamw8bit: bitsandbytes' 8-bit AdamW, CUDA only (Dettmers et al. 2022).
    muon: Muon at peak muon_lr for the hidden matrices, AdamW at lr for the rest (MuonAdamW)."""
    fused = device.type in ("cuda", "cpu")
    if name == "muon":
        try:
            groups = model.optim_groups(weight_decay, muon=True)
        except TypeError:
            raise OptimizerError(f"optimizer muon is for GPT models; {type(model).__name__} has per-module "
                                 f"groups of its own: use --set optimizer=adamw") from None
        for g in groups:
            if g.get("muon"):
                g.update(lr_scale=muon_lr / lr, weight_decay=muon_weight_decay)
        # a CPU without native bfloat16 emulates Muon's bfloat16 products: float32 is ~2.5x faster there
        float32_ns = device.type == "cpu" and not cpu_native_bf16()
        return MuonAdamW(groups, lr, betas, muon_momentum, fused, float32_ns)
    groups = model.optim_groups(weight_decay)
    if name == "adamw8bit":
        if device.type != "cuda":
            raise OptimizerError("optimizer adamw8bit needs a CUDA device and bitsandbytes; "
                                 "use --set optimizer=adamw")
        try:
            import bitsandbytes as bnb
        except ImportError as e:
            raise OptimizerError("optimizer adamw8bit needs bitsandbytes: pip install bitsandbytes") from e
        return bnb.optim.AdamW8bit(groups, lr=lr, betas=betas)
    return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=fused)
