"""The hierarchical model (models/hrm.py), its batches (data/hrm_batches.py) and
stage (stages/hrm.py): shapes, no
position sees the future in any module, decision labels, learning, exact resume, checkpoints, generation."""

import json
import math

import pytest
import torch

from codeforge.checkpoint import find_checkpoint, load_model, load_weights
from codeforge.config import ConfigError, resolve
from codeforge.data.hrm_batches import HRMBatches, LabelCache, PlanData, corrupt
from codeforge.models import build_model
from codeforge.models.hrm import DONE, REFINE, HRMConfig
from codeforge.stages import run as run_stage
from codeforge.tokenizer import CodeTokenizer
from codeforge.train.optim import build_optimizer, set_lr

PY_OK = ('def add(a, b):\n    """Add."""', '\n    if a:\n        return a + b\n    return b\n')
PY_BAD = ('def add(a, b):\n    """Add."""', '\n    if a:\n        return (a + b\n    return b\n')
GO_OK = ('// Add adds.\nfunc Add(a, b int) int {', '\n\tif a > 0 {\n\t\treturn a + b\n\t}\n\treturn b\n}')
GO_BAD = ('// Add adds.\nfunc Add(a, b int) int {', '\n\tif a > 0 {\n\t\treturn a + b\n\t\n\treturn b\n}')


def records(n: int) -> list[dict]:
    out = []
    for i in range(n):
        if i % 2:
            body = "".join(f"\n    y{j} = x * {i + j}" for j in range(1 + i % 3)) + "\n    return x\n"
            out.append({"prompt": f'def f{i}(x):\n    """Case {i}."""',
                        "plan": ["assign"] * (1 + i % 3) + ["return"], "body": body, "language": "python"})
        else:
            body = (
                "".join(f"\n\tx{j} := a + {i}" for j in range(1 + i % 3))
                + "\n\tfmt.Println(a)\n\treturn a\n}"
            )
            out.append({"prompt": f"// F{i} adds.\nfunc F{i}(a int) int {{", "body": body,
                        "plan": ["assign"] * (1 + i % 3) + ["call", "return"], "language": "go"})
    return out


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These models are tiny: one thread is fastest, and two threads on a busy
    2-core machine are ~100x slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def plans_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("plans")
    recs = records(24)
    (d / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs[:20]) + "not json\n")
    (d / "val.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs[20:]))
    return d


@pytest.fixture(scope="module")
def tok(tokenizer_dir):
    return CodeTokenizer.load(tokenizer_dir)


def tiny_cfg(**kw) -> HRMConfig:
    base = dict(vocab_size=1024, n_embd=32, n_head=2, planner_layers=1, generator_layers=1, refiner_layers=1,
                plan_len=48, code_len=64, refine_warmup_steps=0, ss_start_step=0, ss_ramp_steps=0,
                ss_max_prob=0.0)
    return HRMConfig(**{**base, **kw})


def test_shapes_and_losses(plans_dir, tok):
    data = PlanData(plans_dir, "train", tok)
    assert len(data) == 20 and data.skipped["malformed"] == 1
    torch.manual_seed(0)
    model = build_model(tiny_cfg())
    b = next(HRMBatches(data, tok, 4, 48, 64, seed=1))
    B, Lp = b["plan_idx"].shape
    assert B == 4 and Lp <= 48 and b["code_idx"].size(1) <= 64 and b["ref_idx"].size(1) <= 128
    hp = model.plan_states(b["plan_idx"])
    assert hp.shape == (B, Lp, 32) and model.logits(hp).shape == (B, Lp, 1024)
    hc = model.code_states(hp, b["plan_lens"], b["code_idx"])
    assert hc.shape == (*b["code_idx"].shape, 32)
    assert model.refine_states(hp, b["plan_lens"], b["ref_idx"]).shape == (*b["ref_idx"].shape, 32)
    out = model(b)
    for k in ("loss", "plan", "code", "refine", "decision"):
        assert out[k].dim() == 0 and math.isfinite(float(out[k].detach())), k
    expected = 0.4 * out["plan"] + 0.4 * out["code"] + 0.2 * (out["refine"] + out["decision"])
    assert torch.allclose(out["loss"].detach(), expected)
    # warm-up: refinement contributes nothing before refine_warmup_steps
    m2 = build_model(tiny_cfg(refine_warmup_steps=10))
    m2.load_state_dict(model.state_dict())
    o2 = m2(b, step=3)
    assert torch.allclose(o2["loss"].detach(), 0.4 * o2["plan"] + 0.4 * o2["code"])
    # every parameter in exactly one group, each with its module's scale
    groups = model.optim_groups(0.1)
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))
    assert {g["name"]: g["lr_scale"] for g in groups} == {"shared": 1.0, "planner": 1.2, "generator": 0.8,
                                                          "refiner": 1.0}


