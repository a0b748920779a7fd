"""Benchmarks kept out of the training data (decontam.py): a file that holds a HumanEval problem and its
solution, verbatim or re-indented, is dropped by `prepare` by default and counted, and so is a solution under
other names and layout (its shape); a JSONL of the user's own tasks and a directory of held-out files work the
same; ordinary code is kept."""

import gzip
import json
import sysconfig
from pathlib import Path

import numpy as np

from codeforge.cli import main
from codeforge.decontam import _humaneval_path
from codeforge.tokenizer import CodeTokenizer


def problems(n: int) -> list[dict]:
    with gzip.open(_humaneval_path(), "rt") as f:
        return [json.loads(line) for line in f][:n]


def decoded(out: Path, tok: CodeTokenizer) -> str:
    meta = json.loads((out / "meta.json").read_text())
    text = []
    for split in ("train", "val"):
        for sh in meta["splits"][split]["shards"]:
            ids = np.fromfile(out / sh["file"], dtype=meta["dtype"])
            text.append(tok.decode(ids.tolist()))
    return "\n".join(text)


def test_benchmark_files_are_dropped_by_default_and_counted(tmp_path, code_corpus, tokenizer_dir, capsys):
    tok = CodeTokenizer.load(tokenizer_dir)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for f in sorted(Path(code_corpus).rglob("*.py"))[:12]:
        (corpus / f.name).write_text(f.read_text())
    ps = problems(3)
    (corpus / "copied.py").write_text(ps[0]["prompt"] + ps[0]["canonical_solution"])
    # re-indented with tabs, other quotes and blank lines: still the same words in the same order
    moved = (ps[1]["prompt"] + ps[1]["canonical_solution"]).replace("    ", "\t").replace('"""', "'''")
    (corpus / "reformatted.py").write_text("\n\n".join(moved.splitlines()) + "\n")
    (corpus / "own_task.py").write_text("def my_task(xs):\n    '''Return the sum of the squares of the odd "
                                        "numbers in xs, skipping negative ones entirely.'''\n    return 0\n")
    (corpus / "heldout_copy.py").write_text("def f(a, b):\n    return a + b\n\n" * 5 + "x = 1\n")
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"task_id": "mine/1",
                                 "prompt": "Return the sum of the squares of the odd numbers "
                                 "in xs, skipping negative ones entirely.", "tests": "assert True"}) + "\n")
    heldout = tmp_path / "heldout"
    heldout.mkdir()
    (heldout / "f.py").write_text((corpus / "heldout_copy.py").read_text())

    out = tmp_path / "data"
    assert main(["prepare", "--input", str(corpus), "--tokenizer", str(tokenizer_dir), "--out", str(out),
                 "--val-fraction", "0.1", "--decontaminate", "humaneval", str(tasks), str(heldout)]) == 0
    printed = capsys.readouterr().out
    meta = json.loads((out / "meta.json").read_text())
    assert meta["skipped"]["benchmark"] == 4
    assert "4 sharing a 13-token run or a solution's shape with a benchmark" in printed
    assert meta["options"]["decontaminate"] == ["humaneval", str(tasks), str(heldout)]
    text = decoded(out, tok)
    for p in ps[:2]:
        assert p["canonical_solution"].strip().splitlines()[0].strip() not in text
    assert "skipping negative ones" not in text and "def f(a, b)" not in text
    assert meta["documents"] == 12  # the ordinary files all kept
    # the report says where the corpus went, step by step
    steps = meta["steps"]
    assert list(steps) == ["read", "quality filters", "deduplication", "benchmarks out", "secrets replaced"]
    b = steps["benchmarks out"]
    assert b["documents_in"] - b["documents_out"] == 4 and b["bytes_in"] > b["bytes_out"]
    assert steps["read"]["documents_out"] == steps["quality filters"]["documents_in"] == 16
    assert "benchmarks out" in printed and "documents in -> out" in printed

    # a held-out file added since: the same command does not call the old shards this dataset
    (heldout / "g.py").write_text("def g():\n    return 2\n")
    assert main(["prepare", "--input", str(corpus), "--tokenizer", str(tokenizer_dir), "--out", str(out),
                 "--val-fraction", "0.1", "--decontaminate", "humaneval", str(tasks), str(heldout)]) == 2
    assert "already holds a different dataset" in capsys.readouterr().err

    # the default is HumanEval alone; --no-decontaminate keeps everything, loudly
    out2 = tmp_path / "data2"
    assert main(["prepare", "--input", str(corpus), "--tokenizer", str(tokenizer_dir), "--out", str(out2),
                 "--val-fraction", "0.1"]) == 0
    assert json.loads((out2 / "meta.json").read_text())["skipped"]["benchmark"] == 2
    out3 = tmp_path / "data3"
    assert main(["prepare", "--input", str(corpus), "--tokenizer", str(tokenizer_dir), "--out", str(out3),
                 "--val-fraction", "0.1", "--no-decontaminate"]) == 0
    said = capsys.readouterr()
    assert "warning: --no-decontaminate" in said.err
    meta3 = json.loads((out3 / "meta.json").read_text())
    assert "benchmark" not in meta3["skipped"] and "decontaminate" not in meta3["options"]
    assert ps[0]["canonical_solution"].strip().splitlines()[0].strip() in decoded(out3, tok)


