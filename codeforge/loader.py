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

from .shards import ShardSet


class BatchLoader:
    def __init__(self, shards: ShardSet, batch_size: int, block_size: int, seed: int = 1337,
                 shuffle: bool = True, rank: int = 0, world_size: int = 1, device: str | torch.device = "cpu"):
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
        self.pos = 0  # batches already read in this epoch
        self._order: np.ndarray | None = None

    def _epoch_order(self) -> np.ndarray:
        if self._order is None:
            ids = np.arange(self.n_chunks, dtype=np.int64)
            if self.shuffle:
                ids = np.random.default_rng([self.seed, self.epoch]).permutation(ids)
            self._order = ids[self.rank::self.world_size]
        return self._order

    def _chunk(self, cid: int) -> np.ndarray:
        s = int(np.searchsorted(self._bounds, cid, side="right") - 1)
        off = (cid - self._bounds[s]) * self.T
        return self.shards.arrays[s][off:off + self.T + 1]

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y), each (B, T) int64, on the loader's device."""
        if self.pos >= self.per_epoch:
            self.epoch += 1
            self.pos = 0
            self._order = None
        ids = self._epoch_order()[self.pos * self.B:(self.pos + 1) * self.B]
        self.pos += 1
        buf = np.stack([self._chunk(int(c)) for c in ids]).astype(np.int64)  # (B, T+1)
        t = torch.from_numpy(buf)
        if self.device.type == "cuda":
            t = t.pin_memory().to(self.device, non_blocking=True)
        else:
            t = t.to(self.device)
        return t[:, :-1], t[:, 1:]

    def __iter__(self):
        while True:
            yield self.next_batch()

    @property
    def tokens_per_epoch(self) -> int:
        return self.per_epoch * self.B * self.T * self.world_size

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos, "seed": self.seed, "shuffle": self.shuffle,
                "rank": self.rank, "world_size": self.world_size, "B": self.B, "T": self.T}

    def load_state_dict(self, state: dict) -> None:
        for k in ("seed", "shuffle", "world_size", "B", "T"):
            if state[k] != getattr(self, k):
                raise ValueError(f"loader state was saved with {k}={state[k]!r} but this run has "
                                 f"{getattr(self, k)!r}; resume with the same setting")
        self.epoch, self.pos, self._order = state["epoch"], state["pos"], None
