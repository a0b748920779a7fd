"""One GPT whose config covers GPT-2 and Llama/Qwen: norm, positions, MLP, GQA, QK-norm, tying, bias, dropout.

GPT-2 (Radford et al. 2019): LayerNorm, learned positions, GELU MLP, bias, tied embeddings.
Llama/Qwen (Touvron et al. 2023; Qwen2 2024): RMSNorm, rotary positions (Su et al. 2021), SwiGLU MLP
(Shazeer 2020), grouped-query attention (Ainslie et al. 2023), no bias. ReLU^2 (So et al. 2021) and
QK-norm (Dehghani et al. 2023) are options. Attention runs through PyTorch SDPA (flash / memory-efficient
kernels where the device has them).

The surface every model in codeforge shares:
  forward(idx, targets=None, kv_cache=None, starts=None, loss_reduction="mean") -> logits
  (B, T, vocab), or the cross-entropy loss when targets are given (targets == -1 are ignored;
  models/lm_loss.py), or (GPT; return_hidden=True) the final hidden states;
  num_params(); flops_per_token(); optim_groups(weight_decay); new_kv_cache(...); context_length.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..device import attention_backends
from ..fields import ConfigError, saved, setting
from .cpu_linear import Linear
from .lm_loss import lm_loss


@dataclass
class BlockConfig:
    """What one transformer block is made of: width, heads, MLP, norm, positions, dropout. Every model built
    from gpt.Block (GPT, the reward model, HRM's three stacks) declares these fields here, once."""
    n_embd: int = setting(768, "model width", range=(16, 16_384))
    n_head: int = setting(12, "attention heads", range=(1, 256))
    n_kv_head: int = setting(0, "key/value heads (fewer than n_head: grouped-query attention)",
                             range=(1, 256), zero_means="n_head")
    mlp: str = setting("gelu", "MLP activation", choices=("gelu", "swiglu", "relu2"))
    ffn_hidden: int = setting(0, "MLP hidden width", range=(1, 1 << 20),
                              zero_means="4 x n_embd (gelu, relu2) or 8/3 x n_embd rounded up to 64 (swiglu)")
    norm: str = setting("layernorm", "normalisation", choices=("layernorm", "rmsnorm"))
    norm_eps: float = setting(1e-5, "normalisation epsilon", range=(0.0, 1.0))
    pos: str = setting("learned", "positions: learned table or rotary", choices=("learned", "rope"))
    rope_base: float = setting(10000.0, "rotary base (theta)", range=(1.0, 1e9))
    qk_norm: bool = setting(False, "normalise queries and keys per head")
    bias: bool = setting(True, "biases in linear layers and LayerNorm")
    embd_dropout: float = setting(0.0, "dropout after the embedding", range=(0.0, 0.9))
    attn_dropout: float = setting(0.0, "dropout on attention weights", range=(0.0, 0.9))
    resid_dropout: float = setting(0.0, "dropout on residual branches", range=(0.0, 0.9))

    def __post_init__(self) -> None:
        if not self.n_kv_head:
            self.n_kv_head = self.n_head
        if not self.ffn_hidden:
            self.ffn_hidden = (
                4 * self.n_embd if self.mlp != "swiglu" else 64 * math.ceil(8 * self.n_embd / 3 / 64)
            )

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def block_fields(self) -> dict:
        """This config's BlockConfig fields (what a stack of Blocks needs from it)."""
        return {f.name: getattr(self, f.name) for f in fields(BlockConfig)}


@dataclass
class GPTConfig(BlockConfig):
    arch: str = setting("gpt", "model architecture (the registry key, saved in checkpoints)",
                        choices=("gpt",))
    vocab_size: int = setting(50304, "model vocabulary", range=(256, 200_000),
                              zero_means="the data's tokenizer, padded to a multiple of 64")
    block_size: int = setting(1024, "context length in tokens", range=(8, 131_072))
    n_layer: int = setting(12, "transformer blocks", range=(1, 256))
    tie_embeddings: bool = setting(True, "share the input embedding with the output matrix")

    # the key order of the model section in saved files (fields.saved), from before BlockConfig was shared
    SAVED_ORDER = ("arch", "vocab_size", "block_size", "n_layer", "n_head", "n_embd", "n_kv_head", "mlp",
                   "ffn_hidden", "norm", "norm_eps", "pos", "rope_base", "qk_norm", "tie_embeddings", "bias",
                   "embd_dropout", "attn_dropout", "resid_dropout")

    def to_dict(self) -> dict:
        return saved(self, self.SAVED_ORDER)

    @classmethod
    def from_dict(cls, d: dict) -> "GPTConfig":
        names = {f.name for f in fields(cls)}
        d = {"arch": "gpt", **d}  # checkpoints from before the registry have no arch
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"unknown model config keys {sorted(unknown)}; known: {sorted(names)}")
        return cls(**d)


