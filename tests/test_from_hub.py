"""`--from-hf` / `import --hf` take a Hugging Face Hub name as well as a directory (export/hub.py), and a
fine-tune of an open model says its time and memory before it trains (train/estimate.py).

Nothing here reaches the network: a name is read from a Hub cache built in the test (huggingface_hub's
layout: models--ORG--NAME/{refs/main, snapshots/REV/FILE -> ../../blobs/HASH}) with HF_HUB_OFFLINE=1, and
the network's failure is the library's own exception, raised by a stand-in for snapshot_download."""

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

from codeforge.export import ExportError
from codeforge.export import hub
from codeforge.export.hf import import_hf, write_tokenizer_files

REV = "0123456789abcdef0123456789abcdef01234567"


def hub_cache(root: Path, name: str, src: Path) -> Path:
    """A Hugging Face Hub cache holding `src`'s files as the snapshot of `name` at REV (refs/main -> REV)."""
    repo = root / ("models--" + name.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(REV)
    snap, blobs = repo / "snapshots" / REV, repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for f in sorted(src.iterdir()):
        h = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, blobs / h)
        (snap / f.name).symlink_to(Path("..") / ".." / "blobs" / h)
    return root


@pytest.fixture
def tiny_qwen(tmp_path, tokenizer_dir):
    """A small random Qwen2 in Hugging Face format (transformers' own), with the test tokenizer, declaring
    4,096 positions."""
    from codeforge.tokenizer import CodeTokenizer
    from test_export import hf_model
    tok = CodeTokenizer.load(tokenizer_dir)
    src = tmp_path / "Tiny-Coder"
    model = hf_model("qwen2", vocab=64 * -(-tok.vocab_size // 64))
    model.config.max_position_embeddings = 4096
    model.save_pretrained(src)
    write_tokenizer_files(tokenizer_dir, src)
    return src


@pytest.fixture
def offline_cache(tmp_path, tiny_qwen, monkeypatch):
    """HF_HUB_CACHE holding tiny_qwen as `acme/Tiny-Coder`, HF_HUB_OFFLINE=1, run from an empty directory."""
    cache = hub_cache(tmp_path / "hf-home" / "hub", "acme/Tiny-Coder", tiny_qwen)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return cache


@pytest.mark.parametrize("text,ok", [("Qwen/Qwen2.5-Coder-0.5B", True),
                                     ("deepseek-ai/deepseek-coder-1.3b-base", True),
                                     ("bigcode/starcoder2-3b", True), ("gpt2", False), ("./Qwen/x", False),
                                     ("/abs/path", False), ("a/b/c", False), ("~/models/x", False),
                                     ("org/na--me", False), ("org/name.git", False), ("org/", False),
                                     ("C:\\models\\x", False), ("org/.hidden", False)])
def test_what_counts_as_a_hub_name(text, ok):
    assert hub.is_repo_id(text) is ok


def test_an_existing_directory_wins_over_a_name(tmp_path, monkeypatch, tiny_qwen):
    """A directory that looks like ORG/NAME is that directory: no Hub, no cache looked at."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "Qwen").mkdir()
    shutil.copytree(tiny_qwen, tmp_path / "Qwen" / "Qwen2.5-Coder-0.5B")
    monkeypatch.setattr(hub, "snapshot", lambda *a, **k: pytest.fail("a directory went to the Hub"))
    assert hub.model_source("Qwen/Qwen2.5-Coder-0.5B") == (Path("Qwen/Qwen2.5-Coder-0.5B"), None)
    r = import_hf(str(tiny_qwen), tmp_path / "run", verify=False, log=lambda m: None)
    assert r["hub"] is None and r["path"] == str(tiny_qwen)


def test_a_mistyped_path_is_said_to_be_one(tmp_path):
    for bad in (tmp_path / "no" / "such" / "dir", "mymodel", "./models/qwen"):
        with pytest.raises(ExportError, match=r"no such directory \(so no config.json to read\), and not a "
                                              r"Hugging Face Hub name"):
            hub.model_source(str(bad))
    f = tmp_path / "config.json"
    f.write_text("{}")
    with pytest.raises(ExportError, match="is a file; give the model's directory"):
        hub.model_source(str(f))


def test_a_name_in_the_hub_cache_imports_offline(offline_cache, tmp_path):
    """HF_HUB_OFFLINE=1 and the model cached: imported from the snapshot, the name recorded; the context cut
    to what was asked (rotary positions: the logits still equal transformers')."""
    said: list[str] = []
    r = import_hf("acme/Tiny-Coder", tmp_path / "run", log=said.append, context=1024)
    snap = offline_cache / "models--acme--Tiny-Coder" / "snapshots" / REV
    assert r["hub"] == "acme/Tiny-Coder" and Path(r["path"]) == snap
    assert r["context"] == 1024 and r["declared_context"] == 4096 and r["max_abs_diff"] < 1e-3
    cfg = json.loads((Path(r["checkpoint"]) / "config.json").read_text())
    assert cfg["model"]["block_size"] == 1024
    assert cfg["imported_from"]["hub"] == "acme/Tiny-Coder" and cfg["imported_from"]["context"] == 4096
    assert any("HF_HUB_OFFLINE is set" in m and str(offline_cache) in m for m in said)


def test_logits_are_compared_where_transformers_copy_fits(tiny_qwen, tmp_path, monkeypatch):
    """verify=None (quickstart --from-hf): the parity check runs where a second float32 copy fits in memory,
    and is skipped, said, where it does not (a 1.5B model on a 24 GiB machine)."""
    from codeforge.export import hf
    said: list[str] = []
    monkeypatch.setattr(hf, "available_memory", lambda: (1, "MemAvailable"))
    r = import_hf(tiny_qwen, tmp_path / "a", verify=None, log=said.append)
    assert r["max_abs_diff"] is None and any("not comparing logits with transformers'" in m for m in said)
    monkeypatch.setattr(hf, "available_memory", lambda: (2**40, "MemAvailable"))
    assert import_hf(tiny_qwen, tmp_path / "b", verify=None, log=said.append)["max_abs_diff"] < 1e-3


def test_a_name_missing_from_the_cache_offline_says_how_to_get_it(offline_cache, tmp_path):
    with pytest.raises(ExportError) as e:
        import_hf("acme/Other-Coder", tmp_path / "run", log=lambda m: None)
    msg = str(e.value)
    assert "acme/Other-Coder is not in the Hugging Face cache" in msg and str(offline_cache) in msg
    assert "HF_HUB_OFFLINE is set" in msg and "hf download acme/Other-Coder" in msg
    assert "pass its path instead of the name" in msg and not (tmp_path / "run").exists()


def test_no_route_to_the_hub_is_said_plainly(tmp_path, monkeypatch):
    """Online mode but huggingface.co unreachable: the library raises LocalEntryNotFoundError (its own
    fallback to the cache found nothing); the message names the network, the cache and the way around."""
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    asked = {}

    def unreachable(name, **kw):
        asked.update(kw, name=name)
        raise LocalEntryNotFoundError("ConnectError: [Errno -2] Name or service not known")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", unreachable)
    with pytest.raises(ExportError, match="huggingface.co cannot be reached from here") as e:
        hub.model_source("Qwen/Qwen2.5-Coder-0.5B", log=lambda m: None)
    assert str(tmp_path / "cache") in str(e.value) and "--local-dir Qwen2.5-Coder-0.5B" in str(e.value)
    # only what an import reads is asked for, into the cache the environment names now
    assert asked["name"] == "Qwen/Qwen2.5-Coder-0.5B" and asked["local_files_only"] is False
    assert asked["cache_dir"] == str(tmp_path / "cache") and "*.safetensors" in asked["allow_patterns"]
    assert not any(p.endswith((".bin", ".gguf", ".pth")) for p in asked["allow_patterns"])


def test_a_cached_copy_without_weights_is_refused_by_name(tmp_path, monkeypatch, tiny_qwen):
    part = tmp_path / "part"
    part.mkdir()
    for f in ("config.json", "tokenizer.json"):
        shutil.copyfile(tiny_qwen / f, part / f)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache(tmp_path / "c", "acme/Part", part)))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ExportError, match=r"acme/Part: the copy in the Hugging Face cache .* lacks "
                                          r"\*.safetensors"):
        hub.model_source("acme/Part", log=lambda m: None)


