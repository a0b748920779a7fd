"""Hugging Face format: export a codeforge GPT to the transformers class that computes the same function, and
import one back.

Which class. codeforge's one GPT covers several families by config (models/gpt.py); each maps to the
transformers class with exactly those features, or is refused with the list of what does not map:

  learned positions, LayerNorm, GELU (tanh), MHA        -> GPT2LMHeadModel (Conv1D: weights transposed; a
                                                           model without biases gets zero biases)
  RoPE, RMSNorm, SwiGLU                                 -> LlamaForCausalLM (bias: attention_bias + mlp_bias)
     ... with biases on q/k/v only (the others zero)    -> Qwen2ForCausalLM
     ... with QK-norm (RMSNorm per head, before RoPE)   -> Qwen3ForCausalLM
  RoPE, RMSNorm, non-gated GELU (tanh) or ReLU^2 MLP    -> ArceeForCausalLM (hidden_act gelu_pytorch_tanh |
                                                           relu2), the seed-003 presets
GQA, tied or untied embeddings and the RoPE base carry over as config fields.

Key maps. One literal table per family (KEYS below): codeforge name -> Hugging Face name(s). Where codeforge
fuses what Hugging Face keeps apart, the entry names the parts and the split is explicit:
  attn.c_attn  (q | k | v rows: n_head*hd, n_kv_head*hd, n_kv_head*hd)  -> q_proj, k_proj, v_proj
  mlp.c_fc     (swiglu: gate | up rows, ffn_hidden each)                -> gate_proj, up_proj
GPT-2's attention stays fused (its c_attn has the same q | k | v order) and its Conv1D stores (in, out).

Parity is the contract (tests/test_export.py): float32 logits equal to 1e-4, greedy generation equal, the
tokenizer's ids and chat rendering equal. The export and import commands check the logits themselves when
transformers is installed.

Import reads a directory that may come from anyone, so before building anything it checks (with
checkpoint/guard.py) that every file in it is a regular file and no link leads
out of it (a link's target would
be copied into the run and every checkpoint and export after it; the hub cache's snapshots/REV -> ../../blobs
links are the one exception), that every config value the model takes is of its type and in codeforge's
declared range, that the weights' safetensors headers parse, and that the model fits in the memory there is.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from . import ExportError, check_out
from .hub import model_source
from ..atomic import publish, staging_dir
from ..checkpoint import load_model, save_checkpoint
from ..checkpoint.guard import (CONFIG_BYTES, available_memory, check_inside, check_memory, check_regular,
                                declared_shapes, dims, header_bytes, model_config_from, read_json,
                                safetensors_header)
from ..config import TrainConfig
from ..models import build_model, state_shapes
from ..models.gpt import GPTConfig, unknown_options
from ..fim import FIM_FILE_SEP, FIM_REPO
from ..tokenizer import (CodeTokenizer, META_FILE, SPECIAL_TOKENS, TOKENIZER_FILE, TokenizerError,
                         write_hf_config)
from .families import EXPORTED_OPTIONS, FAMILIES, expand, splits

# -- families ------------------------------------------------------------------------------------------------


class Family:
    """One transformers class as a model is exported to it: the family's record (families.FAMILIES), the
    activation this model's config.json names, and the config fields it needs (attention_bias, ...)."""

    def __init__(self, model_type: str, hidden_act: str | None = None, **extra):
        self.record = FAMILIES[model_type]
        self.name, self.model_type, self.keys = self.record.hf_class, model_type, self.record.hf_keys
        self.hidden_act, self.extra = hidden_act or self.record.hidden_act, extra

    def __repr__(self) -> str:
        return f"{self.name} ({self.model_type})"


def _nonzero(sd: dict[str, torch.Tensor], suffixes: tuple[str, ...]) -> list[str]:
    return [k for k, v in sd.items() if k.endswith(suffixes) and bool(v.detach().abs().max() > 0)]


