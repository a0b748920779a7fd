"""The match starts of a Python regex's `finditer` over a long text, found at Hyperscan's speed and exactly
the same as `re` finds them.

Python's `re` tries a pattern at every position whose character can begin it; an alternation of many words
and shapes (redact.py's marking patterns) begins at most characters of code, so it runs at ~13 MB/s.
Hyperscan runs such a pattern at hundreds of MB/s, but it reports where matches END, not where they start,
and it has no lookarounds. So:

1. The pattern is turned into a Hyperscan pattern that matches the REVERSED text wherever the original could
   match forwards (its parse tree read backwards): every assertion (lookaround, `\\b`, `^`) dropped, which
   only widens it; every character class as the explicit set of ASCII bytes it holds, plus `?` where it
   holds any other character.
2. The text is encoded one byte a character (`str.encode("ascii", "replace")`: each other character `?`) and
   reversed; each end Hyperscan reports there is a position where the original pattern may START. Together
   they hold every position where it can match (a superset: a wider pattern, `?` for any other character).
3. `finditer` is replayed on those candidates alone: from position 0, the first candidate at or after the
   current position where `pattern.match(text, c)` succeeds is the next match, and the search goes on from
   its end. `re` finds the same: its next match is the leftmost position at or after the end of the last
   where the pattern matches, and every such position is a candidate (a lookbehind sees the text before
   `pos`, as in a search).

So the answer is `re`'s own, decided by `re`; Hyperscan only skips the positions where nothing can start. A
pattern this does not translate (a back reference, IGNORECASE, a pattern that can match empty), and any
machine without the `hyperscan` package, get `re`'s plain `finditer`.
"""

from __future__ import annotations

import functools
import re
import threading
from collections.abc import Callable

try:
    import re._constants as _c  # Python 3.11+
    import re._parser as _p
except ImportError:  # pragma: no cover - Python 3.10
    import sre_constants as _c  # type: ignore[no-redef]
    import sre_parse as _p  # type: ignore[no-redef]

try:
    import hyperscan
except ImportError:  # pragma: no cover - a dependency; a machine without its library still runs
    hyperscan = None

OTHER = ord("?")  # the byte every character beyond ASCII is scanned as (and `?` itself)


class Untranslatable(ValueError):
    """A pattern with a construct the reversed Hyperscan pattern cannot stand for."""


def _byte(b: int) -> str:
    return f"\\x{b:02x}"


def _class(members: set[int]) -> str:
    if not members:
        raise Untranslatable("an empty character class")
    return "[" + "".join(_byte(b) for b in sorted(members)) + "]"


ASCII = [chr(i) for i in range(128)]


def _ascii_matching(rx: re.Pattern) -> set[int]:
    return {i for i, ch in enumerate(ASCII) if rx.match(ch)}


@functools.lru_cache(maxsize=4096)
def _literal_members(c: int) -> frozenset[int]:
    """The bytes a literal character stands for under IGNORECASE."""
    members = _ascii_matching(re.compile(re.escape(chr(c)), re.IGNORECASE))
    if c > 127 or _cased(members):
        members.add(OTHER)
    return frozenset(members)


def _cased(members: set[int]) -> bool:
    return any(chr(i).isalpha() for i in members)


@functools.lru_cache(maxsize=4096)
def _members(items: tuple, flags: int) -> frozenset[int]:
    """The bytes a character class of the parse tree holds: the ASCII characters Python's class matches
    (tested one by one against the class itself, with the pattern's flags), and OTHER where it may match a
    character beyond ASCII (under IGNORECASE, one whose case is an ASCII letter's: the Kelvin sign is `k`)."""
    negate = any(op is _c.NEGATE for op, _ in items)
    beyond = negate  # a negated class holds nearly every character beyond ASCII
    parts = []
    for op, av in items:
        if op is _c.NEGATE:
            continue
        if op is _c.LITERAL:
            beyond |= av > 127
            parts.append(re.escape(chr(av)))
        elif op is _c.RANGE:
            beyond |= av[1] > 127
            parts.append(re.escape(chr(av[0])) + "-" + re.escape(chr(av[1])))
        elif op is _c.CATEGORY:
            beyond = True  # \w, \s, \d and their negations hold characters beyond ASCII
            parts.append({
                _c.CATEGORY_DIGIT: r"\d", _c.CATEGORY_NOT_DIGIT: r"\D", _c.CATEGORY_SPACE: r"\s",
                _c.CATEGORY_NOT_SPACE: r"\S", _c.CATEGORY_WORD: r"\w", _c.CATEGORY_NOT_WORD: r"\W",
            }.get(av) or _unsupported(f"category {av}"))
        else:
            raise Untranslatable(f"class item {op}")
    out = _ascii_matching(re.compile("[" + ("^" if negate else "") + "".join(parts) + "]",
                                     flags & (re.ASCII | re.IGNORECASE)))
    if beyond or (flags & re.IGNORECASE and _cased(out)):
        out.add(OTHER)
    return frozenset(out)