def test_per_module_lr_follows_schedule():
    model = build_model(tiny_cfg())
    opt = build_optimizer(model, "adamw", 3e-4, 0.1, (0.9, 0.95), torch.device("cpu"))
    for base in (3e-4, 1.5e-5):
        set_lr(opt, base)
        lrs = {g["name"]: g["lr"] for g in opt.param_groups}
        assert lrs["planner"] == pytest.approx(1.2 * base) and lrs["generator"] == pytest.approx(0.8 * base)
        assert lrs["refiner"] == pytest.approx(base) and opt.param_groups[0]["lr"] == pytest.approx(base)


def _perturb(x: torch.Tensor, t: int, vocab: int = 1024) -> torch.Tensor:
    y = x.clone()
    y[:, t + 1:] = torch.randint(30, vocab, y[:, t + 1:].shape)
    return y


@pytest.mark.parametrize("pos", ["learned", "rope"])
def test_no_future_leak(plans_dir, tok, pos):
    """Perturbing tokens after position t leaves every output at positions <= t unchanged, in each module."""
    torch.manual_seed(0)
    model = build_model(tiny_cfg(pos=pos)).eval()
    b = next(HRMBatches(PlanData(plans_dir, "train", tok), tok, 3, 48, 64, seed=2))
    with torch.no_grad():
        p = b["plan_idx"]
        t = p.size(1) // 2
        a, c = model.logits(model.plan_states(p)), model.logits(model.plan_states(_perturb(p, t)))
        assert torch.allclose(a[:, :t + 1], c[:, :t + 1], atol=1e-5) and not torch.allclose(a, c)
        hp = model.plan_states(p)
        for states, idx in ((model.code_states, b["code_idx"]), (model.refine_states, b["ref_idx"])):
            t = idx.size(1) // 2
            a = model.logits(states(hp, b["plan_lens"], idx))
            c = model.logits(states(hp, b["plan_lens"], _perturb(idx, t)))
            assert torch.allclose(a[:, :t + 1], c[:, :t + 1], atol=1e-5) and not torch.allclose(a, c)
        # the decision at <refine> sees the draft but nothing of the target body after it
        hr = model.refine_states(hp, b["plan_lens"], b["ref_idx"])
        idx = b["ref_idx"].clone()
        for r, s in enumerate(b["sep_pos"].tolist()):
            idx[r, s + 1:] = torch.randint(30, 1024, (idx.size(1) - s - 1,))
        hr2 = model.refine_states(hp, b["plan_lens"], idx)
        rows = torch.arange(3)
        assert torch.allclose(model.decision(hr[rows, b["sep_pos"]]), model.decision(hr2[rows, b["sep_pos"]]),
                              atol=1e-5)


def test_decision_labels(tok):
    labels = LabelCache()
    assert labels(PY_OK[0] + PY_OK[1], "python") == DONE
    assert labels(PY_BAD[0] + PY_BAD[1], "python") == REFINE
    assert labels(GO_OK[0] + GO_OK[1], "go") == DONE
    assert labels(GO_BAD[0] + GO_BAD[1], "go") == REFINE
    assert len(labels.d) == 4 and labels(GO_OK[0] + GO_OK[1], "go") == DONE and len(labels.d) == 4  # cached
    # drafts are deterministic in their seed, and mostly corrupted
    import numpy as np
    ids = tok.encode(PY_OK[1])
    drafts = [corrupt(ids, tok, np.random.default_rng([0, k])) for k in range(40)]
    assert drafts == [corrupt(ids, tok, np.random.default_rng([0, k])) for k in range(40)]
    assert 0 < sum(d == ids for d in drafts) < 25


def test_batch_labels_match_parser(plans_dir, tok):
    data = PlanData(plans_dir, "train", tok)
    src = HRMBatches(data, tok, 4, 48, 64, seed=3, shuffle=False)
    for i in range(len(data)):
        e = src.example(i, 0)
        draft = e["ref"][1:e["sep"]]
        full = data.prompts[i] + tok.decode(draft)
        from codeforge.syntax import is_valid_syntax
        assert e["label"] == (DONE if is_valid_syntax(full, data.languages[i]) else REFINE)


