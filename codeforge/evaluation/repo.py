"""`codeforge eval --repo DIR`: fill-in-the-middle on your own code, the way an editor asks for it.

The files of a repository the run is not known to have trained on (each file's content hash is looked up in
the run's record, RUN/trained_documents.npy: data/trained.py; they are called held-out only when that record
is complete, and otherwise what it does not know is said) become FIM cases of three kinds, chosen by a seeded
generator:
  line   one line of code, the rest of the file as prefix and suffix
  span   2-4 consecutive lines
  block  the body of a function or other block (the indented lines under a line ending in ":" or "{"), up to 8
Each request carries, like llama.vscode's `input_extra`, up to `context_files` other files of the repository
(same directory first) as repo-level context, laid out as llama-server lays them out (fim.repo_infill).

Each case may use as many tokens as its true middle plus 8 (so a model that writes it exactly is not cut short
by the budget), up to what a server allows a fill: llama-server's -n, which `--gguf` sets to an eighth of the
context (16 to 128; llama_server.infill_predict) and the run is held to alike; a fill is cut to the number of
lines of the true middle and scored by exact match (indentation counts; trailing spaces and blank end lines
do not), edit similarity (difflib's ratio of the two texts, 0-1) and whether the filled file still parses
(Python's compiler, tree-sitter for Go), per kind, per file and over files (each file alike: report.py, which
also writes every case to cases.jsonl and report.html). Greedy, so deterministic.

A data-like file (mostly literals: a table, a list of strings, the frames of a spinner; data_like) gives no
cases unless asked (data_files): every line of it is a case like the last, a test of recalling data rather
than writing code, and there are enough of them to outweigh the code files in a case average.

Three backends answer the same cases: a codeforge run (in process), a server's llama.cpp-style `/infill`
(llama-server on the exported GGUF, or `codeforge serve`), and an OpenAI-compatible `/v1/completions` that
takes `suffix` (no repo context: that API has no field for it). An endpoint's answer is read up to
MAX_REPLY_BYTES and REPLY_SECONDS (the whole request: connecting, status line, headers and body); one that is
not a JSON object with a text fill is an EvalError naming the url. A file or fill nested past what Python's
compiler takes does not parse (no case; a case counted as not parsing).
"""

from __future__ import annotations

import difflib
import http.client
import json
import os
import random
import re
import socket
import threading
import time
import urllib.error
import urllib.request

import torch

from ..checkpoint import find_checkpoint, load_model, read_config
from ..corpus import CorpusOptions, CorpusStats, content_hash, iter_documents
from ..data.shards import digest_key
from ..data.trained import trained_record
from ..device import choose_device, choose_precision
from ..engine import Engine, SamplingParams
from ..fim import fit_infill, infill_stop_ids, repo_infill
from ..syntax import guess_language, is_valid_syntax
from ..tokenizer import CodeTokenizer
from .llama_server import gguf_facts, infill_predict, running
from .lm import EvalError
from .report import KINDS, around, by_file, clean, dominant, summarize

# a target file longer than this is skipped (prefix and suffix are cut to the budget anyway)
MAX_FILE_CHARS = 12_000
CONTEXT_CHARS = 4_000  # of each other file sent as context
MAX_FILL = 256  # tokens a case may use at most
# An endpoint's answer is read up to this many bytes and this many seconds: a fill of MAX_FILL tokens, with
# the prompt llama-server echoes back (a few files of context), takes well under a MiB; a server that sends
# without end is cut off instead of filling memory.
MAX_REPLY_BYTES = 4 << 20
REPLY_SECONDS = 300.0


def repo_files(root: str) -> list[tuple[str, str]]:
    """(path relative to root, text) of every code file codeforge's readers take from root (its filters and
    bounds on hostile input apply)."""
    if not os.path.isdir(root):
        raise EvalError(f"--repo {root} is not a directory: give the root of a repository of code files")
    out = []
    for d in iter_documents([root], CorpusOptions(val_fraction=0.0, dedup="exact"), CorpusStats()):
        out.append((os.path.relpath(d.source, root), d.text))
    return out


