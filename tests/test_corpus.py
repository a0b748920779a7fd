import gzip
import json

import pytest

from codeforge.corpus import (CorpusError, CorpusOptions, CorpusStats, Deduper, content_hash, iter_documents,
                              split_of)


def collect(paths, **kw):
    stats = CorpusStats()
    docs = list(iter_documents([str(p) for p in paths], CorpusOptions(**kw), stats))
    return docs, stats


def test_every_filter_counted(code_corpus):
    docs, stats = collect([code_corpus], languages=["go"], max_file_bytes=100_000, exclude_tests=True)
    s = stats.skipped
    assert s["binary"] == 1 and s["non_utf8"] == 1 and s["empty"] == 1 and s["too_large"] == 1
    assert s["minified"] == 1 and s["generated"] == 1 and s["vendored"] == 1 and s["test_file"] == 1
    assert s["duplicate"] == 1
    assert len(docs) == 60 and all(d.source.endswith(".go") for d in docs)
    assert stats.documents == 60 and stats.bytes == sum(len(d.text.encode()) for d in docs)


def test_tests_kept_unless_excluded_and_languages_select(code_corpus):
    docs, stats = collect([code_corpus], languages=["python"])
    assert len(docs) == 60 and all(d.source.endswith(".py") for d in docs)
    docs, stats = collect([code_corpus], languages=["go"])
    assert any(d.source.endswith("f1_test.go") for d in docs) and "test_file" not in stats.skipped


def test_jsonl_gz_zst_and_bad_lines(tmp_path):
    lines = [json.dumps({"text": "a = 1\n"}), "{not json", json.dumps({"body": "x"}),
             json.dumps({"text": "b = 2\n"})]
    plain = tmp_path / "d.jsonl"
    plain.write_text("\n".join(lines) + "\n")
    gz = tmp_path / "d2.jsonl.gz"
    with gzip.open(gz, "wt") as f:
        f.write(json.dumps({"text": "c = 3\n"}) + "\n")
    import zstandard
    zst = tmp_path / "d3.jsonl.zst"
    zst.write_bytes(zstandard.ZstdCompressor().compress((json.dumps({"text": "d = 4\n"}) + "\n").encode()))
    docs, stats = collect([plain, gz, zst])
    assert [d.text for d in docs] == ["a = 1\n", "b = 2\n", "c = 3\n", "d = 4\n"]
    assert stats.skipped["bad_json"] == 1 and stats.skipped["missing_field"] == 1
    assert stats.examples["bad_json"] == f"{plain}:2" and stats.examples["missing_field"] == f"{plain}:3"
    with pytest.raises(CorpusError, match=r"d\.jsonl:2: bad_json"):
        collect([plain], strict=True)
    docs, _ = collect([plain], text_field="body")
    assert [d.text for d in docs] == ["x"]


def test_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"content": ["x = 1\n", None, "y = 2\n"]}), tmp_path / "d.parquet")
    docs, stats = collect([tmp_path / "d.parquet"], text_field="content")
    assert [d.text for d in docs] == ["x = 1\n", "y = 2\n"] and stats.skipped["missing_field"] == 1
    with pytest.raises(CorpusError, match="no column 'text'"):
        collect([tmp_path / "d.parquet"])


def test_hf_dataset_from_local_disk(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"text": ["p = 1\n", "q = 2\n"]}).save_to_disk(str(tmp_path / "ds"))
    docs, _ = collect([f"hf:{tmp_path / 'ds'}"])
    assert [d.text for d in docs] == ["p = 1\n", "q = 2\n"]


def test_missing_path_and_bad_options(tmp_path):
    with pytest.raises(CorpusError, match="does not exist"):
        collect([tmp_path / "nope"])
    with pytest.raises(CorpusError, match="unknown language 'cobol'"):
        collect([tmp_path], languages=["cobol"])
    with pytest.raises(CorpusError, match="--dedup"):
        collect([tmp_path], dedup="fuzzy")


def test_near_dedup(tmp_path):
    base = "\n".join(f"word{i} w{i % 7}" for i in range(300))
    (tmp_path / "a.txt").write_text(base)
    (tmp_path / "b.txt").write_text(base.replace("word150", "changed"))  # one word differs: near duplicate
    (tmp_path / "c.txt").write_text("\n".join(f"other{i}" for i in range(300)))
    docs, stats = collect([tmp_path], dedup="near")
    assert len(docs) == 2 and stats.skipped["near_duplicate"] == 1
    docs, stats = collect([tmp_path], dedup="exact")
    assert len(docs) == 3 and not stats.skipped
    d = Deduper("none")
    assert d.reason("x", content_hash("x")) is None and d.reason("x", content_hash("x")) is None


def test_split_is_stable_and_by_document():
    texts = [f"doc {i}\n" for i in range(2000)]
    splits = [split_of(content_hash(t), 0.1) for t in texts]
    assert 120 < splits.count("val") < 280
    # Stable: the split of a document depends only on its content, not on what else is in the corpus.
    assert [split_of(content_hash(t), 0.1) for t in texts[::-1]] == splits[::-1]
    assert all(split_of(content_hash(t), 0.0) == "train" for t in texts)


def test_file_vanishing_mid_run_is_counted(code_corpus, tmp_path):
    import shutil
    root = tmp_path / "c"
    shutil.copytree(code_corpus / "pkg0", root)
    stats = CorpusStats()
    it = iter_documents([str(root)], CorpusOptions(languages=["go"]), stats)
    first = next(it)
    victim = sorted(root.glob("*.go"))[-1]
    victim.unlink()
    rest = list(it)
    assert stats.skipped["vanished"] == 1 and first.text and len(rest) >= 1
    with pytest.raises(CorpusError, match="vanished"):
        it = iter_documents([str(root)], CorpusOptions(languages=["go"], strict=True), CorpusStats())
        next(it)
        sorted(root.glob("*.go"))[-1].unlink()
        list(it)


def test_sized_validation_split_takes_enough_whole_files_and_not_most_of_the_code():
    """The quickstart's split for a small corpus: several files and ~20k tokens where there are many, the
    least share where the corpus is large, and never most of the code because one large file ranks early."""
    import random

    from codeforge.corpus import VAL_CAP_SHARE, sized_val_fraction, split_of
    rng = random.Random(0)
    small = [(rng.randbytes(32), 2000) for _ in range(50)]
    f = sized_val_fraction(small, 0.02)
    val = [n for d, n in small if split_of(d, f) == "val"]
    assert len(val) >= 3 and sum(val) >= 0.1 * 50 * 2000 * 0.99 and f > 0.02
    big = [(rng.randbytes(32), 20_000) for _ in range(2000)]
    assert sized_val_fraction(big, 0.02) == 0.02
    over = 0
    for t in range(100):
        rng = random.Random(t)
        docs = [(rng.randbytes(32), 3000) for _ in range(30)] + [(rng.randbytes(32), 300_000)]
        f = sized_val_fraction(docs, 0.02)
        share = sum(n for d, n in docs if split_of(d, f) == "val") / sum(n for _, n in docs)
        # past the cap only when the least share itself holds the large file (as plain prepare would)
        over += share > VAL_CAP_SHARE and split_of(docs[-1][0], 0.02) != "val"
    assert over == 0
    # a small library whose first file alone is over the quarter (but not most of
    # the code): that file, not none
    docs = [(bytes([8 + 20 * i]) + bytes(31), n) for i, n in enumerate([30_000] + [8_000] * 10)]
    f = sized_val_fraction(docs, 0.02)
    assert [n for d, n in docs if split_of(d, f) == "val"] == [30_000]
