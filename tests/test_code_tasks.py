"""Code tasks with hidden tests (codeforge/tasks/code_tasks.py): generation, loading, scoring, writing.

The sandbox tests run real programs through bubblewrap and skip where it is not installed; the rest run
everywhere. Reference solutions are checked twice: in this process for a large generation (cheap), and in
the sandbox for one instance of every family.
"""

from __future__ import annotations

import json
import re
import shutil
from collections import Counter

import pytest

from codeforge import CodeforgeError
from codeforge.chat import read_conversations
from codeforge.corpus import CorpusStats
from codeforge.tasks import code_tasks
from codeforge.tasks.code_tasks import (FAMILIES, KINDS, REWARDS, TaskError, execution_rewards, extract_code,
                                        generate_tasks, load_tasks, task_conversation, task_program,
                                        validate_tasks, write_tasks)

needs_sandbox = pytest.mark.skipif(shutil.which("bwrap") is None,
                                   reason="bubblewrap (bwrap) is not installed: `apt-get install bubblewrap`")


def _write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


# -- generation -----------------------------------------------------------------------------------------

def test_families_cover_every_kind_and_level():
    cells = Counter((f.kind, f.level) for f in FAMILIES.values())
    assert len(FAMILIES) >= 25
    assert all(cells[(k, lv)] >= 2 for k in KINDS for lv in (1, 2, 3)), cells


def test_generated_task_shape():
    tasks = generate_tasks(len(FAMILIES))
    assert {t["family"] for t in tasks} == set(FAMILIES)  # one turn each: every family once
    for t in tasks:
        assert set(t) == {"id", "family", "kind", "level", "entry_point", "prompt", "solution", "tests",
                          "split"}
        assert t["id"].startswith(t["family"] + "-")
        assert t["kind"] in KINDS and t["level"] in (1, 2, 3) and t["split"] in ("train", "test")
        sig = re.match(r"Write a Python function `(\w+\([\w, ]*\))` that ", t["prompt"])
        assert sig and sig[1].startswith(t["entry_point"] + "(")
        assert t["prompt"].endswith(f"\n\n```python\ndef {sig[1]}:\n```")
        assert t["solution"].startswith(f"def {t['entry_point']}(") and "```" not in t["solution"]
        lines = t["tests"].splitlines()
        assert 4 <= len(lines) <= 8 and all(line.startswith(f"assert {t['entry_point']}(") for line in lines)


def test_reference_solutions_pass_in_process_and_none_fails():
    """A large generation, executed here (our own reference code): every solution passes its tests, and a
    function returning None fails them."""
    for t in generate_tasks(1500, seed=7):
        exec(t["solution"] + "\n" + t["tests"], {})
        with pytest.raises(AssertionError):
            exec(f"def {t['entry_point']}(*args):\n    return None\n" + t["tests"], {})


def test_generation_is_deterministic_and_seeded():
    a, b = generate_tasks(120, seed=3), generate_tasks(120, seed=3)
    assert a == b
    assert [t["id"] for t in generate_tasks(120, seed=4)] != [t["id"] for t in a]
    assert len({t["id"] for t in a}) == len(a)
    assert len({(t["prompt"], t["tests"]) for t in a}) == len(a)


def test_growing_n_keeps_tasks_and_splits():
    small, big = generate_tasks(150, seed=1), generate_tasks(600, seed=1)
    assert big[:150] == small  # the same tasks, the same splits
    frac = sum(t["split"] == "test" for t in big) / len(big)
    assert 0.12 < frac < 0.28, frac
    # held-out tasks are new instances of the training families
    train_ids = {t["id"] for t in big if t["split"] == "train"}
    assert not any(t["id"] in train_ids for t in big if t["split"] == "test")
    assert {t["family"] for t in big if t["split"] == "test"} <= {t["family"] for t in big
                                                                  if t["split"] == "train"}


