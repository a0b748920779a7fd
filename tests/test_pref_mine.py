import ast
import difflib
import gzip
import json
import random
import shutil
from collections import Counter

import pytest

from codeforge.corpus import content_hash, split_of
from codeforge.syntax import is_valid_syntax, parser
from codeforge.mining.pairs import (KINDS, PairError, check_pairs_by_tests, load_pairs, mine_pairs, mutate,
                                    normalise_pair, pairs_from_tasks, write_pairs)
from codeforge.mining.functions import MineError
from codeforge.mining.sft import mine_sft

PY = '''def clamp_total(xs, limit=10):
    """Add up the non-negative xs, never going over limit."""
    label = "a + b < 1 and 2"  # x - 1 > 2 or y
    total = 0
    for i in range(len(xs)):
        if xs[i] < 0:
            continue
        elif xs[i] == 0:
            return -1
        else:
            total += xs[i] * 2
    while total > limit and limit >= 0:
        total = total - 1
    if total == 3:
        total = 4
    return total
'''

GO = '''func ClampTotal(xs []int, limit int) int {
\tlabel := "a + b < 1 && 2" // x - 1 > 2 || y
\t_ = label
\ttotal := 0
\tfor i := 0; i < len(xs); i++ {
\t\tif xs[i] < 0 {
\t\t\tcontinue
\t\t} else if xs[i] == 0 {
\t\t\treturn -1
\t\t}
\t\ttotal += xs[i] * 2
\t}
\tif total > limit && limit >= 0 {
\t\treturn limit
\t} else {
\t\ttotal = total - 1
\t}
\treturn total
}
'''

# Operators and digits only inside strings and comments: nothing for operator or off_by_one to touch.
PY_TEXT_ONLY = '''def describe(x):
    """Doc with 1 + 2 < 3 inside."""
    s = "1 + 2 < 3 and 4"  # 5 - 6 > 7 or 8
    s += "!"
    return f"{x + 1}" + s
'''
GO_TEXT_ONLY = '''func Describe(x string) string {
\ts := "1 + 2 < 3 && 4" // 5 - 6 > 7 || 8
\ts += "!"
\treturn s + `9 - 10 >= 11` + x
}
'''
TEXTS = {"python": ['"a + b < 1 and 2"', "# x - 1 > 2 or y"], "go": ['"a + b < 1 && 2"', "// x - 1 > 2 || y"]}
SOURCES = {"python": PY, "go": GO}


def structure(code: str, language: str):
    """What a semantic variant must change: Python's AST, Go's tree-sitter (type, leaf text) sequence."""
    if language == "python":
        return ast.dump(ast.parse(code))
    out, stack = [], [parser("go").parse(("package p\n\n" + code).encode()).root_node]
    while stack:
        n = stack.pop()
        if n.type != "comment":
            out.append((n.type, "" if n.child_count else n.text.decode()))
            stack.extend(reversed(n.children))
    return out


def changed_lines(a: str, b: str) -> tuple[list[str], list[str]]:
    diff = list(difflib.ndiff(a.splitlines(), b.splitlines()))
    return [d[2:] for d in diff if d.startswith("- ")], [d[2:] for d in diff if d.startswith("+ ")]


def all_variants(code, language, **kw):
    return mutate(code, language, random.Random(0), per_kind=50, **kw)


# -- mutations -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("language", ["python", "go"])
def test_every_kind_found_and_keeps_its_promise(language):
    code = SOURCES[language]
    assert is_valid_syntax(code, language)
    variants = all_variants(code, language)
    assert {k for k, _ in variants} == set(KINDS)
    assert len({v for _, v in variants}) == len(variants) and code not in {v for _, v in variants}
    for kind, v in variants:
        if kind == "syntax":
            assert not is_valid_syntax(v, language), v
        else:
            assert is_valid_syntax(v, language), v
            assert structure(v, language) != structure(code, language), v


