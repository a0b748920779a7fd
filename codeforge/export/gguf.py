"""GGUF for llama.cpp (and Ollama, LM Studio and the editor plugins built on it),
written with the `gguf` package.

Architectures, as llama.cpp's convert_hf_to_gguf.py writes them for the same transformers class (hf.py picks
the class):
  GPT2LMHeadModel          -> gpt2    fused attn_qkv kept (same q | k | v rows);
                                      biases required (zeros if none)
  LlamaForCausalLM         -> llama   Q and K rows permuted: llama.cpp's "normal" rotary pairs dimensions
                                      (2i, 2i+1) where codeforge and transformers pair (i, i + hd/2)
  Qwen2ForCausalLM         -> qwen2   NEOX rotary (rotate-half, as ours): no permutation; q/k/v biases
  Qwen3ForCausalLM         -> qwen3   NEOX rotary; attn_q_norm / attn_k_norm
  ArceeForCausalLM (relu2) -> arcee   permuted like llama; llama.cpp's arcee computes ReLU^2 only, so the
                                      GELU variant (the seed-003 presets) has no llama.cpp architecture and is
                                      refused (its Hugging Face export works)
Tensor names are llama.cpp's (token_embd, blk.N.attn_q, ...; gguf.TENSOR_NAMES); shapes are PyTorch's
(out, in), which GGUF stores reversed as ggml expects. f32 writes every tensor as float32; f16 and q8_0
convert the matrices (2-D) and keep vectors (norms, biases) in float32, as convert_hf_to_gguf does; a matrix
whose rows do not divide into q8_0 blocks of 32 is written f16.

Tokenizer. model "gpt2" (byte-level BPE): every token string in id order (a model vocabulary padded past the
tokenizer's gets [PADn] tokens of type UNUSED), types (special tokens CONTROL, other added ones USER_DEFINED),
the merges, BOS/EOS/EOT/pad/unk, the FIM ids, no BOS added, and the chat template. (llama.cpp's whole-text
llama_detokenize "cleans up" a space before an apostrophe for every llama-bpe model, Llama 3's included, with
no key to turn it off; generation writes text token by token and is unaffected.) llama.cpp splits text with
one of the pre-tokenizers it knows by name (llama-vocab.cpp) and refuses any other, so the name must be the
rule the tokenizer was trained with (recorded as llama_cpp_pre in codeforge_tokenizer.json, and checked
against tokenizer.json's regex):
  --split llama3 (the default)      -> "llama-bpe"  (the same regex)
  a Qwen2 / GPT-2 tokenizer (import) -> "qwen2" / "gpt2"
  --split code                      -> no llama.cpp pre-tokenizer is this rule: refused in one sentence,
                                       unless --allow-tokenizer-mismatch, which writes "llama-bpe", says
                                       loudly how many tokens of a code sample come out differently, and
                                       records it in the file (codeforge.tokenizer_mismatch).
"""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from . import ExportError, check_out
from ..chat import CHAT_TEMPLATE
from ..config import speaks_chat
from .. import printable, rundir
from ..checkpoint import load_model
from ..models.gpt import GPTConfig
from ..tokenizer import EOT, LLAMA3_SPLIT_PATTERN, META_FILE
from .families import FAMILIES, expand, splits
from .hf import SAMPLE, choose_family
from .options import GGUF_DTYPES

