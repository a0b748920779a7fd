"""Preference pairs for DPO-style training: a real function (chosen) against a broken copy of it (rejected).

Pairs come from two places:

* a code corpus (`mine_pairs`, `write_pairs`): the documented Go and Python functions `mining/sft.py` finds,
  each asked for by the same request the SFT miner writes, answered by the real function (chosen) and by a
  mutated copy (rejected);
* code tasks with tests (`pairs_from_tasks`, `check_pairs_by_tests`): the reference solution against
  mutated solutions, kept only when the tests tell them apart, run in `codeforge.sandbox`.

and users bring their own (`load_pairs`), in the usual JSONL shapes.

Mutations (`mutate`) edit the source at byte offsets of tree-sitter nodes, so an edit never lands inside a
string literal or a comment (those subtrees are never searched, f-string interpolations included):

* `syntax`: damage a careful reader spots at once: drop a closing `)`, `]` or `}`, a Python block colon,
  or a string's closing quote. The result must NOT parse (tree-sitter finds an error).
* `operator`: swap one operator of a binary, comparison, boolean or augmented-assignment node: + and -,
  * and /, // to /, < and <=, > and >=, == and !=, and/or, && and ||, += and -=. Operators with a string
  literal operand are left alone (`"a" - "b"` is not a plausible slip), and so are the relational operators
  of loop conditions, which belong to `off_by_one`.
* `off_by_one`: a decimal integer literal n becomes n+1 or n-1; the stop of a Python `range(...)` gets
  ` + 1` or ` - 1`; < becomes <= (and back, and > / >=) in a `while` or Go `for` condition.
* `dropped_branch`: remove an `else`/`elif` clause, an `if` statement that has none, or an early `return`
  (any return that is not the last statement of its function's body). Python gets `pass` where a block
  would be left empty.

A semantic variant (every kind but `syntax`) must still parse and must differ from the original in
structure, not only in layout: for Python `ast.dump(ast.parse(...))` of the two must differ, for Go the
pre-order sequence of tree-sitter (node type, leaf text) with comments left out. That proves the code
changed, not that its behaviour did (`x - 1 + 1` differs from `x` in structure only); `check_pairs_by_tests`
is the behavioural filter where tests exist.

Every choice is drawn from a `random.Random` seeded from (seed, hash of the function's code), so the pairs
depend only on the inputs, and the train/held-out split is the SFT miner's content-hash rule, so a function
and its pairs stay in one split when files are added.
"""

from __future__ import annotations

import ast
import inspect
import json
import random
import re
import warnings
from collections import Counter, defaultdict
from pathlib import Path

from .. import CodeforgeError
from ..atomic import output_dir, write_splits
from ..chat import ROLES
from ..corpus import (MAX_LINE_CHARS, CorpusOptions, CorpusStats, bounded_lines, content_hash,
                      long_line_detail, open_text, split_of)
from ..sandbox import run_many
from ..syntax import parser
from ..tasks.code_tasks import load_tasks
from .functions import LANG_NAME, MineError, mined_files
from .sft import conversation

KINDS = ("syntax", "operator", "off_by_one", "dropped_branch")
SEMANTIC_KINDS = KINDS[1:]
PER_KIND = 2  # variants of each kind `mutate` returns: enough to pick from, cheap to validate
SPLITS = ("train", "heldout")

# Operator swaps: each a slip that keeps the code well-formed and usually changes what it computes.
SWAPS = {"+": "-", "-": "+", "*": "/", "/": "*", "//": "/", "<": "<=", "<=": "<", ">": ">=", ">=": ">",
         "==": "!=", "!=": "==", "and": "or", "or": "and", "&&": "||", "||": "&&", "+=": "-=", "-=": "+="}
RELATIONAL = {"<": "<=", "<=": "<", ">": ">=", ">=": ">"}
OPERATOR_PARENTS = {"python": {"binary_operator", "comparison_operator", "boolean_operator",
                               "augmented_assignment"},
                    "go": {"binary_expression", "assignment_statement"}}
# Subtrees never searched for edit sites: text, not code.
OPAQUE = {"python": {"string", "comment", "concatenated_string"},
          "go": {"interpreted_string_literal", "raw_string_literal", "rune_literal", "comment"}}
STRING_TYPES = {"python": {"string", "concatenated_string"},
                "go": {"interpreted_string_literal", "raw_string_literal"}}
INTEGER = {"python": "integer", "go": "int_literal"}
FUNCTIONS = {"python": {"function_definition"},
             "go": {"function_declaration", "method_declaration", "func_literal"}}
PY_COLON_OWNERS = {"function_definition", "class_definition", "if_statement", "elif_clause", "else_clause",
                   "for_statement", "while_statement", "try_statement", "except_clause", "finally_clause",
                   "with_statement"}
PY_RANGE_STOPS = {"identifier", "call", "attribute", "subscript", "parenthesized_expression",
                  "binary_operator"}
