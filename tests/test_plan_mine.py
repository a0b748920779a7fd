import json
import os
import textwrap
from pathlib import Path

import pytest

from codeforge import CodeforgeError
from codeforge.cli import main
from codeforge.corpus import content_hash, split_of
from codeforge.mining.plans import (CODE_OPEN, PLAN_OPEN, PLAN_WORDS, PlanMineError, mine_plans, parse_plan,
                                    plan_text, write_plans)
from codeforge.mining.sft import mine_sft

A_PY = '''"""Module a."""
import functools


def walk(items, pred):
    """Yield the items that pass pred, stopping at None."""
    for x in items:
        if x is None:
            break
        elif pred(x):
            yield x
        else:
            continue
    return None


@functools.lru_cache(maxsize=None)
def load(path,
         strict=True):
    """Read path, retrying once."""
    total = 0
    total += 1
    with open(path) as f:
        data = f.read()
    try:
        value = parse(data)
    except ValueError as e:
        raise RuntimeError(path) from e
    else:
        log(value)
    finally:
        close()
    while total < 3:
        total -= 1
    assert total
    del data
    return value


class Box:
    """A box."""

    def __init__(self):
        self.items = []

    async def fetch(self, key):
        # no docstring here
        async with self.lock:
            value = await self.get(key)
        await self.flush()
        match key:
            case 1:
                pass
            case _:
                global counter
        def helper():
            return 1
        class Inner:
            pass
        lambda: 0
        import os
        return helper

    def todo(self):
        """Not yet."""
        raise NotImplementedError


def stub():
    ...


def one(x): return x * 2
'''

B_PY = '''def walk(items, pred):
    """Yield the items that pass pred, stopping at None."""
    for x in items:
        if x is None:
            break
        elif pred(x):
            yield x
        else:
            continue
    return None


def scale(v, k=2):
    return [k * x for x in v]
'''

BROKEN_PY = '''def good(x):
    return x + 1


def broken(x):
    return (x +
'''

TEST_PY = '''def helper_for_tests(x):
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

var limit = 3 // the limit
func Min(a, b int) int {
\tif a < b {
\t\treturn a
\t}
\treturn b
}

func Noop() {}

func Asm(x int) int
'''

PUMP_GO = '''package set

// Pump moves values until done.
func Pump(in <-chan int, out chan<- int, done chan struct{}) (n int, err error) {
\tvar buf []int
\tconst limit = 10
\tdefer close(out)
\tgo func() { <-done }()
loop:
\tfor {
\t\tselect {
\t\tcase v, ok := <-in:
\t\t\tif !ok {
\t\t\t\tbreak loop
\t\t\t} else if v < 0 {
\t\t\t\tcontinue
\t\t\t} else {
\t\t\t\tn++
\t\t\t}
\t\t\tout <- v
\t\tcase <-done:
\t\t\treturn n, nil
\t\tdefault:
\t\t}
\t}
\tswitch {
\tcase n > limit:
\t\tfallthrough
\tcase n == 0:
\t\terr = errors.New("x")
\t}
\tswitch t := any(buf).(type) {
\tcase []int:
\t\t_ = t
\t}
\t{
\t\tn--
\t}
\t<-done
\tgoto end
end:
\treturn
}
'''

PLANS = {
    "walk": "for { if { break } elif { yield } else { continue } } return",
    "load": "assign assign with { assign } try { assign } except { raise } else { call } finally { call } "
            "while { assign } assert del return",
    "Box.__init__": "assign",
    "Box.fetch": "with { assign } await match { case { pass } case { global } } def class expr import return",
    "one": "return",
    "scale": "return",
    "good": "return",
    "Set.Add": "if { return } assign return",
    "Set.Len": "return",
    "Set.Sorted": "assign for { assign } call return",
    "Min": "if { return } return",
    "Pump": "var const defer go for { select { case { if { break } elif { continue } else { assign } send } "
            "case { return } default { } } } switch { case { fallthrough } case { assign } } "
            "switch { case { assign } } block { assign } expr goto return",
}


@pytest.fixture()
def tree(tmp_path):
    root = tmp_path / "src"
    (root / "pkg").mkdir(parents=True)
    (root / "vendor").mkdir()
    for name, text in [("a.py", A_PY), ("b.py", B_PY), ("broken.py", BROKEN_PY), ("test_c.py", TEST_PY),
                       ("set.go", SET_GO), ("pkg/pump.go", PUMP_GO), ("vendor/v.go", SET_GO)]:
        (root / name).write_text(text, encoding="utf-8")
    return root


def by_name(rows):
    return {r["name"]: r for r in rows}