@pytest.mark.parametrize("language", ["python", "go"])
def test_semantic_edits_never_touch_strings_or_comments(language):
    for kind, v in all_variants(SOURCES[language], language,
                                kinds=["operator", "off_by_one", "dropped_branch"]):
        for text in TEXTS[language]:
            assert v.count(text) == 1, (kind, v)
    text_only = PY_TEXT_ONLY if language == "python" else GO_TEXT_ONLY
    assert all_variants(text_only, language, kinds=["operator", "off_by_one"]) == []
    # the f-string interpolation {x + 1} is inside a string too; only syntax damage is possible
    assert {k for k, _ in all_variants(text_only, language)} == {"syntax"}


def test_syntax_damage_kinds_python():
    variants = [v for _, v in all_variants(PY, "python", kinds=["syntax"])]
    assert any("for i in range(len(xs):" in v for v in variants)  # a dropped paren
    assert any("\n        else\n" in v for v in variants)  # a dropped block colon
    assert any('"""Add up the non-negative xs, never going over limit.\n' in v for v in variants)  # a quote
    go = [v for _, v in all_variants(GO, "go", kinds=["syntax"])]
    assert any('"a + b < 1 && 2 //' in v for v in go)
    assert any(v.rstrip().endswith("return total") for v in go)  # the function's closing brace


def edits(code: str, language: str, kind: str) -> set[tuple[str, str]]:
    """(old line, new line) of every variant of one kind, each variant changing exactly one line."""
    out = set()
    for _, v in all_variants(code, language, kinds=[kind]):
        old, new = changed_lines(code, v)
        assert len(old) == len(new) == 1, v
        out.add((old[0].strip(), new[0].strip()))
    return out


def test_operator_swaps_one_real_operator():
    py = edits(PY, "python", "operator")
    assert {("while total > limit and limit >= 0:", "while total > limit or limit >= 0:"),
            ("total += xs[i] * 2", "total -= xs[i] * 2"), ("total += xs[i] * 2", "total += xs[i] / 2"),
            ("if xs[i] < 0:", "if xs[i] <= 0:"), ("elif xs[i] == 0:", "elif xs[i] != 0:"),
            ("total = total - 1", "total = total + 1")} <= py
    go = edits(GO, "go", "operator")
    assert {("if total > limit && limit >= 0 {", "if total > limit || limit >= 0 {"),
            ("if xs[i] < 0 {", "if xs[i] <= 0 {"), ("total += xs[i] * 2", "total -= xs[i] * 2")} <= go
    # relational operators of loop conditions are off_by_one's, not operator's
    assert not any(new.startswith(("while total >= limit", "for i := 0; i <= len")) for _, new in py | go)


def test_off_by_one_variants():
    py = {new for _, new in edits(PY, "python", "off_by_one")}
    assert "while total >= limit and limit >= 0:" in py  # the loop bound
    assert "total = 1" in py and "total = -1" not in py  # 0 only goes up
    assert py & {"total = total - 2", "total = total - 0"}  # a literal n -> n +- 1
    assert py & {"for i in range(len(xs) + 1):", "for i in range(len(xs) - 1):"}  # a range stop
    go = {new for _, new in edits(GO, "go", "off_by_one")}
    assert {"for i := 0; i <= len(xs); i++ {", "for i := 1; i < len(xs); i++ {"} <= go
    # `range(n - 1)`: the literal changes, nothing is appended (that could undo it: n - 1 + 1)
    code = 'def f(n):\n    """Sum below n minus one."""\n    return sum(range(n - 1))\n'
    assert {new for _, new in edits(code, "python", "off_by_one")} <= {"return sum(range(n - 2))",
                                                                        "return sum(range(n - 0))"}


def test_dropped_branch_python_and_go():
    py = [v for _, v in all_variants(PY, "python", kinds=["dropped_branch"])]
    assert any("else:" not in v and "total += xs[i] * 2" not in v for v in py)  # the else clause
    assert any("elif" not in v and "else:" in v for v in py)  # the elif clause, the else kept
    assert any("            pass\n" in v and "return -1" not in v for v in py)  # lone early return -> pass
    assert any("if total == 3" not in v for v in py)  # an if with no else
    assert all(v.rstrip().endswith("return total") for v in py)  # the final return is never dropped
    go = [v for _, v in all_variants(GO, "go", kinds=["dropped_branch"])]
    assert any("} else {" not in v and "return limit\n\t}\n\treturn total" in v for v in go)
    assert any("} else if" not in v for v in go)
    assert any("return limit" not in v for v in go)
    assert all(v.rstrip().endswith("return total\n}") for v in go)