def test_levels_filter_and_bad_options(monkeypatch):
    assert {t["level"] for t in generate_tasks(40, levels=(1,))} == {1}
    assert generate_tasks(0) == []
    with pytest.raises(TaskError, match="levels"):
        generate_tasks(5, levels=(4,))
    with pytest.raises(TaskError, match="n = -1"):
        generate_tasks(-1)
    # a family whose parameters are used up leaves the rotation; when all are, asking for more is an error
    monkeypatch.setattr(code_tasks, "FAMILIES", {k: FAMILIES[k] for k in ("reverse_string", "add_const")})
    assert len(generate_tasks(40)) == 40
    with pytest.raises(TaskError, match=r"make only \d+ distinct tasks; asked for n = 100000"):
        generate_tasks(100_000)


# -- completions ----------------------------------------------------------------------------------------

def test_extract_code():
    assert extract_code("def f():\n    return 1\n") == "def f():\n    return 1\n"
    assert extract_code("Here:\n```python\nx = 1\n```\nand\n```python\ny = 2\n```") == "x = 1\n"
    assert extract_code("```\nx = 1\n```") == "x = 1\n"
    assert extract_code("```bash\nls\n```\n```py\nx = 1\n```") == "x = 1\n"   # python before other tags
    assert extract_code("```text\nx = 1\n```") == "x = 1\n"                   # else the first block
    # unterminated
    assert extract_code("Sure.\n```python\ndef f():\n    return 1") == "def f():\n    return 1\n"
    assert extract_code("  ```python\n  x = 1\n  ```") == "x = 1\n"            # indented fence
    t = {"tests": "assert f() == 1\n"}
    assert task_program(t, "```python\ndef f():\n    return 1\n```") == ("def f():\n    return "
                                                                         "1\n\n\nassert f() == 1\n")


# -- user tasks -----------------------------------------------------------------------------------------

def test_load_tasks_defaults_and_errors(tmp_path):
    p = _write_jsonl(tmp_path / "t.jsonl", [{"prompt": "p", "tests": "assert 1"}, "",
                                             {"prompt": "q", "tests": "assert 2", "id": "mine", "extra": 1}])
    tasks = load_tasks(p)
    assert [t["id"] for t in tasks] == ["line-1", "mine"] and tasks[1]["extra"] == 1

    cases = [
        ([{"prompt": "p"}], r":1: missing 'tests'"),
        ([{"prompt": "p", "tests": "assert 1"}, '{"prompt": "p", "tests": '], r"t\.jsonl:2: not JSON"),
        ([{"prompt": "p", "tests": ["assert 1"]}], r":1: 'tests' must be a string, got list"),
        ([{"prompt": "p", "tests": "assert 1", "level": "2"}], r":1: 'level' must be int"),
        (["[1, 2]"], r":1: a task must be a JSON object, got list"),
        ([{"prompt": "p", "tests": "a", "id": "x"}, {"prompt": "p", "tests": "b", "id": "x"}],
         r":2: id 'x' repeats line 1"),
        ([""], r"no tasks"),
    ]
    for rows, msg in cases:
        _write_jsonl(tmp_path / "t.jsonl", rows)
        with pytest.raises(TaskError, match=msg):
            load_tasks(tmp_path / "t.jsonl")
    assert issubclass(TaskError, CodeforgeError)
    with pytest.raises(TaskError, match="does not exist"):
        load_tasks(tmp_path / "nope.jsonl")
    (tmp_path / "d").mkdir()
    with pytest.raises(TaskError, match="without train.jsonl or heldout.jsonl"):
        load_tasks(tmp_path / "d")