ACTS = {"gelu": "gelu_pytorch_tanh", "relu2": "relu2", "swiglu": "silu"}


def choose_family(m: GPTConfig, sd: dict[str, torch.Tensor] | None = None) -> Family:
    """The transformers class that computes exactly what model config `m` (with weights `sd`, which decide
    between Llama and Qwen2 when there are biases) computes; ExportError listing every feature that does
    not map otherwise."""
    sd = sd or {}
    why: list[str] = []
    if m.arch != "gpt":
        raise ExportError(f"model arch {m.arch!r} has no Hugging Face counterpart; only arch 'gpt' exports")
    unknown = unknown_options(m, EXPORTED_OPTIONS)
    if unknown:
        raise ExportError(f"model option(s) {', '.join(f'{k}={getattr(m, k)!r}' for k in unknown)} are not "
                          "mapped to any Hugging Face or GGUF family yet (export/families.py, "
                          "EXPORTED_OPTIONS): the exported file would compute another model")
    if m.pos == "learned":  # GPT-2
        if m.norm != "layernorm":
            why.append(f"norm={m.norm} with learned positions (GPT-2 has LayerNorm)")
        if m.mlp != "gelu":
            why.append(f"mlp={m.mlp} with learned positions (GPT-2's MLP is GELU)")
        if m.n_kv_head != m.n_head:
            why.append(f"n_kv_head={m.n_kv_head} < n_head={m.n_head} (GPT-2 has no grouped-query attention)")
        if m.qk_norm:
            why.append("qk_norm (GPT-2 has no QK-norm)")
        if not why:
            return Family("gpt2", ACTS["gelu"])
    else:
        if m.norm != "rmsnorm":
            why.append(f"norm={m.norm} with rotary positions (Llama/Qwen/Arcee use RMSNorm)")
        if m.mlp == "swiglu":
            if m.qk_norm:
                mlp_b = _nonzero(sd, ("mlp.c_fc.bias", "mlp.c_proj.bias")) if m.bias else []
                if mlp_b:
                    why.append("bias=true with qk_norm: Qwen3 has no MLP biases, and these are not zero: "
                               f"{mlp_b[:3]}")
                if not why:
                    return Family("qwen3", attention_bias=m.bias)
            elif m.bias and not _nonzero(sd, ("attn.c_proj.bias", "mlp.c_fc.bias", "mlp.c_proj.bias")) and sd:
                # biases on q/k/v only: Qwen2's layout (a model imported from Qwen2 goes back to it)
                if not why:
                    return Family("qwen2")
            elif not why:
                return Family("llama", attention_bias=m.bias, mlp_bias=m.bias)
        else:  # non-gated MLP with RoPE + RMSNorm: Arcee (AFM) is that layer with a configurable activation
            if m.qk_norm:
                why.append(f"qk_norm with mlp={m.mlp} (Arcee, the class with a non-gated MLP and RoPE, has "
                           f"no QK-norm; Qwen3 has QK-norm but a SwiGLU MLP)")
            if not why:
                return Family("arcee", ACTS[m.mlp], attention_bias=m.bias, mlp_bias=m.bias)
    raise ExportError("no transformers class computes this model; what does not map: " + "; ".join(why))


# -- config.json ---------------------------------------------------------------------------------------------

