"""The training loop, used by every stage. Each iteration reads top to bottom in a fixed order:
evaluate, sample, checkpoint, stop check, one optimisation step (accumulating micro-batches), log.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import time
from pathlib import Path

import torch

from ..config import ConfigError, RunConfig, dumps_toml
from ..device import autocast, choose_device, choose_precision, memory_gib, peak_flops
from ..engine import Engine, SamplingParams
from ..evaluate import evaluate_loss, token_byte_lengths
from ..loader import BatchLoader
from ..models.gpt import GPT, GPTConfig
from ..shards import ShardSet
from ..tokenizer import CodeTokenizer
from . import checkpoint as ckpt_io
from .logging import RunLogger
from .optim import build_optimizer, lr_at


class TrainingError(RuntimeError):
    """Training cannot go on; the message says why and what to do."""


def shape_diff(saved: dict, cfg: GPTConfig) -> dict:
    """Fields whose difference makes saved weights unusable (dropout rates may change between stages)."""
    return {k: (v, getattr(cfg, k, None)) for k, v in saved.items()
            if not k.endswith("dropout") and getattr(cfg, k, None) != v}


def round_up(n: int, k: int) -> int:
    return (n + k - 1) // k * k


class Trainer:
    def __init__(self, cfg: RunConfig, resume: bool = False, log=print):
        self.cfg, self.resume, self.print = cfg, resume, log
        t = cfg.train
        if not t.data or not t.out:
            raise ConfigError("train needs --data DIR (from `codeforge prepare`) and --out RUN")
        self.run_dir = Path(t.out)

        # -- distributed (torchrun sets these) -------------------------------------------------------------
        self.ddp = int(os.environ.get("WORLD_SIZE", "1")) > 1
        self.rank = int(os.environ.get("RANK", "0"))
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.master = self.rank == 0

        # -- device and precision: chosen here, once, and said why ---------------------------------------------
        try:
            self.device, why_dev = choose_device(t.device)
            self.precision, why_prec = choose_precision(self.device, t.precision)
        except ValueError as e:
            raise ConfigError(str(e)) from e
        if self.ddp:
            torch.distributed.init_process_group("nccl" if self.device.type == "cuda" else "gloo")
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
        self.say(f"device: {self.device} ({why_dev}); precision: {self.precision} ({why_prec})")

        # -- data and tokenizer ---------------------------------------------------------------------------
        self.train_set = ShardSet(t.data, "train")
        self.val_set = ShardSet(t.data, "val") if self.train_set.meta["splits"]["val"]["tokens"] else None
        self.tok = CodeTokenizer.load(Path(t.data) / "tokenizer")
        self.train_set.check_tokenizer(self.tok.hash, f"the tokenizer copied beside it")
        m = cfg.model
        if m.vocab_size == 0:  # from the data, padded to a multiple of 64 for fast matmuls
            m.vocab_size = round_up(self.tok.vocab_size, 64)
        elif m.vocab_size < self.tok.vocab_size:
            raise ConfigError(f"model.vocab_size = {m.vocab_size} is smaller than the tokenizer's vocabulary "
                              f"({self.tok.vocab_size}); drop --vocab-size to take it from the data")
        cfg.validate()

        # -- resume or init_from ------------------------------------------------------------------------
        self.start_ckpt = None
        if self.resume:
            try:
                self.start_ckpt = ckpt_io.find_checkpoint(self.run_dir)
            except ckpt_io.CheckpointError:
                self.say(f"--resume: no checkpoint in {self.run_dir} yet; starting fresh")
        elif (self.run_dir / "checkpoints").exists() and any((self.run_dir / "checkpoints").iterdir()):
            raise ConfigError(f"{self.run_dir} already holds a training run; pass --resume to continue it, or "
                              f"choose another --out (nothing was changed)")
        if self.start_ckpt is not None:
            self._check_compatible(self.start_ckpt, "--resume")

        # -- model -----------------------------------------------------------------------------------------
        torch.manual_seed(t.seed)
        self.model = GPT(m).to(self.device)
        self.model.grad_checkpointing = t.grad_checkpointing
        self.model.loss_chunk_rows = t.loss_chunk_rows
        if t.init_from and self.start_ckpt is None:
            self._init_from(t.init_from)
        self.flops_per_token = self.model.flops_per_token(m.block_size)
        self.say(f"model: {self.model.num_params():,} parameters ({self.model.num_params(True):,} non-embedding), "
                 f"{self.flops_per_token / 1e6:.1f} MFLOPs/token; {m.n_layer} layers, {m.n_head} heads, "
                 f"{m.n_embd} wide, context {m.block_size}, vocab {m.vocab_size}")
        self.fwd = self.model
        if t.compile:
            self.fwd = torch.compile(self.model)
        if self.ddp:
            from torch.nn.parallel import DistributedDataParallel as DDP
            self.fwd = DDP(self.fwd, device_ids=[self.device.index] if self.device.type == "cuda" else None)

        try:
            self.opt = build_optimizer(self.model, t.optimizer, t.learning_rate, t.weight_decay,
                                       (t.beta1, t.beta2), self.device)
        except ValueError as e:
            raise ConfigError(str(e)) from e
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.precision == "fp16")
        try:
            self.loader = BatchLoader(self.train_set, t.batch_size, m.block_size, seed=t.seed, rank=self.rank,
                                      world_size=self.world, device=self.device)
        except ValueError as e:  # too little data for one batch
            raise ConfigError(str(e)) from e
        self.tokens_per_step = t.batch_size * m.block_size * t.grad_accum_steps * self.world
        self.total_steps = self._budget()
        self.token_bytes = token_byte_lengths(self.tok, m.vocab_size)
        self.peak = peak_flops(self.device)

        self.step, self.tokens, self.best_val, self.bad_in_row, self.skipped = 0, 0, math.inf, 0, 0
        self.last_val: float | None = None
        self.last_val_step = -1
        if self.start_ckpt is not None:
            self._restore(self.start_ckpt)

    # -- helpers -------------------------------------------------------------------------------------------
    def say(self, msg: str) -> None:
        if self.master:
            self.print(msg)

    def _budget(self) -> int:
        t = self.cfg.train
        if t.max_iters:
            return t.max_iters
        if t.max_tokens:
            return math.ceil(t.max_tokens / self.tokens_per_step)
        epochs = t.epochs or 1.0
        return max(1, math.ceil(epochs * self.loader.per_epoch / t.grad_accum_steps))

    def _init_from(self, src: str) -> None:
        """Start from another run's weights (staged training): same shape and tokenizer, fresh optimizer."""
        try:
            ck = ckpt_io.find_checkpoint(src, "best")
        except ckpt_io.CheckpointError as e:
            raise ConfigError(f"--init-from: {e}") from e
        self._check_compatible(ck, "--init-from")
        ckpt_io.load_weights(self.model, ck)
        self.say(f"initialised weights from {ck}")

    def _check_compatible(self, ck: Path, what: str) -> None:
        """Refuse a checkpoint whose weights do not fit this run's model or whose tokenizer is not the data's."""
        saved = ckpt_io.read_config(ck)
        diff = shape_diff(saved["model"], self.cfg.model)
        if diff:
            raise ConfigError(f"{what} {ck}: model shape differs (field: (checkpoint, this run)) {diff}; use the "
                              f"same model settings as the run you continue from")
        if saved.get("tokenizer_hash") != self.tok.hash:
            raise ConfigError(f"{what} {ck}: it was trained with tokenizer {saved.get('tokenizer_hash')} but "
                              f"{self.cfg.train.data} uses {self.tok.hash}; prepare the data with that tokenizer")

    def _restore(self, ck: Path) -> None:
        ckpt_io.load_weights(self.model, ck)
        st = ckpt_io.load_train_state(ck)
        self.opt.load_state_dict(st["optimizer"])
        self.scaler.load_state_dict(st["scaler"])
        self.loader.load_state_dict(st["loader"])
        ckpt_io.set_rng_state(st["rng"])
        self.step, self.tokens = st["step"], st["tokens"]
        self.best_val, self.skipped = st["best_val"], st["skipped"]
        self.last_val, self.last_val_step = st.get("last_val"), st.get("last_val_step", -1)
        self.say(f"resumed from {ck} at step {self.step} ({self.tokens:,} tokens)")

    def _save(self, final: bool = False) -> None:
        if not self.master:
            return
        # "best" only for weights evaluated at this very step, and strictly better than any before
        best = self.last_val is not None and self.last_val_step == self.step and self.last_val < self.best_val
        if best:
            self.best_val = self.last_val
        state = {"optimizer": self.opt.state_dict(), "scaler": self.scaler.state_dict(),
                 "loader": self.loader.state_dict(), "rng": ckpt_io.rng_state(), "step": self.step,
                 "tokens": self.tokens, "best_val": self.best_val, "skipped": self.skipped, "last_val": self.last_val,
                 "last_val_step": self.last_val_step}
        config = {**self.cfg.to_dict(), "tokenizer_hash": self.tok.hash}
        path = ckpt_io.save_checkpoint(self.run_dir, self.step, self.model, config, state, self.tok.path,
                                       self.cfg.train.keep_last, best=best, final=final)
        self.logger.message(f"saved {path}{' (best)' if best else ''}")

    def _evaluate(self) -> dict | None:
        if self.val_set is None or not self.master:
            return None
        t = self.cfg.train
        try:
            r = evaluate_loss(self.model, self.val_set, t.batch_size, self.cfg.model.block_size, t.eval_iters,
                              self.device, self.precision, self.token_bytes)
        except ValueError as e:  # validation split smaller than one batch
            if not getattr(self, "_warned_val", False):
                self.logger.message(f"no evaluation (so no 'best' checkpoint): {e}")
                self._warned_val = True
            return None
        self.last_val, self.last_val_step = r["val_loss"], self.step
        rec = {"step": self.step, "val_loss": r["val_loss"], "val_perplexity": r["perplexity"],
               "val_bpb": r["bits_per_byte"], "tokens": self.tokens}
        self.logger.log(rec)
        self.logger.message(f"step {self.step}: val loss {r['val_loss']:.4f}, perplexity {r['perplexity']:.2f}, "
                            f"{r['bits_per_byte']:.3f} bits/byte")
        return rec

    def _sample(self) -> None:
        if not self.master:
            return
        eng = Engine(self.model, self.tok, self.device, self.precision)
        text = eng.generate([""], SamplingParams(max_new_tokens=self.cfg.train.sample_tokens, temperature=0.8,
                                                 top_k=50, seed=self.step))[0]
        self.model.train()
        with open(self.run_dir / "samples.jsonl", "a") as f:
            f.write(json.dumps({"step": self.step, "text": text}) + "\n")
        self.logger.message(f"sample at step {self.step}:\n{text[:400]}")

    # -- the loop ------------------------------------------------------------------------------------------
    def run(self) -> dict:
        t, total = self.cfg.train, self.total_steps
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.master:
            (self.run_dir / "config.toml").write_text(dumps_toml(self.cfg.to_dict()))
        self.logger = RunLogger(self.run_dir, total, self.step, t.tensorboard, t.wandb, t.wandb_project,
                                self.cfg.to_dict(), t.progress, enabled=self.master)
        self.say(f"training {total} steps of {self.tokens_per_step:,} tokens "
                 f"(batch {t.batch_size} x accumulation {t.grad_accum_steps} x {self.world} rank(s) x context "
                 f"{self.cfg.model.block_size}); run directory {self.run_dir}")
        stop = {"signal": None}

        def on_signal(signum, frame):
            stop["signal"] = signal.Signals(signum).name

        old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        start_step = self.step
        self.model.train()
        t_last, tokens_last = time.perf_counter(), self.tokens
        try:
            while True:
                if self.ddp:  # every rank must agree to stop at the same step, or the others hang in all-reduce
                    flag = torch.tensor([1 if stop["signal"] else 0], device=self.device)
                    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
                    if flag.item() and not stop["signal"]:
                        stop["signal"] = "SIGTERM"
                last = self.step >= total
                fresh = self.step != start_step or start_step == 0
                t_aside = time.perf_counter()  # evaluation, samples and saves are not training throughput
                if fresh and ((t.eval_every and self.step % t.eval_every == 0) or last):
                    self._evaluate()
                if fresh and t.sample_every and self.step % t.sample_every == 0 and self.step > 0:
                    self._sample()
                if last or stop["signal"] or (t.save_every and self.step % t.save_every == 0 and self.step > start_step):
                    self._save(final=last)
                if last or stop["signal"]:
                    break
                t_last += time.perf_counter() - t_aside
                loss, norm = self._optimisation_step()
                self.step += 1
                self.tokens += self.tokens_per_step
                if self.step % t.log_every == 0 or self.step == 1 or self.step == total:
                    now = time.perf_counter()
                    tps = (self.tokens - tokens_last) / max(now - t_last, 1e-9)
                    t_last, tokens_last = now, self.tokens
                    rec = {"step": self.step, "loss": loss, "lr": self.opt.param_groups[0]["lr"],
                           "grad_norm": norm, "tokens": self.tokens, "tokens_per_s": tps}
                    if self.peak:
                        rec["mfu"] = tps * self.flops_per_token / (self.peak * self.world)
                    if self.device.type == "cuda":
                        rec["memory_gib"] = memory_gib(self.device)
                    self.logger.log(rec)
                    post = {"loss": f"{loss:.4f}", "lr": f"{rec['lr']:.2e}", "tok/s": f"{tps:,.0f}"}
                    if "mfu" in rec:
                        post["mfu"] = f"{rec['mfu']:.1%}"
                    if "memory_gib" in rec:
                        post["mem"] = f"{rec['memory_gib']:.1f}G"
                    self.logger.progress(self.step, post)
            if self.ddp:  # normal end only (after an error a barrier would hang): rank 0 may still be saving
                torch.distributed.barrier()
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            self.logger.close()
            if self.ddp:
                torch.distributed.destroy_process_group()
        if stop["signal"]:
            self.say(f"{stop['signal']}: saved a checkpoint at step {self.step}; continue with --resume")
        return {"step": self.step, "tokens": self.tokens, "val_loss": self.last_val, "interrupted": stop["signal"],
                "skipped_steps": self.skipped, "run_dir": str(self.run_dir)}

    def _optimisation_step(self) -> tuple[float, float]:
        """One optimizer step at this step's learning rate; counts skipped (non-finite) steps and stops the run
        after max_bad_steps of them in a row."""
        t = self.cfg.train
        lr = lr_at(self.step, base_lr=t.learning_rate, warmup=t.warmup_steps, total=self.total_steps,
                   schedule=t.schedule, min_ratio=t.min_lr_ratio, decay_fraction=t.decay_fraction)
        for g in self.opt.param_groups:
            g["lr"] = lr
        loss_v, norm_v, applied = train_step(self.fwd, self.model, self.opt, self.scaler, self.loader.next_batch,
                                             t.grad_accum_steps, t.grad_clip, self.device, self.precision, self.ddp)
        if applied:
            self.bad_in_row = 0
        else:
            self.skipped += 1
            self.bad_in_row += 1
            self.logger.message(f"step {self.step + 1}: non-finite loss {loss_v} / grad norm {norm_v}; update skipped")
            if self.bad_in_row >= t.max_bad_steps:
                raise TrainingError(
                    f"{self.bad_in_row} non-finite losses in a row at step {self.step + 1}; stopping without writing "
                    f"NaN weights. Lower --learning-rate, check the data, or use --precision bf16/fp32; the last "
                    f"good checkpoint is in {self.run_dir / 'checkpoints'}")
        return loss_v, norm_v


