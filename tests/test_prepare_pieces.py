"""A large single-file input (plain or compressed JSONL, parquet) is cut into pieces at plan time
(codeforge/data/pieces.py) so that every worker reads part of it: the documents, their names, the skip
reasons and the token stream are those of reading it whole, for any task and worker count."""

import gzip
import json
import random
import re
from pathlib import Path

import numpy as np
import pytest
from conftest import make_go_file, make_py_file

from codeforge.corpus import CorpusOptions, CorpusStats, read_unit
from codeforge.data import pieces, pipeline
from codeforge.data.shards import ShardSet, prepare


def _quiet(*a):
    pass


def records(n: int, seed: int = 3) -> list[str]:
    """JSONL lines: code records (with duplicates, a secret, a bad line, a record without text, blank lines
    and \\r\\n endings) numbered so every line is told apart."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        body = (make_go_file(rng, i) if i % 2 else make_py_file(rng, i)) + f"// record {i} é\n"
        if i % 97 == 5:
            out.append('{"text": "not closed\n')
        elif i % 89 == 7:
            out.append(json.dumps({"content": body}) + "\n")
        elif i % 83 == 9:
            out.append("\r\n")
        elif i % 79 == 11:
            out.append(json.dumps({"text": "g = Github(\"ghp_" + "a1B2c3D4e5" * 4 + "\")\n" + body}) + "\r\n")
        else:
            out.append(json.dumps({"text": body}) + "\n")
        if i % 50 == 3:  # an exact duplicate of the record before
            out.append(out[-1])
    return out


@pytest.fixture
def small_pieces(monkeypatch):
    """Pieces of a few KB, so a test-sized file is cut in many."""
    monkeypatch.setattr(pieces, "PIECE_MIN", 4096)
    monkeypatch.setattr(pieces, "BLOCK", 1000)  # cuts and line ends across the pass's blocks


def in_chunks(parts: list[dict], plan: Path) -> list[dict]:
    """The pieces with their chunk files' paths, as workdir.plan_units hands them to the reader."""
    return [{**p, "file": str(plan / "chunks" / p["file"])} for p in parts]


def read_all(path: str, parts: list[dict] | None, opts: CorpusOptions):
    stats = CorpusStats()
    docs = []
    for p in parts or [None]:
        docs += [(d.source, d.text) for d in read_unit(path, None, opts, stats, p)]
    return docs, dict(stats.skipped)


def test_a_jsonl_read_in_pieces_is_the_file_read_whole(tmp_path, small_pieces):
    f = tmp_path / "big.jsonl"
    f.write_text("".join(records(400)), newline="")
    size = f.stat().st_size
    parts = pieces.split(str(f), size, 1 << 30, tmp_path)
    assert parts is not None and len(parts) >= 10
    assert parts[0]["bytes"][0] == 0 and parts[-1]["bytes"][1] == size
    assert all(a["bytes"][1] == b["bytes"][0] for a, b in zip(parts, parts[1:]))
    opts = CorpusOptions()
    whole, skipped = read_all(str(f), None, opts)
    split, skipped_split = read_all(str(f), parts, opts)
    assert split == whole and skipped_split == skipped  # names hold the line numbers: they agree too
    assert skipped["bad_json"] >= 4 and skipped["missing_field"] >= 4


def test_a_compressed_jsonl_is_decompressed_once_into_chunks(tmp_path, small_pieces):
    f = tmp_path / "big.jsonl.gz"
    with gzip.open(f, "wt", newline="") as g:
        g.write("".join(records(300)))
    plan = tmp_path / "plan"
    plan.mkdir()
    parts = pieces.split(str(f), f.stat().st_size, 1 << 30, plan)
    assert parts is not None and len(parts) >= 5
    # named within plan/chunks/ (so a node that mounts the work directory elsewhere finds them)
    assert all(re.fullmatch(r"00000/\d{5}\.jsonl", p["file"]) for p in parts)
    assert all((plan / "chunks" / p["file"]).is_file() for p in parts)
    opts = CorpusOptions()
    assert read_all(str(f), in_chunks(parts, plan), opts) == read_all(str(f), None, opts)


