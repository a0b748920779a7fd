"""The data commands as a user runs them: output, exit codes, and clear errors on bad input."""

import json

from codeforge.cli import main


def test_tokenizer_train_eval_prepare_info(tmp_path, code_corpus, capsys):
    tok = tmp_path / "tok"
    assert main(["tokenizer", "train", "--input", str(code_corpus), "--vocab-size", "600", "--out",
                 str(tok)]) == 0
    said = capsys.readouterr().out
    meta = json.loads((tok / "codeforge_tokenizer.json").read_text())
    # this small corpus runs out of pairs seen twice a little before 600 under the default (llama3) split
    assert f"trained tokenizer: vocab {meta['vocab_size']} " in said and 500 < meta["vocab_size"] <= 600, said
    assert main(["tokenizer", "eval", "--tokenizer", str(tok), "--input", str(code_corpus), "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["roundtrip_ok"] and r["bytes_per_token"] > 1.5
    data = tmp_path / "data"
    assert main(["prepare", "--input", str(code_corpus), "--tokenizer", str(tok), "--out", str(data),
                 "--languages", "go", "--exclude-tests", "--val-fraction", "0.2", "--workers", "2"]) == 0
    out = capsys.readouterr().out
    assert "skipped" in out and "1 test files (--exclude-tests)" in out and "1 in third-party" in out
    assert main(["data", "info", str(data)]) == 0
    out = capsys.readouterr().out
    assert "sample of the first document" in out and "package" in out


def test_bad_inputs_exit_2_with_message(tmp_path, code_corpus, tokenizer_dir, capsys):
    assert main(["tokenizer", "train", "--input", str(tmp_path / "missing"), "--out",
                 str(tmp_path / "t")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["tokenizer", "train", "--input", str(code_corpus), "--vocab-size", "100",
                 "--out", str(tmp_path / "t")]) == 2
    assert "out of range [256, 200000]" in capsys.readouterr().err
    assert main(["prepare", "--input", str(code_corpus), "--tokenizer", str(tmp_path / "none"),
                 "--out", str(tmp_path / "d")]) == 2
    assert "no tokenizer" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok = 1"}\nnot json\n')
    assert main(["prepare", "--input", str(bad), "--tokenizer", str(tokenizer_dir), "--out",
                 str(tmp_path / "d"), "--strict"]) == 2
    assert "bad.jsonl:2" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()
    assert main(["data", "info", str(tmp_path)]) == 2
    assert "not a prepared data directory" in capsys.readouterr().err
