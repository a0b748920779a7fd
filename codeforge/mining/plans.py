"""Mine (prompt, plan, body) triples for the hierarchical model, offline: every Go or Python function.

One JSON object per function (documented or not):

    {"prompt": P, "plan": [WORD, ...], "body": Y, "language": "go" | "python", "source": PATH,
     "name": NAME, "split": "train" | "val"}

* `prompt` P is the function up to where its body starts, exactly as written: Python decorators, the `def`
  header up to its colon (it may span lines) and the docstring literal when there is one; Go the `//` doc
  comment directly above the `func` (directive lines such as `//go:noinline` included, as written) and the
  signature up to and including the body's `{`.
* `body` Y is the rest of the function, to its last character (Python: the statements after the colon or
  the docstring; Go: after the `{`, through the closing `}`). A method is dedented by the indentation of
  its first line, the same for P and Y, so `prompt + body` is the function's source exactly: from its
  first decorator or doc-comment line to its last character.
* `plan` S is a statement-level skeleton of the body, computed from the code itself (self-supervised): the
  body's statements, walked with tree-sitter, each written as one abstract keyword; a statement holding
  blocks writes each block as `{ ... }` after its keyword. Identifiers, literals, expressions and
  comments are left out, so `for x in y: if a: return b` is `for { if { return } }`. The Python docstring
  is in P and not in S. Expressions are not entered: a lambda or a Go func literal is part of the
  statement holding it, and a nested `def`/`class` is one word without its body.

The plan words (PLAN_WORDS, so a model can reserve one token each):

    {  }  ...        open and close a block; `...` ends a plan cut at max_plan_words (braces then unbalanced)
    assign           =, +=, :=, x: T = v, x++ / x--, Python `type X = ...`
    call             an expression statement that is a call (Python 2 print/exec too)
    await yield expr an expression statement that is an await, a yield, or anything else (`<-ch`, `a, b`)
    return raise assert pass break continue del import def class
    global           global or nonlocal
    if elif else     Go `else if` is `elif`, so both languages share the shape
    for while try except finally with match case default
                     `for` is also Python's async for and every Go for; `except*` is `except`;
                     `case`/`default` are the arms of a Python match or a Go switch/select
    switch select defer go send goto fallthrough      Go only (send: `ch <- v`)
    var const type   Go declarations inside a body (`type` also at Go top level)
    block            a bare Go `{ ... }` block
    stmt             any statement kind not listed (a grammar newer than this table)

A Go label is dropped (the labelled statement is kept). An if-statement's initializer, a for clause and a
switch tag are expressions and are left out. `parse_plan` computes the same plan for any snippet (a whole
function, a body as cut here, or loose statements), so generated code can be scored against S.

Functions are found as in `mining/sft.py` (methods of classes, nested classes; functions nested inside
functions are not mined). The split is `corpus.split_of` over the hash `mining/sft.py` uses for the same
function (the code without the Go doc comment), so with seed 0 and the same fraction a function held out
from SFT is held out here too, and a function stays in its split when files are added; that hash also
deduplicates. Functions left out are counted by reason: `syntax_error` (tree-sitter found an error inside
it), `no_body` (Go implemented in assembly), `trivial_body` (only `pass`, `...`, `raise
NotImplementedError` or the docstring; an empty Go body), `too_long` (more than `max_chars` characters),
`short_plan` (fewer than `min_plan_words` words), `duplicate`.
"""

from __future__ import annotations

import inspect
from collections import Counter
from pathlib import Path

from ..atomic import write_splits
from ..corpus import CorpusOptions, CorpusStats, content_hash, split_of
from ..syntax import parser
from .functions import (LANG_NAME, MineError, dedent, go_doc, line_start,
                        go_function_nodes, mined_files, python_docstring, python_function_nodes,
                        python_trivial)

PLAN_OPEN = "<plan>"
CODE_OPEN = "<code>"
PLAN_WORDS: tuple[str, ...] = (
    "{", "}", "...",
    "assign", "call", "await", "yield", "expr",
    "return", "raise", "assert", "pass", "break", "continue", "del", "import", "def", "class", "global",
    "if", "elif", "else", "for", "while", "try", "except", "finally", "with", "match", "case", "default",
    "switch", "select", "defer", "go", "send", "goto", "fallthrough",
    "var", "const", "type", "block", "stmt",
)


