"""Short ways to the end of a grammar, for constrained decoding's token budget (constrain.py, "Budget"): from
a matcher's state, a token sequence the grammar accepts that ends the reply or the call, kept up to date after
every token. Split from constrain.py, which holds the grammars and the masks; this is the search."""

from __future__ import annotations

import collections
import re
from typing import TYPE_CHECKING

import llguidance
import numpy as np
import torch

from .chat import CALL_CLOSE, IM_END

if TYPE_CHECKING:
    from .tokenizer import CodeTokenizer

PATH_LIMIT = 1024  # the longest way to the end searched for (longer: the grammar is left without a reserve)
JOIN_STEPS = 4  # a way repaired after a token off it: greedy steps before it must rejoin the old way ...
JOIN_SKIP = 3  # ... skipping at most this many of the old way's tokens (else a whole new walk)
# inside a string that no allowed token ends: a search for the fewest tokens that end it, where
LOOK_WIDTH = 64
LOOK_NODES = 64  # each step allows at most LOOK_WIDTH tokens, through at most LOOK_NODES matchers;
# for a grammar's start way, the ends of such a string each walked on to the end (the best kept)
LOOK_ENDS = 8

_CLOSERS = re.compile(rb"[}\]]+")  # ends objects and arrays
_VALUE = re.compile(rb'(-?[0-9]+|""|true|false|null|\[\]|\{\})([}\]]*)')  # a whole JSON value, then closers
_QUOTE_END = re.compile(rb'([^"\\]*)"([}\]]*)')  # (inside a string) ends it, then closers
# JSON lexical states: outside a string, inside one, just after a backslash in one
LEX_OUT, LEX_IN, LEX_ESC = 0, 1, 2