def test_mutate_is_deterministic_and_bad_input_is_refused():
    for language in ("python", "go"):
        a = mutate(SOURCES[language], language, random.Random(7))
        assert a == mutate(SOURCES[language], language, random.Random(7))
        assert 1 <= len([k for k, _ in a if k == "operator"]) <= 2  # per_kind default
    assert mutate("def f(:\n    pass\n", "python", random.Random(0)) == []  # a broken original gives nothing
    with pytest.raises(MineError, match="kinds \\['typo'\\]"):
        mutate(PY, "python", random.Random(0), kinds=["typo"])
    with pytest.raises(MineError, match="rust"):
        mutate(PY, "rust", random.Random(0))


# -- mining a corpus -------------------------------------------------------------------------------------

CORPUS = {
    "calc.py": '''"""Calculator helpers."""


def mean(xs):
    """Return the arithmetic mean of xs, or 0.0 for an empty list."""
    if not xs:
        return 0.0
    return sum(xs) / len(xs)


def undocumented(x):
    return x + 1


class Grid:
    """A grid of cells."""

    def neighbours(self, r, c):
        """The in-bounds cells next to (r, c), row by row."""
        out = []
        for dr in (-1, 0, 1):
            for dc in (-1, 0, 1):
                if (dr or dc) and 0 <= r + dr < self.h and 0 <= c + dc < self.w:
                    out.append((r + dr, c + dc))
        return out
''',
    "strs.py": '''def pad(s, n):
    """Left-pad s with spaces to at least n characters."""
    while len(s) < n:
        s = " " + s
    return s
''',
    "mathx.go": '''package mathx

// Abs returns the absolute value of x.
func Abs(x int) int {
\tif x < 0 {
\t\treturn -x
\t}
\treturn x
}

// Sum adds up the first n values of xs.
func Sum(xs []int, n int) int {
\ts := 0
\tfor i := 0; i < n; i++ {
\t\ts += xs[i]
\t}
\treturn s
}
''',
    "notes.txt": "not code\n",
}


@pytest.fixture()
def corpus(tmp_path):
    root = tmp_path / "src"
    root.mkdir()
    for name, text in CORPUS.items():
        (root / name).write_text(text, encoding="utf-8")
    return root


def test_mine_pairs_rows_and_stats(corpus):
    train, heldout, stats = mine_pairs([str(corpus)], heldout_fraction=0.5, seed=1)
    rows = train + heldout
    assert sorted(r["meta"]["name"] for r in rows) == ["Abs", "Grid.neighbours", "Sum", "mean", "pad"]
    sft_train, sft_heldout, _ = mine_sft([str(corpus)], heldout_fraction=0.5, seed=1)
    sft = {r["meta"]["name"]: r["messages"] for r in sft_train + sft_heldout}
    for r in rows:
        assert set(r) == {"prompt", "chosen", "rejected", "meta"}
        assert set(r["meta"]) == {"kind", "language", "source", "name"} and r["meta"]["kind"] in KINDS
        assert r["prompt"] == [sft[r["meta"]["name"]][0]]  # the SFT miner's request
        assert r["chosen"] == [sft[r["meta"]["name"]][1]]  # the real function
        [rejected] = r["rejected"]
        assert rejected["role"] == "assistant" and rejected["content"] != r["chosen"][0]["content"]
        language = r["meta"]["language"]
        assert is_valid_syntax(rejected["content"], language) == (r["meta"]["kind"] != "syntax")
        split = split_of(content_hash(r["chosen"][0]["content"]), 0.5)
        assert (r in heldout) == (split == "val")
    assert stats["pairs"] == stats["train"] + stats["heldout"] == len(rows) == sum(stats["kinds"].values())
    assert stats["files"] == 3 and stats["functions"] == 6 and stats["skipped"] == {"no_doc": 1}
    assert train and heldout  # both splits used with this corpus and fraction
    assert (train, heldout, stats) == mine_pairs([str(corpus)], heldout_fraction=0.5, seed=1)  # deterministic