class PlanMineError(MineError):
    """Bad input to the plan miner; the message names the value and the fix."""


# -- plans -----------------------------------------------------------------------------------------------

PY_SIMPLE = {
    "return_statement": "return", "raise_statement": "raise", "assert_statement": "assert",
    "pass_statement": "pass", "break_statement": "break", "continue_statement": "continue",
    "delete_statement": "del", "import_statement": "import", "import_from_statement": "import",
    "future_import_statement": "import", "global_statement": "global", "nonlocal_statement": "global",
    "function_definition": "def", "class_definition": "class", "type_alias_statement": "assign",
    "print_statement": "call", "exec_statement": "call",
}
PY_COMPOUND = {"if_statement": "if", "for_statement": "for", "while_statement": "while",
               "try_statement": "try", "with_statement": "with", "match_statement": "match"}
PY_CLAUSE = {"elif_clause": "elif", "else_clause": "else", "except_clause": "except",
             "except_group_clause": "except", "finally_clause": "finally", "case_clause": "case"}
PY_EXPR = {"call": "call", "await": "await", "yield": "yield", "assignment": "assign",
           "augmented_assignment": "assign"}
GO_SIMPLE = {
    "short_var_declaration": "assign", "assignment_statement": "assign", "inc_statement": "assign",
    "dec_statement": "assign", "var_declaration": "var", "const_declaration": "const",
    "type_declaration": "type", "send_statement": "send", "return_statement": "return",
    "defer_statement": "defer", "go_statement": "go", "break_statement": "break",
    "continue_statement": "continue", "goto_statement": "goto", "fallthrough_statement": "fallthrough",
    "function_declaration": "def", "method_declaration": "def", "import_declaration": "import",
}
GO_CASE = {"expression_case": "case", "type_case": "case", "communication_case": "case",
           "default_case": "default"}
GO_SWITCH = {"expression_switch_statement": "switch", "type_switch_statement": "switch",
             "select_statement": "select"}


def _first_block(node):
    return next((c for c in node.children if c.type == "block"), None)


def _python_stmts(block) -> list:
    return [] if block is None else [c for c in block.named_children if c.type != "comment"]


def _python_plan(stmts: list) -> list[str]:
    words: list[str] = []
    for s in stmts:
        if s.type in PY_CLAUSE:  # the arms of a match, found in its block
            words += [PY_CLAUSE[s.type], "{", *_python_plan(_python_stmts(_first_block(s))), "}"]
        elif s.type in PY_COMPOUND:
            words += [PY_COMPOUND[s.type], "{", *_python_plan(_python_stmts(_first_block(s))), "}"]
            words += _python_plan([c for c in s.children if c.type in PY_CLAUSE])
        elif s.type == "expression_statement":
            kids = [c for c in s.named_children if c.type != "comment"]
            words.append(PY_EXPR.get(kids[0].type, "expr") if len(kids) == 1 else "expr")
        elif s.type == "decorated_definition":
            d = s.child_by_field_name("definition")
            words.append("class" if d is not None and d.type == "class_definition" else "def")
        else:
            words.append(PY_SIMPLE.get(s.type, "stmt"))
    return words


def _go_stmts(nodes) -> list:
    out = []
    for c in nodes:
        if c.type == "statement_list":
            out += _go_stmts(c.named_children)
        elif c.is_named and c.type not in ("comment", "empty_statement"):
            out.append(c)
    return out


def _go_case_stmts(case) -> list:
    """The statements of a switch/select arm: what follows its `:` (not the case's own send/receive)."""
    colon = next((i for i, c in enumerate(case.children) if c.type == ":"), len(case.children))
    return _go_stmts(case.children[colon + 1:])