class Ways:
    """Short ways to the end of a grammar, for the token budget: from a matcher's state, a token sequence the
    grammar accepts that ends the reply (or the call). A greedy walk on a copy of the matcher: forced tokens
    first; then </tool_call> where allowed; then the allowed token that ends things soonest for the JSON
    lexical state the text is in (inside a string: a closing quote, then closing brackets; outside one:
    closing brackets, then a separator, then a whole short value like 0, "", [], then an opening quote or
    bracket); inside a string that no allowed token ends (a key, an enum value or a tool's name to spell), the
    fewest tokens that end it, by a small breadth-first search (`_close_soon`); failing that (a minimum
    length), the longest allowed token. Every step is checked by the matcher, so what comes back is always a
    way to the end; it is short (the grammars' JSON has one layout, and its required parts are forced), not
    proven shortest. `after` keeps a way up to date after a token off it: the old way where it still holds
    (or its rest past a few tokens, or the token's split realigned), else a few greedy steps that rejoin it,
    else a new walk."""

    def __init__(self, tok: "CodeTokenizer", vocab: int):
        self.vocab = vocab
        ids = tok.special_ids
        self.eos, self.close_id = ids[IM_END], ids.get(CALL_CLOSE)
        self.special = {i for i in ids.values() if i is not None}
        self.bytes = [b"" if i in self.special else tok.token_bytes(i) for i in range(vocab)]
        self.exact = {}  # bytes -> id (the first id with them)
        out, inside, size = (np.full(vocab, -1, dtype=np.int32) for _ in range(3))
        for i, b in enumerate(self.bytes):
            if not b:
                continue
            self.exact.setdefault(b, i)
            size[i] = min(len(b), 999)
            if _CLOSERS.fullmatch(b):
                out[i] = 40000 + len(b)
            elif b in (b", ", b","):
                out[i] = 30000 + len(b)
            elif (v := _VALUE.fullmatch(b)) is not None:
                out[i] = 20000 + 100 * min(len(v.group(2)), 99) - min(len(v.group(1)), 99)
            elif b in (b'"', b"[", b"{", b"-"):
                out[i] = 10000 + (b'-{["'.index(b))
            if (q := _QUOTE_END.fullmatch(b)) is not None:
                inside[i] = 10000 - 1000 * min(len(q.group(1)), 9) + min(len(q.group(2)), 99)
        for i in self.special:
            if i < vocab:
                size[i] = 0  # a special token only as a last resort (they are forced where needed)
        self.out, self.inside, self.size = out, inside, size
        self.lex: dict[tuple[int, int], int] = {}
        # Tokens that may lengthen the way to the end by more than a token outside a string (they start or
        # end a value, a key, an item or a call); any other token there (a number's digits, a literal's
        # letters, a closing bracket) lengthens it by at most one. Inside a string any token may (a character
        # that picks a longer key, enum value or tool name): every one is checked there.
        marks = [any(c in b for c in b',{["\n') or i in self.special for i, b in enumerate(self.bytes)]
        self.structural = np.array(marks)
        self._on: dict[torch.device, torch.Tensor] = {}

    def structural_on(self, device: torch.device) -> torch.Tensor:
        """`structural` as a bool tensor on `device` (made once per device)."""
        got = self._on.get(device)
        if got is None:
            got = self._on[device] = torch.from_numpy(self.structural).to(device)
        return got

    def scan(self, state: int, token: int) -> int:
        """The JSON lexical state after `token` (a special token starts a new text, outside any string)."""
        got = self.lex.get((state, token))
        if got is None:
            got = state
            if token in self.special:
                got = LEX_OUT
            else:
                for c in self.bytes[token] if 0 <= token < self.vocab else b"":
                    if got == LEX_ESC:
                        got = LEX_IN
                    elif got == LEX_IN:
                        got = LEX_ESC if c == 0x5C else LEX_OUT if c == 0x22 else LEX_IN
                    elif c == 0x22:
                        got = LEX_IN
            self.lex[(state, token)] = got
        return got

    def _allowed(self, m: llguidance.LLMatcher) -> np.ndarray:
        bits = np.frombuffer(m.compute_bitmask(), dtype=np.uint8)
        return np.unpackbits(bits, bitorder="little")[:self.vocab].astype(bool)

    def _pick(self, m: llguidance.LLMatcher, allowed: np.ndarray, state: int, forced: bytes,
              end: bool, best: bool) -> tuple[list[int], bool] | None:
        """The next tokens of the walk: (tokens, whether they reach the end)."""
        if self.close_id is not None and allowed[self.close_id]:
            return [self.close_id], False
        for k in range(len(forced), 0, -1):  # forced bytes that no one token holds: the longest token of them
            t = self.exact.get(forced[:k])
            if t is not None and allowed[t]:
                return [t], False
        for score in (self.inside,) if state == LEX_IN else (self.out,) if state == LEX_OUT else ():
            masked = np.where(allowed, score, -1)
            t = int(masked.argmax())
            if masked[t] >= 0:
                return [t], False
        if state == LEX_IN and (got := self._close_soon(m, allowed, end, best)) is not None:
            return got
        masked = np.where(allowed, self.size, -1)
        t = int(masked.argmax())
        return ([t], False) if masked[t] >= 0 else None

    def _close_soon(self, m: llguidance.LLMatcher, allowed: np.ndarray, end: bool,
                    best: bool) -> tuple[list[int], bool] | None:
        """Inside a string that no allowed token ends with a closing quote (a key, an enum value or a tool's
        name to spell): the fewest tokens that end it, by a breadth-first search over the allowed tokens
        (longest first, one matcher per text reached: `"b"` before `"alpha_beta..."`); with `best`, each of
        the first LOOK_ENDS strings found is walked on to the end, and the shortest whole way comes back (what
        follows a tool's name or a key differs). None when no end is found through LOOK_NODES matchers, where
        each step allows at most LOOK_WIDTH tokens (wider: a free string with a minimum length, where the
        longest token does best)."""
        if int(allowed.sum()) > LOOK_WIDTH:
            return None
        queue, nodes, seen = collections.deque([(m, allowed, LEX_IN, [], b"")]), 0, set()
        # (quotes then more)
        out = [t for t in np.flatnonzero(allowed).tolist() if self.scan(LEX_IN, t) == LEX_OUT]
        ends = [(m.deep_copy(), [], max(out, key=lambda u: self.inside[u]))] if out else []
        if ends and not best:
            queue.clear()
        while queue and nodes < LOOK_NODES:
            mm, ok, state, path, text = queue.popleft()
            for t in sorted(np.flatnonzero(ok).tolist(), key=lambda t: -self.size[t]):
                reached = text + self.bytes[t]
                if self.scan(state, t) == LEX_OUT or reached in seen or nodes >= LOOK_NODES:
                    continue
                c = mm.deep_copy()
                if not c.consume_token(t):
                    continue
                seen.add(reached)
                nodes += 1
                after, inner = self._allowed(c), self.scan(state, t)
                cands = np.flatnonzero(after).tolist()
                out = [u for u in cands if self.scan(inner, u) == LEX_OUT] if len(cands) <= LOOK_WIDTH else \
                    np.flatnonzero(after & (self.inside >= 0)).tolist() if inner == LEX_IN else []
                # ends here: the quote with the most closers after it (checked on making: breadth-first)
                if out:
                    ends.append((c, path + [t], max(out, key=lambda u: self.inside[u])))
                    if not best or len(ends) >= LOOK_ENDS:
                        queue.clear()
                        break
                if len(cands) <= LOOK_WIDTH:
                    queue.append((c, after, inner, path + [t], reached))
        if not ends:
            return None
        if not best:
            return ends[0][1], False
        whole = []
        for c, path, last in ends:
            if c.consume_token(last) and (rest := self.way(c, LEX_OUT, end)) is not None:
                whole.append(path + [last] + rest)
        return (min(whole, key=len), True) if whole else (ends[0][1], False)

    def way(self, matcher: llguidance.LLMatcher, state: int, end: bool,
            old: list[int] | None = None, best: bool = False) -> list[int] | None:
        """Tokens from the matcher's state to the end (to an accepting state, then <|im_end|> when `end`);
        None when the walk finds none within PATH_LIMIT tokens. With `old` (a way from before the last token),
        the walk ends, within its first JOIN_STEPS steps, where the old way rejoins (`_join`). With `best`
        (the way from a grammar's start, which gives min_tokens), the first string to spell whose ends lead
        on differently picks the end with the shortest way after it (`_close_soon`). The matcher is not
        changed."""
        m, path, steps = matcher.deep_copy(), [], 0
        while len(path) <= PATH_LIMIT and not m.is_error():
            if (
                old is not None
                and 0 < steps <= JOIN_STEPS
                and (rest := self._join(m, state, old)) is not None
            ):
                return path + rest
            if m.is_accepting():
                return path + [self.eos] if end else path
            step = m.compute_ff_tokens()
            if not step:
                got = self._pick(m, self._allowed(m), state, m.compute_ff_bytes(), end, best)
                if got is None:
                    return None
                step, whole = got
                if whole:
                    return path + step if len(path) + len(step) <= PATH_LIMIT else None
            if not m.consume_tokens(step):
                return None
            for t in step:
                state = self.scan(state, t)
            path += step
            steps += 1
        return None

    def _join(self, m: llguidance.LLMatcher, state: int, old: list[int]) -> list[int] | None:
        """The rest of the way `old` past its first j tokens (j <= JOIN_SKIP, the most that holds) where it
        holds from the matcher's state; inside a string the whole of it is tried first (a character of the
        string leaves the way as it was)."""
        js = range(min(JOIN_SKIP, len(old) - 1), -1, -1)
        for j in (0, *js[:-1]) if state != LEX_OUT else js:
            rest = old[j:]
            if m.validate_tokens(rest) == len(rest):
                return rest
        return None

    def after(self, m: llguidance.LLMatcher, state: int, token: int, old: list[int], end: bool,
              search: bool) -> list[int] | None:
        """A way to the end from the matcher `m`, which has just consumed `token` off the way `old` (in
        lexical state `state` now): `old` realigned (the token is the start of old's first token: the rest of
        that token's bytes, then old's rest), or `_join`; else (`search`) a walk that rejoins old within a few
        steps, or a new way. None when none is found (without `search`: none cheaply)."""
        if old:
            b, first = self.bytes[token], self.bytes[old[0]]
            if b and len(first) > len(b) and first.startswith(b):
                t = self.exact.get(first[len(b):])
                if t is not None and m.validate_tokens([t, *old[1:]]) == len(old):
                    return [t, *old[1:]]
            rest = self._join(m, state, old)
            if rest is not None:
                return rest
        return self.way(m, state, end, old or None) if search else None
