"""Values crossing the sandbox's wall as plain data: ENCODE_CODE is the code the box's runner uses to encode
each return value (exact built-in types only, so no method of the program's objects runs), and
decode_value reads what ast.literal_eval parsed out of its report back, refusing anything the runner would
not have written and bounding its size. sandbox.py builds the runner around them."""

from __future__ import annotations

# Plain data out of the box: the runner encodes each return value with ENCODE_CODE (only exact built-in types,
# type(v) is int and never a subclass, so no method of the program's objects runs) and writes repr() of the
# tagged result; this side parses it with ast.literal_eval (which evaluates nothing) and decode_value. The
# inputs go in as marshal data that this side wrote. Neither needs an import in the box (json would pull in
# `re`, about 30 ms per program).
ENCODE_CODE = r"""
def encode_value(v, depth=0, budget=None):
    budget = budget if budget is not None else [MAX_VALUE_ITEMS]
    budget[0] -= 1
    if budget[0] < 0 or depth > MAX_VALUE_DEPTH:
        raise ValueError("value too large or too deep to return")
    t = type(v)
    if v is None or t is bool or t is str:
        return v
    if t is int:
        return {"i": str(v)} if abs(v) >= 1 << 53 else v
    if t is float:
        return {"f": repr(v)}
    if t is complex:
        return {"c": [repr(v.real), repr(v.imag)]}
    if t is bytes:
        return {"b": v.hex()}
    if t in (list, tuple, set, frozenset):
        tag = {list: "l", tuple: "t", set: "s", frozenset: "z"}[t]
        return {tag: [encode_value(x, depth + 1, budget) for x in v]}
    if t is dict:
        return {"d": [[encode_value(k, depth + 1, budget), encode_value(x, depth + 1, budget)]
                      for k, x in v.items()]}
    raise TypeError("not data: " + t.__qualname__)
"""
MAX_VALUE_ITEMS = 20_000        # items in one returned value (and in all of a report, when decoding)
MAX_VALUE_DEPTH = 50            # nesting of one returned value
MAX_HASHED_ITEMS = 2_000        # items of one set or dict coming back
# bytes of return values read from the box, all calls together: ast.literal_eval takes ~500 bytes of memory
# per byte of a hostile report (4 MB cost 1.9 GB in review), so this stays small; a function of a test
# returns a few values, not megabytes
REPORT_CAP = 256 * 2**10
_encoder: dict = {"MAX_VALUE_ITEMS": MAX_VALUE_ITEMS, "MAX_VALUE_DEPTH": MAX_VALUE_DEPTH}
exec(compile(ENCODE_CODE, "<codeforge.box_values encode_value>", "exec"), _encoder)  # the runner's own code
encode_value = _encoder["encode_value"]  # for encode_calls' check that the inputs are plain data


MAX_INT_DIGITS = 1000             # of an integer coming back (the runner tags any of 2**53 or more)


def decode_value(e, budget: list[int] | None = None):
    """A value encoded by ENCODE_CODE, from what ast.literal_eval parsed out of a report; ValueError for
    anything the runner would not have written. Items are counted against MAX_VALUE_ITEMS, and sets and
    dict keys may only be scalars (a set of colliding hashes costs quadratic time to build)."""
    budget = budget if budget is not None else [MAX_VALUE_ITEMS]
    budget[0] -= 1
    if budget[0] < 0:
        raise ValueError("too many items")
    t = type(e)
    if e is None or t in (bool, str):
        return e
    if t is int:
        if abs(e) >= 1 << 53:  # the runner writes these as {"i": digits}
            raise ValueError("bare integer out of range")
        return e
    if t is dict and len(e) == 1:
        (tag, x), = e.items()
        if tag == "i" and type(x) is str and len(x) <= MAX_INT_DIGITS:
            return int(x)
        if tag == "f" and type(x) is str:
            return float(x)
        if tag == "c":
            return complex(float(x[0]), float(x[1]))
        if tag == "b" and type(x) is str:
            return bytes.fromhex(x)
        if tag in ("l", "t", "s", "z") and type(x) is list:
            items = [decode_value(y, budget) for y in x]
            if tag in ("s", "z") and len(items) > MAX_HASHED_ITEMS:
                raise ValueError("set too large")
            return {"l": list, "t": tuple, "s": set, "z": frozenset}[tag](items)
        if tag == "d" and type(x) is list:
            if len(x) > MAX_HASHED_ITEMS:
                raise ValueError("dict too large")
            return {decode_value(k, budget): decode_value(y, budget) for k, y in x}
    raise ValueError("not an encoded value")