def test_per_function_spreads_kinds_and_max_pairs_caps(corpus):
    train, heldout, stats = mine_pairs([str(corpus)], per_function=4, heldout_fraction=0.0)
    assert heldout == []
    for name in ("Abs", "Sum", "pad", "mean", "Grid.neighbours"):
        rows = [r for r in train if r["meta"]["name"] == name]
        kinds = [r["meta"]["kind"] for r in rows]
        possible = mutate(rows[0]["chosen"][0]["content"], rows[0]["meta"]["language"], random.Random(0))
        assert len(kinds) == min(4, len(possible))
        # no repeat early
        assert len(set(kinds)) == min(len(kinds), len({k for k, _ in possible})), (name, kinds)
    assert {r["meta"]["kind"] for r in train if r["meta"]["name"] == "Abs"} == set(KINDS)
    assert len({r["rejected"][0]["content"] for r in train}) == len(train)
    semantic, _, _ = mine_pairs([str(corpus)], kinds=["operator", "off_by_one", "dropped_branch"])
    assert semantic and all(r["meta"]["kind"] != "syntax" for r in semantic)
    capped, capped_held, stats = mine_pairs([str(corpus)], per_function=4, max_pairs=6)
    assert len(capped) + len(capped_held) == stats["pairs"] == 6
    with pytest.raises(MineError, match="per_function"):
        mine_pairs([str(corpus)], per_function=0)
    with pytest.raises(MineError, match="kinds"):
        mine_pairs([str(corpus)], kinds=["nope"])


def test_write_pairs(corpus, tmp_path):
    out = tmp_path / "pairs"
    stats = write_pairs([str(corpus)], out, heldout_fraction=0.0, per_function=2)
    lines = (out / "train.jsonl").read_text().splitlines()
    assert len(lines) == stats["pairs"] and (out / "heldout.jsonl").read_text() == ""
    assert load_pairs(out, split="heldout") == []  # the miner's empty held-out split is no error
    meta = json.loads((out / "meta.json").read_text())
    assert meta["stats"] == stats and meta["options"]["per_function"] == 2
    assert load_pairs(out)[0]["chat"] is True and len(load_pairs(out)) == len(lines)
    with pytest.raises(MineError, match="not empty"):
        write_pairs([str(corpus)], out)
    write_pairs([str(corpus)], out, overwrite=True, max_pairs=1)
    assert len((out / "train.jsonl").read_text().splitlines()) + len((out / "heldout.jsonl").read_text()
                                                                      .splitlines()) == 1
    with pytest.raises(MineError, match="options"):
        write_pairs([str(corpus)], tmp_path / "x", max_examples=3)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "a.py").write_text("def f(x):\n    return x\n")
    with pytest.raises(MineError, match="no preference pairs"):
        write_pairs([str(empty)], tmp_path / "none")


# -- pairs from tasks, checked by tests ------------------------------------------------------------------

TASKS = [
    {"id": "absval", "prompt": "Write absval(x), the absolute value of x.",
     "solution": "def absval(x):\n    if x < 0:\n        return -x\n    return x\n",
     "tests": "assert absval(-3) == 3\nassert absval(2) == 2\nassert absval(0) == 0\n"},
    {"id": "count_up", "prompt": "Write count_up(n): the list 1..n.",
     "solution": "def count_up(n):\n    out = []\n    i = 1\n    while i <= n:\n        out.append(i)\n"
                 "        i = i + 1\n    return out\n",
     "tests": "assert count_up(3) == [1, 2, 3]\nassert count_up(0) == []\n"},
]