def held_out(files: list[tuple[str, str]], run_dir: str | None) -> tuple[list[tuple[str, str]], int, bool]:
    """(files the run is not known to have trained on, how many were left out as trained on, whether the
    run's record is complete: only then are the files kept held out)."""
    if not run_dir:
        return files, 0, False
    record = trained_record(run_dir)  # every known key left out, complete or not
    keys = set(record.keys.tolist())
    kept = [(p, t) for p, t in files if digest_key(content_hash(t)) not in keys]
    return kept, len(files) - len(kept), record.complete


def split_lines(text: str) -> list[str]:
    """Lines ending in "\n" (their ends kept), and no other line break: str.splitlines also breaks at form
    feeds and U+2028, which a file's text may hold inside a line."""
    return [x for x in re.split(r"(?<=\n)", text) if x]


def _norm(text: str) -> str:
    """A fill or middle as compared: each line without trailing spaces, no blank lines at either end;
    indentation counts."""
    return "\n".join(line.rstrip() for line in text.split("\n")).strip("\n")


def parses(code: str, language: str) -> bool:
    """Python: the compiler's verdict (tree-sitter recovers from a wrongly indented line); Go: tree-sitter.
    Code nested deeper than the compiler goes does not parse."""
    if language == "python":
        try:
            compile(code, "<filled>", "exec", dont_inherit=True)
            return True
        # nesting past the compiler's limits: a RecursionError (a long chain of unary operators) or, from
        # the parser's own stack, a MemoryError; either way Python would not run the file
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return False
    try:
        return is_valid_syntax(code, language)
    except UnicodeEncodeError:  # a lone surrogate (JSON's "\ud800" in a fill): no file could hold it
        return False


# -- data-like files ----------------------------------------------------------------------------------------