DECIMAL = re.compile(rb"0|[1-9][0-9]*")
GO_PREFIX = b"package p\n\n"  # is_valid_syntax's rule: a lone Go function parses inside a package clause


class PairError(CodeforgeError):
    """A preference-pair file that cannot be used; the message names the file, the line and the problem.
    `reason` is the short name bad rows are counted under when they are skipped."""

    def __init__(self, message: str, reason: str = "unusable"):
        super().__init__(message)
        self.reason = reason


# -- parsing ---------------------------------------------------------------------------------------------

_PARSERS: dict[str, object] = {}


def _parse(src: bytes, language: str):
    if language not in _PARSERS:
        _PARSERS[language] = parser(language)
    return _PARSERS[language].parse(src).root_node


def _prefix(code: str, language: str) -> bytes:
    return GO_PREFIX if language == "go" and not code.lstrip().startswith("package") else b""


def _tree_ok(code: str, language: str) -> bool:
    """is_valid_syntax, with a cached parser (mutate checks many variants)."""
    return not _parse(_prefix(code, language) + code.encode("utf-8"), language).has_error


def _structure(code: str, language: str) -> str | tuple | None:
    """What two variants must differ in to count as different code, or None when `code` does not parse:
    Python's AST dump (tree-sitter must accept it too), Go's pre-order (type, leaf text) without comments."""
    if not _tree_ok(code, language):
        return None
    if language == "python":
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # SyntaxWarning for odd escapes, `is` with a literal
                return ast.dump(ast.parse(code))
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return None
    out: list[tuple[str, str]] = []
    stack = [_parse(_prefix(code, language) + code.encode("utf-8"), language)]
    while stack:
        node = stack.pop()
        if node.type == "comment":
            continue
        out.append((node.type, "" if node.child_count else node.text.decode("utf-8", "replace")))
        stack.extend(reversed(node.children))
    return tuple(out)


class _Source:
    """One function's bytes and tree; edits are (start, end, replacement) in these bytes."""

    def __init__(self, code: str, language: str):
        self.language = language
        self.prefix = _prefix(code, language)
        self.src = self.prefix + code.encode("utf-8")
        self.root = _parse(self.src, language)
        self.nodes = list(self._code_nodes())

    def _code_nodes(self):
        """Pre-order nodes outside strings and comments (the string and comment nodes themselves included)."""
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            if node.type not in OPAQUE[self.language]:
                stack.extend(reversed(node.children))

    def apply(self, edit: tuple[int, int, bytes]) -> str:
        a, b, new = edit
        return (self.src[:a] + new + self.src[b:])[len(self.prefix):].decode("utf-8")

    def lines_of(self, node) -> tuple[int, int] | None:
        """The byte span of the whole lines `node` fills (its trailing comment included), or None when it
        shares a line with other code."""
        start = self.src.rfind(b"\n", 0, node.start_byte) + 1
        if self.src[start:node.start_byte].strip():
            return None
        end = self.src.find(b"\n", node.end_byte)
        end = len(self.src) if end < 0 else end + 1
        rest = self.src[node.end_byte:end].strip()
        if rest and not rest.startswith(b"#" if self.language == "python" else b"//"):
            return None
        return start, end

    def drop_statement(self, node) -> tuple[int, int, bytes]:
        """Remove a statement: its lines when it has them to itself, else its span; Python keeps a `pass`
        where the block would be left empty."""
        if self.language == "python":
            siblings = [c for c in node.parent.named_children if c.type != "comment"]
            if len(siblings) == 1:
                return node.start_byte, node.end_byte, b"pass"
        span = self.lines_of(node)
        if span is not None:
            return span[0], span[1], b""
        return node.start_byte, node.end_byte, b"pass" if self.language == "python" else b""


def _is_string(node, language: str) -> bool:
    return node.type in STRING_TYPES[language]


def _stringish(node, language: str) -> bool:
    """A string literal, or a + chain or parenthesis holding one: `"a" + b + c` is text concatenation."""
    if _is_string(node, language):
        return True
    if node.type in ("parenthesized_expression", "expression_list", "binary_operator", "binary_expression"):
        op = node.child_by_field_name("operator")
        if node.type.startswith("binary") and (op is None or op.type != "+"):
            return False
        return any(_stringish(c, language) for c in node.named_children if c.type != "comment")
    return False


# -- edit sites, by kind ---------------------------------------------------------------------------------
# Each returns [(subkind, edit)]: subkinds ("bracket", "colon", ...) are interleaved so that a function with
# forty parentheses and one colon still gets a colon variant now and then.

