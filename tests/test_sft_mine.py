import json
from collections import Counter

import pytest

from codeforge.corpus import content_hash, split_of
from codeforge.mining.functions import MineError, mine_functions
from codeforge.mining.sft import mine_sft, write_sft

A_PY = '''"""Module a."""
import functools


def add(a, b):
    """Return the sum of a and b."""
    return a + b


def undocumented(x):
    return x * 2


def tiny(x):
    """Tiny."""
    return x


def stub(x):
    """This function is not written yet."""
    pass


def ellipsis_stub(x):
    """Another placeholder without a body."""
    ...


@functools.lru_cache(maxsize=None)
def fib(n: int,
        memo: bool = True) -> int:
    """Return the n-th Fibonacci number, cached."""
    return n if n < 2 else fib(n - 1) + fib(n - 2)


class Stack:
    """A stack of items."""

    def __init__(self):
        self.items = []

    def push(self, item):
        """Put item on top of the stack.

        Returns the new size.
        """
        self.items.append(item)
        return len(self.items)

    def nested(self):
        """Has a nested helper inside it."""
        def helper():
            """Nested helpers are not mined."""
            return 1
        return helper()
'''

B_PY = '''def add(a, b):
    """Return the sum of a and b."""
    return a + b


def scale(v, k=2):
    """Multiply every element of v by k (× k)."""
    return [k * x for x in v]
'''

TEST_PY = '''def helper_for_tests(x):
    """Only mined when test files are kept."""
    return x + 1
'''

SET_GO = '''package set

import "sort"

// Set is a set of ints.
type Set map[int]bool

// Add puts x in the set and reports whether it was new.
//
//go:noinline
func (s Set) Add(x int) bool {
\tif s[x] {
\t\treturn false
\t}
\ts[x] = true
\treturn true
}

func (s Set) Len() int { return len(s) }

// Sorted returns the members in increasing order.
func (s *Set) Sorted() []int {
\tout := make([]int, 0, len(*s))
\tfor x := range *s {
\t\tout = append(out, x)
\t}
\tsort.Ints(out)
\treturn out
}
'''

UTIL_GO = '''package set

// Max returns the larger of a and b.
func Max(a, b int) int {
\tif a > b {
\t\treturn a
\t}
\treturn b
}

// Noop does nothing at all, on purpose.
func Noop() {}

var limit = 3 // the limit
func Min(a, b int) int {
\tif a < b {
\t\treturn a
\t}
\treturn b
}
'''

PUSH = '''def push(self, item):
    """Put item on top of the stack.

    Returns the new size.
    """
    self.items.append(item)
    return len(self.items)'''

FIB_SIG = "def fib(n: int,\n        memo: bool = True) -> int:"

ADD_GO = "func (s Set) Add(x int) bool {\n\tif s[x] {\n\t\treturn false\n\t}\n\ts[x] = true\n\treturn true\n}"

MINED = ["add", "fib", "Stack.push", "Stack.nested", "scale", "Set.Add", "Set.Sorted", "Max"]


@pytest.fixture()
def tree(tmp_path):
    root = tmp_path / "src"
    root.mkdir()
    for name, text in [("a.py", A_PY), ("b.py", B_PY), ("test_c.py", TEST_PY), ("set.go", SET_GO),
                       ("util.go", UTIL_GO)]:
        (root / name).write_text(text, encoding="utf-8")
    return root


def by_name(rows):
    return {r["meta"]["name"]: r for r in rows}


def test_mines_exactly_the_documented_functions(tree):
    train, heldout, stats = mine_sft([str(tree)])
    rows = train + heldout
    assert sorted(r["meta"]["name"] for r in rows) == sorted(MINED)
    assert stats["files"] == 4 and stats["functions"] == 17 and stats["examples"] == 8
    assert stats["skipped"] == {"no_doc": 4, "short_doc": 1, "trivial_body": 3, "duplicate": 1}
    assert stats["corpus_skipped"] == {"test_file": 1}
    rows = by_name(rows)
    assert rows["add"]["meta"] == {"source": str(tree / "a.py"), "language": "python", "name": "add"}
    assert rows["Set.Add"]["meta"]["language"] == "go"
    for r in rows.values():
        assert [m["role"] for m in r["messages"]] == ["user", "assistant"]


def test_assistant_is_the_real_source_and_user_has_signature_and_doc(tree):
    train, heldout, _ = mine_sft([str(tree)])
    rows = by_name(train + heldout)
    answer = {name: r["messages"][1]["content"] for name, r in rows.items()}
    ask = {name: r["messages"][0]["content"] for name, r in rows.items()}
    assert answer["Stack.push"] == PUSH  # a method, dedented
    fib = A_PY[A_PY.index("@functools"):A_PY.index("fib(n - 2)") + len("fib(n - 2)")]
    assert answer["fib"] == fib  # decorator included
    assert answer["Set.Add"] == ADD_GO  # from func to }, no doc comment
    assert answer["Max"] in UTIL_GO and answer["Max"].startswith("func Max") and answer["Max"].endswith("}")
    assert FIB_SIG in ask["fib"] and "@functools.lru_cache(maxsize=None)" in ask["fib"]
    assert '    """Return the n-th Fibonacci number, cached."""\n```' in ask["fib"]
    assert "def push(self, item):" in ask["Stack.push"] and "    Returns the new size.\n" in ask["Stack.push"]
    assert "self.items.append" not in ask["Stack.push"]  # the body is the answer, not the question
    go_stub = ("```go\n// Add puts x in the set and reports whether it was new.\n//\n"
               "func (s Set) Add(x int) bool\n```")
    assert go_stub in ask["Set.Add"] and "go:noinline" not in ask["Set.Add"]
    assert "```go\n// Sorted returns the members in increasing order.\nfunc (s *Set) Sorted() []int\n```" \
        in ask["Set.Sorted"]
    for name in MINED:
        assert ("```python\n" if rows[name]["meta"]["language"] == "python" else "```go\n") in ask[name]


