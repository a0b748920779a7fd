"""Batches for the hierarchical model (models/hrm.py) from mined plans (mining/plans.py's JSONL records
{"prompt": P, "plan": [WORD, ...], "body": Y, "language", ...}, where P + Y is the function's source).

Each record becomes three rows, right-padded per batch, targets -1 where nothing is scored:
  planner    P' <plan> S' <eot>          targets: S' and <eot> (from <plan> on)
  generator  <code> Y' <eot>             targets: Y' and <eot>   (after the planner's states)
  refiner    <draft> D' <refine> Y' <eot> targets: Y' and <eot> (from <refine> on); label at <refine>
The plan S is its words joined by spaces, tokenized as plain text. Truncation: Y' is the first code_len - 2
body tokens (then no <eot>: the body does not end there), S' the first tokens that leave a quarter of
plan_len for the prompt, P' the prompt's last tokens that fit (nearest the body). Each cut is counted.

Drafts D for refinement are corruptions of Y: with probability CLEAN_RATE Y itself; otherwise each of three
corruptions is switched on with probability 1/2 (at least one): token drops and adjacent swaps at a rate
drawn uniformly up to DROP_MAX / SWAP_MAX, and deletion of bracket characters ( ) [ ] { } from the text at a
rate up to BRACKET_MAX (the draft is then re-tokenized). The decision label is whether P + D parses without
tree-sitter error nodes (evaluate.is_valid_syntax): 1 done, 0 refine; labels are cached by text.
The model's own samples are not mixed in yet: that needs a decode and a parse inside the training step
(the teacher-forced argmax of the generator is the cheap candidate); see the stage's notes.

Order and drafts are functions of (seed, epoch, record): an epoch is a seeded permutation, rank r takes
every world_size-th record, and a record's draft comes from a generator seeded with (seed, epoch, index).
The cursor (epoch, position, batches drawn) is the whole state, so a resumed run reads exactly the next
batch. batch["step"] = batches drawn // grad_accum_steps is the optimizer step the batch belongs to (the
model's refinement warm-up and scheduled sampling read it).
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from .. import CodeforgeError
from ..syntax import is_valid_syntax
from ..models.hrm import CODE_ID, DONE, DRAFT_ID, EOT_ID, PAD_ID, PLAN_ID, REFINE, REFINE_ID
from ..tokenizer import CodeTokenizer

CLEAN_RATE = 0.25   # share of drafts that are the gold body (the head must learn to say done)
DROP_MAX, SWAP_MAX, BRACKET_MAX = 0.15, 0.10, 0.5
BRACKETS = "()[]{}"


class PlanDataError(CodeforgeError):
    """The mined plan data cannot be read; the message says what to do."""


class PlanData:
    """The records of one split, tokenized: prompt, plan and body ids, language and texts. Malformed lines
    and records are counted in `skipped` (by reason), never silently dropped."""

    def __init__(self, data_dir: str | Path, split: str, tok: CodeTokenizer):
        path = Path(data_dir) / f"{split}.jsonl"
        if not path.exists():
            raise PlanDataError(f"no {path}: --stage hrm trains on mined plans; make them with `codeforge "
                                f"make-plans --input SRC --out {data_dir}`")
        self.path, self.split = path, split
        self.skipped: Counter = Counter()
        recs = []
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                if not line.strip():
                    continue
                try:
                    r = json.loads(line)
                    ok = (isinstance(r, dict) and isinstance(r.get("prompt"), str)
                          and isinstance(r.get("body"), str)
                          and isinstance(r.get("plan"), list) and r.get("language") in ("go", "python"))
                except ValueError:
                    ok = False
                if not ok:
                    self.skipped["malformed"] += 1
                    continue
                recs.append(r)
        self.records = recs
        self.prompts = [r["prompt"] for r in recs]
        self.bodies = [r["body"] for r in recs]
        self.languages = [r["language"] for r in recs]
        plans = [" ".join(str(w) for w in r["plan"]) for r in recs]
        self.prompt_ids = tok.encode_batch(self.prompts) if recs else []
        self.plan_ids = tok.encode_batch(plans) if recs else []
        self.body_ids = tok.encode_batch(self.bodies) if recs else []

    def __len__(self) -> int:
        return len(self.records)


class LabelCache:
    """Decision labels by (language, sha1 of the function text): a tree-sitter parse each, once."""

    def __init__(self, limit: int = 200_000):
        self.d: dict[tuple[str, str], int] = {}
        self.limit = limit

    def __call__(self, text: str, language: str) -> int:
        key = (language, hashlib.sha1(text.encode("utf-8")).hexdigest())
        if key not in self.d:
            if len(self.d) >= self.limit:
                self.d.clear()
            self.d[key] = DONE if is_valid_syntax(text, language) else REFINE
        return self.d[key]


def corrupt(body_ids: list[int], tok: CodeTokenizer, rng: np.random.Generator) -> list[int]:
    """A draft of the body: itself (CLEAN_RATE), or token drops / adjacent swaps / bracket deletions."""
    if rng.random() < CLEAN_RATE or not body_ids:
        return list(body_ids)
    on = rng.random(3) < 0.5
    if not on.any():
        on[rng.integers(3)] = True
    ids = list(body_ids)
    if on[0]:
        p = rng.uniform(0, DROP_MAX)
        ids = [t for t, u in zip(ids, rng.random(len(ids))) if u >= p]
    if on[1]:
        p = rng.uniform(0, SWAP_MAX)
        for i, u in enumerate(rng.random(max(0, len(ids) - 1))):
            if u < p:
                ids[i], ids[i + 1] = ids[i + 1], ids[i]
    if on[2]:
        p = rng.uniform(0, BRACKET_MAX)
        text = tok.decode(ids)
        kept = [ch for ch, u in zip(text, rng.random(len(text))) if ch not in BRACKETS or u >= p]
        if len(kept) != len(text):
            ids = tok.encode("".join(kept))
    return ids


class HRMBatches:
    """The hrm batch source: `next()` -> dict of tensors (models/hrm.py's forward reads it),
    `state_dict()` / `load_state_dict()`."""

    def __init__(self, data: PlanData, tok: CodeTokenizer, batch_size: int, plan_len: int, code_len: int,
                 seed: int = 1337, shuffle: bool = True, grad_accum_steps: int = 1, rank: int = 0,
                 world_size: int = 1, device: str | torch.device = "cpu", labels: LabelCache | None = None):
        if plan_len < 8 or code_len < 4:
            raise ValueError(f"plan_len {plan_len} / code_len {code_len} too small")
        self.data, self.tok, self.B = data, tok, batch_size
        self.plan_len, self.code_len = plan_len, code_len
        self.seed, self.shuffle, self.accum = seed, shuffle, grad_accum_steps
        self.rank, self.world_size = rank, world_size
        self.device = torch.device(device)
        self.labels = labels or LabelCache()
        self.per_epoch = len(data) // world_size // batch_size
        if self.per_epoch == 0:
            raise ValueError(f"{data.path} has {len(data)} usable records: too few for one batch of "
                             f"{batch_size} per rank over {world_size} rank(s); "
                             f"lower --batch-size or mine more functions")
        self.epoch, self.pos, self.drawn = 0, 0, 0
        self._order: np.ndarray | None = None
        self.truncated: Counter = Counter()
        rows = [self._fixed_rows(i) for i in range(len(data))]  # counts truncation once per record
        # planner + generator row tokens
        self.mean_tokens = float(np.mean([len(p) + len(c) for p, c in rows]))

    def _fixed_rows(self, i: int, count: bool = True) -> tuple[list[int], list[int]]:
        P, S, Y = self.data.prompt_ids[i], self.data.plan_ids[i], self.data.body_ids[i]
        s_room = self.plan_len - 2 - min(len(P), self.plan_len // 4)
        s_cut = len(S) > s_room
        S = S[:s_room]
        p_room = self.plan_len - 1 - len(S) - (0 if s_cut else 1)
        p_cut = len(P) > p_room
        P = P[len(P) - p_room:] if p_cut else P
        y_cut = len(Y) > self.code_len - 2
        if count:
            self.truncated.update({"prompt": p_cut, "plan": s_cut, "body": y_cut})
        plan_row = P + [PLAN_ID] + S + ([] if s_cut else [EOT_ID])
        code_row = [CODE_ID] + Y[:self.code_len - 2] + ([] if y_cut else [EOT_ID])
        return plan_row, code_row

    def _epoch_order(self) -> np.ndarray:
        if self._order is None:
            ids = np.arange(len(self.data), dtype=np.int64)
            if self.shuffle:
                ids = np.random.default_rng([self.seed, self.epoch]).permutation(ids)
            self._order = ids[self.rank::self.world_size]
        return self._order

    def example(self, i: int, epoch: int) -> dict:
        """The three rows of record i with its draft for `epoch` (deterministic)."""
        plan_row, code_row = self._fixed_rows(i, count=False)
        n_p = plan_row.index(PLAN_ID)
        rng = np.random.default_rng([self.seed, epoch, i, 0x4452])
        draft = corrupt(self.data.body_ids[i], self.tok, rng)
        text = self.tok.decode(draft)
        label = self.labels(self.data.prompts[i] + text, self.data.languages[i])
        d = draft[:self.code_len - 2]
        sep = 1 + len(d)
        ref_row = [DRAFT_ID] + d + [REFINE_ID] + code_row[1:]
        return {"plan": plan_row, "n_prompt": n_p, "code": code_row, "ref": ref_row, "sep": sep,
                "label": label}

    def collate(self, exs: list[dict], step: int) -> dict:
        B = len(exs)
        Lp, Lc, Lr = (max(len(e[k]) for e in exs) for k in ("plan", "code", "ref"))
        plan_idx = torch.full((B, Lp), PAD_ID, dtype=torch.long)
        plan_tgt = torch.full((B, Lp), -1, dtype=torch.long)
        s_mask = torch.zeros((B, Lp), dtype=torch.bool)
        code_idx = torch.full((B, Lc), PAD_ID, dtype=torch.long)
        code_tgt = torch.full((B, Lc), -1, dtype=torch.long)
        ref_idx = torch.full((B, Lr), PAD_ID, dtype=torch.long)
        ref_tgt = torch.full((B, Lr), -1, dtype=torch.long)
        for b, e in enumerate(exs):
            p, n = torch.tensor(e["plan"]), e["n_prompt"]
            plan_idx[b, :len(p)] = p
            plan_tgt[b, n:len(p) - 1] = p[n + 1:]  # <plan> predicts S[0], ..., S[-1] predicts <eot>
            s_mask[b, n + 1:len(p)] = p[n + 1:] != EOT_ID
            c = torch.tensor(e["code"])
            code_idx[b, :len(c)] = c
            code_tgt[b, :len(c) - 1] = c[1:]
            r, sep = torch.tensor(e["ref"]), e["sep"]
            ref_idx[b, :len(r)] = r
            ref_tgt[b, sep:len(r) - 1] = r[sep + 1:]
        batch = {"plan_idx": plan_idx, "plan_tgt": plan_tgt, "plan_s_mask": s_mask,
                 "plan_lens": torch.tensor([len(e["plan"]) for e in exs]), "code_idx": code_idx,
                 "code_tgt": code_tgt,
                 "ref_idx": ref_idx, "ref_tgt": ref_tgt, "sep_pos": torch.tensor([e["sep"] for e in exs]),
                 "label": torch.tensor([e["label"] for e in exs])}
        batch = {k: v.to(self.device) for k, v in batch.items()}
        batch["step"] = step
        return batch

    def next_batch(self) -> dict:
        if self.pos >= self.per_epoch:
            self.epoch += 1
            self.pos = 0
            self._order = None
        ids = self._epoch_order()[self.pos * self.B:(self.pos + 1) * self.B]
        self.pos += 1
        step = self.drawn // self.accum
        self.drawn += 1
        return self.collate([self.example(int(i), self.epoch) for i in ids], step)

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        return self.next_batch()

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos, "drawn": self.drawn, "seed": self.seed,
                "shuffle": self.shuffle, "rank": self.rank, "world_size": self.world_size, "B": self.B,
                "accum": self.accum, "plan_len": self.plan_len, "code_len": self.code_len}

    def load_state_dict(self, state: dict) -> None:
        for k in ("seed", "shuffle", "world_size", "B", "accum", "plan_len", "code_len"):
            if state[k] != getattr(self, k):
                raise ValueError(f"hrm batch state was saved with {k}={state[k]!r} but this run has "
                                 f"{getattr(self, k)!r}; resume with the same setting")
        self.epoch, self.pos, self.drawn, self._order = state["epoch"], state["pos"], state["drawn"], None

    def eval_batches(self, limit_rows: int = 0):
        """The split in order, drafts of epoch 0, in batches of B (the last may be smaller): evaluation."""
        n = len(self.data) if not limit_rows else min(limit_rows, len(self.data))
        for s in range(0, n, self.B):
            yield self.collate([self.example(i, 0) for i in range(s, min(n, s + self.B))], 0)
