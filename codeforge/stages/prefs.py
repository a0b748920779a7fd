"""Preference stages, from a trained (SFT) run: `reward` (a scalar head, Bradley-Terry loss; seed 003's
reward model) and `dpo` (Rafailov et al. 2023, against a frozen copy of the starting model). Both read pairs
(tasks/pref_mine.py: `codeforge make-pairs`, or JSONL of your own) through one batch source and hand the
common Trainer a loss; the pieces the RL stages share (the starting point, the reference) live here too.

A pair's two sides are encoded as the prompt followed by the response: conversational pairs with the chat
template (as SFT saw them), standard pairs as plain text ending in end-of-text. Only response tokens are
targets. A pair whose prompt alone fills the context is dropped (counted); a response past it is cut.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from .. import checkpoint as ckpt_io
from ..config import ConfigError, RunConfig, speaks_chat
from ..models import build_model
from ..models.reward import RewardConfig
from ..tokenizer import CodeTokenizer
from ..train import losses
from ..train.trainer import Trainer
from .pretrain import check_init_from, found_by_rank0, launch, resume_point


# -- the starting point ------------------------------------------------------------------------------------

def start_point(cfg: RunConfig, say) -> tuple[CodeTokenizer, Path, dict]:
    """(tokenizer, checkpoint, its saved config) of the run --init-from names: these stages continue one."""
    t = cfg.train
    if not t.init_from:
        raise ConfigError(f"--stage {t.stage} continues a trained model: pass --init-from RUN (a chat run from "
                          f"--stage sft, or any GPT run)")
    check_init_from(t.init_from)
    ck = found_by_rank0(lambda: ckpt_io.find_checkpoint(t.init_from, "auto", log=say))
    saved = ckpt_io.read_config(ck)
    if saved["model"].get("arch", "gpt") != "gpt":
        raise ConfigError(f"--init-from {ck}: a {saved['model']['arch']} model; --stage {t.stage} trains a GPT "
                          f"(an SFT run, usually)")
    tok = CodeTokenizer.load(ck / "tokenizer")
    return tok, ck, saved


def frozen_copy(model_cfg, ck: Path, device: torch.device) -> torch.nn.Module:
    """The reference model: the starting checkpoint, in eval mode, never trained."""
    ref = build_model(model_cfg)
    ckpt_io.load_weights(ref, ck)
    ref.to(device).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


# -- pairs -------------------------------------------------------------------------------------------------

def encode_side(tok: CodeTokenizer, row: dict, side: str) -> tuple[list[int], list[int]]:
    """(ids, targets) of prompt + one response; targets = ids on response tokens, -1 elsewhere."""
    from ..chat import encode_conversation
    if row["chat"]:
        prompt = row["prompt"] if isinstance(row["prompt"], list) else [{"role": "user", "content": row["prompt"]}]
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
            raise ConfigError(f"{len(data)} usable pair(s) for a batch of {batch_size} x {world} rank(s); lower "
                              f"--batch-size or bring more pairs")
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
            raise ValueError(f"the checkpoint counted {s.get('pairs')} pairs, the data now holds {len(self.data)}")
        self.epoch, self.cursor = s["epoch"], s["cursor"]


def reward_loss(fwd, head_model, b: dict) -> tuple[torch.Tensor, dict]:
    """Bradley-Terry on the scores of the chosen rows (first half) against the rejected (second half)."""
    h = fwd(b["ids"], return_hidden=True)
    rows = torch.arange(h.size(0), device=h.device)
    s = head_model.score(h[rows, b["last"]]).squeeze(-1).float()
    n = s.size(0) // 2
    loss, acc = losses.bradley_terry_loss(s[:n], s[n:])
    return loss, {"pair_accuracy": acc, "margin": (s[:n] - s[n:]).mean().detach()}


def response_logprobs(model, b: dict) -> torch.Tensor:
    """(2B,) summed log-probabilities of each row's response tokens."""
    logits = model(b["ids"][:, :-1])
    return losses.sequence_logprobs(logits, b["targets"][:, 1:])


def dpo_loss(fwd, ref, beta: float, sft_coef: float, b: dict) -> tuple[torch.Tensor, dict]:
    """DPO on the pair batch; with sft_coef > 0 plus that times the chosen side's mean per-token NLL (RPO,
    Pang et al. 2024), which keeps the likelihood of the preferred answers from sinking with the rejected."""
    lp = response_logprobs(fwd, b)
    with torch.no_grad():
        ref_lp = response_logprobs(ref, b)
    n = lp.size(0) // 2
    loss, m = losses.dpo_loss(lp[:n], lp[n:], ref_lp[:n], ref_lp[n:], beta)
    if sft_coef:
        counted = (b["targets"][:n, 1:] >= 0).sum().clamp(min=1)
        nll = -lp[:n].sum() / counted
        loss = loss + sft_coef * nll
        m["chosen_nll"] = nll.detach()
    return loss, m