def test_loss_decreases(plans_dir, tok):
    torch.manual_seed(0)
    model = build_model(tiny_cfg(ss_max_prob=0.5, ss_start_step=10))
    src = HRMBatches(PlanData(plans_dir, "train", tok), tok, 4, 48, 64, seed=4)
    batches = [next(src) for _ in range(2)]
    opt = build_optimizer(model, "adamw", 3e-3, 0.0, (0.9, 0.95), torch.device("cpu"))
    set_lr(opt, 3e-3)
    seen = []
    for step in range(30):
        out = model(batches[step % 2], step=step)
        opt.zero_grad()
        out["loss"].backward()
        opt.step()
        seen.append(float(out["loss"].detach()))
    assert sum(seen[-4:]) / 4 < 0.6 * sum(seen[:4]) / 4, seen


def _cfg(plans_dir, tokenizer_dir, out, **over):
    flags = {"train.stage": "hrm", "train.data": str(plans_dir), "train.tokenizer": str(tokenizer_dir),
             "train.out": str(out), "train.batch_size": 4, "train.learning_rate": 2e-3,
             "train.warmup_steps": 2,
             "train.eval_every": 0, "train.eval_tokens": 64, "train.save_every": 3, "train.log_every": 1,
             "train.progress": False, "train.device": "cpu", "train.tensorboard": False,
             "model.refine_warmup_steps": 2, "model.ss_start_step": 1, "model.ss_ramp_steps": 2,
             "model.resid_dropout": 0.1, **over}
    sets = ["model.n_embd=32", "model.n_head=2", "model.planner_layers=1", "model.generator_layers=1",
            "model.refiner_layers=1", "model.plan_len=48", "model.code_len=64"]
    return resolve(["hrm-tiny"], None, sets, flags, vocab_from_data=True)


def test_resume_exact_and_checkpoint(plans_dir, tokenizer_dir, tmp_path):
    quiet = lambda m: None  # noqa: E731
    run_stage(_cfg(plans_dir, tokenizer_dir, tmp_path / "a", **{"train.max_iters": 6}), log=quiet)
    run_stage(_cfg(plans_dir, tokenizer_dir, tmp_path / "b", **{"train.max_iters": 3}), log=quiet)
    r = run_stage(_cfg(plans_dir, tokenizer_dir, tmp_path / "b", **{"train.max_iters": 6}), resume=True,
                  log=quiet)
    assert r["step"] == 6 and r["val_loss"] is not None
    la = [json.loads(x) for x in open(tmp_path / "a" / "metrics.jsonl")]
    lb = [json.loads(x) for x in open(tmp_path / "b" / "metrics.jsonl")]
    loss = lambda recs: {x["step"]: x["loss"] for x in recs if "loss" in x}  # noqa: E731
    assert loss(la) == loss(lb)
    assert any("val_decision_accuracy" in x for x in la)
    # the parts logged
    assert all("train_plan" in x and "train_decision_accuracy" in x for x in la if "loss" in x)
    # generated bodies parsed at each evaluation (syntax_cases)
    final = [x for x in la if "val_loss" in x][-1]
    assert 0 <= final["val_syntax_valid_rate"] <= 1 and 0 <= final["val_avg_iterations"] <= 3
    # the checkpoints hold the same weights; they load by arch through checkpoint.py
    ma, tok, ck, cfg = load_model(tmp_path / "a", torch.device("cpu"))
    mb, *_ = load_model(tmp_path / "b", torch.device("cpu"))
    assert cfg["model"]["arch"] == "hrm" and type(ma).__name__ == "HRM"
    for (k, a), (_, b) in zip(ma.state_dict().items(), mb.state_dict().items()):
        assert torch.equal(a, b), k
    fresh = build_model(cfg["model"])
    load_weights(fresh, find_checkpoint(tmp_path / "a", "latest"))
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), ma.state_dict().values()))
    g = ma.generate(tok.encode(PY_OK[0]), max_plan_tokens=8, max_code_tokens=8, temperature=0.8, seed=0,
                    max_iters=2)
    assert set(g) == {"plan", "code", "draft", "iterations"} and len(g["plan"]) <= 8
    assert all(it["decision"] in ("done", "refine") and 0 <= it["p_done"] <= 1 for it in g["iterations"])
    assert 1 <= len(g["iterations"]) <= 2


def test_config_by_arch(tmp_path):
    m = resolve(["hrm-small"]).model
    assert isinstance(m, HRMConfig) and (m.n_embd, m.n_head, m.planner_layers,
                                         m.generator_layers) == (256, 8, 3, 3)
    assert (m.plan_len, m.code_len, m.refine_iters) == (512, 1024, 5)
    with pytest.raises(ConfigError, match="block_size"):
        resolve(["hrm-tiny"], None, ["model.block_size=64"])
    with pytest.raises(ConfigError, match="plan_len"):
        resolve([], None, ["model.plan_len=64"])
    assert resolve(["tiny"]).model.arch == "gpt"


