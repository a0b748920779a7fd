import math

import pytest

from codeforge.evaluation.generation import function_prompts, pass_at_k
from codeforge.syntax import is_valid_syntax
from codeforge.tokenizer import token_byte_lengths
from codeforge.tokenizer import CodeTokenizer


def test_pass_at_k_hand_computed():
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)
    assert pass_at_k(10, 3, 5) == pytest.approx(1 - 21 / 252)  # 1 - C(7,5)/C(10,5)
    assert pass_at_k(10, 0, 5) == 0.0
    assert pass_at_k(10, 10, 1) == 1.0
    assert pass_at_k(4, 1, 4) == 1.0  # n - c < k
    assert pass_at_k(200, 13, 10) == pytest.approx(1 - math.comb(187, 10) / math.comb(200, 10))
    with pytest.raises(ValueError):
        pass_at_k(3, 1, 5)


def test_syntax_valid_and_broken():
    assert is_valid_syntax("def f(x):\n    return x + 1\n", "python")
    assert not is_valid_syntax("def f(x):\n    return (x + \n", "python")
    assert not is_valid_syntax("def f(x)\n    return x\n", "python")
    assert is_valid_syntax("func Add(a, b int) int {\n\treturn a + b\n}\n", "go")
    assert is_valid_syntax("package main\n\nfunc main() {\n\tprintln(1)\n}\n", "go")
    assert not is_valid_syntax("func Add(a, b int) int {\n\treturn a +\n", "go")
    assert not is_valid_syntax("func Add(a b int int {\n}\n", "go")


def test_function_prompts_cut_signature_and_doc():
    py = 'import os\n\ndef f(x):\n    """Doc."""\n    return x\n\n\ndef g():\n    pass\n'
    ps = function_prompts(py, "python", 5)
    assert ps[0] == 'def f(x):\n    """Doc."""\n    ' and ps[1] == "def g():\n    "
    go = "package p\n\n// Add adds.\n// It is pure.\nfunc Add(a, b int) int {\n\treturn a + b\n}\n"
    assert function_prompts(go, "go", 5) == ["// Add adds.\n// It is pure.\nfunc Add(a, b int) int {\n\t"]
    tabs = 'def h():\n\t"""Tab-indented."""\n\treturn 1\n'
    assert function_prompts(tabs, "python", 5) == ['def h():\n\t"""Tab-indented."""\n\t']


def test_token_byte_lengths_sum_to_text_bytes(tokenizer_dir):
    tok = CodeTokenizer.load(tokenizer_dir)
    lens = token_byte_lengths(tok)
    for text in ["func main() {\n\tfmt.Println(\"héllo ✓\")\n}\n", "x = 1  # 🎉\r\n"]:
        ids = tok.encode(text)
        assert int(lens[ids].sum()) == len(text.encode("utf-8"))
    assert lens[tok.eot_id] == 0


@pytest.mark.skipif(__import__("shutil").which("bwrap") is None, reason="bubblewrap is not installed")
def test_task_eval_counts_only_passes_judged_outside(monkeypatch):
    """`codeforge eval --run R --tasks T`: a forged pass of an in-box task is reported apart (task_judged,
    task_in_box_passed) and task_pass_at_1 counts only the tasks judged outside."""
    from codeforge.evaluation import tasks as task_ev
    loop = "for i in range(5):\n    assert double(i) == 2 * i\n"
    todo = [{"id": "recorded", "entry_point": "double", "tests": loop,
             "solution": "def double(x):\n    return 2 * x\n"},
            {"id": "split", "entry_point": "double", "tests": "assert double(2) == 4\n"},
            {"id": "bare", "entry_point": "double", "tests": loop}]
    any_ = "import unittest.mock as m\ndef double(x):\n    return m.ANY\n"
    answers = [any_, "def double(x):\n    return x + x\n", any_]
    monkeypatch.setattr(task_ev, "sample_tasks", lambda *a, **k: [([1], [2, 3], c) for c in answers])
    r = task_ev.task_eval(None, None, "cpu", "fp32", todo, chat=False)
    assert r["task_outcomes"] == {"not_data": 1, "passed": 1, "passed_in_box": 1}, r
    assert r["task_pass_at_1"] == 0.5 and r["task_solved"] == 1 and r["task_judged_outside"] == 2, r
    assert r["task_judged"] == {"outside": 2, "in_box": 1} and r["task_in_box_passed"] == 1, r