@torch.no_grad()
def pair_eval(loss_fn, model, data: PairData | None, batch_size: int, pad_id: int, device, precision: str,
              max_pairs: int = 512) -> dict | None:
    """The loss and its metrics over the held-out pairs (up to max_pairs, in order), averaged per pair."""
    from ..device import autocast
    if data is None or not len(data):
        return None
    model.eval()
    n = min(len(data), max_pairs)
    tot: dict[str, float] = {}
    for i in range(0, n, batch_size):
        idx = list(range(i, min(i + batch_size, n)))
        with autocast(device, precision):
            loss, m = loss_fn(model, data.collate(idx, pad_id, device))
        for k, v in {"loss": loss, **m}.items():
            tot[k] = tot.get(k, 0.0) + float(v) * len(idx)
    r = {k: v / n for k, v in tot.items()}
    extra = {k: v for k, v in r.items() if k != "loss"}
    acc = f", pair accuracy {r['pair_accuracy']:.1%}" if "pair_accuracy" in r else ""
    return {"val_loss": r["loss"], "eval_pairs": n, "extra": extra,
            "message": f"held-out loss {r['loss']:.4f}{acc} over {n} pairs"}


def load_pair_rows(path: str, say) -> tuple[list[dict], list[dict]]:
    """(train rows, held-out rows): a make-pairs directory's train.jsonl and heldout.jsonl; a single JSONL
    file is split 95/5 by a hash of each row's text, so a pair stays on its side when rows are added."""
    from ..corpus import content_hash, split_of
    from ..tasks.pref_mine import PairError, load_pairs
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


# -- the stages --------------------------------------------------------------------------------------------

def run(cfg: RunConfig, resume: bool = False, log=print) -> dict:
    t = cfg.train
    if not t.data or not t.out:
        raise ConfigError(f"--stage {t.stage} needs --data PAIRS (a JSONL file, or a `codeforge make-pairs` "
                          f"directory) and --out RUN")
    if not Path(t.data).exists():
        raise ConfigError(f"--data {t.data} does not exist; make pairs with `codeforge make-pairs --input SRC "
                          f"--out {t.data}` or pass your own JSONL (prompt/chosen/rejected)")
    return launch(cfg, log, lambda say, device, precision, rank, world, held: _train(
        cfg, resume, say, device, precision, rank, world, held))


def _train(cfg: RunConfig, resume: bool, say, device, precision: str, rank: int, world: int, held) -> dict:
    t = cfg.train
    run_dir = Path(t.out)
    tok, init_ck, saved = start_point(cfg, say)
    if t.stage == "reward":
        cfg.model = RewardConfig.from_gpt(cfg.model.to_dict())
    m = cfg.model
    cfg.validate()
    train_rows, held_rows = load_pair_rows(t.data, say)
    limit = m.block_size + (t.stage == "dpo")
    train = PairData(train_rows, tok, limit)
    val = PairData(held_rows, tok, limit) if held_rows else None
    for name, d in (("training", train), ("held-out", val)):
        if d is not None and (d.dropped or d.cut or d.same):
            say(f"{name} pairs: {d.dropped} dropped (the prompt fills the context of {m.block_size}), {d.same} "
                f"dropped (the sides differ only past it), {d.cut} cut at it")
    if rank == 0:
        held.enter_context(ckpt_io.run_lock(run_dir))
    run_config = {**cfg.to_dict(), "tokenizer_hash": tok.hash, "chat": speaks_chat(saved),
                  "data_identity": ckpt_io.jsonl_identity(t.data, tok.hash)}
    model_dict = m.to_dict()
    start_ckpt = resume_point(run_dir, resume, model_dict, tok.hash, t.data, run_config, say)

    torch.manual_seed(t.seed)
    model = build_model(m).to(device)
    model.grad_checkpointing = t.grad_checkpointing
    if start_ckpt is None:
        ckpt_io.check_compatible(init_ck, {**model_dict, "arch": "gpt"}, tok.hash, "--init-from", t.data)
        ckpt_io.load_weights(model, init_ck, new_ok=("score.",) if t.stage == "reward" else ())
        say(f"initialised weights from {init_ck}" + (" (a new scalar head)" if t.stage == "reward" else ""))
    pad = tok.special_ids.get("<pad>", 0)
    batches = PairBatches(train, t.batch_size, pad, t.seed, device, rank, world)

    if t.stage == "reward":
        def loss_fn(fwd, b):
            return reward_loss(fwd, model, b)
    else:
        ref = frozen_copy(m, init_ck, device)

        def loss_fn(fwd, b):
            return dpo_loss(fwd, ref, t.beta, t.dpo_sft, b)
    total = t.max_iters or max(1, round((t.epochs or 1.0) * batches.per_epoch / t.grad_accum_steps))
    say(f"{t.stage}: {len(train)} training pairs ({batches.per_epoch} batches an epoch), "
        f"{len(val) if val else 0} held out; {total} steps"
        + (f", beta {t.beta}" if t.stage == "dpo" else ""))
    trainer = Trainer(model, batches, loss_fn, t, run_dir, device=device, precision=precision, total_steps=total,
                      tokens_per_step=2 * t.batch_size * m.block_size * t.grad_accum_steps * world,
                      run_config=run_config, assets={"tokenizer": tok.path},
                      evaluate=lambda mdl: pair_eval(loss_fn, mdl, val, t.batch_size, pad, device, precision),
                      start_checkpoint=start_ckpt, rank=rank, world=world, log=say)
    return trainer.run()