def hf_config(m: GPTConfig, fam: Family, special: dict[str, int | None]) -> dict:
    """config.json for family `fam`. The token ids: documents end with <|endoftext|>, chat turns with
    <|im_end|>; codeforge adds no BOS."""
    eot = special.get("<|endoftext|>")
    ids = {"bos_token_id": eot, "eos_token_id": eot, "pad_token_id": special.get("<pad>")}
    common = {"architectures": [fam.name], "model_type": fam.model_type, "vocab_size": m.vocab_size,
              "tie_word_embeddings": m.tie_embeddings, "dtype": "float32", "torch_dtype": "float32",
              "initializer_range": 0.02, "use_cache": True, **ids}
    if fam.model_type == "gpt2":
        return {**common, "n_positions": m.block_size, "n_ctx": m.block_size, "n_embd": m.n_embd,
                "n_layer": m.n_layer, "n_head": m.n_head, "n_inner": m.ffn_hidden,
                "activation_function": fam.hidden_act, "layer_norm_epsilon": m.norm_eps,
                "resid_pdrop": m.resid_dropout, "embd_pdrop": m.embd_dropout, "attn_pdrop": m.attn_dropout,
                "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
                "reorder_and_upcast_attn": False}
    cfg = {**common, "hidden_size": m.n_embd, "intermediate_size": m.ffn_hidden,
           "num_hidden_layers": m.n_layer,
           "num_attention_heads": m.n_head, "num_key_value_heads": m.n_kv_head, "head_dim": m.head_dim,
           "hidden_act": fam.hidden_act, "max_position_embeddings": m.block_size, "rms_norm_eps": m.norm_eps,
           # both spellings: transformers >= 5 reads rope_parameters, older
           # readers (and converters) rope_theta
           "rope_theta": m.rope_base, "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_base},
           "attention_dropout": m.attn_dropout, **fam.extra}
    if fam.model_type in ("qwen2", "qwen3"):
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=m.n_layer)
    return cfg


# -- state dicts ---------------------------------------------------------------------------------------------

def to_hf(sd: dict[str, torch.Tensor], m: GPTConfig, fam: Family) -> dict[str, torch.Tensor]:
    """Our state dict -> the family's, by its key map. Every tensor of ours is used exactly once (asserted);
    a tied lm_head is left out (transformers ties it from the embedding)."""
    sd = dict(sd)
    if m.tie_embeddings:
        sd.pop("lm_head.weight", None)
    rows = splits(m)
    out: dict[str, torch.Tensor] = {}
    used = set()
    for ours, theirs in expand(fam.keys, m.n_layer):
        if ours not in sd:
            continue
        t = sd[ours].detach().to("cpu", torch.float32)
        used.add(ours)
        if isinstance(theirs, tuple):
            kind = next(k for k in rows if f".{k}." in f".{ours}")
            parts = t.split(rows[kind][:len(theirs)], dim=0)
            assert sum(p.shape[0] for p in parts) == t.shape[0], (f"{ours}: split {rows[kind]} of "
                                                                  f"{tuple(t.shape)}")
            out.update({name: p.contiguous() for name, p in zip(theirs, parts)})
        else:
            if ours.endswith(fam.record.conv1d):
                t = t.t()  # nn.Linear (out, in) -> Conv1D (in, out)
            out[theirs] = t.contiguous()
    left = sorted(set(sd) - used)
    if left:
        raise ExportError(f"{fam}: no key map entry for {left[:6]}")
    if fam.record.every_bias and not m.bias:  # GPT-2 always has biases: zeros compute the same
        for ours, theirs in expand(fam.keys, m.n_layer):
            if ours.endswith(".bias") and theirs not in out and ours[:-4] + "weight" in sd:
                out[theirs] = torch.zeros(sd[ours[:-4] + "weight"].shape[0])  # out features (norm: width)
    # Biases the class does not have; choose_family checked they are zero.
    absent = fam.record.hf_absent
    return {k: v for k, v in out.items() if not k.endswith(absent)} if absent else out


