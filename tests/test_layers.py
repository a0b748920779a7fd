"""The package's layer rules, checked on the source text (no codeforge module is imported).

The layer table is written once, in codeforge/__init__.py's docstring; LAYERS below is read from it, so a new
module is placed by adding it to that table (a module of a package listed as `name/` is covered already).
docs/layout.md ("The layer rules") explains the layers and lists every file. The rules checked:

1. a module imports only from its own layer or a lower one (an import from a higher layer is an "arrow up");
2. evaluation and train never import each other, nor stages;
3. models never import train, checkpoint or data;
4. mining and tasks never import data, evaluation, train or stages;
5. no module imports another module's _private name (nor a _private module from outside its package);
6. a stage imports stages/common.py, never another stage;
7. codeforge's own modules are imported inside functions only in the CLI;
8. the import graph of codeforge's own modules has no cycle.

Every import counts (module level and inside functions) except those under `if TYPE_CHECKING:`.
Every module must be placed in a layer. Run as a script (`python tests/test_layers.py [-v]`) for the
before/after figures of a restructuring; -v lists every violation.
"""

from __future__ import annotations

import ast
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "codeforge"
PKG = "codeforge"

def read_layers() -> list[tuple[str, int]]:
    """The layer table of codeforge/__init__.py's docstring, the one place it is written, as (module pattern,
    layer): `models/` is every module of that package, `corpus` one module, the package itself layer 0."""
    doc = ast.get_docstring(ast.parse((ROOT / "__init__.py").read_text()))
    out: list[tuple[str, int]] = [("codeforge", 0)]
    for line in doc.splitlines():
        m = re.match(r"\s+(\d)\s+(.*)$", line)
        if not m:
            continue
        for word in re.split(r"\s{3,}", m.group(2))[0].split():  # three spaces and more: the row's comment
            if word.endswith("/") or (ROOT / word).is_dir():
                out.append((f"codeforge.{word.rstrip('/')}.*", int(m.group(1))))
            else:
                out.append((f"codeforge.{word}", int(m.group(1))))
    return out


# (pattern, layer): "x.*" is x itself and everything under it, a plain name that module only; where several
# match a module, the longest pattern wins (codeforge.x.y over codeforge.x.*)
LAYERS: list[tuple[str, int]] = read_layers()

# rules 2-4: (importer pattern, imported pattern), patterns as in LAYERS
FORBIDDEN: list[tuple[str, str]] = [
    ("codeforge.evaluation.*", "codeforge.train.*"),
    ("codeforge.evaluation.*", "codeforge.stages.*"),
    ("codeforge.train.*", "codeforge.stages.*"),
    ("codeforge.train.*", "codeforge.evaluation.*"),
    ("codeforge.models.*", "codeforge.train.*"),
    ("codeforge.models.*", "codeforge.checkpoint.*"),
    ("codeforge.models.*", "codeforge.data.*"),
    *((f"codeforge.{src}.*", f"codeforge.{dst}.*")
      for src in ("mining", "tasks") for dst in ("data", "evaluation", "train", "stages")),
]


def matches(name: str, pattern: str) -> bool:
    """Whether dotted module `name` is `pattern` (exact) or, for "x.*", x or a module under x."""
    if pattern.endswith(".*"):
        base = pattern[:-2]
        return name == base or name.startswith(base + ".")
    return name == pattern


def layer_of(name: str) -> int | None:
    """The layer of module `name` by longest matching prefix in LAYERS, None where none matches."""
    hits = [(len(p), layer) for p, layer in LAYERS if matches(name, p)]
    return max(hits)[1] if hits else None


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


@dataclass(frozen=True)
class Import:
    """One import of a codeforge module (or of a name from one) by a codeforge module."""

    src: str  # importing module
    file: str  # its path relative to the repository, for messages
    line: int
    text: str  # the statement, or the attribute use for a private-name access
    target: str  # the imported module (resolved, absolute)
    name: str | None = None  # the imported name where it is not itself a module
    in_function: bool = False

    def where(self) -> str:
        return f"{self.file}:{self.line}"


@dataclass
class Graph:
    modules: dict[str, Path]  # dotted name -> file
    imports: list[Import] = field(default_factory=list)  # codeforge imports (TYPE_CHECKING excluded)
    attr_uses: list[Import] = field(default_factory=list)  # `mod._name` where mod is bound to a module
    function_imports_all: int = 0  # import statements inside function bodies, any package
    function_imports_codeforge: int = 0  # of those, the ones importing codeforge
    root: Path = ROOT

    def rel(self, module: str) -> str:
        """The file of `module` relative to the repository (the parent of the package)."""
        return self.modules[module].relative_to(self.root.parent).as_posix()


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([PKG, *parts])


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _statements(body: list[ast.stmt], in_function: bool = False) -> Iterator[tuple[ast.stmt, bool]]:
    """Yield (statement, inside a function) for every statement, skipping the bodies of `if TYPE_CHECKING:`.

    Imports are statements, so expressions are never entered (that keeps the walk fast)."""
    for stmt in body:
        yield stmt, in_function
        inner = in_function or isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef))
        if isinstance(stmt, ast.If) and _is_type_checking(stmt.test):
            yield from _statements(stmt.orelse, inner)
            continue
        for name in ("body", "orelse", "finalbody"):
            yield from _statements(getattr(stmt, name, []), inner)
        for sub in getattr(stmt, "handlers", []) + getattr(stmt, "cases", []):  # except clauses, match cases
            yield from _statements(sub.body, inner)


