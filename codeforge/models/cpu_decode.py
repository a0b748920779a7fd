"""One decoding step of a GPT on the CPU in numpy: the same arithmetic as GPT.forward, without PyTorch's
per-operation cost.

A decoding step feeds one token per sequence. Its products read every weight once (cpu_linear sends them to
OpenBLAS); what is left is some 40 operations a layer on vectors of a few hundred numbers: norms, rotary
turns, the residual adds, the MLP's activation, and attention of one query over the cache. PyTorch spends
4-40 us on each of them whatever its size (its dispatcher, TensorIterator setup, F.rms_norm as seven
operations) and its CPU attention kernel ~150-260 us a layer for one query; numpy spends ~1-3 us on such an
operation, and attention for one query is two small products and a softmax. At 128M parameters this was 14
of a ~45 ms token (docs/LOG.md#2026-11-25-numpy-decode-step).

`stepper(model, ...)` gives the engine and the server's scheduler a Stepper where it applies (`usable`): a
GPT whose forward is GPT's (the reward model's is) and whose every option set is one the step implements
(KNOWN_OPTIONS: a new option is refused, never ignored), on the CPU in float32, no gradient recorded, numpy's
OpenBLAS found, and $CODEFORGE_CPU_MATMUL not `torch` (which keeps every step in PyTorch). It reads and
writes the same KV cache as GPT.forward, with rows at their own positions behind the same padding mask, so a
prompt's prefill runs in PyTorch and the steps after it here; the logits agree with GPT.forward to float32
rounding (tests/test_cpu_decode.py compares both for every model option, and the engine's and the server's
greedy tokens).

The weights are numpy views of the parameters (no copy): an optimizer updating them in place is seen; a
replaced module or a parameter whose storage moved (model.to(), load_state_dict with assign) makes a new
Stepper (`stepper` compares before each step). A module of a class of its own (an adapter around a layer), a
forward hook, or a sharded parameter (FSDP's DTensors, which have no numpy view) leaves the step to PyTorch,
as does a model in training mode with dropout.
"""

from __future__ import annotations

import math
import weakref

import numpy as np
import torch
import torch.nn as nn

from .cpu_linear import Linear, backend, openblas_pays
from .gpt import GPT, MLP, Attention, Block, RMSNorm, unknown_options

GELU_C = math.sqrt(2.0 / math.pi)


# Every model option Stepper.step implements, with the values it implements (None: any value). A config field
# not listed here is an option the step has never heard of (a new attention variant, say): set to anything but
# its default it would be silently ignored, so the step is refused and PyTorch runs the model's own forward.
KNOWN_OPTIONS: dict[str, tuple | None] = {
    "arch": None, "vocab_size": None, "block_size": None, "n_layer": None, "tie_embeddings": None,
    "n_embd": None, "n_head": None, "n_kv_head": None, "ffn_hidden": None, "norm_eps": None,
    "rope_base": None,
    "qk_norm": None, "bias": None, "embd_dropout": None, "attn_dropout": None, "resid_dropout": None,
    "mlp": ("gelu", "swiglu", "relu2"), "norm": ("layernorm", "rmsnorm"), "pos": ("learned", "rope"),
}


def knows(cfg) -> bool:
    """Whether every option `cfg` sets is one Stepper.step implements (KNOWN_OPTIONS)."""
    if unknown_options(cfg, KNOWN_OPTIONS):
        return False
    return all(allowed is None or getattr(cfg, name, None) in allowed
               for name, allowed in KNOWN_OPTIONS.items())


def usable(model: nn.Module, device: torch.device, precision: str) -> bool:
    """Whether Stepper can run `model`'s decoding steps (see the module's docstring)."""
    if not isinstance(model, GPT) or type(model).forward is not GPT.forward or not knows(model.cfg):
        return False
    dropout = model.training and any((model.cfg.embd_dropout, model.cfg.attn_dropout,
                                      model.cfg.resid_dropout))
    return (device.type == "cpu" and precision == "fp32" and not torch.is_grad_enabled() and not dropout
            and model.wte.weight.dtype == torch.float32 and backend() == "openblas")


# one per model, kept beside it (not on it: a deepcopy of the model must not copy the views, nor a cycle keep
# the weights)
_STEPPERS: "weakref.WeakKeyDictionary[nn.Module, Stepper]" = weakref.WeakKeyDictionary()


