"""Export and import parity: a codeforge run exported to Hugging Face computes the same logits, greedy tokens,
token ids and chat rendering in transformers; a transformers model imported into codeforge does the same in
reverse; GGUF files hold llama.cpp's names, layouts and metadata; llama.cpp itself agrees (slow: it builds
llama-cpp-python). Tiny random models built in the test; nothing is downloaded."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from codeforge.checkpoint import load_model, save_checkpoint
from codeforge.cli import main
from codeforge.models import build_model
from codeforge.models.gpt import GPTConfig
from codeforge.tokenizer import CodeTokenizer

transformers = pytest.importorskip("transformers")

CODE = [
    'def fibonacci(n: int) -> int:\n    """Return the n-th Fibonacci number."""\n    a, b = 0, 1\n'
    '    for _ in range(n):\n        a, b = b, a + b\n    return a\n',
    'package main\n\nimport "fmt"\n\nfunc Max(a, b int) int {\n\tif a > b {\n\t\treturn a\n\t}\n\treturn '
    'b\n}\n\nfunc main() {\n\tfmt.Println(Max(3, 4)) // 4\n}\n',
]
CONVERSATION = {"messages": [
    {"role": "system", "content": "You write Go."},
    {"role": "user", "content": "Reverse a string."},
    {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
        "name": "run_tests", "arguments": "{\"path\": \"rev.go\"}"}}]},
    {"role": "tool", "content": "ok 2 tests"},
    {"role": "assistant", "content": "func Reverse(s string) string {\n\treturn s\n}"}],
    "tools": [{"type": "function", "function": {"name": "run_tests", "parameters": {"type": "object"}}}]}

# Every family and the features that choose it (models/gpt.py fields); "zero": biases set to zero after init.
FAMILIES = {
    "gpt2": ("GPT2LMHeadModel", dict()),
    "gpt2-nobias-untied": ("GPT2LMHeadModel", dict(bias=False, tie_embeddings=False)),
    "llama-gqa": ("LlamaForCausalLM", dict(pos="rope", norm="rmsnorm", mlp="swiglu", bias=False, n_kv_head=2,
                                           tie_embeddings=False, rope_base=500000.0)),
    "llama-bias": ("LlamaForCausalLM", dict(pos="rope", norm="rmsnorm", mlp="swiglu", bias=True)),
    "qwen2": ("Qwen2ForCausalLM", dict(pos="rope", norm="rmsnorm", mlp="swiglu", bias=True, n_kv_head=2,
                                       zero=("attn.c_proj.bias", "mlp.c_fc.bias", "mlp.c_proj.bias"))),
    "qwen3": ("Qwen3ForCausalLM", dict(pos="rope", norm="rmsnorm", mlp="swiglu", bias=False, qk_norm=True,
                                       n_kv_head=2, norm_eps=1e-6)),
    "arcee-gelu": ("ArceeForCausalLM", dict(pos="rope", norm="rmsnorm", mlp="gelu", bias=False)),  # seed 003
    "arcee-relu2": ("ArceeForCausalLM", dict(pos="rope", norm="rmsnorm", mlp="relu2", bias=False,
                                             tie_embeddings=False)),
}


@pytest.fixture(scope="module")
def tok(tokenizer_dir) -> CodeTokenizer:
    return CodeTokenizer.load(tokenizer_dir)


def randomize(model: torch.nn.Module, seed: int, zero: tuple[str, ...] = ()) -> None:
    """Weights far from their init (norm gains around 1, biases non-zero), so a swapped, transposed or
    missing tensor shows in the logits; larger than init so greedy choices are not near-ties."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and name.endswith("weight"):  # norm gains
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=g))
            if name.endswith(zero):
                p.zero_()