def test_quickstart_from_a_model_without_fim_tokens_trains_without_fim(tmp_path, capsys):
    """A model whose tokenizer has no FIM tokens (Qwen2 before 2.5, Llama) is fine-tuned without
    fill-in-the-middle and without repo-level documents, said once each, and its FIM score is skipped; before,
    the loader's first batch failed with a TypeError inside fim.py."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from codeforge.open_model import tune_settings
    from codeforge.quickstart import run_quickstart
    from conftest import STDLIB
    from test_export import hf_model
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = [p.read_text() for p in sorted((STDLIB / "json").glob("*.py"))]
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=512, special_tokens=["<|endoftext|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    src = tmp_path / "no-fim"
    hf_model("qwen2", vocab=512).save_pretrained(src)
    tok.save(str(src / "tokenizer.json"))
    r = import_hf(src, tmp_path / "imported", verify=False, log=lambda m: None)
    assert tune_settings(Path(r["out"]), 4, 10_000, 4096, 560, 4)[1]["train.fim_rate"] == 0.0
    out = run_quickstart(str(tmp_path / "qs"), corpus=str(STDLIB / "wsgiref"), max_iters=2, from_hf=str(src),
                         lora_rank=4, device="cpu")
    said = capsys.readouterr().out
    assert out["step"] == 2 and "tokenizer has no repository tokens" in said
    assert "fill-in-the-middle, as editors ask" not in said
    assert "fill-in-the-middle on your files: not scored (the model's tokenizer has no FIM" in said


# -- the estimate ----------------------------------------------------------------------------------------

def qwen_cfgs(shape: str, batch: int, context: int, rank: int = 16):
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from lora_estimates import configs
    from dataclasses import replace
    m, t = configs(shape, batch, context)
    return m, replace(t, lora_rank=rank)


def test_lora_flops_skip_the_frozen_weights_gradient():
    from codeforge.models import build_model
    from codeforge.train.estimate import train_flops_per_token
    m, t = qwen_cfgs("Qwen2.5-Coder-0.5B", 1, 1024)
    with torch.device("meta"):
        model = build_model(m)
    full = train_flops_per_token(m, t.__class__(lora_rank=0))
    assert full == model.flops_per_token(1024)
    lora = train_flops_per_token(m, t)
    attn = 12 * 24 * 896 * 1024
    adapters = 24 * 16 * ((896 + 896 + 2 * 128) + (896 + 896) + (896 + 2 * 4864) + (4864 + 896))
    assert lora == pytest.approx((full - attn) * 4 / 6 + attn + 6 * adapters)
    assert 0.66 < lora / full < 0.72  # about two thirds: no weight gradients


ROW = {"shape": "Qwen2.5-Coder-0.5B", "params": 502075264, "lora_rank": 16, "batch": 2, "context": 1024,
       "precision": "bf16", "threads": 1, "seconds_per_step": 40.0, "flops_per_s": 5e10, "matmul_flops": 6e10,
       "peak_rss_gib": 6.0, "plan_gib": 4.0}


def test_the_cpu_estimate_scales_the_measured_pace_by_flops_cores_and_rate():
    from codeforge.train.estimate import cpu_estimate, plan, train_flops_per_token
    m, t = qwen_cfgs("Qwen2.5-Coder-1.5B", 2, 1024)
    fpt = train_flops_per_token(m, t)
    one = cpu_estimate(m, t, "bf16", 1, 100, rows=[ROW])
    assert one.measured and one.seconds_per_step == pytest.approx(fpt * 2048 / 5e10)
    assert one.memory == pytest.approx(plan(m, t, 1, "bf16").total("ddp") * 1.5)  # the row's peak / plan
    # two one-thread processes on a CPU whose cores multiply twice as fast: 2 x the tokens at 4 x the pace
    two = cpu_estimate(m, t, "bf16", 2, 100, per_core=1.2e11, cores=2, rows=[ROW])
    assert two.seconds_per_step == pytest.approx(one.seconds_per_step / 2)
    assert two.memory == pytest.approx(2 * one.memory) and two.seconds == 100 * two.seconds_per_step
    assert cpu_estimate(m, t, "bf16", 1, 100, rows=[]) is None


def test_the_gpu_estimate_is_labelled_an_estimate():
    from codeforge.train.estimate import GPU_ASSUMED, describe, gpu_estimate, train_flops_per_token
    m, t = qwen_cfgs("Qwen2.5-Coder-0.5B", 4, 1024)
    g = gpu_estimate(m, t, 560)
    assert not g.measured and g.where == "one H100 SXM"
    rate = 989e12 * GPU_ASSUMED["mfu"]
    assert g.seconds_per_step == pytest.approx(train_flops_per_token(m, t) * 4096 / rate)
    text = "\n".join(describe(g))
    assert "estimated, not measured" in text and "37.6%" in text and "560 steps" in text


def two_rank_cfg(monkeypatch, free_gib: float):
    """quickstart --from-hf's 1.5B LoRA config on 2 local ranks (2 x 1024 each), on a CPU with free_gib."""
    from dataclasses import replace

    from codeforge.config import RunConfig
    from codeforge.train import estimate
    m, t = qwen_cfgs("Qwen2.5-Coder-1.5B", 2, 1024)
    monkeypatch.setattr(estimate, "MEASURED_CPU", [ROW])
    monkeypatch.setattr(estimate, "available_memory", lambda: (int(free_gib * estimate.GIB), "MemAvailable"))
    monkeypatch.setattr(estimate, "core_rate", lambda precision: 6e10)
    monkeypatch.setattr(estimate, "usable_cores", lambda: 2)
    return RunConfig(model=m, train=replace(t, local_ranks=2, device="cpu", precision="bf16", max_iters=50,
                                            time_budget=480.0))