def test_plans_of_known_functions_both_languages(tree):
    train, val, stats = mine_plans([str(tree)], exclude_tests=True)
    rows = by_name(train + val)
    assert {name: " ".join(r["plan"]) for name, r in rows.items()} == PLANS
    assert stats["files"] == 5 and stats["examples"] == len(PLANS) and stats["truncated_plans"] == 0
    # a.py 7 (helper is nested: not counted), b.py 2, broken.py 2, set.go 6, pump.go 1
    assert stats["functions"] == 7 + 2 + 2 + 6 + 1
    assert stats["skipped"] == {"duplicate": 1, "no_body": 1, "syntax_error": 1, "trivial_body": 3}
    assert stats["corpus_skipped"] == {"test_file": 1, "vendored": 1}
    for r in rows.values():
        assert set(r) == {"prompt", "plan", "body", "language", "source", "name", "split"}
        assert set(r["plan"]) <= set(PLAN_WORDS) and r["split"] in ("train", "val")
    assert rows["walk"]["source"] == str(tree / "a.py")  # the first copy is kept, b.py's is the duplicate
    assert rows["Pump"]["language"] == "go" and rows["load"]["language"] == "python"
    # the test file is mined when tests are kept
    assert "helper_for_tests" in by_name(sum(mine_plans([str(tree)])[:2], []))


def test_prompt_plus_body_is_the_source_and_holds_the_doc(tree):
    train, val, _ = mine_plans([str(tree)])
    rows = by_name(train + val)

    def cut(text, first, last):
        return text[text.index(first):text.index(last) + len(last)]

    expect = {
        "walk": cut(A_PY, "def walk", "    return None"),
        "load": cut(A_PY, "@functools", "    return value"),
        "Box.fetch": textwrap.dedent(cut(A_PY, "    async def fetch", "        return helper")),
        "one": "def one(x): return x * 2",
        "Set.Add": cut(SET_GO, "// Add puts", "\treturn true\n}"),
        "Set.Len": "func (s Set) Len() int { return len(s) }",
        "Min": cut(SET_GO, "func Min", "\treturn b\n}"),
        "Pump": cut(PUMP_GO, "// Pump", "\treturn\n}"),
    }
    for name, source in expect.items():
        assert rows[name]["prompt"] + rows[name]["body"] == source, name
    load = rows["load"]
    assert load["prompt"] == cut(A_PY, "@functools", '"""Read path, retrying once."""')
    assert load["body"].startswith("\n    total = 0\n")
    assert rows["Box.fetch"]["prompt"] == "async def fetch(self, key):"  # no docstring: header only
    assert rows["Box.fetch"]["body"].startswith("\n    # no docstring here\n    async with")
    assert rows["one"]["prompt"] == "def one(x):" and rows["one"]["body"] == " return x * 2"
    add = rows["Set.Add"]
    assert add["prompt"] == ("// Add puts x in the set and reports whether it was new.\n//\n//go:noinline\n"
                             "func (s Set) Add(x int) bool {")
    assert add["body"] == "\n\tif s[x] {\n\t\treturn false\n\t}\n\ts[x] = true\n\treturn true\n}"
    assert rows["Min"]["prompt"] == "func Min(a, b int) int {"  # a trailing comment above is no doc
    assert rows["Set.Len"]["body"] == " return len(s) }"


def test_parse_plan_agrees_with_records_and_reads_snippets(tree):
    train, val, _ = mine_plans([str(tree)])
    for r in train + val:  # the whole function and the body alone give the record's plan
        assert parse_plan(r["prompt"] + r["body"], r["language"]) == r["plan"], r["name"]
        assert parse_plan(r["body"], r["language"]) == r["plan"], r["name"]
    assert parse_plan("for x in y:\n    if a: return b\n", "python") == "for { if { return } }".split()
    assert parse_plan("x = 1\nf(x)\nyield x\nx, y\n", "python") == ["assign", "call", "yield", "expr"]
    assert parse_plan("x := 1\nfor {\n\tch <- x\n}\n", "go") == ["assign", "for", "{", "send", "}"]
    go_file = "package p\n\nimport \"fmt\"\n\nvar v = 1\n\nfunc A() {}\n\nfunc B() { fmt.Println() }\n"
    assert parse_plan(go_file, "go") == ["import", "var", "def", "def"]  # a file: its top level
    assert parse_plan("\tif a {\n\t\treturn\n\t}\n", "go") == ["if", "{", "return", "}"]  # no closing brace
    # doc in the prompt
    assert parse_plan("def f(x):\n    '''Doc.'''\n    return x\n", "python") == ["return"]
    # the cap matches the miner's
    assert parse_plan("a()\nb()\nc()\nd()\n", "python", max_plan_words=3) == ["call", "call", "..."]


