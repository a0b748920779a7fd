"""Language-model stages: pretrain and code on prepared shards; sft (instruction pairs) and tools (tool
calling) on chat shards, whose loader packs whole conversations and masks every target an assistant did not
write, so the loss is the same LM loss (SFT is data). Defaults per stage come from presets/stages.toml.
Prepared shards -> model (DDP or FSDP2, train/parallel.py) -> Trainer, with validation loss and a sample at
each evaluation."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import torch

from ..config import STAGE, ConfigError, RunConfig
from ..data.loader import batch_source
from ..data.shards import ShardSet
from ..data.trained import data_identity
from ..engine import Engine, SamplingParams
from ..models.gpt import set_attention
from ..evaluation.lm import validation_loss
from ..tokenizer import CodeTokenizer, token_byte_lengths
from ..train import parallel
from ..train.losses import lm_loss_fn
from ..train.memory import estimate
from ..train.step import Prefetcher
from .common import (Run, adapters, begin, budget, built, check_init_from, init_from, launch,
                     record_documents, sized_evaluation, train, vocabulary)


def run(cfg: RunConfig, resume: bool = False, log=print) -> dict:
    """Train (or resume) the run `cfg` describes."""
    t = cfg.train
    if not t.data or not t.out:
        raise ConfigError("train needs --data DIR (from `codeforge prepare`) and --out RUN")
    ShardSet(t.data, "train")  # inputs first: a missing or unprepared --data is said before anything else
    check_init_from(t.init_from)
    sampler = chat_sample if STAGE[t.stage].chat == "yes" else plain_sample
    with launch(cfg, log) as run:
        return _train(run, resume, sampler)


def _train(run: Run, resume: bool, sampler: Callable[..., str]) -> dict:
    say, device, precision, rank, world = run.say, run.device, run.precision, run.rank, run.world
    t = run.cfg.train
    chat_stage = STAGE[t.stage].chat == "yes"
    # -- data and tokenizer -------------------------------------------------------------------------------
    train_set = ShardSet(t.data, "train")
    if chat_stage and not train_set.chat:
        raise ConfigError(f"--stage {t.stage} trains on chat data, but {t.data} holds plain text shards; "
                          "prepare chat JSONL with `codeforge prepare --chat ...` "
                          "(or `codeforge make-sft` first)")
    if train_set.chat and not chat_stage:
        raise ConfigError(f"{t.data} holds chat data; train it with --stage sft (or tools), not {t.stage}")
    val_set = ShardSet(t.data, "val") if train_set.meta["splits"]["val"]["tokens"] else None
    if val_set is None:
        say(f"note: {t.data} has no validation split: no evaluation and no 'best' checkpoint (prepare with "
            f"--val-fraction > 0 for them)")
    tok = CodeTokenizer.load(Path(t.data) / "tokenizer")
    train_set.check_tokenizer(tok.hash, "the tokenizer copied beside it")

    # -- the start: lock, recorded config, resume point (from here on the run's config is began.cfg) -------
    began = begin(run, vocabulary(run.cfg, tok, "data"), resume, tok, data_identity(t.data))
    cfg, start_ckpt = began.cfg, began.start
    t, m = cfg.train, cfg.model
    # the documents this run trains on (and its --init-from run did), so a later score can be checked
    record_documents(run, began, t.data, t.init_from or None)

    # -- model: under FSDP only rank 0 builds the whole model (parallel.wrap fills the other ranks) ----------
    plan = None
    if world > 1 and t.parallel == "auto" and device.type == "cuda" and t.optimizer == "adamw":
        # auto picks FSDP when DDP would not fit; every rank decides on the same numbers (the smallest device)
        p = estimate(m, t, world, precision, t.fsdp_offload)
        mem = torch.tensor([float(torch.cuda.get_device_properties(device).total_memory)], device=device)
        torch.distributed.all_reduce(mem, op=torch.distributed.ReduceOp.MIN)
        plan = (p.total("ddp"), p.total("fsdp"), mem.item())
    mode = parallel.choose_mode(t.parallel, world, device, plan)
    own = parallel.materialises(mode[0], rank)
    # on the host: the trainer's parallel.wrap places it (FSDP: shard by shard)
    model = built(cfg, on_meta=not own)
    model.grad_checkpointing = t.grad_checkpointing
    say(set_attention(model, t.attention, device))
    model.loss_chunk_rows = t.loss_chunk_rows
    loaded = init_from(run, model, tok, load=own) if t.init_from and start_ckpt is None else None
    if t.lora_rank:
        adapters(run, model, began.record, start_ckpt, loaded, mode[0])
    if chat_stage and not t.init_from and start_ckpt is None:
        say(f"note: --stage {t.stage} without --init-from trains a chat model from random weights; pass "
            f"--init-from PRETRAINED_RUN to fine-tune one")
    say(f"model: {model.num_params():,} parameters ({model.num_params(True):,} non-embedding), "
        f"{model.flops_per_token() / 1e6:.1f} MFLOPs/token; {m.n_layer} layers, {m.n_head} heads, "
        f"{m.n_embd} wide, context {m.block_size}, vocab {m.vocab_size}")

    # -- batches and budget ---------------------------------------------------------------------------------
    try:
        batches = batch_source(train_set, t.batch_size, m.block_size, tok.special_ids, seed=t.seed, rank=rank,
                               world_size=world, device=device, fim_rate=0.0 if chat_stage else t.fim_rate,
                               fim_spm_rate=t.fim_spm_rate)
    except ValueError as e:  # too little data for one batch
        raise ConfigError(str(e)) from e
    if t.prefetch == "on" or (t.prefetch == "auto" and device.type == "cuda"):
        batches = Prefetcher(batches, device)  # the next batch built while the step runs
    if getattr(batches, "split", 0) or getattr(batches, "dropped", 0):
        say(f"chat data: {batches.split} conversation(s) longer than one window ({m.block_size} tokens of "
            f"context and the target after them) split at turn boundaries, {batches.dropped} dropped (a "
            "single turn longer than the context)")
    tokens_per_step = t.batch_size * m.block_size * t.grad_accum_steps * world
    total = budget(cfg, tokens_per_step,
                   max(1, math.ceil((t.epochs or 1.0) * batches.per_epoch / t.grad_accum_steps)))
    say(passes_note(total, tokens_per_step, train_set.tokens, bool(t.time_budget)))

    # -- evaluation and samples -----------------------------------------------------------------------------
    began = sized_evaluation(began, tokens_per_step, total, say)  # a short run scores fewer tokens
    t = began.cfg.train
    token_bytes = token_byte_lengths(tok, m.vocab_size)
    warned = []

    def evaluate(mdl):
        if val_set is None:
            return None
        try:
            return validation_loss(mdl, val_set, m.block_size, tok.special_ids, t.eval_tokens, device,
                                   precision, token_bytes)
        except ValueError as e:  # a validation split too small to score
            if not warned:
                say(f"no evaluation (so no 'best' checkpoint): {e}")
                warned.append(1)
            return None

    # -- train ----------------------------------------------------------------------------------------------
    return train(run, began, model, batches, lm_loss_fn, total_steps=total, tokens_per_step=tokens_per_step,
                 tok=tok, evaluate=evaluate, mode=mode, fixed_shapes=True,
                 sample=lambda mdl, step: sampler(mdl, tok, device, precision, step, t.sample_tokens),
                 plan_note=lambda steps: passes_note(steps, tokens_per_step, train_set.tokens, False))


# beyond ~4 passes, repeated data is worth much less than new (Muennighoff et al. 2023), and a small model on
# a small repository starts to memorise: validation loss turns up
MANY_PASSES = 4


def passes_note(total: int, tokens_per_step: int, train_tokens: int, budgeted: bool) -> str:
    """The plan in passes over the training split, with a warning and what to do where they are many."""
    passes = total * tokens_per_step / max(train_tokens, 1)
    up_to = "up to " if budgeted else ""
    line = (f"plan: {up_to}{total:,} steps x {tokens_per_step:,} tokens = {up_to}{passes:.1f} passes over "
            f"the training split ({train_tokens:,} tokens)")
    if passes <= MANY_PASSES:
        return line
    if budgeted:  # the time budget chooses the count after the first steps; that plan is the one judged
        return line + "; the time budget chooses how many, and the plan is said again then"
    fewer = max(1, int(MANY_PASSES * train_tokens / tokens_per_step))
    return (f"{line}\nwarning: {passes:.0f} passes over the same {train_tokens:,} tokens: the model will "
            "memorise them (training loss falls toward 0 while validation loss rises after the first few "
            "passes; the `best` checkpoint keeps the weights from before that). More code helps most: train "
            "on a larger corpus of the same language first, then on this one (docs/pipeline.md, \"A small "
            f"repository\"); or train less: --max-iters {fewer} is {MANY_PASSES} passes")


def plain_sample(model, tok, device, precision, step: int, max_new_tokens: int = 64) -> str:
    """A sample from the start of a document (seeded by the step)."""
    eng = Engine(model, tok, device, precision)
    return eng.generate([""], SamplingParams(max_new_tokens=max_new_tokens, temperature=0.8, top_k=50,
                                             seed=step))[0]


SAMPLE_PROMPT = [{"role": "user", "content": "Write a Python function that returns the reverse of a string."}]


def chat_sample(model, tok, device, precision, step: int, max_new_tokens: int = 96) -> str:
    """The model's reply to a fixed request, greedy, so samples across steps are comparable."""
    r = Engine(model, tok, device, precision).chat(SAMPLE_PROMPT, None,
                                                   SamplingParams(max_new_tokens=max_new_tokens,
                                                                  temperature=0.0))
    return r["text"] + ("<|im_end|>" if r["ended"] else " [no <|im_end|>]")
