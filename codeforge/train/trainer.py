"""The training loop, used by every stage. It is handed its parts and never builds them: a model, a batch
source (`next()`, `state_dict()`, `load_state_dict()`), a loss function `loss_fn(model, batch) -> (loss,
metrics)`, the training config, the run directory, and callbacks to evaluate and sample. Stages
(codeforge/stages/) do the wiring. Each iteration reads top to bottom in a fixed order: the stop agreement,
evaluation, sampling, checkpointing, one optimisation step (accumulating micro-batches), the budget, the pace
line, the log; each component decides for itself whether this step is its step (`_evaluate_if_due`, ...).
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch

from .. import CodeforgeError, rundir
from .. import checkpoint as ckpt_io
from ..config import SECTIONS, TrainConfig, dumps_toml
from ..device import alone_threads, matmul_flops, memory_gib, peak_flops
from ..distributed import lost_peer
from . import parallel
from .logging import RunLogger, duration
from .optim import build_optimizer, lr_at, set_lr
from .step import LossFn, Readback, skips_on_device, train_step
from .stopping import StopRequests, resume_hint



class TrainingError(CodeforgeError):
    """Training cannot go on; the message says why and what to do."""


class Trainer:
    def __init__(self, model: torch.nn.Module, batches, loss_fn: LossFn, cfg: TrainConfig,
                 run_dir: str | Path, *,
                 device: torch.device, precision: str, total_steps: int, tokens_per_step: int,
                 run_config: dict, assets: dict[str, Path] | None = None,
                 evaluate: Callable[[torch.nn.Module], dict | None] | None = None,
                 sample: Callable[[torch.nn.Module, int], str] | None = None,
                 start_checkpoint: Path | None = None,
                 rank: int = 0, world: int = 1, log=print, aux: torch.nn.Module | None = None,
                 mode: tuple[str, str] | None = None, plan_note: Callable[[int], str] | None = None,
                 fixed_shapes: bool = False):
        """model: initialised (or loaded by the stage), on the host or `device` (wrap places it); under FSDP
        the ranks other than 0 may hand it on the meta device (parallel.materialises).
        batches: the training batch source.
        run_config: the resolved configuration saved with every checkpoint (it must let the checkpoint module
        rebuild the model; its model and train sections are also written to RUN/config.toml).
        assets: directories copied into every checkpoint (e.g. {"tokenizer": path}).
        evaluate(model) -> {"val_loss", ...} or None: every number in it is logged as val_KEY, its "extra"
        dict too; "objective" (default val_loss; lower is better) picks the "best" checkpoint.
        sample(model, step) -> text.
        start_checkpoint: resume from it (weights, optimizer, batch-source cursor, RNG, counters).
        aux: a module trained beside the model whose weights are not the model's (PPO's value head): its
        parameters join the optimizer (no weight decay) and gradient clipping, and its weights are saved in
        the training state, so checkpoints stay the bare model the engine, eval and export read.
        rank, world: this process among torchrun's. mode: (mode, why) from parallel.choose_mode, when the
        stage decided it (before building the model); otherwise decided here from cfg.parallel.
        plan_note(steps) -> what that many steps mean for the data (passes over it, and a warning): said
        again when --time-budget chooses the count, so a warning is about the plan that runs.
        fixed_shapes: every batch has the same shape (the LM stages' (B, T)), so --compile-shapes static
        may compile for that one shape; the stages whose batches are padded per batch (pairs, rollouts, the
        hierarchical model's) compile with PyTorch's dynamic shapes whatever it says."""
        self.model, self.batches, self.loss_fn, self.cfg = model, batches, loss_fn, cfg
        self.run_dir, self.device, self.precision = Path(run_dir), device, precision
        self.total_steps, self.tokens_per_step, self.run_config = total_steps, tokens_per_step, run_config
        self.assets, self.evaluate_fn, self.sample_fn = assets or {}, evaluate, sample
        self.plan_note = plan_note
        self.evals_done = 0  # evaluations this process ran
        self.budget_set = False  # --time-budget: the step count was chosen
        self.budget_cap = total_steps  # the most steps a budget may choose (--max-iters)
        self.rank, self.world, self.master = rank, world, rank == 0
        # several ranks (DDP or FSDP): they agree on stopping and average the logged loss
        self.ddp = world > 1
        self.print = log
        self.mode, why = mode or parallel.choose_mode(cfg.parallel, world, device)
        self.sharded = self.mode == "fsdp"
        if self.sharded and cfg.optimizer != "adamw":
            raise TrainingError(f"--parallel fsdp trains with adamw, not {cfg.optimizer}: "
                                + ("Muon orthogonalises whole weight matrices, and FSDP splits each "
                                   "across ranks" if cfg.optimizer == "muon"
                                   else "bitsandbytes' 8-bit state is not shardable")
                                + "; use --set optimizer=adamw, or --parallel ddp")
        if self.sharded and aux is not None:
            raise TrainingError("--parallel fsdp does not shard this stage's extra module (PPO's value "
                                "head); use --parallel ddp")
        if world > 1 or cfg.parallel == "fsdp":
            self.say(f"parallel: {self.mode} ({why})")
        compiled = cfg.compile == "on" or (cfg.compile == "auto" and device.type == "cuda")
        self.fwd = parallel.wrap(model, device, self.mode, compiled, precision, cfg.fsdp_offload,
                                 static=cfg.compile_shapes == "static" and fixed_shapes, say=self.say)
        self.compiled = compiled
        background = cfg.async_checkpoint == "on" or (cfg.async_checkpoint == "auto"
                                                      and device.type == "cuda")
        # DCP's background writes talk over a group of their own, never interleaved with training's
        # collectives
        self.ckpt_group = torch.distributed.new_group(backend="gloo") if self.sharded and background else None
        self.pending = None  # a sharded checkpoint still being written in the background
        self.aux = aux
        self.opt = build_optimizer(model, cfg.optimizer, cfg.learning_rate, cfg.weight_decay,
                                   (cfg.beta1, cfg.beta2), device, cfg.muon_lr, cfg.muon_momentum,
                                   cfg.muon_weight_decay)
        if aux is not None:
            self.opt.add_param_group({"params": list(aux.parameters()), "weight_decay": 0.0})
        self.params = [p for g in self.opt.param_groups for p in g["params"]]
        self.defer = self._host_sync(cfg.host_sync, device, precision)
        self.readback = Readback()  # --host-sync log: the steps' numbers not read yet
        self.line_wait: dict | None = None  # a log line due at a step whose numbers are not read yet
        self.last_numbers = (math.nan, math.nan)  # the last step's (loss, norm) read to the host
        self.last_read = 0  # the step they are of
        self.scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
        self.flops_per_token = model.flops_per_token()
        self.peak = peak_flops(device)
        self.step, self.tokens, self.best_val, self.bad_in_row, self.skipped = 0, 0, math.inf, 0, 0
        self.parts: dict = {}  # the loss_fn's own metrics since the last log line (train_step adds to it)
        self.parts_steps = 0
        self.last_val: float | None = None
        self.last_said: str | None = None  # a stage's own wording of its last evaluation
        self.last_val_step = -1
        if start_checkpoint is not None:
            self._restore(start_checkpoint)

    # -- helpers -------------------------------------------------------------------------------------------
    def say(self, msg: str) -> None:
        if self.master:
            self.print(msg)

    def _host_sync(self, asked: str, device: torch.device, precision: str) -> bool:
        """Whether the steps' numbers stay on the device until a log line (--host-sync log)."""
        able = skips_on_device(self.opt, precision, self.mode)
        if asked == "log" and not able:
            self.say("note: --host-sync log needs the fused AdamW to skip a non-finite step on the device "
                     f"(not {self.cfg.optimizer} with --precision {precision} under --parallel "
                     f"{self.mode}): the step's numbers are read after every step")
        return able and (asked == "log" or (asked == "auto" and device.type == "cuda"))

    def _restore(self, ck: Path) -> None:
        st = ckpt_io.load_train_state(ck)
        if ckpt_io.is_sharded(ck):  # an FSDP run's: DCP reshards it onto this run's ranks (or one process)
            ckpt_io.load_sharded_state(self.model, self.opt, ck)
        elif self.sharded:  # written by one process or DDP: read whole on every rank, each keeps its shard
            ckpt_io.load_whole_into_sharded(self.model, self.opt, ck, st["optimizer"])
        else:
            ckpt_io.load_weights(self.model, ck)
            self.opt.load_state_dict(st["optimizer"])
        if self.aux is not None:
            if "aux" not in st:
                raise TrainingError(f"--resume {ck}: the checkpoint holds no weights for this stage's "
                                    f"{type(self.aux).__name__}; it was written by another stage")
            self.aux.load_state_dict(st["aux"])
        self.scaler.load_state_dict(st["scaler"])
        try:
            self.batches.load_state_dict(st["loader"])
        except ValueError as e:
            raise TrainingError(f"--resume {ck}: {e}") from e
        ckpt_io.set_rng_state(st["rng"])
        self.step, self.tokens = st["step"], st["tokens"]
        self.best_val, self.skipped = st["best_val"], st["skipped"]
        self.last_val, self.last_val_step = st.get("last_val"), st.get("last_val_step", -1)
        self.say(f"resumed from {ck} at step {self.step} ({self.tokens:,} tokens)")

    def _finish_pending(self) -> None:
        """Publish the checkpoint written in the background (every rank together)."""
        job, self.pending = self.pending, None
        try:
            path = job.finish()
        except ckpt_io.CheckpointWriteError as e:
            raise TrainingError(f"training stopped at step {self.step}: {e}") from e
        self.logger.message(f"saved {path}{' (best)' if job.best else ''}")

    def _save(self, final: bool = False, now: bool = False) -> None:
        """now: not in the background (the run ends here)."""
        self._read_back()  # the skip count and the log line of the steps saved
        if self.pending is not None:
            self._finish_pending()
        if not self.master and not self.sharded:
            return
        # "best" only for weights evaluated at this very step, and strictly better than any before
        best = self.last_val is not None and self.last_val_step == self.step and self.last_val < self.best_val
        if best:
            self.best_val = self.last_val
        state = {"scaler": self.scaler.state_dict(),
                 "loader": self.batches.state_dict(), "rng": ckpt_io.rng_state(), "step": self.step,
                 "tokens": self.tokens, "best_val": self.best_val, "skipped": self.skipped,
                 "last_val": self.last_val, "last_val_step": self.last_val_step}
        if self.aux is not None:
            state["aux"] = {k: v.detach().clone() for k, v in self.aux.state_dict().items()}
        try:
            if self.sharded:  # every rank writes its shards of weights and optimizer state
                job = ckpt_io.save_sharded_checkpoint(self.run_dir, self.step, self.model, self.opt,
                                                      self.run_config, state, self.assets, self.cfg.keep_last,
                                                      best=best, final=final,
                                                      background_group=None if now else self.ckpt_group)
                if job.future is not None:
                    self.pending = job
                    return
                path = job.finish()
            else:
                state["optimizer"] = self.opt.state_dict()
                path = ckpt_io.save_checkpoint(self.run_dir, self.step, self.model, self.run_config, state,
                                               self.assets, self.cfg.keep_last, best=best, final=final)
        except ckpt_io.CheckpointWriteError as e:  # a full disk: stop here rather than train on unsaved
            raise TrainingError(f"training stopped at step {self.step}: {e}") from e
        self.logger.message(f"saved {path}{' (best)' if best else ''}")

    def _budget_steps(self, pace: "Pace", t_run: float, cap: int, sps: float) -> tuple[int, float, float]:
        """(steps, seconds per step, seconds per evaluation): the step count (at most `cap`, at least one more
        step) whose steps and evaluations end within --time-budget of t_run at `sps` seconds a step; every
        rank takes the smallest."""
        t = self.cfg
        sps = sps or 1e-9
        left = t.time_budget - (time.perf_counter() - t_run)
        per_eval = pace.eval_s if self.evaluate_fn else 0.0
        # steps n and the evaluations on the way (every eval_every steps, and one at the end) fit in `left`
        per_step = sps + (per_eval / t.eval_every if t.eval_every else 0.0)
        n = int(max(0.0, left - per_eval) / per_step)
        total = max(self.step + 1, min(cap, self.step + n))
        if self.ddp:
            agreed = torch.tensor([total], device=self.device)
            torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MIN)
            total = int(agreed.item())
        return total, sps, per_eval

    def _set_total(self, pace: "Pace", total: int) -> None:
        """The run's step count from now on, saved as max_iters (budget then off) in RUN/config.toml."""
        self.total_steps = total
        pace.total = total
        self.logger.set_total(total)
        self.run_config.setdefault("train", {}).update(max_iters=total, time_budget=0.0)
        if self.master:
            (self.run_dir / rundir.CONFIG).write_text(dumps_toml({k: v for k, v in self.run_config.items()
                                                                  if k in SECTIONS}))

    def _fit_budget(self, pace: "Pace", t_run: float) -> int:
        """--time-budget: from the measured seconds per step and the last evaluation's time, the step count
        that ends training and its evaluations within the budget (at most --max-iters); saved as max_iters."""
        t = self.cfg
        self.budget_set = True
        self.budget_cap = chosen_from = self.total_steps
        total, sps, per_eval = self._budget_steps(pace, t_run, chosen_from, pace.seconds_per_step(self.step))
        pace.mark(self.step)
        self._set_total(pace, total)
        self.say(f"time budget {duration(t.time_budget)}: {sps:.2f} s/step measured"
                 + (f" and {duration(per_eval)} per evaluation" if per_eval else "") + f", so {total} steps"
                 + (f" (of --max-iters {chosen_from})" if total < chosen_from else " (all of --max-iters)")
                 + f"; saved as max_iters in {rundir.CONFIG}: a re-run with --max-iters {total} repeats it")
        if self.plan_note:
            self.say(self.plan_note(total))
        return total

    def _refit_budget(self, pace: "Pace", t_run: float) -> int:
        """After an evaluation: the budget fitted again at the pace since the last fit (load that came or went
        since, the evaluation's real cost), when that moves the count by more than 5%."""
        old = self.total_steps
        total, sps, per_eval = self._budget_steps(pace, t_run, self.budget_cap, pace.recent(self.step))
        pace.mark(self.step)
        # within 5%, the change is the noise of a measured pace: keep the count rather than rewrite
        # config.toml and announce a new one after every evaluation
        if abs(total - old) <= max(1, 0.05 * old):
            return old
        self._set_total(pace, total)
        self.say(f"time budget {duration(self.cfg.time_budget)}: now {sps:.2f} s/step"
                 + (f" and {duration(per_eval)} per evaluation" if per_eval else "")
                 + f", so {total} steps instead of {old}; saved as max_iters in {rundir.CONFIG}")
        return total

    def _evaluate(self) -> None:
        self._read_back()
        if self.evaluate_fn is None or not (self.master or self.sharded):
            return
        if self.master and not self.evals_done:  # the first one can take minutes on a CPU: say it has begun
            self.logger.message(f"step {self.step}: evaluating (validation every {self.cfg.eval_every} steps"
                                + (f", up to {self.cfg.eval_tokens:,} tokens" if self.cfg.eval_tokens else "")
                                + ")...")
        # local ranks (stages/local.py): the others wait for rank 0's evaluation, so it may use their threads
        with alone_threads() if not self.sharded else contextlib.nullcontext():
            # under FSDP every rank runs it: each forward gathers the weights
            r = self.evaluate_fn(self.model)
        self.evals_done += 1
        self.model.train()
        if r is None:
            return
        self.last_val, self.last_val_step = r.get("objective", r.get("val_loss")), self.step
        self.last_said = r.get("message")
        if not self.master:
            return
        names = {"perplexity": "val_perplexity", "bits_per_byte": "val_bpb", "eval_tokens": "val_tokens"}
        rec = {"step": self.step, "tokens": self.tokens}
        rec.update({names.get(k, k if k.startswith("val_") else f"val_{k}"): v for k, v in r.items()
                    if k not in ("extra", "objective", "message")})
        rec.update({f"val_{k}": v for k, v in r.get("extra", {}).items()})  # a stage's own metrics (hrm)
        self.logger.log(rec)
        if "message" in r:  # a stage that scores otherwise (pair accuracy, pass rate) words its own line
            self.logger.message(f"step {self.step}: {r['message']}")
        else:
            self.logger.message(f"step {self.step}: val loss {r['val_loss']:.4f}, perplexity "
                                f"{r['perplexity']:.2f}, {r['bits_per_byte']:.3f} bits/byte "
                                f"({r.get('eval_tokens', 0):,} validation tokens)")

    def _sample(self) -> None:
        self._read_back()
        if self.sample_fn is None or not (self.master or self.sharded):
            return
        # FSDP: every rank samples the same (same seed), rank 0 writes
        text = self.sample_fn(self.model, self.step)
        self.model.train()
        if not self.master:
            return
        with open(self.run_dir / rundir.SAMPLES, "a") as f:
            f.write(json.dumps({"step": self.step, "text": text}) + "\n")
        self.logger.message(f"sample at step {self.step}:\n{text[:400]}")

    # -- the loop ------------------------------------------------------------------------------------------
    def run(self) -> dict:
        """Train to total_steps (or a stop request), as a list of calls to the run's components, each of which
        decides for itself whether this step is its step: evaluation, sampling, checkpointing, the step count
        a --time-budget fits, the log line."""
        self._open()  # config.toml, the logger, what is about to happen
        # Ctrl-C / SIGTERM: stop after this step, with a checkpoint
        stop = StopRequests(self.master).install()
        start = self.step
        pace = Pace(start, self.total_steps, self.device, self.cfg.eval_every if self.evaluate_fn else -1)
        self.model.train()
        t_run = time.perf_counter()  # the budget counts from here: the first evaluation is part of the run
        self.clock = (time.perf_counter(), self.tokens)  # the log line's throughput counts from here
        try:
            while True:
                stopping = stop.agreed(self)  # every rank stops at the same step, or the others hang
                last = self.step >= self.total_steps
                t_aside = time.perf_counter()  # evaluation, samples and saves are not training throughput
                self._evaluate_if_due(start, last, stopping, pace, t_run)
                self._sample_if_due(start)
                self._save_if_due(start, last, stopping)
                if last or stopping:
                    break
                self._set_aside(time.perf_counter() - t_aside, pace)
                self._optimisation_step()
                self.step += 1
                self.tokens += self.tokens_per_step
                self._fit_budget_if_due(pace, t_run)
                self._note_pace(pace)
                self._log_if_due(pace)
            self._read_back()
            if self.ddp:  # normal end only (after an error a barrier would hang): rank 0 may still be saving
                torch.distributed.barrier()
        except Exception as e:
            self._fail(e, stop)
        finally:
            stop.restore()
            self.logger.close()
        if stop.signal:
            self.say(f"{stop.signal}: saved a checkpoint at step {self.step}; {resume_hint()}")
        return {"step": self.step, "tokens": self.tokens,
                "val_loss": None if self.last_said else self.last_val,
                "val_step": self.last_val_step, "evaluation": self.last_said, "interrupted": stop.signal,
                "skipped_steps": self.skipped, "run_dir": str(self.run_dir)}

    # -- the components' calls, each with its own cadence ----------------------------------------------------
    def _open(self) -> None:
        """The run directory's config.toml and logger, and what the run is about to do (with a warning where
        the warm-up outlasts the run)."""
        t, total = self.cfg, self.total_steps
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.master:
            (self.run_dir / rundir.CONFIG).write_text(dumps_toml({k: v for k, v in self.run_config.items()
                                                                  if k in SECTIONS}))
        self.logger = RunLogger(self.run_dir, total, self.step, t.tensorboard, t.wandb, t.wandb_project,
                                self.run_config, t.progress, enabled=self.master)
        left = max(total - self.step, 0)
        where = f"steps {self.step + 1}-{total} ({left} left)" if self.step else f"{total} steps"
        if self.step and not left:
            self.say(f"the run is already at step {self.step} of {total}: nothing to train (--max-iters N "
                     f"trains on to N); run directory {self.run_dir}")
        else:
            self.say(f"training {where} of {self.tokens_per_step:,} tokens "
                     f"(batch {t.batch_size} x accumulation {t.grad_accum_steps} x {self.world} rank(s)); "
                     f"run directory {self.run_dir}")
        if left and self.master:
            note = Pace.estimate(left, self.tokens_per_step * left, self.flops_per_token, self.device,
                                 self.precision, self.world, t.eval_every, t.eval_tokens)
            if note:
                self.say(note)
        if t.warmup_steps > total and left and t.learning_rate > 0:
            self.say(f"warning: --warmup-steps {t.warmup_steps} is longer than the run's {total} steps, so "
                     f"the learning rate climbs to only {total / t.warmup_steps:.0%} of --learning-rate "
                     f"{t.learning_rate:g} and never reaches it; set --warmup-steps below the step count "
                     f"(about a tenth of it: {max(1, total // 10)})")

    def _evaluate_if_due(self, start: int, last: bool, stopping: bool, pace: "Pace", t_run: float) -> None:
        """Every eval_every steps and at the last; not again at the step a resume starts from (the run that
        saved it evaluated there). Under --time-budget the step count is fitted again after each one."""
        t = self.cfg
        fresh = self.step != start or start == 0
        if not (fresh and ((t.eval_every and self.step % t.eval_every == 0) or last)):
            return
        t_eval = time.perf_counter()
        self._evaluate()
        pace.note_eval(time.perf_counter() - t_eval)
        if t.time_budget and self.budget_set and not last and not stopping:
            self._refit_budget(pace, t_run)

    def _sample_if_due(self, start: int) -> None:
        """Every sample_every steps after the first (not again at a resume's first step)."""
        every = self.cfg.sample_every
        fresh = self.step != start or start == 0
        if fresh and every and self.step % every == 0 and self.step > 0:
            self._sample()

    def _save_if_due(self, start: int, last: bool, stopping: bool) -> None:
        """A checkpoint at the last step, on a stop, every save_every steps, and whenever an evaluation at
        this very step beat the best so far (the best weights are kept when they are evaluated, not only at
        the next periodic save); nothing where nothing was trained since the checkpoint the run resumed
        from."""
        better = (self.last_val is not None and self.last_val_step == self.step and self.step > start
                  and self.last_val < self.best_val)
        trained = self.step > start or start == 0
        periodic = self.cfg.save_every and self.step % self.cfg.save_every == 0 and self.step > start
        if trained and (last or stopping or better or periodic):
            self._save(final=last, now=last or stopping)

    def _set_aside(self, seconds: float, pace: "Pace") -> None:
        """Time spent on evaluation, samples and saves counts neither in throughput nor in the pace."""
        t_last, tokens_last = self.clock
        self.clock = (t_last + seconds, tokens_last)
        pace.pause(seconds)

    def _fit_budget_if_due(self, pace: "Pace", t_run: float) -> None:
        """--time-budget: the step count, once the pace is measured (a resumed run too, from then on)."""
        if self.cfg.time_budget and not self.budget_set and self.defer:
            self._read_back()  # the steps timed are the device's, not their launches (the first few only)
        if self.cfg.time_budget and not self.budget_set and pace.measured(self.step):
            self._fit_budget(pace, t_run)

    def _note_pace(self, pace: "Pace") -> None:
        """The step timed; the pace line (how long the rest will take) once the first steps are measured."""
        first = pace.t_first is None
        if self.defer and not pace.said:  # the pace line times the device's steps, not their launches
            self._read_back()
        note = pace.step(self.step)
        if first and self.compiled:  # the first step traced and compiled the model: say what that cost
            self.logger.message(f"compile: the first step took {duration(pace.t_first - pace.t0)} "
                                "(torch.compile building the training graph; --no-compile skips it)")
        if note:
            self.logger.message(note)

    def _log_if_due(self, pace: "Pace") -> None:
        """A metrics record and the progress line every log_every steps, at the first and the last, and at
        least once a minute (the logger says when). Under --host-sync log the line of step k is written once
        step k+1 is queued, with the numbers of step k read then (and those of the steps before it)."""
        if self.defer and (self.line_wait is not None or len(self.readback) >= 256):
            self._read_back(upto=self.step - 1)  # first: the waiting line resets the logger's clock
        due = (self.step % self.cfg.log_every == 0 or self.step == 1 or self.step == self.total_steps
               or self.logger.line_due())
        if not due:
            return
        now = time.perf_counter()
        t_last, tokens_last = self.clock
        self.clock = (now, self.tokens)
        # what the line says, as it is at this step (the loss_fn's own terms stay tensors until written)
        at = {"step": self.step, "tokens": self.tokens, "lr": self.opt.param_groups[0]["lr"],
              "tokens_per_s": (self.tokens - tokens_last) / max(now - t_last, 1e-9),
              "eta": pace.eta(self.step), "parts": (self.parts, self.parts_steps), "when": self.logger.now()}
        self.parts, self.parts_steps = {}, 0
        if self.defer and self.last_read != self.step:
            self.line_wait = at  # written when this step's numbers are read
        else:
            self._log_line(at, *self.last_numbers)

    def _read_back(self, upto: int | None = None) -> None:
        """--host-sync log: the numbers of the steps up to `upto` (all by default) read in one transfer: the
        skipped steps counted (and the run stopped after max_bad_steps in a row), the waiting log line
        written."""
        if not self.defer or not len(self.readback):
            return
        for step, loss, norm, applied in self.readback.read(upto):
            self._account(step, loss, norm, applied)
            self.last_numbers, self.last_read = (loss, norm), step
            if self.line_wait is not None and self.line_wait["step"] == step:
                at, self.line_wait = self.line_wait, None
                self._log_line(at, loss, norm)

    def _log_line(self, at: dict, loss: float, norm: float) -> None:
        rec = {"step": at["step"], "loss": loss, "lr": at["lr"], "grad_norm": norm, "tokens": at["tokens"],
               "tokens_per_s": at["tokens_per_s"]}
        tps = rec["tokens_per_s"]
        if self.peak:
            rec["mfu"] = tps * self.flops_per_token / (self.peak * self.world)
        if self.device.type == "cuda":
            rec["memory_gib"] = memory_gib(self.device)
        # a loss_fn's own terms (e.g. the hierarchical model's plan/code/refine), mean since last line
        parts, n = at["parts"]
        rec.update({f"train_{k}": float(v) / n for k, v in parts.items()})
        self.logger.log(rec)
        post = {"loss": f"{loss:.4f}", "lr": f"{rec['lr']:.2e}", "tok/s": f"{tps:,.0f}"}
        if "mfu" in rec:
            post["mfu"] = f"{rec['mfu']:.1%}"
        if "memory_gib" in rec:
            post["mem"] = f"{rec['memory_gib']:.1f}G"
        self.logger.progress(at["step"], post, at["eta"], when=at["when"])

    def _fail(self, e: Exception, stop: "StopRequests") -> None:
        """An error in the loop: raised as it is, unless another rank was lost (then the message says what
        happened and where the last checkpoint is)."""
        lost = self.ddp and lost_peer(e)
        if not lost and self.pending is not None and self.pending.future is not None:
            # let the background writer end before the process does; its unpublished directory is
            # removed by a later save (publishing it would need the other ranks)
            with contextlib.suppress(Exception):
                self.pending.future.result()
        if not lost:
            raise e
        # torchrun sends SIGTERM to the surviving ranks as soon as it sees one die: its default action
        # would end this rank before it says why, so signals stay recorded-only until the process ends
        stop.keep()
        latest = ckpt_io.latest_step(self.run_dir)
        raise TrainingError(
            f"rank {self.rank}: lost contact with the other ranks at step {self.step} ({type(e).__name__}: "
            f"{str(e).strip().splitlines()[0][:300] if str(e).strip() else 'no detail'}). A rank was killed, "
            f"crashed, ran out of memory or was stuck past --dist-timeout {self.cfg.dist_timeout}s; "
            f"torchrun's summary (or, with --local-ranks, the line above) names it. The job stops here; "
            + (f"the last complete checkpoint is {latest}: continue with --resume" if latest else
               "no checkpoint was written yet") + ".") from e

    def _optimisation_step(self) -> None:
        """One optimizer step at this step's learning rate; its numbers accounted for now, or (--host-sync
        log) kept on the device for _read_back."""
        t = self.cfg
        lr = lr_at(self.step, base_lr=t.learning_rate, warmup=t.warmup_steps, total=self.total_steps,
                   schedule=t.schedule, min_ratio=t.min_lr_ratio, decay_fraction=t.decay_fraction)
        set_lr(self.opt, lr)
        loss, norm, applied = train_step(self.fwd, self.model, self.opt, self.scaler, self.batches,
                                         self.loss_fn, t.grad_accum_steps, t.grad_clip, self.device,
                                         self.precision, self.mode, parts=self.parts, params=self.params,
                                         sync=list(self.aux.parameters()) if self.aux is not None
                                         and self.ddp else None, defer=self.defer)
        self.parts_steps += 1
        if self.defer:
            self.readback.add(self.step + 1, loss, norm, applied)
        else:
            self.last_numbers, self.last_read = (loss, norm), self.step + 1
            self._account(self.step + 1, loss, norm, applied)

    def _account(self, step: int, loss_v: float, norm_v: float, applied: bool) -> None:
        """Count a skipped (non-finite) step, and stop the run after max_bad_steps of them in a row."""
        t = self.cfg
        if applied:
            self.bad_in_row = 0
        else:
            self.skipped += 1
            self.bad_in_row += 1
            self.logger.message(f"step {step}: non-finite loss {loss_v} / grad norm {norm_v}; "
                                "update skipped")
            if self.bad_in_row >= t.max_bad_steps:
                raise TrainingError(
                    f"{self.bad_in_row} non-finite losses in a row at step {step}; stopping without "
                    "writing NaN weights. Lower --learning-rate, check the data, or use --precision "
                    f"bf16/fp32; the last good checkpoint is in {self.run_dir / 'checkpoints'}")


class Pace:
    """Measures seconds per step on this machine (training only: evaluation and saves are paused out) and
    says, once the first steps are timed, how long the run will take, with a warning and what to change
    when that is far beyond what this device does in reasonable time."""

    # the pace is trusted once 5 steps or 5 seconds are timed, whichever comes first: a few steps average out
    # one slow one, and a model whose steps take minutes gets its pace line after one timed step
    MEASURE_STEPS, MEASURE_SECONDS = 5, 5.0
    WARN_SECONDS = {"cpu": 2 * 3600}   # beyond this, a run on this device gets the warning
    WARN_ANY = 48 * 3600

    def __init__(self, start_step: int, total: int, device: torch.device, eval_every: int = -1):
        """eval_every: the run's (0: only at the end; -1: no evaluation); the time of the last evaluation
        counts once for every evaluation still to come."""
        self.start, self.total, self.device, self.eval_every = start_step, total, device, eval_every
        self.eval_s = 0.0
        self.t0 = time.perf_counter()
        self.t_first = None   # after the first step (compilation and warm-up excluded from the pace)
        self.first_step = None
        self.t_mark = self.mark_step = None  # mark(): where the recent pace is measured from
        self.said = False

    CPU_BOUND = 2e11  # FLOP/s per CPU thread no CPU exceeds in training (AVX-512 bf16 peaks near 1e11)
    TRAIN_SHARE = 0.5  # of the matmul rate a training step reaches at best (attention, norms, optimizer)

    @classmethod
    def estimate(cls, steps: int, tokens: int, flops_per_token: float, device: torch.device, precision: str,
                 world: int = 1, eval_every: int = 0, eval_tokens: int = 0) -> str | None:
        """Before anything slow (the first evaluation can take minutes where a run is too big for the device):
        on a CPU, the least time `steps` of `tokens` can take, from the model's FLOPs and a measured matrix
        product rate, with the warning when that is far beyond what the CPU does in reasonable time. None
        where a CPU could do it within ten minutes even at a bound no CPU reaches (not worth measuring)."""
        if device.type != "cpu" or not flops_per_token:
            return None
        evals = (steps // eval_every if eval_every else 0) + 1
        # an evaluation: forward only
        flops = flops_per_token * tokens + flops_per_token / 3 * eval_tokens * evals
        if flops / (cls.CPU_BOUND * torch.get_num_threads() * world) < 600:
            return None
        rate = matmul_flops(device, precision) * world
        need = flops / (rate * cls.TRAIN_SHARE)
        msg = (f"estimate: {steps:,} steps of {tokens // steps:,} tokens at {flops_per_token / 1e6:,.0f} "
               f"MFLOPs a token (and {evals} evaluation(s)) are {flops:.2g} FLOPs; this CPU multiplies at "
               f"~{rate / 1e9:,.0f} GFLOP/s, so at least ~{duration(need)} (the measured pace follows after "
               "the first steps)")
        if need > cls.WARN_SECONDS.get("cpu", cls.WARN_ANY):
            msg += ("\nwarning: that is far beyond what a CPU does in reasonable time. To finish sooner: a "
                    "smaller model (a CPU preset: `codeforge presets`; --preset cpu-small lowend-cpu is the "
                    "quickstart's), a shorter context (--block-size), fewer steps (--max-iters), or a GPU. "
                    "Ctrl-C saves a checkpoint; --resume continues it.")
        return msg

    def pause(self, seconds: float) -> None:
        self.t0 += seconds
        if self.t_first is not None:
            self.t_first += seconds
        if self.t_mark is not None:
            self.t_mark += seconds

    def mark(self, step: int) -> None:
        self.t_mark, self.mark_step = time.perf_counter(), step

    def recent(self, step: int) -> float | None:
        """Seconds per step since mark() (the whole run's pace before any mark, or with no step since)."""
        if self.t_mark is None or step <= self.mark_step:
            return self.seconds_per_step(step)
        return (time.perf_counter() - self.t_mark) / (step - self.mark_step)

    def measured(self, step: int) -> bool:
        """Whether enough steps were timed to trust the pace (as for the pace line)."""
        if self.first_step is None:
            return False
        return (step - self.first_step >= self.MEASURE_STEPS
                or time.perf_counter() - self.t_first >= self.MEASURE_SECONDS) and step > self.first_step

    def seconds_per_step(self, step: int) -> float | None:
        if self.t_first is None or step <= self.first_step:
            return None
        return (time.perf_counter() - self.t_first) / (step - self.first_step)

    def note_eval(self, seconds: float) -> None:
        self.eval_s = seconds

    def evals_left(self, step: int) -> int:
        if self.eval_every < 0 or step >= self.total:
            return 0
        if self.eval_every == 0:
            return 1
        e = self.eval_every
        return self.total // e - step // e + (1 if self.total % e else 0)

    def eta(self, step: int) -> float | None:
        sps = self.seconds_per_step(step)
        return None if sps is None else sps * (self.total - step) + self.eval_s * self.evals_left(step)

    def step(self, step: int) -> str | None:
        if self.t_first is None:
            self.t_first, self.first_step = time.perf_counter(), step
            return None
        if self.said or step >= self.total:
            return None
        measured = step - self.first_step
        if measured < self.MEASURE_STEPS and time.perf_counter() - self.t_first < self.MEASURE_SECONDS:
            return None
        self.said = True
        sps = self.seconds_per_step(step)
        need = self.eta(step)
        rate = f"{1 / sps:.2f} steps/s" if sps < 1 else f"{sps:.1f} s/step"
        evals = self.evals_left(step)
        with_evals = (
            f" with {evals} evaluation(s) of ~{duration(self.eval_s)}" if evals and self.eval_s else ""
        )
        msg = (f"pace: {rate} measured over {measured} steps on {self.device.type}; the remaining "
               f"{self.total - step} steps{with_evals} need ~{duration(need)}")
        limit = self.WARN_SECONDS.get(self.device.type, self.WARN_ANY)
        if need > limit:
            msg += (f"\nwarning: that is far beyond what {self.device.type} does in reasonable time. To "
                    "finish sooner: a smaller model (fewer --n-layer, a narrower --n-embd), a shorter "
                    "context (--block-size), fewer steps (--max-iters), or a GPU. Ctrl-C saves a checkpoint; "
                    "--resume continues it.")
        return msg