def test_write_tasks_without_sandbox_and_read_back(tmp_path):
    out = tmp_path / "tasks"
    stats = write_tasks(out, n=60, seed=2, validate=False)
    assert stats["kept"] == 60 and stats["train"] + stats["test"] == 60 and stats["skipped"] == 0
    meta = json.loads((out / "meta.json").read_text())
    assert meta["stats"] == stats and sum(meta["stats"]["by_split"]["test"]["kind"].values()) == stats["test"]
    test = load_tasks(out)  # DIR -> DIR/heldout.jsonl
    train = load_tasks(out, split="train")
    by_id = {t["id"]: t for t in generate_tasks(60, seed=2)}
    assert all(t == by_id[t["id"]] for t in test)  # test rows are the tasks as generated
    assert all(t | task_conversation(t) == t and t["split"] == "train" for t in train)
    # the train file is a chat SFT file as it is; the test rows are not conversations, so the held-out
    # tasks cannot be trained on by pointing `prepare --chat` at the whole directory
    stats_chat = CorpusStats()
    got = list(read_conversations([str(out / "train.jsonl")], stats_chat))
    assert len(got) == len(train) and not stats_chat.skipped
    assert got[0][0][1]["content"] == train[0]["solution"]
    stats_dir = CorpusStats()
    assert len(list(read_conversations([str(out)], stats_dir))) == len(train)
    assert stats_dir.skipped["no_messages"] == len(test)

    with pytest.raises(TaskError, match="not empty"):
        write_tasks(out, n=5, validate=False)
    write_tasks(out, n=5, validate=False, overwrite=True)
    assert len(load_tasks(out, "train")) + len(load_tasks(out, "heldout")) == 5
    assert (out / "heldout.jsonl").is_file() and not (out / "test.jsonl").exists()  # the other miners' name
    held = load_tasks(out, "heldout")
    (out / "heldout.jsonl").rename(out / "test.jsonl")  # a directory make-tasks wrote before the rename
    assert load_tasks(out) == load_tasks(out, "test") == held
    with pytest.raises(TaskError, match="has no dev.jsonl"):
        load_tasks(out, split="dev")


# -- the sandbox ----------------------------------------------------------------------------------------

@needs_sandbox
def test_every_family_reference_passes_and_wrong_answer_is_wrong():
    tasks = generate_tasks(60)
    assert {t["family"] for t in tasks} == set(FAMILIES)
    wrong = [f"def {t['entry_point']}(*args):\n    return None\n" for t in tasks]
    res = execution_rewards(tasks + tasks, [t["solution"] for t in tasks] + wrong)
    ok, bad = res[:len(tasks)], res[len(tasks):]
    failures = [(t["id"], r) for t, r in zip(tasks, ok) if r["outcome"] != "passed"]
    assert not failures, failures
    assert all(r["reward"] == 1.0 for r in ok)
    assert Counter(r["outcome"] for r in bad) == Counter(wrong=len(tasks))
    assert all(r["reward"] == REWARDS["wrong"] == 0.5 for r in bad)


@needs_sandbox
def test_execution_reward_outcomes():
    task = {"id": "t", "tests": "assert double(2) == 4\nassert double(0) == 0\n"}
    cases = {
        "passed": "Here you go:\n```python\ndef double(x):\n    return 2 * x\n```",
        "wrong": "def double(x):\n    return x + 2",
        "runtime_error": "def double(x):\n    return x / undefined_name",
        "early_exit": "```python\nimport sys\ndef double(x):\n    return 0\nsys.exit(0)\n```",
        "no_parse": "```python\ndef double(x) return 2 * x\n```",
    }
    extra = {"os._exit": ("early_exit", "import os\ndef double(x):\n    return 0\nos._exit(0)"),
             "timeout": ("runtime_error", "def double(x):\n    while True:\n        pass"),
             "prose": ("no_parse", "I think the answer is to double it.")}
    completions = list(cases.values()) + [c for _, c in extra.values()]
    want = list(cases) + [o for o, _ in extra.values()]
    got = execution_rewards([task] * len(completions), completions, timeout=1.0)
    assert [g["outcome"] for g in got] == want, got
    assert [g["reward"] for g in got] == [REWARDS[o] for o in want]
    assert REWARDS["early_exit"] == REWARDS["no_parse"] == 0.0
    assert REWARDS["runtime_error"] == 0.25 and REWARDS["passed"] == 1.0
    assert "NameError" in got[2]["detail"] and "before its end" in got[3]["detail"]
    assert got[4]["detail"].startswith("SyntaxError")
    with pytest.raises(TaskError, match="pairs"):
        execution_rewards([task], [])


