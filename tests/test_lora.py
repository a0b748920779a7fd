"""LoRA on the same Trainer and data path as every stage (models/lora.py, with PEFT): only the adapters train;
checkpoints hold the merged weights every reader takes as an ordinary model, and the adapter alone; a resumed
run equals the straight one; the merged model is what PEFT's own forward computes."""

import json
import os
import signal

import pytest
import torch

from codeforge.checkpoint import find_checkpoint, load_model
from codeforge.config import ConfigError
from codeforge.models import lora
from test_trainer import cfg_for, losses, train_run

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def base(data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("lora") / "base"
    train_run(cfg_for(data_dir, out, train__max_iters=8, train__save_every=8))
    return out


def lora_cfg(data_dir, out, base, **over):
    return cfg_for(data_dir, out,
                   **{"train__init_from": str(base), "train__lora_rank": 4, "train__lora_alpha": 8,
                                     "train__learning_rate": 1e-2, **over})


def test_only_the_adapters_train_and_the_checkpoint_is_an_ordinary_model(data_dir, base, tmp_path):
    out = tmp_path / "ft"
    r = train_run(lora_cfg(data_dir, out, base, train__max_iters=8))
    assert r["step"] == 8
    ck = find_checkpoint(out, "latest")
    # 2 blocks x 4 layers (attention q/k/v and output, MLP in and out) x (A, B); every adapter trained: PEFT
    # starts each B at zero, so a non-zero B is the optimizer's doing
    tensors = lora.read_adapter(ck)[1]
    assert len(tensors) == 2 * 4 * 2 and all(v.abs().sum() > 0 for k, v in tensors.items() if "lora_B" in k)
    conf = json.loads((ck / lora.ADAPTER_CONFIG).read_text())
    assert conf["r"] == 4 and conf["lora_alpha"] == 8 and conf["target_modules"] == sorted(lora.TARGETS)
    adapter_bytes = (ck / lora.ADAPTER_FILE).stat().st_size
    assert adapter_bytes < (ck / "model.safetensors").stat().st_size / 4  # the adapter alone is small
    # the frozen weights did not move: outside the adapted layers the merged checkpoint is the base
    merged, tok, _, cfg = load_model(out, torch.device("cpu"), "latest")
    start, _, _, _ = load_model(base, torch.device("cpu"), "latest")
    ms, ss = merged.state_dict(), start.state_dict()
    assert torch.equal(ms["wte.weight"], ss["wte.weight"]) and torch.equal(
        ms["ln_f.weight"], ss["ln_f.weight"]
    )
    changed = [k for k in ms if not torch.equal(ms[k], ss[k])]
    assert changed and all(k.split(".")[-2] in lora.TARGETS for k in changed), changed
    assert cfg["lora_base"]["checkpoint"] == str(find_checkpoint(base, "auto").resolve())
    # the merged weights compute what PEFT's own (unmerged) LoRA forward computes with the saved adapter
    peft_model, _, _, _ = load_model(base, torch.device("cpu"), "latest")
    lora.attach(peft_model, 4, 8)
    lora.load_adapter(peft_model, lora.read_adapter(ck)[1], str(ck))
    x = torch.tensor([tok.encode("def add(a, b):\n    return a + b\n")[:24]])
    with torch.no_grad():
        torch.testing.assert_close(merged(x), peft_model(x), rtol=1e-4, atol=1e-4)
    # the numpy decoding step reads the weights itself: it must not stand in for a model with adapters
    from codeforge.models import cpu_decode
    assert cpu_decode.fingerprint(peft_model) is None and cpu_decode.fingerprint(merged) is not None


def test_a_resumed_lora_run_is_the_straight_one(data_dir, base, tmp_path, monkeypatch):
    import shutil
    base = shutil.copytree(base, tmp_path / "base")  # this test damages its starting weights at the end
    over = dict(train__max_iters=8, train__save_every=2, train__optimizer="adamw")
    train_run(lora_cfg(data_dir, tmp_path / "a", base, **over))
    straight = losses(tmp_path / "a")
    import codeforge.train.trainer as tr
    real = tr.Trainer._optimisation_step

    def step_then_signal(self):
        out = real(self)
        if self.step == 4:
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    monkeypatch.setattr(tr.Trainer, "_optimisation_step", step_then_signal)
    assert train_run(lora_cfg(data_dir, tmp_path / "b", base, **over))["interrupted"] == "SIGTERM"
    monkeypatch.setattr(tr.Trainer, "_optimisation_step", real)
    train_run(lora_cfg(data_dir, tmp_path / "b", base, **over), resume=True)
    resumed = losses(tmp_path / "b")
    assert sorted(resumed) == sorted(straight) == list(range(1, 9))
    assert all(resumed[s] == straight[s] for s in straight), (resumed, straight)
    a = load_model(tmp_path / "a", torch.device("cpu"), "latest")[0].state_dict()
    b = load_model(tmp_path / "b", torch.device("cpu"), "latest")[0].state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    # the same targets listed in another order are the same run (one spelling of the set)
    assert (
        lora_cfg(data_dir, tmp_path / "b", base, train__lora_targets="c_proj, c_fc,c_attn").train.lora_targets
        == "c_attn,c_fc,c_proj"
    )
    # another rank asked on resume: refused, the adapters' shapes are the run's
    with pytest.raises(ConfigError, match="lora_rank"):
        train_run(cfg_for(data_dir, tmp_path / "b", train__init_from=str(base), train__lora_rank=8,
                          train__lora_alpha=8, train__learning_rate=1e-2, **over), resume=True)
    # the starting weights changed on disk: a resume would put the adapters on other weights, so it is refused
    f = find_checkpoint(base, "auto") / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-8] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match=r"started from .*does not match the sha256.*--init-from"):
        train_run(lora_cfg(data_dir, tmp_path / "b", base, **{**over, "train__max_iters": 10}), resume=True)