def _unsupported(what: str):
    raise Untranslatable(what)


ALL = set(range(128))
WIDEN = 16  # a repeat bounded above this is scanned unbounded
_REPEATS = (_c.MAX_REPEAT, _c.MIN_REPEAT) + tuple(
    getattr(_c, name) for name in ("POSSESSIVE_REPEAT",) if hasattr(_c, name))


class _Translation:
    """A parse tree as a Hyperscan pattern over the bytes scanned (one a character: ASCII as itself, any other
    character OTHER), matching every string the Python pattern matches, or those strings reversed
    (`backwards`): assertions dropped, classes as explicit bytes, a back reference as its group's pattern."""

    def __init__(self, tree, backwards: bool):
        self.backwards = backwards
        self.groups: dict[int, tuple] = {}  # group number -> (its sequence, the flags inside it)
        self._collect(tree, tree.state.flags)

    def _collect(self, sub, flags: int) -> None:
        for op, av in sub:
            if op is _c.SUBPATTERN:
                group, add, drop, inner = av
                inner_flags = (flags | add) & ~drop
                if group is not None:
                    self.groups[group] = (inner, inner_flags)
                self._collect(inner, inner_flags)
            elif op in _REPEATS:
                self._collect(av[2], flags)
            elif op is _c.BRANCH:
                for alt in av[1]:
                    self._collect(alt, flags)
            elif op is getattr(_c, "ATOMIC_GROUP", None) or op in (_c.ASSERT, _c.ASSERT_NOT):
                self._collect(av if op is not _c.ASSERT and op is not _c.ASSERT_NOT else av[1], flags)
            elif op is _c.GROUPREF_EXISTS:
                for alt in av[1:]:
                    if alt is not None:
                        self._collect(alt, flags)

    def literal(self, c: int, flags: int) -> str:
        if not flags & re.IGNORECASE:
            return _byte(c if c < 128 else OTHER)
        return _class(_literal_members(c))

    def seq(self, sub, flags: int) -> str:
        items = list(sub)
        out = []
        for op, av in reversed(items) if self.backwards else items:
            if op is _c.LITERAL:
                out.append(self.literal(av, flags))
            elif op is _c.NOT_LITERAL:
                out.append(_class(ALL | {OTHER}))  # all but one character: every byte can stand for one
            elif op is _c.IN:
                out.append(_class(_members(tuple(av), flags & (re.ASCII | re.IGNORECASE))))
            elif op is _c.ANY:
                out.append(_class(ALL | {OTHER}))
            elif op in _REPEATS:
                lo, hi, inner = av
                # a long bounded repeat as an unbounded one: a wider pattern (re decides), compiled ~3x faster
                top = "" if hi is _c.MAXREPEAT or hi > WIDEN else str(hi)
                out.append(f"(?:{self.seq(inner, flags)}){{{lo},{top}}}")
            elif op is _c.SUBPATTERN:
                _, add, drop, inner = av
                out.append(f"(?:{self.seq(inner, (flags | add) & ~drop)})")
            elif op is getattr(_c, "ATOMIC_GROUP", None):
                out.append(f"(?:{self.seq(av, flags)})")  # atomic matches a subset of the plain group
            elif op is _c.BRANCH:
                out.append("(?:" + "|".join(self.seq(alt, flags) for alt in av[1]) + ")")
            elif op is _c.GROUPREF:
                if av not in self.groups:
                    raise Untranslatable(f"a reference to group {av}")
                inner, inner_flags = self.groups[av]
                # the text the group matched, perhaps in another case under IGNORECASE
                out.append(f"(?:{self.seq(inner, inner_flags | (flags & re.IGNORECASE))})")
            elif op is _c.GROUPREF_EXISTS:
                _, yes, no = av
                alts = [self.seq(yes, flags), self.seq(no, flags) if no is not None else ""]
                out.append("(?:" + "|".join(alts) + ")")
            elif op in (_c.ASSERT, _c.ASSERT_NOT, _c.AT):
                continue  # an assertion only narrows where a match is: without it, a superset
            else:
                raise Untranslatable(f"{op}")
        return "".join(out)


