"""JSON schemas closed as llama.cpp's JSON-schema converter reads them, for grammar-constrained decoding
(constrain.py): an object that lists "properties" takes only those keys, and those it requires, unless its
"additionalProperties" says otherwise (true, or a schema for the other keys' values), at every depth. JSON
Schema's own rule allows extra keys unless "additionalProperties" is false; under it a barely trained model
wrote junk keys in 6 of 10 forced tool calls (`{"path": "...", ":,": true}`). An object built from parts
(`allOf`, `anyOf`/`oneOf` beside its own properties, a `$ref` beside them) takes the keys of all its parts
and is closed as one; the caller's schema is never changed. The work is bounded by the schema's size: a
schema whose closed form would be many times larger is refused (ConstraintError), not closed in part.
"""

from __future__ import annotations

import copy
import urllib.parse

from . import CodeforgeError


class ConstraintError(CodeforgeError):
    """A tool schema, response_format or tool_choice that cannot be turned into a grammar, or a token fed
    that the grammar forbids; the message names the tool or field and the fix."""


# JSON Schema keywords whose value is a schema, a list of schemas, or a map of names to schemas: where
# closed_schema looks for objects (data keywords, enum, const, default, examples, are never walked).
_SUB_ONE = ("additionalProperties", "items", "additionalItems", "contains", "not", "if", "then", "else",
            "propertyNames", "unevaluatedItems", "unevaluatedProperties")
_SUB_LIST = ("prefixItems", "items")
_SUB_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_PARTS = ("allOf", "anyOf", "oneOf")
_EXTRA = ("additionalProperties", "unevaluatedProperties")  # what says whether an object takes other keys
_MERGE_LIMIT = 256  # schemas one merged object may look through (a cycle of $refs among parts ends it)
_INLINE_LIMIT = 64  # parts copied in from their $ref per schema (a part that refers to itself ends it)
_GROWTH = (4, 500_000)  # closed_schema's work: 4 times the schema's size (~ its JSON's length), plus this


class _Open(Exception):
    """An object made of parts whose keys cannot all be listed: it is left as written."""


class _Work:
    """What closed_schema may still do, in about JSON characters (unbounded, N objects that add keys beside
    a $ref to a definition of P properties would take N*P names: 2 million for a 108 KB schema)."""

    def __init__(self, schema: dict):
        self.left = self.limit = _GROWTH[0] * _size(schema) + _GROWTH[1]
        self.inlines = _INLINE_LIMIT

    def spend(self, n: int) -> None:
        self.left -= n
        if self.left < 0:
            raise ConstraintError(
                f"schema too large once its objects are closed (past {self.limit}, ~4 times its own size): "
                f"each object that adds keys beside a $ref, allOf, anyOf or oneOf takes a copy of the keys "
                f"its parts list; use a large definition so in fewer objects")


def _size(x: object) -> int:
    """About the length of `x` as JSON, each object and list counted once."""
    n, todo, seen = 0, [x], set()
    while todo:
        s = todo.pop()
        if not isinstance(s, (dict, list)):
            n += len(s) + 2 if isinstance(s, str) else 4
        elif id(s) not in seen:
            seen.add(id(s))
            n += 2 + (sum(len(str(k)) + 4 for k in s) if isinstance(s, dict) else len(s))
            todo += s.values() if isinstance(s, dict) else s
    return n


def closed_schema(schema: dict) -> dict:
    """A copy of `schema` in which every object that lists "properties" and says nothing of other keys (no
    "additionalProperties", no "unevaluatedProperties") takes no others, as llama.cpp's JSON-schema converter
    reads a schema: JSON Schema itself would allow any extra key there, and a barely trained model writes
    them (`{"path": "a.py", ":,": true}`). `"additionalProperties": true` or a schema keeps them allowed.
    A "required" key that "properties" does not list is added to it, taking any value.

    An object made of parts (allOf; anyOf and oneOf beside its own properties; a $ref beside properties)
    takes the keys its parts list together, each with its part's schema: closing each part alone would let
    no object hold the keys of two parts. Such parts are copied in from their $ref, so that a definition
    used elsewhere alone is closed there. Where a part says it takes other keys (or cannot be followed: a
    $ref outside the schema), the object is left as written; a part `true` adds no keys. The caller's
    schema is not changed. The work (names read from parts and added, parts copied in) is bounded by
    _GROWTH, ~4 times the schema's JSON length plus 500 KB: a schema that needs more (many objects adding
    keys beside a $ref to a large definition) -> ConstraintError, not closed in part."""
    work = _Work(schema)
    root = copy.deepcopy(schema)  # closed as it is walked; parts are copied in from `schema`, as written
    todo: list[tuple[object, bool]] = [(root, False)]
    seen: set[int] = set()
    while todo:
        node, inner = todo.pop()
        if not isinstance(node, dict) or id(node) in seen:
            continue
        seen.add(id(node))
        merged = _close(schema, node, inner, work)
        for key in _PARTS:
            parts = node.get(key)
            if isinstance(parts, list):
                # allOf's parts hold together with the object whatever it says: none is closed alone
                todo += [(p, merged or key == "allOf") for p in parts]
        for key in _SUB_ONE:
            if isinstance(node.get(key), dict):
                todo.append((node[key], False))
        for key in _SUB_LIST:
            if isinstance(node.get(key), list):
                todo += [(p, False) for p in node[key]]
        for key in _SUB_MAP:
            if isinstance(node.get(key), dict):
                todo += [(p, False) for p in node[key].values()]
    return root