def test_lora_bad_settings_say_what_to_do(data_dir, base, tmp_path):
    with pytest.raises(ConfigError, match="--init-from RUN"):
        train_run(cfg_for(data_dir, tmp_path / "x", train__lora_rank=4, train__max_iters=2))
    with pytest.raises(ConfigError, match=r"--lora-targets q_proj.*no linear layer of that name"):
        train_run(lora_cfg(data_dir, tmp_path / "y", base, train__max_iters=2, train__lora_targets="q_proj"))
    # the output head is read by the loss directly: an adapter there would never train (and a tied one would
    # be saved twice), so it is not a target
    with pytest.raises(ConfigError, match=r"--lora-targets lm_head.*the blocks have no linear layer"):
        train_run(lora_cfg(data_dir, tmp_path / "z", base, train__max_iters=2, train__lora_targets="lm_head"))
    with pytest.raises(ConfigError, match="--lora-targets is empty"):
        lora_cfg(data_dir, tmp_path / "w", base, train__lora_targets=" , ")
    # stages that do not train adapters refuse the option rather than fine-tune every weight
    with pytest.raises(ConfigError,
                       match=r"language-model stages \(pretrain, code, sft, tools\); --stage dpo"):
        lora_cfg(data_dir, tmp_path / "v", base, train__stage="dpo")