@needs_sandbox
def test_validate_tasks_keeps_good_and_says_why_others_go(tmp_path):
    good = generate_tasks(3)
    tasks = load_tasks(_write_jsonl(tmp_path / "t.jsonl", [
        {"id": "fails", "prompt": "p", "tests": "assert inc(1) == 2\n",
         "solution": "def inc(x):\n    return x\n"},
        {"id": "unparsable", "prompt": "p", "tests": "assert inc(1) ==\n"},
        {"id": "vacuous", "prompt": "p", "tests": "assert 1 + 1 == 2\n"},
        {"id": "no_solution", "prompt": "p", "tests": "assert inc(1) == 2\n"},
    ]))
    kept, skipped = validate_tasks(good + tasks, timeout=5.0)
    assert [t["id"] for t in kept] == [t["id"] for t in good] + ["no_solution"]
    why = {s["id"]: s["reason"] for s in skipped}
    assert set(why) == {"fails", "unparsable", "vacuous"}
    assert why["fails"] == "reference solution fails its tests: wrong: inc(1) returned 1, expected 2"
    assert why["unparsable"].startswith("tests do not parse: SyntaxError")
    assert "check nothing" in why["vacuous"]


@needs_sandbox
def test_write_tasks_validates_in_the_sandbox(tmp_path):
    stats = write_tasks(tmp_path / "tasks", n=12, seed=5)
    assert stats["kept"] == 12 and stats["skipped"] == 0


@needs_sandbox
def test_tests_that_do_not_split_are_recorded_on_the_solution_and_judged_outside():
    """A loop over inputs, an in-place sort checked through the argument, a recursive solution: recorded on
    the reference and judged outside. Tests that expect an exception, or use more of the solution than its
    entry function, or a task without a solution: only in the box, where a pass is "passed_in_box"."""
    in_place = {"id": "sort", "entry_point": "sort_in_place",
                "solution": "def sort_in_place(xs):\n    xs.sort()\n",
                "tests": "for n in range(4):\n    xs = list(range(n, 0, -1))\n    sort_in_place(xs)\n"
                         "    assert xs == sorted(xs)\n"}
    fact = {"id": "fact", "solution": "def fact(n):\n    return 1 if n < 2 else n * fact(n - 1)\n",
            "tests": "for n in range(6):\n    assert fact(n) == [1, 1, 2, 6, 24, 120][n]\n"}  # no entry_point
    raises = {"id": "raises", "entry_point": "inv", "solution": "def inv(x):\n    return 1 / x\n",
              "tests": "try:\n    inv(0)\nexcept ZeroDivisionError:\n    pass\nelse:\n    assert False\n"}
    helper = {"id": "helper", "entry_point": "f", "solution": "K = 3\ndef f(x):\n    return x * K\n",
              "tests": "for i in range(3):\n    assert f(i) == i * K\n"}
    cases = code_tasks.record_tasks([in_place, fact, raises, helper], timeout=10.0)
    assert isinstance(cases[0], code_tasks.Cases) and cases[0].suffix and len(cases[0].calls) == 4
    assert isinstance(cases[1], code_tasks.Cases) and len(cases[1].calls) == 6  # outermost calls only
    assert "raise" in cases[2] and "K of the solution" in cases[3]
    got = execution_rewards([in_place] * 3 + [fact] * 2 + [raises], [
        "def sort_in_place(xs):\n    xs[:] = sorted(xs)\n",
        # the values come back, the list unsorted
        "def sort_in_place(xs):\n    return sorted(xs)\n",
        "def sort_in_place(xs):\n    xs.append(0)\n",
        "def fact(n):\n    import math\n    return math.factorial(n)\n",
        "def fact(n):\n    return n\n",
        "def inv(x):\n    return 1 / x\n"])
    assert [(r["outcome"], r["verdict"]) for r in got] == [
        ("passed", "outside"), ("wrong", "outside"), ("wrong", "outside"), ("passed", "outside"),
        ("wrong", "outside"), ("passed_in_box", "in_box")], got
    assert "left its arguments" in got[2]["detail"], got[2]
