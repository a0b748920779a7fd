"""Sources -> documents: read lazily, decode, filter, deduplicate, split train/validation.

A *source* is a path: a directory walked recursively (files picked by extension), a single text or code
file, a `.jsonl` (optionally `.gz` / `.zst`) with one JSON object per line, a `.parquet` file, or
`hf:NAME[:SPLIT]` for a Hugging Face dataset streamed through the optional `datasets` extra.
Every input that does not become a document is counted under a reason in `CorpusStats.skipped`.

Hostile inputs are skipped and counted, never read blindly (or refused under `--strict`):
  not_regular_file     a FIFO, socket or device (or a symlink to one): never opened, so nothing hangs or
                       reads forever; only regular files are read, checked again on the open descriptor
  broken_symlink       a symlink whose target is missing, or a symlink loop
  unreadable           open() or read() failed (permission denied, I/O error), or a directory could not be
                       listed
  corrupt_compressed   a .gz / .zst that is not in that format, is truncated or is damaged; the records read
                       before the damage are kept (the file is streamed), and the file is counted once
  corrupt_parquet      a .parquet file pyarrow cannot read (or whose page headers do not parse)
  symlinked_dir        a symlink to a directory inside a walked tree: not followed (as os.walk does by
                       default, so a link loop cannot recurse forever); pass its target as another input.
                       Warned, but not refused under --strict: it is a policy, not damage.
  symlink_outside      a symlink inside a walked tree to a file outside it (it could name ~/.ssh/id_rsa):
                       never read. Warned, not refused under --strict (a policy); name the target to read it.
  oversized_record     a JSONL line longer than the line limit, or the rows of a parquet row group with a page
                       over the page limit: skipped without ever being held whole (see "Read limits")
A source named directly (not found in a walk) that is not a regular file or directory, a broken symlink or
unreadable is refused before any work, with its path.

Read limits: a few kilobytes on disk can hold gigabytes once read (a line of one repeated byte compresses
32,000:1 in zstd, 1,000:1 in gzip), so nothing is read whole before its size is known:
  whole files          at most --max-file-bytes (default 1,000,000) read, the size checked before reading;
                       only JSONL is decompressed (.jsonl.gz / .jsonl.zst): any other file is read as it is
                       on disk, so a compressed one is at most --max-file-bytes of bytes (and binary)
  .gz / .zst streams   decompressed in bounded steps (zstd is fed 1 KiB of input at a time: at most 32 MiB
                       out)
  JSONL lines          at most `line_limit(max_file_bytes)` characters held (12 x --max-file-bytes + 64 KiB,
                       12,065,536 by default: the longest JSON line whose text can pass --max-file-bytes, an
                       astral character escaping to 12); a longer line is read through in 1 MiB pieces and
                       counted as oversized_record. Chat and preference-pair JSONL use the same limit.
  parquet pages        each row group's text-column page headers are read first (parquet_page_sizes); a row
                       group with a page over `parquet_page_limit` (64 MiB, or the line limit if larger) is
                       skipped unread, its rows counted as oversized_record, as pyarrow decodes a page whole
                       (about 5 times its size at peak); the others are read in batches of at most 64 MiB
                       decoded even if every row repeats the largest dictionary entry.
"""

from __future__ import annotations

import errno
import gzip
import hashlib
import io
import json
import os
import re
import stat
import sys
import zlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from . import CodeforgeError
from .decontam import benchmarks
from .fields import ConfigError, check_fields, default_of, setting
from .parquet_pages import BadPageHeader, parquet_page_sizes
from .redact import redact, redact_pii

LANGUAGES: dict[str, tuple[str, ...]] = {
    "go": (".go",), "python": (".py", ".pyi"), "c": (".c", ".h"),
    "cpp": (".cc", ".cpp", ".cxx", ".hpp", ".hh"),
    "rust": (".rs",), "java": (".java",), "javascript": (".js", ".mjs", ".jsx"),
    "typescript": (".ts", ".tsx"),
    "shell": (".sh", ".bash"), "ruby": (".rb",), "text": (".txt", ".md", ".rst"),
}
EXT_TO_LANG = {ext: lang for lang, exts in LANGUAGES.items() for ext in exts}
VENDORED_DIRS = frozenset({"vendor", "node_modules", "third_party", "third-party", ".git", "__pycache__",
                           "site-packages", ".venv", ".tox"})
TEST_DIRS = frozenset({"test", "tests", "testdata", "__tests__"})
TEST_FILE = re.compile(r"(_test\.go|^test_.*\.py|_test\.py|\.test\.[jt]sx?|\.spec\.[jt]sx?|Test\.java)$")
GENERATED = re.compile(
    r"Code generated .{0,200}DO NOT EDIT|@generated|<auto-generated|automatically generated|"
    r"AUTO-GENERATED FILE|autogenerated by", re.IGNORECASE)