def from_hf(hf: dict[str, torch.Tensor], m: GPTConfig, fam: Family) -> dict[str, torch.Tensor]:
    """The family's state dict -> ours (the inverse of to_hf). Biases our config has but the class lacks
    (Qwen2's o_proj and MLP, Llama without mlp_bias, ...) are zeros, which compute the same."""
    hf = dict(hf)
    out: dict[str, torch.Tensor] = {}
    shapes = _our_shapes(m)
    for ours, theirs in expand(fam.keys, m.n_layer):
        if ours not in shapes:
            continue
        names = theirs if isinstance(theirs, tuple) else (theirs,)
        if ours == "lm_head.weight" and m.tie_embeddings:
            hf.pop("lm_head.weight", None)
            continue
        if all(n in hf for n in names):
            parts = [hf.pop(n).to(torch.float32) for n in names]
            t = torch.cat(parts, dim=0) if len(parts) > 1 else parts[0]
            if ours.endswith(fam.record.conv1d):
                t = t.t()
            out[ours] = t.contiguous()
        elif ours.endswith(".bias"):
            out[ours] = torch.zeros(shapes[ours])
        else:
            missing = [n for n in names if n not in hf]
            raise ExportError(f"{fam}: the checkpoint lacks {missing} (for {ours})")
    for k in [k for k in hf if k.endswith((".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq"))]:
        hf.pop(k)  # buffers older transformers saved
    if not m.bias:  # zero biases (GPT-2 always has them) are what a model without biases computes
        for k in [k for k, v in hf.items() if k.endswith(".bias") and not bool(v.abs().max() > 0)]:
            hf.pop(k)
    if hf:
        raise ExportError(f"{fam}: tensors with no place in a codeforge model: {sorted(hf)[:6]}")
    bad = {k: (tuple(v.shape), shapes[k]) for k, v in out.items() if tuple(v.shape) != shapes[k]}
    if bad:
        raise ExportError(f"{fam}: tensor shapes do not fit the config (got, expected): "
                          f"{dict(list(bad.items())[:4])}")
    return out


def _our_shapes(m: GPTConfig) -> dict[str, tuple]:
    return state_shapes(m)[0]  # from the config alone: nothing is built


# -- tokenizer files -----------------------------------------------------------------------------------------

def write_tokenizer_files(tok_dir: Path, out: Path) -> None:
    """tokenizer.json, tokenizer_config.json (special tokens and the chat
    template) and special_tokens_map.json.
    A codeforge tokenizer gets its config written afresh by tokenizer.write_hf_config (the current chat
    template); a tokenizer that came in from Hugging Face keeps its own."""
    shutil.copyfile(tok_dir / TOKENIZER_FILE, out / TOKENIZER_FILE)
    if (tok_dir / META_FILE).exists() or not (tok_dir / "tokenizer_config.json").exists():
        write_hf_config(out)
    else:
        shutil.copyfile(tok_dir / "tokenizer_config.json", out / "tokenizer_config.json")
    tc = json.loads((out / "tokenizer_config.json").read_text())
    smap = {k: tc[k]
            for k in ("bos_token", "eos_token", "pad_token", "unk_token", "additional_special_tokens")
            if tc.get(k) is not None}
    (out / "special_tokens_map.json").write_text(json.dumps(smap, indent=2))


# -- export --------------------------------------------------------------------------------------------------

def normal_file_modes(d: Path) -> None:
    """Give every file in `d` the mode a plain open(..., "w") gives under the current umask (0644 under
    umask 022): safetensors' writer creates model.safetensors 0600, which left one file of the export
    unreadable to the group and others while the rest were readable."""
    mode = 0o666 & ~current_umask()
    for p in d.iterdir():
        if p.is_file() and not p.is_symlink():
            p.chmod(mode)