def _syntax_edits(s: _Source) -> list[tuple[str, tuple]]:
    out = []
    for n in s.nodes:
        if not n.is_named and n.type in (")", "]", "}"):
            out.append(("bracket", (n.start_byte, n.end_byte, b"")))
        elif (
            s.language == "python"
            and n.type == ":"
            and n.parent is not None
            and n.parent.type in PY_COLON_OWNERS
        ):
            out.append(("colon", (n.start_byte, n.end_byte, b"")))
        elif _is_string(n, s.language) and n.type != "concatenated_string" and n.child_count:
            close = n.children[-1]  # string_end (Python), `"` or `` ` `` (Go)
            if not close.is_named or close.type == "string_end":
                out.append(("quote", (close.start_byte, close.end_byte, b"")))
    return out


def _loop_conditions(s: _Source) -> list:
    """Condition nodes of loops: Python `while`, Go `for cond {}` and `for init; cond; post {}`."""
    out = []
    for n in s.nodes:
        if n.type == "while_statement" and s.language == "python":
            out.append(n.child_by_field_name("condition"))
        elif n.type == "for_clause":
            out.append(n.child_by_field_name("condition"))
        elif n.type == "for_statement" and s.language == "go":
            out += [c for c in n.named_children
                    if c.type not in ("for_clause", "range_clause", "block", "comment")]
    return [c for c in out if c is not None]


def _relational_in(cond, language: str) -> list:
    """Relational operator tokens inside a loop condition (not inside strings or nested functions)."""
    found, stack = [], [cond]
    while stack:
        n = stack.pop()
        if n.type in OPAQUE[language] or n.type in ("lambda", "func_literal"):
            continue
        if not n.is_named and n.type in RELATIONAL and n.parent.type in OPERATOR_PARENTS[language]:
            found.append(n)
        stack.extend(n.children)
    return found


def _operator_edits(s: _Source) -> list[tuple[str, tuple]]:
    in_loops = {n.start_byte for c in _loop_conditions(s) for n in _relational_in(c, s.language)}
    out = []
    for n in s.nodes:
        if (
            n.is_named
            or n.type not in SWAPS
            or n.parent is None
            or n.parent.type not in OPERATOR_PARENTS[s.language]
        ):
            continue
        if n.type in RELATIONAL and n.start_byte in in_loops:
            continue  # off_by_one's
        if any(_stringish(c, s.language) for c in n.parent.named_children):
            continue
        out.append((n.type, (n.start_byte, n.end_byte, SWAPS[n.type].encode())))
    return out


def _off_by_one_edits(s: _Source, rng: random.Random) -> list[tuple[str, tuple]]:
    out = []
    for n in s.nodes:
        if n.type == INTEGER[s.language] and DECIMAL.fullmatch(n.text):
            v = int(n.text)
            new = v + 1 if v == 0 or rng.random() < 0.5 else v - 1
            out.append(("literal", (n.start_byte, n.end_byte, str(new).encode())))
        elif s.language == "python" and n.type == "call" and n.child_by_field_name("function") is not None \
                and n.child_by_field_name("function").text == b"range":
            args = [c for c in n.child_by_field_name("arguments").named_children if c.type != "comment"]
            if not 1 <= len(args) <= 3 or any(a.type in ("keyword_argument", "list_splat") for a in args):
                continue
            stop = args[0] if len(args) == 1 else args[1]
            if stop.type not in PY_RANGE_STOPS:
                continue  # a literal is the literal rule's; `a or b` would bind the wrong way
            if stop.type == "binary_operator" and stop.child_by_field_name("operator").type in ("+", "-") \
                    and stop.child_by_field_name("right").type == "integer":
                continue  # `n - 1`: the literal rule changes it; appending would undo it (`n - 1 + 1`)
            out.append(("range", (stop.end_byte, stop.end_byte, rng.choice((b" + 1", b" - 1")))))
    for cond in _loop_conditions(s):
        for op in _relational_in(cond, s.language):
            out.append(("loop_bound", (op.start_byte, op.end_byte, RELATIONAL[op.type].encode())))
    return out


def _enclosing_function(node, language: str):
    p = node.parent
    while p is not None and p.type not in FUNCTIONS[language]:
        p = p.parent
    return p


def _last_statement(fn):
    body = fn.child_by_field_name("body")
    if body is None:
        return None
    lists = [c for c in body.named_children if c.type == "statement_list"]  # Go wraps statements in one
    stmts = [c for c in (lists[0] if lists else body).named_children if c.type != "comment"]
    return stmts[-1] if stmts else None


def _dropped_branch_edits(s: _Source) -> list[tuple[str, tuple]]:
    out = []
    for n in s.nodes:
        if n.type == "if_statement" and s.language == "python":
            clauses = [c for c in n.named_children if c.type in ("elif_clause", "else_clause")]
            for c in clauses:
                span = s.lines_of(c)
                if span is not None:
                    out.append((c.type, (span[0], span[1], b"")))
            if not clauses:
                out.append(("if", s.drop_statement(n)))
        elif n.type == "if_statement":  # Go: `if c {...} else ...`
            alt, cons = n.child_by_field_name("alternative"), n.child_by_field_name("consequence")
            if alt is not None and cons is not None:
                out.append(("else", (cons.end_byte, alt.end_byte, b"")))
            elif alt is None and n.parent is not None and n.parent.type != "if_statement":
                out.append(("if", s.drop_statement(n)))
        elif n.type == "return_statement":
            fn = _enclosing_function(n, s.language)
            if fn is not None and _last_statement(fn) is not None and n != _last_statement(fn):
                out.append(("return", s.drop_statement(n)))
    return out


