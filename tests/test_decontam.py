"""Benchmarks kept out of the training data (decontam.py): a file that holds a HumanEval problem and its
solution, verbatim or re-indented, is dropped by `prepare` by default and counted; a JSONL of the user's own
tasks and a directory of held-out files work the same; ordinary code is kept."""

import gzip
import json
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
    assert meta["skipped"]["benchmark"] == 4 and "4 sharing a 13-token run with a benchmark" in printed
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