def test_what_cutting_could_change_is_read_whole(tmp_path, small_pieces):
    lines = records(200)
    bad = tmp_path / "latin1.jsonl"  # not UTF-8 part way: the reader stops there, so it stays one unit
    bad.write_bytes("".join(lines[:150]).encode() + b'{"text": "caf\xe9"}\n' + "".join(lines[150:]).encode())
    assert pieces.split(str(bad), bad.stat().st_size, 1 << 30, tmp_path) is None
    damaged = tmp_path / "cut.jsonl.gz"  # a truncated gzip: the reader keeps what comes before the damage
    damaged.write_bytes(gzip.compress("".join(lines).encode())[:-200])
    plan = tmp_path / "plan"
    plan.mkdir()
    assert pieces.split(str(damaged), damaged.stat().st_size, 1 << 30, plan) is None
    assert not any((plan / "chunks").rglob("*.jsonl"))  # the chunks written before the damage are gone
    small = tmp_path / "small.jsonl"
    small.write_text("".join(lines[:3]))
    assert pieces.split(str(small), small.stat().st_size, 1 << 30, tmp_path) is None
    assert pieces.split(str(tmp_path / "x.txt"), 1 << 30, 1 << 30, tmp_path) is None  # one document
    assert pieces.split("hf:org/name", 0, 1 << 30, tmp_path) is None


def test_chunks_never_fill_the_disk(tmp_path, small_pieces, monkeypatch):
    f = tmp_path / "bomb.jsonl.gz"
    with gzip.open(f, "wt") as g:
        g.write("".join(records(300)))
    monkeypatch.setattr(pieces, "KEEP_FREE", __import__("shutil").disk_usage(tmp_path).free - 50_000)
    plan = tmp_path / "plan"
    plan.mkdir()
    assert pieces.split(str(f), f.stat().st_size, 1 << 30, plan) is None
    assert not any((plan / "chunks").rglob("*.jsonl"))


def test_a_parquet_file_is_cut_by_row_groups(tmp_path, small_pieces):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    texts = [json.loads(x)["text"] if x.strip().startswith('{"text": "') and x.strip().endswith("}")
             else None for x in records(400)]
    f = tmp_path / "big.parquet"
    pq.write_table(pa.table({"text": texts}), f, row_group_size=20)
    parts = pieces.split(str(f), max(f.stat().st_size, 3 * pieces.PIECE_MIN), 1 << 30, tmp_path)
    assert parts is not None and len(parts) >= 3
    assert parts[0]["groups"][0] == 0 and parts[-1]["groups"][1] == pq.ParquetFile(f).metadata.num_row_groups
    opts = CorpusOptions()
    assert read_all(str(f), parts, opts) == read_all(str(f), None, opts)


