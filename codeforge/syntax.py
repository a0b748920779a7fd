"""Syntax of Go and Python code through tree-sitter: a parser per language, whether a snippet parses, and
a guess at a text's language. The miners (mining/), the hierarchical model's batches and evaluation share
these."""

from __future__ import annotations


def parser(language: str):
    from tree_sitter import Language, Parser
    if language == "python":
        import tree_sitter_python as grammar
    elif language == "go":
        import tree_sitter_go as grammar
    else:
        raise ValueError(f"syntax checks support go and python, not {language!r}")
    return Parser(Language(grammar.language()))


def is_valid_syntax(code: str, language: str) -> bool:
    """True when tree-sitter parses `code` without an error node. Go snippets without a package clause get
    one, so a lone function counts."""
    if language == "go" and not code.lstrip().startswith("package"):
        code = "package p\n\n" + code
    return not parser(language).parse(code.encode("utf-8")).root_node.has_error


def guess_language(text: str) -> str:
    return "go" if text.lstrip().startswith(("package ", "// ", "/*")) and "func " in text else "python"