def current_umask() -> int:
    """The process's umask, read without changing it where Linux shows it (os.umask can only set it, and
    setting it to read it opens a moment in which another thread's files get mode 0666)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


def export_hf(run: str | Path, out: str | Path, which: str = "auto", overwrite: bool = False,
              verify: bool = True, log: Callable[[str], None] = print) -> dict:
    """Write run `run`'s checkpoint `which` as a Hugging Face model directory `out`. Returns a summary
    {"family", "checkpoint", "out", "max_abs_diff" (None without transformers or verify)}."""
    out = check_out(out, overwrite)
    model, tok, ck, cfg = load_model(run, torch.device("cpu"), which, log=log)
    m: GPTConfig = model.cfg
    sd = model.state_dict()
    fam = choose_family(m, sd)
    hf_sd = to_hf(sd, m, fam)
    tmp = staging_dir(out)
    try:
        config = hf_config(m, fam, tok.special_ids)
        config["codeforge"] = {"checkpoint": str(ck), "model": m.to_dict(), "tokenizer_hash": tok.hash}
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        save_file(hf_sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        eos = [i for i in (tok.eot_id, tok.special_ids.get("<|im_end|>")) if i is not None]
        # no max_length: transformers warns on every generate(max_new_tokens=...) when the model sets both
        # (the context length is config.json's max_position_embeddings / n_positions)
        (tmp / "generation_config.json").write_text(json.dumps({
            "bos_token_id": tok.eot_id, "eos_token_id": eos, "pad_token_id": tok.special_ids.get("<pad>")},
            indent=2))
        write_tokenizer_files(ck / "tokenizer", tmp)
        normal_file_modes(tmp)
        publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    diff = verify_logits(model, out, tok) if verify else None
    return {"family": fam.name, "checkpoint": str(ck), "out": str(out), "max_abs_diff": diff}


# -- import --------------------------------------------------------------------------------------------------

IMPORTABLE = tuple(FAMILIES)


NOT_IMPORTABLE = "codeforge cannot import it as it is"


def _hub_blobs(hf_dir: Path) -> Path | None:
    """blobs/ of the Hugging Face hub cache when `hf_dir` is one of its snapshots
    (models--ORG--NAME/snapshots/ REV, whose files are links to ../../blobs/HASH), else None."""
    real = hf_dir.resolve()
    repo = real.parent.parent
    blobs = repo / "blobs"
    if real.parent.name == "snapshots" and repo.name.startswith("models--") and blobs.is_dir() \
            and not blobs.is_symlink():
        return blobs
    return None


def check_model_dir(hf_dir: Path) -> None:
    """Every entry of `hf_dir` but its subdirectories is a regular file (a FIFO would block the read), and
    none is a link out of it: its files are read, and some copied into the run and every checkpoint and
    export of it, so a link to a key elsewhere would carry the key with them. The hub cache's links from a
    snapshot to its blobs stay within the model's own cache entry and are followed."""
    blobs = _hub_blobs(hf_dir)
    for p in sorted(hf_dir.iterdir()):
        if p.is_symlink() and not (blobs is not None and p.resolve().parent == blobs):
            check_inside(p, hf_dir, ExportError)
        if not p.is_dir():
            check_regular(p, ExportError, "replace it with the file it stands for")


def read_hf_config(hf_dir: str | Path) -> dict:
    """config.json of Hugging Face model directory `hf_dir`, once the directory passed check_model_dir()."""
    p = Path(hf_dir)
    f = p / "config.json"
    if not os.path.lexists(f) or not p.is_dir():
        raise ExportError(f"{p} is not a Hugging Face model directory (no config.json)")
    check_model_dir(p)
    c = read_json(f, CONFIG_BYTES, ExportError, NOT_IMPORTABLE)
    if not isinstance(c, dict):
        raise ExportError(f"{f} is a {type(c).__name__}, not an object of settings; {NOT_IMPORTABLE}")
    if c.get("model_type") not in IMPORTABLE:
        raise ExportError(f"{p}: model_type {c.get('model_type')!r} is not supported; importable families: "
                          f"{', '.join(IMPORTABLE)}")
    return c


