"""The hierarchical model's stage (seed 001): mined plans (JSONL from `codeforge make-plans`) + a tokenizer ->
HRM (models/hrm.py) -> the common Trainer. Wiring only: the loss is the model's weighted multi-task loss
(the batch carries the optimizer step for refinement warm-up and scheduled sampling), evaluation scores the
validation records with the gold plan, the sample shows a plan, the code and the refinement iterations.
Device, precision, the run lock, --resume and --init-from checks are pretrain.py's, in the same order."""

from __future__ import annotations

import contextlib
import math
from dataclasses import replace
from pathlib import Path

import torch

from .. import checkpoint as ckpt_io
from ..config import ConfigError, RunConfig
from ..device import autocast
from ..evaluate import token_byte_lengths
from ..hrm_data import HRMBatches, LabelCache, PlanData
from ..models import build_model
from ..tokenizer import CodeTokenizer
from ..train.trainer import Trainer
from .pretrain import found_by_rank0, launch, resume_point, round_up

PARTS = ("plan", "code", "refine", "decision", "plan_accuracy", "code_accuracy", "decision_accuracy")


def hrm_loss_fn(model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, dict]:
    """The trainer's loss_fn: the model's weighted total; the parts as metrics."""
    out = model(batch)
    return out["loss"], {k: out[k] for k in PARTS}


def tokenizer_dir(cfg: RunConfig) -> Path:
    t = cfg.train
    if t.tokenizer:
        return Path(t.tokenizer)
    if (Path(t.data) / "tokenizer" / "tokenizer.json").exists():
        return Path(t.data) / "tokenizer"
    raise ConfigError(f"--stage hrm needs --tokenizer DIR (a trained tokenizer: `codeforge tokenizer train`); "
                      f"{t.data} holds none")


def run(cfg: RunConfig, resume: bool = False, log=print) -> dict:
    t = cfg.train
    if not t.data or not t.out:
        raise ConfigError("train --stage hrm needs --data DIR (from `codeforge make-plans`) and --out RUN")
    if cfg.model.arch != "hrm":
        raise ConfigError(f"--stage hrm trains the hierarchical model; model.arch is {cfg.model.arch!r}: add "
                          f"--preset hrm-small (or hrm-tiny), or --arch hrm")
    if not (Path(t.data) / "train.jsonl").exists():
        raise ConfigError(f"{t.data} has no train.jsonl; mine plans first: codeforge make-plans --input SRC "
                          f"--out {t.data}")
    return launch(cfg, log, lambda say, device, precision, rank, world, held: _train(
        cfg, resume, say, device, precision, rank, world, held))


