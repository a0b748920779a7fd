"""The procedural task families of `codeforge make-tasks` and the RL stages: string, list, arithmetic and dict
functions at three levels, each a function that draws its constants, names and argument names from a seeded
Random and returns the prompt, the reference solution and the test inputs; `generate_tasks` turns them into
task dicts (code_tasks.py's docstring describes a task, its split and how it is scored).

A new family is one function here and one row of FAMILIES."""

from __future__ import annotations

import copy
import json
import random
import textwrap
from dataclasses import dataclass, field
from typing import Callable

from .. import CodeforgeError
from ..corpus import content_hash, split_of

KINDS = ("string", "list", "arithmetic", "dict")
LEVELS = (1, 2, 3)
HELDOUT_FRACTION = 0.2
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
            "swapcase": f"returns `{s}` with the case of every letter swapped "
                        "(upper to lower, lower to upper)"}
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
    f, s = p.pick(f"count_{c}", f"count_letter_{c}", f"occurrences_of_{c}",
                  f"how_many_{c}s"), p.pick(*STR_ARGS)
    return _Spec(f, (s,), f"returns how many times the character {_q(c)} occurs in `{s}`",
                 f"return sum(1 for ch in {s} if ch == {c!r})", lambda r: (_text(r, 1, 8),),
                 [("",), (c * 3,)])


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
    piece, pair, example = ((f"{s}[i] + str(j - i)", "the character followed by the length of the run",
                             "a3b1")
                            if order == "char_first" else
                            (f"str(j - i) + {s}[i]", "the length of the run followed by the character",
                             "3a1b"))
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
    return _Spec(f, (s,),
                 f"returns True when `{s}` reads the same forwards and backwards once everything but "
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
                 'When several words are equally long, return the first of them; '
                 'when there are none, return "".')


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
                 "-": (f"subtract_{NUM[k]}_from_each", f"decrease_all_by_{NUM[k]}",
                       f"lower_by_{NUM[k]}")}[op])
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
    return _Spec(f, (xs,),
                 f"returns the second {op} distinct value in `{xs}`, or None when it has fewer than "
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
    return _Spec(f, (xs,),
                 f"returns how many pairs of positions i < j there are with {xs}[i] + {xs}[j] == {k}",
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
    does, body = {"diff": (f"returns the absolute difference between `{a}` and `{b}`",
                           f"return abs({a} - {b})"),
                  "max": (f"returns the larger of `{a}` and `{b}`", f"return {a} if {a} >= {b} else {b}"),
                  "min": (f"returns the smaller of `{a}` and `{b}`",
                          f"return {a} if {a} <= {b} else {b}")}[op]
    return _Spec(f, (a, b), does, body, lambda r: (r.randint(-30, 30), r.randint(-30, 30)), [(0, 0), (3, -3)])


@_family("arithmetic", 1)
def _clamp(p: _Draw) -> _Spec:
    lo = p.int(-10, 10)
    hi = p.int(lo + 1, lo + 20)
    f, x = p.pick("clamp", "limit", "clip", "bound"), p.pick(*INT_ARGS)
    return _Spec(f, (x,),
                 f"returns `{x}` limited to the range {lo} to {hi}: {lo} when `{x}` is smaller, {hi} "
                 f"when it is larger, else `{x}` itself", f"return min(max({x}, {lo}), {hi})",
                 lambda r: (r.randint(lo - 15, hi + 15),), [(lo,), (hi,)])


@_family("arithmetic", 2)
def _sum_multiples(p: _Draw) -> _Spec:
    k = p.int(2, 9)
    f = p.pick(f"sum_multiples_of_{NUM[k]}", f"sum_of_{NUM[k]}s", f"multiples_{k}_total")
    n = p.pick("n", "limit", "upto", "top")
    return _Spec(f, (n,),
                 f"returns the sum of the integers from 1 to `{n}` inclusive that are divisible by {k} "
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
                  "count": (f"returns how many decimal digits `{x}` has (0 has one)",
                            f"return len(str(abs({x})))"),
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
                 f"below 1)", f"return sum(i ** {e} for i in range(1, {n} + 1))",
                 lambda r: (r.randint(1, 30),), [(0,), (1,), (-2,)])


@_family("arithmetic", 3)
def _digital_root(p: _Draw) -> _Spec:
    op = p.pick("root", "steps")
    f = p.pick(*{"root": ("digital_root", "reduce_digits", "repeated_digit_sum"),
                 "steps": ("additive_persistence", "digit_sum_steps", "steps_to_one_digit")}[op])
    n = p.pick(*INT_ARGS)
    step = f"{n} = sum(int(d) for d in str({n}))"
    if op == "root":
        does = (f"replaces `{n}`, a non-negative integer, by the sum of its decimal digits until it has a "
                f"single digit, and returns that digit")
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
    body = (f"g, h = {a}, {b}\nwhile h:\n    g, h = h, g % h\nreturn "
            f"{'g' if op == 'gcd' else f'{a} * {b} // g'}")
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
    return _Spec(f, (n,),
                 f"returns the {'sum' if op == 'sum' else 'number'} of the prime numbers less than or "
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
    return _Spec(f, (n,),
                 f'returns a list of strings for the numbers 1 to `{n}`: "{w1}" for multiples of {a}, '
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
    f = p.pick(*{"keys": ("sorted_keys", "key_list", "keys_in_order"),
                 "total": ("total", "sum_values", "value_sum"),
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
    return _Spec(f, (d,),
                 f"returns the keys of the dict `{d}` whose value is {'greater' if op == '>' else 'less'} "
                 f"than {k}, as a sorted list", f"return sorted(k for k, v in {d}.items() if v {op} {k})",
                 lambda r: (_scores(r),), [({},), ({"x": k},)])


@_family("dict", 2)
def _invert(p: _Draw) -> _Spec:
    f, d = p.pick("invert", "invert_dict", "swap_keys_values", "reverse_mapping"), p.pick(*DICT_ARGS)

    def rand(r: random.Random) -> tuple:
        keys = r.sample(WORDS, r.randint(1, 5))
        return (dict(zip(keys, r.sample(range(-10, 30), len(keys)))),)
    return _Spec(f, (d,), f"returns a new dict that maps each value of the dict `{d}` to its key",
                 f"return {{v: k for k, v in {d}.items()}}", rand, [({},)],
                 f"The values of `{d}` are all different.")


@_family("dict", 2)
def _filter_dict(p: _Draw) -> _Spec:
    op = p.pick("even", "odd", "positive")
    f = p.pick(f"keep_{op}_values", f"{op}_entries", f"only_{op}")
    d = p.pick(*DICT_ARGS)
    test = {"even": "v % 2 == 0", "odd": "v % 2 == 1", "positive": "v > 0"}[op]
    return _Spec(f, (d,),
                 f"returns a new dict holding only the entries of the dict `{d}` whose value is {op}",
                 f"return {{k: v for k, v in {d}.items() if {test}}}", lambda r: (_scores(r),), [({},)])


@_family("dict", 2)
def _tally(p: _Draw) -> _Spec:
    alphabet = p.pick("ints", "letters")
    f, xs = p.pick("tally", "count_each", "occurrences", "histogram"), p.pick(*LIST_ARGS[:3])
    body = f"out = {{}}\nfor v in {xs}:\n    out[v] = out.get(v, 0) + 1\nreturn out"

    def rand(r: random.Random) -> tuple:
        pool = [0, 1, 2, 3, 5] if alphabet == "ints" else list("abcd")
        return ([r.choice(pool) for _ in range(r.randint(1, 8))],)
    return _Spec(f, (xs,),
                 f"returns a dict mapping each element of the list `{xs}` to the number of times it "
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
    return _Spec(f, (s,),
                 f"returns a dict mapping {which} of `{s}`, in lower case, to the number of times it "
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
    return _Spec(f, (a, b),
                 f"returns a new dict with every key of the dicts `{a}` and `{b}`; a key found in both "
                 f"maps to {both}", body, lambda r: (_scores(r), _scores(r)), [({}, {}), ({"x": 1}, {})])


@_family("dict", 3)
def _arg_extreme(p: _Draw) -> _Spec:
    op = p.pick("largest", "smallest")
    f = p.pick(*{"largest": ("key_of_max", "argmax", "best_key"),
                 "smallest": ("key_of_min", "argmin", "worst_key")}[op])
    d = p.pick(*DICT_ARGS)
    body = (f"best = None\nfor k, v in {d}.items():\n    if best is None or v "
            f"{'>' if op == 'largest' else '<'} {d}[best]:\n        best = k\nreturn best")
    return _Spec(f, (d,),
                 f"returns the key of the dict `{d}` with the {op} value, or None when `{d}` is empty",
                 body, lambda r: (_scores(r, 0, 5),), [({},), ({"a": 1, "b": 1},)],
                 f"When several keys tie, return the first of them in the order of `{d}`.")


@_family("dict", 3)
def _char_index(p: _Draw) -> _Spec:
    op = p.pick("first", "last")
    f, s = p.pick(f"{op}_positions", f"{op}_index_of_each", f"{op}_seen"), p.pick(*STR_ARGS)
    cond = "    if ch not in out:\n        out[ch] = i" if op == "first" else "    out[ch] = i"
    return _Spec(f, (s,),
                 f"returns a dict mapping each character of `{s}` to the index of its {op} occurrence "
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