DEDUP_MODES = ("none", "exact", "near")
# What each skip reason means, in words a user recognises (for the summaries commands print)
REASON_WORDS = {
    "vendored": "in third-party or tool directories (site-packages, vendor, node_modules, .git, .venv, ...)",
    "test_file": "test files (--exclude-tests)", "duplicate": "exact duplicates",
    "near_duplicate": "near duplicates", "binary": "binary", "non_utf8": "not UTF-8 text", "empty": "empty",
    "too_large": "larger than --max-file-bytes",
    "minified": "minified (a line longer than --max-line-length)", "generated": "marked as generated code",
    "unknown_extension": "of other languages",
    "not_regular_file": "not regular files (FIFOs, sockets, devices)",
    "broken_symlink": "broken or looping symlinks", "unreadable": "unreadable",
    "symlinked_dir": "directory symlinks (not followed)", "corrupt_compressed": "damaged .gz/.zst",
    "corrupt_parquet": "damaged parquet", "bad_json": "lines that are not JSON",
    "missing_field": "records without the text field", "vanished": "gone before they were read",
    "benchmark": "sharing a 13-token run or a solution's shape with a benchmark (--decontaminate: "
                 "HumanEval by default)",
    "symlink_outside": "file symlinks pointing out of the input tree (not followed)",
    "oversized_record": "records over the read limits (JSONL lines over 12 x --max-file-bytes characters, "
                        "rows of parquet row groups with a page over 64 MiB)",
}


def describe_skipped(skipped: dict) -> str:
    """'17,424 in third-party ... directories; 2,031 test files (--exclude-tests); 190 exact duplicates'."""
    items = sorted(skipped.items(), key=lambda kv: -kv[1])
    return "; ".join(f"{n:,} {REASON_WORDS.get(k, k.replace('_', ' '))}" for k, n in items if n) or "nothing"


def describe_secrets(found: dict) -> str:
    """'2 AWS Access Key, 1 Private Key' (most first)."""
    return ", ".join(f"{n:,} {k}" for k, n in sorted(found.items(), key=lambda kv: -kv[1])) or "none"


# Reasons that are a corpus filter doing its job (counted quietly); any other reason is malformed input.
FILTER_REASONS = frozenset({"binary", "non_utf8", "empty", "too_large", "minified", "generated", "vendored",
                            "test_file", "duplicate", "near_duplicate", "unknown_extension", "benchmark"})


class CorpusError(CodeforgeError):
    """Bad corpus input; the message names the input and the fix."""


class UnusableInput(CorpusError):
    """A file that cannot be read as data. `reason` is its CorpusStats key; readers here count it, a caller
    that does not (chat.read_conversations) still gets a clear error naming the path instead of a hang."""

    def __init__(self, path: str, reason: str, detail: str):
        self.path, self.reason, self.detail = path, reason, detail
        super().__init__(f"{path}: {reason}: {detail}")


# the options every prepared dataset's fingerprint has held (CorpusOptions.to_dict)
FINGERPRINT_FIELDS = ("languages", "text_field", "max_file_bytes", "max_line_length", "exclude_tests",
                      "dedup", "near_threshold", "val_fraction", "strict")


@dataclass
class CorpusInput:
    """The sources a corpus command reads (`tokenizer train|eval`, `prepare`): a command's options class
    derives from it, so --input is declared here once."""
    input: list[str] = setting([], "directories, .txt, .jsonl[.gz|.zst], .parquet files, or hf:NAME[:SPLIT]",
                               required=True, metavar="PATH")


@dataclass
class CorpusOptions:
    """What makes a file a training document, each option declared once (fields.setting). The commands that
    read a corpus (`tokenizer train`, `tokenizer eval`, `prepare`) make their flags from it and build it
    back (cli/data.py); the quickstart and the miners set it in code. to_dict() is part of a prepared
    dataset's fingerprint, and a field added here leaves old fingerprints as they were (see there)."""
    languages: list[str] | None = setting(
        None, f"keep files of these languages, by extension: {', '.join(LANGUAGES)} (default: all of them)",
        type=str, many=True, metavar="LANG")
    text_field: str = setting("text", "JSONL/parquet field that holds the text", metavar="NAME")
    max_file_bytes: int = setting(1_000_000, "skip larger documents", range=(1, 10**12))
    max_line_length: int = setting(1000, "a longer line marks a file minified", range=(1, 10**9))
    exclude_tests: bool = setting(False, "skip test files (_test.go, test_*.py, tests/)")
    dedup: str = setting("exact", "drop duplicate documents: exact (same text), near (MinHash, similar text) "
                         "or none", choices=DEDUP_MODES)
    near_threshold: float = setting(0.85, "near dedup: the estimated Jaccard similarity of two documents' "
                                    "5-word shingles from which they count as duplicates",
                                    range=(0.0, 1.0), open_low=True, cli=False)
    # [0, 1): a fraction of 1 would leave no training split (0.999999 as config.py bounds its betas)
    val_fraction: float = setting(0.01, "share of documents kept for validation, chosen by a stable hash of "
                                  "each document", range=(0.0, 0.999999))
    strict: bool = setting(False, "fail on a malformed input instead of skipping it")
    # Off here, but on by default in `prepare` and the quickstart: so prepare's flags for these two are its
    # own (data/options.py: --decontaminate SRC..., --no-decontaminate, --keep-secrets)
    decontaminate: list[str] = setting([], "benchmark sources a document must not overlap (decontam.py: "
                                       "humaneval, a JSONL file, a directory)", cli=False)
    redact_secrets: bool = setting(False, "replace secrets with a placeholder per kind (redact.py, "
                                   "detect-secrets)", cli=False)
    redact_pii: bool = setting(False, "also replace e-mail addresses and public IP addresses "
                               "(REDACTED_EMAIL_ADDRESS, REDACTED_IP_ADDRESS; example domains and private, "
                               "loopback and documentation ranges stay), counted with the secrets")

    def validate(self, command: str = "corpus") -> None:
        """CorpusError for a value outside its declaration (the message names the flag, the allowed values
        and the fix) or a language without known extensions. command: the one the message names."""
        try:
            check_fields(self, command, via_set=False)
        except ConfigError as e:  # a CorpusError, as callers of the corpus readers expect
            raise CorpusError(str(e)) from None
        for lang in self.languages or []:
            if lang not in LANGUAGES:
                raise CorpusError(f"unknown language {lang!r}; known: {', '.join(sorted(LANGUAGES))}")

    def extensions(self) -> set[str]:
        langs = self.languages or list(LANGUAGES)
        return {ext for lang in langs for ext in LANGUAGES[lang]}

    def to_dict(self) -> dict:
        """The options as meta.json saves them and the dataset's fingerprint hashes them. A field declared
        after FINGERPRINT_FIELDS counts only when it is not at its default, so data prepared before the field
        existed keeps its fingerprint (and a rerun still finds it done)."""
        defaults = {f.name: default_of(f) for f in fields(self)}
        return {k: v for k, v in asdict(self).items() if k in FINGERPRINT_FIELDS or v != defaults[k]}


