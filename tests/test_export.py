"""Export and import parity: a codeforge run exported to Hugging Face computes the same logits, greedy tokens,
token ids and chat rendering in transformers; a transformers model imported into codeforge does the same in
reverse; GGUF files hold llama.cpp's names, layouts and metadata; llama.cpp itself agrees (slow: it builds
llama-cpp-python). Tiny random models built in the test; nothing is downloaded."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

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
    'package main\n\nimport "fmt"\n\nfunc Max(a, b int) int {\n\tif a > b {\n\t\treturn a\n\t}\n\treturn b\n}\n'
    '\nfunc main() {\n\tfmt.Println(Max(3, 4)) // 4\n}\n',
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
    for step in eng.generate_ids([prompt], SamplingParams(max_new_tokens=n, temperature=0, stop_at_eot=False)):
        out.append(step[0])
    return out


@torch.no_grad()
def greedy_hf(hf, prompt: list[int], n: int) -> list[int]:
    from transformers import GenerationConfig
    gc = GenerationConfig(max_new_tokens=n, min_new_tokens=0, do_sample=False, eos_token_id=None, pad_token_id=0)
    out = hf.generate(torch.tensor([prompt]), generation_config=gc, attention_mask=torch.ones(1, len(prompt),
                                                                                                 dtype=torch.long))
    return out[0, len(prompt):].tolist()


# -- export --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", list(FAMILIES))
def test_hf_export_parity(family, tmp_path, tokenizer_dir, tok, capsys):
    from transformers import AutoModelForCausalLM
    cls, kw = FAMILIES[family]
    run = make_run(tmp_path / "run", tokenizer_dir, seed=hash(family) % 1000, **kw)
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


def test_bad_input_gets_clear_messages(tmp_path, tokenizer_dir, capsys):
    empty = tmp_path / "empty_run"
    empty.mkdir()
    assert main(["export", "--run", str(empty), "--format", "hf", "--out", str(tmp_path / "a")]) == 2
    assert "no checkpoint in" in capsys.readouterr().err
    assert main(["export", "--run", str(tmp_path / "nope"), "--format", "hf", "--out", str(tmp_path / "a")]) == 2
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


# -- import --------------------------------------------------------------------------------------------------------

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
    assert main(["train", "--data", str(data_dir), "--out", str(tmp_path / "ft"), "--init-from", str(tmp_path / "imp"),
                 "--max-iters", "2", "--batch-size", "2", "--eval-every", "0", "--eval-tokens", "256",
                 "--no-tensorboard", "--no-progress", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "initialised weights from" in out
    cfg = json.loads((tmp_path / "ft" / "checkpoints" / "step_000002" / "config.json").read_text())
    assert cfg["model"]["qk_norm"] is False and cfg["model"]["n_kv_head"] == 2 and cfg["model"]["bias"] is True


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
