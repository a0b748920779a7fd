"""End to end: the quickstart's whole pipeline on a small real corpus, then its outputs used by the CLI."""

import json

from codeforge.cli import main
from codeforge.quickstart import corpus_path, run_quickstart

from conftest import STDLIB


def test_quickstart_pipeline_end_to_end(tmp_path, capsys):
    out = tmp_path / "qs"
    r = run_quickstart(str(out), corpus=str(STDLIB / "email"), max_iters=12)
    assert r["step"] == 12 and r["val_loss"] > 0 and r["bits_per_byte"] > 0
    assert 0 <= r["syntax_valid_rate"] <= 1 and r["pass_at_1"] == 0.0
    printed = capsys.readouterr().out
    assert "[5/5]" in printed and "bits per byte" in printed and "sample:" in printed
    for p in ("tokenizer/tokenizer.json", "data/meta.json", "run/metrics.jsonl", "run/eval.jsonl", "run/config.toml"):
        assert (out / p).exists(), p
    # Running it again reuses the tokenizer and shards and finds the run complete.
    r2 = run_quickstart(str(out), corpus=str(STDLIB / "email"), max_iters=12)
    assert "reusing" in capsys.readouterr().out and r2["step"] == 12
    # The run directory is one the other commands accept.
    assert main(["eval", "--run", str(out / "run"), "--eval-tokens", "64",
                 "--syntax-samples", "0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["syntax_valid_rate"] is None


def test_corpus_names():
    path, langs = corpus_path("python-stdlib")
    assert (STDLIB / "os.py").exists() and path == str(STDLIB) and langs == ["python"]
    import pytest
    with pytest.raises(FileNotFoundError, match="not python-stdlib, go, or an existing path"):
        corpus_path("/nonexistent/corpus")
