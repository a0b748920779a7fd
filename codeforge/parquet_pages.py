"""Parquet page headers read by hand (Thrift's compact protocol, the few fields needed), so a reader knows
each page's decoded size before pyarrow decodes it whole: corpus.py skips a row group whose page would
take more memory than its limit (a small file can hold a page that decodes to gigabytes)."""

from __future__ import annotations

import os
from collections.abc import Iterator


class BadPageHeader(Exception):
    """A parquet page header that does not parse (counted as corrupt_parquet)."""


class _PageHeaders:
    """Just enough of Thrift's compact protocol to read parquet page headers at byte offsets of a file:
    a header's top-level integer fields are returned, everything else skipped; binary fields (page
    statistics) are skipped by offset, never read. Reads with os.pread, so pyarrow's position on the same
    file is untouched. Malformed input raises BadPageHeader."""

    def __init__(self, fd: int, end: int):
        self.fd, self.end = fd, end
        self.pos, self._block, self._at = 0, b"", 0

    def _byte(self) -> int:
        i = self.pos - self._at
        if not 0 <= i < len(self._block):
            self._at, self._block = self.pos, os.pread(self.fd, 4096, self.pos)
            i = 0
            if not self._block:
                raise BadPageHeader("page header runs past the end of the file")
        self.pos += 1
        return self._block[i]

    def _varint(self) -> int:
        out = shift = 0
        while True:
            b = self._byte()
            out |= (b & 0x7F) << shift
            if b < 0x80:
                return out
            shift += 7
            if shift > 63:
                raise BadPageHeader("varint longer than 64 bits")

    def _zigzag(self) -> int:
        n = self._varint()
        return (n >> 1) ^ -(n & 1)

    def _skip(self, t: int, depth: int, in_list: bool = False) -> None:
        if depth > 16:
            raise BadPageHeader("page header nested too deep")
        if t in (1, 2):  # a bool: its value is in the field header, or one byte in a list
            if in_list:
                self._byte()
        elif t == 3:
            self._byte()
        elif t in (4, 5, 6):
            self._varint()
        elif t == 7:
            self.pos += 8
        elif t == 8:
            n = self._varint()  # read first: `self.pos += self._varint()` would add to the old position
            self.pos += n
        elif t in (9, 10):  # list, set
            h = self._byte()
            n, et = h >> 4, h & 15
            if n == 15:
                n = self._varint()
            if et == 7:
                self.pos += 8 * n  # doubles: one step, not n
            else:
                for _ in range(n):  # every other element reads at least one byte: bounded by the file
                    self._skip(et, depth + 1, True)
        elif t == 11:  # map
            n = self._varint()
            if n:
                kv = self._byte()
                for _ in range(n):
                    self._skip(kv >> 4, depth + 1, True)
                    self._skip(kv & 15, depth + 1, True)
        elif t == 12:
            self.struct(depth + 1)
        else:
            raise BadPageHeader(f"unknown thrift type {t}")
        if self.pos > self.end:
            raise BadPageHeader("page header runs past its column chunk")

    def struct(self, depth: int = 0) -> dict[int, int]:
        """The struct at self.pos: {field id: value} of its integer fields; self.pos moves past it."""
        fields: dict[int, int] = {}
        last = 0
        while h := self._byte():
            t, delta = h & 15, h >> 4
            last = last + delta if delta else self._zigzag()
            if t in (4, 5, 6):
                fields[last] = self._zigzag()
            else:
                self._skip(t, depth)
        return fields


def parquet_page_sizes(fd: int, col) -> Iterator[int]:
    """Uncompressed size of every page (dictionary and data) of one column chunk (pyarrow's
    ColumnChunkMetaData), read from the page headers alone: what pyarrow will hold decoded at once."""
    start = col.data_page_offset
    if col.has_dictionary_page and col.dictionary_page_offset:
        start = min(start, col.dictionary_page_offset)
    end = start + col.total_compressed_size  # the chunk's pages with their headers
    r = _PageHeaders(fd, end)
    r.pos = start
    while r.pos < end:
        h = r.struct()  # PageHeader: 1 type, 2 uncompressed_page_size, 3 compressed_page_size
        if h.get(2, -1) < 0 or h.get(3, -1) < 0:
            raise BadPageHeader(f"page header at byte {r.pos} has no page sizes")
        yield h[2]
        r.pos += h[3]