def test_bad_benchmark_sources_say_what_to_give(tmp_path, code_corpus, tokenizer_dir, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x"}\nnot json\n')
    for src, said in ((str(tmp_path / "missing.jsonl"), "No such file"), (str(bad), "line 2: not JSON")):
        assert main(["prepare", "--input", str(code_corpus), "--tokenizer", str(tokenizer_dir),
                     "--out", str(tmp_path / "d"), "--decontaminate", src]) == 2
        err = capsys.readouterr().err
        assert said in err and "--decontaminate" in err, err
        assert not (tmp_path / "d" / "meta.json").exists()


# --- solutions by their shape (decontam.shape): another's names, layout and docstring hide no copy ---------

STDLIB = Path(sysconfig.get_paths()["stdlib"])
# HumanEval/0 renamed, untyped, tab-indented, its own docstring, an `if` joined onto one line: no run of 13
# words is left of it
RENAMED = '''
def any_two_near(vals, eps):
\t"""True when two of the values are closer than eps."""
\tfor p, first in enumerate(vals):
\t\tfor q, second in enumerate(vals):
\t\t\tif p != q:
\t\t\t\tgap = abs(first - second)
\t\t\t\tif gap < eps: return True
\treturn False
'''
# HumanEval/86 as black would explode it, other quotes: 12 words, so the word rule never saw it
REFORMATTED = '''
def anti_shuffle(s):
    return " ".join(
        [
            "".join(sorted(list(i)))
            for i in s.split(" ")
        ]
    )
'''
# HumanEval/116 as written, without its docstring: 12 words again
VERBATIM = '''
def sort_array(arr):
    return sorted(sorted(arr), key=lambda x: bin(x)[2:].count('1'))
'''


def test_a_solution_renamed_or_reformatted_is_dropped():
    from codeforge.decontam import Benchmarks
    bench = Benchmarks(["humaneval"])
    host = (STDLIB / "textwrap.py").read_text()
    assert bench.hit(host) is None
    docs = [d for c in (RENAMED, REFORMATTED, VERBATIM) for d in (host + "\n" + c, c + "\n\n" + host)]
    for doc in docs:
        assert bench.hit(doc) == "humaneval", doc[-400:]
    words_only = Benchmarks(["humaneval"], shapes=False)
    assert not any(words_only.hit(doc) for doc in docs)  # what decontam let through before shapes


def test_a_users_solution_renamed_is_dropped_and_named(tmp_path):
    from codeforge.decontam import Benchmarks
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({
        "task_id": "mine/1",
        "prompt": "def rotate(items: list, k: int) -> list:\n    '''Rotate left by k.'''\n",
        "canonical_solution": "    if not items:\n        return []\n    k %= len(items)\n"
                              "    return items[k:] + items[:k]\n",
        "tests": "assert rotate([1, 2, 3], 1) == [2, 3, 1]"}) + "\n")
    copy = "def shift(xs, n):\n    if not xs: return []\n    n %= len(xs)\n    return xs[n:] + xs[:n]\n"
    assert Benchmarks([str(tasks)]).hit("import os\n\n" + copy) == str(tasks)