def translated(rx: re.Pattern, backwards: bool = False) -> str:
    """A Hyperscan pattern (bytes one a character, as scanned) matching, wherever `rx` can match, the text
    (or with `backwards`, the reversed text) there. A pattern that can match the empty string is refused
    (it matches everywhere)."""
    if not isinstance(rx.pattern, str):
        raise Untranslatable("a bytes pattern")
    if rx.flags & re.LOCALE:
        raise Untranslatable("LOCALE")
    tree = _p.parse(rx.pattern, rx.flags)
    if tree.getwidth()[0] == 0:
        raise Untranslatable("a pattern that can match empty")
    try:
        return _Translation(tree, backwards).seq(tree, tree.state.flags)
    except RecursionError:
        raise Untranslatable("nested too deep") from None


def reversed_pattern(rx: re.Pattern) -> str:
    """translated(rx, backwards=True): every place `rx` can match forwards, as the reversed text's matches."""
    return translated(rx, backwards=True)


# Every scan runs over the data and PAD after it, and a match ending in PAD is dropped: the hyperscan 0.9.1
# wheel misses some matches that end exactly at the end of a short buffer (`[s-~] [Ds-~][ ?k]\?` on 2,000
# random short buffers ending in `z D ?`: 209 missed; with one byte after the data, none; found by this
# project's hostile review, 2026-11-29). The patterns hold no assertion, so bytes after the data cannot take
# away a match that ends before them.
PAD = b"\0" * 16


class _Db:
    """One Hyperscan database, compiled once and shared by every thread (Hyperscan's compiler lets the other
    threads run, so `compile()` on a thread of its own overlaps other work), with a scratch space per thread
    (a scan's working memory is one thread's)."""

    def __init__(self, expressions: list[bytes], flags: int = 0, literal: bool = False):
        self.expressions, self.flags, self.literal = expressions, flags, literal
        self._db = None
        self._lock = threading.Lock()
        self._local = threading.local()

    def compile(self):
        if self._db is None:
            with self._lock:
                if self._db is None:
                    db = hyperscan.Database(mode=hyperscan.HS_MODE_BLOCK)
                    n = len(self.expressions)
                    db.compile(expressions=self.expressions, ids=list(range(n)), elements=n,
                               flags=[self.flags] * n, literal=self.literal)
                    self._db = db
        return self._db

    def scan(self, data: bytes, on_match: Callable) -> None:
        db = self.compile()
        scratch = getattr(self._local, "scratch", None)
        if scratch is None:
            scratch = self._local.scratch = hyperscan.Scratch(db)
        n = len(data)

        def within(i: int, start: int, end: int, flags: int, ctx) -> bool | None:
            return on_match(i, start, end, flags, ctx) if end <= n else None
        try:  # padded: see PAD
            db.scan(data + PAD, match_event_handler=within, scratch=scratch)
        except hyperscan.ScanTerminated:  # the handler said it had seen enough
            pass


def _compiled(dbs: list[_Db]) -> bool:
    """Whether Hyperscan compiles every database (False: a pattern it refuses, a machine it cannot run on)."""
    try:
        for db in dbs:
            db.compile()
    except hyperscan.error:
        return False
    return True


# a text with more candidates than one in CROWDED positions (a hostile run of `MMMM...`: each a candidate re
# rejects) is scanned by re alone, so such a text costs what it did (a Python step a candidate costs ~10x
# re's own try at a position)
CROWDED = 32


class Starts:
    """`starts(texts)` is `[[m.start() for m in rx.finditer(t)] for rx, t in zip(patterns, texts)]`: the
    match starts of each pattern over its own text (the texts are of one length, one position a character:
    a text and its lower case, say), found as the module says. `warm()` compiles its databases now."""

    def __init__(self, patterns: list[re.Pattern], probes: tuple[str, ...] = ()):
        self.patterns = list(patterns)
        self.probes = probes  # texts warm() checks the answers on: any difference, and re answers alone
        self.fast = hyperscan is not None
        if self.fast:
            try:  # one database a pattern: each scans its own text alone
                self.dbs = [_Db([reversed_pattern(rx).encode()]) for rx in self.patterns]
            except Untranslatable:
                self.fast = False

    def warm(self) -> None:
        if self.fast and self.dbs[0]._db is None:
            self.fast = _compiled(self.dbs) and all(
                _starts(rx, db, t) == [m.start() for m in rx.finditer(t)]
                for rx, db in zip(self.patterns, self.dbs) for t in self.probes)

    def __call__(self, texts: list[str]) -> list[list[int]]:
        self.warm()
        if not self.fast:
            return [[m.start() for m in rx.finditer(t)] for rx, t in zip(self.patterns, texts)]
        n = len(texts[0])
        if any(len(t) != n for t in texts):
            raise ValueError("the texts differ in length")
        return [_starts(rx, db, text) for rx, text, db in zip(self.patterns, texts, self.dbs)]