def config_from_hf(c: dict, where: str | Path = "config.json") -> tuple[GPTConfig, Family]:
    """Our model config (and the family) for a Hugging Face config.json (file `where`); ExportError listing
    what has no codeforge counterpart (rope scaling, sliding windows, another activation, ...), or naming the
    first value that is not of its type or outside codeforge's declared range (checked before anything is
    computed from it: a config of 10^6 layers is refused, not built)."""
    mt = c["model_type"]
    why: list[str] = []
    tie = bool(c.get("tie_word_embeddings", mt == "gpt2"))
    if mt == "gpt2":
        act = c.get("activation_function", "gelu_new")
        if act not in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast"):
            why.append(f"activation_function {act!r} (codeforge's GELU is the tanh approximation: gelu_new)")
        if c.get("scale_attn_by_inverse_layer_idx"):
            why.append("scale_attn_by_inverse_layer_idx")
        if c.get("scale_attn_weights", True) is False:
            why.append("scale_attn_weights=false")
        names = {"vocab_size": "vocab_size", "block_size": "n_positions", "n_layer": "n_layer",
                 "n_head": "n_head", "n_embd": "n_embd", "n_kv_head": "n_head", "ffn_hidden": "n_inner",
                 "norm_eps": "layer_norm_epsilon"}
        kw = dict(vocab_size=c.get("vocab_size"), block_size=c.get("n_positions", 1024),
                  n_layer=c.get("n_layer", 12),
                  n_head=c.get("n_head", 12), n_embd=c.get("n_embd", 768), n_kv_head=c.get("n_head", 12),
                  mlp="gelu",
                  ffn_hidden=c.get("n_inner") or 0,  # 0: 4 x n_embd, GPT-2's default
                  norm="layernorm", norm_eps=c.get("layer_norm_epsilon", 1e-5), pos="learned",
                  tie_embeddings=tie, bias=True)
    else:
        act = c.get("hidden_act", "silu")
        acts = {"llama": ("silu",), "qwen2": ("silu",), "qwen3": ("silu",),
                "arcee": ("relu2", "gelu_pytorch_tanh", "gelu_new")}[mt]
        if act not in acts:
            why.append(f"hidden_act {act!r} (codeforge computes {' or '.join(acts)} for {mt})")
        rope = c.get("rope_parameters") or {}
        rope_type = rope.get("rope_type") or (c.get("rope_scaling") or {}).get("rope_type") or \
            (c.get("rope_scaling") or {}).get("type") or "default"
        if rope_type != "default":
            why.append(f"rope scaling {rope_type!r}")
        theta = rope.get("rope_theta", c.get("rope_theta", 10000.0))
        if c.get("use_sliding_window"):
            why.append("sliding-window attention")
        if c.get("pretraining_tp", 1) != 1:
            why.append(f"pretraining_tp={c['pretraining_tp']}")
        bias = {"qwen2": True, "llama": bool(c.get("attention_bias") or c.get("mlp_bias")),
                "arcee": bool(c.get("attention_bias") or c.get("mlp_bias")),
                "qwen3": bool(c.get("attention_bias"))}[mt]
        names = {"vocab_size": "vocab_size", "block_size": "max_position_embeddings",
                 "n_layer": "num_hidden_layers",
                 "n_head": "num_attention_heads", "n_embd": "hidden_size", "n_kv_head": "num_key_value_heads",
                 "ffn_hidden": "intermediate_size", "norm_eps": "rms_norm_eps", "rope_base": "rope_theta"}
        kw = dict(vocab_size=c.get("vocab_size"), block_size=c.get("max_position_embeddings", 2048),
                  n_layer=c.get("num_hidden_layers"), n_head=c.get("num_attention_heads"),
                  n_embd=c.get("hidden_size"),
                  n_kv_head=c.get("num_key_value_heads") or c.get("num_attention_heads"),
                  mlp={"arcee": "relu2" if act == "relu2" else "gelu"}.get(mt, "swiglu"),
                  ffn_hidden=c.get("intermediate_size"), norm="rmsnorm", norm_eps=c.get("rms_norm_eps", 1e-6),
                  pos="rope",
                  rope_base=float(theta) if isinstance(theta, int) and not isinstance(theta, bool) else theta,
                  qk_norm=mt == "qwen3", tie_embeddings=tie, bias=bias)
    if why:
        raise ExportError(f"a {mt} model with features codeforge does not compute: {'; '.join(why)}")
    # longer contexts: ours is the range's top
    if isinstance(kw["block_size"], int) and kw["block_size"] > 131_072:
        kw["block_size"] = 131_072
    m = model_config_from(kw, where, ExportError, NOT_IMPORTABLE, names)
    if mt != "gpt2" and c.get("head_dim") not in (None, m.head_dim):
        raise ExportError(f"a {mt} model with features codeforge does not compute: head_dim "
                          f"{c.get('head_dim')} != hidden_size / num_attention_heads ({m.n_embd}/{m.n_head})")
    fam = Family(mt, act if mt == "arcee" else None)
    return m, fam