def test_ordinary_code_is_not_taken_for_a_solution():
    """Idioms that HumanEval's solutions share with everyone (a loop over pairs, Euclid's gcd, a two-line
    adder, a table of number words) and standard-library files that hold runs of solutions are kept: a
    document must hold two thirds of one solution's runs, of a solution of 22 tokens or more."""
    from codeforge.decontam import Benchmarks
    bench = Benchmarks(["humaneval"])
    ordinary = [
        "def close_pairs(points, limit):\n    out = []\n    for i in range(len(points)):\n"
        "        for j in range(i + 1, len(points)):\n            if dist(points[i], points[j]) < limit:\n"
        "                out.append((i, j))\n    return out\n",
        "def gcd(a, b):\n    while b:\n        a, b = b, a % b\n    return a\n",
        "def add(x, y):\n    return x + y\n",
        "def word_value(w):\n    table = {'zero': 0, 'one': 1, 'two': 2, 'three': 3, 'four': 4, 'five': 5, "
        "'six': 6, 'seven': 7, 'eight': 8, 'nine': 9}\n    return table[w]\n",
        "package main\n\nfunc gcd(a, b int) int {\n\tfor b != 0 {\n\t\ta, b = b, a%b\n\t}\n\treturn a\n}\n",
    ]
    for text in ordinary:
        assert bench.hit(text) is None, text
    # flagged when any one run was enough (runs of 20 and 24 tokens): each shares one with a solution
    for name in ("lib2to3/pgen2/pgen.py", "test/test_buffer.py", "fnmatch.py", "textwrap.py"):
        if (STDLIB / name).exists():
            assert bench.hit((STDLIB / name).read_text()) is None, name


def test_shape_keeps_the_code_and_drops_the_rest():
    from codeforge.decontam import shape
    same = [
        "def f(xs, n):\n    '''Keep the big ones.'''\n    return [x for x in xs if x > n]  # big\n",
        "def keep_above(values,limit):\n\treturn ([v for v in values if (v > limit)])\n",
        'def keep(a, b):\n    r"""Another docstring."""\n    return [\n        c\n        for c in a\n'
        '        if c > b\n    ]\n',
    ]
    assert len({shape(s) for s in same}) == 1
    assert shape("s = 'a#b'  # c\nt = 1.5") == shape('s = "x"\nt = 2') == shape("s = f'{x}'; t = .5")
    # a number then a name on the next line stay two tokens
    assert shape("return (x == 1)\npower = 1") == shape("return x == 1\npower = 1")
    # builtins and their methods are what keeps a shape apart from any other
    assert shape("return sorted(x)") != shape("return reversed(x)")
    assert shape("return s.split()") != shape("return s.strip()") != shape("return s.foo()")
    # unclosed quotes cost a scan to the end of their line (of the text for a triple quote), and end
    assert shape('x = "abc\n' * 2000 + "'''" + "y = 1\n" * 2000)
    assert shape("package main\n\nfunc main() { fmt.Println(`a`, 'b') } // done\n")


