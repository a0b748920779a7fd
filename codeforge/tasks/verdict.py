"""The verdict outside the box: a task's tests as calls and expected values, the values the box returns judged
here, where the program cannot reach them.

Tests that split (`assert f(args) == value`, `assert f(args)`, `assert not f(args)`, `assert f(args) is
None|True|False`, literal arguments and values, one function: `split_tests`) become Cases: the box is given
the calls only, runs the program once, calls f on each input and returns the values as plain data
(codeforge.sandbox, `calls=`); `judge` compares them with the expected values, which never enter the box.

Tests that do not split (other statements, loops, random or computed arguments) are judged outside too when
the task has a reference solution (`record_tasks`): the tests run once in the box against the solution, with
the global random generator seeded, and record every call they make of the entry function (its arguments,
the solution's value and, where the solution changed an argument in place, the argument afterwards); a
completion must then give the same plain values on those calls (floats within RECORDED_FLOAT_TOL). That is
stricter than tests that accept several answers. Where that cannot be done (no solution, no single entry
function, tests that expect an exception or use more of the solution than the entry), the record says why,
and the caller runs the tests inside the program instead (code_tasks.execution_rewards, verdict "in_box").
"""

from __future__ import annotations

import ast
import math
from dataclasses import dataclass
from typing import Callable

from ..corpus import content_hash
from ..sandbox import encode_calls, run_many


def syntax_error(code: str) -> str | None:
    """Why `code` is not Python (the parser's error and line), or None when it parses."""
    try:
        ast.parse(code)
    except SyntaxError as e:
        return f"{type(e).__name__}: {e.msg} (line {e.lineno})"
    except (ValueError, RecursionError, MemoryError) as e:  # null bytes; absurd nesting
        return f"{type(e).__name__}: {e}"
    return None


# -- the verdict: return values compared outside the box -----------------------------------------------------

@dataclass
class Cases:
    """A task's tests split into calls and what must come back: the box is given `calls` only; `checks`
    (per call ("eq", expected) | ("truthy", bool) | ("is", None/True/False) | ("pred", a Property judged
    here on the plain value) | ("ref", (expected value, arguments after the call or None)): the reference's
    value, and where the reference changed its arguments in place, their state afterwards) never enter it.
    `suffix` is code appended to the program (WRAP_CODE, for "ref" checks of arguments), `shown` the name
    details use for `entry`, `float_tol` the least tolerance on float values (recorded references)."""
    entry: str
    calls: list[tuple[tuple, dict]]
    checks: list[tuple[str, object]]
    suffix: str = ""
    shown: str | None = None
    float_tol: float = 0.0


class Property:
    """A check judged outside the box on a call's plain return value (HumanEval/32: a root of the polynomial,
    not the canonical solution's root): `test(value)` -> bool, `text` says what was expected."""

    def __init__(self, test: Callable[[object], bool], text: str):
        self.test, self.text = test, text

    def __call__(self, value) -> bool:
        return bool(self.test(value))


MAX_FOLDED = 100_000  # items of a sequence, or bits of an integer, that folding `'ab' * 3` may build


def literal(node: ast.AST):
    """The value of a literal expression: what ast.literal_eval accepts, plus +, -, * between literals (as in
    `'abc' + 'de'`, `2 * 3 * 7`), sizes capped. ValueError for anything else (names, calls,
    comprehensions)."""
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        pass
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult)):
        left, right = literal(node.left), literal(node.right)
        for x, y in ((left, right), (right, left)):
            if (
                isinstance(node.op, ast.Mult)
                and isinstance(x, (str, bytes, list, tuple))
                and isinstance(y, int)
                and len(x) * max(y, 0) > MAX_FOLDED
            ):
                raise ValueError("folded sequence too large")
        if (
            isinstance(left, int)
            and isinstance(right, int)
            and left.bit_length() + right.bit_length() > MAX_FOLDED
        ):
            raise ValueError("folded integer too large")
        try:
            return {ast.Add: lambda: left + right, ast.Sub: lambda: left - right,
                    ast.Mult: lambda: left * right}[type(node.op)]()
        except TypeError as e:
            raise ValueError(str(e)) from None
    raise ValueError(f"not a literal: {ast.dump(node)[:60]}")


