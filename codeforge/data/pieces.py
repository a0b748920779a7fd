"""A large single-file input cut into pieces at plan time, so that one big JSONL or parquet file is many tasks
and every worker reads part of it (pipeline.make_plan). Each piece is read by corpus.read_unit exactly as that
part of the whole file would be read: the same documents, in the same order, named by the same path and line
(or row), so the shards are the same token for token whatever the task and worker counts.

  plain JSONL (.jsonl, .json)  byte ranges cut just after a newline, found by one pass over the file that also
                               counts lines (universal newlines, as the reader counts them) and checks that
                               it is UTF-8 throughout;
  compressed JSONL (.gz, .zst) a streaming pass that decompresses it once into chunk files of the work
                               directory (plan/chunks/), cut the same way; the chunks are read as plain
                               JSONL pieces and removed with the work directory;
  parquet                      runs of whole row groups (the file's own unit of reading).

A file is left whole (one unit, read as before) when cutting it could change what is read: not UTF-8
somewhere (the reader stops at the first bad byte), damaged compressed data (the reader keeps what comes
before the damage), a parquet page header that does not parse, or decompressed data that would take more
than a third of the work directory's free disk beyond KEEP_FREE (the raw documents and the tokens need the
rest). A parquet data page damaged past a sound header, found only while reading, ends that piece's reading;
the later pieces are still read (whole, the reader would stop there).
"""

from __future__ import annotations

import codecs
import io
import os
import shutil
from pathlib import Path

from ..corpus import UnusableInput, open_bytes, record_kind
from ..parquet_pages import BadPageHeader, parquet_page_sizes

PIECE_MIN = 4 << 20  # a piece's least bytes (smaller ones cost more in task overhead than they save)
SPLIT_PARTS = 16  # a file is cut into about this many pieces (pipeline.MIN_TASKS), each at most `top` bytes
KEEP_FREE = 1 << 30  # decompressed chunks take at most a third of what is free beyond this
BLOCK = 8 << 20  # bytes read at a time by the pass over a file
CHUNKS = "chunks"  # plan/chunks/: decompressed pieces of compressed inputs


