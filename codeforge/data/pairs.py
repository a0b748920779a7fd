"""Preference pairs as the trainer's batch source: encoded pairs (prompt + each response, targets only on
the response), batches with a seeded shuffle per epoch and this rank's share, and the rows read from a
`codeforge make-pairs` directory or a JSONL file of your own.

A pair's two sides are encoded as the prompt followed by the response: conversational pairs with the chat
template (as SFT saw them), standard pairs as plain text ending in end-of-text. Only response tokens are
targets. A pair whose prompt alone fills the context is dropped (counted); a response past it is cut.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from ..chat import encode_conversation
from ..corpus import content_hash, split_of
from ..fields import ConfigError
from ..mining.pairs import PairError, load_pairs
from ..tokenizer import CodeTokenizer


def encode_side(tok: CodeTokenizer, row: dict, side: str) -> tuple[list[int], list[int]]:
    """(ids, targets) of prompt + one response; targets = ids on response tokens, -1 elsewhere."""
    if row["chat"]:
        prompt = (
            row["prompt"] if isinstance(row["prompt"], list) else [{"role": "user", "content": row["prompt"]}]
        )
        ids, mask = encode_conversation(tok, prompt + [{"role": "assistant", "content": row[side]}])
    else:
        p, r = tok.encode(row["prompt"]), tok.encode(row[side]) + [tok.eot_id]
        ids, mask = p + r, [0] * len(p) + [1] * len(r)
    return ids, [i if m else -1 for i, m in zip(ids, mask)]


class PairData:
    """Encoded pairs: per pair (chosen ids, chosen targets, rejected ids, rejected targets), each at most
    block_size + 1 tokens."""

    def __init__(self, rows: list[dict], tok: CodeTokenizer, limit: int):
        """limit: tokens a side may keep (block_size + 1 for DPO, which shifts; block_size for the reward
        model, which reads the whole sequence)."""
        self.pairs, self.dropped, self.cut, self.same = [], 0, 0, 0
        for row in rows:
            sides = [encode_side(tok, row, s) for s in ("chosen", "rejected")]
            if any(next((i for i, y in enumerate(tg) if y >= 0), len(tg)) >= limit - 4 for _, tg in sides):
                self.dropped += 1  # the prompt alone (nearly) fills the context: nothing to compare
                continue
            cut = tuple(x[:limit] for side in sides for x in side)
            if cut[0] == cut[2]:
                self.same += 1  # the sides differ only past the context: no signal
                continue
            self.cut += any(len(ids) > limit for ids, _ in sides)
            self.pairs.append(cut)

    def __len__(self) -> int:
        return len(self.pairs)

    def collate(self, idx: list[int], pad_id: int, device: torch.device) -> dict:
        """{"ids", "targets": (2B, T) with the B chosen rows first, then the B rejected, right-padded; "last":
        (2B,) index of each row's last response token}."""
        seqs = [self.pairs[i][0:2] for i in idx] + [self.pairs[i][2:4] for i in idx]
        T = max(len(ids) for ids, _ in seqs)
        ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
        tg = torch.full((len(seqs), T), -1, dtype=torch.long)
        for r, (a, b) in enumerate(seqs):
            ids[r, :len(a)] = torch.tensor(a)
            tg[r, :len(b)] = torch.tensor(b)
        # the last response token (<|im_end|> or end-of-text), where the reward model is read, as PPO reads it
        last = torch.tensor([max(i for i, y in enumerate(b) if y >= 0) for _, b in seqs])
        return {"ids": ids.to(device), "targets": tg.to(device), "last": last.to(device)}


class PairBatches:
    """The trainer's batch source over PairData: a seeded shuffle per epoch, this rank's share of it, and a
    cursor that resumes exactly."""

    def __init__(self, data: PairData, batch_size: int, pad_id: int, seed: int, device: torch.device,
                 rank: int = 0, world: int = 1):
        if len(data) < batch_size * world:
            raise ConfigError(f"{len(data)} usable pair(s) for a batch of {batch_size} x {world} rank(s); "
                              f"lower --batch-size or bring more pairs")
        self.data, self.bs, self.pad_id, self.seed, self.device = data, batch_size, pad_id, seed, device
        self.rank, self.world = rank, world
        self.per_epoch = len(data) // (batch_size * world)
        self.epoch, self.cursor = 0, 0
        self._shuffled: tuple[int, list[int]] | None = None  # (epoch, order): drawn once an epoch

    def _order(self) -> list[int]:
        if self._shuffled is None or self._shuffled[0] != self.epoch:
            order = list(range(len(self.data)))
            random.Random(f"{self.seed}:{self.epoch}").shuffle(order)
            self._shuffled = (self.epoch, order)
        return self._shuffled[1]

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        if self.cursor >= self.per_epoch:
            self.epoch, self.cursor = self.epoch + 1, 0
        span = self.bs * self.world
        chunk = self._order()[self.cursor * span:(self.cursor + 1) * span]
        self.cursor += 1
        return self.data.collate(chunk[self.rank::self.world], self.pad_id, self.device)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, "pairs": len(self.data)}

    def load_state_dict(self, s: dict) -> None:
        if s.get("pairs") != len(self.data):
            raise ValueError(
                f"the checkpoint counted {s.get('pairs')} pairs, the data now holds {len(self.data)}")
        self.epoch, self.cursor = s["epoch"], s["cursor"]


def load_pair_rows(path: str, say) -> tuple[list[dict], list[dict]]:
    """(train rows, held-out rows): a make-pairs directory's train.jsonl and heldout.jsonl; a single JSONL
    file is split 95/5 by a hash of each row's text, so a pair stays on its side when rows are added."""
    p = Path(path)
    try:
        if p.is_dir():
            train = load_pairs(p, split="train")
            held = load_pairs(p, split="heldout") if (p / "heldout.jsonl").exists() else []
            return train, held
        rows = load_pairs(p)
    except PairError as e:
        raise ConfigError(str(e)) from e
    train, held = [], []
    for r in rows:
        key = repr((r["prompt"], r["chosen"], r["rejected"]))
        (held if split_of(content_hash(key), 0.05) == "val" else train).append(r)
    say(f"{p}: {len(train)} training pair(s), {len(held)} held out (5% by hash)")
    return train, held
