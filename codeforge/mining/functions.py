"""The tree-sitter walk every miner shares: the documented Go and Python functions of a source file, each
with its signature, doc comment or docstring, body and position. mining/sft.py turns them into instruction
pairs, mining/plans.py into plans, mining/pairs.py into preference pairs."""

from __future__ import annotations

import ast
import inspect
import os
import re
from collections import Counter
from collections.abc import Callable, Iterator

from .. import CodeforgeError
from ..corpus import CorpusOptions, CorpusStats, iter_documents
from ..syntax import parser
from .options import LANG_NAME

MINED_LANGUAGES = {".go": "go", ".py": "python"}  # extension -> language; other files are not mined
MIN_DOC_CHARS = 10  # "Add adds." and shorter say nothing the name does not
DOC_NAME = {"go": "doc comment", "python": "docstring"}
# go/ast's rule for a directive line (//go:noinline, //line ...), which is not part of a doc comment
GO_DIRECTIVE = re.compile(r"^//(line |extern |export |[a-z0-9]+:[a-z0-9])")


class MineError(CodeforgeError):
    """Bad input to the instruction-pair miner; the message names the value and the fix."""


def dedent(text: str, indent: str) -> str:
    """Remove `indent` from the lines that start with it. Unlike textwrap.dedent this also works when a
    multi-line string inside the function has a line at column 0 (such lines are left as they are)."""
    if not indent:
        return text
    return "\n".join(line.removeprefix(indent) for line in text.split("\n"))


def line_start(src: bytes, byte: int) -> int:
    return src.rfind(b"\n", 0, byte) + 1


def python_docstring(body) -> tuple[object | None, str]:
    """The docstring node of a function body and its cleaned text (inspect.cleandoc), or (None, "")."""
    stmts = [c for c in body.named_children if c.type != "comment"]
    if not stmts or stmts[0].type != "expression_statement" or stmts[0].named_child_count != 1:
        return None, ""
    node = stmts[0].named_children[0]
    if node.type != "string":
        return None, ""
    try:
        value = ast.literal_eval(node.text.decode("utf-8"))
    except (ValueError, SyntaxError):  # f-string: not a docstring Python would keep
        return None, ""
    return (node, inspect.cleandoc(value)) if isinstance(value, str) else (None, "")


def python_trivial(stmts: list) -> bool:
    """True when the statements after the docstring are only `pass`, `...` or `raise NotImplementedError`."""
    for s in stmts:
        if s.type == "pass_statement":
            continue
        if s.type == "expression_statement" and [c.type for c in s.named_children] == ["ellipsis"]:
            continue
        if s.type == "raise_statement" and re.fullmatch(rb"raise\s+NotImplementedError(\(.*\))?", s.text,
                                                        re.DOTALL):
            continue
        return False
    return True


def python_function_nodes(root) -> list[tuple]:
    """Every Python function below `root` as (node with its decorators, function_definition, class prefix
    "A.B."): methods of classes at any depth and functions in module-level blocks, not functions nested in
    functions (they lean on the enclosing scope). Shared by the miners here."""
    out: list[tuple] = []

    def visit(node, prefix: str) -> None:
        for child in node.children:
            fn = child.child_by_field_name("definition") if child.type == "decorated_definition" else child
            if fn is not None and fn.type == "function_definition":
                out.append((child, fn, prefix))
                continue  # nested functions are not mined
            if child.type == "class_definition":
                name = child.child_by_field_name("name")
                visit(child, f"{prefix}{name.text.decode('utf-8')}." if name else prefix)
            elif child.named_child_count:
                visit(child, prefix)  # blocks of classes, if/try at module level

    visit(root, "")
    return out


def _python_functions(src: bytes, root, skipped: Counter) -> list[dict]:
    def python_function(outer, fn, prefix: str) -> dict | None:
        name_node, body = fn.child_by_field_name("name"), fn.child_by_field_name("body")
        if outer.has_error or name_node is None or body is None:
            skipped["syntax_error"] += 1
            return None
        name = prefix + name_node.text.decode("utf-8")
        doc_node, doc = python_docstring(body)
        if doc_node is None:
            skipped["no_doc"] += 1
            return None
        if len(doc) < MIN_DOC_CHARS:
            skipped["short_doc"] += 1
            return None
        stmts = [c for c in body.named_children if c.type != "comment"]
        if python_trivial(stmts[1:]):
            skipped["trivial_body"] += 1
            return None
        start = line_start(src, outer.start_byte)
        indent = src[start:outer.start_byte].decode("utf-8")
        colon = [c for c in fn.children if c.type == ":" and c.end_byte <= body.start_byte][-1]

        def text(a: int, b: int) -> str:
            return dedent(src[a:b].decode("utf-8"), indent)

        return {"name": name, "signature": text(line_start(src, fn.start_byte), colon.end_byte), "doc": doc,
                "code": text(start, outer.end_byte), "stub": text(start, doc_node.end_byte)}

    return [item for item in (python_function(*node) for node in python_function_nodes(root)) if item]