def hf_weight_files(hf_dir: Path) -> list[Path]:
    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        extra = " (only PyTorch .bin files: re-save it with save_pretrained(safe_serialization=True))" \
            if list(hf_dir.glob("*.bin")) else ""
        raise ExportError(f"{hf_dir} has no .safetensors weights{extra}")
    return files


def load_hf_weights(hf_dir: Path) -> dict[str, torch.Tensor]:
    sd: dict[str, torch.Tensor] = {}
    for f in hf_weight_files(hf_dir):
        try:
            sd.update(load_file(str(f)))
        except (OSError, SafetensorError) as e:
            raise ExportError(f"{f} cannot be read ({e}); {NOT_IMPORTABLE}") from e
    return sd


def import_hf(hf_dir: str | Path, out: str | Path, overwrite: bool = False, verify: bool | None = True,
              log: Callable[[str], None] = print, context: int | None = None) -> dict:
    """A codeforge run directory `out` (one checkpoint, step 0, with the
    tokenizer) from the Hugging Face model
    in `hf_dir` (a directory, or a Hub name ORG/NAME: hub.model_source), to start training from (`codeforge
    train --init-from OUT`), generate, evaluate or export. context: at most this many positions for a rotary
    model (its block_size, the context it trains and serves at; nothing in its weights depends on it): the
    Hub's code models declare 32,768, and one training window that long does not fit a CPU's memory.
    verify None: compare logits with transformers' where its copy of the model fits in memory too."""
    hf_dir, hub_name = model_source(hf_dir, log)
    c = read_hf_config(hf_dir)
    m, fam = config_from_hf(c, hf_dir / "config.json")
    declared = m.block_size
    if context and m.pos == "rope" and m.block_size > context:
        m = replace(m, block_size=context)
    out = check_out(out, overwrite)
    # the weights' headers, and the memory: our float32 model, the tensors read, their float32 copies
    # (from_hf), and transformers' own copy when verifying
    stored = sum(header_bytes(safetensors_header(f, ExportError, NOT_IMPORTABLE))
                 for f in hf_weight_files(hf_dir))
    params = declared_shapes(m)[2]
    if verify is None:
        have = available_memory()
        verify = have is None or 4 * params * 3 + stored <= have[0]
        if not verify:  # a 1.5B model on a 24 GiB machine: the import fits, a second float32 copy does not
            log(f"note: not comparing logits with transformers': its float32 copy of {params:,} parameters "
                f"would not fit in the memory available ({have[0] / 2**30:.1f} GiB)")
    check_memory(4 * params * (3 if verify else 2) + stored,
                 f"{hf_dir / 'config.json'} declares a model of {params:,} parameters ({dims(m)}): "
                 "importing it",
                 ExportError)
    if not os.path.lexists(hf_dir / "tokenizer.json"):
        raise ExportError(f"{hf_dir} has no tokenizer.json (the fast tokenizer); codeforge needs it to train "
                          "and generate. Save it with "
                          f"AutoTokenizer.from_pretrained(...).save_pretrained({hf_dir})")
    try:
        tok = CodeTokenizer.load(hf_dir, log=log)  # a split rule that fails on probe texts is refused
    except TokenizerError as e:
        raise ExportError(str(e)) from e
    if tok.vocab_size > m.vocab_size:
        raise ExportError(f"{hf_dir}: the tokenizer has {tok.vocab_size} tokens but the model only "
                          f"{m.vocab_size}")
    lacking = [t for t in SPECIAL_TOKENS if tok.special_ids.get(t) is None and not t.startswith("<|reserved")
               # without them /infill joins other files as llama.cpp does
               and t not in (FIM_REPO, FIM_FILE_SEP)]
    if lacking:
        log(f"note: the tokenizer lacks codeforge's special tokens {lacking}: what uses them (FIM, chat with "
            f"tools, ...) will not work with this model")
    sd = from_hf(load_hf_weights(hf_dir), m, fam)
    model = build_model(m)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and m.tie_embeddings)]
    if missing or unexpected:
        raise ExportError(f"{hf_dir}: weights do not fit (missing {missing[:4]}, unexpected "
                          f"{unexpected[:4]})")
    model.eval()
    if out.exists() and overwrite:
        shutil.rmtree(out) if out.is_dir() else out.unlink()
    tok_tmp = out.parent / f".{out.name}.tokenizer-tmp"
    shutil.rmtree(tok_tmp, ignore_errors=True)
    tok_tmp.mkdir(parents=True)
    try:
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (hf_dir / name).is_file():
                shutil.copyfile(hf_dir / name, tok_tmp / name)
        train = TrainConfig().to_dict()
        train.update(out=str(out), init_from=str(hf_dir))
        config = {"model": m.to_dict(), "train": train, "tokenizer_hash": tok.hash,
                  "imported_from": {"path": str(hf_dir.resolve()), "architectures": c.get("architectures"),
                                    "model_type": c["model_type"],
                                    **({"hub": hub_name} if hub_name else {}),
                                    **({"context": declared} if declared != m.block_size else {})}}
        ck = save_checkpoint(out, 0, model, config, {}, {"tokenizer": tok_tmp}, keep_last=1, final=True)
    finally:
        shutil.rmtree(tok_tmp, ignore_errors=True)
    diff = verify_logits(model, hf_dir, tok) if verify else None
    return {"family": fam.name, "checkpoint": str(ck), "out": str(out), "max_abs_diff": diff,
            "params": model.num_params(), "path": str(hf_dir), "hub": hub_name, "context": m.block_size,
            "declared_context": declared}