def unknown_options(cfg, known) -> list[str]:
    """The options of `cfg` (a config dataclass) set to anything but their default that are not in `known`:
    what a reader of the config that knows only `known` would silently ignore (the numpy decoding step, the
    exporters). A new option left at its default is no reason to refuse."""
    return [f.name for f in fields(cfg) if f.name not in known
            and (f.default is MISSING or getattr(cfg, f.name) != f.default)]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.size(-1),), self.weight, self.eps)


def make_norm(cfg: GPTConfig, dim: int) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return RMSNorm(dim, cfg.norm_eps)
    return nn.LayerNorm(dim, eps=cfg.norm_eps, bias=cfg.bias)


def rope_tables(head_dim: int, length: int, base: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding tables (rotate-half convention: dimension i turns with i + head_dim/2), both of shape
    (length, head_dim): cos repeated over the two halves, and sin negated on the first half, so that
    apply_rope is two products and a sum. The angles themselves are cos[:, :hd/2] and sin[:, hd/2:]."""
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    ang = torch.outer(torch.arange(length, device=device, dtype=torch.float32), inv)
    cos, sin = ang.cos(), ang.sin()
    return torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, heads, T, head_dim) rotated: [x1 cos - x2 sin, x2 cos + x1 sin] for halves x1, x2; cos/sin
    (B or 1, 1, T, head_dim) from rope_tables. Three operations where the halves took eight (a decoding step
    runs this 24 times at 12 layers)."""
    xf = x.float()
    return torch.addcmul(xf * cos, xf.roll(x.size(-1) // 2, dims=-1), sin).type_as(x)


@torch.no_grad()
def init_gpt2(m: nn.Module, depth: int, std: float = 0.02, keep: nn.Module | None = None) -> None:
    """GPT-2's initialisation of one module (Radford et al. 2019, section 2.3): Linear and Embedding weights
    N(0, std), a projection into the residual stream N(0, std / sqrt(2 * depth)) so the stream's variance
    does not grow with the `depth` branches it sums, biases 0, norm gains 1. keep: a module whose weight is
    another's (a tied head), left as it is."""
    if isinstance(m, nn.Linear):
        if m is not keep:
            nn.init.normal_(m.weight, 0.0,
                            std / math.sqrt(2 * depth) if getattr(m, "residual", False) else std)
        if m.bias is not None:
            nn.init.zeros_(m.bias)
    elif isinstance(m, nn.Embedding):
        nn.init.normal_(m.weight, 0.0, std)
    elif isinstance(m, (nn.LayerNorm, RMSNorm)):
        nn.init.ones_(m.weight)
        if getattr(m, "bias", None) is not None:
            nn.init.zeros_(m.bias)


@torch.no_grad()
def refresh_rope(module: nn.Module, cfg: BlockConfig, device) -> None:
    """A rotary module's cos/sin buffers computed again (they are not saved: after to_empty() they hold
    nothing)."""
    if cfg.pos == "rope":
        cos, sin = rope_tables(cfg.head_dim, cfg.block_size, cfg.rope_base, device=device)
        module.rope_cos.copy_(cos)
        module.rope_sin.copy_(sin)


class KVCache:
    """Keys and values of every layer for up to `max_len` positions: (B, n_kv_head, max_len, head_dim)
    each."""

    def __init__(self, cfg: GPTConfig, batch: int, max_len: int, device, dtype):
        shape = (batch, cfg.n_kv_head, max_len, cfg.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layer)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layer)]
        self.len = 0  # positions filled so far (the same for every row)
        self.max_len = max_len


def attention_mask(T: int, cached: int, starts: list[int] | None, device) -> torch.Tensor | None:
    """Which keys each of T new queries may attend to, after `cached` positions already in the cache: a bool
    mask (B|1, 1|-, T, cached + T), True where allowed, or None where SDPA's own causal mask is the one.

    starts: per row, the column of its first real token (rows left-padded to one length, or rows that joined
    a shared cache late); None or all 0 when every row starts at column 0. A query sees the keys from its
    row's start up to itself; a query in the padding before its row's start sees only itself, so its softmax
    stays finite (its output is never read)."""
    L = cached + T
    if starts is None or not any(starts):
        if cached == 0 or T == 1:  # from the start, or one query that sees every key: nothing to hide
            return None
        # a chunk after a cached prefix: query i sees the whole prefix and the new keys up to itself
        return torch.ones(T, L, dtype=torch.bool, device=device).tril(diagonal=cached)
    first = torch.tensor(starts, device=device)[:, None, None, None]  # (B, 1, 1, 1)
    cols = torch.arange(L, device=device)
    rows = torch.arange(cached, L, device=device)[:, None]  # each query's own column, (T, 1)
    return ((cols <= rows) & (cols >= first)) | (cols == rows)


def positions(T: int, cached: int, starts: list[int] | None, device) -> torch.Tensor:
    """The positions of T new tokens after `cached` columns: (1, T) cached.., or with `starts` (B, T) each
    row's own, counted from its first real token (0 in its padding)."""
    cols = torch.arange(cached, cached + T, device=device).unsqueeze(0)
    if starts is None or not any(starts):
        return cols
    return (cols - torch.tensor(starts, device=device).unsqueeze(1)).clamp(min=0)


def sdpa_under(backends: list, q, k, v, **kw) -> torch.Tensor:
    """scaled_dot_product_attention restricted to `backends` (tried in that order). A single forced backend
    that cannot run this call (its dtype, head size, mask or dropout) fails naming --attention, not with
    PyTorch's "No available kernel"."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(backends, set_priority=True):
        try:
            return F.scaled_dot_product_attention(q, k, v, **kw)
        except RuntimeError as e:
            if len(backends) > 1 or backends[0] == SDPBackend.MATH:
                raise
            name = {SDPBackend.CUDNN_ATTENTION: "cudnn", SDPBackend.FLASH_ATTENTION: "flash",
                    SDPBackend.EFFICIENT_ATTENTION: "efficient"}.get(backends[0], str(backends[0]))
            raise ConfigError(
                f"--attention (train.attention) {name} cannot run this attention on {q.device} ({q.dtype}, "
                f"head size {q.shape[-1]}, {'a mask' if kw.get('attn_mask') is not None else 'causal'}"
                f"{', dropout' if kw.get('dropout_p') else ''}); pick --attention auto (PyTorch's choice) or "
                f"math. PyTorch said: {str(e).strip().splitlines()[0]}") from e


def set_attention(model: nn.Module, requested: str, device) -> str:
    """Run every attention layer of `model` (GPT, the reward model, HRM: any built from Block) with the SDPA
    kernels --attention names for `device` (device.attention_backends; a kernel the device lacks is refused
    here). The reason, for the run's log."""
    backends, why = attention_backends(torch.device(device), requested)
    for m in model.modules():
        if isinstance(m, Attention):
            m.sdpa_backends = None if backends is None else list(backends)
    return f"attention: {requested} ({why})"


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig, layer: int):
        super().__init__()
        if cfg.n_embd % cfg.n_head or cfg.n_head % cfg.n_kv_head:
            raise ValueError(f"n_embd {cfg.n_embd} must divide by n_head {cfg.n_head}, and n_head by "
                             f"n_kv_head {cfg.n_kv_head}")
        self.cfg, self.layer = cfg, layer
        hd = cfg.head_dim
        self.c_attn = Linear(cfg.n_embd, (cfg.n_head + 2 * cfg.n_kv_head) * hd, bias=cfg.bias)
        self.c_proj = Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.c_proj.residual = True  # scaled at init
        self.q_norm = make_norm(cfg, hd) if cfg.qk_norm else None
        self.k_norm = make_norm(cfg, hd) if cfg.qk_norm else None
        self.resid_drop = nn.Dropout(cfg.resid_dropout)
        # the SDPA kernels, in priority order, or None for PyTorch's choice: a runtime choice (set_attention,
        # from --attention), not architecture, so no checkpoint records it
        self.sdpa_backends: list | None = None

    def forward(self, x, rope, kv_cache: KVCache | None, attn_mask):
        B, T, C = x.shape
        cfg, hd = self.cfg, self.cfg.head_dim
        H, KV = cfg.n_head, cfg.n_kv_head
        # (B, q heads + k heads + v heads, T, hd)
        heads = self.c_attn(x).view(B, T, H + 2 * KV, hd).transpose(1, 2)
        # split, not slices: the backward of a split is one concatenation, where each slice's backward fills a
        # gradient the size of `heads` with zeros and adds them up (docs/LOG.md#2026-11-27-qkv-split)
        if self.q_norm is not None:
            q, k, v = heads.split([H, KV, KV], dim=1)
            q, k = self.q_norm(q), self.k_norm(k)
            if rope is not None:
                q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        else:  # queries and keys turned in one go
            qk, v = heads.split([H + KV, KV], dim=1)
            q, k = (qk if rope is None else apply_rope(qk, *rope)).split([H, KV], dim=1)
        if kv_cache is not None:
            start = kv_cache.len
            kv_cache.k[self.layer][:, :, start:start + T] = k
            kv_cache.v[self.layer][:, :, start:start + T] = v
            k = kv_cache.k[self.layer][:, :, :start + T]
            v = kv_cache.v[self.layer][:, :, :start + T]
        # attn_mask None: plain causal attention from column 0 (the model builds every other mask, once per
        # forward, in attention_mask)
        is_causal = attn_mask is None and T > 1
        kw = dict(attn_mask=attn_mask, is_causal=is_causal, enable_gqa=cfg.n_kv_head != cfg.n_head,
                  dropout_p=cfg.attn_dropout if self.training else 0.0)
        if self.sdpa_backends is None:  # PyTorch's own choice of kernel (--attention auto off Hopper)
            y = F.scaled_dot_product_attention(q, k, v, **kw)
        else:
            y = sdpa_under(self.sdpa_backends, q, k, v, **kw)
        y = y.transpose(1, 2).reshape(B, T, C)  # (B, T, n_embd)
        return self.resid_drop(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.kind = cfg.mlp
        if cfg.mlp not in ("gelu", "swiglu", "relu2"):
            raise ValueError(f"mlp {cfg.mlp!r} is not one of gelu, swiglu, relu2")
        width = cfg.ffn_hidden * (2 if cfg.mlp == "swiglu" else 1)  # swiglu: gate and up in one matmul
        self.c_fc = Linear(cfg.n_embd, width, bias=cfg.bias)
        self.c_proj = Linear(cfg.ffn_hidden, cfg.n_embd, bias=cfg.bias)
        self.c_proj.residual = True
        self.drop = nn.Dropout(cfg.resid_dropout)

    def forward(self, x):
        h = self.c_fc(x)
        if self.kind == "swiglu":
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        elif self.kind == "relu2":
            h = F.relu(h).square()
        else:
            h = F.gelu(h, approximate="tanh")
        return self.drop(self.c_proj(h))


class Block(nn.Module):
    @staticmethod
    def shapes(cfg: GPTConfig, prefix: str = "") -> dict[str, tuple[int, ...]]:
        """The names and shapes of a Block's state dict (under `prefix`), from the config alone: what
        checkpoint/guard.py compares a weights file with before anything is built. Equal to the built
        module's (tests/test_hostile_inputs.py checks it for every option)."""
        C, hd = cfg.n_embd, cfg.head_dim
        out: dict[str, tuple[int, ...]] = {}

        # make_norm: RMSNorm has a gain only, LayerNorm a bias with bias
        def norm(name: str, dim: int) -> None:
            out[f"{prefix}{name}.weight"] = (dim,)
            if cfg.norm == "layernorm" and cfg.bias:
                out[f"{prefix}{name}.bias"] = (dim,)

        def linear(name: str, n_out: int, n_in: int) -> None:
            out[f"{prefix}{name}.weight"] = (n_out, n_in)
            if cfg.bias:
                out[f"{prefix}{name}.bias"] = (n_out,)

        norm("ln_1", C)
        linear("attn.c_attn", (cfg.n_head + 2 * cfg.n_kv_head) * hd, C)
        linear("attn.c_proj", C, C)
        if cfg.qk_norm:
            norm("attn.q_norm", hd)
            norm("attn.k_norm", hd)
        norm("ln_2", C)
        linear("mlp.c_fc", cfg.ffn_hidden * (2 if cfg.mlp == "swiglu" else 1), C)
        linear("mlp.c_proj", C, cfg.ffn_hidden)
        return out

    def __init__(self, cfg: GPTConfig, layer: int):
        super().__init__()
        self.ln_1 = make_norm(cfg, cfg.n_embd)
        self.attn = Attention(cfg, layer)
        self.ln_2 = make_norm(cfg, cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x, rope=None, kv_cache=None, attn_mask=None):
        x = x + self.attn(self.ln_1(x), rope, kv_cache, attn_mask)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    @staticmethod
    def shapes(cfg: GPTConfig) -> tuple[dict[str, tuple[int, ...]], list[list[str]]]:
        """({state-dict name: shape}, groups of names that are one tensor) of GPT(cfg), from the config alone
        (Block.shapes); a tied lm_head is the embedding."""
        out = {"wte.weight": (cfg.vocab_size, cfg.n_embd)}
        if cfg.pos == "learned":
            out["wpe.weight"] = (cfg.block_size, cfg.n_embd)
        for i in range(cfg.n_layer):
            out.update(Block.shapes(cfg, f"blocks.{i}."))
        out["ln_f.weight"] = (cfg.n_embd,)
        if cfg.norm == "layernorm" and cfg.bias:
            out["ln_f.bias"] = (cfg.n_embd,)
        out["lm_head.weight"] = (cfg.vocab_size, cfg.n_embd)
        tied = [["wte.weight", "lm_head.weight"]] if cfg.tie_embeddings else []
        return out, tied

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.pos not in ("learned", "rope") or cfg.norm not in ("layernorm", "rmsnorm"):
            raise ValueError(
                f"pos must be learned|rope and norm layernorm|rmsnorm, got {cfg.pos}, {cfg.norm}")
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd) if cfg.pos == "learned" else None
        self.drop = nn.Dropout(cfg.embd_dropout)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layer))
        self.ln_f = make_norm(cfg, cfg.n_embd)
        self.lm_head = Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        if cfg.pos == "rope":
            cos, sin = rope_tables(cfg.head_dim, cfg.block_size, cfg.rope_base)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        self.grad_checkpointing = False
        self.loss_chunk_rows = 0  # > 0: fused chunked lm_head + cross-entropy in training (lm_loss)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2 initialisation: every Linear and Embedding weight N(0, 0.02), biases 0, norms 1, and the
        projections that write into the residual stream N(0, 0.02 / sqrt(2 * n_layer)) so the stream's
        variance does not grow with depth (Radford et al. 2019, section 2.3)."""
        tied = self.lm_head if self.cfg.tie_embeddings else None  # its weight is the embedding's, drawn once
        for m in self.modules():
            init_gpt2(m, self.cfg.n_layer, keep=tied)
        refresh_rope(self, self.cfg, self.wte.weight.device)

    # -- the shared surface -------------------------------------------------------------------------------
    @property
    def context_length(self) -> int:
        return self.cfg.block_size

    def new_kv_cache(self, batch: int, max_len: int, device, dtype) -> KVCache:
        """An empty cache for `batch` rows of up to `max_len` positions (the engine asks; it never builds
        one)."""
        return KVCache(self.cfg, batch, max_len, device, dtype)

    def num_params(self, non_embedding: bool = False) -> int:
        """Exact count of distinct parameters (a tied lm_head counts once)."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.wte.weight.numel() + (self.wpe.weight.numel() if self.wpe is not None else 0)
        return n

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs per token: 6 per weight-matrix parameter (forward 2, backward 4, Kaplan et al. 2020)
        including the lm_head matmul even when tied, plus attention scores and values: 6 * 2 * n_layer *
        n_embd * T (forward 2*2*T*C per layer, backward twice that). Position embeddings are lookups."""
        T = seq_len or self.cfg.block_size
        n = self.num_params() - (self.wpe.weight.numel() if self.wpe is not None else 0)
        if not self.cfg.tie_embeddings:
            n -= self.wte.weight.numel()  # the input lookup is free; lm_head is the matmul counted
        return 6 * n + 12 * self.cfg.n_layer * self.cfg.n_embd * T

    def optim_groups(self, weight_decay: float, muon: bool = False) -> list[dict]:
        """Matrices (dim >= 2: linear weights, embeddings) decay; biases and norm gains do not. muon: the
        blocks' weight matrices form a third group marked "muon" (embeddings, the output head and any head a
        subclass adds stay with AdamW). Every parameter is in exactly one group (asserted)."""
        params = {n: p for n, p in self.named_parameters() if p.requires_grad}
        # LoRA's low-rank factors (models/lora.py) stay with AdamW: Muon's orthogonalised steps are for full
        # matrices
        hidden = ({id(p) for n, p in self.blocks.named_parameters() if p.dim() == 2 and ".lora_" not in n}
                  if muon else set())
        matrices = [p for p in params.values() if p.dim() == 2 and id(p) in hidden]
        decay = [p for p in params.values() if p.dim() >= 2 and id(p) not in hidden]
        no_decay = [p for p in params.values() if p.dim() < 2]
        assert len(matrices) + len(decay) + len(no_decay) == len(params), (
            "a parameter is in no optimizer group")
        groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        return groups + ([{"params": matrices, "weight_decay": weight_decay, "muon": True}] if muon else [])

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, kv_cache: KVCache | None = None,
                starts: list[int] | None = None, last_only: bool = False, loss_reduction: str = "mean",
                return_hidden: bool = False):
        """idx (B, T) token ids, written after what kv_cache holds (if given).
        starts: per row, the cache column of its first real token, for rows that do not start at column 0
        (left-padded prompts, rows that joined a shared cache late); the model then counts each row's
        positions from its start and hides the keys before it (attention_mask, positions).
        last_only: logits of the last position only, (B, 1, vocab) (generation needs no more).
        With targets: the mean loss over targets != -1, or (B, T) per-token losses with loss_reduction="none"
        (evaluation uses that, so it shares this one loss path).
        return_hidden: the final normalised hidden states (B, T, n_embd) instead of logits, for a head of
        one's own (the reward model's score, PPO's value head); the logits are F.linear(h, lm_head.weight)."""
        B, T = idx.shape
        start = kv_cache.len if kv_cache is not None else 0
        if start + T > self.cfg.block_size:
            raise ValueError(f"sequence of {start + T} tokens exceeds the model's context of "
                             f"{self.cfg.block_size}")
        pos = positions(T, start, starts, idx.device)
        attn_mask = attention_mask(T, start, starts, idx.device)
        x = self.wte(idx)  # (B, T, n_embd)
        rope = None
        if self.wpe is not None:
            x = x + self.wpe(pos)
        else:
            rope = (self.rope_cos[pos].unsqueeze(1), self.rope_sin[pos].unsqueeze(1))  # (B|1, 1, T, hd)
        x = self.drop(x)
        for block in self.blocks:
            if self.grad_checkpointing and self.training and kv_cache is None:
                x = torch.utils.checkpoint.checkpoint(block, x, rope, None, attn_mask, use_reentrant=False)
            else:
                x = block(x, rope, kv_cache, attn_mask)
        if kv_cache is not None:
            kv_cache.len += T
        if return_hidden:
            return self.ln_f(x)
        if targets is None:
            return self.lm_head(self.ln_f(x[:, -1:] if last_only else x))
        x = self.ln_f(x)
        return lm_loss(x, self.lm_head.weight, targets, self.loss_chunk_rows if self.training else 0,
                       reduction=loss_reduction)
