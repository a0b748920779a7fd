"""--hrm's stages: plans mined from the corpus, seed 001's hierarchical model trained on them at a CPU's size,
then the seed's metrics table and one held-out function planned, written and refined.
"""

from __future__ import annotations

import time

from .. import rundir
from ..checkpoint import load_model
from ..config import resolve
from ..corpus import describe_skipped
from ..data.hrm_batches import PlanData
from ..device import choose_device
from ..evaluation.run import run_eval
from ..mining.plans import write_plans
from ..stages import run as run_stage
from .survey import Quickstart

# hrm-tiny's shape at this tokenizer's 8k vocabulary; ~2.5 steps/s on 2 idle cores: the whole quickstart took
# 7.2 minutes (docs/LOG.md#2026-11-22-quickstart-hrm)
HRM_PRESET = "hrm-tiny"
HRM_STEPS = 500
HRM_TRAIN = {"batch_size": 8, "learning_rate": 2e-3, "warmup_steps": 50, "min_lr_ratio": 0.1,
             "weight_decay": 0.1, "eval_every": 250, "eval_tokens": 16_384, "save_every": 250,
             "log_every": 25}
HRM_CASES = 16


def make_plans(q: Quickstart) -> None:
    plans = q.out_dir / "plans"
    if (plans / "train.jsonl").exists():
        print(f"{q.head} make-plans: reusing {plans}")
        return
    st = write_plans([q.src], plans, overwrite=False, languages=q.langs, exclude_tests=True)
    print(f"{q.head} make-plans: {st['examples']:,} functions (train {st['train']:,}, val {st['val']:,}) -> "
          f"{plans}\n      skipped: {describe_skipped(st['skipped'])}")


def train_hrm(q: Quickstart, training: dict) -> dict:
    flags = {"train.stage": "hrm", "train.data": str(q.out_dir / "plans"), "train.tokenizer": str(q.tok_dir),
             "train.out": str(q.run_dir), "train.max_iters": q.opts.max_iters or HRM_STEPS,
             "train.device": q.opts.device, **{f"train.{k}": v for k, v in training.items()}}
    cfg = resolve([HRM_PRESET], None, [], flags, vocab_from_data=True)
    print(f"{q.head} train --stage hrm: {cfg.train.max_iters} steps -> {q.run_dir}")
    return run_stage(cfg, resume=(q.run_dir / rundir.CHECKPOINTS).exists())


def evaluate_hrm(q: Quickstart, cases: int) -> dict:
    """Teacher-forced scores on the held-out functions, then `cases` of them planned, written and refined;
    printed as the seed's metrics table, and one function generated."""
    print(f"{q.head} eval: teacher-forced on the held-out functions, then {cases} of them planned, written "
          f"and refined")
    ev = run_eval(str(q.run_dir), device=q.opts.device, hrm_cases=cases)
    rows = [("body bits per byte (given the gold plan)", ev["bits_per_byte"]),
            ("plan accuracy (next plan word, teacher-forced)", ev.get("plan_accuracy")),
            ("code accuracy (next body token, teacher-forced)", ev.get("code_accuracy")),
            ("refinement decision accuracy", ev.get("decision_accuracy")),
            ("plan exact match (generated)", ev.get("plan_exact")),
            ("code exact match (generated)", ev.get("code_exact")),
            ("code AST node F1 (generated)", ev.get("code_ast_f1")),
            ("syntax-valid rate (generated)", ev.get("syntax_valid_rate")),
            ("average refinement iterations", ev.get("avg_iterations"))]
    print("\nthe hierarchical model's metrics, measured:")
    for name, v in rows:
        print(f"  {name:48s} {'n/a' if v is None else f'{v:.3f}'}")
    model, tok, _, _ = load_model(str(q.run_dir), choose_device(q.opts.device)[0])
    val = PlanData(q.out_dir / "plans", "val", tok)
    rec = val.records[0] if len(val) else {"prompt": "def fibonacci(n):\n"}
    g = model.generate(tok.encode(rec["prompt"]), max_plan_tokens=48, max_code_tokens=128)
    steps = ", ".join(f"{i['decision']} (p_done {i['p_done']:.2f})" for i in g["iterations"]) or "none"
    print(f"\nheld-out prompt:\n{rec['prompt']}\n# plan: {tok.decode(g['plan'])}\n# refinement: {steps}\n"
          f"{tok.decode(g['code'])}\n")
    print(f"finished in {(time.perf_counter() - q.started) / 60:.1f} min. Next: codeforge generate --run "
          f"{q.run_dir} --show-plan --prompt 'def f(x):'   |   codeforge eval --run {q.run_dir}")
    return ev
