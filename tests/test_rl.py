"""Preference and RL stages end to end on the CPU (stages/prefs.py, stages/rl.py): each of reward, DPO, PPO
and GRPO raises the reward on a task a tiny model learns in seconds; resume is exact (the rollout in
progress and PPO's value head included); bad pairs and broken tasks are reported, not trained on.

The task: `pick()` must return 'a'. The starting model is SFT'd on answers that return 'a' and 'b' in equal
numbers, so about half its samples pass; every method should move that towards 'a'.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal

import pytest
import torch

from codeforge import CodeforgeError
from codeforge.checkpoint import load_model
from codeforge.config import resolve
from codeforge.evaluation.tasks import task_eval
from codeforge.stages import run as run_stage

PROMPT = "Write a Python function `pick()` that returns the letter a.\n\n```python\ndef pick():\n```"
GOOD = "def pick():\n    return 'a'\n"
BAD = "def pick():\n    return 'b'\n"
TESTS = "assert pick() == 'a'\n"

if shutil.which("bwrap") is None:
    pytest.skip("bubblewrap (bwrap) is not installed: `apt-get "
                "install bubblewrap`; execution rewards need it",
                allow_module_level=True)


def conv(answer: str) -> dict:
    return {"messages": [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": answer}]}


def cfg_for(data, out, **over):
    flags = {"model.n_layer": 2, "model.n_head": 2, "model.n_embd": 64, "model.block_size": 96,
             "train.batch_size": 8, "train.learning_rate": 3e-3, "train.warmup_steps": 0,
             "train.eval_every": 0,
             "train.save_every": 0, "train.log_every": 1, "train.progress": False, "train.device": "cpu",
             "train.tensorboard": False, "train.data": str(data), "train.out": str(out)}
    flags.update({k.replace("__", "."): v for k, v in over.items()})
    return resolve([], None, [], flags, vocab_from_data=True)


@pytest.fixture(scope="module")
def world(tmp_path_factory, tokenizer_dir):
    """An SFT run that answers 'a' about half the time, the task file, and a pair file."""
    from codeforge.corpus import CorpusOptions
    from codeforge.data.shards import prepare
    d = tmp_path_factory.mktemp("rl")
    (d / "chat.jsonl").write_text("".join(json.dumps(conv(GOOD if i % 2 else BAD)) + "\n" for i in range(80)))
    prepare([str(d / "chat.jsonl")], tokenizer_dir, d / "data", CorpusOptions(val_fraction=0.0, dedup="none"),
            log=lambda *a: None, chat=True)
    run_stage(cfg_for(d / "data", d / "sft", train__stage="sft", train__max_iters=150, train__batch_size=2),
              log=lambda m: None)
    tasks = [{"id": f"pick-{i}", "prompt": PROMPT, "tests": TESTS, "solution": GOOD, "entry_point": "pick"}
             for i in range(20)]
    (d / "tasks.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks))
    pairs = [{"prompt": [{"role": "user", "content": PROMPT}],
              "chosen": [{"role": "assistant", "content": GOOD}],
              "rejected": [{"role": "assistant", "content": BAD}]} for _ in range(40)]
    (d / "pairs").mkdir()  # a make-pairs directory: the held-out pairs are the same task's (there is one)
    for name in ("train.jsonl", "heldout.jsonl"):
        (d / "pairs" / name).write_text("".join(json.dumps(p) + "\n" for p in pairs))
    return d


SAMPLES = 128  # per pass-rate measurement: a gain of 0.2 is then ~4 standard errors, not one rounding step
MIN_GAIN = 0.1  # the smallest raise in pass rate a method must show (it also has to be significant)
MAX_P = 1e-3  # one-sided Fisher exact test: "after" beats "before" by more than sampling noise


def pass_rate(run, n: int = SAMPLES) -> float:
    """Sampled at temperature 1 (greedy would be all or nothing), seeded."""
    model, tok, _, _ = load_model(run, torch.device("cpu"))
    task = {"id": "pick", "prompt": PROMPT, "tests": TESTS}
    return task_eval(model, tok, torch.device("cpu"), "fp32", [task], True, max_new_tokens=24, samples=n,
                     temperature=1.0, seed=5)["task_pass_at_1"]


def fisher_one_sided(k0: int, k1: int, n: int) -> float:
    """P(the second of two samples of n draws has >= k1 passes) when both come from one pass rate, given the
    k0 + k1 passes in all (hypergeometric tail): the chance that a raise this large is noise."""
    total = k0 + k1
    return sum(math.comb(n, j) * math.comb(n, total - j)
               for j in range(k1, min(n, total) + 1)) / math.comb(2 * n, total)


def assert_raised(method: str, before: float, after: float, n: int = SAMPLES) -> None:
    """The method raised the pass rate by at least MIN_GAIN and significantly (p < MAX_P). The figures are
    printed (`pytest -s`) so a run on another CPU shows its margin, not only a pass."""
    k0, k1 = round(before * n), round(after * n)
    p = fisher_one_sided(k0, k1, n)
    print(f"\n[margin] {method}: pass rate {before:.3f} -> {after:.3f} (gain {after - before:+.3f}, "
          f"needs >= {MIN_GAIN}); one-sided Fisher p = {p:.1e} (needs < {MAX_P:.0e}); {n} samples each")
    assert after - before >= MIN_GAIN and p < MAX_P, (method, before, after, p)


def metrics(run) -> list[dict]:
    with open(os.path.join(run, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def before(world):
    p = pass_rate(world / "sft")
    assert 0.2 <= p <= 0.8, p  # the starting point really is undecided
    return p


RL = dict(train__rollout_tasks=2, train__group_size=8, train__rollout_tokens=24, train__batch_size=8,
          train__learning_rate=1e-3, train__eval_tasks=1)


def test_grpo_raises_the_pass_rate(world, before, tmp_path):
    run = tmp_path / "grpo"
    r = run_stage(cfg_for(world / "tasks.jsonl", run, train__stage="grpo",
                          train__init_from=str(world / "sft"), train__max_iters=30, **RL), log=lambda m: None)
    assert r["step"] == 30
    assert_raised("grpo", before, pass_rate(run))
    rows = metrics(run)
    assert any("train_pass_rate" in x for x in rows) and any("val_task_pass_at_1" in x for x in rows)
    rolls = [json.loads(x) for x in (run / "rollouts.jsonl").read_text().splitlines()]
    assert rolls and all({"reward", "pass_rate", "early_exit", "outcomes"} <= set(x) for x in rolls)
    print(f"[margin] grpo rollouts: mean reward {rolls[0]['reward']:.3f} (first) -> "
          f"{rolls[-1]['reward']:.3f} (last)")
    assert rolls[-1]["reward"] > rolls[0]["reward"]


def test_dpo_raises_the_pass_rate(world, before, tmp_path):
    """DPO with the chosen side's LM loss beside it (RPO) raises the pass rate; plain DPO raises its implicit
    reward margin, but here (as in docs/LOG.md#2026-11-23-preference-and-rl) it also lowers the likelihood of
    both sides, and the sampled answers degrade: the test records that rather than hiding it."""
    run = tmp_path / "dpo"
    run_stage(cfg_for(world / "pairs", run, train__stage="dpo", train__init_from=str(world / "sft"),
                      train__max_iters=15, train__learning_rate=1e-3, train__eval_every=15,
                      train__dpo_sft=1.0),
              log=lambda m: None)
    assert_raised("dpo + sft", before, pass_rate(run))
    val = [x for x in metrics(run) if "val_loss" in x][-1]
    assert val["val_pair_accuracy"] == 1.0 and val["val_margin"] > 0.1
    plain = tmp_path / "plain"
    run_stage(cfg_for(world / "pairs", plain, train__stage="dpo", train__init_from=str(world / "sft"),
                      train__max_iters=15, train__learning_rate=1e-3, train__eval_every=15),
              log=lambda m: None)
    val = [x for x in metrics(plain) if "val_loss" in x]
    print(f"[margin] plain dpo: val loss {val[0]['val_loss']:.3f} -> {val[-1]['val_loss']:.3f} (needs < "
          f"0.65), margin {val[-1]['val_margin']:.3f} (needs > 0.1), rejected reward "
          f"{val[-1]['val_reward_rejected']:.3f}")
    # from log 2 down: it prefers the chosen
    assert val[-1]["val_loss"] < 0.65 < 0.69 < val[0]["val_loss"] + 0.01
    assert val[-1]["val_margin"] > 0.1 and val[-1]["val_reward_rejected"] < 0


@pytest.fixture(scope="module")
def reward_run(world, tmp_path_factory):
    run = tmp_path_factory.mktemp("rm") / "rm"
    run_stage(cfg_for(world / "pairs", run, train__stage="reward", train__init_from=str(world / "sft"),
                      train__max_iters=30, train__learning_rate=3e-3, train__eval_every=30),
              log=lambda m: None)
    return run


def test_reward_model_learns_the_preference(reward_run):
    val = [x for x in metrics(reward_run) if "val_loss" in x]
    print(f"[margin] reward model: val loss {val[0]['val_loss']:.3f} -> {val[-1]['val_loss']:.3f} (needs < "
          f"0.3), pair accuracy {val[-1]['val_pair_accuracy']:.3f} (needs 1.0)")
    assert val[-1]["val_pair_accuracy"] == 1.0 and val[-1]["val_loss"] < 0.3
    # step 0: the zero-initialised score head ties every pair (its line says so: see the test below)
    assert val[0]["val_pair_ties"] == 1.0 and val[-1]["val_pair_ties"] == 0.0
    model, _, _, cfg = load_model(reward_run, torch.device("cpu"))
    assert cfg["model"]["arch"] == "reward" and hasattr(model, "score")


def test_pair_eval_line_tells_ties_from_wrong_pairs():
    from codeforge.stages.prefs import pair_eval

    class Pairs:
        def __len__(self):
            return 4

        def collate(self, idx, pad_id, device):
            return idx

    class Many(Pairs):
        def __len__(self):
            return 300

    def tied(model, batch):
        return torch.tensor(0.6931), {"pair_accuracy": torch.tensor(0.0), "pair_ties": torch.tensor(1.0)}

    def ranked(model, batch):
        return torch.tensor(0.2), {"pair_accuracy": torch.tensor(0.75), "pair_ties": torch.tensor(0.0)}

    def one_tie(model, batch):  # one tied pair in 300: said as a count, not rounded away to 0%
        return torch.tensor(0.3), {"pair_accuracy": torch.tensor(0.5), "pair_ties": torch.tensor(1 / 300)}
    model = torch.nn.Linear(1, 1)
    said = pair_eval(tied, model, Pairs(), 2, 0, torch.device("cpu"), "fp32")["message"]
    assert said == ("held-out loss 0.6931, pair accuracy 0.0% over "
                    "4 pairs (all tie, counted as not ranked right)")
    assert pair_eval(ranked, model, Pairs(), 2, 0, torch.device("cpu"), "fp32")["message"] == \
        "held-out loss 0.2000, pair accuracy 75.0% over 4 pairs"
    assert pair_eval(one_tie, model, Many(), 300, 0, torch.device("cpu"), "fp32")["message"] == \
        "held-out loss 0.3000, pair accuracy 50.0% over 300 pairs (1 tie, counted as not ranked right)"


def test_ppo_with_the_reward_model_raises_the_pass_rate(world, before, reward_run, tmp_path):
    run = tmp_path / "ppo"
    run_stage(cfg_for(world / "tasks.jsonl", run, train__stage="ppo", train__init_from=str(world / "sft"),
                      train__reward_model=str(reward_run), train__max_iters=60, **RL), log=lambda m: None)
    assert_raised("ppo", before, pass_rate(run))
    rows = [x for x in metrics(run) if "train_rm_score" in x]
    assert rows and "train_kl" in rows[0] and "train_value_loss" in rows[0]
    assert "train_pass_rate" not in rows[0]  # rewards came from the model only
    # the checkpoint is a plain GPT (the value head lives in the training state): the engine loads it
    model, _, _, cfg = load_model(run, torch.device("cpu"))
    assert cfg["model"]["arch"] == "gpt" and not any("value" in k for k in model.state_dict())


def losses_of(run) -> dict:
    return {x["step"]: x["loss"] for x in metrics(run) if "loss" in x}


@pytest.mark.parametrize("stage", ["dpo", "grpo", "ppo"])
def test_resume_equals_straight(stage, world, tmp_path, monkeypatch):
    data = world / ("pairs" if stage == "dpo" else "tasks.jsonl")
    over = dict(train__stage=stage, train__init_from=str(world / "sft"), train__max_iters=6,
                train__kl_coef=0.05, train__save_every=0)
    if stage != "dpo":
        over.update(RL, train__rollout_tasks=1, train__group_size=4, train__batch_size=2, train__ppo_epochs=2)
    run_stage(cfg_for(data, tmp_path / "a", **over), log=lambda m: None)
    straight = losses_of(tmp_path / "a")
    import codeforge.train.trainer as tr
    real = tr.Trainer._optimisation_step

    def step_then_signal(self):
        r = real(self)
        if self.step == 2:  # mid-rollout for the RL stages (4 micro-batches a rollout)
            os.kill(os.getpid(), signal.SIGTERM)
        return r

    monkeypatch.setattr(tr.Trainer, "_optimisation_step", step_then_signal)
    r = run_stage(cfg_for(data, tmp_path / "b", **over), log=lambda m: None)
    assert r["interrupted"] == "SIGTERM" and r["step"] == 3
    monkeypatch.setattr(tr.Trainer, "_optimisation_step", real)
    run_stage(cfg_for(data, tmp_path / "b", **over), resume=True, log=lambda m: None)
    resumed = losses_of(tmp_path / "b")
    assert sorted(resumed) == sorted(straight) == list(range(1, 7))
    assert all(resumed[s] == straight[s] for s in straight), (straight, resumed)


def test_bad_pairs_and_broken_tasks(world, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "p", "chosen": "x", "rejected": "y"}) + "\n"
                   + json.dumps({"prompt": "p", "chosen": "x"}) + "\n")
    with pytest.raises(CodeforgeError, match=r"line 2.*rejected"):
        run_stage(cfg_for(bad, tmp_path / "r1", train__stage="dpo", train__init_from=str(world / "sft"),
                          train__max_iters=1), log=lambda m: None)
    assert not (tmp_path / "r1" / "checkpoints").exists()
    tasks = [{"id": f"ok-{i}", "prompt": PROMPT, "tests": TESTS, "solution": GOOD} for i in range(10)]
    tasks += [{"id": "wrong-ref", "prompt": PROMPT, "tests": TESTS, "solution": BAD},
              {"id": "bad-tests", "prompt": PROMPT, "tests": "assert pick( ==", "solution": GOOD}]
    f = tmp_path / "tasks.jsonl"
    f.write_text("".join(json.dumps(t) + "\n" for t in tasks))
    said = []
    run_stage(cfg_for(f, tmp_path / "r2", train__stage="grpo", train__init_from=str(world / "sft"),
                      train__max_iters=1, **RL), log=said.append)
    text = "\n".join(said)
    assert "wrong-ref" in text and "bad-tests" in text and "skipped" in text
    with pytest.raises(CodeforgeError, match="--init-from"):
        run_stage(cfg_for(f, tmp_path / "r3", train__stage="grpo", **RL), log=lambda m: None)
    with pytest.raises(CodeforgeError, match="--reward-model"):
        run_stage(cfg_for(f, tmp_path / "r4", train__stage="ppo", train__rewards="model",
                          train__init_from=str(world / "sft"), **RL), log=lambda m: None)


def test_max_tokens_is_the_budget_of_the_preference_and_rl_stages(world, tmp_path):
    """With max_iters 0, train.max_tokens sets the number of steps for every stage (it was ignored by the
    preference and RL stages, which fell back to one epoch): ceil(max_tokens / tokens a step reads)."""
    per_step = 2 * 8 * 96  # dpo: chosen and rejected rows, batch 8, context 96
    r = run_stage(cfg_for(world / "pairs", tmp_path / "dpo", train__stage="dpo",
                          train__init_from=str(world / "sft"),
                          train__max_iters=0, train__max_tokens=3 * per_step - 1), log=lambda m: None)
    assert r["step"] == 3
    per_step = 8 * 24  # grpo: batch 8 x rollout_tokens 24
    r = run_stage(cfg_for(world / "tasks.jsonl", tmp_path / "grpo", train__stage="grpo",
                          train__init_from=str(world / "sft"), train__max_iters=0,
                          train__max_tokens=2 * per_step, **RL), log=lambda m: None)
    assert r["step"] == 2


@pytest.mark.parametrize("stage", ["reward", "dpo", "grpo"])
def test_resume_on_another_number_of_ranks_is_refused(stage, world, reward_run, tmp_path):
    """Every stage records the number of ranks it trained on; these stages deal pairs or tasks to ranks by
    rank (their cursor counts them so), so a resume on another number is refused with the number to use,
    as chat SFT's is, instead of continuing on a wrong cursor."""
    from codeforge.checkpoint import find_checkpoint, read_config
    from codeforge.config import STAGE
    from codeforge.train.resume import check_resume
    if stage == "reward":
        ck = find_checkpoint(reward_run, "latest")
    else:
        data = world / ("pairs" if stage == "dpo" else "tasks.jsonl")
        over = RL if stage == "grpo" else {}
        run_stage(cfg_for(data, tmp_path / stage, train__stage=stage, train__init_from=str(world / "sft"),
                          train__max_iters=1, **over), log=lambda m: None)
        ck = find_checkpoint(tmp_path / stage, "latest")
    saved = read_config(ck)
    assert saved["world_size"] == 1 and STAGE[stage].other_ranks == "refuse"
    now = {**saved, "train": dict(saved["train"]), "world_size": 2}
    with pytest.raises(CodeforgeError,
                       match=rf"the number of ranks 1 -> 2 \(--stage {stage} deals its examples"):
        check_resume(ck, now, STAGE[stage].other_ranks)
    assert check_resume(ck, dict(saved, train=dict(saved["train"])), STAGE[stage].other_ranks)[1] == \
        saved["train"]["grad_accum_steps"]  # the same number of ranks resumes as before