def _interleave(cands: list[tuple[str, tuple]], rng: random.Random) -> list[tuple]:
    """Edits in a random order that takes each subkind in turn: shuffled within a subkind, subkinds in a
    shuffled order, round robin."""
    groups: dict[str, list] = defaultdict(list)
    for sub, edit in cands:
        groups[sub].append(edit)
    order = sorted(groups)
    rng.shuffle(order)
    for sub in order:
        rng.shuffle(groups[sub])
    out = []
    for i in range(max((len(g) for g in groups.values()), default=0)):
        out += [groups[sub][i] for sub in order if i < len(groups[sub])]
    return out


def _check_kinds(kinds) -> tuple[str, ...]:
    if kinds is None:
        return KINDS
    if isinstance(kinds, str) or not kinds or any(k not in KINDS for k in kinds):
        raise MineError(f"kinds {kinds!r}: give a non-empty list drawn from {', '.join(KINDS)}")
    return tuple(kinds)


def mutate(code: str, language: str, rng: random.Random, kinds: list[str] | tuple[str, ...] | None = None,
           per_kind: int = PER_KIND) -> list[tuple[str, str]]:
    """Broken copies of one Go or Python function (or program) as [(kind, code)], at most `per_kind` of each
    kind in `kinds` (default: all of KINDS), in KINDS order, all distinct.

    Candidate edits are tried in an order drawn from `rng`; a `syntax` variant is kept only when it does
    not parse, any other only when it parses and differs from `code` in structure (module docstring). An
    original that does not parse itself gives no variants.
    """
    kinds = _check_kinds(kinds)
    if per_kind < 1:
        raise MineError(f"per_kind {per_kind} must be >= 1")
    if language not in LANG_NAME:
        raise MineError(f"cannot mutate code of language {language!r}: only {sorted(LANG_NAME)}")
    original = _structure(code, language)
    if original is None:
        return []
    s = _Source(code, language)
    seen = {code}
    out: list[tuple[str, str]] = []
    for kind in KINDS:
        if kind not in kinds:
            continue
        if kind == "syntax":
            cands = _syntax_edits(s)
        elif kind == "operator":
            cands = _operator_edits(s)
        elif kind == "off_by_one":
            cands = _off_by_one_edits(s, rng)
        else:
            cands = _dropped_branch_edits(s)
        found = 0
        for edit in _interleave(cands, rng):
            if found >= per_kind:
                break
            variant = s.apply(edit)
            if variant in seen:
                continue
            if kind == "syntax":
                ok = not _tree_ok(variant, language)
            else:
                changed = _structure(variant, language)
                ok = changed is not None and changed != original
            if ok:
                seen.add(variant)
                out.append((kind, variant))
                found += 1
    return out


def _spread(variants: list[tuple[str, str]], n: int, rng: random.Random) -> list[tuple[str, str]]:
    """Up to n variants, one kind after another: the kinds present in a random order, round robin."""
    by_kind: dict[str, list] = defaultdict(list)
    for v in variants:
        by_kind[v[0]].append(v)
    order = sorted(by_kind)
    rng.shuffle(order)
    out: list[tuple[str, str]] = []
    while len(out) < n and any(by_kind.values()):
        for k in order:
            if by_kind[k] and len(out) < n:
                out.append(by_kind[k].pop(0))
    return out


# -- mining a corpus -------------------------------------------------------------------------------------

def _row(request: str, chosen: str, rejected: str, meta: dict) -> dict:
    return {"prompt": [{"role": "user", "content": request}],
            "chosen": [{"role": "assistant", "content": chosen}],
            "rejected": [{"role": "assistant", "content": rejected}], "meta": meta}


