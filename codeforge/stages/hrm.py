"""The hierarchical model's stage (the Hierarchical Recursive Go Coder recipe): mined plans (JSONL from
`codeforge make-plans`) + a tokenizer -> HRM (models/hrm.py) -> the common Trainer. The loss is the model's
weighted multi-task loss (the batch carries the optimizer step for refinement warm-up and scheduled
sampling), evaluation scores the validation records with the gold plan (evaluation/hrm.py), the sample
shows a plan, the code and the refinement iterations."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from .. import printable
from ..config import ConfigError, RunConfig
from ..data.hrm_batches import HRMBatches, LabelCache, PlanData
from ..evaluation.hrm import PARTS, evaluate_hrm, hrm_generation_eval
from ..tokenizer import CodeTokenizer, token_byte_lengths
from ..train.resume import jsonl_identity
from .common import (Run, begin, budget, built, init_from, launch, record_documents, sized_evaluation, train,
                     vocabulary)


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
    raise ConfigError(f"--stage hrm needs --tokenizer DIR (a trained tokenizer: `codeforge tokenizer "
                      f"train`); {t.data} holds none")


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
    with launch(cfg, log) as run:
        return _train(run, resume)


def _train(run: Run, resume: bool) -> dict:
    say, device, precision, rank, world = run.say, run.device, run.precision, run.rank, run.world
    t = run.cfg.train
    # -- tokenizer and data ---------------------------------------------------------------------------------
    tok = CodeTokenizer.load(tokenizer_dir(run.cfg))
    cfg = vocabulary(run.cfg, tok, "tokenizer").validate()
    train_data = PlanData(t.data, "train", tok)
    val_data = PlanData(t.data, "val", tok) if (Path(t.data) / "val.jsonl").exists() else None
    for d in (train_data, val_data):
        if d is not None and d.skipped:
            say(f"{d.path}: skipped {dict(d.skipped)} line(s)")
    if val_data is not None and not len(val_data):
        val_data = None
    if val_data is None:
        say(f"note: {t.data} has no validation records: no evaluation and no 'best' checkpoint")

    # -- the start: lock, recorded config, resume point ------------------------------------------------------
    began = begin(run, cfg, resume, tok, jsonl_identity(t.data, tok.hash))
    cfg, start_ckpt = began.cfg, began.start
    t, m = cfg.train, cfg.model
    # plans carry the path of the file each function came from, not its content key
    record_documents(run, began, started_from=t.init_from or None, unknown=(
        f"the plans in {printable(t.data)}: the functions they hold are not recorded by the file they came "
        f"from",))

    # -- model ----------------------------------------------------------------------------------------------
    model = built(cfg).to(device)
    if t.init_from and start_ckpt is None:
        init_from(run, model, tok)
    say(f"model: hrm, {model.num_params():,} parameters ({model.num_params(True):,} non-embedding); planner "
        f"{m.planner_layers}, generator {m.generator_layers}, refiner {m.refiner_layers} layers x {m.n_embd} "
        f"wide, {m.n_head} heads; plan context {m.plan_len}, code context {m.code_len}, vocab {m.vocab_size}")

    # -- batches and budget ---------------------------------------------------------------------------------
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
    total = budget(cfg, tokens_per_step,
                   max(1, math.ceil((t.epochs or 1.0) * batches.per_epoch / t.grad_accum_steps)))

    # -- evaluation and samples -----------------------------------------------------------------------------
    began = sized_evaluation(began, tokens_per_step, total, say)  # a short run scores fewer tokens
    t = began.cfg.train
    token_bytes = token_byte_lengths(tok, m.vocab_size).to(device)
    val_batches = (HRMBatches(val_data, tok, min(t.batch_size, len(val_data)), m.plan_len, m.code_len,
                              seed=t.seed,
                              shuffle=False, device=device, labels=labels) if val_data is not None else None)

    def evaluate(mdl):
        if val_batches is None:
            return None
        r = evaluate_hrm(mdl, val_batches, t.eval_tokens, device, precision, token_bytes)
        if t.syntax_cases:  # the seed's syntax validation during training: generated bodies parsed
            g = hrm_generation_eval(mdl, tok, val_data, t.syntax_cases,
                                    max_plan_tokens=min(64, m.plan_len // 2),
                                    max_code_tokens=min(128, m.code_len // 2))
            r["extra"].update({k: g[k]
                               for k in ("syntax_valid_rate", "avg_iterations", "plan_exact", "code_ast_f1")
                               if k in g})
        return r

    def sample(mdl, step):
        return sample_hrm(mdl, tok, val_data or train_data, step, t.sample_tokens)

    # -- train ----------------------------------------------------------------------------------------------
    return train(run, began, model, batches, hrm_loss_fn, total_steps=total, tokens_per_step=tokens_per_step,
                 tok=tok, evaluate=evaluate, sample=sample)


def sample_hrm(model, tok: CodeTokenizer, data: PlanData, step: int, max_tokens: int = 64) -> str:
    """Plan, code and refinement iterations for the first record's prompt,
    greedy (comparable across steps)."""
    was = model.training
    model.eval()
    try:
        r = model.generate(data.prompt_ids[0], max_plan_tokens=max_tokens, max_code_tokens=max_tokens)
    finally:
        model.train(was)
    its = " ".join(f"[{i['iteration']}: {i['decision']} p_done={i['p_done']:.2f}]" for i in r["iterations"])
    return (f"{data.prompts[0]}\n# plan: {tok.decode(r['plan'])}\n# code:\n{tok.decode(r['code'])}\n"
            f"# refinement: {its or 'none'}")