def stepper(model: nn.Module, device: torch.device, precision: str, rows: int = 1) -> "Stepper | None":
    """The model's Stepper for a step of `rows` sequences, where `usable` and where OpenBLAS pays for the
    products (cpu_linear.openblas_pays: one row, or a model mostly in large matrices; a small model's 8-row
    products ran faster in PyTorch's threads: 445-475 tokens/s against 780 for a 3.4M model,
    docs/LOG.md#2026-11-25-numpy-step-batch-8); else None, and PyTorch runs the step. Made again when a module
    or a weight the step reads is not the one it was made from (a replaced layer, model.to(), load_state_dict
    with assign); never where a module is of a class of its own, has a hook, or holds a sharded (FSDP)
    parameter: the step would not be the module's forward."""
    if not usable(model, device, precision) or not openblas_pays(model, rows):
        _STEPPERS.pop(model, None)  # no views left holding weights the model no longer uses
        return None
    now = fingerprint(model)
    st = _STEPPERS.get(model)
    if now is None:
        _STEPPERS.pop(model, None)
        return None
    if st is None or st.held != now:
        st = _STEPPERS[model] = Stepper(model)
        st.held = now
    return st


def _read(m: GPT):
    """(module, the class it must be) for every module the step reads, in the step's order."""
    norm = RMSNorm if m.cfg.norm == "rmsnorm" else nn.LayerNorm
    yield m, type(m)
    yield m.wte, nn.Embedding
    if m.wpe is not None:
        yield m.wpe, nn.Embedding
    for b in m.blocks:
        yield from ((b, Block), (b.ln_1, norm), (b.attn, Attention), (b.attn.c_attn, Linear),
                    (b.attn.c_proj, Linear), (b.ln_2, norm), (b.mlp, MLP), (b.mlp.c_fc, Linear),
                    (b.mlp.c_proj, Linear))
        if b.attn.q_norm is not None:
            yield from ((b.attn.q_norm, norm), (b.attn.k_norm, norm))
    yield m.ln_f, norm
    yield m.lm_head, Linear


def fingerprint(m: GPT) -> tuple | None:
    """The identity and storage of every module and tensor the step reads, or None where the step cannot
    stand in for forward: a module of another class, a forward hook, a tensor that is not a plain one."""
    if nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks:
        return None
    out = []
    for mod, kind in _read(m):
        if type(mod) is not kind or mod._forward_hooks or mod._forward_pre_hooks:
            return None
        for t in (*mod._parameters.values(), *mod._buffers.values()):
            if t is not None:
                if type(t.data) is not torch.Tensor:
                    return None
                out.append((id(mod), id(t), t.data_ptr()))
    return tuple(out)


def _np(t: torch.Tensor | None) -> np.ndarray | None:
    return None if t is None else t.detach().numpy()


