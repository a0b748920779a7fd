import json
import os

import numpy as np
import pytest

from codeforge.corpus import CorpusOptions
from codeforge.data.shards import ShardError, ShardSet, prepare
from codeforge.tokenizer import CodeTokenizer, train_tokenizer



def _quiet(*a):
    pass


def test_shards_decode_back_to_documents(data_dir, tokenizer_dir):
    meta = json.loads((data_dir / "meta.json").read_text())
    tok = CodeTokenizer.load(tokenizer_dir)
    assert meta["tokenizer_hash"] == tok.hash and meta["dtype"] == "uint16"
    assert meta["splits"]["val"]["documents"] > 0 and meta["splits"]["train"]["documents"] > 0
    assert meta["documents"] == sum(s["documents"] for s in meta["splits"].values())
    assert meta["skipped"]["binary"] == 1 and meta["skipped"]["duplicate"] >= 1
    ss = ShardSet(data_dir, "train")
    starts = ss.doc_starts()
    stream = np.concatenate(ss.arrays)
    assert len(starts) == ss.documents and starts[0] == 0 and len(stream) == ss.tokens
    ends = list(starts[1:]) + [len(stream)]
    assert all(stream[e - 1] == tok.eot_id for e in ends)  # every document ends with end-of-text
    first = tok.decode(stream[starts[0]:ends[0] - 1].tolist())
    for i in (0, 1, len(starts) - 1):
        assert np.array_equal(ss.document(i), stream[starts[i]:ends[i] - 1])
    assert first.startswith("package ") or first.startswith("def ") or first.startswith('"""')
    assert (data_dir / "tokenizer" / "tokenizer.json").exists()


def test_deterministic_bytes_and_small_shards(tmp_path, code_corpus, tokenizer_dir):
    opts = CorpusOptions(languages=["go", "python"], val_fraction=0.2, max_file_bytes=20_000)
    a = prepare([str(code_corpus)], tokenizer_dir, tmp_path / "a", opts, shard_tokens=500, log=_quiet)
    prepare([str(code_corpus)], tokenizer_dir, tmp_path / "b", opts, shard_tokens=500, log=_quiet)
    assert len(a["splits"]["train"]["shards"]) > 3
    files = sorted(os.listdir(tmp_path / "a"))
    assert files == sorted(os.listdir(tmp_path / "b"))
    for f in files:
        if f.endswith((".bin", ".npy")):
            assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f
    assert all(s["tokens"] <= 500 for s in a["splits"]["train"]["shards"])
    ss = ShardSet(tmp_path / "a")  # documents read across many shards equal the concatenated stream
    stream, starts = np.concatenate(ss.arrays), ss.doc_starts()
    for i in range(ss.documents):
        end = starts[i + 1] if i + 1 < ss.documents else len(stream)
        assert np.array_equal(ss.document(i), stream[starts[i]:end - 1])