def go_doc(node) -> list[str]:
    """The `//` comment lines directly above a declaration, each on its own line, top to bottom."""
    lines, row, prev = [], node.start_point[0], node.prev_sibling
    while prev is not None and prev.type == "comment" and prev.end_point[0] == row - 1:
        text = prev.text.decode("utf-8")
        before = prev.prev_sibling
        if not text.startswith("//") or before is not None and before.end_point[0] == prev.start_point[0]:
            break  # a /* block */ or a trailing comment of the line above
        lines.append(text)
        row, prev = prev.start_point[0], before
    return lines[::-1]


def go_function_nodes(root, skipped: Counter) -> list[tuple]:
    """(node, name, body) of every top-level Go func and method that parses and has a body, in file order;
    a method is named Recv.Name (the receiver's type without * or [T]). Left out: counted in `skipped`
    (syntax_error, no_body)."""
    out = []
    for node in root.children:
        if node.type not in ("function_declaration", "method_declaration"):
            continue
        if node.has_error or node.child_by_field_name("name") is None:
            skipped["syntax_error"] += 1
            continue
        name = node.child_by_field_name("name").text.decode("utf-8")
        if node.type == "method_declaration":
            recv = node.child_by_field_name("receiver")
            types = [n for n in descendants(recv) if n.type == "type_identifier"]
            name = f"{types[0].text.decode('utf-8')}.{name}" if types else name
        body = node.child_by_field_name("body")
        if body is None:
            skipped["no_body"] += 1
            continue
        out.append((node, name, body))
    return out


def _go_functions(src: bytes, root, skipped: Counter) -> list[dict]:
    out = []
    for node, name, body in go_function_nodes(root, skipped):
        comments = [c for c in go_doc(node) if not GO_DIRECTIVE.match(c)]
        doc = "\n".join(c[3:] if c.startswith("// ") else c[2:] for c in comments).strip()
        if not comments:
            skipped["no_doc"] += 1
            continue
        if len(doc) < MIN_DOC_CHARS:
            skipped["short_doc"] += 1
            continue
        if all(c.type == "comment" for c in body.named_children):
            skipped["trivial_body"] += 1
            continue
        signature = src[node.start_byte:body.start_byte].decode("utf-8").rstrip()
        out.append({"name": name, "signature": signature, "doc": doc,
                    "code": src[node.start_byte:node.end_byte].decode("utf-8"),
                    "stub": "\n".join(comments) + "\n" + signature})
    return out


def descendants(node):
    for c in node.children:
        yield c
        yield from descendants(c)


def mine_functions(text: str, language: str, skipped: Counter | None = None) -> list[dict]:
    """The documented, non-trivial functions of one source file, in file order.

    Each is {"name", "signature", "doc", "code", "stub"}: `name` is qualified for methods (`Class.method`,
    Go `Recv.Method`), `doc` is the documentation text without comment markers or quotes, `code` is the
    answer and `stub` the part shown in the request (see the module docstring). Functions left out are
    counted in `skipped` by reason, when given.
    """
    if language not in LANG_NAME:
        raise MineError(f"cannot mine functions of language {language!r}: only {sorted(LANG_NAME)}")
    skipped = Counter() if skipped is None else skipped
    src = text.encode("utf-8")
    root = parser(language).parse(src).root_node
    return (_python_functions if language == "python" else _go_functions)(src, root, skipped)


def mined_files(sources: list[str], opts: CorpusOptions, cstats: CorpusStats, skipped: Counter,
                counts: Counter,
                mine: Callable[[str, str, Counter], list[dict]] = mine_functions) -> Iterator[tuple]:
    """(document, language, what `mine` found in it) for every Go or Python file of the corpus, in its
    order: the walk every miner makes. Other files are counted in skipped["unsupported_file"];
    counts["files"] and counts["functions"] (found plus left out) grow as it goes."""
    for doc in iter_documents(sources, opts, cstats):
        language = MINED_LANGUAGES.get(os.path.splitext(doc.source)[1])
        if language is None:
            skipped["unsupported_file"] += 1
            continue
        counts["files"] += 1
        before = sum(skipped.values())
        found = mine(doc.text, language, skipped)
        counts["functions"] += len(found) + sum(skipped.values()) - before
        yield doc, language, found