def mine_pairs(sources: list[str], languages: list[str] | None = None, max_pairs: int = 0,
               heldout_fraction: float = 0.05, seed: int = 0, max_chars: int = 4000, per_function: int = 1,
               kinds: list[str] | None = None,
               exclude_tests: bool = True) -> tuple[list[dict], list[dict], dict]:
    """(train, heldout, stats) preference pairs mined from `sources` (paths as `codeforge.corpus` reads
    them), in the conversational shape:

        {"prompt": [{"role": "user", "content": REQUEST}], "chosen": [{"role": "assistant", "content": REAL}],
         "rejected": [{"role": "assistant", "content": BROKEN}],
         "meta": {"kind", "language", "source", "name"}}

    Functions, requests, dedup and the split are the SFT miner's (`mining/sft.mine_sft`); each function gives
    up to `per_function` pairs with different broken copies, spread over the mutation `kinds` (default all).
    `max_pairs` (0: no limit) caps train + heldout; reading stops there. stats is {"files", "functions",
    "pairs", "train", "heldout", "kinds": {kind: pairs}, "skipped": {reason: functions}, "corpus_skipped"};
    reasons are the SFT miner's plus `unparseable` (Python's own parser refuses it) and `no_mutation`.
    """
    for lang in languages or []:
        if lang not in LANG_NAME:
            raise MineError(f"--languages {lang!r}: only {', '.join(sorted(LANG_NAME))} can be mined")
    if not 0.0 <= heldout_fraction < 1.0:
        raise MineError(f"heldout_fraction {heldout_fraction} must be in [0, 1)")
    if max_pairs < 0 or max_chars <= 0 or per_function < 1:
        raise MineError(f"max_pairs {max_pairs} must be >= 0, max_chars {max_chars} > 0 and per_function "
                        f"{per_function} >= 1")
    kinds = _check_kinds(kinds)
    # mined from code with its secrets replaced and benchmark copies left out, as `prepare` does
    opts = CorpusOptions(languages=languages or ["go", "python"], exclude_tests=exclude_tests, dedup="exact",
                         val_fraction=0.0, redact_secrets=True, decontaminate=["humaneval"])
    cstats = CorpusStats()
    skipped: Counter = Counter()
    by_kind: Counter = Counter()
    seen: set[bytes] = set()
    train: list[dict] = []
    heldout: list[dict] = []
    counts: Counter = Counter()  # files, functions

    def full() -> bool:
        return bool(max_pairs) and len(train) + len(heldout) >= max_pairs

    for doc, language, found in mined_files(sources, opts, cstats, skipped, counts):
        for fn in found:
            if full():
                break
            if len(fn["code"]) > max_chars:
                skipped["too_long"] += 1
                continue
            digest = content_hash(fn["code"])
            if digest in seen:
                skipped["duplicate"] += 1
                continue
            seen.add(digest)
            if _structure(fn["code"], language) is None:
                skipped["unparseable"] += 1
                continue
            rng = random.Random(f"{seed}:pref:{digest.hex()}")
            variants = _spread(mutate(fn["code"], language, rng, kinds), per_function, rng)
            if not variants:
                skipped["no_mutation"] += 1
                continue
            request = conversation(fn, language, doc.source, digest, seed)["messages"][0]["content"]
            split = heldout if split_of(digest, heldout_fraction) == "val" else train
            for kind, broken in variants:
                if full():
                    break
                split.append(_row(request, fn["code"], broken, {"kind": kind, "language": language,
                                                                 "source": doc.source, "name": fn["name"]}))
                by_kind[kind] += 1
        if full():
            break
    stats = {"files": counts["files"], "functions": counts["functions"],
             "pairs": len(train) + len(heldout), "train": len(train),
             "heldout": len(heldout), "kinds": {k: by_kind[k] for k in KINDS if by_kind[k]},
             "skipped": dict(sorted(skipped.items())), "corpus_skipped": dict(sorted(cstats.skipped.items()))}
    return train, heldout, stats


def write_pairs(sources: list[str], out_dir: str | Path, overwrite: bool = False, **options) -> dict:
    """Mine `sources` (options as in `mine_pairs`) into out_dir/{train,heldout}.jsonl and meta.json, written
    aside and renamed into place (codeforge.atomic). Returns the stats."""
    out = output_dir(out_dir, overwrite, MineError)
    try:
        bound = inspect.signature(mine_pairs).bind(sources, **options)  # a bad option fails before mining
    except TypeError as e:
        raise MineError(f"preference mining options: {e}") from None
    bound.apply_defaults()
    train, heldout, stats = mine_pairs(sources, **options)
    if not stats["pairs"]:
        raise MineError(f"no preference pairs found in {sources}: {stats['files']} .go/.py files, "
                        f"{stats['functions']} functions, skipped {stats['skipped']}; check the paths hold "
                        f"documented Go or Python functions, or pass --languages go python "
                        f"(now {' '.join(bound.arguments['languages'] or ['go', 'python'])})")
    write_splits(out, {"train.jsonl": train, "heldout.jsonl": heldout},
                 {"sources": list(sources),
                  "options": {k: v for k, v in bound.arguments.items() if k != "sources"}, "stats": stats})
    return stats


# -- pairs from code tasks with tests --------------------------------------------------------------------

def _task_field(task: dict, key: str, i: int):
    if not isinstance(task, dict) or key not in task:
        raise MineError(f"task {i} has no {key!r}: tasks are dicts with 'id', 'prompt', 'solution' and "
                        "'tests'")
    return task[key]


