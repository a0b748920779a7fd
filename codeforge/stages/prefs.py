"""Preference stages, from a trained (SFT) run: `reward` (a scalar head, Bradley-Terry loss: the reward
model of the staged pipeline's RLHF step) and `dpo` (Rafailov et al. 2023, against a frozen copy of the
starting model). Both read pairs (data/pairs.py: `codeforge make-pairs`, or JSONL of your own) through one
batch source and hand the common Trainer a loss."""

from __future__ import annotations

from pathlib import Path

import torch

from ..config import ConfigError, RunConfig, speaks_chat
from ..data.pairs import PairBatches, PairData, load_pair_rows
from ..device import autocast
from ..models.reward import RewardConfig
from ..train import losses
from ..train.resume import jsonl_identity
from ..train.trainer import Trainer
from .common import Run, begin, budget, built, frozen_copy, init_from, launch, start_point


# -- losses and evaluation --------------------------------------------------------------------------------

def reward_loss(fwd, head_model, b: dict) -> tuple[torch.Tensor, dict]:
    """Bradley-Terry on the scores of the chosen rows (first half) against the rejected (second half)."""
    h = fwd(b["ids"], return_hidden=True)
    rows = torch.arange(h.size(0), device=h.device)
    s = head_model.score(h[rows, b["last"]]).squeeze(-1).float()
    n = s.size(0) // 2
    loss, acc = losses.bradley_terry_loss(s[:n], s[n:])
    return loss, {"pair_accuracy": acc, "margin": (s[:n] - s[n:]).mean().detach(),
                  "pair_ties": (s[:n] == s[n:]).float().mean()}


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
    ties = round(r.get("pair_ties", 0.0) * n)  # the untrained start: a zero score head, a policy = its reference
    tied = f" ({'all' if ties == n else ties} tie, counted as not ranked right)" if ties else ""
    return {"val_loss": r["loss"], "eval_pairs": n, "extra": extra,
            "message": f"held-out loss {r['loss']:.4f}{acc} over {n} pairs{tied}"}


# -- the stages --------------------------------------------------------------------------------------------

def run(cfg: RunConfig, resume: bool = False, log=print) -> dict:
    t = cfg.train
    if not t.data or not t.out:
        raise ConfigError(f"--stage {t.stage} needs --data PAIRS (a JSONL file, or a `codeforge make-pairs` "
                          f"directory) and --out RUN")
    if not Path(t.data).exists():
        raise ConfigError(f"--data {t.data} does not exist; make pairs with `codeforge make-pairs --input SRC "
                          f"--out {t.data}` or pass your own JSONL (prompt/chosen/rejected)")
    with launch(cfg, log) as run:
        return _train(run, resume)


def _train(run: Run, resume: bool) -> dict:
    cfg, say, device, precision, rank, world = run.cfg, run.say, run.device, run.precision, run.rank, run.world
    t = cfg.train
    # -- the starting point and the pairs -------------------------------------------------------------------
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

    # -- the start: lock, recorded config, resume point ------------------------------------------------------
    run_config, start_ckpt = begin(run, resume, tok, jsonl_identity(t.data, tok.hash), chat=speaks_chat(saved))
    t = cfg.train

    # -- model ----------------------------------------------------------------------------------------------
    model = built(cfg).to(device)
    model.grad_checkpointing = t.grad_checkpointing
    if start_ckpt is None:
        init_from(run, model, tok, ck=init_ck, arch="gpt", new_ok=("score.",) if t.stage == "reward" else (),
                  why=" (a new scalar head)" if t.stage == "reward" else "")

    # -- batches, loss and budget ---------------------------------------------------------------------------
    pad = tok.special_ids.get("<pad>", 0)
    batches = PairBatches(train, t.batch_size, pad, t.seed, device, rank, world)
    if t.stage == "reward":
        def loss_fn(fwd, b):
            return reward_loss(fwd, model, b)
    else:
        ref = frozen_copy(m, init_ck, device)

        def loss_fn(fwd, b):
            return dpo_loss(fwd, ref, t.beta, t.dpo_sft, b)
    tokens_per_step = 2 * t.batch_size * m.block_size * t.grad_accum_steps * world
    total = budget(cfg, tokens_per_step, max(1, round((t.epochs or 1.0) * batches.per_epoch / t.grad_accum_steps)))
    say(f"{t.stage}: {len(train)} training pairs ({batches.per_epoch} batches an epoch), "
        f"{len(val) if val else 0} held out; {total} steps"
        + (f", beta {t.beta}" if t.stage == "dpo" else ""))

    # -- train ----------------------------------------------------------------------------------------------
    trainer = Trainer(model, batches, loss_fn, t, run.dir, device=device, precision=precision, total_steps=total,
                      tokens_per_step=tokens_per_step, run_config=run_config, assets={"tokenizer": tok.path},
                      evaluate=lambda mdl: pair_eval(loss_fn, mdl, val, t.batch_size, pad, device, precision),
                      start_checkpoint=start_ckpt, rank=rank, world=world, log=say)
    return trainer.run()