def test_lora_on_an_imported_qwen2_with_its_own_fim_tokens_exports_merged(
    tmp_path, tokenizer_dir, code_corpus
):
    """The path of a downloaded open code model, at tiny size: a Qwen2 checkpoint
    whose tokenizer spells its FIM
    tokens Qwen2.5-Coder's way (<|fim_prefix|>), imported; its data prepared with its tokenizer; LoRA with FIM
    on the same loader; the merged HF export computes in transformers what codeforge computes, and the GGUF
    and the Ollama Modelfile carry the model's own FIM tokens."""
    import transformers

    from codeforge.cli import main
    from codeforge.export.hf import write_tokenizer_files
    from codeforge.tokenizer import CodeTokenizer
    from test_export import hf_model
    tok = CodeTokenizer.load(tokenizer_dir)
    src = tmp_path / "qwen"
    hf = hf_model("qwen2", vocab=64 * -(-tok.vocab_size // 64))
    hf.save_pretrained(src)
    write_tokenizer_files(tokenizer_dir, src)
    text = (src / "tokenizer.json").read_text()
    for ours in ("fim_prefix", "fim_suffix", "fim_middle"):
        text = text.replace(f'"<{ours}>"', f'"<|{ours}|>"')
    (src / "tokenizer.json").write_text(text)
    for f in src.glob("*.json"):  # and wherever else transformers' files name them
        f.write_text(f.read_text().replace("<fim_", "<|fim_").replace("_prefix>", "_prefix|>")
                     .replace("_suffix>", "_suffix|>").replace("_middle>", "_middle|>"))
    assert main(["import", "--hf", str(src), "--out", str(tmp_path / "imp"), "--no-verify"]) == 0
    imp_tok = CodeTokenizer.load(find_checkpoint(tmp_path / "imp", "auto") / "tokenizer")
    fim_id = imp_tok.tok.token_to_id("<|fim_prefix|>")
    assert fim_id is not None and imp_tok.special_ids["<fim_prefix>"] == fim_id
    assert imp_tok.tok.token_to_id("<fim_prefix>") is None
    data = tmp_path / "data"
    assert main(["prepare", "--input", str(code_corpus), "--tokenizer",
                 str(find_checkpoint(tmp_path / "imp", "auto")
                                                                              / "tokenizer"),
                 "--out", str(data), "--val-fraction", "0.2"]) == 0
    assert main(["train", "--data", str(data), "--out", str(tmp_path / "ft"), "--init-from",
                 str(tmp_path / "imp"),
                 "--lora-rank", "4", "--lora-alpha", "8", "--fim-rate", "0.5", "--max-iters", "3",
                 "--batch-size", "2",
                 "--eval-every", "0", "--learning-rate", "0.01", "--no-tensorboard", "--no-progress",
                 "--device", "cpu"]) == 0
    merged, _, ck, cfg = load_model(tmp_path / "ft", torch.device("cpu"), "latest")
    assert cfg["train"]["lora_rank"] == 4 and (ck / lora.ADAPTER_FILE).exists()
    # an editor's raw FIM prompt in the model's own spelling is read as its FIM tokens (serve's completions)
    from codeforge.engine import Engine

    ids = Engine(merged, imp_tok, torch.device("cpu"), "fp32")._encode_prompt(
        "<|fim_prefix|>a = <|fim_suffix|>\n<|fim_middle|>"
    )
    assert ids[0] == fim_id and imp_tok.special_ids["<fim_middle>"] == ids[-1]
    out = tmp_path / "hf"
    assert main(["export", "--run", str(tmp_path / "ft"), "--format", "hf", "--out", str(out),
                 "--no-verify"]) == 0
    again = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    idx = torch.tensor([imp_tok.encode("def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n")[:20]])
    with torch.no_grad():
        assert (again(idx).logits - merged(idx)).abs().max().item() <= 1e-4
        assert (again(idx).logits - hf(idx).logits).abs().max().item() > 1e-3  # the adapters moved it
    import gguf
    g = tmp_path / "m.gguf"
    assert main(["export", "--run", str(tmp_path / "ft"), "--format", "gguf", "--out", str(g)]) == 0
    fields = gguf.GGUFReader(str(g)).fields
    assert fields["tokenizer.ggml.fim_pre_token_id"].contents() == fim_id
    assert "<|fim_prefix|>{{ .Prompt }}<|fim_suffix|>" in (tmp_path / "m.Modelfile").read_text()


def test_plan_counts_the_adapters_alone_as_trained():
    """`codeforge plan --lora-rank`: gradients and optimizer state are the adapters' alone (a 1.5B Qwen2 shape
    on a 12 GB card: fits with LoRA, not with full fine-tuning, at the same batch and checkpointing)."""
    from codeforge.config import resolve
    from codeforge.train.memory import GIB, estimate, fits, report
    shape = {"model.n_layer": 28, "model.n_embd": 1536, "model.n_head": 12, "model.n_kv_head": 2,
             "model.ffn_hidden": 8960, "model.vocab_size": 151936, "model.block_size": 2048,
             "train.batch_size": 1, "train.grad_checkpointing": True, "train.loss_chunk_rows": 512}
    full = resolve(["qwen-small", "12gb-card"], None, [], shape)
    lo = resolve(["qwen-small", "12gb-card"], None, [], {**shape, "train.lora_rank": 16})
    pf, pl = estimate(full.model, full.train, 1, "fp16"), estimate(lo.model, lo.train, 1, "fp16")
    # rank 16 on q/k/v, both output projections and the MLP's input, 28 blocks
    C, kv, H = 1536, 2 * 128, 8960
    assert pl.adapters == 28 * 16 * ((C + C + 2 * kv) + (C + C) + (C + 2 * H) + (H + C))
    assert pl.rows["gradients"][0] == 4 * pl.adapters and pl.rows["optimizer state"][0] == 8 * pl.adapters
    assert pl.rows["activations"] == pf.rows["activations"]
    assert fits(pl, 12 * GIB)[0] and not fits(pf, 12 * GIB)[0]
    assert "LoRA rank 16: 16,400,384 trainable" in report(pl, lo.model, lo.train, "fp16", 12 * GIB)


def test_the_adapter_alone_goes_out_small_and_comes_back_merged(data_dir, base, tmp_path, capsys):
    from codeforge.cli import main
    run = tmp_path / "ft"
    train_run(lora_cfg(data_dir, run, base, train__max_iters=4))
    out = tmp_path / "adapter"
    assert main(["export", "--run", str(run), "--format", "adapter", "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted([lora.ADAPTER_FILE, lora.ADAPTER_CONFIG,
                                                            "codeforge_adapter.json"])
    assert (
        sum(p.stat().st_size for p in out.iterdir())
        < (find_checkpoint(run, "auto") / "model.safetensors").stat().st_size
    )
    assert main(["import", "--adapter", str(out), "--base", str(base), "--out",
                 str(tmp_path / "merged")]) == 0
    capsys.readouterr()
    a = load_model(run, torch.device("cpu"), "auto")[0].state_dict()
    b = load_model(tmp_path / "merged", torch.device("cpu"), "auto")[0].state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # onto other weights than it was trained on: refused, naming the right ones
    other = tmp_path / "other"
    train_run(cfg_for(data_dir, other, train__max_iters=2, train__save_every=2))
    assert main(["import", "--adapter", str(out), "--base", str(other), "--out", str(tmp_path / "m2")]) == 2
    assert "adapters mean something only on the weights they were trained on" in capsys.readouterr().err
    assert main(["export", "--run", str(base), "--format", "adapter", "--out", str(tmp_path / "a2")]) == 2
    assert "not trained with --lora-rank" in capsys.readouterr().err
    assert main(["import", "--adapter", str(out), "--out", str(tmp_path / "m3")]) == 2
    assert "needs --base RUN" in capsys.readouterr().err


def test_quickstart_from_an_open_model_with_lora_in_one_command(tmp_path, tokenizer_dir, capsys):
    """`codeforge quickstart --corpus MYREPO --from-hf DIR --lora-rank R`:
    import, prepare with the model's own
    tokenizer, LoRA on the code, the scores on the held-out files (bits per byte and eval --repo's line)."""
    from codeforge.export.hf import write_tokenizer_files
    from codeforge.quickstart import run_quickstart
    from codeforge.tokenizer import CodeTokenizer
    from conftest import STDLIB
    from test_export import hf_model
    tok = CodeTokenizer.load(tokenizer_dir)
    src = tmp_path / "qwen"
    hf_model("qwen2", vocab=64 * -(-tok.vocab_size // 64)).save_pretrained(src)
    write_tokenizer_files(tokenizer_dir, src)
    out = tmp_path / "qs"
    r = run_quickstart(str(out), corpus=str(STDLIB / "wsgiref"), max_iters=3, from_hf=str(src), lora_rank=4,
                       device="cpu")
    printed = capsys.readouterr().out
    assert "model: imported" in printed and "LoRA adapters of rank 4" in printed and r["step"] == 3
    # the imported model's data is unknown: its score is not called held-out, and says why
    assert "fill-in-the-middle on your held-out files" not in printed and "base:" not in printed
    assert ("fill-in-the-middle on your files (as an editor asks" in printed and "not a held-out score: the "
            "imported model qwen: what it was trained on is not known" in printed)
    assert r["repo_eval"]["trained_on_files"] > 0 and not r["repo_eval"]["held_out_checked"]
    assert (out / "tokenizer" / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    ck = find_checkpoint(out / "run", "latest")
    assert (ck / lora.ADAPTER_FILE).exists() and json.loads((ck / "config.json").read_text())["model"][
        "n_kv_head"
    ] == 2
    assert r["bits_per_byte"] > 0


def test_codeforge_serve_serves_a_lora_run_as_its_adapters_compute(data_dir, base, tmp_path):
    """`codeforge serve --run LORA_RUN` serves the merged weights: its greedy completion is the one the
    unmerged model (the base with PEFT's adapters attached) writes."""
    from codeforge.engine import Engine, SamplingParams
    from test_serve import serving
    run = tmp_path / "ft"
    train_run(lora_cfg(data_dir, run, base, train__max_iters=4, train__learning_rate=5e-2))
    ck = find_checkpoint(run, "latest")
    unmerged, tok, _, _ = load_model(base, torch.device("cpu"), "latest")
    lora.attach(unmerged, 4, 8)
    lora.load_adapter(unmerged, lora.read_adapter(ck)[1], str(ck))
    want = Engine(unmerged, tok, torch.device("cpu"), "fp32").generate(
        ["def add(a, b):"], SamplingParams(max_new_tokens=12, temperature=0))[0]
    with serving(run) as live:
        r = live.client.completions.create(model="tiny", prompt="def add(a, b):", max_tokens=12,
                                           temperature=0)
    assert r.choices[0].text == want
