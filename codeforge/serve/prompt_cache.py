"""llama-server's per-slot prompt cache, for the batcher's prefill: a few entries of (prompt tokens, the keys
and values a one-row prefill computed for them). A new prompt that shares a prefix with an entry's copies
those positions' keys and values and computes only the rest (at least its last token: its logits are the
first token's distribution), then replaces the entry with its own. An editor plugin sends one growing
prompt after another (llama.vim, llama.vscode: the file around the cursor, with id_slot 0), so most of a
request's prompt is cached; their warm-up requests (n_predict 0) fill the entry before the user asks.

Which entry (llama-server's get_available_slot, tools/server/server-context.cpp:1528-1640): the one a request
names (id_slot, modulo the entry count), else the one whose tokens share the longest prefix with the prompt
as a fraction of the prompt (over `similarity`, 0.1 as llama-server's --slot-prompt-similarity), else the
least recently used. Unlike llama-server's slots an entry is not a running row: any number of rows may read
one, each reads it at admission and the last to be admitted is what it holds.

Memory: an entry holds at most the context (block_size positions) of keys and values, as a one-row prefill
cache of the prompt's own length; `entries` of them are at most entries x block_size positions (the slot
cache of the batcher holds 2 x block_size x max_batch).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

SIMILARITY = 0.1  # llama-server's default --slot-prompt-similarity


@dataclass
class Entry:
    tokens: np.ndarray  # (P,) int64
    k: list[torch.Tensor]  # per layer (n_kv_head, P, head_dim)
    v: list[torch.Tensor]
    used: int  # the clock at its last use (least recently used goes first)


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading tokens a and b share."""
    m = min(len(a), len(b))
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if diff.size else m


class PromptCache:
    def __init__(self, entries: int, similarity: float = SIMILARITY):
        if entries < 1:
            raise ValueError(f"a prompt cache needs at least one entry, not {entries}")
        self.entries: list[Entry | None] = [None] * entries
        self.similarity = similarity
        self._clock = 0
        self.hits = 0  # prompts that reused at least one cached token
        self.reused_tokens = 0  # tokens they did not compute

    def __len__(self) -> int:
        return len(self.entries)

    def choose(self, prompt: list[int], slot: int | None = None) -> int:
        """The entry a prompt uses: `slot` modulo the entry count when given (>= 0), else the best shared
        prefix over the similarity threshold, else the least recently used (an empty one first)."""
        if slot is not None and slot >= 0:
            return slot % len(self.entries)
        ids = np.asarray(prompt, dtype=np.int64)
        best, f_best = None, 0.0
        for i, e in enumerate(self.entries):
            if e is None or not len(e.tokens):
                continue
            f = common_prefix(e.tokens, ids) / max(1, len(ids))
            if f > f_best and f > self.similarity:
                best, f_best = i, f
        if best is not None:
            return best
        return min(range(len(self.entries)),
                   key=lambda i: -1 if self.entries[i] is None else self.entries[i].used)

    def reuse(self, i: int, prompt: list[int]) -> tuple[int, list[torch.Tensor], list[torch.Tensor]]:
        """(n_past, keys, values) of entry i for a prompt: n_past tokens of the prompt (its shared prefix, at
        most len(prompt) - 1) have their keys and values in keys/values[:, :n_past]."""
        e = self.entries[i]
        if e is None:
            return 0, [], []
        n = min(common_prefix(e.tokens, np.asarray(prompt, dtype=np.int64)), len(prompt) - 1)
        if n > 0:
            self.hits += 1
            self.reused_tokens += n
        return max(0, n), e.k, e.v

    def store(self, i: int, prompt: list[int], k: list[torch.Tensor], v: list[torch.Tensor]) -> None:
        """Entry i now holds this prompt's keys and values (per layer (n_kv_head, len(prompt), head_dim))."""
        self._clock += 1
        self.entries[i] = Entry(np.asarray(prompt, dtype=np.int64), k, v, self._clock)

    def clear(self) -> None:
        self.entries = [None] * len(self.entries)

    def tokens_held(self) -> int:
        return sum(len(e.tokens) for e in self.entries if e is not None)
