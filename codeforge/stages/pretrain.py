"""Language-model stages (pretrain, code; and, through sft.py, the chat stages): prepared shards -> model ->
Trainer. Owns the process group, device and precision choice, the vocabulary from the data's tokenizer, the
run-directory lock, --resume and --init-from with their checks (an intact checkpoint, the same model shape,
tokenizer, batch, seed and data: checkpoint.py), the budget, and the eval/sample callbacks."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from .. import checkpoint as ckpt_io
from ..config import CHAT_STAGES, ConfigError, RunConfig
from ..device import (choose_device, choose_precision, distributed_env, setup_distributed, startup_group,
                      teardown_distributed)
from ..evaluate import token_byte_lengths, validation_loss
from ..loader import batch_source
from ..models import build_model
from ..shards import ShardSet
from ..tokenizer import CodeTokenizer
from ..train import parallel
from ..train.losses import lm_loss_fn
from ..train.trainer import Trainer


FSDP_STAGES = ("pretrain", "code", "sft", "tools")  # one model, a loss on its outputs, nothing beside it


def round_up(n: int, k: int) -> int:
    return (n + k - 1) // k * k


def found_by_rank0(find: Callable[[], Path | None]) -> Path | None:
    """find() (which reads and hashes a checkpoint's files) on rank 0 only, its answer or its error passed to
    the other ranks: N ranks sharing a filesystem verify a checkpoint once, not N times, and all take the
    same one. One process: just find()."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return find()
    msg: list = [None]
    group = startup_group()  # hashing a big checkpoint can take longer than --dist-timeout
    if torch.distributed.get_rank() == 0:
        try:
            msg[0] = ("found", find())
        except Exception as e:
            msg[0] = ("error", str(e))
            torch.distributed.broadcast_object_list(msg, src=0, group=group)
            raise
    torch.distributed.broadcast_object_list(msg, src=0, group=group)
    kind, value = msg[0]
    if kind == "error":  # rank 0 raised it (and the CLI prints it there); the others end with it too
        raise ConfigError(value)
    return value


def resume_point(run_dir: Path, resume: bool, model_dict: dict, tok_hash: str, data, run_config: dict, say):
    """The checkpoint a --resume continues from (None: start fresh), checked against this run's model shape,
    tokenizer, data and fixed settings; without --resume, a run directory that already holds checkpoints is
    refused (nothing is overwritten). Every stage starts this way."""
    start = None
    if resume:
        def newest() -> Path | None:
            try:  # the newest intact checkpoint (a damaged newer one is named and skipped)
                return ckpt_io.find_checkpoint(run_dir, "latest", train_state=True, log=say)
            except ckpt_io.NoCheckpointError:
                say(f"--resume: no checkpoint in {run_dir} yet; starting fresh")
                return None
        start = found_by_rank0(newest)
    elif (run_dir / "checkpoints").exists() and any((run_dir / "checkpoints").iterdir()):
        raise ConfigError(f"{run_dir} already holds a training run; pass --resume to continue it, or "
                          f"choose another --out (nothing was changed)")
    if start is not None:
        ckpt_io.check_compatible(start, model_dict, tok_hash, "--resume", data)
        for note in ckpt_io.check_resume(start, run_config):
            say(f"--resume: {note}")
    return start


def launch(cfg: RunConfig, log, train) -> dict:
    """The preamble every stage shares: the device and precision (said once), the process group under
    torchrun (alive exactly as long as this call), a `say` that only rank 0 speaks through, and an ExitStack
    for what the run holds (the run-directory lock). Calls train(say, device, precision, rank, world, held)."""
    t = cfg.train
    device, why_dev = choose_device(t.device)
    precision, why_prec = choose_precision(device, t.precision)
    rank, world = distributed_env()
    if world > 1 and t.parallel == "fsdp" and t.stage not in FSDP_STAGES:
        raise ConfigError(f"--parallel fsdp is for the language-model stages ({', '.join(FSDP_STAGES)}); --stage "
                          f"{t.stage} builds extra models (reference, reward, value) beside the trained one and "
                          f"runs with --parallel ddp")
    setup_distributed(device, t.dist_timeout)
    try:
        say = log if rank == 0 else (lambda m: None)
        say(f"device: {device} ({why_dev}); precision: {precision} ({why_prec})")
        with contextlib.ExitStack() as held:
            return train(say, device, precision, rank, world, held)
    finally:
        teardown_distributed()


def run(cfg: RunConfig, resume: bool = False, log=print,
        sampler: Callable[..., str] | None = None) -> dict:
    """Train (or resume) the run `cfg` describes."""
    t = cfg.train
    if not t.data or not t.out:
        raise ConfigError("train needs --data DIR (from `codeforge prepare`) and --out RUN")
    ShardSet(t.data, "train")  # inputs first: a missing or unprepared --data is said before anything else
    check_init_from(t.init_from)
    return launch(cfg, log, lambda say, device, precision, rank, world, held: _train(
        cfg, resume, say, device, precision, rank, world, sampler or plain_sample, held))


def check_init_from(init_from: str) -> None:
    if init_from and not Path(init_from).exists():
        raise ConfigError(f"--init-from {init_from} does not exist: pass a run directory (from `codeforge "
                          f"train --out`) or one of its checkpoints")


def _train(cfg: RunConfig, resume: bool, say, device: torch.device, precision: str, rank: int, world: int,
           sampler, held: contextlib.ExitStack) -> dict:
    t = cfg.train
    run_dir = Path(t.out)
    # -- data and tokenizer -------------------------------------------------------------------------------
    train_set = ShardSet(t.data, "train")
    chat_stage = t.stage in CHAT_STAGES
    if chat_stage and not train_set.chat:
        raise ConfigError(f"--stage {t.stage} trains on chat data, but {t.data} holds plain text shards; prepare "
                          f"chat JSONL with `codeforge prepare --chat ...` (or `codeforge make-sft` first)")
    if train_set.chat and not chat_stage:
        raise ConfigError(f"{t.data} holds chat data; train it with --stage sft (or tools), not {t.stage}")
    val_set = ShardSet(t.data, "val") if train_set.meta["splits"]["val"]["tokens"] else None
    if val_set is None:
        say(f"note: {t.data} has no validation split: no evaluation and no 'best' checkpoint (prepare with "
            f"--val-fraction > 0 for them)")
    tok = CodeTokenizer.load(Path(t.data) / "tokenizer")
    train_set.check_tokenizer(tok.hash, "the tokenizer copied beside it")
    m = cfg.model
    if m.vocab_size == 0:  # from the data, padded to a multiple of 64 for fast matmuls
        cfg.model = m = replace(m, vocab_size=round_up(tok.vocab_size, 64))
    elif m.vocab_size < tok.vocab_size:
        raise ConfigError(f"model.vocab_size = {m.vocab_size} is smaller than the tokenizer's vocabulary "
                          f"({tok.vocab_size}); drop --vocab-size to take it from the data")
    cfg.validate()

    # -- the run directory: one trainer at a time (rank 0 holds it for all ranks) ---------------------------
    if rank == 0:
        held.enter_context(ckpt_io.run_lock(run_dir))
    run_config = {**cfg.to_dict(), "tokenizer_hash": tok.hash, "data_identity": ckpt_io.data_identity(t.data),
                  "world_size": world}

    # -- resume or init_from --------------------------------------------------------------------------------
    model_dict = m.to_dict()
    start_ckpt = resume_point(run_dir, resume, model_dict, tok.hash, t.data, run_config, say)
    if run_config["train"]["grad_accum_steps"] != t.grad_accum_steps:  # resumed on another number of ranks
        cfg.train = t = replace(t, grad_accum_steps=run_config["train"]["grad_accum_steps"])

    # -- model ----------------------------------------------------------------------------------------------
    torch.manual_seed(t.seed)
    plan = None
    if world > 1 and t.parallel == "auto" and device.type == "cuda" and t.optimizer == "adamw":
        # auto picks FSDP when DDP would not fit; every rank decides on the same numbers (the smallest device)
        from ..plan import estimate
        p = estimate(m, t, world, precision, t.fsdp_offload)
        mem = torch.tensor([float(torch.cuda.get_device_properties(device).total_memory)], device=device)
        torch.distributed.all_reduce(mem, op=torch.distributed.ReduceOp.MIN)
        plan = (p.total("ddp"), p.total("fsdp"), mem.item())
    mode = parallel.choose_mode(t.parallel, world, device, plan)
    own = parallel.materialises(mode[0], rank)  # under FSDP only rank 0 holds the whole model (wrap fills the rest)
    with contextlib.nullcontext() if own else torch.device("meta"):
        model = build_model(m)  # on the host: the trainer's parallel.wrap places it (FSDP: shard by shard)
    model.grad_checkpointing = t.grad_checkpointing
    model.loss_chunk_rows = t.loss_chunk_rows
    if t.init_from and start_ckpt is None:
        ck = found_by_rank0(lambda: ckpt_io.find_checkpoint(t.init_from, "auto", log=say))
        ckpt_io.check_compatible(ck, model_dict, tok.hash, "--init-from", t.data)
        if own:
            ckpt_io.load_weights(model, ck)
        say(f"initialised weights from {ck}")
    elif chat_stage and start_ckpt is None:
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
    if getattr(batches, "split", 0) or getattr(batches, "dropped", 0):
        say(f"chat data: {batches.split} conversation(s) longer than the context ({m.block_size + 1} tokens) "
            f"split at turn boundaries, {batches.dropped} dropped (a single turn longer than the context)")
    tokens_per_step = t.batch_size * m.block_size * t.grad_accum_steps * world
    if t.max_iters:
        total = t.max_iters
    elif t.max_tokens:
        total = math.ceil(t.max_tokens / tokens_per_step)
    else:
        total = max(1, math.ceil((t.epochs or 1.0) * batches.per_epoch / t.grad_accum_steps))
    token_bytes = token_byte_lengths(tok, m.vocab_size)
    warned = []

    def evaluate(mdl):
        if val_set is None:
            return None
        try:
            return validation_loss(mdl, val_set, m.block_size, tok.special_ids, t.eval_tokens, device, precision,
                                   token_bytes)
        except ValueError as e:  # a validation split too small to score
            if not warned:
                say(f"no evaluation (so no 'best' checkpoint): {e}")
                warned.append(1)
            return None

    trainer = Trainer(model, batches, lm_loss_fn, t, run_dir, device=device, precision=precision,
                      total_steps=total, tokens_per_step=tokens_per_step,
                      run_config=run_config, assets={"tokenizer": tok.path},
                      evaluate=evaluate, sample=lambda mdl, step: sampler(mdl, tok, device, precision, step, t.sample_tokens),
                      start_checkpoint=start_ckpt, rank=rank, world=world, log=say, mode=mode)
    return trainer.run()


def plain_sample(model, tok, device, precision, step: int, max_new_tokens: int = 64) -> str:
    """A sample from the start of a document (seeded by the step)."""
    from ..engine import Engine, SamplingParams
    eng = Engine(model, tok, device, precision)
    return eng.generate([""], SamplingParams(max_new_tokens=max_new_tokens, temperature=0.8, top_k=50, seed=step))[0]
