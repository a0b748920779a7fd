"""Large single-file inputs in pieces (codeforge/data/pieces.py) at their edges: a name whose case the readers
do not take as JSONL or parquet, chunks against the disk the later stages need, a damaged parquet page
header, a chunk removed meanwhile, a work directory reached by another path, a tampered plan, an input gone
after the plan. Each reads as the whole file would, or is refused with a message."""

import gzip
import json
import shutil
from collections import namedtuple
from pathlib import Path

import pytest

from codeforge.corpus import CorpusError, CorpusOptions, CorpusStats, read_unit
from codeforge.data import pieces, pipeline, workdir


@pytest.fixture
def small_pieces(monkeypatch):
    monkeypatch.setattr(pieces, "PIECE_MIN", 256)
    monkeypatch.setattr(pieces, "BLOCK", 1000)


def _jsonl(n: int) -> str:
    return "".join(json.dumps({"text": f"def f{i}():\n    return {i}\n"}) + "\n" for i in range(n))


def _read(path: str, parts, opts=None):
    stats = CorpusStats()
    docs = [(d.source, d.text) for p in (parts or [None])
            for d in read_unit(path, None, opts or CorpusOptions(), stats, p)]
    return docs, dict(stats.skipped)


@pytest.mark.parametrize("name", ["BIG.JSONL", "big.Json", "big.PARQUET"])
def test_upper_case_extension_is_read_as_the_whole_file_would_be(tmp_path, small_pieces, name):
    """A name the readers take case and all: BIG.JSONL is one code file (or skipped), whole or not."""
    f = tmp_path / name
    if name.lower().endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq
        pq.write_table(pa.table({"text": [f"x = {i}\n" * 20 for i in range(400)]}), f, row_group_size=20,
                       compression="none")
    else:
        f.write_text(_jsonl(200))
    parts = pieces.split(str(f), f.stat().st_size, 1 << 30, tmp_path)
    assert parts is None or _read(str(f), parts) == _read(str(f), None)


def test_a_small_compressed_input_leaves_no_chunks_behind(tmp_path, small_pieces):
    """A compressed input that makes one piece is read whole, and no chunk of it stays in plan/chunks."""
    f = tmp_path / "small.jsonl.gz"
    with gzip.open(f, "wt") as g:
        g.write(_jsonl(2))
    plan = tmp_path / "plan"
    plan.mkdir()
    assert pieces.split(str(f), f.stat().st_size, 1 << 30, plan) is None
    left = [str(p) for p in (plan / "chunks").rglob("*") if p.is_file()]
    assert left == []


def test_chunks_leave_room_for_the_stages_after_them(tmp_path, small_pieces, monkeypatch):
    """Chunks never take the room the later stages need: the raw documents (the same text again), the
    tokens and the output; with free = chunks + KEEP_FREE + a little, the input is read whole."""
    f = tmp_path / "big.jsonl.gz"
    text = _jsonl(3000)
    with gzip.open(f, "wt") as g:
        g.write(text)
    decompressed = len(text.encode())
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(pieces.shutil, "disk_usage",
                        lambda p: Usage(1 << 40, 0, pieces.KEEP_FREE + decompressed + 10))
    plan = tmp_path / "plan"
    plan.mkdir()
    parts = pieces.split(str(f), f.stat().st_size, 1 << 30, plan)
    free_after = pieces.KEEP_FREE + decompressed + 10 - decompressed
    # the docs/ stage alone needs about `decompressed` bytes more than the KEEP_FREE margin
    assert parts is None or free_after - pieces.KEEP_FREE >= decompressed