def test_pairs_from_tasks_candidates():
    rows = pairs_from_tasks(TASKS, per_task=3)
    assert rows == pairs_from_tasks(TASKS, per_task=3)  # deterministic
    assert Counter(r["meta"]["task_id"] for r in rows) == {"absval": 3, "count_up": 3}
    for r in rows:
        task = {t["id"]: t for t in TASKS}[r["meta"]["task_id"]]
        assert r["prompt"] == [{"role": "user", "content": task["prompt"]}]
        assert r["chosen"] == [{"role": "assistant", "content": task["solution"]}]
        assert r["meta"]["language"] == "python" and r["meta"]["kind"] in KINDS
    skipped = Counter()
    assert pairs_from_tasks([{"id": "x", "prompt": "p", "solution": "def f(:", "tests": ""}],
                            skipped=skipped) == []
    assert skipped == {"unparseable": 1}
    assert pairs_from_tasks([{"id": "y", "prompt": "p", "tests": "assert True"}], skipped=skipped) == []
    assert skipped == {"unparseable": 1, "no_solution": 1}
    with pytest.raises(MineError, match="no 'id'"):
        pairs_from_tasks([{"prompt": "p", "solution": "x = 1"}])


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")
def test_check_pairs_by_tests_keeps_only_behaviour_changes():
    rows = pairs_from_tasks(TASKS, per_task=3, kinds=["operator", "off_by_one", "dropped_branch"])
    absval, count_up = TASKS[0]["solution"], TASKS[1]["solution"]
    same = absval.replace("x < 0", "x <= 0")  # -0 == 0: the tests cannot tell
    differs = count_up.replace("i <= n", "i < n")

    def row(task_id, chosen, rejected):
        return {"prompt": [{"role": "user", "content": "p"}],
                "chosen": [{"role": "assistant", "content": chosen}],
                "rejected": [{"role": "assistant", "content": rejected}],
                "meta": {"kind": "operator", "language": "python", "task_id": task_id}}

    extra = [row("absval", absval, same), row("count_up", count_up, differs), row("nope", absval, same),
             row("absval", absval.replace("-x", "x"), same)]  # a chosen side that fails its own tests
    tasks = {t["id"]: t for t in TASKS}
    kept, dropped = check_pairs_by_tests(rows + extra, tasks, timeout=3.0)
    assert dropped["unknown_task"] == 1 and dropped["chosen_fails"] == 1 and dropped["same_behaviour"] >= 1
    assert sum(dropped.values()) + len(kept) == len(rows) + len(extra)
    kept_rejected = [r["rejected"][0]["content"] for r in kept]
    assert differs in kept_rejected and same not in kept_rejected and kept
    assert all(r["meta"]["rejected_status"] in ("failed", "timeout", "memory") for r in kept)
    assert all(r["chosen"][0]["content"] in (absval, count_up) for r in kept)


# -- reading pairs users bring ---------------------------------------------------------------------------

def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows),
                    encoding="utf-8")
    return path


USER = {"role": "user", "content": "Add 2 and 2."}
GOOD, BAD = {"role": "assistant", "content": "4"}, {"role": "assistant", "content": "5"}


def test_load_pairs_accepts_the_three_shapes(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [
        {"prompt": "2+2=", "chosen": "4", "rejected": "5"},
        {"prompt": [USER], "chosen": [GOOD], "rejected": [BAD]},
        {"prompt": [USER], "chosen": "4", "rejected": BAD},
        {"chosen": [USER, GOOD], "rejected": [USER, BAD]},
        "",
        {"chosen": [USER, GOOD, USER, GOOD], "rejected": [USER, GOOD, USER, BAD], "score": 1},
    ])
    rows = load_pairs(path)
    assert rows[0] == {"prompt": "2+2=", "chosen": "4", "rejected": "5", "chat": False}
    for r in rows[1:4]:
        assert r == {"prompt": [USER], "chosen": "4", "rejected": "5", "chat": True}
    assert rows[4] == {"prompt": [USER, GOOD, USER], "chosen": "4", "rejected": "5", "chat": True}
    assert len(rows) == 5
    gz = tmp_path / "p.jsonl.gz"
    gz.write_bytes(gzip.compress(path.read_bytes()))
    assert load_pairs(gz) == rows
    d = tmp_path / "dir"
    d.mkdir()
    write_jsonl(d / "train.jsonl", [{"prompt": "a", "chosen": "b", "rejected": "c"}])
    write_jsonl(d / "heldout.jsonl", [{"prompt": "x", "chosen": "y", "rejected": "z"}])
    assert load_pairs(d)[0]["prompt"] == "a" and load_pairs(d, split="heldout")[0]["prompt"] == "x"