def permute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """convert_hf_to_gguf's LlamaModel.permute: within each head, rows (i, i + hd/2) of the rotate-half
    layout become rows (2i, 2i+1), the interleaved pairs llama.cpp's rope type NORM rotates.
    w: (n_head * hd, ...) -> same shape."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


def gguf_tensors(sd: dict[str, torch.Tensor], m: GPTConfig, model_type: str) -> dict[str, torch.Tensor]:
    """Our state dict -> llama.cpp's tensors (float32), by the family's literal map (families.FAMILIES)."""
    fam = FAMILIES[model_type]
    table = fam.gguf_tensors
    sd = {k: v.detach().to("cpu", torch.float32) for k, v in sd.items()}
    if m.tie_embeddings:
        sd.pop("lm_head.weight", None)  # llama.cpp falls back to token_embd
    rows = splits(m)
    out: dict[str, torch.Tensor] = {}
    used = set()
    for ours, theirs in expand(table, m.n_layer):
        if ours not in sd:
            continue
        used.add(ours)
        t = sd[ours]
        if isinstance(theirs, tuple):
            kind = next(k for k in rows if f".{k}." in f".{ours}")
            parts = t.split(rows[kind][:len(theirs)], dim=0)
            for name, p in zip(theirs, parts):
                if fam.rope_permuted and ".attn_q." in name:
                    p = permute_rows(p, m.n_head)
                elif fam.rope_permuted and ".attn_k." in name:
                    p = permute_rows(p, m.n_kv_head)
                out[name] = p.contiguous()
        else:
            out[theirs] = t.contiguous()
    left = sorted(set(sd) - used)
    if left:
        raise ExportError(f"GGUF {model_type}: no tensor map entry for {left[:6]}")
    if fam.every_bias and not m.bias:  # llama.cpp's gpt2 requires every bias: zeros compute the same
        for ours, theirs in expand(table, m.n_layer):
            w = ours[:-4] + "weight"
            if ours.endswith(".bias") and theirs not in out and w in sd:
                out[theirs] = torch.zeros(sd[w].shape[0])
    for name in [n for n in out if n.endswith(fam.gguf_not_loaded)]:
        if bool(out[name].abs().max() > 0):
            raise ExportError(f"GGUF {model_type}: llama.cpp does not load {name}, and it is not zero")
        del out[name]
    return out


# -- the tokenizer -------------------------------------------------------------------------------------------

KNOWN_SPLITS = {  # a split regex (as in tokenizer.json) -> the llama.cpp pre-tokenizer with the same rule
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| """
    r"""?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""":
        "llama-bpe",
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| """
    r"""?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""":
        "qwen2",
}


def pre_tokenizer_name(tok_json: dict) -> tuple[str | None, str]:
    """(llama.cpp pre-tokenizer name or None, a description of the rule) for a tokenizer.json."""
    pt = tok_json.get("pre_tokenizer") or {}
    steps = pt.get("pretokenizers", [pt]) if pt.get("type") == "Sequence" else [pt]
    kinds = [s.get("type") for s in steps]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True) and not steps[0].get("add_prefix_space"):
        return "gpt2", "GPT-2's byte-level rule"
    if kinds == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True):
        pattern = (steps[0].get("pattern") or {}).get("Regex")
        if steps[0].get("behavior") == "Isolated" and not steps[0].get("invert") and pattern in KNOWN_SPLITS:
            return KNOWN_SPLITS[pattern], f"the split regex {pattern!r}"
        return None, f"the split regex {pattern!r}"
    return None, f"the pre-tokenizer {json.dumps(pt)[:200]}"


def recorded_pre(tok) -> str | None:
    """The llama.cpp pre-tokenizer name codeforge_tokenizer.json records (tokenizers trained since the default
    became llama3), or None (older tokenizers, imported ones: their rule is read from tokenizer.json)."""
    f = tok.path / META_FILE if tok.path is not None else None
    if f is None or not f.is_file():
        return None
    try:
        meta = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise ExportError(f"{f} is not readable JSON ({e}); train the tokenizer again") from None
    name = meta.get("llama_cpp_pre") if isinstance(meta, dict) else None
    if name is not None and not isinstance(name, str):
        raise ExportError(f"{f}: llama_cpp_pre = {name!r} is not a name; train the tokenizer again")
    return name


def mismatch_rate(tok, texts: list[str], pattern: str) -> tuple[int, int]:
    """(our tokens that would not come out, our tokens) when `tok`'s BPE runs after `pattern`'s split instead
    of its own, over `texts`: a token counts as kept when the other encoding has the same id over the same
    characters. That share of what the model was trained on changes under llama.cpp."""
    from tokenizers import Regex, Tokenizer, pre_tokenizers
    other = Tokenizer.from_str(tok.tok.to_str())
    other.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    other.encode_special_tokens = True
    diff = total = 0
    for t in texts:
        a, b = tok.tok.encode(t, add_special_tokens=False), other.encode(t, add_special_tokens=False)
        ours = set(zip(a.ids, a.offsets))
        total += len(ours)
        diff += len(ours - set(zip(b.ids, b.offsets)))
    return diff, total


def write_tokenizer(w, tok, vocab_size: int, pre: str) -> None:
    import gguf

    tj = json.loads(tok.tok.to_str())
    vocab = tok.tok.get_vocab(with_added_tokens=True)
    by_id = {i: s for s, i in vocab.items()}
    special = {a["id"] for a in tj.get("added_tokens", []) if a.get("special")}
    # an added token that is plain text (an imported tokenizer's ordinary added word) is USER_DEFINED, as
    # llama.cpp's converter types it: llama.cpp matches those whole in user text, as `tokenizers` does
    added = {a["id"] for a in tj.get("added_tokens", [])}
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        else:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.CONTROL if i in special
                         else gguf.TokenType.USER_DEFINED if i in added else gguf.TokenType.NORMAL)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"].get("merges", [])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    sid = tok.special_ids
    w.add_bos_token_id(tok.eot_id)  # documents start after <|endoftext|>; never added (add_bos false)
    w.add_eos_token_id(tok.eot_id)
    w.add_add_bos_token(False)
    w.add_add_eos_token(False)

    for key, name in ((gguf.Keys.Tokenizer.EOT_ID, "<|im_end|>"), (gguf.Keys.Tokenizer.PAD_ID, "<pad>"),
                      (gguf.Keys.Tokenizer.UNK_ID, "<unk>"), (gguf.Keys.Tokenizer.FIM_PRE_ID, "<fim_prefix>"),
                      (gguf.Keys.Tokenizer.FIM_SUF_ID, "<fim_suffix>"),
                      (gguf.Keys.Tokenizer.FIM_MID_ID, "<fim_middle>"),
                      (gguf.Keys.Tokenizer.FIM_REP_ID, "<|repo_name|>"),
                      (gguf.Keys.Tokenizer.FIM_SEP_ID, "<|file_sep|>")):
        if sid.get(name) is not None:
            w.add_uint32(key, sid[name])
    tc = tok.path / "tokenizer_config.json" if tok.path is not None else None
    template = CHAT_TEMPLATE
    if tc is not None and tc.exists() and not (tok.path / "codeforge_tokenizer.json").exists():
        # an imported tokenizer's own
        template = json.loads(tc.read_text()).get("chat_template") or CHAT_TEMPLATE
    if isinstance(template, str):
        w.add_chat_template(template)


# -- export --------------------------------------------------------------------------------------------------

def _qtype(name: str, t: np.ndarray, dtype: str):
    import gguf
    Q = gguf.GGMLQuantizationType
    if dtype == "f32" or t.ndim < 2:
        return Q.F32
    if dtype == "q8_0" and t.shape[-1] % 32 == 0:
        return Q.Q8_0
    return Q.F16


def export_gguf(run: str | Path, out: str | Path, which: str = "auto", dtype: str = "f32",
                overwrite: bool = False,
                allow_tokenizer_mismatch: bool = False, log: Callable[[str], None] = print,
                verbose: Callable[[str], None] = lambda m: None) -> dict:
    """Write run `run`'s checkpoint as a GGUF file. Returns {"arch", "pre", "checkpoint", "out", "bytes",
    "tokenizer_mismatch"}. `verbose` receives the details of a tokenizer llama.cpp cannot reproduce."""
    import gguf

    if dtype not in GGUF_DTYPES:
        raise ExportError(f"--dtype {dtype!r} is not one of {', '.join(GGUF_DTYPES)}")
    out = check_out(out, overwrite)
    if out.is_dir():
        raise ExportError(f"--out {out} is a directory; GGUF is one file (e.g. {out / 'model.gguf'})")
    model, tok, ck, cfg = load_model(run, torch.device("cpu"), which, log=log)
    m: GPTConfig = model.cfg
    sd = model.state_dict()
    fam = choose_family(m, sd)
    if FAMILIES[fam.model_type].gguf_mlp not in (None, m.mlp):
        raise ExportError(
            f"llama.cpp has no architecture for this model: RoPE + RMSNorm + a non-gated {m.mlp.upper()} "
            "MLP (its arcee computes ReLU^2, gpt2/starcoder2 use LayerNorm). "
            f"`codeforge export --format hf` writes it as {fam.name}; for llama.cpp train with "
            "--set model.mlp=swiglu (Llama) or relu2 (Arcee)")
    arch = FAMILIES[fam.model_type].gguf_arch
    tensors = gguf_tensors(sd, m, fam.model_type)

    tj = json.loads(tok.tok.to_str())
    pre, rule = pre_tokenizer_name(tj)
    recorded = recorded_pre(tok)
    if recorded is not None and recorded != pre:
        actual = f"llama.cpp's {pre!r}" if pre else "a rule llama.cpp does not implement"
        raise ExportError(f"{tok.path / META_FILE} says the tokenizer splits text as llama.cpp's "
                          f"{recorded!r}, but its tokenizer.json splits with {actual}: the two files do not "
                          "belong together; train the tokenizer again")
    mismatch = None
    if pre is None:
        texts = [SAMPLE] + [p.read_text(errors="replace") for p in sorted(Path(__file__).parent.glob("*.py"))]
        diff, total = mismatch_rate(tok, texts, LLAMA3_SPLIT_PATTERN)
        mismatch = {"tokens_differing": diff, "tokens": total, "rule": rule}
        share = f"{100 * diff / max(total, 1):.0f}%"
        verbose(f"the tokenizer splits text with {rule}; under llama.cpp's nearest rule (llama-bpe) {diff:,} "
                f"of {total:,} tokens of a code sample come out differently")
        if not allow_tokenizer_mismatch:
            raise ExportError(
                "this run's tokenizer uses codeforge's code split, which llama.cpp does not implement "
                f"({share} of the tokens of a code sample would differ), so it cannot run in llama.cpp: "
                "train the tokenizer with the default split (`codeforge tokenizer train`, or `--split "
                "llama3`) and the model on it, or pass --allow-tokenizer-mismatch to write the file anyway "
                "(--verbose shows the rule)")
        pre = "llama-bpe"
        bar = "!" * 100
        log(f"{bar}\nWARNING: llama.cpp will split text differently from this tokenizer ({share} of the "
            "tokens of a code sample would come out differently), so the model sees tokens it was not "
            f"trained on.\nWritten anyway (--allow-tokenizer-mismatch) with pre-tokenizer {pre}; the file "
            "records codeforge.tokenizer_mismatch = true. Expect worse output in llama.cpp than in "
            f"codeforge.\n{bar}")

    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        w = gguf.GGUFWriter(str(tmp), arch)
        # the name `codeforge serve` gives it (printable: no terminal escapes)
        w.add_name(rundir.model_name(run))
        w.add_file_type({"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                         "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[dtype])
        w.add_context_length(m.block_size)
        w.add_embedding_length(m.n_embd)
        w.add_block_count(m.n_layer)
        w.add_feed_forward_length(m.ffn_hidden)
        w.add_head_count(m.n_head)
        w.add_head_count_kv(m.n_kv_head)
        if m.norm == "layernorm":
            w.add_layer_norm_eps(m.norm_eps)
        else:
            w.add_layer_norm_rms_eps(m.norm_eps)
        if m.pos == "rope":
            w.add_rope_freq_base(m.rope_base)
            w.add_rope_dimension_count(m.head_dim)
            w.add_key_length(m.head_dim)
            w.add_value_length(m.head_dim)
        w.add_vocab_size(m.vocab_size)
        write_tokenizer(w, tok, m.vocab_size, pre)
        w.add_string("codeforge.checkpoint", printable(str(ck)))
        w.add_string("codeforge.model", json.dumps(m.to_dict()))
        w.add_string("codeforge.tokenizer_hash", tok.hash)
        w.add_bool("codeforge.tokenizer_mismatch", mismatch is not None)
        for name, t in tensors.items():
            a = t.numpy().astype(np.float32)
            q = _qtype(name, a, dtype)
            if q == gguf.GGMLQuantizationType.F32:
                w.add_tensor(name, a)
            elif q == gguf.GGMLQuantizationType.F16:
                w.add_tensor(name, a.astype(np.float16))
            else:
                w.add_tensor(name, gguf.quants.quantize(a, q), raw_dtype=q)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    modelfile = write_modelfile(out, tok, cfg, m.block_size)
    return {"arch": arch, "pre": pre, "checkpoint": str(ck), "out": str(out), "bytes": out.stat().st_size,
            "tokenizer_mismatch": mismatch, "modelfile": str(modelfile)}


# Ollama's TEMPLATE (Go's text/template): .Suffix set (an editor's fill-in-the-middle request, `ollama`'s
# /api/generate with "suffix") gives the PSM prompt fim.infill_text writes; .Messages (chat) the ChatML turns
# chat.py renders; else the prompt as it is. Ollama offers "insert" only for a template that mentions .Suffix.
FIM_TEMPLATE = ("{{- if .Suffix }}<fim_prefix>{{ .Prompt }}<fim_suffix>{{ .Suffix }}<fim_middle>")
CHAT_TEMPLATE_GO = ("{{- else if .Messages }}{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content "
                    "}}<|im_end|>\n{{ end }}<|im_start|>assistant\n")
MODELFILE_SAMPLING = {"temperature": 0.2, "top_k": 20}  # what `codeforge eval` samples completions with


def modelfile_text(gguf_name: str, tok, chat: bool, context: int) -> str:
    """An Ollama Modelfile for the GGUF file `gguf_name` beside it: FROM, a TEMPLATE that fills the middle
    for editors (and speaks ChatML for a chat run), the stop tokens, the context and sampling."""
    # "{{ else }}" after the chat branch: a dash would trim the newline that ends its generation prompt
    fim = FIM_TEMPLATE
    for name in ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"):  # an imported tokenizer's own spelling
        fim = fim.replace(name, tok.special_text(name) or name)
    template = fim + (CHAT_TEMPLATE_GO + "{{ else }}" if chat else "{{- else }}") + "{{ .Prompt }}{{ end }}"
    stops = [EOT] + (["<|im_end|>"] if chat and tok.special_ids.get("<|im_end|>") is not None else [])
    lines = [f"# Ollama: ollama create NAME -f {shlex.quote(gguf_name.removesuffix('.gguf') + '.Modelfile')} "
             f"(written by codeforge export)",
             f"FROM ./{gguf_name}", f'TEMPLATE """{template}"""']
    lines += [f'PARAMETER stop "{s}"' for s in stops]
    lines += [f"PARAMETER num_ctx {context}"] + [f"PARAMETER {k} {v}" for k, v in MODELFILE_SAMPLING.items()]
    return "\n".join(lines) + "\n"


def write_modelfile(out: Path, tok, cfg: dict, context: int) -> Path:
    """OUT's Ollama Modelfile, beside it as NAME.Modelfile (NAME: the file's name without .gguf)."""
    path = out.with_name(out.name.removesuffix(".gguf") + ".Modelfile")
    path.write_text(modelfile_text(out.name, tok, speaks_chat(cfg), context))
    return path