@dataclass
class Document:
    text: str
    source: str  # the path or name it came from (with :line for JSONL)
    nbytes: int = -1  # UTF-8 size; computed once, where the bytes are at hand
    digest: bytes = b""  # content hash, set by iter_documents: dedup and the split both use it

    def __post_init__(self) -> None:
        if self.nbytes < 0:
            self.nbytes = len(self.text.encode("utf-8"))


@dataclass
class CorpusStats:
    documents: int = 0
    bytes: int = 0
    skipped: Counter = field(default_factory=Counter)
    examples: dict = field(default_factory=dict)  # reason -> first offending input
    secrets: Counter = field(default_factory=Counter)  # kind -> values replaced (redact.py)
    steps: dict = field(default_factory=dict)  # step -> [documents in, bytes in, documents out, bytes out]

    def step(self, name: str, bytes_in: int, kept: bool, bytes_out: int | None = None) -> None:
        """One document through step `name`: kept or not, with its bytes out (default: as it came in)."""
        row = self.steps.setdefault(name, [0, 0, 0, 0])
        row[0] += 1
        row[1] += bytes_in
        row[2] += kept
        row[3] += (bytes_in if bytes_out is None else bytes_out) if kept else 0

    def skip(self, reason: str, where: str, strict: bool = False, detail: str = "", n: int = 1) -> None:
        """Count `n` inputs (a file, a record, the rows of a parquet row group) skipped for `reason`."""
        self.skipped[reason] += n
        self.examples.setdefault(reason, where)
        if strict:
            raise CorpusError(f"{where}: {reason}{': ' + detail if detail else ''} (--strict is on)")
        if reason not in FILTER_REASONS and self.skipped[reason] <= 5:  # malformed input: say where, at once
            print(f"warning: skipping {where}: {reason}{': ' + detail if detail else ''}", file=sys.stderr)


def _file_kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISDIR, "a directory")):
        if test(mode):
            return name
    return "not a regular file"


def check_sources(paths: list[str]) -> None:
    """Fail before any work if a source does not exist, or is not a regular file or directory one can read
    (a FIFO would block forever, /dev/zero never ends)."""
    if not paths:
        raise CorpusError("no --input given: pass one or more directories or files")
    for p in paths:
        if p.startswith("hf:"):
            continue
        try:
            st = os.stat(p)
        except FileNotFoundError:
            if os.path.islink(p):
                raise CorpusError(f"input {p!r} is a broken symlink (its target {os.readlink(p)!r} does not "
                                  f"exist)") from None
            raise CorpusError(f"input {p!r} does not exist: check the path (directories, .txt, "
                              f".jsonl[.gz|.zst], .parquet, or hf:NAME for a Hugging Face dataset)") from None
        except OSError as e:
            what = "is a symlink loop" if e.errno == errno.ELOOP else f"cannot be read ({e.strerror})"
            raise CorpusError(f"input {p!r} {what}") from None
        is_dir = stat.S_ISDIR(st.st_mode)
        if not (is_dir or stat.S_ISREG(st.st_mode)):
            raise CorpusError(f"input {p!r} is {_file_kind(st.st_mode)}: only regular files and directories "
                              "are read (a pipe or device may block or never end); write the data to a file "
                              "first")
        if not os.access(p, os.R_OK | (os.X_OK if is_dir else 0)):
            raise CorpusError(f"input {p!r} is not readable (permission denied)")


# -- filters ---------------------------------------------------------------------------------------------

def reject_reason(text: str, opts: CorpusOptions) -> str | None:
    """The reason a decoded text is not a training document, or None."""
    if not text.strip():
        return "empty"
    if len(text) > opts.max_file_bytes:
        return "too_large"
    if "\x00" in text[:8192]:
        return "binary"
    # tried at line starts only (an attempt from every position costs the square of a line's length)
    if re.search(f"(?m)^[^\n]{{{opts.max_line_length + 1}}}", text):
        return "minified"
    if GENERATED.search(text[:2000]):
        return "generated"
    return None


def _decode(raw: bytes) -> tuple[str | None, str | None]:
    if b"\x00" in raw[:8192]:
        return None, "binary"
    try:
        return raw.decode("utf-8"), None
    except UnicodeDecodeError:
        return None, "non_utf8"


def _is_test_path(parts: tuple[str, ...]) -> bool:
    return bool(TEST_FILE.search(parts[-1])) or any(p in TEST_DIRS for p in parts[:-1])


# -- read limits -----------------------------------------------------------------------------------------