BAD_ROWS = [
    ("{not json", "bad_json", "not JSON"),
    ({"prompt": "p", "chosen": "a"}, "missing_side", "no 'rejected'"),
    ({"prompt": "p", "rejected": "a"}, "missing_side", "no 'chosen'"),
    ({"prompt": "p", "chosen": "a", "rejected": "a"}, "same_sides", "same text"),
    ({"prompt": "p", "chosen": "  ", "rejected": "a"}, "empty_side", "'chosen' is empty"),
    ({"prompt": [USER], "chosen": [GOOD], "rejected": [{"role": "assistant", "content": ""}]}, "empty_side",
     "'rejected' is empty"),
    ({"prompt": "p", "chosen": 3, "rejected": "a"}, "bad_type", "'chosen' must be text too, not int"),
    ({"prompt": 7, "chosen": "a", "rejected": "b"}, "bad_type", "'prompt' is int"),
    ([1, 2], "bad_type", "JSON object"),
    ({"prompt": [USER], "chosen": [GOOD, BAD], "rejected": [BAD]}, "bad_message", "exactly one assistant"),
    ({"prompt": [USER], "chosen": [USER], "rejected": [BAD]}, "bad_message", "is a user message"),
    ({"prompt": [{"role": "robot", "content": "x"}], "chosen": "a", "rejected": "b"}, "bad_message",
     "'robot'"),
    ({"prompt": [USER, GOOD], "chosen": "a", "rejected": "b"}, "bad_message", "ends with an assistant"),
    ({"chosen": "4", "rejected": "5"}, "no_prompt", "no 'prompt'"),
    ({"chosen": [GOOD], "rejected": [BAD]}, "no_prompt", "share no leading messages"),
    ({"chosen": [USER, GOOD], "rejected": [USER, GOOD]}, "same_sides", "same conversation"),
    ({"chosen": [USER, GOOD, USER], "rejected": [USER, BAD]}, "bad_message", "it has assistant, user"),
]


@pytest.mark.parametrize("bad,reason,message", BAD_ROWS)
def test_load_pairs_names_file_line_and_problem(tmp_path, bad, reason, message):
    ok = {"prompt": "p", "chosen": "a", "rejected": "b"}
    path = write_jsonl(tmp_path / "p.jsonl", [ok, ok, bad, ok])
    with pytest.raises(PairError) as e:
        load_pairs(path)
    assert f"{path}: line 3: " in str(e.value) and message in str(e.value) and e.value.reason == reason
    skipped = Counter()
    assert len(load_pairs(path, skipped=skipped)) == 3 and skipped == {reason: 1}
    if not isinstance(bad, str):
        with pytest.raises(PairError) as e:  # one row, as a caller holding parsed JSON sees it
            normalise_pair(bad)
        assert e.value.reason == reason and message in str(e.value)


def test_load_pairs_file_errors(tmp_path):
    with pytest.raises(PairError, match="no such preference-pair file"):
        load_pairs(tmp_path / "missing.jsonl")
    with pytest.raises(PairError, match="holds no train.jsonl"):
        load_pairs(tmp_path)
    with pytest.raises(PairError, match="split 'test'"):
        load_pairs(tmp_path, split="test")
    empty = write_jsonl(tmp_path / "empty.jsonl", [""])
    with pytest.raises(PairError, match="no preference pairs .the file is empty"):
        load_pairs(empty)
    (tmp_path / "train.jsonl").write_text("")
    with pytest.raises(PairError, match="train.jsonl: no preference pairs"):
        load_pairs(tmp_path)
    bad = write_jsonl(tmp_path / "bad.jsonl", ["[", {"chosen": "a"}])
    with pytest.raises(PairError, match="line 1: not JSON"):
        load_pairs(bad)
    skipped = Counter()
    with pytest.raises(PairError, match=r"no preference pairs \(2 bad rows skipped"):
        load_pairs(bad, skipped=skipped)