# -- parity --------------------------------------------------------------------------------------------------

SAMPLE = ('def fibonacci(n: int) -> int:\n    """Return the n-th Fibonacci number."""\n    a, b = 0, 1\n'
          '    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n\nfunc Max(a, b int) int {\n'
          '\tif a > b {\n\t\treturn a\n\t}\n\treturn b\n}\n')


def load_transformers(hf_dir: str | Path):
    """The transformers model in hf_dir, float32, eval; None when transformers is not installed."""
    try:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging
    except ImportError:
        return None
    # transformers' "Loading weights" tqdm bar would land in the middle of codeforge's own output: off for
    # this load (it also switches off huggingface_hub's bars), then back to what it was
    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        return AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    finally:
        if was:
            hf_logging.enable_progress_bar()


@torch.no_grad()
def verify_logits(model: torch.nn.Module, hf_dir: str | Path, tok, text: str = SAMPLE) -> float | None:
    """Max |logit difference| between our model and transformers' on `text` (None without transformers);
    ExportError when it is beyond 1e-3 (a wrong export must not pass silently)."""
    hf = load_transformers(hf_dir)
    if hf is None:
        return None
    ids = tok.encode(text)[: model.cfg.block_size]
    idx = torch.tensor([ids])
    ours = model.float()(idx)
    theirs = hf(idx).logits
    diff = float((ours - theirs).abs().max())
    if not diff <= 1e-3:
        raise ExportError(f"parity check failed: transformers' logits differ from codeforge's by {diff:.3g} "
                          f"(max abs) on {len(ids)} tokens of code; the output in {hf_dir} is wrong")
    return diff