def _close(root: dict, node: dict, inner: bool, work: _Work) -> bool:
    """Close one object of closed_schema (in place); whether its parts are merged into it (so not closed
    alone). `inner`: the node is itself a part of a merged object. `root`: the schema as written, which the
    $refs of parts are read from."""
    if "$ref" in node and ("properties" in node or any(k in node for k in _PARTS)):
        # a $ref beside other keywords holds together with them (llguidance reads it so, as 2019-09 does)
        ref = {"$ref": node.pop("$ref")}
        node["allOf"] = (node["allOf"] if isinstance(node.get("allOf"), list) else []) + [ref]
    props = node.get("properties")
    keys = [k for k in _PARTS
            if isinstance(node.get(k), list) and (k == "allOf" or props is not None or inner)]
    for k in keys:  # the parts' own copies: their definitions may be closed where used alone
        for i, part in enumerate(node[k]):
            if isinstance(part, dict) and set(part) == {"$ref"} and work.inlines > 0:
                target = _resolve(root, part["$ref"], work)
                if isinstance(target, dict):
                    work.inlines -= 1
                    work.spend(_size(target))
                    node[k][i] = copy.deepcopy(target)
    if inner or any(k in node for k in _EXTRA):
        return inner or bool(keys)
    if not (keys or isinstance(props, dict)):
        return False
    try:
        names = _names(root, node, work)
    except _Open:
        return bool(keys)
    if names is not None and isinstance(props if props is not None else {}, dict):
        new = [n for n in names if n not in (props or {})]  # a key only required takes any value
        work.spend(sum(len(n) + 6 for n in new))
        node["properties"] = {**(props or {}), **{n: {} for n in new}}
        node["additionalProperties"] = False
    return bool(keys)


def _names(root: dict, node: dict, work: _Work) -> list[str] | None:
    """The keys an object (and its parts) lists, its own first, then its parts' in order, then those they
    require but do not list; None when none lists any; _Open when a part takes keys it does not list or
    cannot be followed."""
    out: dict[str, None] = {}
    required: dict[str, None] = {}
    listed = [False]
    count = [0]

    def visit(s: object, top: bool) -> None:
        count[0] += 1
        if s is True:  # any value: no keys to add
            return
        if not isinstance(s, dict) or count[0] > _MERGE_LIMIT:
            raise _Open
        req = s.get("required") if isinstance(s.get("required"), list) else []
        work.spend(1 + len(req) + (len(s["properties"]) if isinstance(s.get("properties"), dict) else 0))
        if "$ref" in s:
            visit(_resolve(root, s["$ref"], work), False)
        if not top and (any(s.get(k, False) is not False for k in _EXTRA) or "patternProperties" in s):
            raise _Open
        props = s.get("properties", {})
        if not isinstance(props, dict):
            raise _Open
        listed[0] = listed[0] or "properties" in s
        out.update(dict.fromkeys(props))
        required.update(dict.fromkeys(r for r in req if isinstance(r, str)))
        for key in _PARTS:
            for part in s.get(key) if isinstance(s.get(key), list) else []:
                visit(part, False)

    visit(node, True)
    return list({**out, **required}) if listed[0] else None


def _resolve(root: dict, ref: object, work: _Work, hops: int = 16) -> object:
    """The schema a local $ref ("#", "#/$defs/x") points at, through chains of $refs; None if none."""
    for _ in range(hops):
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            return None
        work.spend(len(ref))
        at: object = root
        for step in ref[2:].split("/") if ref != "#" else []:
            step = urllib.parse.unquote(step).replace("~1", "/").replace("~0", "~")
            if isinstance(at, dict) and step in at:
                at = at[step]
            elif isinstance(at, list) and step.isdigit() and int(step) < len(at):
                at = at[int(step)]
            else:
                return None
        if not (isinstance(at, dict) and set(at) == {"$ref"}):
            return at
        ref = at["$ref"]
    return None