def train_step(fwd, model, opt, scaler, next_batch, accum: int, clip: float, device: torch.device,
               precision: str, ddp: bool = False) -> tuple[float, float, bool]:
    """Forward/backward over `accum` micro-batches, unscale, clip, and step unless the loss or the gradient
    is non-finite (then the weights stay as they were). Returns (mean loss, grad norm, applied). The single
    host sync per optimizer step is the read of loss and norm together. The benchmarks time this function."""
    loss_acc = torch.zeros((), device=device)
    for micro in range(accum):
        x, y = next_batch()
        ctx = fwd.no_sync() if ddp and micro < accum - 1 else contextlib.nullcontext()
        with ctx:
            with autocast(device, precision):
                loss = fwd(x, y) / accum
            scaler.scale(loss).backward()
        loss_acc += loss.detach()
    scaler.unscale_(opt)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else math.inf)
    loss_v, norm_v = torch.stack([loss_acc.float(), norm.float()]).tolist()
    fp16_overflow = precision == "fp16" and math.isfinite(loss_v) and not math.isfinite(norm_v)
    applied = math.isfinite(loss_v) and (math.isfinite(norm_v) or fp16_overflow)
    if applied:
        scaler.step(opt)  # on an fp16 overflow the scaler skips the step itself and lowers the scale
    scaler.update()
    opt.zero_grad(set_to_none=True)
    return loss_v, norm_v, applied