def _starts(rx: re.Pattern, db: _Db, text: str) -> list[int]:
    """rx's finditer starts over text, from the reversed scan's candidates (or re alone when crowded)."""
    n = len(text)
    limit = n // CROWDED + 64
    found: set[int] = set()

    def on_match(_i: int, _from: int, to: int, _flags: int, _ctx, add: Callable = found.add,
                 size: Callable = found.__len__) -> bool:
        add(n - to)
        return size() > limit  # crowded: stop, and let re scan it
    db.scan(text.encode("ascii", "replace")[::-1], on_match)
    if len(found) > limit:
        return [m.start() for m in rx.finditer(text)]
    starts, pos, match = [], 0, rx.match
    for c in sorted(found):
        if c < pos:
            continue
        m = match(text, c)
        if m:
            starts.append(c)
            pos = m.end()
    return starts


class AnyOf:
    """`any_of(data)`: whether any of the byte strings occurs in `data`, by one Hyperscan pass (a pure literal
    database: compiled in ~0.1 s for thousands). `fast` is False without the hyperscan package (or where it
    cannot compile them); the caller then asks otherwise."""

    def __init__(self, literals: list[bytes]):
        self.literals = sorted(set(literals))
        self.fast = hyperscan is not None and bool(self.literals)
        if self.fast:
            self.db = _Db(self.literals, hyperscan.HS_FLAG_SINGLEMATCH, literal=True)
            self.fast = _compiled([self.db])

    def __call__(self, data: bytes) -> bool:
        found = []

        def on_match(*_) -> bool:
            found.append(True)
            return True  # one is enough: the scan stops
        self.db.scan(data, on_match)
        return bool(found)


class Gate:
    """`gate(lines)`: for each line, the numbers of the pattern groups (`groups[k]`, a list of patterns each)
    one of whose patterns may match somewhere in it, found by one Hyperscan pass a line; every group with a
    pattern not translated is in every line's set. A group missing from a line's set has no match in it:
    each pattern is widened to a Hyperscan pattern matching every string it matches (assertions dropped), so
    a match inside the line is one Hyperscan reports. `warm()` compiles its database now."""

    def __init__(self, groups: list[list[re.Pattern] | None], probes: tuple[str, ...] = ()):
        self.groups = groups
        self.probes = probes  # lines warm() checks: a group one of whose patterns matches must be in its set
        self.always: set[int] = set()
        owners: dict[bytes, list[int]] = {}  # each expression once (detect-secrets' keyword plugin has 64
        # patterns, 10 of them distinct: compiled 1.1 -> 0.2 s), with the groups it stands for
        for k, patterns in enumerate(groups):
            try:
                if not patterns:
                    raise Untranslatable("no pattern")
                exprs = [translated(rx).encode() for rx in patterns]
            except Untranslatable:
                self.always.add(k)
                continue
            for e in exprs:
                owners.setdefault(e, []).append(k)
        self.expressions = list(owners)
        self.owners = [sorted(set(v)) for v in owners.values()]
        self.fast = hyperscan is not None and bool(self.expressions)
        if self.fast:  # one report a pattern a line is enough
            self.db = _Db(self.expressions, hyperscan.HS_FLAG_SINGLEMATCH)
        else:
            self.always |= {k for ks in self.owners for k in ks}

    def warm(self) -> None:
        if self.fast and self.db._db is None and not (_compiled([self.db]) and self._probes_pass()):
            self.fast = False
            self.always |= {k for ks in self.owners for k in ks}

    def _probes_pass(self) -> bool:
        for line, got in zip(self.probes, self._sets(list(self.probes))):
            want = {k for k, patterns in enumerate(self.groups)
                    if any(rx.search(line) for rx in patterns or ())}
            if not want <= got:
                return False
        return True

    def __call__(self, lines: list[str]) -> list[set[int]]:
        self.warm()
        return self._sets(lines)

    def _sets(self, lines: list[str]) -> list[set[int]]:
        out = [set(self.always) for _ in lines]
        if not self.fast:
            return out
        owners = self.owners
        for found, line in zip(out, lines):
            if not line:
                continue

            def on_match(i: int, _from: int, _to: int, _flags: int, _ctx,
                         add: Callable = found.update) -> None:
                add(owners[i])
            self.db.scan(line.encode("ascii", "replace"), on_match)
        return out