def _parse_file(path: Path, src: str, modules: dict[str, Path], graph: Graph) -> None:
    source = path.read_text(encoding="utf-8")
    tree = ast.parse(source, filename=str(path))
    file = graph.rel(src)
    package = src if path.name == "__init__.py" else src.rpartition(".")[0]
    bound: dict[str, str] = {}  # local name -> codeforge module it is bound to
    for node, in_function in _statements(tree.body):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        text = ast.unparse(node)
        if len(text) > 100:
            text = text[:96] + " ..."
        found: list[Import] = []
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name != PKG and not alias.name.startswith(PKG + "."):
                    continue
                found.append(Import(src, file, node.lineno, text, alias.name, None, in_function))
                if alias.asname:
                    bound[alias.asname] = alias.name
                else:
                    bound[PKG] = PKG
        else:
            if node.level:
                parts = package.split(".")
                if node.level - 1 >= len(parts):
                    base = "." * node.level + (node.module or "")  # above the top level: not codeforge
                else:
                    base = ".".join(parts[:len(parts) - (node.level - 1)]
                                    + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if base != PKG and not base.startswith(PKG + "."):
                if in_function:
                    graph.function_imports_all += 1
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in modules:
                    found.append(Import(src, file, node.lineno, text, sub, None, in_function))
                    bound[alias.asname or alias.name] = sub
                else:
                    found.append(Import(src, file, node.lineno, text, base, alias.name, in_function))
        if in_function:
            graph.function_imports_all += 1
            graph.function_imports_codeforge += bool(found)
        graph.imports.extend(found)

    names = "|".join(re.escape(n) for n in bound)
    if not names or not re.search(rf"\b(?:{names})\s*\.\s*(?:\w+\s*\.\s*)*_", source):
        return  # no `x._y` in the text: spare the walk through every expression
    for node in ast.walk(tree):  # `x._y` (or `x.sub._y`) where x is bound to a codeforge module in this file
        if not isinstance(node, ast.Attribute) or not is_private(node.attr):
            continue
        chain, value = [], node.value
        while isinstance(value, ast.Attribute):
            chain.append(value.attr)
            value = value.value
        if not isinstance(value, ast.Name) or value.id not in bound:
            continue
        mod = bound[value.id]
        for part in reversed(chain):
            if f"{mod}.{part}" not in modules:
                break
            mod = f"{mod}.{part}"
        else:
            sub = f"{mod}.{node.attr}"
            target, name = (sub, None) if sub in modules else (mod, node.attr)
            graph.attr_uses.append(Import(src, file, node.lineno, ast.unparse(node), target, name))


@lru_cache(maxsize=None)
def collect(root: Path = ROOT) -> Graph:
    """Parse every .py file under `root` and return its modules and their codeforge imports."""
    files = sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)
    modules = {module_name(p, root): p for p in files}
    graph = Graph(modules, root=root)
    for name, path in modules.items():
        _parse_file(path, name, modules, graph)
    graph.imports.sort(key=lambda i: (i.file, i.line))
    graph.attr_uses.sort(key=lambda i: (i.file, i.line))
    return graph


def _describe(imp: Import) -> str:
    return f"{imp.where()}: {imp.text}  ({imp.src} -> {imp.target})"


def _edges(graph: Graph) -> list[Import]:
    """Imports of existing codeforge modules, one per (statement, target), self-imports left out."""
    seen, out = set(), []
    for imp in graph.imports:
        key = (imp.src, imp.line, imp.target)
        if imp.target in graph.modules and imp.target != imp.src and key not in seen:
            seen.add(key)
            out.append(imp)
    return out


def unplaced(graph: Graph) -> list[str]:
    return [f"{graph.rel(name)} ({name})" for name in graph.modules if layer_of(name) is None]


def unresolved(graph: Graph) -> list[str]:
    return list(dict.fromkeys(f"{_describe(i)}: no module {i.target}"
                              for i in graph.imports if i.target not in graph.modules))


def arrows_up(graph: Graph) -> list[str]:
    out = []
    for imp in _edges(graph):
        a, b = layer_of(imp.src), layer_of(imp.target)
        if a is not None and b is not None and b > a:
            out.append(f"{_describe(imp)}: layer {a} imports layer {b}")
    return out