def pairs_from_tasks(tasks: list[dict], seed: int = 0, per_task: int = 3, kinds: list[str] | None = None,
                     skipped: Counter | None = None) -> list[dict]:
    """Candidate pairs for Python code tasks ({"id", "prompt", "solution", "tests"}): the solution is chosen,
    a mutated solution rejected; up to `per_task` pairs per task, spread over `kinds` (default all), drawn
    from a Random seeded from (seed, solution). meta is {"kind", "language": "python", "task_id"}.

    These are candidates: a mutation need not change behaviour, so filter them with `check_pairs_by_tests`.
    Tasks that give none are counted in `skipped`: no_solution, unparseable, no_mutation.
    """
    if per_task < 1:
        raise MineError(f"per_task {per_task} must be >= 1")
    kinds = _check_kinds(kinds)
    skipped = Counter() if skipped is None else skipped
    rows = []
    for i, task in enumerate(tasks):
        prompt, task_id = _task_field(task, "prompt", i), _task_field(task, "id", i)
        solution = task.get("solution")
        if solution is None:  # optional in tasks users bring (code_tasks.load_tasks)
            skipped["no_solution"] += 1
            continue
        if not isinstance(solution, str) or not isinstance(prompt, str):
            raise MineError(f"task {task_id!r}: 'prompt' and 'solution' must be text, got "
                            f"{type(prompt).__name__} and {type(solution).__name__}")
        if _structure(solution, "python") is None:
            skipped["unparseable"] += 1
            continue
        rng = random.Random(f"{seed}:task:{content_hash(solution).hex()}")
        variants = _spread(mutate(solution, "python", rng, kinds), per_task, rng)
        if not variants:
            skipped["no_mutation"] += 1
        for kind, broken in variants:
            rows.append(_row(prompt, solution, broken,
                             {"kind": kind, "language": "python", "task_id": task_id}))
    return rows


def write_task_pairs(tasks_path: str | Path, out_dir: str | Path, overwrite: bool = False, seed: int = 0,
                     per_task: int = 3, max_pairs: int = 0, heldout_fraction: float = 0.05,
                     **sandbox_kw) -> dict:
    """Pairs from tasks with reference solutions (a `make-tasks` directory: its train split gives the training
    pairs, its test split the held-out ones; a JSONL file: split by a hash of the task id), each rejected
    side run against the tests and kept only when it fails them. Written like write_pairs."""
    out, p = output_dir(out_dir, overwrite, MineError), Path(tasks_path)
    if p.is_dir():
        splits = {"train": load_tasks(p, split="train"), "heldout": load_tasks(p, split="heldout")}
    else:
        tasks = load_tasks(p)
        splits = {"train": [], "heldout": []}
        for t in tasks:
            key = "heldout" if split_of(content_hash(str(t["id"])), heldout_fraction) == "val" else "train"
            splits[key].append(t)
    rows, stats = {}, {"skipped": Counter(), "dropped": Counter(), "kinds": Counter()}
    for name, tasks in splits.items():
        cands = pairs_from_tasks(tasks, seed=seed, per_task=per_task, skipped=stats["skipped"])
        kept, dropped = check_pairs_by_tests(cands, {t["id"]: t for t in tasks}, **sandbox_kw)
        stats["dropped"].update(dropped)
        kept = kept[:max_pairs] if max_pairs and name == "train" else kept
        stats["kinds"].update(r["meta"]["kind"] for r in kept)
        rows[name] = kept
    if not rows["train"]:
        raise MineError(f"no preference pairs from the tasks in {p}: skipped {dict(stats['skipped'])}, "
                        f"dropped {dict(stats['dropped'])}; the tasks need reference solutions whose broken "
                        "copies fail")
    st = {"tasks": {k: len(v) for k, v in splits.items()}, "pairs": sum(map(len, rows.values())),
          "train": len(rows["train"]), "heldout": len(rows["heldout"]),
          **{k: dict(sorted(v.items())) for k, v in stats.items()}}
    write_splits(out, {"train.jsonl": rows["train"], "heldout.jsonl": rows["heldout"]},
                 {"tasks": str(p), "options": {"seed": seed, "per_task": per_task, "max_pairs": max_pairs},
                  "stats": st})
    return st


def _content(side) -> str:
    """The text of a pair's side: a string, or the content of its (last) assistant message."""
    if isinstance(side, str):
        return side
    if (
        isinstance(side, list)
        and side
        and isinstance(side[-1], dict)
        and isinstance(side[-1].get("content"), str)
    ):
        return side[-1]["content"]
    raise MineError("a pair side must be text or a list ending in an assistant message, got "
                    f"{str(side)[:80]!r}")