def test_before_training_fits_a_cpu_run_to_memory_keeping_the_global_batch(monkeypatch):
    """Two local ranks each hold a whole model: where they would not fit, one process takes the global batch,
    then smaller batches accumulate to it; where everything fits nothing changes."""
    from codeforge.train import estimate
    cfg = two_rank_cfg(monkeypatch, 24)
    new, lines = estimate.before_training(cfg)
    text = "\n".join(lines)
    t = new.train
    assert t.local_ranks == 1 and t.batch_size * t.grad_accum_steps == 4 and t.batch_size < 4
    assert "one process, not 2" in text and "accumulated (the same tokens a step)" in text
    assert "this CPU:" in text and "one H100 SXM:" in text and "the 8 min budget trains ~" in text
    assert "run the same command on a GPU" in text
    assert "measured: Qwen2.5-Coder-0.5B shape" in text and "estimated, not measured" in text
    monkeypatch.setattr(estimate, "available_memory", lambda: (int(200 * estimate.GIB), "MemAvailable"))
    assert estimate.before_training(cfg)[0] == cfg


def test_a_resumed_run_keeps_the_batch_it_saved(monkeypatch, tmp_path):
    """A re-run resumes: the processes and batch come from its config.toml (a resume refuses another batch on
    as many ranks), whatever the memory says now; the estimate is still said."""
    from codeforge.open_model import estimate_first
    cfg = two_rank_cfg(monkeypatch, 24)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text("[train]\nlocal_ranks = 2\nbatch_size = 2\ngrad_accum_steps = 1\n")
    new, lines = estimate_first(cfg, run, resume=True)
    assert (new.train.local_ranks, new.train.batch_size, new.train.grad_accum_steps) == (2, 2, 1)
    text = "\n".join(lines)
    assert "this CPU:" in text and "one process" not in text and "more than the 24.0 GiB available" in text
    assert estimate_first(cfg, tmp_path / "none", resume=False)[0].train.local_ranks == 1


def test_quickstart_from_a_hub_name_offline_says_the_estimate_first(offline_cache, tmp_path, capsys):
    """`codeforge quickstart --corpus DIR --from-hf ORG/NAME --lora-rank R` with the model in the Hub cache
    and no network: the name is imported from the cache, and the estimate is printed before training."""
    from codeforge.quickstart import run_quickstart
    from conftest import STDLIB
    r = run_quickstart(str(tmp_path / "qs"), corpus=str(STDLIB / "wsgiref"), max_iters=2,
                       from_hf="acme/Tiny-Coder", lora_rank=4, device="cpu")
    out = capsys.readouterr().out
    assert "model: imported acme/Tiny-Coder from " in out and "context: 1,024 tokens" in out
    est = out.index("estimate before training:")
    assert "this CPU: ~" in out[est:] and "one H100 SXM: ~" in out[est:] and out.index("[4/5] train") < est
    assert est < out.index("initialised weights from") and r["step"] == 2