# A file is data-like when at least DATA_SHARE of its lines that hold code or data hold data, and at least
# DATA_LINES do. Of the 19,488 Python files of this project's virtual environment, the 115 past both bounds
# and short enough to give cases (MAX_FILE_CHARS) are tables (unicode widths, colour palettes, stop words,
# constants, key maps); codeforge's own files are at most 0.62 (export/families.py, its key maps).
DATA_SHARE = 0.75
DATA_LINES = 24
_STRING = re.compile(r'"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'|`[^`\n]*`')
_NUMBER = re.compile(r"(?<![\w.])(?:0[xXoObB][0-9a-fA-F_]+|\d[\d_]*\.?\d*(?:[eE][+-]?\d+)?|\.\d+)[jJlLuUfF]*")
_WORD = re.compile(r"_*[^\W\d_]\w*")  # a name has a letter: `_/\_` is art
_LITERAL_WORDS = frozenset({"True", "False", "None", "true", "false", "nil", "null"})


def _line_is_data(line: str) -> bool | None:
    """True: a line of data (literals, with at most half as many names: `"⠋", "⠙",`, `0: {"a", "b"},`,
    `[1, 2, 3],`, or no name at all: ASCII art, a hex dump); False: a line of code; None: neither (blank,
    a comment, a lone bracket). A string with two or more spaces is prose (a message), counted as a name."""
    s = line.strip()
    if not s or s.startswith(("#", "//", "/*", "*")):
        return None
    literals = 0

    def literal(m: re.Match) -> str:
        nonlocal literals
        if m.group().count(" ") >= 2:
            return " w "
        literals += 1
        return " "
    s = _NUMBER.sub(literal, re.split(r"\s(?:#|//)", " " + _STRING.sub(literal, s))[0])
    names = 0
    for w in _WORD.findall(s):
        if w in _LITERAL_WORDS:
            literals += 1
        else:
            names += 1
    if names == 0:
        return True if literals or len("".join(s.split())) >= 4 else None
    return True if literals >= 2 * names and literals >= 2 else False


def literal_share(text: str) -> tuple[int, float]:
    """(lines of data, their share of the lines of code or data) in text."""
    kinds = [_line_is_data(x) for x in text.split("\n")]
    data, code = kinds.count(True), kinds.count(False)
    return data, data / max(1, data + code)


def data_like(text: str) -> float | None:
    """The share of data lines when text is a data-like file (DATA_SHARE and DATA_LINES), else None."""
    lines, share = literal_share(text)
    return share if lines >= DATA_LINES and share >= DATA_SHARE else None


def _block(lines: list[str], i: int) -> int:
    """The end (exclusive) of the block whose header is line i: at most 8 following lines indented deeper."""
    indent = len(lines[i]) - len(lines[i].lstrip())
    j = i + 1
    while j < len(lines) and j - i <= 8 and (not lines[j].strip()
                                             or len(lines[j]) - len(lines[j].lstrip()) > indent):
        j += 1
    while j > i + 1 and not lines[j - 1].strip():
        j -= 1
    return j


def repo_cases(files: list[tuple[str, str]], n: int, seed: int = 0, context_files: int = 4,
               data_files: bool = False) -> list[dict]:
    """Up to n cases of each kind from the files that parse: {"kind", "path", "line" (1-based, where the
    middle starts), "prefix", "middle", "suffix", "language", "data_like", "extra": [(path, text), ...]}.
    Data-like files give none unless data_files. A repository without data-like files gives the cases it
    gave before they were looked for (they are left out before the seeded generator is used)."""
    rng = random.Random(seed)
    usable = []
    for path, text in files:
        lang = guess_language(text)
        if len(text) > MAX_FILE_CHARS:
            continue
        is_data = data_like(text) is not None
        if (is_data and not data_files) or not parses(text, lang):
            continue
        lines = split_lines(text)
        code = [i for i in range(1, len(lines) - 1)
                if lines[i].strip() and not lines[i].lstrip().startswith(("#", "//"))]
        heads = [i for i in code if lines[i].rstrip().endswith((":", "{")) and _block(lines, i) > i + 1]
        if len(code) >= 4:
            usable.append((path, lines, code, heads, lang, is_data))
    rng.shuffle(usable)
    cases: list[dict] = []
    counts = dict.fromkeys(KINDS, 0)
    seen: set = set()
    for _ in range(4 * n):
        if not usable or all(c >= n for c in counts.values()):
            break
        for path, lines, code, heads, lang, is_data in usable:
            for kind in KINDS:
                if counts[kind] >= n:
                    continue
                if kind == "block":
                    if not heads:
                        continue
                    h = rng.choice(heads)
                    i, j = h + 1, _block(lines, h)
                else:
                    width = 1 if kind == "line" else rng.randint(2, 4)
                    i = rng.choice(code[:max(1, len(code) - width)])
                    j = min(i + width, len(lines) - 1)
                if (path, kind, i) in seen or j <= i:
                    continue
                seen.add((path, kind, i))
                counts[kind] += 1
                cases.append({"kind": kind, "path": path, "line": i + 1, "prefix": "".join(lines[:i]),
                              "middle": "".join(lines[i:j]), "suffix": "".join(lines[j:]), "language": lang,
                              "data_like": is_data, "extra": _context(path, files, context_files)})
    return cases


def _context(path: str, files: list[tuple[str, str]], k: int) -> list[tuple[str, str]]:
    """Up to k other files as repo-level context, those in the same directory first (as an editor's open
    and nearby files), each cut to its first CONTEXT_CHARS characters."""
    here = os.path.dirname(path)
    others = [(p, t) for p, t in files if p != path]
    others.sort(key=lambda pt: (os.path.dirname(pt[0]) != here, pt[0]))
    return [(p, t[:CONTEXT_CHARS]) for p, t in others[:k]]


# -- backends: (prefix, suffix, extra, max_new) -> the fill --------------------------------------------------

def engine_backend(engine, n_batch: int | None = None):
    """A codeforge run in process: the prompt codeforge serve's /infill builds (llama-server's), greedy."""
    tok, ctx = engine.tok, engine.block_size

    stops = infill_stop_ids(tok)

    n = infill_predict(ctx)

    def fill(prefix: str, suffix: str, extra, max_new: int) -> str:
        # the prompt llama-server lays out with -n n (what `--gguf` starts it with), and never more than n
        # tokens, as it allows; then the other files give way until the middle has room
        ids, _ = repo_infill(tok, prefix, suffix, extra, n_ctx=ctx, n_batch=n_batch or ctx // 2, n_predict=n)
        max_new = min(max_new, n)
        if len(ids) + max_new > ctx:
            ids = fit_infill(ids, ctx - max_new, tok.special_ids)
        out: list[int] = []
        p = SamplingParams(max_new_tokens=max_new, temperature=0.0)
        for step in engine.generate_ids([ids], p, warn=lambda m: None):
            t = step[0]
            if t is None or t in stops:
                break
            out.append(t)
        return tok.decode(out, skip_special=True)
    return fill


def _late(url: str) -> EvalError:
    return EvalError(f"{url} did not finish its answer within {REPLY_SECONDS:g} s; is the server "
                     f"overloaded, or not an /infill or completions server?")


def _read(r, url: str, limit: int, deadline: float) -> bytes:
    """An answer's body, at most `limit` bytes and until `deadline` (time.monotonic()): read a piece at a
    time (read1 returns what has come), so that a body that never ends, or trickles in, is cut off."""
    got: list[bytes] = []
    n = 0
    while True:
        if time.monotonic() > deadline:
            raise _late(url)
        piece = r.read1(65536)
        if not piece:
            return b"".join(got)
        n += len(piece)
        if n > limit:
            raise EvalError(f"{url} answered more than {limit:,} bytes (a fill takes a few KB): not an "
                            f"/infill or completions server, or one that sends without end")
        got.append(piece)


class _Deadline:
    """The whole of one request held to `seconds`: connecting, the status line, the headers and the body.
    A socket's timeout bounds each wait alone, and starts again with every byte, so a server that sends its
    status line or headers a byte at a time held the eval for as long as it liked; a timer shuts the
    connection down at the deadline instead, which ends any wait on it. It shuts down its own duplicate of
    each socket (the same connection), closed only once the request is over, so it never touches a
    descriptor the process has since reused."""

    def __init__(self, seconds: float):
        self.lock = threading.Lock()
        self.socks: list[socket.socket] = []
        self.passed = self.done = False
        self.timer = threading.Timer(seconds, self._expire)
        self.timer.daemon = True
        self.timer.start()

    def watch(self, sock: socket.socket) -> None:
        with self.lock:
            if self.done:
                return
            self.socks.append(sock.dup())
            if self.passed:
                self._shut(self.socks[-1])

    def _expire(self) -> None:
        with self.lock:
            if self.done:
                return
            self.passed = True
            for s in self.socks:
                self._shut(s)

    @staticmethod
    def _shut(s: socket.socket) -> None:
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def stop(self) -> None:
        self.timer.cancel()
        with self.lock:
            self.done = True
            for s in self.socks:
                s.close()
            self.socks.clear()


class _Watched:
    """An http.client connection whose socket a _Deadline watches from the moment it connects (before a
    proxy tunnel or TLS handshake, which it bounds too)."""

    def __init__(self, *args, deadline: _Deadline, **kwargs):
        super().__init__(*args, **kwargs)
        create = self._create_connection

        def create_watched(*a, **k):
            sock = create(*a, **k)
            deadline.watch(sock)
            return sock
        self._create_connection = create_watched


class _HTTP(_Watched, http.client.HTTPConnection):
    pass


class _HTTPS(_Watched, http.client.HTTPSConnection):
    pass


class _HTTPHandler(urllib.request.HTTPHandler):
    def __init__(self, deadline: _Deadline):
        super().__init__()
        self.deadline = deadline

    def http_open(self, req):
        return self.do_open(_HTTP, req, deadline=self.deadline)


class _HTTPSHandler(urllib.request.HTTPSHandler):
    def __init__(self, deadline: _Deadline):
        super().__init__()
        self.deadline = deadline

    def https_open(self, req):
        return self.do_open(_HTTPS, req, context=self._context, deadline=self.deadline)


def _post(url: str, body: dict, what: str) -> dict:
    """The JSON object a server answers to `body`; every way it can fail is an EvalError naming the url,
    once, within REPLY_SECONDS of asking."""
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    deadline = time.monotonic() + REPLY_SECONDS
    watch = _Deadline(REPLY_SECONDS)
    try:
        opener = urllib.request.build_opener(_HTTPHandler(watch), _HTTPSHandler(watch))
        # the timer bounds the whole request; the socket's timeout each wait; _read's check, the body too
        with opener.open(req, timeout=REPLY_SECONDS) as r:
            data = _read(r, url, MAX_REPLY_BYTES, deadline)
    except EvalError:
        raise  # _read's own, already naming the url and the cause
    except urllib.error.HTTPError as e:
        try:
            detail = _read(e, url, 2000, deadline).decode(errors="replace")[:500]
        except (EvalError, OSError, AttributeError, http.client.HTTPException):
            detail = "(no readable body)"
        if watch.passed:
            raise _late(url) from None
        raise EvalError(f"{url} answered HTTP {e.code} to {what}: {detail}") from None
    except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException) as e:
        if watch.passed:  # the timer's shutdown, seen as a connection closed mid-answer
            raise _late(url) from None
        raise EvalError(f"{url}: {e}; is the server running there?") from None
    finally:
        watch.stop()
    if watch.passed:  # a body without a length, ended by the shutdown: cut short, not whole
        raise _late(url)
    try:
        out = json.loads(data)
    except RecursionError:
        raise EvalError(f"{url} answered {what} with text that is not JSON it can read (nested too "
                        f"deeply): not an /infill or completions server") from None
    except ValueError as e:  # UnicodeDecodeError included
        raise EvalError(f"{url} answered {what} with text that is not JSON ({e}): not an /infill or "
                        f"completions server") from None
    if not isinstance(out, dict):
        raise EvalError(f"{url} answered {what} with {type(out).__name__}, not a JSON object: not an /infill "
                        f"or completions server")
    return out


def infill_backend(url: str):
    """A server's llama.cpp-style /infill (llama-server on a GGUF, or codeforge serve), greedy."""
    url = url.rstrip("/") + "/infill"

    def fill(prefix: str, suffix: str, extra, max_new: int) -> str:
        try:
            r = _post(url,
                      {"input_prefix": prefix, "input_suffix": suffix, "n_predict": max_new, "temperature": 0,
                            "top_k": 1, "seed": 0, "cache_prompt": False,
                            "input_extra": [{"filename": p, "text": t} for p, t in extra]}, "/infill")
        except EvalError as e:
            # llama-server's and codeforge serve's words for a model without FIM
            if "not supported" in str(e).lower():
                raise EvalError(f"{e}\nthe model it serves has no fill-in-the-middle tokens: export the run "
                                "again with `codeforge export --run RUN --format gguf` (it writes their ids) "
                                "from a run whose tokenizer has them, "
                                "or score the run itself with --run") from None
            raise
        if "content" not in r:
            raise EvalError(f"{url} answered without `content`: not llama.cpp's /infill")
        if not isinstance(r["content"], str):
            raise EvalError(f"{url} answered `content` that is {type(r['content']).__name__}, not text: not "
                            f"llama.cpp's /infill")
        return r["content"]
    return fill


def completions_backend(url: str, model: str | None):
    """An OpenAI-compatible /v1/completions with `suffix` (no repo context: the API has no field for it)."""
    base = url.rstrip("/")
    url = base + ("/completions" if base.endswith("/v1") else "/v1/completions")

    def fill(prefix: str, suffix: str, extra, max_new: int) -> str:
        body = {"prompt": prefix, "suffix": suffix, "max_tokens": max_new, "temperature": 0}
        if model:
            body["model"] = model
        try:
            r = _post(url, body, "a completion with `suffix`")
        except EvalError as e:
            if "suffix" in str(e).lower():
                raise EvalError(f"{e}\nthis endpoint does not take `suffix` (fill-in-the-middle); use its "
                                f"/infill with --endpoint-api infill, or another server") from None
            raise
        try:
            text = r["choices"][0]["text"]
        except (KeyError, IndexError, TypeError):
            raise EvalError(
                f"{url} answered without choices[0].text: not an OpenAI completions endpoint") from None
        if not isinstance(text, str):
            raise EvalError(f"{url} answered choices[0].text that is {type(text).__name__}, not text: not an "
                            f"OpenAI completions endpoint")
        return text
    return fill


def fill_cases(fill, cases: list[dict], max_new: int = 64, with_context: bool = True) -> list[dict]:
    """Each case filled and scored, one record each (report.py writes them to cases.jsonl): file, line,
    kind, language, expected, got (the fill as scored: cut to the middle's number of lines), exact, edit
    similarity, parses, with_context, data_like, budget and the lines around the gap."""
    records = []
    for i, c in enumerate(cases):
        budget = c.get("budget", max_new)
        got = fill(c["prefix"], c["suffix"], c["extra"] if with_context else [], budget)
        want_lines = c["middle"].count("\n") or 1
        got = "".join(split_lines(got)[:want_lines])
        if c["middle"].endswith("\n") and not got.endswith("\n"):
            got += "\n"
        records.append({
            "case": i, "file": clean(c["path"]), "line": c.get("line", c["prefix"].count("\n") + 1),
            "kind": c["kind"], "language": c["language"], "with_context": with_context,
            "expected": clean(c["middle"]), "got": clean(got),
            "exact": _norm(got) == _norm(c["middle"]),
            "edit_similarity": difflib.SequenceMatcher(None, _norm(got), _norm(c["middle"])).ratio(),
            "parses": parses(c["prefix"] + got + c["suffix"], c["language"]),
            "data_like": bool(c.get("data_like")), "budget": budget, **around(c["prefix"], c["suffix"])})
    return records


def score_repo(fill, cases: list[dict], max_new: int = 64, with_context: bool = True) -> dict:
    """Exact match, edit similarity and syntax validity per kind, over all cases and over files (each file
    alike)."""
    return summarize(fill_cases(fill, cases, max_new, with_context))


def run_repo_eval(repo: str, run: str | None = None, endpoint: str | None = None, api: str = "infill",
                  model: str | None = None, n: int = 20, context_files: int = 4, seed: int = 0,
                  max_new: int = MAX_FILL,
                  device: str = "auto", which: str = "auto", both: bool = False, gguf: str | None = None,
                  llama_server: str | None = None, log=print, cap: int | None = None,
                  data_files: bool = False, records: list[dict] | None = None) -> dict:
    """Everything `eval --repo` reports. both: score with and without the repository context. gguf: start
    llama.cpp's llama-server on that file (binary: llama_server, or as evaluation/llama_server.py finds it)
    and score it through its /infill; a run given beside it or an endpoint only says which files are held out.
    cap: tokens a fill may take at most (the server's -n; by default infill_predict of the run's context).
    data_files: data-like files give cases too (marked). records: a list that gets every case's record, of
    each pass (fill_cases), for report.write_report; the result itself stays small enough for eval.jsonl."""
    if gguf:
        if endpoint:
            raise EvalError("--gguf FILE starts its own llama-server: give it or --endpoint URL, not both")
        with running(gguf, llama_server, log=log) as url:
            r = run_repo_eval(repo, run, url, "infill", None, n, context_files, seed, max_new, device, which,
                              both, cap=infill_predict(gguf_facts(gguf)["context"] or 2048),
                              data_files=data_files, records=records)
        return {**r, "backend": f"llama-server {gguf}"}
    if n < 1 or context_files < 0:
        raise EvalError(f"--repo-cases {n} / --repo-context {context_files}: give at least 1 case of each "
                        f"kind and 0 or more other files")
    files = repo_files(repo)
    run_dir = ck = None
    if run:
        ck = find_checkpoint(run, which)
        run_dir = str(ck.parent.parent)
    kept, trained_on, checked = held_out(files, run_dir)
    if not files:
        raise EvalError(f"--repo {repo}: no code files found (Go, Python and other languages by extension)")
    if not kept:
        raise EvalError(f"--repo {repo}: all {len(files)} files were in the run's training data, so no score "
                        f"on them would be honest; give a directory of files it never trained on (its "
                        f"validation files, or code written since)")
    cases = repo_cases(kept, n, seed, context_files, data_files)
    # the data-like files among those that could give cases (a longer file gives none anyway)
    data = {p: s for p, t in kept if len(t) <= MAX_FILE_CHARS and (s := data_like(t)) is not None}
    if not cases:
        left = (f"; {len(data)} data-like file(s) left out: --repo-data-files scores them too"
                if data and not data_files else "")
        raise EvalError(f"--repo {repo}: none of its {len(kept)} held-out files gives a case (files that "
                        f"parse, with 4+ lines of code, up to {MAX_FILE_CHARS:,} characters; Go and Python)"
                        f"{left}")
    if endpoint:
        # the run's tokenizer where there is one: the budgets of scoring the run itself, so the numbers
        # compare; without one, about 2 bytes a token, generous for code
        tok = (
            CodeTokenizer.load(ck / "tokenizer")
            if ck and (ck / "tokenizer" / "tokenizer.json").exists()
            else None
        )
        if cap is None and ck is not None:
            cap = infill_predict(read_config(ck)["model"]["block_size"])
        for c in cases:
            need = len(tok.encode(c["middle"])) if tok else len(c["middle"].encode()) // 2
            c["budget"] = min(MAX_FILL, need + 8, cap or MAX_FILL)
        fill = infill_backend(endpoint) if api == "infill" else completions_backend(endpoint, model)
        if api != "infill":
            context_files, both = 0, False
    else:
        dev, _ = choose_device(device)
        mdl, tok, ck, cfg = load_model(run, dev, which)
        precision, _ = choose_precision(dev, cfg.get("train", {}).get("precision", "auto"))
        for c in cases:
            c["budget"] = min(MAX_FILL, len(tok.encode(c["middle"])) + 8, infill_predict(mdl.context_length))
        fill = engine_backend(Engine(mdl, tok, dev, precision))
    r = {"repo": str(repo), "files": len(files), "held_out_files": len(kept), "trained_on_files": trained_on,
         "held_out_checked": checked, "cases": len(cases), "context_files": context_files, "seed": seed,
         "backend": endpoint and f"{api} {endpoint}" or f"run {run}", "run_dir": run_dir,
         "data_files": "scored" if data_files else "left out",
         "data_like_files": {clean(p): s for p, s in sorted(data.items())}}
    # what the run's record cannot say (None: nothing, so the files kept are held out; or no run at all)
    r["held_out_unknown"] = trained_record(run_dir).unknown if run_dir else None
    with torch.no_grad():
        lead = fill_cases(fill, cases, max_new, with_context=context_files > 0)
        second = fill_cases(fill, cases, max_new, with_context=False) if both and context_files else []
    r["scores"] = summarize(lead)
    if second:
        r["scores_without_context"] = summarize(second)
    r["scores_by_file"] = by_file(lead)
    r["dominant_files"] = dominant(lead)
    if records is not None:
        records.extend(lead + second)
    return r