def check_pairs_by_tests(rows: list[dict], tasks_by_id: dict, timeout: float = 5.0, *,
                         workers: int | None = None,
                         unsafe_no_sandbox: bool = False) -> tuple[list[dict], Counter]:
    """(kept, dropped): the rows whose chosen side passes its task's tests and whose rejected side does not,
    each program being `code + "\\n\\n" + tests` run in `codeforge.sandbox` (run_many, `timeout` seconds).
    A rejected side that times out or runs out of memory fails; its status goes to meta["rejected_status"].

    Dropped rows are counted by reason: `unknown_task` (meta["task_id"] not in tasks_by_id), `no_tests`,
    `chosen_fails` (the reference solution fails its own tests) and `same_behaviour` (the tests cannot
    tell the broken copy from the solution). Each distinct program runs once.
    """
    dropped: Counter = Counter()
    programs: dict[str, int] = {}
    plans = []  # (row, chosen program index, rejected program index)
    for row in rows:
        task_id = (row.get("meta") or {}).get("task_id")
        task = tasks_by_id.get(task_id)
        if task is None:
            dropped["unknown_task"] += 1
            continue
        tests = task.get("tests")
        tests = "\n".join(tests) if isinstance(tests, list) else tests
        if not isinstance(tests, str) or not tests.strip():
            dropped["no_tests"] += 1
            continue
        pair = [_content(row["chosen"]) + "\n\n" + tests, _content(row["rejected"]) + "\n\n" + tests]
        plans.append((row, *[programs.setdefault(p, len(programs)) for p in pair]))
    results = []
    if plans:
        results = run_many(list(programs), timeout, workers=workers, unsafe_no_sandbox=unsafe_no_sandbox)
    kept: list[dict] = []
    for row, c, r in plans:
        if not results[c].passed:
            dropped["chosen_fails"] += 1
        elif results[r].passed:
            dropped["same_behaviour"] += 1
        else:
            kept.append({**row, "meta": {**row["meta"], "rejected_status": results[r].status}})
    return kept, dropped


# -- reading pairs users bring ---------------------------------------------------------------------------

class _Bad(Exception):
    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason, self.detail = reason, detail


def _message(m, what: str) -> dict:
    if not isinstance(m, dict) or m.get("role") not in ROLES:
        role = m.get("role") if isinstance(m, dict) else m
        raise _Bad("bad_message", f"{what} has role {str(role)[:40]!r}; a message is {{\"role\": one of "
                                  f"{'/'.join(ROLES)}, \"content\": text}}")
    if not isinstance(m.get("content"), str) and not (m.get("content") is None and m.get("tool_calls")):
        raise _Bad("bad_type", f"{what} content is {type(m.get('content')).__name__}, not text")
    return m


def _answer(side, name: str) -> str:
    """The text of a `chosen`/`rejected` side given as text, one assistant message, or a list of one."""
    if isinstance(side, str):
        return side
    if isinstance(side, list):
        if len(side) != 1:
            raise _Bad("bad_message", f"{name!r} must hold exactly one assistant message, has {len(side)}")
        side = side[0]
    if not isinstance(side, dict):
        raise _Bad("bad_type",
                   f"{name!r} is {type(side).__name__}: give text or a list of one assistant message")
    m = _message(side, f"{name!r}")
    if m["role"] != "assistant":
        raise _Bad("bad_message", f"{name!r} is a {m['role']} message; it must be the assistant's answer")
    if m.get("tool_calls"):
        raise _Bad("bad_message", f"{name!r} makes tool calls; preference pairs hold text answers only")
    return m["content"]


def _implicit(chosen: list, rejected: list) -> tuple[list[dict], str, str]:
    """(prompt, chosen text, rejected text) of two whole conversations: the prompt is their common leading
    messages, and after it each side must hold one assistant message."""
    for name, conv in (("chosen", chosen), ("rejected", rejected)):
        for i, m in enumerate(conv):
            _message(m, f"{name!r} message {i}")
    k = 0
    while k < min(len(chosen), len(rejected)) and chosen[k] == rejected[k]:
        k += 1
    if k == len(chosen) == len(rejected):
        raise _Bad("same_sides",
                   "'chosen' and 'rejected' are the same conversation: the pair teaches nothing")
    if k == 0:
        raise _Bad("no_prompt", "no 'prompt', and 'chosen' and 'rejected' share no leading messages to take "
                                "it from: give 'prompt' explicitly")
    answers = []
    for name, conv in (("chosen", chosen), ("rejected", rejected)):
        rest = conv[k:]
        if len(rest) != 1 or rest[0]["role"] != "assistant":
            roles = ", ".join(m["role"] for m in rest) or "nothing"
            raise _Bad("bad_message", f"after the {k} messages both sides share (the prompt), {name!r} must "
                                      f"end with one assistant message; it has {roles}")
        answers.append(_answer(rest, name))
    return chosen[:k], answers[0], answers[1]


def normalise_pair(obj) -> dict:
    """One preference row in any of the accepted shapes as {"prompt": text | [messages], "chosen": text,
    "rejected": text, "chat": bool}; PairError (with `reason`) naming what is wrong.

    Shapes: standard ("prompt", "chosen", "rejected" all text; chat False); conversational ("prompt" a list
    of messages, each side one assistant message, a list of one, or text; chat True); implicit prompt (no
    "prompt", each side a whole conversation: the prompt is their common leading messages; chat True).
    """
    try:
        return _normalise(obj)
    except _Bad as e:
        raise PairError(e.detail, e.reason) from None