def piece_bytes(size: int, top: int) -> int:
    """The size of a piece of a `size`-byte file: about size / SPLIT_PARTS, between PIECE_MIN and `top`."""
    return max(PIECE_MIN, min(top, size // SPLIT_PARTS))


def kind(path: str) -> str | None:
    """How a single-file input is cut: "jsonl", "compressed" or "parquet", as corpus.record_kind reads it;
    None for what is read whole."""
    how = record_kind(path)
    if how == "jsonl" and path.endswith((".gz", ".zst")):
        return "compressed"
    return how


def split(path: str, size: int, top: int, plan: Path, text_field: str = "text") -> list[dict] | None:
    """The pieces of input `path` (`size` bytes on disk), or None to read it whole (too small, one piece, or
    a file cutting could change; see the module docstring). plan: the work directory's plan/, where
    compressed inputs' chunks go; text_field: the parquet column read (its page headers are checked)."""
    how = kind(path)
    # a compressed file of a quarter piece or less holds about a piece at the usual 4x: read whole
    if how is None or size < (PIECE_MIN // 4 if how == "compressed" else 2 * PIECE_MIN):
        return None
    try:
        if how == "parquet":
            return _row_groups(path, piece_bytes(size, top), text_field)
        if how == "jsonl":
            with open_bytes(path) as f:
                pieces = _cut(f, piece_bytes(size, top), None)
        else:
            pieces = _chunked(path, size, top, plan)
    except (OSError, UnusableInput):
        return None
    return pieces if pieces is not None and len(pieces) > 1 else None


class _Lines:
    """Counts lines as the reader's text stream does (universal newlines: \\n, \\r\\n and a lone \\r each end
    one) over bytes given block by block, and checks they are UTF-8."""

    def __init__(self):
        self.lines, self.cr_last = 0, False
        self.utf8 = codecs.getincrementaldecoder("utf-8")("strict")

    def feed(self, data: bytes, final: bool = False) -> bool:
        """Counts `data`'s line ends; False where it is not UTF-8."""
        try:
            self.utf8.decode(data, final)
        except UnicodeDecodeError:
            return False
        n, r, rn = data.count(b"\n"), data.count(b"\r"), data.count(b"\r\n")
        if self.cr_last and data[:1] == b"\n":
            rn += 1  # a \r\n across two blocks: counted once, by its \n
        self.lines += n + r - rn
        if data:
            self.cr_last = data[-1:] == b"\r"
        return True


def _cut(f, piece: int, out: Path | None) -> list[dict] | None:
    """Pieces of the stream `f` cut just after a \\n once each holds `piece` bytes: {"bytes": [start, end],
    "line": its first line's number} of f itself, or with `out` (a directory) each piece written there as a
    chunk file ({"file": the chunk's path, "bytes": [0, length], "line": ...}). None where the stream is
    not UTF-8."""
    lines = _Lines()
    pieces: list[dict] = []
    start = pos = 0
    first = 1
    sink = None

    def close_piece(end: int) -> None:
        nonlocal start, first, sink
        if end <= start:
            return
        entry = {"bytes": [start, end] if out is None else [0, end - start], "line": first}
        if out is not None:
            sink.close()
            entry["file"] = sink.name
            sink = None
        pieces.append(entry)
        start, first = end, lines.lines + 1

    while True:
        block = f.read(BLOCK)
        if not block:
            break
        rest = block
        while rest:
            want = start + piece - pos  # bytes still to go before this piece may end
            if want > len(rest):
                head, rest = rest, b""
                cut = False
            else:
                nl = rest.find(b"\n", max(want, 1) - 1)
                cut = nl >= 0
                head, rest = (rest[:nl + 1], rest[nl + 1:]) if cut else (rest, b"")
            if not lines.feed(head):
                _drop(pieces, sink)
                return None
            if out is not None:
                if sink is None:
                    sink = open(out / f"{len(pieces):05d}.jsonl", "xb")
                sink.write(head)
            pos += len(head)
            if cut:
                close_piece(pos)
    if not lines.feed(b"", final=True):
        _drop(pieces, sink)
        return None
    close_piece(pos)
    return pieces


def _drop(pieces: list[dict], sink) -> None:
    """Remove the chunk files written so far (a file that is read whole after all)."""
    if sink is not None:
        sink.close()
        os.unlink(sink.name)
    for p in pieces:
        if "file" in p:
            os.unlink(p["file"])


def _chunked(path: str, size: int, top: int, plan: Path) -> list[dict] | None:
    """A compressed JSONL decompressed once into plan/chunks/N/ (N: the input's place among the chunked),
    cut into pieces; None (nothing kept) where it is damaged, not UTF-8, one piece, or its chunks would take
    more than a third of the disk free beyond KEEP_FREE."""
    root = plan / CHUNKS
    root.mkdir(exist_ok=True)
    name = f"{len(os.listdir(root)):05d}"
    out = root / name
    with open_bytes(path) as f:
        out.mkdir()
        # the stages after the plan need room too: the same text again as raw documents, then the tokens
        room = (shutil.disk_usage(out).free - KEEP_FREE) // 3
        try:
            # the decompressed size is not known before the pass: pieces sized for 4x compression
            pieces = _cut(_Bounded(f, room), piece_bytes(size * 4, top), out)
        except (UnusableInput, _TooBig):
            pieces = None
        except BaseException:  # a full disk, an interrupt: no half-written chunks left behind
            shutil.rmtree(out, ignore_errors=True)
            raise
    if pieces is None or len(pieces) < 2:  # damaged, too big, or one piece: read whole, as before
        shutil.rmtree(out, ignore_errors=True)
        return None
    for p in pieces:  # named within plan/chunks/, so any host that mounts the work directory finds them
        p["file"] = f"{name}/{os.path.basename(p['file'])}"
    return pieces


class _TooBig(Exception):
    pass


class _Bounded(io.RawIOBase):
    """A stream that raises _TooBig once more than `limit` bytes were read from it."""

    def __init__(self, f, limit: int):
        self._f, self._left = f, limit

    def read(self, n: int = -1) -> bytes:
        data = self._f.read(n)
        self._left -= len(data)
        if self._left < 0:
            raise _TooBig
        return data


def _row_groups(path: str, piece: int, text_field: str) -> list[dict] | None:
    """Runs of whole row groups of about `piece` bytes: {"groups": [first, end), "row": the rows before the
    first, "size": their bytes}. None for a file pyarrow cannot open, or one with a text-column page header
    that does not parse (read whole, the reader stops there: so it is read whole)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    try:
        with open(path, "rb") as f:
            meta = pq.ParquetFile(f).metadata
            for i in range(meta.num_row_groups):
                rg = meta.row_group(i)
                for c in map(rg.column, range(rg.num_columns)):
                    if c.path_in_schema == text_field or c.path_in_schema.startswith(text_field + "."):
                        for _ in parquet_page_sizes(f.fileno(), c):
                            pass
    except (pa.ArrowException, OSError, BadPageHeader):
        return None
    pieces, first, rows, acc, before = [], 0, 0, 0, 0
    for i in range(meta.num_row_groups):
        rg = meta.row_group(i)
        acc += rg.total_byte_size
        rows += rg.num_rows
        if acc >= piece or i == meta.num_row_groups - 1:
            pieces.append({"groups": [first, i + 1], "row": before, "size": acc})
            first, before, acc = i + 1, rows, 0
    return pieces