def make_run(root: Path, tokenizer_dir: Path, seed: int = 0, zero: tuple[str, ...] = (), **model_kw) -> Path:
    """A run directory with one checkpoint of a tiny random model (vocab from the test tokenizer)."""
    tok = CodeTokenizer.load(tokenizer_dir)
    kw = dict(vocab_size=64 * -(-tok.vocab_size // 64), block_size=192, n_layer=2, n_head=4, n_embd=64)
    m = GPTConfig(**{**kw, **model_kw})
    model = build_model(m)
    randomize(model, seed, zero)
    config = {"model": m.to_dict(), "train": {}, "tokenizer_hash": tok.hash}
    save_checkpoint(root, 1, model, config, {}, {"tokenizer": tokenizer_dir}, keep_last=1)
    return root


def code_batch(tok: CodeTokenizer, n: int = 64) -> torch.Tensor:
    rows = [tok.encode(t)[:n] for t in CODE]
    assert all(len(r) == n for r in rows), [len(r) for r in rows]
    return torch.tensor(rows)


@torch.no_grad()
def greedy_ours(model, tok, prompt: list[int], n: int) -> list[int]:
    from codeforge.engine import Engine, SamplingParams
    eng = Engine(model, tok, "cpu", "fp32")
    out = []
    for step in eng.generate_ids([prompt],
                                 SamplingParams(max_new_tokens=n, temperature=0, stop_at_eot=False)):
        out.append(step[0])
    return out


@torch.no_grad()
def greedy_hf(hf, prompt: list[int], n: int) -> list[int]:
    from transformers import GenerationConfig
    # generate() fills unset fields from the model's own generation_config.json, whose eos is the tokenizer's
    # end-of-text: clear it there too, or a greedy path through that id stops early and the lengths differ.
    hf.generation_config.eos_token_id = None
    gc = GenerationConfig(max_new_tokens=n, min_new_tokens=0, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
    out = hf.generate(torch.tensor([prompt]), generation_config=gc, attention_mask=torch.ones(1, len(prompt),
                                                                                                 dtype=torch.long))
    return out[0, len(prompt):].tolist()


# -- export --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", list(FAMILIES))
def test_hf_export_parity(family, tmp_path, tokenizer_dir, tok, capsys):
    from transformers import AutoModelForCausalLM
    cls, kw = FAMILIES[family]
    run = make_run(tmp_path / "run", tokenizer_dir, seed=list(FAMILIES).index(family) + 101, **kw)
    out = tmp_path / "hf"
    verify = [] if family in ("gpt2", "qwen3") else ["--no-verify"]  # the command's own check, twice
    assert main(["export", "--run", str(run), "--format", "hf", "--out", str(out), *verify]) == 0
    said = capsys.readouterr().out
    assert f"as {cls}" in said and ("parity:" in said) == (not verify)
    for f in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
              "tokenizer_config.json", "special_tokens_map.json"):
        assert (out / f).is_file(), f
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [cls]

    model, _, _, _ = load_model(run, torch.device("cpu"))
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(hf).__name__ == cls
    idx = code_batch(tok)
    with torch.no_grad():
        diff = (model(idx) - hf(idx).logits).abs().max().item()
    assert diff <= 1e-4, diff
    prompt = idx[0, :24].tolist()
    assert greedy_ours(model, tok, prompt, 64) == greedy_hf(hf, prompt, 64)


def test_hf_tokenizer_ids_and_chat_template(tmp_path, tokenizer_dir, tok):
    from transformers import AutoTokenizer

    from codeforge.chat import encode_conversation, render_text
    run = make_run(tmp_path / "run", tokenizer_dir)
    out = tmp_path / "hf"
    assert main(["export", "--run", str(run), "--format", "hf", "--out", str(out), "--no-verify"]) == 0
    at = AutoTokenizer.from_pretrained(out)
    for text in CODE + ["", "  \t\n\n x = 'é' + \"日本\"  # 🚀\r\n"]:
        assert at.encode(text, add_special_tokens=False) == tok.encode(text)
        assert at.decode(tok.encode(text)) == text
    msgs, tools = CONVERSATION["messages"], CONVERSATION["tools"]
    for gen in (False, True):
        text = at.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=gen)
        assert text == render_text(msgs, tools, add_generation_prompt=gen)
        assert at.encode(text, add_special_tokens=False) == encode_conversation(tok, msgs, tools, gen)[0]
    gen_cfg = json.loads((out / "generation_config.json").read_text())
    assert gen_cfg["eos_token_id"] == [tok.eot_id, tok.special_ids["<|im_end|>"]]
    fim = tok.special_ids["<fim_middle>"]
    assert at.pad_token == "<pad>" and at.convert_tokens_to_ids("<fim_middle>") == fim
    assert at.decode([fim], skip_special_tokens=True) == ""  # known to transformers as a special token


@pytest.mark.parametrize("kw,words", [
    (dict(pos="rope", norm="layernorm", mlp="swiglu", bias=False), ["norm=layernorm with rotary positions"]),
    (dict(pos="learned", norm="rmsnorm", mlp="relu2", n_kv_head=2),
     ["norm=rmsnorm with learned positions", "mlp=relu2 with learned positions", "n_kv_head=2"]),
    (dict(pos="rope", norm="rmsnorm", mlp="gelu", qk_norm=True, bias=False), ["qk_norm with mlp=gelu"]),
    (dict(pos="rope", norm="rmsnorm", mlp="swiglu", qk_norm=True, bias=True), ["Qwen3 has no MLP biases"]),
])
def test_unmappable_features_are_refused_with_the_list(kw, words, tmp_path, tokenizer_dir, capsys):
    run = make_run(tmp_path / "run", tokenizer_dir, **kw)
    assert main(["export", "--run", str(run), "--format", "hf", "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert "no transformers class computes this model" in err
    for w in words:
        assert w in err, (w, err)
    assert not (tmp_path / "hf").exists()


def test_an_option_no_family_maps_is_refused_not_dropped():
    """A model option the exporters have never heard of (here a made-up sliding window on a config of its
    own), set on a model, refuses the export instead of writing a file that computes another model; left at
    its default it changes nothing."""
    from dataclasses import dataclass, field

    from codeforge.export import ExportError
    from codeforge.export.hf import choose_family
    from codeforge.models.gpt import GPTConfig

    @dataclass
    class WindowConfig(GPTConfig):
        window: int = field(default=0)

    llama = dict(pos="rope", norm="rmsnorm", mlp="swiglu", bias=False)
    assert choose_family(WindowConfig(**llama)).model_type == "llama"
    with pytest.raises(ExportError, match="window=16"):
        choose_family(WindowConfig(**llama, window=16))


def test_bad_input_gets_clear_messages(tmp_path, tokenizer_dir, capsys):
    empty = tmp_path / "empty_run"
    empty.mkdir()
    assert main(["export", "--run", str(empty), "--format", "hf", "--out", str(tmp_path / "a")]) == 2
    assert "no checkpoint in" in capsys.readouterr().err
    assert main(["export", "--run", str(tmp_path / "nope"), "--format", "hf", "--out",
                 str(tmp_path / "a")]) == 2
    assert "does not exist" in capsys.readouterr().err
    run = make_run(tmp_path / "run", tokenizer_dir)
    out = tmp_path / "hf"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert main(["export", "--run", str(run), "--format", "hf", "--out", str(out)]) == 2
    assert "already exists" in capsys.readouterr().err and (out / "keep.txt").read_text() == "mine"
    assert main(["export", "--run", str(run), "--format", "hf", "--out", str(out), "--overwrite",
                 "--no-verify"]) == 0
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").exists()
    # an unsupported family on import
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"model_type": "bert"}))
    assert main(["import", "--hf", str(bert), "--out", str(tmp_path / "r2")]) == 2
    assert "model_type 'bert' is not supported" in capsys.readouterr().err
    assert main(["import", "--hf", str(tmp_path / "nothing"), "--out", str(tmp_path / "r3")]) == 2
    assert "no config.json" in capsys.readouterr().err


# -- import --------------------------------------------------------------------------------------------------

def hf_model(kind: str, vocab: int):
    """A small random transformers model of each importable family, built by transformers itself."""
    import transformers as tr
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    cfg = {
        "gpt2": lambda: tr.GPT2Config(vocab_size=vocab, n_positions=256, n_embd=64, n_layer=2, n_head=4),
        "llama": lambda: tr.LlamaConfig(**common, tie_word_embeddings=False, rope_theta=50000.0),
        "qwen2": lambda: tr.Qwen2Config(**common, tie_word_embeddings=True),
        "qwen3": lambda: tr.Qwen3Config(**common, head_dim=16, tie_word_embeddings=True),
        "arcee": lambda: tr.ArceeConfig(**common, head_dim=16, tie_word_embeddings=False),
    }[kind]()
    torch.manual_seed(7)
    model = tr.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # transformers' init leaves norms at 1 and biases at 0: move them
        for name, p in model.named_parameters():
            if name.endswith("bias") or p.dim() == 1:
                p.add_(0.05 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=g))
    return model