def _go_plan(stmts: list) -> list[str]:
    words: list[str] = []
    for s in stmts:
        if s.type == "if_statement":
            kw = "if"
            while s is not None:  # if { } elif { } ... else { }
                words += [kw, "{", *_go_plan(_go_stmts(s.child_by_field_name("consequence").children)), "}"]
                alt, kw = s.child_by_field_name("alternative"), "elif"
                if alt is not None and alt.type == "block":
                    words += ["else", "{", *_go_plan(_go_stmts(alt.children)), "}"]
                s = alt if alt is not None and alt.type == "if_statement" else None
        elif s.type == "for_statement":
            words += ["for", "{", *_go_plan(_go_stmts(s.child_by_field_name("body").children)), "}"]
        elif s.type in GO_SWITCH:
            words += [GO_SWITCH[s.type], "{"]
            for case in s.named_children:
                if case.type in GO_CASE:
                    words += [GO_CASE[case.type], "{", *_go_plan(_go_case_stmts(case)), "}"]
            words.append("}")
        elif s.type == "block":
            words += ["block", "{", *_go_plan(_go_stmts(s.children)), "}"]
        elif s.type == "labeled_statement":
            words += _go_plan(_go_stmts([c for c in s.named_children if c.type != "label_name"]))
        elif s.type == "expression_statement":
            kids = s.named_children
            words.append("call" if len(kids) == 1 and kids[0].type == "call_expression" else "expr")
        else:
            words.append(GO_SIMPLE.get(s.type, "stmt"))
    return words


def _cap(words: list[str], max_plan_words: int) -> list[str]:
    """At most max_plan_words words (0: no cap), the last one `...` when words were cut."""
    if max_plan_words and len(words) > max_plan_words:
        return words[:max_plan_words - 1] + ["..."]
    return words


def _python_body_plan(fn) -> list[str]:
    body = fn.child_by_field_name("body")
    doc_node, _ = python_docstring(body) if body is not None else (None, "")
    stmts = _python_stmts(body)
    if doc_node is not None:
        stmts = stmts[1:]  # the docstring is in the prompt
    return _python_plan(stmts)


def _go_body_plan(fn) -> list[str]:
    body = fn.child_by_field_name("body")
    return [] if body is None else _go_plan(_go_stmts(body.children))


def _python_function_node(root):
    """The function_definition when the module is exactly one (possibly decorated) function, else None."""
    stmts = _python_stmts(root)
    if len(stmts) != 1:
        return None
    node = stmts[0]
    if node.type == "decorated_definition":
        node = node.child_by_field_name("definition")
    return node if node is not None and node.type == "function_definition" else None


def _go_function_node(root):
    """The function/method declaration when the file is exactly one (besides package and imports)."""
    decls = [c for c in root.named_children
             if c.type not in ("package_clause", "import_declaration", "comment")]
    ok = len(decls) == 1 and decls[0].type in ("function_declaration", "method_declaration")
    return decls[0] if ok else None


def parse_plan(code: str, language: str, max_plan_words: int = 0) -> list[str] | None:
    """The plan of a code snippet, or None when it does not parse (tree-sitter finds an error).

    The snippet may be a whole function (its body's plan: what a mined record's `plan` is for
    `prompt + body`), a body as mined here (Python: what follows the colon or docstring, still indented;
    Go: what follows the `{`, with or without the closing `}`), or loose statements / a whole file (the
    plan of its top-level statements; a Go file's functions are `def` words). `max_plan_words` caps it as
    the miner does (0: no cap).
    """
    if language not in LANG_NAME:
        raise PlanMineError(f"cannot plan code of language {language!r}: only {sorted(LANG_NAME)}")
    p = parser(language)

    def parse(text: str):
        root = p.parse(text.encode("utf-8")).root_node
        return None if root.has_error else root

    if language == "python":
        root = parse(code)
        if root is not None:
            fn = _python_function_node(root)
            return _cap(_python_body_plan(fn) if fn is not None else _python_plan(_python_stmts(root)),
                        max_plan_words)
        root = parse("def _():" + code)  # a body, still indented as in its function
        fn = _python_function_node(root) if root is not None else None
        return None if fn is None else _cap(_python_body_plan(fn), max_plan_words)
    head = "" if code.lstrip().startswith("package") else "package p\n\n"
    root = parse(head + code)
    if root is not None:
        fn = _go_function_node(root)
        if fn is not None:
            return _cap(_go_body_plan(fn), max_plan_words)
        return _cap(_go_plan(_go_stmts([c for c in root.named_children if c.type != "package_clause"])),
                    max_plan_words)
    for text in ("package p\n\nfunc _() {" + code, "package p\n\nfunc _() {\n" + code + "\n}"):
        root = parse(text)  # a body with its closing brace, then loose statements
        fn = _go_function_node(root) if root is not None else None
        if fn is not None:
            return _cap(_go_body_plan(fn), max_plan_words)
    return None