class Stepper:
    """step(ids (B,) tensor, cache) -> logits (B, 1, vocab), one token per row at position cache.len. Its
    inputs are the engine's and the server's (valid ids and positions, a boolean mask in which every row
    sees at least its own key); `stepper` decides where it may run."""

    def __init__(self, model: GPT):
        self.cfg = model.cfg
        self.held: tuple | None = None  # stepper(): the fingerprint of what it was made from
        self._bind(model)

    def _bind(self, m: GPT) -> None:
        """numpy views of every weight, per layer (no reference to the model itself)."""
        cfg = self.cfg

        def norm(mod):
            return (_np(mod.weight), _np(getattr(mod, "bias", None)), mod.eps)

        def lin(mod):
            return _np(mod.weight), _np(mod.bias)

        self.wte, self.wpe = _np(m.wte.weight), _np(m.wpe.weight) if m.wpe is not None else None
        self.cos = _np(m.rope_cos) if cfg.pos == "rope" else None
        self.sin = _np(m.rope_sin) if cfg.pos == "rope" else None
        self.layers = []
        for b in m.blocks:
            a = b.attn
            self.layers.append(dict(
                ln_1=norm(b.ln_1), ln_2=norm(b.ln_2), qkv=lin(a.c_attn), proj=lin(a.c_proj),
                q_norm=norm(a.q_norm) if a.q_norm is not None else None,
                k_norm=norm(a.k_norm) if a.k_norm is not None else None,
                fc=lin(b.mlp.c_fc), fc_proj=lin(b.mlp.c_proj)))
        self.ln_f = norm(m.ln_f)
        self.head = _np(m.lm_head.weight)

    def _norm(self, x: np.ndarray, p) -> np.ndarray:
        w, b, eps = p
        if self.cfg.norm == "rmsnorm":
            ms = np.add.reduce(x * x, axis=-1, keepdims=True) / x.shape[-1]
            return x * (1.0 / np.sqrt(ms + np.float32(eps))) * w
        d = x - np.add.reduce(x, axis=-1, keepdims=True) / x.shape[-1]
        var = np.add.reduce(d * d, axis=-1, keepdims=True) / x.shape[-1]
        y = d * (1.0 / np.sqrt(var + np.float32(eps))) * w
        return y + b if b is not None else y

    @staticmethod
    def _linear(x: np.ndarray, p) -> np.ndarray:
        w, b = p
        y = np.matmul(x, w.T)
        if b is not None:
            y += b
        return y

    def step(self, ids: torch.Tensor, cache, starts: list[int] | None = None) -> torch.Tensor:
        """Logits (B, 1, vocab) for ids (B,) or (B, 1), one token per row, written to the cache (a KVCache, or
        any object with per-layer .k/.v lists of (B, n_kv_head, length, head_dim) and .len) at column
        cache.len, as GPT.forward does. starts: each row's first real column, as GPT.forward's: a row's
        position is counted from it and the keys before it are hidden (default: every row starts at 0)."""
        cfg = self.cfg
        B, col = ids.shape[0], cache.len
        if col + 1 > cfg.block_size:
            raise ValueError(f"sequence of {col + 1} tokens exceeds the model's context of {cfg.block_size}")
        H, KV, hd = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        G, half, scale = H // KV, hd // 2, np.float32(1.0 / math.sqrt(hd))
        first = np.asarray(starts).reshape(B) if starts is not None and any(starts) else None
        at = np.full(B, col) if first is None else col - first
        x = self.wte[ids.reshape(B).numpy()]  # (B, C), a copy
        if self.wpe is not None:
            x += self.wpe[at]
        cos = self.cos[at][:, None, :] if self.cos is not None else None  # (B, 1, hd)
        sin = self.sin[at][:, None, :] if self.sin is not None else None
        # the columns before each row's start (gpt.attention_mask's rule for one query at column col)
        hidden = (
            None
            if first is None
            else (np.arange(col + 1)[None, :] < first[:, None]).reshape(B, 1, 1, col + 1)
        )
        for i, L in enumerate(self.layers):
            h = self._linear(self._norm(x, L["ln_1"]), L["qkv"]).reshape(B, H + 2 * KV, hd)
            v = h[:, H + KV:]
            if L["q_norm"] is not None:
                qk = np.concatenate([self._norm(h[:, :H], L["q_norm"]),
                                     self._norm(h[:, H:H + KV], L["k_norm"])],
                                    axis=1)
            else:
                qk = h[:, :H + KV]
            if cos is not None:  # rotate-half: x cos + [x2, x1] sin (rope_tables negates sin's first half)
                qk = qk * cos + np.concatenate([qk[..., half:], qk[..., :half]], axis=-1) * sin
            kc, vc = cache.k[i].numpy(), cache.v[i].numpy()  # (B, KV, length, hd)
            kc[:, :, col] = qk[:, H:]
            vc[:, :, col] = v
            q = qk[:, :H].reshape(B, KV, G, hd)  # query head j reads key head j // G, as SDPA's enable_gqa
            s = np.matmul(q, kc[:, :, :col + 1].transpose(0, 1, 3, 2))  # (B, KV, G, col + 1)
            s *= scale
            if hidden is not None:
                np.copyto(s, -np.inf, where=hidden)
            s -= s.max(axis=-1, keepdims=True)
            np.exp(s, out=s)
            s /= np.add.reduce(s, axis=-1, keepdims=True)
            y = np.matmul(s, vc[:, :, :col + 1]).reshape(B, H * hd)
            x = x + self._linear(y, L["proj"])
            f = self._linear(self._norm(x, L["ln_2"]), L["fc"])
            if cfg.mlp == "swiglu":
                g, u = f[:, :cfg.ffn_hidden], f[:, cfg.ffn_hidden:]
                f = g * (0.5 + 0.5 * np.tanh(0.5 * g)) * u  # silu(g) = g sigmoid(g), without exp's overflow
            elif cfg.mlp == "relu2":
                f = np.maximum(f, 0)
                f *= f
            else:
                f = 0.5 * f * (1.0 + np.tanh(np.float32(GELU_C) * (f + np.float32(0.044715) * f * f * f)))
            x = x + self._linear(f, L["fc_proj"])
        cache.len += 1
        logits = np.matmul(self._norm(x, self.ln_f), self.head.T)
        return torch.from_numpy(logits).view(B, 1, -1)