@pytest.mark.parametrize("kind", ["gpt2", "llama", "qwen2", "qwen3", "arcee"])
def test_hf_import_parity(kind, tmp_path, tokenizer_dir, tok, capsys):
    from codeforge.export.hf import write_tokenizer_files
    hf = hf_model(kind, vocab=64 * -(-tok.vocab_size // 64))
    src = tmp_path / "src"
    hf.save_pretrained(src)
    write_tokenizer_files(tokenizer_dir, src)
    run = tmp_path / "run"
    verify = [] if kind == "llama" else ["--no-verify"]
    assert main(["import", "--hf", str(src), "--out", str(run), *verify]) == 0
    assert ("parity:" in capsys.readouterr().out) == (not verify)
    model, _, ck, cfg = load_model(run, torch.device("cpu"))
    assert cfg["imported_from"]["model_type"] == kind
    idx = code_batch(tok)
    with torch.no_grad():
        diff = (model(idx) - hf(idx).logits).abs().max().item()
    assert diff <= 1e-4, diff
    prompt = idx[1, :24].tolist()
    assert greedy_ours(model, tok, prompt, 64) == greedy_hf(hf, prompt, 64)
    # and back out: the same class, the same logits
    back = tmp_path / "back"
    assert main(["export", "--run", str(run), "--format", "hf", "--out", str(back), "--no-verify"]) == 0
    assert json.loads((back / "config.json").read_text())["architectures"] == hf.config.architectures
    again = transformers.AutoModelForCausalLM.from_pretrained(back, dtype=torch.float32).eval()
    with torch.no_grad():
        assert (again(idx).logits - hf(idx).logits).abs().max().item() <= 1e-5


def test_imported_run_trains_with_init_from(tmp_path, tokenizer_dir, data_dir, capsys):
    """An imported model is a run like any other: --init-from takes its shape and weights."""
    from codeforge.export.hf import write_tokenizer_files
    tok = CodeTokenizer.load(tokenizer_dir)
    src = tmp_path / "src"
    hf_model("qwen2", vocab=64 * -(-tok.vocab_size // 64)).save_pretrained(src)
    write_tokenizer_files(tokenizer_dir, src)
    assert main(["import", "--hf", str(src), "--out", str(tmp_path / "imp"), "--no-verify"]) == 0
    assert main(["train", "--data", str(data_dir), "--out", str(tmp_path / "ft"), "--init-from",
                 str(tmp_path / "imp"),
                 "--max-iters", "2", "--batch-size", "2", "--eval-every", "0", "--eval-tokens", "256",
                 "--no-tensorboard", "--no-progress", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "initialised weights from" in out
    cfg = json.loads((tmp_path / "ft" / "checkpoints" / "step_000002" / "config.json").read_text())
    assert (
        cfg["model"]["qk_norm"] is False and cfg["model"]["n_kv_head"] == 2 and cfg["model"]["bias"] is True
    )


def test_import_refuses_what_codeforge_does_not_compute(tmp_path, tokenizer_dir, capsys):
    import transformers as tr
    from codeforge.export.hf import write_tokenizer_files
    cfg = tr.LlamaConfig(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, rope_scaling={"rope_type": "linear", "factor": 2.0})
    src = tmp_path / "src"
    tr.LlamaForCausalLM(cfg).save_pretrained(src)
    write_tokenizer_files(tokenizer_dir, src)
    assert main(["import", "--hf", str(src), "--out", str(tmp_path / "run")]) == 2
    assert "rope scaling 'linear'" in capsys.readouterr().err
    shutil.rmtree(src)


def test_import_refuses_a_tokenizer_whose_split_rule_backtracks(tmp_path, tokenizer_dir, tok, capsys):
    """Before: imported, and `codeforge generate` on a 35-character prompt ended in the tokenizer's
    PanicException. Now refused, naming tokenizer.json, its pre_tokenizer and the fix; nothing is written."""
    from codeforge.export.hf import write_tokenizer_files
    from test_tokenizer import BACKTRACKING_SPLITS, assert_raw_tokenizers_panics, with_split
    bad = with_split(tokenizer_dir, tmp_path / "bad", BACKTRACKING_SPLITS[1])
    assert_raw_tokenizers_panics(bad)
    src = tmp_path / "src"
    hf_model("llama", vocab=64 * -(-tok.vocab_size // 64)).save_pretrained(src)
    write_tokenizer_files(bad, src)
    assert_raw_tokenizers_panics(src)
    assert main(["import", "--hf", str(src), "--out", str(tmp_path / "run"), "--no-verify"]) == 2
    err = capsys.readouterr().err
    assert f"{src / 'tokenizer.json'}: the split rule in its pre_tokenizer" in err, err
    assert "backtrack" in err and "codeforge tokenizer train" in err and "Traceback" not in err, err
    assert not (tmp_path / "run").exists()


# -- GGUF ----------------------------------------------------------------------------------------------------

gguf = pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def llama3_tok_dir(tmp_path_factory, code_corpus) -> Path:
    """A tokenizer trained with the llama.cpp-compatible split (tokenizer train --split llama3)."""
    from codeforge.corpus import CorpusOptions, CorpusStats, iter_documents
    from codeforge.tokenizer import train_tokenizer
    out = tmp_path_factory.mktemp("tok3") / "tokenizer"
    from conftest import STDLIB
    texts = (d.text for d in iter_documents([str(code_corpus), str(STDLIB / "json")],
                                            CorpusOptions(languages=["go", "python"]), CorpusStats()))
    train_tokenizer(texts, 1024, out, split="llama3")
    return out


def read_gguf(path: Path) -> tuple[dict, dict]:
    r = gguf.GGUFReader(str(path))
    fields = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    return fields, {t.name: t for t in r.tensors}


def gguf_values(t) -> torch.Tensor:
    """A GGUF tensor's values as float32 in PyTorch's (out, in) shape."""
    data = (
        gguf.quants.dequantize(t.data, t.tensor_type) if t.tensor_type.name not in ("F32", "F16") else t.data
    )
    return torch.from_numpy(np.asarray(data, dtype=np.float32).copy()).reshape(
        tuple(reversed(t.shape.tolist()))
    )



@pytest.mark.parametrize("family,arch", [("gpt2", "gpt2"), ("llama-gqa", "llama"), ("qwen2", "qwen2"),
                                         ("qwen3", "qwen3"), ("arcee-relu2", "arcee")])
def test_gguf_names_shapes_and_metadata(family, arch, tmp_path, llama3_tok_dir):
    from codeforge.export.gguf import permute_rows
    _, kw = FAMILIES[family]
    run = make_run(tmp_path / "run", llama3_tok_dir, **kw)
    out = tmp_path / "m.gguf"
    assert main(["export", "--run", str(run), "--format", "gguf", "--out", str(out)]) == 0
    model, tok, _, _ = load_model(run, torch.device("cpu"))
    m = model.cfg
    fields, tensors = read_gguf(out)
    assert fields["general.architecture"] == arch
    assert fields[f"{arch}.block_count"] == m.n_layer and fields[f"{arch}.embedding_length"] == m.n_embd
    assert fields[f"{arch}.attention.head_count"] == m.n_head
    assert fields[f"{arch}.attention.head_count_kv"] == m.n_kv_head
    assert (
        fields[f"{arch}.context_length"] == m.block_size
        and fields[f"{arch}.feed_forward_length"] == m.ffn_hidden
    )
    if m.pos == "rope":
        assert fields[f"{arch}.rope.freq_base"] == m.rope_base
        assert fields[f"{arch}.attention.layer_norm_rms_epsilon"] == pytest.approx(m.norm_eps)
    else:
        assert fields[f"{arch}.attention.layer_norm_epsilon"] == pytest.approx(m.norm_eps)
    # tokenizer: tokens in id order, padded to the model's vocab, merges, special ids, template
    assert fields["tokenizer.ggml.model"] == "gpt2" and fields["tokenizer.ggml.pre"] == "llama-bpe"
    toks = fields["tokenizer.ggml.tokens"]
    assert len(toks) == m.vocab_size and toks[tok.eot_id] == "<|endoftext|>"
    assert toks[tok.vocab_size:] == [f"[PAD{i}]" for i in range(tok.vocab_size, m.vocab_size)]
    types = fields["tokenizer.ggml.token_type"]
    assert (
        types[tok.special_ids["<fim_prefix>"]] == gguf.TokenType.CONTROL
        and types[300] == gguf.TokenType.NORMAL
    )
    assert len(fields["tokenizer.ggml.merges"]) == tok.vocab_size - 256 - 24
    sid = tok.special_ids
    assert fields["tokenizer.ggml.eos_token_id"] == tok.eot_id
    assert fields["tokenizer.ggml.eot_token_id"] == sid["<|im_end|>"]
    assert fields["tokenizer.ggml.padding_token_id"] == sid["<pad>"]
    assert [fields[f"tokenizer.ggml.fim_{k}_token_id"] for k in ("pre", "suf", "mid")] == \
        [sid["<fim_prefix>"], sid["<fim_suffix>"], sid["<fim_middle>"]]
    assert (
        fields["tokenizer.ggml.add_bos_token"] is False
        and "<|im_start|>" in fields["tokenizer.chat_template"]
    )
    # tensors: llama.cpp's names, our values (Q/K rows permuted for llama/arcee only)
    sd = model.state_dict()
    hd, L = m.head_dim, m.n_layer
    expect = {"token_embd.weight": sd["wte.weight"], "output_norm.weight": sd["ln_f.weight"]}
    if not m.tie_embeddings:
        expect["output.weight"] = sd["lm_head.weight"]
    for i in range(L):
        q, k, v = sd[f"blocks.{i}.attn.c_attn.weight"].split([m.n_head * hd, m.n_kv_head * hd,
                                                              m.n_kv_head * hd])
        if arch == "gpt2":
            expect[f"blk.{i}.attn_qkv.weight"] = sd[f"blocks.{i}.attn.c_attn.weight"]
            expect[f"blk.{i}.attn_norm.bias"] = sd[f"blocks.{i}.ln_1.bias"]
        else:
            permuted = arch in ("llama", "arcee")
            expect[f"blk.{i}.attn_q.weight"] = permute_rows(q, m.n_head) if permuted else q
            expect[f"blk.{i}.attn_k.weight"] = permute_rows(k, m.n_kv_head) if permuted else k
            expect[f"blk.{i}.attn_v.weight"] = v
        if arch == "qwen2":
            expect[f"blk.{i}.attn_q.bias"] = sd[f"blocks.{i}.attn.c_attn.bias"][: m.n_head * hd]
            assert f"blk.{i}.attn_output.bias" not in tensors  # zero, and llama.cpp's qwen2 has none
        if arch == "qwen3":
            expect[f"blk.{i}.attn_k_norm.weight"] = sd[f"blocks.{i}.attn.k_norm.weight"]
        if m.mlp == "swiglu":
            gate, up = sd[f"blocks.{i}.mlp.c_fc.weight"].chunk(2)
            expect[f"blk.{i}.ffn_gate.weight"], expect[f"blk.{i}.ffn_up.weight"] = gate, up
        else:
            expect[f"blk.{i}.ffn_up.weight"] = sd[f"blocks.{i}.mlp.c_fc.weight"]
        expect[f"blk.{i}.ffn_down.weight"] = sd[f"blocks.{i}.mlp.c_proj.weight"]
    for name, want in expect.items():
        assert name in tensors, (name, sorted(tensors))
        assert torch.equal(gguf_values(tensors[name]), want), name
    assert all(t.tensor_type.name == "F32" for t in tensors.values())
    assert ("position_embd.weight" in tensors) == (arch == "gpt2")


def test_permuted_rows_are_llama_cpp_rotary_pairs():
    """Why llama/arcee Q/K rows are permuted: llama.cpp's rope type NORM rotates adjacent pairs (2i, 2i+1);
    ours (and transformers') rotates (i, i + hd/2). Rotating the permuted rows the NORM way gives the
    permuted result of rotating ours, so the attention scores (dot products over all rows) are equal."""
    from codeforge.export.gguf import permute_rows
    from codeforge.models.gpt import apply_rope, rope_tables
    n_head, hd, T = 3, 8, 5
    w = torch.randn(n_head * hd, 7)
    x = torch.randn(T, 7)
    cos_full, sin_full = rope_tables(hd, T, 10000.0)
    ours = apply_rope((x @ w.t()).view(T, n_head, hd).transpose(0, 1), cos_full, sin_full)  # (n_head, T, hd)
    cos, sin = cos_full[:, :hd // 2], sin_full[:, hd // 2:]  # the angles
    y = (x @ permute_rows(w, n_head).t()).view(T, n_head, hd).transpose(0, 1)
    a, b = y[..., 0::2], y[..., 1::2]  # adjacent pairs
    norm = torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)
    perm = permute_rows(torch.arange(hd).float().unsqueeze(1), 1).squeeze(1).long()
    assert torch.allclose(norm, ours[..., perm], atol=1e-6)


def test_gguf_f16_and_q8_0(tmp_path, llama3_tok_dir):
    _, kw = FAMILIES["llama-gqa"]
    run = make_run(tmp_path / "run", llama3_tok_dir, **kw)
    model, _, _, _ = load_model(run, torch.device("cpu"))
    down = model.state_dict()["blocks.1.mlp.c_proj.weight"]
    sizes = {}
    for dtype, mat, tol in (("f16", "F16", 1e-3), ("q8_0", "Q8_0", 2e-3)):
        out = tmp_path / f"m-{dtype}.gguf"
        assert main(["export", "--run", str(run), "--format", "gguf", "--out", str(out), "--dtype",
                     dtype]) == 0
        fields, tensors = read_gguf(out)
        assert tensors["blk.1.ffn_down.weight"].tensor_type.name == mat
        assert tensors["blk.1.ffn_norm.weight"].tensor_type.name == "F32"  # vectors stay float32
        assert (gguf_values(tensors["blk.1.ffn_down.weight"]) - down).abs().max() <= tol
        sizes[dtype] = out.stat().st_size
    assert sizes["q8_0"] < sizes["f16"]
    assert main(["export", "--run", str(run), "--format", "gguf", "--out", str(tmp_path / "m-f16.gguf")]) == 2


@pytest.fixture(scope="module")
def code_tok_dir(tmp_path_factory, code_corpus) -> Path:
    """A tokenizer trained with codeforge's own code split (tokenizer train --split code)."""
    from codeforge.corpus import CorpusOptions, CorpusStats, iter_documents
    from codeforge.tokenizer import train_tokenizer
    out = tmp_path_factory.mktemp("tokcode") / "tokenizer"
    texts = (d.text for d in iter_documents([str(code_corpus)], CorpusOptions(languages=["go", "python"]),
                                            CorpusStats()))
    train_tokenizer(texts, 1024, out, split="code")
    return out


def test_the_default_tokenizer_exports_to_gguf_with_its_recorded_name(tmp_path, tokenizer_dir, capsys):
    """The shared test tokenizer is trained with the default split: no flag needed, the name comes from the
    tokenizer's metadata, and a metadata file that disagrees with tokenizer.json is refused."""
    meta = json.loads((tokenizer_dir / "codeforge_tokenizer.json").read_text())
    assert meta["split"] == "llama3" and meta["llama_cpp_pre"] == "llama-bpe"
    run = make_run(tmp_path / "run", tokenizer_dir, **FAMILIES["qwen2"][1])
    out = tmp_path / "m.gguf"
    assert main(["export", "--run", str(run), "--format", "gguf", "--out", str(out), "--dtype", "q8_0"]) == 0
    fields, _ = read_gguf(out)
    assert fields["tokenizer.ggml.pre"] == "llama-bpe" and fields["codeforge.tokenizer_mismatch"] is False
    assert (
        fields["tokenizer.ggml.fim_pre_token_id"]
        == CodeTokenizer.load(tokenizer_dir).special_ids["<fim_prefix>"]
    )
    assert "<|im_start|>" in fields["tokenizer.chat_template"]
    # tampered metadata: the recorded name must be the rule tokenizer.json applies
    tok_copy = tmp_path / "tok"
    shutil.copytree(tokenizer_dir, tok_copy)
    m = json.loads((tok_copy / "codeforge_tokenizer.json").read_text())
    (tok_copy / "codeforge_tokenizer.json").write_text(json.dumps(m | {"llama_cpp_pre": "qwen2"}))
    run2 = make_run(tmp_path / "run2", tok_copy, **FAMILIES["qwen2"][1])
    assert main(["export", "--run", str(run2), "--format", "gguf", "--out", str(tmp_path / "m2.gguf")]) == 2
    assert "do not belong together" in capsys.readouterr().err


def test_code_split_runs_still_export_to_hf(tmp_path, code_tok_dir, capsys):
    """A run on a code-split tokenizer (every run made before llama3 became the default) exports to Hugging
    Face as before: transformers' logits and token ids equal codeforge's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    run = make_run(tmp_path / "run", code_tok_dir, seed=7, **FAMILIES["llama-gqa"][1])
    out = tmp_path / "hf"
    assert main(["export", "--run", str(run), "--format", "hf", "--out", str(out)]) == 0
    assert "parity:" in capsys.readouterr().out
    model, tok, _, _ = load_model(run, torch.device("cpu"))
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    hf_tok = AutoTokenizer.from_pretrained(out)
    for text in CODE:
        assert hf_tok(text, add_special_tokens=False)["input_ids"] == tok.encode(text)
    idx = code_batch(tok)
    with torch.no_grad():
        assert (model(idx) - hf(idx).logits).abs().max().item() <= 1e-4


@pytest.mark.xfail(strict=True,
                   reason="transformers 5 forces its Qwen2Tokenizer on model_type qwen2 (it lists qwen2 "
                   "among models whose hub tokenizer_class is wrong), which rebuilds the pre-tokenizer with "
                   "Qwen2's regex (single digits) and an NFC normalizer "
                   "instead of reading tokenizer.json: numbers of 2+ "
                   "digits get other ids. PreTrainedTokenizerFast.from_pretrained(dir) reads it exactly.")
def test_qwen2_export_autotokenizer_ids(tmp_path):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from codeforge.tokenizer import train_tokenizer
    tok, _ = train_tokenizer(iter(["x = 12345 + 678\ncafe\u0301 = 'cafe\u0301'\n" * 50]), 300,
                             tmp_path / "tok")
    run = make_run(tmp_path / "run", tmp_path / "tok", **FAMILIES["qwen2"][1])
    out = tmp_path / "hf"
    assert main(["export", "--run", str(run), "--format", "hf", "--out", str(out), "--no-verify"]) == 0
    text = "x = 12345 + 678\ncafe\u0301 = 1\n"  # "123" is one token here; the accent is a combining one
    assert PreTrainedTokenizerFast.from_pretrained(out).encode(text,
                                                               add_special_tokens=False) == tok.encode(text)
    assert AutoTokenizer.from_pretrained(out).encode(text, add_special_tokens=False) == tok.encode(text)


def test_gguf_code_split_is_refused_loudly_unless_allowed(tmp_path, code_tok_dir, capsys):
    run = make_run(tmp_path / "run", code_tok_dir, **FAMILIES["llama-gqa"][1])
    out = tmp_path / "m.gguf"
    assert main(["export", "--run", str(run), "--format", "gguf", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert (
        "code split, which llama.cpp does not implement" in err
        and "--split llama3" in err
        and not out.exists()
    )
    line = err.strip().splitlines()
    assert len(line) == 1 and "\\p{L}" not in err and len(line[0]) < 480, err  # one sentence, no regex
    assert main(["export", "--run", str(run), "--format", "gguf", "--out", str(out), "--verbose"]) == 2
    assert "\\p{L}" in capsys.readouterr().err  # --verbose shows the rule
    assert main(["export", "--run", str(run), "--format", "gguf", "--out", str(out),
                 "--allow-tokenizer-mismatch"]) == 0
    said = capsys.readouterr().out
    assert "WARNING" in said and "would come out differently" in said
    fields, _ = read_gguf(out)
    assert fields["codeforge.tokenizer_mismatch"] is True and fields["tokenizer.ggml.pre"] == "llama-bpe"


def test_gguf_refuses_what_llama_cpp_cannot_compute(tmp_path, llama3_tok_dir, capsys):
    run = make_run(tmp_path / "run", llama3_tok_dir, **FAMILIES["arcee-gelu"][1])  # the seed-003 presets
    assert main(["export", "--run", str(run), "--format", "gguf", "--out", str(tmp_path / "m.gguf")]) == 2
    err = capsys.readouterr().err
    assert "llama.cpp has no architecture for this model" in err and "--format hf" in err


# -- llama.cpp itself (slow: llama-cpp-python builds llama.cpp from source, ~14 minutes on 2 cores) ----------

# Held-out text with what trips tokenizers: tabs, CRLF, Unicode identifiers and strings, long numbers, runs of
# blank lines and trailing spaces, a BOM-less emoji, special-token text inside a file.
EDGE_TEXTS = ["func Größe(ñ int) int {\r\n\treturn ñ * 12345678901234567890\r\n}\r\n",
              "def 计算(x):\n\t\treturn x + 3.14159265358979323846e-10  \n\n\n\n# naïve café  \t\n",
              "  x\t=  'é日本🚀'  \r\n\n\n  # done",
              "s = '<|endoftext|> <fim_prefix> not special here'\nn = 0x7fffffffffffffff_0000\n"]


def held_out_code() -> list[str]:
    """Files the test tokenizers never saw: Python's email/ package (they train on json/ and asyncio/) and,
    where golang-src is installed, Go's net/http."""
    from conftest import STDLIB
    texts = [p.read_text(errors="replace") for p in sorted((STDLIB / "email").glob("*.py"))[:12]]
    go = sorted(Path("/usr/share").glob("go-*/src/net/http"))
    if go:
        texts += [p.read_text(errors="replace") for p in sorted(go[-1].glob("*.go"))[:12]]
    return texts


def llama_detokenize(llama_cpp, llm, ids: list[int]) -> str:
    """The text llama.cpp generates for `ids`: its llama_token_to_piece, token by token, as llama-server and
    llama-cli write output. (llama-cpp-python's Llama.detokenize reads each piece into a 32-byte buffer and
    cuts longer tokens, a run of 40 spaces say; and llama.cpp's whole-text llama_detokenize drops the space
    before an apostrophe for llama-bpe models, HF's old clean-up, Llama 3's too.)"""
    import ctypes
    buf = ctypes.create_string_buffer(1024)
    out = b""
    for t in ids:
        n = llama_cpp.llama_token_to_piece(llm._model.vocab, t, buf, len(buf), 0, False)
        assert 0 <= n <= len(buf), n
        out += buf.raw[:n]
    return out.decode()


@pytest.mark.slow
@pytest.mark.parametrize("vocab", [8000, 32000])
def test_default_tokenizer_matches_llama_cpp(vocab, tmp_path):
    """A tokenizer trained with the default split at 8k and 32k: llama.cpp
    (through llama-cpp-python) gives the
    same token ids as codeforge on held-out Python and Go and on EDGE_TEXTS, and
    decodes them back to the text."""
    llama_cpp = pytest.importorskip("llama_cpp",
                                    reason="pip install llama-cpp-python (builds llama.cpp; see README)")
    from conftest import STDLIB

    from codeforge.corpus import CorpusOptions, CorpusStats, iter_documents
    from codeforge.tokenizer import train_tokenizer
    sources = [str(STDLIB / d)
               for d in ("json", "asyncio", "collections", "importlib", "unittest", "logging")]
    go = sorted(Path("/usr/share").glob("go-*/src"))
    if go:
        sources += [str(go[-1] / d)
                    for d in ("strings", "bytes", "fmt", "sort", "os", "io", "bufio", "encoding")]
    texts = (d.text
             for d in iter_documents(sources, CorpusOptions(languages=["go", "python"]), CorpusStats()))
    tok_dir = tmp_path / "tok"
    tok, meta = train_tokenizer(texts, vocab, tok_dir)
    assert meta["llama_cpp_pre"] == "llama-bpe"
    run = make_run(tmp_path / "run", tok_dir, n_layer=1, n_embd=32, n_head=2, block_size=64)
    out = tmp_path / "m.gguf"
    assert main(["export", "--run", str(run), "--format", "gguf", "--out", str(out)]) == 0
    llm = llama_cpp.Llama(model_path=str(out), n_ctx=64, vocab_only=True, verbose=False)
    n_ids = n_texts = 0
    for text in held_out_code() + EDGE_TEXTS:
        ids = tok.encode(text)
        assert llm.tokenize(text.encode(), add_bos=False, special=False) == ids, text[:80]
        assert llama_detokenize(llama_cpp, llm, ids) == text
        n_ids += len(ids)
        n_texts += 1
    print(f"\nvocab {tok.vocab_size}: {n_ids} token ids equal on {n_texts} held-out texts")
    assert n_texts >= 12 + len(EDGE_TEXTS)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama-gqa", "qwen2", "qwen3", "gpt2", "arcee-relu2"])
def test_llama_cpp_parity(family, tmp_path, tokenizer_dir, monkeypatch):
    """llama.cpp loads the exported f32 GGUF of a run on the default tokenizer and agrees with codeforge: the
    same token ids on code, logits within 1e-3 (max abs), the same 32-token greedy continuation."""
    llama_cpp = pytest.importorskip("llama_cpp",
                                    reason="pip install llama-cpp-python (builds llama.cpp; see README)")
    from conftest import STDLIB
    run = make_run(tmp_path / "run", tokenizer_dir, seed=11, **{**FAMILIES[family][1], "block_size": 512})
    out = tmp_path / "m.gguf"
    assert main(["export", "--run", str(run), "--format", "gguf", "--out", str(out)]) == 0
    model, tok, _, _ = load_model(run, torch.device("cpu"))
    f32 = 0  # GGML_TYPE_F32: llama.cpp keeps keys and values in f16 by default
    llm = llama_cpp.Llama(model_path=str(out), n_ctx=512, n_batch=512, n_threads=2, logits_all=True,
                          verbose=False, type_k=f32, type_v=f32)

    texts = CODE + [(STDLIB / "json" / "decoder.py").read_text()[:6000]] + EDGE_TEXTS
    n_ids = 0
    for text in texts:
        ids = tok.encode(text)
        assert llm.tokenize(text.encode(), add_bos=False, special=False) == ids, text[:60]
        assert llama_detokenize(llama_cpp, llm, ids) == text
        n_ids += len(ids)

    ids = tok.encode(texts[2])[:256]
    llm.reset()
    llm.eval(ids)
    theirs = torch.from_numpy(np.array(llm.scores[: len(ids)], dtype=np.float32))
    with torch.no_grad():
        ours = model(torch.tensor([ids]))[0]
    diff = (ours - theirs).abs().max().item()
    print(f"\n{family}: {n_ids} token ids equal on {len(texts)} code samples; logits max abs diff {diff:.2e} "
          f"over {len(ids)} positions x {ours.shape[-1]} vocab (max |logit| {ours.abs().max().item():.1f})")
    if model.cfg.mlp == "gelu":
        # llama.cpp's CPU GELU reads an f16 table at the input rounded to f16
        # (ggml-cpu/vec.h, GGML_GELU_FP16):
        # with that GELU emulated the difference drops from 1.3e-3 to 3.6e-4; the
        # tensors are exact (GGUF tests).
        with monkeypatch.context() as mp:
            mp.setattr(torch.nn.functional, "gelu", ggml_gelu_f16)
            with torch.no_grad():
                emulated = (model(torch.tensor([ids]))[0] - theirs).abs().max().item()
        print(f"{family}: with llama.cpp's f16 GELU table emulated: max abs diff {emulated:.2e}")
        # the rest: not pinned down (see docs/LOG.md#2026-11-22-gguf-parity)
        assert emulated <= 1e-3, emulated
    assert diff <= (2e-3 if model.cfg.mlp == "gelu" else 1e-3), diff

    prompt = ids[:40]
    llm.reset()
    llm.eval(prompt)
    cont = []
    for _ in range(32):
        nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        cont.append(nxt)
        llm.eval([nxt])
    ours_cont = greedy_ours(model, tok, prompt, 32)
    print(f"{family}: greedy 32 tokens equal: {cont == ours_cont} (llama.cpp {cont[:6]}..., codeforge "
          f"{ours_cont[:6]}...)")
    assert cont == ours_cont


def ggml_gelu_f16(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """GELU as llama.cpp's CPU backend computes it: tanh approximation at the input rounded to f16, the result
    stored as f16; x <= -10 gives 0 and x >= 10 gives x."""
    xh = x.half().float()
    y = (0.5 * xh * (1 + torch.tanh(0.7978845608028654 * xh * (1 + 0.044715 * xh * xh)))).half().float()
    return torch.where(x <= -10, torch.zeros_like(x), torch.where(x >= 10, x, y))


# -- what the export leaves behind (issue 29) ----------------------------------------------------------------

def test_hf_export_files_modes_generation_config_and_quiet_output(tmp_path, tokenizer_dir, capfd):
    """Every exported file has the same mode, a normal file's under the umask (model.safetensors was 0600);
    generation_config.json sets no max_length, so generate(max_new_tokens=...) does not warn about it; the
    parity check's transformers load prints no progress bar into codeforge's output."""
    import logging
    import os
    import stat
    import warnings
    from transformers import AutoModelForCausalLM
    run = make_run(tmp_path / "run", tokenizer_dir, seed=7)
    out = tmp_path / "hf"
    capfd.readouterr()
    assert main(["export", "--run", str(run), "--format", "hf", "--out", str(out)]) == 0
    said = capfd.readouterr()
    assert "parity:" in said.out
    for text in (said.out, said.err):
        assert "Loading weights" not in text and "it/s]" not in text and "%|" not in text, text

    umask = os.umask(0)
    os.umask(umask)
    files = sorted(p for p in out.iterdir() if p.is_file())
    assert {p.name for p in files} >= {"config.json", "model.safetensors", "generation_config.json",
                                       "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"}
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in files}
    assert set(modes.values()) == {0o666 & ~umask}, {k: oct(v) for k, v in modes.items()}
    if not umask & 0o044:
        assert all(m & 0o044 == 0o044 for m in modes.values()), modes  # group- and other-readable

    gen = json.loads((out / "generation_config.json").read_text())
    assert "max_length" not in gen
    assert gen["eos_token_id"] and gen["bos_token_id"] is not None and "pad_token_id" in gen
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    handler = Keep(logging.DEBUG)
    tlog = logging.getLogger("transformers")
    tlog.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with torch.no_grad():
                hf.generate(torch.tensor([[1, 2, 3]]), attention_mask=torch.ones(1, 3, dtype=torch.long),
                            max_new_tokens=4, do_sample=False)
    finally:
        tlog.removeHandler(handler)
    said = capfd.readouterr()
    texts = [str(w.message) for w in caught] + [r.getMessage() for r in records] + [said.out, said.err]
    assert not [t for t in texts if "max_length" in t], texts


def test_normal_file_modes_follow_the_umask(tmp_path):
    import os
    import stat
    from codeforge.export.hf import current_umask, normal_file_modes
    (tmp_path / "a.safetensors").write_bytes(b"x")
    (tmp_path / "a.safetensors").chmod(0o600)
    (tmp_path / "b.json").write_text("{}")
    old = os.umask(0o027)
    try:
        assert current_umask() == 0o027
        normal_file_modes(tmp_path)
    finally:
        os.umask(old)
    assert {stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()} == {0o640}


def test_terminal_escapes_in_a_run_name_are_neither_written_nor_printed(tmp_path, tokenizer_dir, capsys):
    """Found in the second hostile review: a run directory named with terminal escape bytes (ESC ] 0 ; ... BEL
    retitles the window; ESC [ 2 J clears it) went raw into the GGUF's general.name and onto the terminal, and
    into the server's model name. Now each is written as escapes."""
    from codeforge.rundir import model_name as run_name
    evil = "m\x1b]0;pwned\x07\x1b[2Jodel\u202e"
    run = make_run(tmp_path / evil, tokenizer_dir, **FAMILIES["qwen2"][1])
    out = tmp_path / "m.gguf"
    assert main(["export", "--run", str(run), "--format", "gguf", "--out", str(out)]) == 0
    printed = capsys.readouterr()
    fields, _ = read_gguf(out)
    for text in (fields["general.name"], fields["codeforge.checkpoint"], printed.out, printed.err,
                 run_name(str(run))):
        assert "\x1b" not in text and "\x07" not in text and "\u202e" not in text, repr(text)
    assert fields["general.name"] == "m\\x1b]0;pwned\\x07\\x1b[2Jodel\\u202e"
    assert run_name(str(run)) == fields["general.name"]


GO_RENDER = r'''package main

import (
	"encoding/json"
	"os"
	"strings"
	"text/template"
)

// The fields of Ollama's template data that a Modelfile TEMPLATE reads.
type Message struct {
	Role    string
	Content string
}
type Data struct {
	Prompt   string
	Suffix   string
	Messages []Message
}

func main() {
	raw, _ := os.ReadFile(os.Args[1])
	s := string(raw)
	i := strings.Index(s, "TEMPLATE \"\"\"") + len("TEMPLATE \"\"\"")
	j := strings.Index(s[i:], "\"\"\"")
	t := template.Must(template.New("modelfile").Parse(s[i : i+j]))
	var cases []Data
	in, _ := os.ReadFile(os.Args[2])
	if err := json.Unmarshal(in, &cases); err != nil {
		panic(err)
	}
	var out []string
	for _, c := range cases {
		var b strings.Builder
		if err := t.Execute(&b, c); err != nil {
			panic(err)
		}
		out = append(out, b.String())
	}
	enc, _ := json.Marshal(out)
	os.Stdout.Write(enc)
}
'''


def go_render(modelfile: Path, cases: list[dict], tmp: Path) -> list[str]:
    """Each case rendered by Go's text/template (the engine Ollama renders a Modelfile TEMPLATE with)."""
    import os
    import shutil
    import subprocess
    go = shutil.which("go")
    if go is None:
        pytest.skip("Go is not installed (apt-get install golang-go)")
    (tmp / "render.go").write_text(GO_RENDER)
    (tmp / "cases.json").write_text(json.dumps(cases))
    env = {**os.environ, "GOCACHE": str(tmp / "gocache"), "GOPATH": str(tmp / "gopath"), "GO111MODULE": "off",
           "GOFLAGS": "", "CGO_ENABLED": "0"}
    r = subprocess.run([go, "run", str(tmp / "render.go"), str(modelfile), str(tmp / "cases.json")],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.parametrize("chat", [False, True])
def test_the_ollama_modelfile_renders_codeforges_prompts_in_go(tmp_path, tokenizer_dir, chat):
    """`export --format gguf` writes NAME.Modelfile beside NAME.gguf; its TEMPLATE, rendered by Go's
    text/template as Ollama does, gives fim.infill_text's PSM prompt for an editor's prefix and suffix (token
    for token the prompt codeforge infills with), the prompt itself for plain completion, and for a chat run
    chat.py's ChatML with the generation prompt."""
    from codeforge.chat import render_text
    from codeforge.fim import infill_ids, infill_text
    run = make_run(tmp_path / "run", tokenizer_dir)
    if chat:  # a run a chat stage trained
        cfg_path = next((run / "checkpoints").glob("step_*")) / "config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["train"]["stage"] = "sft"
        cfg_path.write_text(json.dumps(cfg))
        man = next((run / "checkpoints").glob("step_*")) / "manifest.json"
        if man.exists():  # the manifest records the config's sha256: record the edited one
            import hashlib
            m = json.loads(man.read_text())
            for k, v in m.get("files", {}).items():
                if k == "config.json":
                    v["sha256"] = hashlib.sha256(cfg_path.read_bytes()).hexdigest()
                    v["bytes"] = cfg_path.stat().st_size
            man.write_text(json.dumps(m))
    out = tmp_path / "m.q8_0.gguf"
    assert main(["export", "--run", str(run), "--format", "gguf", "--out", str(out), "--dtype", "q8_0"]) == 0
    fields, _ = read_gguf(out)  # the ids llama-server's /infill builds its repo-level prompt with
    sp = CodeTokenizer.load(tokenizer_dir).special_ids
    assert fields["tokenizer.ggml.fim_rep_token_id"] == sp["<|repo_name|>"]
    assert fields["tokenizer.ggml.fim_sep_token_id"] == sp["<|file_sep|>"]
    assert fields["tokenizer.ggml.fim_pre_token_id"] == sp["<fim_prefix>"]
    modelfile = tmp_path / "m.q8_0.Modelfile"
    text = modelfile.read_text()
    assert "FROM ./m.q8_0.gguf" in text and 'PARAMETER stop "<|endoftext|>"' in text and "num_ctx 192" in text
    assert ('PARAMETER stop "<|im_end|>"' in text) == chat
    prefix, suffix = "def add(a, b):\n    return ", "\n\nprint(add(1, 2))\n"
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Reverse a string."}]
    cases = [{"Prompt": prefix, "Suffix": suffix}, {"Prompt": "def f(x):"}]
    if chat:
        cases.append({"Messages": [{"Role": m["role"], "Content": m["content"]} for m in msgs]})
    got = go_render(modelfile, cases, tmp_path)
    tok = CodeTokenizer.load(tokenizer_dir)
    assert got[0] == infill_text(prefix, suffix)
    assert tok.encode(got[0], allow_special=True) == infill_ids(tok, prefix, suffix)
    assert got[1] == "def f(x):"
    if chat:
        assert got[2] == render_text(msgs, add_generation_prompt=True)


def test_each_family_is_one_record_both_exporters_read():
    """A family's HF and GGUF facts sit in one record (export/families.py): both maps name the same
    codeforge tensors, the importer accepts exactly the recorded families, and each class name is unique."""
    from codeforge.export.families import FAMILIES
    from codeforge.export.hf import IMPORTABLE, Family
    assert IMPORTABLE == tuple(FAMILIES)
    assert len({r.hf_class for r in FAMILIES.values()}) == len(FAMILIES)
    for mt, r in FAMILIES.items():
        assert set(r.hf_keys) == set(r.gguf_tensors), mt
        f = Family(mt)
        assert (f.name, f.model_type, f.keys, f.hidden_act) == (r.hf_class, mt, r.hf_keys, r.hidden_act)
