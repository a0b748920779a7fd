"""Preference stages, from a trained (SFT) run: `reward` (a scalar head, Bradley-Terry loss: the reward
model of the staged pipeline's RLHF step) and `dpo` (Rafailov et al. 2023, against a frozen copy of the
starting model). Both read pairs (data/pairs.py: `codeforge make-pairs`, or JSONL of your own) through one
batch source and hand the common Trainer a loss; what differs between them is a row of VARIANTS."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from .. import printable
from ..config import PAIR_STAGES, ConfigError, RunConfig, speaks_chat
from ..data.pairs import PairBatches, PairData, load_pair_rows
from ..device import autocast
from ..models.gpt import set_attention
from ..models.reward import RewardConfig
from ..train import losses
from ..train.resume import jsonl_identity
from .common import (Run, begin, budget, built, frozen_copy, init_from, launch, record_documents, start_point,
                     train)


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
    # the untrained start: a zero score head, a policy = its reference
    ties = round(r.get("pair_ties", 0.0) * n)
    tied = f" ({'all' if ties == n else ties} tie, counted as not ranked right)" if ties else ""
    return {"val_loss": r["loss"], "eval_pairs": n, "extra": extra,
            "message": f"held-out loss {r['loss']:.4f}{acc} over {n} pairs{tied}"}


# -- the stage table: one row per preference stage -----------------------------------------------------------

@dataclass(frozen=True)
class PrefVariant:
    """What a preference stage is, beside the pairs every one of them reads. A new preference loss (ORPO,
    KTO) is a loss function and a row here, plus its row in config.py's STAGE_TABLE (kind "prefs")."""
    # (fwd, model, ref, train settings, batch) -> (loss, metrics); ref is None without a reference
    loss: Callable
    reference: bool  # a frozen copy of the starting model is kept beside the trained one
    # the trained model's config from the starting GPT's (None: the GPT)
    model: Callable[[dict], object] | None
    new_ok: tuple[str, ...]  # parameters the starting checkpoint lacks (a new head)
    why: str  # said after "initialised weights from ..."
    # the pairs' length limit past the context (dpo scores the target after the last position)
    extra_token: int
    settings: Callable[[object], str]  # the stage's own settings, said with the plan


VARIANTS = {
    "reward": PrefVariant(loss=lambda fwd, model, ref, t, b: reward_loss(fwd, model, b), reference=False,
                          model=RewardConfig.from_gpt, new_ok=("score.",), why=" (a new scalar head)",
                          extra_token=0, settings=lambda t: ""),
    "dpo": PrefVariant(loss=lambda fwd, model, ref, t, b: dpo_loss(fwd, ref, t.beta, t.dpo_sft, b),
                       reference=True,
                       model=None, new_ok=(), why="", extra_token=1, settings=lambda t: f", beta {t.beta}"),
}
# a stage of kind "prefs" without its row here would train nothing known
if set(VARIANTS) != set(PAIR_STAGES):
    raise ImportError(f"stages/prefs.py has rows for {sorted(VARIANTS)}, config.py's prefs stages are "
                      f"{sorted(PAIR_STAGES)}")


# -- the stages --------------------------------------------------------------------------------------------

def run(cfg: RunConfig, resume: bool = False, log=print) -> dict:
    t = cfg.train
    if not t.data or not t.out:
        raise ConfigError(f"--stage {t.stage} needs --data PAIRS (a JSONL file, or a `codeforge make-pairs` "
                          f"directory) and --out RUN")
    if not Path(t.data).exists():
        raise ConfigError(f"--data {t.data} does not exist; make pairs with `codeforge make-pairs --input "
                          f"SRC --out {t.data}` or pass your own JSONL (prompt/chosen/rejected)")
    with launch(cfg, log) as run:
        return _train(run, resume)


def _train(run: Run, resume: bool) -> dict:
    say, device, precision, rank, world = run.say, run.device, run.precision, run.rank, run.world
    t = run.cfg.train
    variant = VARIANTS[t.stage]
    # -- the starting point and the pairs -------------------------------------------------------------------
    tok, init_ck, saved = start_point(run.cfg, say)
    cfg = run.cfg if variant.model is None else replace(run.cfg, model=variant.model(run.cfg.model.to_dict()))
    m = cfg.validate().model
    train_rows, held_rows = load_pair_rows(t.data, say)
    limit = m.block_size + variant.extra_token
    train_pairs = PairData(train_rows, tok, limit)
    val = PairData(held_rows, tok, limit) if held_rows else None
    for name, d in (("training", train_pairs), ("held-out", val)):
        if d is not None and (d.dropped or d.cut or d.same):
            say(f"{name} pairs: {d.dropped} dropped (the prompt fills the context of {m.block_size}), "
                f"{d.same} dropped (the sides differ only past it), {d.cut} cut at it")

    # -- the start: lock, recorded config, resume point ------------------------------------------------------
    began = begin(run, cfg, resume, tok, jsonl_identity(t.data, tok.hash), chat=speaks_chat(saved))
    t = began.cfg.train
    # pairs carry no document keys (make-pairs answers with your files' functions): the starting run's record
    # goes on, incomplete
    record_documents(run, began, started_from=t.init_from, unknown=(
        f"the preference pairs in {printable(t.data)}: the code in their answers is not recorded by the file "
        f"it came from (make-pairs takes your files' functions)",))

    # -- model ----------------------------------------------------------------------------------------------
    model = built(began.cfg).to(device)
    model.grad_checkpointing = t.grad_checkpointing
    say(set_attention(model, t.attention, device))
    if began.start is None:
        init_from(run, model, tok, ck=init_ck, arch="gpt", new_ok=variant.new_ok, why=variant.why)

    # -- batches, loss and budget ---------------------------------------------------------------------------
    pad = tok.special_ids.get("<pad>", 0)
    batches = PairBatches(train_pairs, t.batch_size, pad, t.seed, device, rank, world)
    ref = frozen_copy(m, init_ck, device) if variant.reference else None

    def loss_fn(fwd, b):
        return variant.loss(fwd, model, ref, t, b)
    tokens_per_step = 2 * t.batch_size * m.block_size * t.grad_accum_steps * world
    total = budget(began.cfg, tokens_per_step,
                   max(1, round((t.epochs or 1.0) * batches.per_epoch / t.grad_accum_steps)))
    say(f"{t.stage}: {len(train_pairs)} training pairs ({batches.per_epoch} batches an epoch), "
        f"{len(val) if val else 0} held out; {total} steps{variant.settings(t)}")

    # -- train ----------------------------------------------------------------------------------------------
    return train(run, began, model, batches, loss_fn, total_steps=total, tokens_per_step=tokens_per_step,
                 tok=tok,
                 evaluate=lambda mdl: pair_eval(loss_fn, mdl, val, t.batch_size, pad, device, precision))