def _stream(d: Path, split: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    s = ShardSet(d, split)
    tokens = np.concatenate([np.fromfile(d / sh["file"], dtype=np.uint16 if s.meta["dtype"] == "uint16"
                                         else np.uint32) for sh in s.meta["splits"][split]["shards"]])
    return tokens, np.load(d / f"{split}_docs.npy"), np.load(d / f"{split}_digests.npy")


@pytest.mark.parametrize("compressed", [False, True])
def test_prepare_of_one_big_jsonl_is_the_same_for_any_task_and_worker_count(tmp_path, tokenizer_dir,
                                                                           monkeypatch, compressed):
    monkeypatch.setattr(pieces, "PIECE_MIN", 16384)
    f = tmp_path / ("big.jsonl.gz" if compressed else "big.jsonl")
    data = "".join(records(600))
    if compressed:
        with gzip.open(f, "wt", newline="") as g:
            g.write(data)
    else:
        f.write_text(data, newline="")
    opts = CorpusOptions(dedup="near", redact_secrets=True, decontaminate=["humaneval"], val_fraction=0.1)
    whole_plan = pipeline.make_plan
    said: list[str] = []
    monkeypatch.setattr(pieces, "split", lambda *a: None)  # the file as one unit: what prepare did before
    one = prepare([str(f)], tokenizer_dir, tmp_path / "whole", opts, log=_quiet, workers=1)
    monkeypatch.undo()
    monkeypatch.setattr(pieces, "PIECE_MIN", 16384)
    assert pipeline.make_plan is whole_plan
    four = prepare([str(f)], tokenizer_dir, tmp_path / "four", opts, log=_quiet, workers=1, tasks=4)
    many = prepare([str(f)], tokenizer_dir, tmp_path / "many", opts, log=said.append, workers=2)
    assert one["engine"]["tasks"] == 1 and four["engine"]["tasks"] == 4 and many["engine"]["tasks"] > 4
    assert any("on 2 worker(s)" in m for m in said)
    for other in (four, many):
        for k in ("documents", "skipped", "secrets_replaced", "splits"):
            if k == "splits":
                assert {s: {x: v for x, v in d.items() if x != "shards"} for s, d in one[k].items()} == \
                    {s: {x: v for x, v in d.items() if x != "shards"} for s, d in other[k].items()}
            else:
                assert one.get(k) == other.get(k), k
    for split in ("train", "val"):
        a = _stream(tmp_path / "whole", split)
        for other in ("four", "many"):
            b = _stream(tmp_path / other, split)
            assert all(np.array_equal(x, y) for x, y in zip(a, b)), (split, other)
    assert one["skipped"]["bad_json"] >= 6 and one["secrets_replaced"]


def test_encoding_overlapped_with_the_hygiene_steps_keeps_the_shards(tmp_path, tokenizer_dir, code_corpus,
                                                                      monkeypatch):
    """EncodeShards encodes a batch on its own thread while the next is filtered and redacted: with a batch
    per document (hundreds in flight one after another) the shards are byte for byte those of a few large
    batches."""
    from codeforge.data import steps
    pools = []

    class Counted(steps.ThreadPoolExecutor):
        def __init__(self, *a, **kw):
            pools.append(1)
            super().__init__(*a, **kw)

    opts = CorpusOptions(redact_secrets=True, val_fraction=0.2)
    # --workers 1 as asked: a worker is a core, so nothing runs beside it
    prepare([str(code_corpus)], tokenizer_dir, tmp_path / "few", opts, log=_quiet, workers=1, tasks=2)
    monkeypatch.setattr(steps, "BATCH_BYTES", 1)
    monkeypatch.setattr(steps, "ThreadPoolExecutor", Counted)
    # the default for a small corpus: one process that may use every core, so the encoder has its thread
    prepare([str(code_corpus)], tokenizer_dir, tmp_path / "many", opts, log=_quiet, tasks=2)
    assert pools  # the overlapped path ran
    files = lambda d: {f.name: f.read_bytes() for f in sorted(d.iterdir()) if f.suffix in (".bin", ".npy")}  # noqa: E731
    assert files(tmp_path / "few") == files(tmp_path / "many") and files(tmp_path / "few")


def test_the_minified_check_tried_at_line_starts_finds_what_any_position_finds():
    from codeforge.corpus import reject_reason
    rng = random.Random(1)
    opts = CorpusOptions()
    for _ in range(300):
        lines = ["x" * rng.choice([5, 80, 999, 1000, 1001, 1500, 3000]) + rng.choice(["", "\r", " "])
                 for _ in range(rng.randint(1, 30))]
        text = "\n".join(lines)
        import re
        long_line = bool(re.search(f"[^\n]{{{opts.max_line_length + 1}}}", text))
        assert (reject_reason(text, opts) == "minified") == long_line