ZSTD_FEED = 1 << 10  # compressed bytes per zstd call: a 4-byte RLE block decodes to 128 KiB, so <= 32 MiB out
LINE_PIECE = 1 << 20  # characters read at a time while reading through an over-long line
PARQUET_BATCH_BYTES = 64 << 20  # decoded bytes a parquet batch may reach, at its worst
# pyarrow holds a page about 5 times over while decoding it (a 60 MB value: 315 MB peak). pyarrow's writer
# closes a page every 1,024 rows at the earliest, so 20 KB documents already make 20 MB pages: the limit
# must not be the line limit's 12 MB.
PARQUET_PAGE_BYTES = 64 << 20


def line_limit(max_file_bytes: int) -> int:
    """The longest JSONL line (in characters) read: long enough for any record whose text passes
    --max-file-bytes (one astral character escapes to 12, two \\uXXXX), plus 64 KiB for the other fields."""
    return 12 * max_file_bytes + (64 << 10)


MAX_LINE_CHARS = line_limit(CorpusOptions.max_file_bytes)  # 12,065,536: the default for chat and pair JSONL


def parquet_page_limit(max_file_bytes: int) -> int:
    """The largest parquet page (uncompressed bytes) read: 64 MiB, or the line limit if that is larger."""
    return max(PARQUET_PAGE_BYTES, line_limit(max_file_bytes))


def bounded_lines(f: io.TextIOBase, limit: int, first: int = 1) -> Iterator[tuple[int, str | None]]:
    """(line number, line) of a text stream, never holding more than `limit` characters of one line (plus
    its newline): a longer line is read through in LINE_PIECE pieces, discarded, and given as (n, None).
    first: the number of the stream's first line."""
    lineno = first - 1
    while line := f.readline(limit + 1):
        lineno += 1
        if len(line) <= limit or line.endswith("\n"):
            yield lineno, line
            continue
        while line and not line.endswith("\n"):
            line = f.readline(LINE_PIECE)
        yield lineno, None


def long_line_detail(limit: int, fix: str) -> str:
    return f"a line longer than {limit:,} characters, the read limit: skipped without being held whole; {fix}"


def leaves_tree(path: str, tree: str) -> str | None:
    """For a file met while walking the directory `tree` (a real path): the real path of a regular file
    outside `tree` that `path` is a symlink to, else None. A link to a missing or non-regular target is
    left to the open, which counts it as broken_symlink or not_regular_file."""
    if not os.path.islink(path):
        return None  # the walk follows no directory link, so a plain entry is inside the tree
    real = os.path.realpath(path)
    if os.path.commonpath([real, tree]) == tree or not os.path.isfile(real):
        return None
    return real


# -- readers ---------------------------------------------------------------------------------------------

def _open_regular(path: str) -> tuple[io.BufferedReader, os.stat_result]:
    """Open `path` for reading only if it is (or a symlink resolves to) a regular file; else UnusableInput.
    A FIFO, socket or device is never opened (opening a device can have effects of its own). The open uses
    O_NONBLOCK and the descriptor is checked again, so a file swapped for a FIFO in between cannot block."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        if os.path.islink(path):
            raise UnusableInput(path, "broken_symlink", "symlink to a missing target") from None
        raise UnusableInput(path, "vanished", "file disappeared while reading") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnusableInput(path, "broken_symlink", "symlink loop") from None
        raise UnusableInput(path, "unreadable", e.strerror or str(e)) from None
    if not stat.S_ISREG(st.st_mode):
        raise UnusableInput(path, "not_regular_file",
                            f"{_file_kind(st.st_mode)}; only regular files are read")
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
    except FileNotFoundError:
        raise UnusableInput(path, "vanished", "file disappeared while reading") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnusableInput(path, "broken_symlink", "symlink loop") from None
        raise UnusableInput(path, "unreadable", e.strerror or str(e)) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise UnusableInput(path, "not_regular_file", f"{_file_kind(st.st_mode)} (replaced while reading)")
    return os.fdopen(fd, "rb"), st


class _Decompressed(io.RawIOBase):
    """The decompressed bytes of a .gz (all members) or .zst (all frames) file. Damage raises UnusableInput
    (corrupt_compressed) at the point it is met, instead of gzip's EOFError / BadGzipFile / zlib.error, and
    instead of zstandard's silent early end on a truncated frame."""

    def __init__(self, f: io.BufferedReader, path: str):
        self._f, self.path = f, path
        self._zst = path.endswith(".zst")
        if self._zst:
            import zstandard
            self._zmod = zstandard
            self._d = None  # decompressor of the current frame
            self._pending = b""  # compressed bytes after the end of a frame: the next frame's start
            self._buf, self._pos = b"", 0
        else:
            self._gz = gzip.GzipFile(fileobj=f, mode="rb")

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        try:
            data = self._read_zst(len(b)) if self._zst else self._gz.read(len(b))
        except (EOFError, gzip.BadGzipFile, zlib.error) as e:
            raise UnusableInput(self.path, "corrupt_compressed", str(e) or type(e).__name__) from None
        except Exception as e:
            if self._zst and isinstance(e, self._zmod.ZstdError):
                raise UnusableInput(self.path, "corrupt_compressed", str(e)) from None
            raise
        b[:len(data)] = data
        return len(data)

    def _read_zst(self, n: int) -> bytes:
        """At most n decompressed bytes. The input goes in ZSTD_FEED bytes at a time, so one call never
        produces more than 32 MiB however well the data compresses (zstandard's decompressobj has no
        output limit of its own)."""
        while self._pos >= len(self._buf):
            if self._pending:
                chunk, self._pending = self._pending[:ZSTD_FEED], self._pending[ZSTD_FEED:]
            else:
                chunk = self._f.read(ZSTD_FEED)
            if not chunk:
                if self._d is not None and not self._d.eof:
                    raise EOFError("zstd file ended inside a frame (truncated)")
                return b""
            if self._d is None or self._d.eof:
                self._d = self._zmod.ZstdDecompressor().decompressobj()
            self._buf, self._pos = self._d.decompress(chunk), 0
            if self._d.eof:
                self._pending = self._d.unused_data + self._pending
        out = self._buf[self._pos:self._pos + n]
        self._pos += len(out)
        return out

    def close(self) -> None:
        if not self.closed:
            if not self._zst:
                self._gz.close()  # does not close the file object it was given
            self._f.close()
        super().close()