def test_a_damaged_parquet_row_group_ends_the_reading_as_whole(tmp_path, small_pieces):
    """A row group whose page header does not parse: whole, the reader stops there, so the file is not cut."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    f = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": [f"value_{i} = {i}\n" * 30 for i in range(120)]}), f, row_group_size=20,
                   compression="none")
    meta = pq.ParquetFile(f).metadata
    off = meta.row_group(2).column(0).data_page_offset
    data = bytearray(f.read_bytes())
    data[off:off + 16] = b"\xff" * 16  # row group 2's page header
    f.write_bytes(bytes(data))
    assert pieces.split(str(f), f.stat().st_size, 1 << 30, tmp_path) is None
    pq.write_table(pa.table({"text": [f"value_{i} = {i}\n" * 30 for i in range(120)]}), f, row_group_size=20,
                   compression="none")
    assert len(pieces.split(str(f), f.stat().st_size, 1 << 30, tmp_path)) > 3


def test_a_chunk_gone_is_an_error_not_a_silent_vanished_skip(tmp_path, small_pieces):
    """A piece whose chunk file is gone (removed by hand, a tmp cleaner) stops the task with a message, rather
    than counting the input, still there, as vanished and going on without its records."""
    f = tmp_path / "big.jsonl.gz"
    with gzip.open(f, "wt") as g:
        g.write(_jsonl(300))
    plan = tmp_path / "plan"
    plan.mkdir()
    parts = pieces.split(str(f), f.stat().st_size, 1 << 30, plan)
    assert parts
    parts = [{**p, "file": str(plan / "chunks" / p["file"])} for p in parts]  # as plan_units hands them on
    assert _read(str(f), parts) == _read(str(f), None)
    shutil.rmtree(plan / "chunks")
    with pytest.raises(CorpusError, match="gone"):
        _read(str(f), parts)


def test_chunk_paths_in_the_plan_do_not_pin_one_resolution_of_the_work_path(tmp_path, small_pieces):
    """Chunk names are relative to the work directory's plan/chunks/, so a node where the work path resolves
    elsewhere (/home -> /gpfs/home on one, a direct mount on another) reads the plan. Simulated: the work
    directory reached through a link whose target moves after planning."""
    real = tmp_path / "storeA"
    real.mkdir()
    link = tmp_path / "home"
    link.symlink_to(real)
    work = link / "w"
    work.mkdir()
    f = tmp_path / "big.jsonl.gz"
    with gzip.open(f, "wt") as g:
        g.write(_jsonl(300))
    t = pipeline.make_plan([str(f)], CorpusOptions(), work, tasks=2)
    assert t == 2
    # the compute node sees the same tree at another real path
    shutil.move(str(real), str(tmp_path / "storeB"))
    link.unlink()
    link.symlink_to(tmp_path / "storeB")
    for r in range(t):
        for _, _, piece in workdir.plan_units(work, r, [str(f)]):
            assert Path(piece["file"]).is_file()


def test_a_tampered_piece_is_refused_as_keepwork(tmp_path, small_pieces):
    """A piece of the wrong shape (e.g. "line": "x") is refused as a plan prepare did not write (KeepWork),
    never handed to a reader."""
    f = tmp_path / "big.jsonl"
    f.write_text(_jsonl(300))
    work = tmp_path / "w"
    work.mkdir()
    pipeline.make_plan([str(f)], CorpusOptions(), work, tasks=2)
    name = work / "plan" / "00000.jsonl"
    path, tree, size, piece = json.loads(name.read_text().splitlines()[0])
    for bad in ({**piece, "line": "x"}, {**piece, "bytes": [10, 5]}, {**piece, "bytes": [0, True]},
                {"groups": [0, 1], "row": 0, "size": 1}, {**piece, "file": "../../../etc/passwd"},
                {**piece, "file": "00000/00001.jsonl", "extra": 1}, {**piece, "line": 0}):
        name.write_text(json.dumps([path, tree, size, bad]) + "\n")
        with pytest.raises(workdir.KeepWork):
            for p, tr, pc in workdir.plan_units(work, 0, [str(f)]):
                list(read_unit(p, tr, CorpusOptions(), CorpusStats(), pc))


def test_an_input_gone_after_the_plan_is_counted_once(tmp_path, small_pieces):
    """An input removed (or made unreadable) after planning is counted once, as when it is read whole."""
    f = tmp_path / "big.jsonl"
    f.write_text(_jsonl(300))
    parts = pieces.split(str(f), f.stat().st_size, 1 << 30, tmp_path)
    assert parts and len(parts) > 1
    f.unlink()
    assert _read(str(f), parts)[1] == _read(str(f), None)[1]


def test_a_full_disk_while_decompressing_leaves_no_chunks(tmp_path, small_pieces, monkeypatch):
    """An error writing a chunk (the disk full): the file is read whole, with nothing half-written left."""
    f = tmp_path / "big.jsonl.gz"
    with gzip.open(f, "wt") as g:
        g.write(_jsonl(3000))
    plan = tmp_path / "plan"
    plan.mkdir()
    def full(stream, piece, out):
        (out / "00000.jsonl").write_bytes(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pieces, "_cut", full)
    assert pieces.split(str(f), f.stat().st_size, 1 << 30, plan) is None  # read whole: the reader says why
    assert not any((plan / "chunks").rglob("*.jsonl"))