def test_mine_functions_fields_and_skips():
    skipped = Counter()
    fns = {f["name"]: f for f in mine_functions(A_PY, "python", skipped)}
    assert list(fns) == ["add", "fib", "Stack.push", "Stack.nested"]
    assert fns["fib"]["signature"] == FIB_SIG
    assert fns["Stack.push"]["doc"] == "Put item on top of the stack.\n\nReturns the new size."
    assert fns["Stack.push"]["code"] == PUSH
    assert skipped == {"no_doc": 2, "short_doc": 1, "trivial_body": 2}
    go = {f["name"]: f for f in mine_functions(SET_GO, "go")}
    assert list(go) == ["Set.Add", "Set.Sorted"]
    assert go["Set.Add"]["doc"] == "Add puts x in the set and reports whether it was new."
    assert go["Set.Add"]["signature"] == "func (s Set) Add(x int) bool"
    with pytest.raises(MineError, match="'rust'"):
        mine_functions("fn main() {}", "rust")


def test_deterministic_and_seeded(tree):
    assert mine_sft([str(tree)]) == mine_sft([str(tree)])
    a, _, _ = mine_sft([str(tree)], heldout_fraction=0.0)
    b, _, _ = mine_sft([str(tree)], heldout_fraction=0.0, seed=1)
    assert [r["messages"][1] for r in a] == [r["messages"][1] for r in b]
    assert [r["messages"][0] for r in a] != [r["messages"][0] for r in b]  # other phrasings


def test_heldout_split_disjoint_and_stable(tree):
    train, heldout, stats = mine_sft([str(tree)], heldout_fraction=0.5)
    tn, hn = {r["meta"]["name"] for r in train}, {r["meta"]["name"] for r in heldout}
    assert not tn & hn and sorted(tn | hn) == sorted(MINED) and tn and hn
    assert stats["train"] == len(train) and stats["heldout"] == len(heldout)
    for r in train + heldout:
        want = "val" if r in heldout else "train"
        assert split_of(content_hash(r["messages"][1]["content"]), 0.5) == want
    # fewer files: every function keeps its split
    train2, heldout2, _ = mine_sft([str(tree / "a.py"), str(tree / "set.go")], heldout_fraction=0.5)
    assert {r["meta"]["name"] for r in heldout2} == hn & {r["meta"]["name"] for r in train2 + heldout2}


def test_options_filter(tree):
    _, _, stats = mine_sft([str(tree)], exclude_tests=False)
    assert stats["examples"] == 9 and "corpus_skipped" in stats and not stats["corpus_skipped"]
    train, heldout, stats = mine_sft([str(tree)], languages=["go"])
    assert sorted(r["meta"]["name"] for r in train + heldout) == ["Max", "Set.Add", "Set.Sorted"]
    train, heldout, stats = mine_sft([str(tree)], max_chars=len(PUSH))
    assert stats["skipped"]["too_long"] == 2 and stats["examples"] == 6  # fib and nested are longer
    assert "Stack.push" in {r["meta"]["name"] for r in train + heldout}
    train, heldout, stats = mine_sft([str(tree)], max_examples=3)
    assert [r["meta"]["name"] for r in train + heldout] == ["add", "fib", "Stack.push"]
    with pytest.raises(MineError, match="'rust'"):
        mine_sft([str(tree)], languages=["rust"])
    with pytest.raises(MineError, match="1.5"):
        mine_sft([str(tree)], heldout_fraction=1.5)


def test_write_sft_files_and_refusals(tree, tmp_path):
    out = tmp_path / "sft"
    stats = write_sft([str(tree)], out, heldout_fraction=0.5)
    train = [json.loads(line) for line in (out / "train.jsonl").read_text(encoding="utf-8").splitlines()]
    heldout = [json.loads(line) for line in (out / "heldout.jsonl").read_text(encoding="utf-8").splitlines()]
    assert (train, heldout) == mine_sft([str(tree)], heldout_fraction=0.5)[:2]
    assert "× k" in (out / "train.jsonl").read_text(encoding="utf-8") + (out / "heldout.jsonl").read_text()
    meta = json.loads((out / "meta.json").read_text())
    assert meta["stats"] == stats and meta["sources"] == [str(tree)]
    assert meta["options"]["heldout_fraction"] == 0.5 and meta["options"]["max_chars"] == 4000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sft", "src"]  # no staging dir left behind
    with pytest.raises(MineError, match="not empty.*--overwrite"):
        write_sft([str(tree)], out)
    assert write_sft([str(tree)], out, overwrite=True, heldout_fraction=0.0)["train"] == 8
    assert (out / "heldout.jsonl").read_text() == ""
    empty = tmp_path / "bare"
    empty.mkdir()
    (empty / "x.py").write_text("def f(x):\n    return x\n")
    with pytest.raises(MineError, match=r"no instruction pairs found in .*bare.*--languages"):
        write_sft([str(empty)], tmp_path / "none")
    assert not (tmp_path / "none").exists()