def open_text(path: str, span: tuple[int, int] | None = None) -> io.TextIOBase:
    """UTF-8 text of a regular file, decompressed by extension (.gz, .zst); span: only bytes [start, end) of a
    plain file (a piece of it, data/pieces.py). Raises UnusableInput for a file that is not regular, a broken
    symlink, unreadable, or (while reading) damaged compressed data."""
    f, _ = _open_regular(path)
    if span is not None:
        raw = io.BufferedReader(_Span(f, *span), 1 << 16)
    else:
        raw = io.BufferedReader(_Decompressed(f, path), 1 << 16) if path.endswith((".gz", ".zst")) else f
    text = io.TextIOWrapper(raw, encoding="utf-8", errors="strict")
    # Bytes decoded per step (8 KiB by default): reading through a 6 GiB line of a .zst takes 4.7 s of CPU,
    # not 8.6 (measured; larger zstd output buffers cost more in page faults than they save)
    text._CHUNK_SIZE = 1 << 16
    return text


def open_bytes(path: str) -> io.BufferedIOBase:
    """The bytes of a regular file (decompressed by extension, .gz and .zst), for a pass over them
    (data/pieces.py); UnusableInput as open_text raises it."""
    f, _ = _open_regular(path)
    return io.BufferedReader(_Decompressed(f, path), 1 << 16) if path.endswith((".gz", ".zst")) else f


class _Span(io.RawIOBase):
    """Bytes [start, end) of an open file."""

    def __init__(self, f: io.BufferedReader, start: int, end: int):
        self._f, self._left = f, max(0, end - start)
        f.seek(start)

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        data = self._f.read(min(len(b), self._left))
        self._left -= len(data)
        b[:len(data)] = data
        return len(data)

    def close(self) -> None:
        if not self.closed:
            self._f.close()
        super().close()


def _read_jsonl(path: str, opts: CorpusOptions, stats: CorpusStats, piece: dict | None = None,
                ) -> Iterator[Document]:
    """Documents of a JSONL file, streamed. A damaged compressed file keeps the records read before the
    damage and is counted once under corrupt_compressed (refused under --strict). A line over
    line_limit(--max-file-bytes) is counted as oversized_record without being held whole. piece: one piece of
    the file (data/pieces.py): its bytes, the number of its first line, and the file they are read from (the
    input itself, or a decompressed chunk of it); documents are named by the input's path and line as when
    the whole file is read."""
    kept = 0
    limit = line_limit(opts.max_file_bytes)
    read_from, span, first = ((piece.get("file", path), tuple(piece["bytes"]), piece["line"]) if piece
                              else (path, None, 1))
    if piece and "file" in piece and not os.path.isfile(piece["file"]):
        raise CorpusError(f"{path}: the decompressed piece {piece['file']} of prepare's work directory is "
                          "gone (removed while prepare ran?); run the same command again, it starts afresh")
    try:
        with open_text(read_from, span) as f:
            for lineno, line in bounded_lines(f, limit, first):
                where = f"{path}:{lineno}"
                if line is None:
                    stats.skip("oversized_record", where, opts.strict,
                               long_line_detail(limit, "raise --max-file-bytes to read longer records"))
                    continue
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    stats.skip("bad_json", where, opts.strict, str(e))
                    continue
                text = obj.get(opts.text_field) if isinstance(obj, dict) else None
                if not isinstance(text, str):
                    stats.skip("missing_field", where, opts.strict, f"no string field {opts.text_field!r} "
                               f"(set --text-field)")
                    continue
                kept += 1
                yield Document(text, where)
    except UnicodeDecodeError:
        stats.skip("non_utf8", path, opts.strict)
    except UnusableInput as e:  # a piece (plain bytes) meets it only on opening: counted once, by the first
        if _first_piece(piece):
            stats.skip(e.reason, path, opts.strict,
                       e.detail + (f" (kept the {kept} records before it)" if kept else ""))
    except OSError as e:
        stats.skip("unreadable", path, opts.strict, e.strerror or str(e))


def _first_piece(piece: dict | None) -> bool:
    """Whether a piece is its input's first (or the whole input): a file that cannot be opened is counted in
    that one only, as it is once when read whole."""
    if piece is None:
        return True
    if "groups" in piece:
        return piece["groups"][0] == 0
    return piece["line"] == 1