@pytest.mark.parametrize("code,language", [
    ("def f(x:\n    return x\n", "python"), ("    return (x +\n", "python"), ("for x in\n", "python"),
    ("func f() {\n\tif x {\n", "go"), ("x := (1 +\n", "go"), ("package p\nfunc f() { return }}\n", "go"),
])
def test_parse_plan_is_none_on_broken_code(code, language):
    assert parse_plan(code, language) is None


def test_parse_plan_refuses_other_languages():
    with pytest.raises(PlanMineError, match="rust"):
        parse_plan("fn main() {}", "rust")


def test_plan_text_single_stream():
    r = {"prompt": "def f(x):", "plan": ["if", "{", "return", "}"], "body": "\n    if x:\n        return 1"}
    text = plan_text(r)
    assert text == "def f(x):\n<plan> if { return } <code>\n    if x:\n        return 1"
    assert PLAN_OPEN == "<plan>" and CODE_OPEN == "<code>"
    prompt, rest = text.split("\n" + PLAN_OPEN + " ", 1)
    plan, body = rest.split(" " + CODE_OPEN, 1)
    assert prompt + body == r["prompt"] + r["body"] and plan.split() == r["plan"]


def test_plan_words_vocabulary():
    assert isinstance(PLAN_WORDS, tuple) and len(set(PLAN_WORDS)) == len(PLAN_WORDS)
    assert all(isinstance(w, str) and w and " " not in w for w in PLAN_WORDS)
    assert {"{", "}", "...", "assign", "call", "return", "if", "elif", "else", "for", "while", "try",
            "except",
            "finally", "with", "raise", "yield", "break", "continue", "defer", "go", "select", "switch",
            "case", "var", "const", "expr"} <= set(PLAN_WORDS)


def test_split_is_by_hash_stable_and_matches_sft(tree, tmp_path):
    train, val, _ = mine_plans([str(tree)], val_fraction=0.5)
    assert (
        train and val and all(r["split"] == "train" for r in train) and all(r["split"] == "val" for r in val)
    )
    split = {r["name"]: r["split"] for r in train + val}
    # adding files moves no function to the other split, and the same run gives the same records
    more = tmp_path / "more"
    more.mkdir()
    for i in range(20):
        (more / f"m{i}.py").write_text(f"def f{i}(x):\n    y = x * {i}\n    return y\n")
    train2, val2, _ = mine_plans([str(more), str(tree)], val_fraction=0.5)
    split2 = {r["name"]: r["split"] for r in train2 + val2}
    assert all(split2[name] == s for name, s in split.items())
    assert mine_plans([str(tree)], val_fraction=0.5)[:2] == (train, val)
    # the hash is sft_mine's: a documented function held out from SFT is held out here too
    _, heldout, _ = mine_sft([str(tree)], heldout_fraction=0.5)
    assert heldout and {r["meta"]["name"] for r in heldout} <= {r["name"] for r in val}
    assert split["Min"] == split_of(content_hash(SET_GO[SET_GO.index("func Min"):SET_GO.index("\treturn b\n}")
                                                        + 12]),
                                    0.5)
    # another seed is another, equally deterministic split
    salted = mine_plans([str(tree)], val_fraction=0.5, seed=7)
    assert salted == mine_plans([str(tree)], val_fraction=0.5, seed=7)
    assert {r["name"] for r in salted[1]} != {r["name"] for r in val}


def test_skip_reasons_caps_and_limits(tree):
    train, val, stats = mine_plans([str(tree)], max_chars=60, exclude_tests=True)
    assert stats["skipped"]["too_long"] >= 5 and "duplicate" not in stats["skipped"]  # both walks too long
    assert {r["name"] for r in train + val} == {"Box.__init__", "one", "scale", "good", "Set.Len"}
    assert all(len(r["prompt"] + r["body"]) <= 60 for r in train + val)
    train, val, stats = mine_plans([str(tree)], min_plan_words=2, exclude_tests=True)
    assert stats["skipped"]["short_plan"] == sum(len(p.split()) < 2 for p in PLANS.values())
    train, val, stats = mine_plans([str(tree)], max_plan_words=6, exclude_tests=True)
    rows = by_name(train + val)
    assert rows["walk"]["plan"] == ["for", "{", "if", "{", "break", "..."]
    assert rows["Set.Add"]["plan"] == ["if", "{", "return", "}", "assign", "return"]  # exactly 6: not cut
    assert stats["truncated_plans"] == sum(len(p.split()) > 6 for p in PLANS.values())
    assert all(len(r["plan"]) <= 6 for r in train + val)
    assert mine_plans([str(tree)], max_examples=3)[2]["examples"] == 3
    assert mine_plans([str(tree)], languages=["go"])[2]["examples"] == 5
    for bad in ({"languages": ["rust"]}, {"val_fraction": 1.0}, {"max_plan_words": 1}, {"max_chars": 0}):
        with pytest.raises(PlanMineError):
            mine_plans([str(tree)], **bad)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_hostile_inputs_are_skipped_and_counted(tree):
    os.mkfifo(tree / "pipe.py")
    os.symlink(tree / "loop_b.go", tree / "loop_a.go")
    os.symlink(tree / "loop_a.go", tree / "loop_b.go")
    os.symlink(tree / "pkg", tree / "linked")
    train, val, stats = mine_plans([str(tree)])
    assert stats["examples"] == len(PLANS) + 1  # the test file's function, nothing twice through the link
    assert stats["corpus_skipped"]["not_regular_file"] == 1 and stats["corpus_skipped"]["broken_symlink"] == 2
    assert stats["corpus_skipped"]["symlinked_dir"] == 1