def forbidden_pairs(graph: Graph) -> list[str]:
    out = []
    for imp in _edges(graph):
        for src_pat, dst_pat in FORBIDDEN:
            if matches(imp.src, src_pat) and matches(imp.target, dst_pat):
                out.append(f"{_describe(imp)}: {src_pat} must not import {dst_pat}")
    return out


def private_imports(graph: Graph) -> list[str]:
    out: dict[str, list[str]] = {}  # message -> the private names it is about, in order
    for imp in sorted(graph.imports + graph.attr_uses, key=lambda i: (i.file, i.line)):
        if imp.name is not None and is_private(imp.name) and imp.target != imp.src:
            out.setdefault(f"{_describe(imp)}: private name", []).append(imp.name)
        parts = imp.target.split(".")  # a _private module is imported only from inside its package
        for i, part in enumerate(parts):
            owner = ".".join(parts[:i])
            if is_private(part) and not matches(imp.src, owner + ".*"):
                out.setdefault(f"{_describe(imp)}: private module {'.'.join(parts[:i + 1])} "
                               f"imported from outside {owner}", [])
                break
    return [msg + ("s " if len(names) > 1 else " ") * bool(names) + ", ".join(names)
            for msg, names in out.items()]


def cycles(graph: Graph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    succ: dict[str, set[str]] = {m: set() for m in graph.modules}
    for imp in _edges(graph):
        succ[imp.src].add(imp.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(succ[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(succ):
        if v not in index:
            visit(v)
    return sorted(out)


def cycle_report(graph: Graph) -> list[str]:
    out = []
    for comp in cycles(graph):
        members = set(comp)
        files = ", ".join(graph.rel(m) for m in comp)
        out.append("\n".join([f"cycle of {len(comp)} modules: {files}", *(
            f"    {_describe(i)}" for i in _edges(graph) if i.src in members and i.target in members)]))
    return out


def stage_to_stage(graph: Graph) -> list[str]:
    """Rule 6: a stage file imports stages/common.py, never another stage (the package's dispatcher may)."""
    return [f"{_describe(imp)}: a stage imports another stage; share it through stages/common.py"
            for imp in _edges(graph)
            if imp.src.startswith(f"{PKG}.stages.") and imp.target.startswith(f"{PKG}.stages.")
            and imp.target != f"{PKG}.stages.common"]


def inner_imports(graph: Graph) -> list[str]:
    """Rule 7: imports of codeforge's own modules inside functions only in the CLI (where they keep torch out
    of `codeforge --help`)."""
    return [_describe(imp) for imp in _edges(graph)
            if imp.in_function and not (imp.src == f"{PKG}.cli" or imp.src.startswith(f"{PKG}.cli."))]


def _fail(title: str, items: list[str]) -> None:
    if items:
        pytest.fail(f"{title} ({len(items)}):\n" + "\n".join(f"  {i}" for i in items), pytrace=False)


def test_every_module_is_placed() -> None:
    _fail("not placed in a layer: add it to the layer table in codeforge/__init__.py's docstring and to the "
          "file list in docs/layout.md", unplaced(collect()))


def test_imports_resolve() -> None:
    _fail("imports of codeforge modules that do not exist", unresolved(collect()))


def test_no_arrow_up() -> None:
    _fail("arrows up: a module imports only from its own layer or a lower one", arrows_up(collect()))


def test_no_forbidden_pairs() -> None:
    _fail("forbidden imports between siblings", forbidden_pairs(collect()))


def test_no_private_imports() -> None:
    _fail("imports of another module's _private name", private_imports(collect()))


def test_a_stage_imports_common_not_another_stage() -> None:
    _fail("stage files importing another stage", stage_to_stage(collect()))


def test_codeforge_imports_inside_functions_only_in_the_cli() -> None:
    _fail("imports of codeforge modules inside functions outside cli/ (move them to the top)",
          inner_imports(collect()))


def test_no_import_cycles() -> None:
    _fail("import cycles among codeforge modules", cycle_report(collect()))


def main(argv: list[str]) -> int:
    verbose = "-v" in argv
    graph = collect()
    sizes = {m: len(p.read_text(encoding="utf-8").splitlines()) for m, p in graph.modules.items()}
    biggest = max(sizes, key=sizes.__getitem__)
    checks = [("not placed in a layer", unplaced(graph)), ("unresolved codeforge imports", unresolved(graph)),
              ("arrows up", arrows_up(graph)), ("forbidden pairs", forbidden_pairs(graph)),
              ("private-name imports (statements)", private_imports(graph))]
    comps = cycles(graph)
    print(f"modules: {len(graph.modules)}")
    print(f"imports inside functions: {graph.function_imports_codeforge} of codeforge modules, "
          f"{graph.function_imports_all} in all")
    for title, items in checks:
        print(f"{title}: {len(items)}")
        for item in items if verbose else ():
            print(f"  {item}")
    print(f"cycles: {len(comps)}")
    for comp in comps:
        print(f"  {len(comp)} modules: " + ", ".join(graph.rel(m) for m in comp))
    print(f"largest file: {graph.rel(biggest)} ({sizes[biggest]} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