def _normalise(obj) -> dict:
    if not isinstance(obj, dict):
        raise _Bad("bad_type",
                   f"expected a JSON object with 'chosen' and 'rejected', got {type(obj).__name__}")
    for side in ("chosen", "rejected"):
        if side not in obj:
            raise _Bad("missing_side", f"no {side!r}: a pair needs both 'chosen' and 'rejected'")
    prompt, chosen, rejected = obj.get("prompt"), obj["chosen"], obj["rejected"]
    if prompt is None:
        if not (isinstance(chosen, list) and isinstance(rejected, list)):
            raise _Bad("no_prompt", "no 'prompt', and 'chosen'/'rejected' are not conversations (lists of "
                                    "messages) that one could be taken from")
        prompt, chosen, rejected = _implicit(chosen, rejected)
        chat = True
    elif isinstance(prompt, str):
        for name, side in (("chosen", chosen), ("rejected", rejected)):
            if not isinstance(side, str):
                raise _Bad("bad_type", f"'prompt' is text, so {name!r} must be text too, not "
                                       f"{type(side).__name__} (or give 'prompt' as a list of messages)")
        chat = False
    elif isinstance(prompt, list):
        if not prompt:
            raise _Bad("no_prompt", "'prompt' is an empty list of messages")
        for i, m in enumerate(prompt):
            _message(m, f"'prompt' message {i}")
        if prompt[-1]["role"] == "assistant":
            raise _Bad("bad_message", "'prompt' ends with an assistant message: the answers would follow it")
        chosen, rejected = _answer(chosen, "chosen"), _answer(rejected, "rejected")
        chat = True
    else:
        raise _Bad("bad_type", f"'prompt' is {type(prompt).__name__}: give text or a list of messages")
    for name, text in (("chosen", chosen), ("rejected", rejected)):
        if not text.strip():
            raise _Bad("empty_side", f"{name!r} is empty")
    if chosen == rejected:
        raise _Bad("same_sides", "'chosen' and 'rejected' are the same text: the pair teaches nothing")
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected, "chat": chat}


def load_pairs(path: str | Path, split: str = "train", skipped: Counter | None = None,
               max_line_chars: int = MAX_LINE_CHARS) -> list[dict]:
    """Preference pairs from a JSONL file, or from `split` ("train" or "heldout") of a directory holding
    train.jsonl / heldout.jsonl (what `write_pairs` makes); .gz and .zst files are decompressed. Each row is
    normalised by `normalise_pair`.

    A bad row raises PairError naming the file, the line and what is wrong, unless a Counter is passed as
    `skipped`: then bad rows are counted there by reason (bad_json, missing_side, same_sides, empty_side,
    bad_type, bad_message, no_prompt, oversized_record) and left out. A line longer than `max_line_chars` is
    never held whole (corpus.bounded_lines). A file with no good pair is an error either way, except a
    directory's empty heldout.jsonl, which gives []: the miner writes one when no function fell in it.
    """
    if split not in SPLITS:
        raise PairError(f"split {split!r} must be one of {', '.join(SPLITS)}")
    p = Path(path)
    may_be_empty = False
    if p.is_dir():
        may_be_empty = split == "heldout"
        if not (p / f"{split}.jsonl").is_file():
            raise PairError(f"{str(p)!r} holds no {split}.jsonl: pass a JSONL file, or a directory written "
                            f"by the pair miner (train.jsonl, heldout.jsonl)")
        p = p / f"{split}.jsonl"
    elif not p.exists():
        raise PairError(f"{str(p)!r}: no such preference-pair file")
    rows: list[dict] = []
    bad: Counter = Counter()
    try:
        with open_text(str(p)) as f:
            for lineno, line in bounded_lines(f, max_line_chars):
                if line is None:
                    reason, detail = "oversized_record", long_line_detail(
                        max_line_chars,
                        "a pair that long cannot fit a context: shorten the record or drop it")
                elif not line.strip():
                    continue
                else:
                    try:
                        obj = json.loads(line)
                    except json.JSONDecodeError as e:
                        reason, detail = "bad_json", f"not JSON ({e})"
                    else:
                        try:
                            rows.append(_normalise(obj))
                            continue
                        except _Bad as e:
                            reason, detail = e.reason, e.detail
                if skipped is None:
                    raise PairError(f"{p}: line {lineno}: {detail}", reason)
                bad[reason] += 1
    except UnicodeDecodeError as e:
        raise PairError(f"{p}: not UTF-8 text ({e})", "non_utf8") from None
    if skipped is not None:
        skipped.update(bad)
    if not rows and not (may_be_empty and not bad):
        raise PairError(f"{p}: no preference pairs" + (f" ({sum(bad.values())} bad rows skipped: {dict(bad)})"
                                                       if bad else " (the file is empty)"), "no_pairs")
    return rows
