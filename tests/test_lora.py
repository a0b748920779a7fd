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
    return cfg_for(data_dir, out, **{"train__init_from": str(base), "train__lora_rank": 4, "train__lora_alpha": 8,
                                     "train__learning_rate": 1e-2, **over})


def test_only_the_adapters_train_and_the_checkpoint_is_an_ordinary_model(data_dir, base, tmp_path):
    out = tmp_path / "ft"
    r = train_run(lora_cfg(data_dir, out, base, train__max_iters=8))
    assert r["step"] == 8
    ck = find_checkpoint(out, "latest")
    # 2 blocks x 4 layers (attention q/k/v and output, MLP in and out) x (A, B); every adapter trained: PEFT starts each B at zero, so a non-zero B is the optimizer's doing
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
    assert torch.equal(ms["wte.weight"], ss["wte.weight"]) and torch.equal(ms["ln_f.weight"], ss["ln_f.weight"])
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


def test_a_resumed_lora_run_is_the_straight_one(data_dir, base, tmp_path, monkeypatch):
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
    # another rank asked on resume: refused, the adapters' shapes are the run's
    with pytest.raises(ConfigError, match="lora_rank"):
        train_run(cfg_for(data_dir, tmp_path / "b", train__init_from=str(base), train__lora_rank=8,
                          train__lora_alpha=8, train__learning_rate=1e-2, **over), resume=True)


def test_lora_bad_settings_say_what_to_do(data_dir, base, tmp_path):
    with pytest.raises(ConfigError, match="--init-from RUN"):
        train_run(cfg_for(data_dir, tmp_path / "x", train__lora_rank=4, train__max_iters=2))
    with pytest.raises(ConfigError, match=r"--lora-targets q_proj.*no linear layer of that name"):
        train_run(lora_cfg(data_dir, tmp_path / "y", base, train__max_iters=2, train__lora_targets="q_proj"))