def _train(cfg: RunConfig, resume: bool, say, device, precision: str, rank: int, world: int,
           held: contextlib.ExitStack) -> dict:
    t = cfg.train
    run_dir = Path(t.out)
    tok = CodeTokenizer.load(tokenizer_dir(cfg))
    m = cfg.model
    if m.vocab_size == 0:
        cfg.model = m = replace(m, vocab_size=round_up(tok.vocab_size, 64))
    elif m.vocab_size < tok.vocab_size:
        raise ConfigError(f"model.vocab_size = {m.vocab_size} is smaller than the tokenizer's vocabulary "
                          f"({tok.vocab_size}); drop --vocab-size to take it from the tokenizer")
    cfg.validate()
    train_data = PlanData(t.data, "train", tok)
    val_data = PlanData(t.data, "val", tok) if (Path(t.data) / "val.jsonl").exists() else None
    for d in (train_data, val_data):
        if d is not None and d.skipped:
            say(f"{d.path}: skipped {dict(d.skipped)} line(s)")
    if val_data is not None and not len(val_data):
        val_data = None
    if val_data is None:
        say(f"note: {t.data} has no validation records: no evaluation and no 'best' checkpoint")

    if rank == 0:
        held.enter_context(ckpt_io.run_lock(run_dir))
    run_config = {**cfg.to_dict(), "tokenizer_hash": tok.hash, "data_identity": ckpt_io.jsonl_identity(t.data, tok.hash)}
    model_dict = m.to_dict()
    start_ckpt = resume_point(run_dir, resume, model_dict, tok.hash, t.data, run_config, say)

    torch.manual_seed(t.seed)
    model = build_model(m).to(device)
    if t.init_from and start_ckpt is None:
        ck = found_by_rank0(lambda: ckpt_io.find_checkpoint(t.init_from, "auto", log=say))
        ckpt_io.check_compatible(ck, model_dict, tok.hash, "--init-from", t.data)
        ckpt_io.load_weights(model, ck)
        say(f"initialised weights from {ck}")
    say(f"model: hrm, {model.num_params():,} parameters ({model.num_params(True):,} non-embedding); planner "
        f"{m.planner_layers}, generator {m.generator_layers}, refiner {m.refiner_layers} layers x {m.n_embd} wide, "
        f"{m.n_head} heads; plan context {m.plan_len}, code context {m.code_len}, vocab {m.vocab_size}")

    labels = LabelCache()
    try:
        batches = HRMBatches(train_data, tok, t.batch_size, m.plan_len, m.code_len, seed=t.seed,
                             grad_accum_steps=t.grad_accum_steps, rank=rank, world_size=world, device=device,
                             labels=labels)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    cut = {k: v for k, v in batches.truncated.items() if v}
    if cut:
        say(f"truncated to plan_len {m.plan_len} / code_len {m.code_len}: {cut} of {len(train_data)} records")
    # tokens a step reads: planner and generator rows (prompt, plan, body and markers), on average
    tokens_per_step = max(1, round(batches.mean_tokens * t.batch_size * t.grad_accum_steps * world))
    if t.max_iters:
        total = t.max_iters
    elif t.max_tokens:
        total = math.ceil(t.max_tokens / tokens_per_step)
    else:
        total = max(1, math.ceil((t.epochs or 1.0) * batches.per_epoch / t.grad_accum_steps))
    token_bytes = token_byte_lengths(tok, m.vocab_size).to(device)
    val_batches = (HRMBatches(val_data, tok, min(t.batch_size, len(val_data)), m.plan_len, m.code_len, seed=t.seed,
                              shuffle=False, device=device, labels=labels) if val_data is not None else None)

    def evaluate(mdl):
        if val_batches is None:
            return None
        r = evaluate_hrm(mdl, val_batches, t.eval_tokens, device, precision, token_bytes)
        if t.syntax_cases:  # the seed's syntax validation during training: generated bodies parsed
            from ..evaluate import hrm_generation_eval
            g = hrm_generation_eval(mdl, tok, val_data, t.syntax_cases, max_plan_tokens=min(64, m.plan_len // 2),
                                    max_code_tokens=min(128, m.code_len // 2))
            r["extra"].update({k: g[k] for k in ("syntax_valid_rate", "avg_iterations", "plan_exact", "code_ast_f1")
                               if k in g})
        return r

    def sample(mdl, step):
        return sample_hrm(mdl, tok, val_data or train_data, step, t.sample_tokens)

    trainer = Trainer(model, batches, hrm_loss_fn, t, run_dir, device=device, precision=precision,
                      total_steps=total, tokens_per_step=tokens_per_step, run_config=run_config,
                      assets={"tokenizer": tok.path}, evaluate=evaluate, sample=sample,
                      start_checkpoint=start_ckpt, rank=rank, world=world, log=say)
    return trainer.run()


@torch.no_grad()
def evaluate_hrm(model, val: HRMBatches, eval_tokens: int, device, precision: str,
                 token_bytes: torch.Tensor) -> dict:
    """Validation records in order (drafts of epoch 0), until eval_tokens body targets are scored (0: all):
    val_loss is the body's loss given the gold plan (the generator's, what `best` is chosen by), bits per
    byte of the body, and the parts as extras (plan/refine/decision losses, token and decision accuracies),
    each a mean over batches weighted by its batch's rows."""
    model.eval()
    sums: dict[str, float] = {}
    rows, nats, nbytes, code_tokens = 0, 0.0, 0, 0
    for batch in val.eval_batches():
        with autocast(device, precision):
            out = model(batch)
        n = batch["plan_idx"].size(0)
        rows += n
        for k in PARTS:
            sums[k] = sums.get(k, 0.0) + float(out[k]) * n
        tgt = batch["code_tgt"]
        counted = tgt != -1
        nats += float(out["code"]) * int(counted.sum())
        nbytes += int(token_bytes[tgt.clamp(min=0)][counted].sum())
        code_tokens += int(counted.sum())
        if eval_tokens and code_tokens >= eval_tokens:
            break
    model.train()
    extra = {k: v / rows for k, v in sums.items()}
    loss = nats / max(code_tokens, 1)
    return {"val_loss": loss, "perplexity": math.exp(min(loss, 50)), "bits_per_byte": nats / math.log(2) / max(nbytes, 1),
            "eval_tokens": code_tokens, "extra": extra}


def sample_hrm(model, tok: CodeTokenizer, data: PlanData, step: int, max_tokens: int = 64) -> str:
    """Plan, code and refinement iterations for the first record's prompt, greedy (comparable across steps)."""
    was = model.training
    model.eval()
    try:
        r = model.generate(data.prompt_ids[0], max_plan_tokens=max_tokens, max_code_tokens=max_tokens)
    finally:
        model.train(was)
    its = " ".join(f"[{i['iteration']}: {i['decision']} p_done={i['p_done']:.2f}]" for i in r["iterations"])
    return (f"{data.prompts[0]}\n# plan: {tok.decode(r['plan'])}\n# code:\n{tok.decode(r['code'])}\n"
            f"# refinement: {its or 'none'}")