def test_eval_generate_and_engine_on_an_hrm_run(plans_dir, tokenizer_dir, tmp_path, capsys):
    """codeforge eval reports the seed's metrics beside the usual keys; generate shows plan and refinement;
    the GPT engine refuses the model with a message saying what takes it."""
    from codeforge.cli import main
    from codeforge.engine import Engine, EngineError
    run_stage(_cfg(plans_dir, tokenizer_dir, tmp_path / "r", **{"train.max_iters": 2}), log=lambda m: None)
    capsys.readouterr()
    assert main(["eval", "--run", str(tmp_path / "r"), "--hrm-cases", "2", "--device", "cpu", "--json"]) == 0
    said = capsys.readouterr()
    r = json.loads(said.out)
    # progress, not minutes of silence
    assert "eval: 2 functions planned, written and refined: done in" in said.err
    assert "eval: validation of the bodies given their gold plans" in said.err
    for k in ("val_loss", "bits_per_byte", "plan_accuracy", "code_accuracy", "decision_accuracy",
              "avg_iterations", "plan_exact", "code_exact", "code_ast_f1", "syntax_valid_rate"):
        assert k in r and 0 <= r[k] < 100, k
    assert r["hrm_cases"] == 2 and 0 <= r["avg_iterations"] <= 5
    assert (
        json.loads((tmp_path / "r" / "eval.jsonl").read_text().splitlines()[-1])["plan_accuracy"]
        == r["plan_accuracy"]
    )
    assert main(["generate", "--run", str(tmp_path / "r"), "--prompt", "def f(x):\n", "--show-plan",
                 "--max-new-tokens", "8", "--seed", "0", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# plan:") and "# final:\ndef f(x):\n" in out and "# refinement 1:" in out
    model, tok, _, _ = load_model(tmp_path / "r", torch.device("cpu"))
    with pytest.raises(EngineError, match="hrm model.*generate"):
        Engine(model, tok)


def test_decoded_scores():
    from codeforge.evaluation.hrm import ast_node_f1, plan_and_code_scores
    a = "def f(x):\n    if x:\n        return 1\n    return 2\n"
    assert ast_node_f1(a, a, "python") == 1.0
    assert 0 < ast_node_f1(a, "def f(x):\n    return 2\n", "python", base="def f(x):\n") < 1
    assert ast_node_f1("def f(x):\n    pass\n", "def f(x):\n    for i in x:\n        g(i)\n", "python",
                       base="def f(x):\n") == 0.0
    gold = {"language": "python", "prompt": "def f(x):\n", "plan": ["if", "{", "return", "}", "return"],
            "body": "    if x:\n        return 1\n    return 2\n"}
    same = plan_and_code_scores([{**gold, "gen_plan": gold["plan"], "gen_body": gold["body"]}])
    assert same == {"plan_exact": 1.0, "plan_word_accuracy": 1.0, "code_exact": 1.0, "code_ast_f1": 1.0,
                    "syntax_valid_rate": 1.0, "plan_followed": 1.0}
    empty = plan_and_code_scores([{**gold, "gen_plan": ["return"], "gen_body": ""}])
    assert (
        empty["syntax_valid_rate"] == 0.0
        and empty["plan_followed"] == 0.0
        and empty["plan_word_accuracy"] == 0.0
    )
    broken = plan_and_code_scores([{**gold, "gen_plan": ["if", "{"], "gen_body": "    if x\n"}])
    assert broken["syntax_valid_rate"] == 0.0 and broken["plan_word_accuracy"] == 2 / 5


def test_a_short_hrm_run_scores_fewer_validation_tokens(plans_dir, tokenizer_dir, tmp_path):
    """As for the language model (evaluation/lm.py's sized_eval_tokens): a run too short to pay for
    --eval-tokens scores fewer, says so and saves the count (the guide's hrm-small run sat silent for minutes
    in its first evaluation of 262,144 tokens)."""
    import tomllib

    from codeforge.evaluation.lm import EVAL_FLOOR
    said = []
    run_stage(_cfg(plans_dir, tokenizer_dir, tmp_path / "r",
                   **{"train.max_iters": 2, "train.eval_tokens": 10**6}),
              log=said.append)
    assert any(f"evaluation: up to {EVAL_FLOOR:,} validation tokens each (of --eval-tokens 1,000,000)" in m
               for m in said), said
    assert tomllib.loads((tmp_path / "r" / "config.toml").read_text())["train"]["eval_tokens"] == EVAL_FLOOR