def literal_call(node: ast.AST, name: str | None) -> tuple[str, tuple, dict] | None:
    """(function name, args, kwargs) when `node` calls a plain name with literal arguments only."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)) or (
        name and node.func.id != name
    ):
        return None
    if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
        return None
    try:
        return node.func.id, tuple(literal(a) for a in node.args), {k.arg: literal(k.value)
                                                                    for k in node.keywords}
    except ValueError:
        return None


def split_tests(tests: str, entry_point: str | None = None) -> Cases | str:
    """The tests as Cases, or why they cannot be split. Each statement must be one of `assert f(...) == v`,
    `assert v == f(...)`, `assert f(...)`, `assert not f(...)`, `assert f(...) is None|True|False`, with
    literal arguments and v, all calling the same function (entry_point when given)."""
    try:
        body = ast.parse(tests).body
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        return f"tests do not parse ({type(e).__name__})"
    name = entry_point
    calls, checks = [], []
    for st in body:
        where = f"line {getattr(st, 'lineno', '?')}"
        if not isinstance(st, ast.Assert):
            return f"{where}: not an assert statement"
        t, check, call = st.test, None, None
        if isinstance(t, ast.Compare) and len(t.ops) == 1:
            left, op, right = t.left, t.ops[0], t.comparators[0]
            if isinstance(op, ast.Eq):
                for c, v in ((left, right), (right, left)):
                    call = literal_call(c, name)
                    if call:
                        try:
                            check = ("eq", literal(v))
                        except ValueError:
                            return f"{where}: the expected value is not a literal"
                        break
            elif (
                isinstance(op, ast.Is)
                and isinstance(right, ast.Constant)
                and right.value in (None, True, False)
            ):
                call, check = literal_call(left, name), ("is", right.value)
        elif isinstance(t, ast.UnaryOp) and isinstance(t.op, ast.Not):
            call, check = literal_call(t.operand, name), ("truthy", False)
        else:
            call, check = literal_call(t, name), ("truthy", True)
        if not call:
            return f"{where}: not a call of {name or 'one function'} with literal arguments"
        name = call[0]
        calls.append((call[1], call[2]))
        checks.append(check)
    if not calls:
        return "no assert statements"
    return Cases(name, calls, checks)


def same(expected, got, float_tol: float = 0.0) -> bool:
    """`expected == got` between plain values (both decoded from data, so no program code runs). With
    float_tol > 0, where the expected value is a float a number within float_tol of it (absolute, as
    HumanEval's own checks write `abs(x - y) < 1e-6`) counts as equal, inside lists and tuples too."""
    try:
        # True == 1 in Python; a test's `is True` would not
        if (type(expected) is bool) != (type(got) is bool):
            return False
        if float_tol > 0:
            if type(expected) is float:
                return (type(got) in (int, float) and math.isfinite(expected)
                        and abs(expected - got) <= float_tol) or expected == got
            if type(expected) in (list, tuple) and type(got) is type(expected):
                return len(expected) == len(got) and all(same(x, y, float_tol) for x, y in zip(expected, got))
        return bool(expected == got)
    except Exception:  # OverflowError (a huge int against a float), RecursionError, MemoryError
        return False


def _safe_repr(v, n: int = 80) -> str:
    try:
        text = repr(v)
    except Exception:  # an int of more than 4300 digits has no repr
        return f"<a {type(v).__name__} too large to show>"
    return text[:n] + ("..." if len(text) > n else "")


def _shown(cases: Cases, i: int) -> str:
    args, kwargs = cases.calls[i]
    text = ", ".join([_safe_repr(a) for a in args] + [f"{k}={_safe_repr(v)}" for k, v in kwargs.items()])
    return f"{cases.shown or cases.entry}({text[:80]}{'...' if len(text) > 80 else ''})"


def judge(cases: Cases, outputs: list | None, float_tol: float = 0.0) -> tuple[str, str]:
    """(outcome, detail) of one run's return values against the checks: passed, wrong (a value differs),
    runtime_error (a call raised), not_data (a value that is not plain data came back)."""
    checks = cases.checks
    float_tol = max(float_tol, cases.float_tol)
    if outputs is None or len(outputs) != len(checks):
        return "runtime_error", "no return values"
    for i, ((kind, want), (status, got)) in enumerate(zip(checks, outputs)):
        if status == "error":
            return "runtime_error", f"{_shown(cases, i)} raised {got}"
        if status == "not_data":
            return "not_data", f"{_shown(cases, i)} returned a {got}, not plain data"
        if kind == "ref" and cases.suffix and not (type(got) is list and len(got) == 3):
            return "bad_report", f"{_shown(cases, i)}: the wrapper's record is malformed"
    for i, ((kind, want), (_, got)) in enumerate(zip(checks, outputs)):
        after = None
        if kind == "ref":  # the reference's value, and its arguments afterwards where it changed them
            want, after = want
            if cases.suffix:
                got, got_args, got_kwargs = got
        try:
            if kind in ("eq", "ref"):
                ok = same(want, got, float_tol)
            elif kind == "is":
                ok = got is want
            elif kind == "pred":
                ok = want(got)
            else:
                ok = bool(got) == want
        except Exception:
            ok = False
        if ok and after is not None and not (same(after[0], got_args, float_tol)
                                             and same(after[1], got_kwargs, float_tol)):
            return "wrong", (f"{_shown(cases, i)} left its arguments as "
                             f"{_safe_repr([got_args, got_kwargs])}, expected {_safe_repr(after)}")
        if not ok:
            want_text = {"eq": _safe_repr(want), "ref": _safe_repr(want), "is": repr(want),
                         "pred": getattr(want, "text", "a value with the checked property"),
                         "truthy": "a true value" if want else "a false value"}[kind]
            return "wrong", f"{_shown(cases, i)} returned {_safe_repr(got)}, expected {want_text}"
    return "passed", ""


def io_outcome(res, cases: Cases, float_tol: float = 0.0) -> tuple[str, str]:
    """The outcome of a run with calls: the sandbox's failure, or the return values judged here."""
    if res.passed:
        return judge(cases, res.outputs, float_tol)
    if "before its end" in res.detail:
        return "early_exit", res.detail
    if res.detail.startswith("sandbox: malformed report"):
        return "bad_report", res.detail
    return "runtime_error", res.detail


# -- tests that do not split: their calls recorded on the reference, judged outside all the same -------------

RECORD_ENTRY = "__codeforge_record__"   # the recording program's function that returns the record
CALL_ENTRY = "__codeforge_call__"       # the candidate's wrapper where arguments changed in place matter
RECORD_SEED = 0                         # random test inputs are drawn the same way every time
# Put between the reference solution and the tests (ENTRY replaced by the function's name): ENTRY becomes a
# wrapper that records each outermost call's arguments (copied before the call), its return value and, where
# the call changed them in place, the arguments afterwards; the global random generator is seeded. Runs in the
# box like any program (the reference is the task author's code), the record comes back as plain data.
RECORD_CODE = """
import copy as _cf_copy, random as _cf_random
_cf_calls, _cf_depth, _cf_real = [], [0], ENTRY
def ENTRY(*args, **kwargs):
    if _cf_depth[0]:
        return _cf_real(*args, **kwargs)
    before = _cf_copy.deepcopy((args, kwargs))
    seen = repr(before)
    _cf_depth[0] += 1
    try:
        value = _cf_real(*args, **kwargs)
    except BaseException as e:
        _cf_calls.append(["raised", type(e).__name__])
        raise
    finally:
        _cf_depth[0] -= 1
    changed = None if repr((args, kwargs)) == seen else _cf_copy.deepcopy([args, kwargs])
    _cf_calls.append([before[0], before[1], _cf_copy.deepcopy(value), changed])
    return value
def __codeforge_record__():
    return _cf_calls
_cf_random.seed(%d)
""" % RECORD_SEED
# Appended to a candidate's program when a recorded call changed its arguments: the values and the arguments
# afterwards come back together (as plain data, like any return value).
WRAP_CODE = """
def __codeforge_call__(*args, **kwargs):
    return [ENTRY(*args, **kwargs), args, kwargs]
"""
MAX_RECORDED_CALLS = 2000
_recorded: dict[str, "Cases | str"] = {}  # content hash of (solution, tests, entry) -> Cases, or why none


def record_program(reference: str, entry: str, tests: str) -> str:
    """The program that records the calls `tests` make of `entry`, defined by `reference` (RECORD_CODE)."""
    return reference.rstrip() + "\n\n" + RECORD_CODE.replace("ENTRY", entry) + "\n" + tests.rstrip() + "\n"


def record_calls(jobs: list[tuple[str, str]], timeout: float = 10.0, **kw) -> list[list | str]:
    """For each (program from record_program, entry): [(args, kwargs, value, arguments afterwards or None)] of
    every outermost call the tests made, or why the calls cannot be judged outside (the reference failed, a
    value is not plain data, a call raised, no call at all)."""
    if not jobs:
        return []
    results = run_many([prog for prog, _ in jobs], timeout=timeout,
                       calls=[encode_calls(RECORD_ENTRY, [((), {})])] * len(jobs), **kw)
    out: list[list | str] = []
    for (_, entry), res in zip(jobs, results):
        if not res.passed:
            out.append(f"the reference solution fails its tests: {res.status}: {res.detail}")
            continue
        status, rows = res.outputs[0]
        if status != "ok":
            out.append(f"the reference's calls of {entry} do not come back as plain data ({status}: {rows})")
            continue
        raised = next((r[1] for r in rows if isinstance(r, list) and len(r) == 2 and r[0] == "raised"), None)
        if raised is not None:
            out.append(f"the tests expect {entry} to raise ({raised}), which return values cannot show")
        elif not rows:
            out.append(f"the tests never call {entry}")
        elif len(rows) > MAX_RECORDED_CALLS:
            out.append(f"the tests call {entry} more than {MAX_RECORDED_CALLS} times")
        elif not all(type(r) is list and len(r) == 4 and type(r[0]) is tuple and type(r[1]) is dict
                     and all(type(k) is str for k in r[1])
                     and (r[3] is None or (type(r[3]) is list and len(r[3]) == 2)) for r in rows):
            out.append("malformed record of calls")
        else:
            out.append([(r[0], r[1], r[2], r[3]) for r in rows])
    return out


def recorded_cases(entry: str, rows: list, float_tol: float = 0.0, prop=None) -> Cases:
    """Cases from record_calls' rows: each call must give the reference's value ("ref"), or pass `prop(args,
    kwargs)` -> Property where one is given; where the reference changed an argument in place, the candidate's
    arguments afterwards must equal the reference's too (the program then gets WRAP_CODE)."""
    calls = [(args, kwargs) for args, kwargs, _, _ in rows]
    wrap = prop is None and any(changed is not None for *_, changed in rows)
    checks = [("pred", prop(args, kwargs)) if prop else ("ref", (value, changed))
              for args, kwargs, value, changed in rows]
    return Cases(CALL_ENTRY if wrap else entry, calls, checks,
                 WRAP_CODE.replace("ENTRY", entry) if wrap else "", entry, float_tol)


def task_entry(task: dict) -> str | None:
    """The function a task's tests call: its entry_point, else the one function of its solution the tests
    use."""
    ep = task.get("entry_point")
    if isinstance(ep, str) and ep.isidentifier():
        return ep
    try:
        defined = {n.name for n in ast.parse(task.get("solution") or "").body
                   if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        used = {n.id for n in ast.walk(ast.parse(task["tests"])) if isinstance(n, ast.Name)}
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    both = defined & used
    return next(iter(both)) if len(both) == 1 else None


def _other_names(task: dict, entry: str) -> set[str]:
    """Names the solution defines at its top level (functions, classes, variables) that the tests use besides
    `entry`: recorded values of `entry` alone would not judge those."""
    sol, tests = ast.parse(task["solution"]), ast.parse(task["tests"])
    defined = set()
    for n in sol.body:
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(n.name)
        elif isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target]):
                defined |= {x.id for x in ast.walk(t) if isinstance(x, ast.Name)}
    own = {x.id for x in ast.walk(tests) if isinstance(x, ast.Name) and isinstance(x.ctx, ast.Store)}
    own |= {n.name for n in ast.walk(tests)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    own |= {(a.asname or a.name).split(".")[0] for n in ast.walk(tests)
            if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
    used = {x.id for x in ast.walk(tests) if isinstance(x, ast.Name) and isinstance(x.ctx, ast.Load)}
    return (defined & used) - own - {entry}


# a float compared with a recorded reference value (the tests' own tolerance is unknown)
RECORDED_FLOAT_TOL = 1e-6


def record_tasks(tasks: list[dict], timeout: float = 10.0, **kw) -> list[Cases | str]:
    """For tasks whose tests do not split: Cases of the calls the tests make of the entry function, recorded
    on the task's reference solution (cached per process), or why the task can only be judged in the box (no
    solution, no single entry function, the tests use more of the solution, a call raised ...)."""
    keys, jobs, out = [], [], []
    for t in tasks:
        entry = task_entry(t)
        why = None
        if not t.get("solution"):
            why = "no reference solution to record the tests' calls on"
        elif entry is None:
            why = "no entry_point (and not one function of the solution the tests call)"
        elif syntax_error(t["solution"]) or syntax_error(t["tests"]):
            why = "the solution or the tests do not parse"
        elif other := _other_names(t, entry):
            why = f"the tests use {', '.join(sorted(other))} of the solution besides {entry}"
        key = content_hash(f"{t.get('solution')}\0{t['tests']}\0{entry}").hex()
        if why:
            _recorded.setdefault(key, why)
        elif key not in _recorded and key not in keys:
            keys.append(key)
            jobs.append((record_program(t["solution"], entry, t["tests"]), entry))
        out.append(key)
    solutions = {k: t["solution"] for k, t in zip(out, tasks) if t.get("solution")}
    fresh: list[tuple[str, Cases]] = []
    for key, (_, entry), rows in zip(keys, jobs, record_calls(jobs, timeout, **kw)):
        _recorded[key] = rows if isinstance(rows, str) else recorded_cases(entry, rows, RECORDED_FLOAT_TOL)
        if isinstance(_recorded[key], Cases):
            fresh.append((key, _recorded[key]))
    if fresh:  # the reference replayed on its own recording: calls whose inputs name state the tests made
        # (a temporary directory, a file) do not replay, and such a task can only be judged in the box
        progs = [solutions[k] + ("\n\n" + c.suffix if c.suffix else "") for k, c in fresh]
        replays = run_many(progs, timeout=timeout, calls=[encode_calls(c.entry, c.calls) for _, c in fresh],
                           **kw)
        for (key, cases), res in zip(fresh, replays):
            outcome, detail = io_outcome(res, cases)
            if outcome != "passed":
                _recorded[key] = (f"the reference solution does not pass its own recorded calls when they "
                                  f"are replayed ({detail}): the tests' calls depend on state they made")
    return [_recorded[k] for k in out]