def test_refuses_other_dataset_unless_overwrite(tmp_path, code_corpus, tokenizer_dir):
    out = tmp_path / "d"
    prepare([str(code_corpus)], tokenizer_dir, out, CorpusOptions(languages=["go"]), log=_quiet)
    before = (out / "meta.json").read_bytes()
    msgs = []
    prepare([str(code_corpus)], tokenizer_dir, out, CorpusOptions(languages=["go"]), log=msgs.append)
    assert "nothing to do" in msgs[0]
    with pytest.raises(ShardError, match="different dataset"):
        prepare([str(code_corpus)], tokenizer_dir, out, CorpusOptions(languages=["python"]), log=_quiet)
    assert (out / "meta.json").read_bytes() == before  # untouched
    meta = prepare([str(code_corpus)], tokenizer_dir, out, CorpusOptions(languages=["python"]),
                   overwrite=True, log=_quiet)
    assert json.loads((out / "meta.json").read_text())["fingerprint"] == meta["fingerprint"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dirs left behind


def test_empty_corpus_refused_and_nothing_written(tmp_path, code_corpus, tokenizer_dir):
    with pytest.raises(ShardError, match="empty after filtering"):
        prepare([str(code_corpus)], tokenizer_dir, tmp_path / "d", CorpusOptions(languages=["rust"]),
                log=_quiet)
    assert not (tmp_path / "d").exists() and list(tmp_path.iterdir()) == []


def test_interrupted_run_leaves_no_complete_looking_dir(tmp_path, code_corpus, tokenizer_dir, monkeypatch):
    """Interrupted while encoding: OUT does not appear; the work directory stays, and the same call resumes
    from it (the finished tasks are not redone) to the same dataset a clean run writes."""
    import codeforge.data.writer as writer
    real = writer.SplitWriter.add
    calls = {"n": 0}

    def boom(self, *a, **k):
        calls["n"] += 1
        if calls["n"] > 1:
            raise KeyboardInterrupt
        return real(self, *a, **k)

    monkeypatch.setattr(writer.SplitWriter, "add", boom)
    with pytest.raises(KeyboardInterrupt):
        prepare([str(code_corpus)], tokenizer_dir, tmp_path / "d", CorpusOptions(), batch_docs=4, log=_quiet,
                workers=1, tasks=4)
    assert not (tmp_path / "d").exists()
    work = [p for p in tmp_path.iterdir() if p.name.startswith(".d.prepare-")]
    assert len(work) == 1 and (work[0] / "logs" / "read" / "completions").is_dir()
    monkeypatch.setattr(writer.SplitWriter, "add", real)
    said = []
    meta = prepare([str(code_corpus)], tokenizer_dir, tmp_path / "d", CorpusOptions(), log=said.append,
                   workers=1, tasks=4)
    assert any("resuming" in m for m in said)
    assert not work[0].exists()  # removed once the dataset is published
    clean = prepare([str(code_corpus)], tokenizer_dir, tmp_path / "clean", CorpusOptions(), log=_quiet,
                    workers=1, tasks=4)
    assert meta["splits"] == clean["splits"]
    for f in sorted((tmp_path / "clean").glob("*_0*.bin")) + sorted((tmp_path / "clean").glob("*.npy")):
        assert (tmp_path / "d" / f.name).read_bytes() == f.read_bytes(), f.name


def test_tokenizer_mismatch_named(tmp_path, data_dir):
    other, _ = train_tokenizer(iter(["completely different text " * 50]), 300, tmp_path / "other")
    ss = ShardSet(data_dir)
    with pytest.raises(ShardError, match=f"{ss.tokenizer_hash}.*{other.hash}"):
        ss.check_tokenizer(other.hash)
    ss.check_tokenizer(ss.tokenizer_hash)


def test_uint32_for_large_vocab(tmp_path):
    texts = [f"tok{i} " * 3 for i in range(70000)]
    tok, meta = train_tokenizer(iter(texts), 66000, tmp_path / "big", min_frequency=1)
    if tok.vocab_size <= 65536:
        pytest.skip(f"corpus gave only {tok.vocab_size} tokens")
    (tmp_path / "c.txt").write_text("\n".join(texts[:100]))
    m = prepare([str(tmp_path / "c.txt")], tmp_path / "big", tmp_path / "d", log=_quiet)
    assert m["dtype"] == "uint32"


def test_missing_or_truncated_shards(tmp_path, data_dir):
    with pytest.raises(ShardError, match="codeforge prepare"):
        ShardSet(tmp_path)
    import shutil
    d = tmp_path / "copy"
    shutil.copytree(data_dir, d)
    f = d / "train_000000.bin"
    f.write_bytes(f.read_bytes()[:-2])
    with pytest.raises(ShardError, match="truncated"):
        ShardSet(d)


def test_changed_source_is_a_different_dataset(tmp_path, code_corpus, tokenizer_dir):
    import shutil
    src = tmp_path / "src"
    shutil.copytree(code_corpus / "pkg0", src)
    out = tmp_path / "d"
    before = prepare([str(src)], tokenizer_dir, out, CorpusOptions(languages=["go"]), log=_quiet)
    (src / "new.go").write_text("package pkg0\n\nfunc New() int { return 42 }\n")
    with pytest.raises(ShardError, match="different dataset"):
        prepare([str(src)], tokenizer_dir, out, CorpusOptions(languages=["go"]), log=_quiet)
    meta = prepare([str(src)], tokenizer_dir, out, CorpusOptions(languages=["go"]), overwrite=True,
                   log=_quiet)
    assert meta["documents"] == before["documents"] + 1


def test_document_larger_than_shard_gets_its_own(tmp_path, code_corpus, tokenizer_dir):
    meta = prepare([str(code_corpus / "pkg1")], tokenizer_dir, tmp_path / "d", CorpusOptions(languages=["go"],
                   val_fraction=0.0), shard_tokens=10, log=_quiet)
    ss = ShardSet(tmp_path / "d")
    assert len(meta["splits"]["train"]["shards"]) == ss.documents > 1
    for i, arr in enumerate(ss.arrays):
        assert np.array_equal(ss.document(i), arr[:-1])  # whole shard = one document + end-of-text


def test_an_empty_validation_split_is_said_with_the_fix(tmp_path, tokenizer_dir):
    """A 17-file library at the default --val-fraction 0.01 puts no document in validation: prepare says so
    and names a fraction that gives it some; with that fraction the split is not empty."""
    src = tmp_path / "lib"
    src.mkdir()
    for i in range(17):
        (src / f"m{i}.py").write_text(f"def f{i}(x):\n    return x + {i}\n" * 3)
    said = []
    meta = prepare([str(src)], tokenizer_dir, tmp_path / "a", CorpusOptions(val_fraction=0.01),
                   log=said.append)
    assert meta["splits"]["val"]["documents"] == 0
    note = next(m for m in said if "validation split is empty" in m)
    fraction = float(note.split("--val-fraction ")[2].split()[0])
    meta = prepare([str(src)], tokenizer_dir, tmp_path / "b", CorpusOptions(val_fraction=fraction),
                   log=said.append)
    assert meta["splits"]["val"]["documents"] > 0


def test_a_small_validation_split_is_said_with_the_fix(tmp_path, tokenizer_dir):
    """One validation file of a few hundred tokens scores nothing worth reading (a newcomer's library got one
    of 256 tokens): prepare says the split is small and names a fraction that gives it several files."""
    from codeforge.corpus import content_hash
    src = tmp_path / "lib"
    src.mkdir()
    texts = []
    for i in range(40):
        text = "".join(f"def f{i}_{j}(x):\n    return x * {j} + {i}\n\n" for j in range(40))
        (src / f"m{i}.py").write_text(text)
        texts.append(text)
    marks = sorted(int.from_bytes(content_hash(t)[:8], "big") / 2**64 for t in texts)
    one = (marks[0] + marks[1]) / 2  # exactly one file below it
    said = []
    meta = prepare([str(src)], tokenizer_dir, tmp_path / "a", CorpusOptions(val_fraction=one),
                   log=said.append)
    assert meta["splits"]["val"]["documents"] == 1
    note = next(m for m in said if "validation split is small" in m)
    fraction = float(note.split("--val-fraction ")[2].split()[0])
    meta = prepare([str(src)], tokenizer_dir, tmp_path / "b", CorpusOptions(val_fraction=fraction),
                   log=said.append)
    assert meta["splits"]["val"]["documents"] >= 3


def test_a_run_records_what_it_trained_on_and_what_it_cannot_know(tmp_path, data_dir):
    """RUN/trained_documents.npy: the training split's keys, with the starting run's; a starting run that
    recorded nothing leaves this run's own split recorded and the record incomplete, saying why (found in
    review: it was once this split alone, and eval said 0 of the validation files had been trained on when
    the base run had seen them; then nothing at all, and a fine-tune of an imported model was scored as
    held-out on the files it trained on, issue 56)."""
    from codeforge.data.shards import split_digests
    from codeforge.data.trained import record_trained, seen_in_training, trained_documents
    keys = split_digests(data_dir, "train")
    r = record_trained(tmp_path / "a", data_dir)
    assert r.complete and np.array_equal(r.keys, keys) and len(keys) > 0
    assert np.array_equal(trained_documents(tmp_path / "a"), keys)
    assert seen_in_training(tmp_path / "a", data_dir, "val")["trained_on"] == 0
    assert seen_in_training(tmp_path / "a", data_dir, "train")["trained_on"] == len(keys)
    (tmp_path / "b" / "checkpoints" / "step_000001").mkdir(parents=True)
    np.save(tmp_path / "b" / "trained_documents.npy", np.array([1, 2, 3], dtype=np.uint64))
    r = record_trained(tmp_path / "c", data_dir, tmp_path / "b" / "checkpoints" / "step_000001")
    assert r.complete and len(r.keys) == len(keys) + 3  # the base run's documents too
    (tmp_path / "old").mkdir()  # a base run from before the records: this run's split known, the base's not
    r = record_trained(tmp_path / "c", data_dir, tmp_path / "old")
    assert np.array_equal(r.keys, keys) and not r.complete and "left no record" in r.unknown
    assert trained_documents(tmp_path / "c") is None  # the old reader: only a complete record
    assert seen_in_training(tmp_path / "c", data_dir, "val") is None  # "0 of them trained on" is not claimed