def plan_text(record: dict) -> str:
    """The single-stream form for a GPT baseline: `P\\n<plan> S <code>Y`.

    The prompt, a newline, PLAN_OPEN, the plan words each after a space, a space, CODE_OPEN and the body
    as it is (it begins with the newline or space after the colon/brace). A model given everything up to
    and including `<plan>` writes the plan, then the code; dropping the middle gives the function back.
    """
    return f"{record['prompt']}\n{PLAN_OPEN} {' '.join(record['plan'])} {CODE_OPEN}{record['body']}"


# -- finding functions -----------------------------------------------------------------------------------

def _python_units(src: bytes, root, skipped: Counter) -> list[dict]:
    """Every function (methods too; not those nested in functions) as {name, prompt, body, plan, key}."""
    def unit(outer, fn, prefix: str) -> dict | None:
        name_node, body = fn.child_by_field_name("name"), fn.child_by_field_name("body")
        if outer.has_error or name_node is None or body is None:
            skipped["syntax_error"] += 1
            return None
        doc_node, _ = python_docstring(body)
        stmts = _python_stmts(body)
        if python_trivial(stmts[1:] if doc_node is not None else stmts):
            skipped["trivial_body"] += 1
            return None
        start = line_start(src, outer.start_byte)
        indent = src[start:outer.start_byte].decode("utf-8")
        colon = [c for c in fn.children if c.type == ":" and c.end_byte <= body.start_byte][-1]
        cut = doc_node.end_byte if doc_node is not None else colon.end_byte
        code = dedent(src[start:outer.end_byte].decode("utf-8"), indent)
        prompt = dedent(src[start:cut].decode("utf-8"), indent)
        assert code.startswith(prompt), (prompt, code)  # the cut is past the indentation of its line
        return {"name": prefix + name_node.text.decode("utf-8"), "prompt": prompt, "body": code[len(prompt):],
                "plan": _python_body_plan(fn), "key": code}

    return [item for item in (unit(*node) for node in python_function_nodes(root)) if item]


def _go_units(src: bytes, root, skipped: Counter) -> list[dict]:
    """Every top-level func/method as {name, prompt, body, plan, key}; key is the code from `func` on."""
    out = []
    for node, name, body in go_function_nodes(root, skipped):
        if not _go_stmts(body.children):  # empty, or comments only
            skipped["trivial_body"] += 1
            continue
        first = node
        for _ in go_doc(node):  # back to the first doc comment line
            first = first.prev_sibling
        start = line_start(src, first.start_byte)
        out.append({"name": name, "prompt": src[start:body.start_byte + 1].decode("utf-8"),
                    "body": src[body.start_byte + 1:node.end_byte].decode("utf-8"),
                    "plan": _go_body_plan(node), "key": src[node.start_byte:node.end_byte].decode("utf-8")})
    return out


def mine_units(text: str, language: str, skipped: Counter | None = None) -> list[dict]:
    """The non-trivial functions of one source file, in file order, each {"name", "prompt", "body", "plan",
    "key"} (plan uncapped; key: the code mining/sft.py hashes). Functions left out are counted in
    `skipped`."""
    if language not in LANG_NAME:
        raise PlanMineError(f"cannot mine functions of language {language!r}: only {sorted(LANG_NAME)}")
    skipped = Counter() if skipped is None else skipped
    src = text.encode("utf-8")
    root = parser(language).parse(src).root_node
    return (_python_units if language == "python" else _go_units)(src, root, skipped)


# -- mining ----------------------------------------------------------------------------------------------