def test_escaped_quotes_start_no_string_so_a_hostile_line_is_one_pass():
    """A line of escaped quotes with no closing quote (`"\\"\\"\\...`), or such lines joined by backslash
    continuations, in a document with a `def `: each quote but the first used to start a string scan to the
    end of the (logical) line, so shaping was quadratic (80 KB took 20 s, a 1 MB file most of an hour). A
    backslash and the character after it are read as one match, left to right, so an escaped quote never
    starts a string: the only matches after the first quote's failed scan are the pairs themselves."""
    from codeforge.decontam import _LITERAL, NUMBER, benchmarks, shape
    n = 10_000  # 20 KB a document: over a second each before, milliseconds now
    head = "def f(): pass\n"
    continued = ('\\"' * 50 + "\\\n") * (n // 50)  # 50 escaped quotes and a backslash-newline a line
    for junk, pairs in (('"\\' * n, n - 1), ("'\\" * n, n - 1), (continued, n + n // 50)):
        text = head + junk
        found = [m.group() for m in _LITERAL.finditer(text)]
        assert len(found) == pairs and all(len(g) == 2 and g[0] == "\\" for g in found)
        assert shape(text).startswith(shape(head)) and benchmarks(["humaneval"]).hit(text) is None
    # a backslash pair stays as it was: a line continuation is in the shape, as before
    assert shape("x = 1 + \\\n    2\n") == "v=" + NUMBER + "+\\" + NUMBER
    assert shape("s = 'it\\'s'  # a # b\ny = \"q\\\"\" \\\n") == shape("s = ''\ny = '' \\\n")


def test_the_rules_are_in_the_datas_fingerprint(monkeypatch):
    """Data prepared under other rules is prepared again (sources_state is in shards.py's fingerprint)."""
    import codeforge.decontam as decontam
    before = decontam.sources_state(["humaneval"])
    monkeypatch.setattr(decontam, "RULES", decontam.RULES + ".next")
    assert decontam.sources_state(["humaneval"]) != before


def test_prepare_drops_a_renamed_solution(tmp_path, code_corpus, tokenizer_dir, capsys):
    tok = CodeTokenizer.load(tokenizer_dir)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for f in sorted(Path(code_corpus).rglob("*.py"))[:8]:
        (corpus / f.name).write_text(f.read_text())
    (corpus / "near.py").write_text("import math\n" + RENAMED)
    out = tmp_path / "data"
    assert main(["prepare", "--input", str(corpus), "--tokenizer", str(tokenizer_dir), "--out", str(out),
                 "--val-fraction", "0.1"]) == 0
    meta = json.loads((out / "meta.json").read_text())
    assert meta["skipped"]["benchmark"] == 1 and meta["documents"] == 8
    assert "any_two_near" not in decoded(out, tok)


# -- the word rule's first look: runs of WINDOW words found by Hyperscan, the answers of the words alone --

def _word_hit_by_words(b, text):
    """The word rule without the first look: every n-gram of the text's words against the index."""
    from codeforge.decontam import NGRAM, TOKEN
    toks = TOKEN.findall(text)
    return next((b.grams[h] for h in (hash(tuple(toks[i:i + NGRAM])) for i in range(len(toks) - NGRAM + 1))
                 if h in b.grams), None)


def test_the_first_look_answers_as_the_words_do():
    """HumanEval's prompts and solutions planted in ordinary code, their words apart by other separators
    (no-break spaces, dashes beyond ASCII, tabs, newlines) and glued to words beyond ASCII: every answer the
    same as the n-grams of the words give, hits and misses."""
    import random

    from codeforge import decontam
    b = decontam.Benchmarks(["humaneval"])
    assert b.windows is not None and b.windows.fast  # hyperscan is a dependency: the fast look is taken
    rng = random.Random(3)
    records = [t for t, _ in decontam._texts("humaneval")]
    lib = Path(sysconfig.get_paths()["stdlib"])
    ordinary = [p.read_text(encoding="utf-8", errors="replace") for p in sorted(lib.glob("*.py"))[:120]]
    texts = list(ordinary)
    for host in ordinary[:60]:
        rec = rng.choice(records)
        start = rng.randint(0, max(0, len(rec) // 2))
        piece = rec[start:start + rng.randint(40, 600)]
        for sep in (" ", "\u00a0", " \u2014 ", "\t", "\n"):
            if rng.random() < 0.5:
                piece = piece.replace(" ", sep, rng.randint(1, 20))
        texts.append(host[:1500] + "é" + piece + "ß\n" + host[1500:3000])
    answers = [b.word_hit(t) for t in texts]
    assert answers == [_word_hit_by_words(b, t) for t in texts]
    assert 10 < sum(a is not None for a in answers) < len(texts)  # both answers were exercised


def test_an_index_whose_runs_are_not_ascii_goes_by_the_words(tmp_path):
    """An n-gram with a word beyond ASCII in each of its runs: no first look (it could not find the run),
    and the words answer."""
    from codeforge import decontam
    words = ["résumé%d" % i for i in range(14)]
    src = tmp_path / "b.jsonl"
    src.write_text(json.dumps({"prompt": " ".join(words)}) + "\n")
    b = decontam.Benchmarks([str(src)])
    assert b.windows is None
    assert b.word_hit("x = 1\n" + " ".join(words) + "\n") == str(src)
    assert b.word_hit("x = 1\n") is None


def test_without_hyperscan_the_words_answer(monkeypatch):
    from codeforge import decontam, prescan
    monkeypatch.setattr(prescan, "hyperscan", None)
    b = decontam.Benchmarks(["humaneval"])
    assert b.windows is not None and not b.windows.fast
    rec = next(t for t, _ in decontam._texts("humaneval"))
    assert b.word_hit("# copied\n" + rec) == "humaneval"
    assert b.word_hit("package main\nfunc main() {}\n") is None


def test_a_large_or_minified_held_out_directory_goes_by_the_words(tmp_path):
    """More n-grams than MAX_WINDOWS, or one whose every run holds a token too long to look for: no first look
    (it would cost more to build than it saves), and the words answer."""
    from codeforge import decontam
    many = tmp_path / "many"
    many.mkdir()
    (many / "a.py").write_text("\n".join(f"v{i} = f{i}(a{i}, b{i})" for i in range(decontam.MAX_WINDOWS)))
    b = decontam.Benchmarks([str(many)])
    assert b.windows is None
    assert b.word_hit("x\nv5 = f5(a5, b5)\nv6 = f6(a6, b6)\nv7 = f7(a7, b7)\nv8 = f8(a8, b8)\n") == str(many)
    minified = tmp_path / "minified"
    minified.mkdir()
    long = "w" * 300
    (minified / "m.js").write_text(" ".join(f"{long}{i}" for i in range(20)))
    b = decontam.Benchmarks([str(minified)])
    assert b.windows is None
    assert b.word_hit(" ".join(f"{long}{i}" for i in range(3, 17))) == str(minified)