def _read_parquet(path: str, opts: CorpusOptions, stats: CorpusStats, piece: dict | None = None,
                  ) -> Iterator[Document]:
    """Rows of a parquet file, row group by row group. pyarrow decodes a page whole (a 10 KB file can hold
    one 300 MB value), so each row group's text-column page headers are read first: a row group with a page
    over parquet_page_limit(--max-file-bytes) is skipped unread, its rows counted as oversized_record. The
    others are read in batches sized so that even rows that all repeat the largest page's value (a dictionary
    page) stay under PARQUET_BATCH_BYTES decoded. A file pyarrow cannot read is counted under
    corrupt_parquet (rows read before the damage are kept). piece: row groups [first, end) only, the rows
    numbered from piece["row"] + 1 (data/pieces.py)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    try:
        f, _ = _open_regular(path)
    except UnusableInput as e:
        if _first_piece(piece):
            stats.skip(e.reason, path, opts.strict, e.detail)
        return
    row = piece["row"] if piece else 0
    with f:
        try:
            pf = pq.ParquetFile(f)
            if opts.text_field not in pf.schema_arrow.names:
                raise CorpusError(f"{path} has no column {opts.text_field!r} (columns: "
                                  f"{pf.schema_arrow.names}); set --text-field")
            limit = parquet_page_limit(opts.max_file_bytes)
            meta = pf.metadata
            for i in range(*piece["groups"]) if piece else range(meta.num_row_groups):
                rg = meta.row_group(i)
                chunks = [c for c in map(rg.column, range(rg.num_columns))
                          if c.path_in_schema == opts.text_field
                          or c.path_in_schema.startswith(opts.text_field + ".")]
                largest = max((size for c in chunks for size in parquet_page_sizes(f.fileno(), c)), default=0)
                if largest > limit:
                    stats.skip("oversized_record", f"{path}#{row + 1}", opts.strict,
                               f"row group {i} ({rg.num_rows} rows) has a page of {largest:,} bytes, over "
                               f"the {limit:,}-byte read limit: skipped unread; raise --max-file-bytes to "
                               "read it", n=rg.num_rows)
                    row += rg.num_rows
                    continue
                batch_size = max(1, min(1024, PARQUET_BATCH_BYTES // max(largest, 1)))
                for batch in pf.iter_batches(batch_size=batch_size, row_groups=[i],
                                             columns=[opts.text_field]):
                    for text in batch.column(0).to_pylist():
                        row += 1
                        if isinstance(text, str):
                            yield Document(text, f"{path}#{row}")
                        else:
                            stats.skip("missing_field", f"{path}#{row}", opts.strict,
                                       "null or non-string value")
        except (pa.ArrowException, OSError) as e:
            stats.skip("corrupt_parquet", path, opts.strict,
                       str(e) + (f" (kept the {row} rows before it)" if row else ""))
        except BadPageHeader as e:
            stats.skip("corrupt_parquet", path, opts.strict, f"bad page header: {e}" +
                       (f" (kept the {row} rows before it)" if row else ""))


def _read_hf(spec: str, opts: CorpusOptions, stats: CorpusStats) -> Iterator[Document]:
    try:
        import datasets
    except ImportError as e:
        raise CorpusError(f"{spec}: Hugging Face datasets need the extra: pip install "
                          "'codeforge[datasets]'") from e
    name, _, split = spec[3:].partition(":")
    if os.path.isdir(name) and os.path.exists(os.path.join(name, "dataset_info.json")):
        ds = datasets.load_from_disk(name)
        if isinstance(ds, datasets.DatasetDict):
            ds = ds[split or "train"]
        it = iter(ds)
    else:
        it = iter(datasets.load_dataset(name, split=split or "train", streaming=True))
    for i, rec in enumerate(it):
        text = rec.get(opts.text_field)
        if isinstance(text, str):
            yield Document(text, f"{spec}#{i}")
        else:
            stats.skip("missing_field", f"{spec}#{i}", opts.strict, f"no string field {opts.text_field!r}")


def _read_file(path: str, opts: CorpusOptions, stats: CorpusStats,
               tree: str | None = None) -> Iterator[Document]:
    """One whole file as a document, at most --max-file-bytes read. tree: the real path of the directory
    being walked; a symlink from it to a regular file outside it is counted as symlink_outside, never read."""
    try:
        f, st = _open_regular(path)
    except UnusableInput as e:
        stats.skip(e.reason, path, opts.strict, e.detail)
        return
    if tree is not None and (real := leaves_tree(path, tree)):
        f.close()
        stats.skip("symlink_outside", path, False, f"a symlink to {real}, outside {tree}: not read; name the "
                   f"target as an input to read it")
        return
    with f:
        if st.st_size > opts.max_file_bytes:
            stats.skip("too_large", path)
            return
        try:
            raw = f.read(opts.max_file_bytes + 1)  # bounded even if the file grows while it is read
        except OSError as e:
            stats.skip("unreadable", path, opts.strict, e.strerror or str(e))
            return
    if len(raw) > opts.max_file_bytes:
        stats.skip("too_large", path)
        return
    text, reason = _decode(raw)
    if reason:
        stats.skip(reason, path)
        return
    yield Document(text, path, len(raw))


def walk_tree(root: str, onerror=None) -> Iterator[tuple[str, list[str], list[str]]]:
    """os.walk(root, topdown=True, followlinks=False), without recursion: os.walk before Python 3.12 recurses
    once per directory level, so a nest ~1,000 deep raised RecursionError before anything was read. Same
    order (depth first, a directory before its contents) and the same contract: `dirnames` may be pruned or
    sorted in place after each yield, and names the symlinks to directories too, which are never descended
    into (a link loop cannot recurse). onerror(OSError) is called for a directory that cannot be listed."""
    stack = [root]
    while stack:
        top = stack.pop()
        dirnames: list[str] = []
        filenames: list[str] = []
        try:
            with os.scandir(top) as it:
                for entry in it:
                    try:
                        is_dir = entry.is_dir()
                    except OSError:
                        is_dir = False
                    (dirnames if is_dir else filenames).append(entry.name)
        except OSError as e:
            if onerror is not None:
                onerror(e)
            continue
        yield top, dirnames, filenames
        # after the yield: the caller's pruning and sorting of dirnames decide what is walked, and when
        for d in reversed(dirnames):
            path = os.path.join(top, d)
            if not os.path.islink(path):
                stack.append(path)


def _walk(root: str, opts: CorpusOptions, stats: CorpusStats) -> Iterator[Document]:
    """Documents of the files under `root` with a wanted extension (walk_files), each read by _read_file."""
    tree = os.path.realpath(root)
    for path in walk_files(root, opts, stats):
        yield from _read_file(path, opts, stats, tree)


def walk_files(root: str, opts: CorpusOptions, stats: CorpusStats) -> Iterator[str]:
    """Paths of the files under `root` with a wanted extension, in a deterministic order; nothing is read.
    Symlinks to directories are not followed (counted as symlinked_dir), so a link loop cannot recurse;
    _read_file later refuses symlinks to files outside `root` (symlink_outside); a directory that cannot be
    listed is counted as unreadable. Any depth is walked (walk_tree does not recurse); a path past PATH_MAX
    cannot be listed, so counts as unreadable."""
    exts = opts.extensions()

    def unlistable(e: OSError) -> None:
        stats.skip("unreadable", e.filename or root, opts.strict, f"directory not listed: {e.strerror or e}")

    for dirpath, dirnames, filenames in walk_tree(root, onerror=unlistable):
        dirnames.sort()  # deterministic order
        rel = os.path.relpath(dirpath, root)
        parts = () if rel == "." else tuple(Path(rel).parts)
        if any(p in VENDORED_DIRS for p in parts):
            n = sum(1 for name in filenames if os.path.splitext(name)[1] in exts)
            if n:
                stats.skipped["vendored"] += n
            continue
        for d in [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            dirnames.remove(d)
            if d not in VENDORED_DIRS:
                stats.skip("symlinked_dir", os.path.join(dirpath, d), False,
                           "directory symlinks are not followed; pass the target as another input")
        for name in sorted(filenames):
            if os.path.splitext(name)[1] not in exts:
                continue
            path = os.path.join(dirpath, name)
            if opts.exclude_tests and _is_test_path(parts + (name,)):
                stats.skip("test_file", path)
                continue
            yield path


def source_units(src: str, opts: CorpusOptions, stats: CorpusStats) -> Iterator[tuple[str, str | None, int]]:
    """The units one source is read in, in reading order, as (path, tree, bytes on disk): one per file of a
    walked directory (tree: the directory's real path), else the whole source (tree None). Nothing is read;
    read_unit reads one unit exactly as read_source would, so units split a corpus among tasks."""
    if not src.startswith("hf:") and os.path.isdir(src):
        tree = os.path.realpath(src)
        for path in walk_files(src, opts, stats):
            try:
                size = os.lstat(path).st_size
            except OSError:
                size = 0
            yield path, tree, size
    else:
        try:
            size = 0 if src.startswith("hf:") else os.stat(src).st_size
        except OSError:
            size = 0
        yield src, None, size


def read_unit(path: str, tree: str | None, opts: CorpusOptions, stats: CorpusStats,
              piece: dict | None = None) -> Iterator[Document]:
    """Raw documents of one unit of source_units; piece: a piece of a large JSONL or parquet input (plan
    time's data/pieces.py), read as that part of the whole file would be."""
    if tree is not None:
        yield from _read_file(path, opts, stats, tree)
    elif piece is not None:
        reader = _read_parquet if "groups" in piece else _read_jsonl
        yield from reader(path, opts, stats, piece)
    else:
        yield from read_source(path, opts, stats)


def record_kind(src: str) -> str | None:
    """How a single-file input that is not a directory is read: "jsonl" (also .gz, .zst), "parquet", or None
    (one whole file, one document). By its name as given, case and all."""
    if src.startswith("hf:"):
        return None
    if re.search(r"\.jsonl?(\.gz|\.zst)?$", src):
        return "jsonl"
    return "parquet" if src.endswith(".parquet") else None


def read_source(src: str, opts: CorpusOptions, stats: CorpusStats) -> Iterator[Document]:
    """Raw documents of one source, before text filters and dedup."""
    if src.startswith("hf:"):
        yield from _read_hf(src, opts, stats)
    elif os.path.isdir(src):
        yield from _walk(src, opts, stats)
    elif record_kind(src) == "jsonl":
        yield from _read_jsonl(src, opts, stats)
    elif record_kind(src) == "parquet":
        yield from _read_parquet(src, opts, stats)
    elif os.path.exists(src):
        yield from _read_file(src, opts, stats)
    else:
        stats.skip("vanished", src, opts.strict, "input disappeared before it was read")


# -- dedup -----------------------------------------------------------------------------------------------

class Deduper:
    """Exact dedup by content hash; `near` adds MinHash LSH over 5-word shingles (datasketch)."""

    def __init__(self, mode: str, threshold: float = 0.85, num_perm: int = 128):
        self.mode = mode
        self.seen: set[bytes] = set()
        if mode == "near":
            from datasketch import MinHashLSH
            self.num_perm = num_perm
            self.lsh = MinHashLSH(threshold=threshold, num_perm=num_perm)
            self.n = 0

    def reason(self, text: str, h: bytes) -> str | None:
        """'duplicate' / 'near_duplicate' if this text (content hash `h`) was seen before, else None."""
        if self.mode == "none":
            return None
        if h in self.seen:
            return "duplicate"
        self.seen.add(h)
        if self.mode == "near":
            from datasketch import MinHash
            words = text.split()
            shingles = {" ".join(words[i:i + 5]).encode() for i in range(max(1, len(words) - 4))}
            m = MinHash(num_perm=self.num_perm)
            m.update_batch(list(shingles))
            if self.lsh.query(m):
                return "near_duplicate"
            self.lsh.insert(str(self.n), m)
            self.n += 1
        return None


def content_hash(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest()


def split_of(digest: bytes, val_fraction: float) -> str:
    """'train' or 'val' from the content hash: a document never lands in both, and adding files never
    moves an existing document to the other split."""
    if val_fraction <= 0:
        return "train"
    return "val" if int.from_bytes(digest[:8], "big") / 2**64 < val_fraction else "train"


# a validation split of ~20k tokens: enough for a loss that moves by its noise less
VAL_LEAST_BYTES = 64 * 1024
VAL_MOST_SHARE = 0.1  # ... but never more than a tenth of a small corpus's bytes
VAL_LEAST_DOCS = 3  # and a few files, not one
# whole files are taken: never more than a quarter of the bytes (one large file can be most)
VAL_CAP_SHARE = 0.25
# ... unless the first file alone is over it: up to half, rather than no validation at all
VAL_ALONE_SHARE = 0.5


def sized_val_fraction(docs: list[tuple[bytes, int]], least: float) -> float:
    """The --val-fraction that gives a validation split of at least `least` of the documents and enough
    bytes to score on: min(VAL_LEAST_BYTES, VAL_MOST_SHARE of the corpus) and min(VAL_LEAST_DOCS, a tenth of
    the files, at least one), not past VAL_CAP_SHARE of the bytes (files are whole: one large file can be
    most of a small corpus; only `least` itself may take more, or the first file alone when it is at most
    VAL_ALONE_SHARE: one file of validation is better than none). docs: every document's (content hash,
    bytes), as split_of sees them. Large corpora keep `least`; a small repository gets a larger share, so
    its validation split is not one file of a few hundred tokens. The split stays split_of's rule (the
    documents whose hash falls below the fraction), so the same corpus always splits the same way."""
    if len(docs) < 2:
        return least
    ranked = sorted((int.from_bytes(d[:8], "big") / 2**64, n) for d, n in docs)
    total = sum(n for _, n in ranked)
    want_bytes = min(VAL_LEAST_BYTES, VAL_MOST_SHARE * total)
    want_docs = max(1, min(VAL_LEAST_DOCS, len(ranked) // 10))
    got, k = 0, 0
    while k < len(ranked) - 1 and (got < want_bytes or k < want_docs):
        if got + ranked[k][1] > VAL_CAP_SHARE * total:  # this whole file would take too much of the code
            break
        got += ranked[k][1]
        k += 1
    if k == 0 and ranked[0][1] <= VAL_ALONE_SHARE * total:  # over the cap alone, but no split at all is worse
        k = 1
    if k == 0:  # the first file alone is most of the code: the least share, however few files that gives
        return least
    a, b = ranked[k - 1][0], ranked[k][0]  # the last document taken and the next: the cut goes between
    cut = next((f for f in (round((a + b) / 2, d) for d in range(2, 18)) if a < f <= b), (a + b) / 2)
    return max(least, min(0.5, cut))


def scrub(text: str, source: str, opts: CorpusOptions) -> tuple[str, Counter]:
    """Secrets (opts.redact_secrets) and personal data (opts.redact_pii) replaced, with counts per kind."""
    found: Counter = Counter()
    if opts.redact_secrets:
        text, got = redact(text, source)
        found.update(got)
    if opts.redact_pii:
        text, got = redact_pii(text)
        found.update(got)
    return text, found


def iter_documents(paths: list[str], opts: CorpusOptions, stats: CorpusStats) -> Iterator[Document]:
    """Filtered, deduplicated documents of all sources, in a deterministic order."""
    opts.validate()
    check_sources(paths)
    dedup = Deduper(opts.dedup, opts.near_threshold)
    bench = benchmarks(opts.decontaminate) if opts.decontaminate else None
    # the report per step (stats.steps: documents and bytes in and out), in the order a document meets them
    steps = {"read": None, "quality filters": "quality", "deduplication": "dedup"}
    if bench is not None:
        steps["benchmarks out"] = "benchmark"
    if opts.redact_secrets or opts.redact_pii:
        steps["secrets replaced"] = "secrets"
    for name in steps:
        stats.steps.setdefault(name, [0, 0, 0, 0])
    for src in paths:
        for doc in read_source(src, opts, stats):
            stats.step("read", doc.nbytes, True)
            reason = reject_reason(doc.text, opts)
            stats.step("quality filters", doc.nbytes, not reason)
            if reason:
                stats.skip(reason, doc.source)
                continue
            doc.digest = content_hash(doc.text)
            reason = dedup.reason(doc.text, doc.digest)
            stats.step("deduplication", doc.nbytes, not reason)
            if not reason and bench is not None:
                reason = "benchmark" if bench.hit(doc.text) else None
                stats.step("benchmarks out", doc.nbytes, not reason)
            if reason:
                stats.skip(reason, doc.source)
                continue
            if opts.redact_secrets or opts.redact_pii:  # after the content hash: the split stays the file's
                text, found = scrub(doc.text, doc.source, opts)
                before = doc.nbytes
                if found:
                    stats.secrets.update(found)
                    doc = Document(text, doc.source, digest=doc.digest)
                stats.step("secrets replaced", before, True, doc.nbytes)
            stats.documents += 1
            stats.bytes += doc.nbytes
            yield doc