def mine_plans(sources: list[str], languages: list[str] | None = None, max_examples: int = 0,
               max_chars: int = 4000, val_fraction: float = 0.05, seed: int = 0, exclude_tests: bool = False,
               max_plan_words: int = 128, min_plan_words: int = 1) -> tuple[list[dict], list[dict], dict]:
    """(train, val, stats) plan records mined from `sources` (paths as `codeforge.corpus` reads them).

    Files are read in the corpus's deterministic order (FIFOs, broken links and unreadable files skipped
    and counted), with exact file dedup and vendored directories left out; test files too when
    `exclude_tests`. A file's language comes from its extension (.go, .py). `max_chars` bounds
    `prompt + body`; plans longer than `max_plan_words` are cut (counted in stats["truncated_plans"]).
    `seed` 0 splits by the function's hash as mining/sft.py does; another seed salts it (a different split,
    as stable). `max_examples` (0: no limit) caps train + val; reading stops there. stats is {"files",
    "functions", "examples", "train", "val", "truncated_plans", "skipped": {reason: n}, "corpus_skipped"}.
    """
    for lang in languages or []:
        if lang not in LANG_NAME:
            raise PlanMineError(f"--languages {lang!r}: only {', '.join(sorted(LANG_NAME))} can be mined")
    if not 0.0 <= val_fraction < 1.0:
        raise PlanMineError(f"val_fraction {val_fraction} must be in [0, 1)")
    if max_examples < 0 or max_chars <= 0:
        raise PlanMineError(f"max_examples {max_examples} must be >= 0 and max_chars {max_chars} > 0")
    if max_plan_words < 2 or min_plan_words < 1:
        raise PlanMineError(f"max_plan_words {max_plan_words} must be >= 2 (room for `...`) and "
                            f"min_plan_words {min_plan_words} >= 1")
    # mined from code with its secrets replaced and benchmark copies left out, as `prepare` does
    opts = CorpusOptions(languages=languages or ["go", "python"], exclude_tests=exclude_tests, dedup="exact",
                         val_fraction=0.0, redact_secrets=True, decontaminate=["humaneval"])
    cstats = CorpusStats()
    skipped: Counter = Counter()
    seen: set[bytes] = set()
    rows: dict[str, list[dict]] = {"train": [], "val": []}
    counts: Counter = Counter()  # files, functions
    truncated = 0
    for doc, language, found in mined_files(sources, opts, cstats, skipped, counts, mine_units):
        for fn in found:
            if len(fn["prompt"]) + len(fn["body"]) > max_chars:
                skipped["too_long"] += 1
                continue
            if len(fn["plan"]) < min_plan_words:
                skipped["short_plan"] += 1
                continue
            digest = content_hash(fn["key"])
            if digest in seen:
                skipped["duplicate"] += 1
                continue
            seen.add(digest)
            plan = _cap(fn["plan"], max_plan_words)
            truncated += plan is not fn["plan"]
            split = split_of(digest if seed == 0 else content_hash(f"{seed}:{digest.hex()}"), val_fraction)
            rows[split].append({"prompt": fn["prompt"], "plan": plan, "body": fn["body"],
                                "language": language,
                                "source": doc.source, "name": fn["name"], "split": split})
            if max_examples and len(rows["train"]) + len(rows["val"]) >= max_examples:
                break
        if max_examples and len(rows["train"]) + len(rows["val"]) >= max_examples:
            break
    train, val = rows["train"], rows["val"]
    stats = {"files": counts["files"], "functions": counts["functions"],
             "examples": len(train) + len(val), "train": len(train),
             "val": len(val), "truncated_plans": truncated, "skipped": dict(sorted(skipped.items())),
             "corpus_skipped": dict(sorted(cstats.skipped.items()))}
    return train, val, stats


def write_plans(sources: list[str], out_dir: str | Path, overwrite: bool = False, **options) -> dict:
    """Mine `sources` (options as in `mine_plans`) into out_dir/{train,val}.jsonl and meta.json.

    An existing out_dir is refused unless `overwrite`. The directory is written aside and renamed into
    place (codeforge.atomic), so a crash never leaves a half-written one. Returns the stats plus
    "example": the first record written.
    """
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise PlanMineError(f"--out {str(out)!r} is a file: pass a directory path")
    if out.exists() and not overwrite:
        raise PlanMineError(f"--out {str(out)!r} already exists: choose a new directory or pass --overwrite")
    bound = inspect.signature(mine_plans).bind(sources, **options)  # a bad option fails here, before mining
    bound.apply_defaults()
    train, val, stats = mine_plans(sources, **options)
    if not stats["examples"]:
        raise PlanMineError(f"no functions to plan found in {sources}: {stats['files']} .go/.py files, "
                            f"{stats['functions']} functions, skipped {stats['skipped']}, corpus skipped "
                            f"{stats['corpus_skipped']}; check the paths hold Go or Python code")
    write_splits(out, {"train.jsonl": train, "val.jsonl": val},
                 {"sources": list(sources),
                  "options": {k: v for k, v in bound.arguments.items() if k != "sources"},
                  "plan_words": list(PLAN_WORDS), "plan_open": PLAN_OPEN, "code_open": CODE_OPEN,
                  "stats": stats})
    return {**stats, "example": (train or val)[0]}