def test_write_plans_atomic_and_refuses_existing(tree, tmp_path):
    out = tmp_path / "plans"
    stats = write_plans([str(tree)], out, val_fraction=0.5)
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "train.jsonl", "val.jsonl"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging leftovers
    train, val, _ = mine_plans([str(tree)], val_fraction=0.5)
    for name, rows in (("train.jsonl", train), ("val.jsonl", val)):
        assert [json.loads(line) for line in (out / name).read_text(encoding="utf-8").splitlines()] == rows
    meta = json.loads((out / "meta.json").read_text())
    assert meta["plan_words"] == list(PLAN_WORDS) and meta["options"]["val_fraction"] == 0.5
    assert stats["example"] == train[0] and stats["examples"] == len(train) + len(val)
    before = (out / "train.jsonl").read_bytes()
    with pytest.raises(PlanMineError, match="already exists.*--overwrite") as e:
        write_plans([str(tree)], out)
    assert isinstance(e.value, CodeforgeError)
    assert (out / "train.jsonl").read_bytes() == before  # untouched
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(PlanMineError, match="already exists"):
        write_plans([str(tree)], empty)
    write_plans([str(tree)], out, overwrite=True, languages=["go"])
    assert (
        len((out / "train.jsonl").read_text().splitlines())
        + len((out / "val.jsonl").read_text().splitlines())
        == 5
    )
    nothing = tmp_path / "nothing"
    nothing.mkdir()
    (nothing / "x.py").write_text("x = 1\n")
    with pytest.raises(PlanMineError, match="no functions"):
        write_plans([str(nothing)], tmp_path / "none")
    with pytest.raises(TypeError):
        write_plans([str(tree)], tmp_path / "bad", heldout_fraction=0.1)  # a misspelt option fails first


def test_cli_make_plans(tree, tmp_path, capsys):
    out = tmp_path / "plans"
    argv = ["make-plans", "--input", str(tree), "--out", str(out), "--exclude-tests", "--max-plan-words",
            "64", "--languages", "go", "python"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert f"mined {len(PLANS)} plan records" in text and str(out) in text
    assert "skipped functions: duplicate 1, no_body 1, syntax_error 1, trivial_body 3" in text
    assert "skipped files: test_file 1, vendored 1" in text
    example = json.loads(text[text.index("example record:\n") + len("example record:\n"):])
    assert set(example) == {"prompt", "plan", "body", "language", "source", "name", "split"}
    assert main(argv) == 2  # never overwritten silently
    assert "already exists" in capsys.readouterr().err
    assert main(argv + ["--overwrite", "--max-examples", "2"]) == 0
    assert "mined 2 plan records" in capsys.readouterr().out


REAL = [Path("/usr/lib/python3.11/json"), Path("/usr/share/go-1.19/src/strings")]


@pytest.mark.parametrize("root", REAL, ids=["python-json", "go-strings"])
def test_real_code(root):
    if not root.is_dir():
        pytest.skip(f"{root} is not installed")
    train, val, stats = mine_plans([str(root)], exclude_tests=True, max_plan_words=10_000)
    rows = train + val
    assert len(rows) >= 15 and stats["truncated_plans"] == 0
    if root.name == "strings":
        assert stats["corpus_skipped"]["test_file"] > 0
    for r in rows:
        assert set(r["plan"]) <= set(PLAN_WORDS) and r["plan"]
        assert parse_plan(r["prompt"] + r["body"], r["language"]) == r["plan"], r["name"]
        assert parse_plan(r["body"], r["language"]) == r["plan"], r["name"]
        source = Path(r["source"]).read_text(encoding="utf-8")
        code = r["prompt"] + r["body"]
        if "." not in r["name"] or r["language"] == "go":  # top-level: verbatim in the file
            assert code in source, r["name"]
        else:  # a method (of a class at top level): dedented by its first line's indentation
            assert textwrap.indent(code, " " * 4 * r["name"].count(".")) in source, r["name"]
    words = {w for r in rows for w in r["plan"]}
    assert {"if", "for", "return", "assign", "call"} <= words
