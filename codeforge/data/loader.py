"""Packed (B, T) batches of inputs and next-token targets from token shards.

Packing: each shard's token stream (documents back to back, separated by end-of-text) is cut into
non-overlapping chunks of T+1 tokens; a chunk gives inputs x = chunk[:-1] and targets y = chunk[1:], so
no token is padding and documents flow into each other across the separator, as in GPT-2 pre-training.

Order: an epoch is a list of all chunk ids, shuffled by a generator seeded with (seed, epoch) or kept in
order (`shuffle=False`). Rank r of `world_size` takes every world_size-th chunk starting at r, so
data-parallel ranks read disjoint data. The cursor (epoch, position) is the whole state: `state_dict()`
saves it and `load_state_dict()` restores it, so a resumed run reads exactly the next batch.
"""

from __future__ import annotations

import numpy as np
import torch

from ..fim import fim_ids, permute_window
from .shards import ShardSet


def on_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`; to a GPU from pinned memory without waiting, so the copy can overlap the
    step running (a prefetch thread's side stream)."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


class BatchLoader:
    def __init__(self, shards: ShardSet, batch_size: int, block_size: int, seed: int = 1337,
                 shuffle: bool = True, rank: int = 0, world_size: int = 1, device: str | torch.device = "cpu",
                 fim_rate: float = 0.0, fim_spm_rate: float = 0.5, special_ids: dict[str, int] | None = None):
        """fim_rate: share of documents reordered for fill-in-the-middle (fim.py), as a function of (seed,
        epoch, chunk), so a resumed run sees the same ones; needs special_ids (the FIM and EOT tokens)."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} must be in [0, world_size={world_size})")
        self.shards, self.B, self.T = shards, batch_size, block_size
        self.seed, self.shuffle, self.rank, self.world_size = seed, shuffle, rank, world_size
        self.device = torch.device(device)
        per_shard = [max(0, (len(a) - 1) // block_size) for a in shards.arrays]
        self.n_chunks = int(sum(per_shard))
        self._bounds = np.cumsum([0] + per_shard)  # chunk id -> shard via searchsorted
        self.per_epoch = self.n_chunks // world_size // batch_size  # whole batches per rank per epoch
        if self.per_epoch == 0:
            raise ValueError(
                f"{shards.dir} split {shards.split!r} has {shards.tokens} tokens: too few for one batch of "
                f"{batch_size} x {block_size + 1} tokens per rank over {world_size} rank(s); "
                f"lower --batch-size or --block-size, or prepare more data")
        self.epoch = 0
        self.pos = 0  # batches already read in this epoch (since `start`)
        self.start = 0  # sequences of this epoch's order read before `pos` counts (resumed on another split)
        self._order: np.ndarray | None = None
        self.fim_rate, self.fim_spm_rate = fim_rate, fim_spm_rate
        if fim_rate > 0:
            if not special_ids:
                raise ValueError("fim_rate > 0 needs the tokenizer's special ids")
            self._fim = fim_ids(special_ids)
            self._eot = special_ids["<|endoftext|>"]

    def _epoch_order(self) -> np.ndarray:
        if self._order is None:
            ids = np.arange(self.n_chunks, dtype=np.int64)
            if self.shuffle:
                ids = np.random.default_rng([self.seed, self.epoch]).permutation(ids)
            self._order = ids[self.start + self.rank::self.world_size]
        return self._order

    def _batches_left_from_start(self) -> int:
        return (self.n_chunks - self.start) // self.world_size // self.B

    def _chunk(self, cid: int) -> np.ndarray:
        s = int(np.searchsorted(self._bounds, cid, side="right") - 1)
        off = (cid - self._bounds[s]) * self.T
        window = self.shards.arrays[s][off:off + self.T + 1]
        if self.fim_rate > 0:
            rng = np.random.default_rng([self.seed, self.epoch, cid, 0x46494D])
            window = permute_window(np.asarray(window), self._eot, self._fim, self.fim_rate,
                                    self.fim_spm_rate, rng)
        return window

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y), each (B, T) int64, on the loader's device."""
        if self.pos >= (self.per_epoch if not self.start else self._batches_left_from_start()):
            self.epoch += 1
            self.pos = self.start = 0
            self._order = None
        ids = self._epoch_order()[self.pos * self.B:(self.pos + 1) * self.B]
        self.pos += 1
        buf = np.stack([self._chunk(int(c)) for c in ids]).astype(np.int64)  # (B, T+1)
        t = on_device(torch.from_numpy(buf), self.device)
        return t[:, :-1], t[:, 1:]

    def __iter__(self):
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.next_batch()

    @property
    def tokens_per_epoch(self) -> int:
        return self.per_epoch * self.B * self.T * self.world_size

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos, "seed": self.seed, "shuffle": self.shuffle,
                "rank": self.rank, "world_size": self.world_size, "B": self.B, "T": self.T,
                "fim_rate": self.fim_rate, "fim_spm_rate": self.fim_spm_rate, "start": self.start}

    def load_state_dict(self, state: dict) -> None:
        """Continue where `state` stopped, also with another world size or batch size: rank r reads every
        world_size-th sequence of one global order (from `start`), so what all ranks together have read is
        a prefix of it, start + pos x B x world_size sequences, whatever the split; the new split reads on
        from there to the end of the epoch."""
        state = {"fim_rate": 0.0, "fim_spm_rate": 0.5, **state}  # saved before FIM existed: none
        for k in ("seed", "shuffle", "T", "fim_rate", "fim_spm_rate"):
            if state[k] != getattr(self, k):
                raise ValueError(f"loader state was saved with {k}={state[k]!r} but this run has "
                                 f"{getattr(self, k)!r}; resume with the same setting")
        start, pos = state.get("start", 0), state["pos"]
        if (state["world_size"], state["B"]) != (self.world_size, self.B):
            start, pos = start + pos * state["B"] * state["world_size"], 0
        self.epoch, self.start, self.pos, self._order = state["epoch"], start, pos, None


class ChatBatchLoader:
    """(B, T) batches of whole conversations from chat shards (shards.py writes a loss mask beside them).

    Pieces: a conversation of at most T+1 tokens is one piece. A longer one is split at its turn boundaries
    (<|im_start|> tokens) into consecutive runs of turns that each fit; if a single turn is longer than
    T+1, the whole conversation is dropped. Both are counted (`split`, `dropped`) and never cut mid-turn.
    Rows: pieces in a seeded per-epoch order (rank r takes every world_size-th), packed greedily one after
    another into rows of T+1 tokens and padded; targets are -1 wherever the mask says the token is not
    written by an assistant, and on the padding. The cursor (epoch, position in the piece order) is the
    state, so a resumed run reads exactly the next batch, as BatchLoader does.
    """

    def __init__(self, shards: ShardSet, batch_size: int, block_size: int, start_id: int, pad_id: int,
                 seed: int = 1337, shuffle: bool = True, rank: int = 0, world_size: int = 1,
                 device: str | torch.device = "cpu"):
        if not shards.chat:
            raise ValueError(f"{shards.dir} holds plain text shards, not chat data; prepare chat JSONL with "
                             f"`codeforge prepare --chat`, or train with --stage pretrain")
        self.shards, self.B, self.T, self.pad_id = shards, batch_size, block_size, pad_id
        self.seed, self.shuffle, self.rank, self.world_size = seed, shuffle, rank, world_size
        self.device = torch.device(device)
        self.split = self.dropped = 0
        starts = shards.doc_starts()
        ends = np.append(starts[1:], shards.tokens)
        pieces: list[tuple[int, int]] = []
        for a, b in zip(starts.tolist(), ends.tolist()):
            if b - a <= block_size + 1:
                pieces.append((a, b))
                continue
            ids, _ = shards.span(a, b)
            cuts = [a + int(i) for i in np.flatnonzero(np.asarray(ids) == start_id)] + [b]
            if cuts[0] != a:
                cuts.insert(0, a)
            turns = list(zip(cuts[:-1], cuts[1:]))
            if any(e - s > block_size + 1 for s, e in turns):
                self.dropped += 1
                continue
            self.split += 1
            s0 = turns[0][0]
            for s, e in turns:
                if e - s0 > block_size + 1:
                    pieces.append((s0, s))
                    s0 = s
            pieces.append((s0, b))
        self.pieces = np.array(pieces, dtype=np.int64).reshape(-1, 2)
        self.epoch, self.pos = 0, 0
        self._order: np.ndarray | None = None
        self.per_epoch = self._count_rows(self._epoch_order()) // batch_size
        if self.per_epoch == 0:
            raise ValueError(
                f"{shards.dir} split {shards.split!r} has {len(self.pieces)} usable conversation pieces "
                f"({self.dropped} dropped with a turn longer than {block_size + 1} tokens): too few for one "
                f"batch of {batch_size} rows per rank over {world_size} rank(s); lower --batch-size, raise "
                f"the model's context, or add data")

    def _epoch_order(self) -> np.ndarray:
        if self._order is None:
            ids = np.arange(len(self.pieces), dtype=np.int64)
            if self.shuffle:
                ids = np.random.default_rng([self.seed, self.epoch]).permutation(ids)
            self._order = ids[self.rank::self.world_size]
        return self._order

    def _count_rows(self, order: np.ndarray) -> int:
        rows, used = 0, self.T + 2  # start "full" so the first piece opens a row
        for n in (self.pieces[order, 1] - self.pieces[order, 0]).tolist():
            if used + n > self.T + 1:
                rows, used = rows + 1, 0
            used += n
        return rows

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y), each (B, T) int64; y is -1 where no loss is taken."""
        order = self._epoch_order()
        ids = np.full((self.B, self.T + 1), self.pad_id, dtype=np.int64)
        mask = np.zeros((self.B, self.T + 1), dtype=bool)
        for r in range(self.B):
            used = 0
            while True:
                if self.pos >= len(order):  # epoch over: a fresh order (rows never mix two epochs)
                    if used:
                        break
                    self.epoch, self.pos, self._order = self.epoch + 1, 0, None
                    order = self._epoch_order()
                a, b = self.pieces[order[self.pos]]
                if used + (b - a) > self.T + 1:
                    break
                tok, m = self.shards.span(int(a), int(b))
                ids[r, used:used + b - a] = tok
                mask[r, used:used + b - a] = m.astype(bool)
                used += int(b - a)
                self.pos += 1
        x = torch.from_numpy(ids[:, :-1])
        y = torch.from_numpy(np.where(mask[:, 1:], ids[:, 1:], -1))
        return on_device(x, self.device), on_device(y, self.device)

    def __iter__(self):
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.next_batch()

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos, "seed": self.seed, "shuffle": self.shuffle,
                "rank": self.rank, "world_size": self.world_size, "B": self.B, "T": self.T, "chat": True}

    def load_state_dict(self, state: dict) -> None:
        for k in ("seed", "shuffle", "world_size", "B", "T"):
            if state[k] != getattr(self, k):
                raise ValueError(f"loader state was saved with {k}={state[k]!r} but this run has "
                                 f"{getattr(self, k)!r}; resume with the same setting")
        self.epoch, self.pos, self._order = state["epoch"], state["pos"], None


def batch_source(shards: ShardSet, batch_size: int, block_size: int, special_ids: dict[str, int], *,
                 seed: int = 1337, shuffle: bool = True, rank: int = 0, world_size: int = 1,
                 device: str | torch.device = "cpu", fim_rate: float = 0.0, fim_spm_rate: float = 0.5):
    """The loader the data calls for: conversation rows with masked targets for chat shards, packed chunks
    otherwise. Both yield (x, y) and save/restore their cursor."""
    if shards.chat:
        return ChatBatchLoader(shards, batch_size, block_size, special_ids["<|im_start|>"],
                               special_ids["<pad>"],
                               seed=seed, shuffle=shuffle, rank=rank, world_size=world_size, device=device)
    return BatchLoader(shards, batch_size, block_size, seed=seed, shuffle=shuffle, rank=rank,
                       world_size=world_size, device=device, fim_rate=fim_rate, fim_spm_rate=fim_spm_rate,
                       special_ids=special_ids)
