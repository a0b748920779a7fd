"""Training throughput of codeforge's real training step (trainer.train_step: autocast, accumulation,
clipping, the preset's optimizer (AdamW, or Muon with lowend-cpu), non-finite check) for a preset on the
current device, on random tokens.

Prints a table (or one JSON object with --json): tokens/s and ms/step (the median of the timed steps, each
synchronised), the first step's seconds (compilation with --compile), peak memory, MFU (GPU devices in the
peak table only). --fit GIB searches the largest micro-batch whose peak memory fits the budget.

    python benchmarks/train_throughput.py --preset fragment-lowend --batch-size 4 --vocab-size 10000
    python benchmarks/train_throughput.py --preset gpt2-small --batch-size 16 --precision bf16 --compile

The GPU speed levers, each off by default (the figures above stay comparable with earlier ones):
  --attention CHOICE         set_attention's SDPA kernels (auto, cudnn, flash, efficient, math); not given:
                             PyTorch's own choice, set_attention not called
  --compile-shapes static    with --compile: parallel.compiled's one static whole graph (default dynamic:
                             plain torch.compile)
  --host-sync log            train_step(defer=True): the step's numbers stay on the device (a non-finite step
                             skipped there) and are read in one Readback at the end (needs the fused AdamW,
                             not fp16)
  --host-batches             batches built on the host as the data loader builds them (a (B, T+1) int64 array
                             cut from a fixed random token array, pinned and copied without blocking on CUDA)
                             instead of the pre-made device batches
  --prefetch                 that host source behind step.Prefetcher (its background thread); implies
                             --host-batches
  --timing window            warm-up, one sync, the timed steps with no sync between them, one sync: tokens
                             over the wall time (default median: each step synchronised, the median)
  --loss-check N             no timing: N steps from the seed on the same batches, every step's loss (the
                             quality guard: the same with the levers as without)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np
import torch

from codeforge.config import resolve
from codeforge.data.loader import on_device
from codeforge.device import autocast, choose_device, choose_precision, peak_flops
from codeforge.models import build_model
from codeforge.models.gpt import set_attention
from codeforge.train import parallel
from codeforge.train.optim import build_optimizer
from codeforge.train.losses import lm_loss_fn
from codeforge.train.step import Prefetcher, Readback, skips_on_device, train_step


class LeverError(ValueError):
    """A lever this run cannot pull (the message says which and what to use)."""


class HostBatches:
    """(x, y) batches built on the host the way data/loader.py's BatchLoader builds them: B windows of T+1
    tokens cut from a token array (here a fixed random one, uint16 as the shards are) at pseudo-random
    offsets, stacked as int64, `torch.from_numpy`, on CUDA pinned and copied without blocking. The offsets of
    batch i come from a generator seeded with (seed, i), so the cursor `pos` is the whole state.

    The array is random with something to learn: runs of 64 tokens that follow a fixed random successor map,
    one token in ten replaced by a uniform one. The loss falls within a few dozen steps, so --loss-check sees
    a lever that changed the arithmetic or the batches (on uniform tokens every run sits at ln V)."""

    def __init__(self, vocab_size: int, batch_size: int, block_size: int, device: torch.device,
                 seed: int = 0):
        n = max(32 * batch_size * (block_size + 1), 1 << 16)
        rng = np.random.default_rng(seed)
        succ = rng.permutation(vocab_size)
        state = rng.integers(0, vocab_size, -(-n // 64))
        runs = np.empty((len(state), 64), dtype=np.uint16 if vocab_size <= 1 << 16 else np.int32)
        for j in range(64):
            runs[:, j], state = state, succ[state]
        self.tokens = runs.reshape(-1)[:n]
        noise = np.flatnonzero(rng.random(n) < 0.1)
        self.tokens[noise] = rng.integers(0, vocab_size, len(noise))
        self.B, self.T, self.device, self.seed, self.pos = batch_size, block_size, device, seed, 0

    def __iter__(self):
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = np.random.default_rng([self.seed, self.pos]).integers(0, len(self.tokens) - self.T, self.B)
        self.pos += 1
        buf = np.stack([self.tokens[s:s + self.T + 1] for s in starts]).astype(np.int64)  # (B, T+1)
        t = on_device(torch.from_numpy(buf), self.device)  # as the real loader moves it
        return t[:, :-1], t[:, 1:]

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.pos = state["pos"]


class Bench:
    """One measurement's model, optimizer and batches, built as `a` asks; `step()` runs one train_step."""

    def __init__(self, a, batch_size: int):
        sets = [f"model.{k}={v}" for k, v in (("block_size", a.block_size), ("vocab_size", a.vocab_size))
                if v]
        cfg = resolve(a.preset, None, sets + a.set)
        m = self.m = cfg.model
        if a.dropout is not None:
            m.embd_dropout = m.attn_dropout = m.resid_dropout = a.dropout
        device, _ = choose_device(a.device)
        precision, _ = choose_precision(device, a.precision)
        self.a, self.batch_size, self.device, self.precision = a, batch_size, device, precision
        torch.manual_seed(0)
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        model = self.model = build_model(m).to(device)
        model.grad_checkpointing = a.gradient_checkpointing
        model.loss_chunk_rows = a.loss_chunk_rows
        # not given: set_attention is not called (PyTorch's own choice, as before the lever existed)
        self.attention_note = set_attention(model, a.attention, device) if a.attention else None
        if not a.compile:
            self.fwd = model
        elif a.compile_shapes == "static":  # the trainer's --compile-shapes static: one whole static graph
            self.fwd = parallel.compiled(model, True, lambda s: print(s, file=sys.stderr), a.compile_backend)
        else:
            self.fwd = torch.compile(model, backend=a.compile_backend)
        t = cfg.train  # --set train.optimizer=muon etc.
        self.opt = build_optimizer(model, t.optimizer, t.learning_rate, t.weight_decay, (t.beta1, t.beta2),
                                   device, t.muon_lr, t.muon_momentum, t.muon_weight_decay)
        self.defer = a.host_sync == "log"
        if self.defer and not skips_on_device(self.opt, precision, "none"):
            raise LeverError(f"--host-sync log needs an optimizer that skips a non-finite step on the "
                             f"device (the fused AdamW, not under fp16); this run has "
                             f"{type(self.opt).__name__} with {precision}: use --host-sync step")
        self.readback = Readback()
        self.scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
        T = self.T = m.block_size
        self.host = a.host_batches or a.prefetch
        self.source = None
        if self.host:
            self.source = HostBatches(m.vocab_size, batch_size, T, device)
            self.next_batch = Prefetcher(self.source, device, depth=1) if a.prefetch else self.source
        else:  # today's figures: four batches made once on the device, cycled
            gen = torch.Generator().manual_seed(0)
            batches = [torch.randint(0, m.vocab_size, (batch_size, T + 1), generator=gen) for _ in range(4)]
            batches = [(b[:, :-1].to(device), b[:, 1:].to(device)) for b in batches]
            i = {"n": 0}

            def cycle():
                while True:
                    i["n"] += 1
                    yield batches[i["n"] % len(batches)]
            self.next_batch = cycle()
        self.n = 0

    def step(self):
        """One train_step: (loss, norm, applied) as floats (--host-sync step) or device tensors, which are
        also kept in the Readback (--host-sync log)."""
        self.n += 1
        out = train_step(self.fwd, self.model, self.opt, self.scaler, self.next_batch, lm_loss_fn,
                         self.a.grad_accum_steps, 1.0, self.device, self.precision, defer=self.defer)
        if self.defer:
            self.readback.add(self.n, *out)
        return out

    def drain(self) -> list[tuple[int, float, float, bool]]:
        """The kept steps' numbers, read in one sync (none with --host-sync step)."""
        return self.readback.read()

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def close(self) -> None:
        if isinstance(self.next_batch, Prefetcher):
            self.next_batch.close()

    def settings(self) -> dict:
        a = self.a
        return {"attention": a.attention, "attention_note": self.attention_note,
                "compile_shapes": a.compile_shapes, "whole_graph": getattr(self.fwd, "whole", None),
                "host_sync": a.host_sync, "prefetch": a.prefetch, "host_batches": bool(self.host),
                "timing": a.timing}


def measure(a, batch_size: int) -> dict:
    b = Bench(a, batch_size)
    try:
        return _loss_check(b, a.loss_check) if a.loss_check else _timed(b)
    finally:
        b.close()


def _describe(b: Bench) -> dict:
    a, device = b.a, b.device
    return {"preset": "+".join(a.preset),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else
            f"cpu ({torch.get_num_threads()} threads)", "precision": b.precision, "compile": a.compile,
            "batch_size": b.batch_size, "block_size": b.T, "vocab_size": b.m.vocab_size,
            "params": b.model.num_params()}


def _loss_check(b: Bench, n: int) -> dict:
    """n steps from the seed, no timing: every step's loss (read once at the end with --host-sync log)."""
    t0 = time.perf_counter()
    rows = [b.step() for _ in range(n)]
    got = b.drain() if b.defer else [(i + 1, *r) for i, r in enumerate(rows)]
    b.sync()
    losses = [r[1] for r in got]
    return {**_describe(b), **b.settings(), "loss_check": n, "losses": losses, "loss": losses[-1],
            "heldout_loss": _heldout(b),
            "steps_skipped": sum(not r[3] for r in got), "seconds": time.perf_counter() - t0,
            "tokens_per_s": None, "torch": torch.__version__}


def _heldout(b: Bench, batches: int = 4) -> float | None:
    """The trained model's mean loss on `batches` batches of windows at offsets of their own (seeded far past
    any step's) from the same token array: the same distribution, though their text may overlap what training
    saw. The model runs uncompiled in eval mode. The loss at equal steps a lever that changes the numerics is
    compared by; None without host batches."""
    if b.source is None:
        return None
    held = HostBatches.__new__(HostBatches)
    held.__dict__.update(b.source.__dict__)
    held.pos = 1 << 30
    b.model.eval()
    total = 0.0
    with torch.no_grad(), autocast(b.device, b.precision):
        for _ in range(batches):
            total += float(lm_loss_fn(b.model, next(held))[0])
    b.model.train()
    return total / batches


def _timed(b: Bench) -> dict:
    a, device = b.a, b.device
    t0 = time.perf_counter()
    first_step_s = None
    for _ in range(max(1, a.warmup)):  # the first step compiles (with --compile): its seconds are reported
        b.step()
        b.sync()
        first_step_s = time.perf_counter() - t0 if first_step_s is None else first_step_s
    b.drain()  # --host-sync log: the warm-up's numbers (already on the host's side of the syncs above)
    loss, got = None, []
    if a.timing == "window":  # no sync between the timed steps: what a training loop's device queue sees
        b.sync()
        t0 = time.perf_counter()
        for _ in range(a.steps):
            got.append(b.step())
        if b.defer:
            got = [r[1:] for r in b.drain()]  # the one read of the window
        b.sync()
        wall = time.perf_counter() - t0
        times = [wall / max(1, a.steps)] * max(1, a.steps)
    else:
        times = []
        for _ in range(a.steps):  # each step timed on its own (synchronised): the median is the figure
            t0 = time.perf_counter()
            got.append(b.step())
            b.sync()
            times.append(time.perf_counter() - t0)
        if b.defer:
            got = [r[1:] for r in b.drain()]
    if got:
        loss = got[-1][0]
    dt = statistics.median(times)
    tokens = b.batch_size * b.T * a.grad_accum_steps
    tps = tokens / dt
    peak = peak_flops(device)
    return {**_describe(b),
            "tokens_per_s": tps, "ms_per_step": dt * 1e3, "ms_per_step_mean": statistics.mean(times) * 1e3,
            "first_step_s": first_step_s, "steps_timed": a.steps,
            "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda"
            else None, "mfu": tps * b.model.flops_per_token(b.T) / peak if peak else None, "loss": loss,
            "steps_skipped": sum(not bool(r[2]) for r in got), **b.settings(), "torch": torch.__version__}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", nargs="+", default=["fragment-lowend"])
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--vocab-size", type=int, default=None)
    ap.add_argument("--grad-accum-steps", type=int, default=1)
    ap.add_argument("--precision", default="auto")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--gradient-checkpointing", action="store_true")
    ap.add_argument("--loss-chunk-rows", type=int, default=0,
                    help="> 0: fused chunked lm_head + cross-entropy")
    ap.add_argument("--dropout", type=float, default=None)
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--fit", type=float, default=None, metavar="GIB",
                    help="largest micro-batch within this budget")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--compile-backend", default="inductor",
                    help="torch.compile's backend (eager: trace only)")
    ap.add_argument("--attention", default=None, choices=["auto", "cudnn", "flash", "efficient", "math"],
                    help="SDPA kernels (set_attention); not given: PyTorch's choice (set_attention not "
                    "called)")
    ap.add_argument("--compile-shapes", default="dynamic", choices=["static", "dynamic"],
                    help="with --compile: static = one whole static graph (parallel.compiled); "
                    "dynamic = plain torch.compile")
    ap.add_argument("--host-sync", default="step", choices=["step", "log"],
                    help="log: the step's numbers stay on the device, read once at the end")
    ap.add_argument("--host-batches", action="store_true",
                    help="batches built on the host as the data loader builds them (not pre-made on the "
                    "device)")
    ap.add_argument("--prefetch", action="store_true",
                    help="the host batches built by step.Prefetcher's background thread (implies "
                    "--host-batches)")
    ap.add_argument("--timing", default="median", choices=["median", "window"],
                    help="median: each step synchronised; window: one sync around all timed steps")
    ap.add_argument("--loss-check", type=int, default=0, metavar="N",
                    help="no timing: N steps from the seed on the same batches, every step's loss")
    return ap


def main() -> None:
    a = parser().parse_args()
    try:
        run(a)
    except LeverError as e:
        raise SystemExit(f"train_throughput: {e}") from None


def run(a) -> None:
    if a.fit is not None:
        best, b = None, 1
        while True:
            try:
                r = measure(a, b)
            except torch.OutOfMemoryError:
                break
            if r["peak_memory_gib"] is None:
                raise SystemExit("--fit needs a CUDA device (peak memory is measured there)")
            if r["peak_memory_gib"] > a.fit:
                break
            best, b = r, b * 2
        if best is None:
            raise SystemExit(f"batch 1 does not fit in {a.fit} GiB")
        lo, hi = best["batch_size"], b  # refine between the last fit and the first miss
        while hi - lo > 1:
            mid = (lo + hi) // 2
            try:
                r = measure(a, mid)
                ok = r["peak_memory_gib"] <= a.fit
            except torch.OutOfMemoryError:
                ok = False
            if ok:
                best, lo = r, mid
            else:
                hi = mid
        print(json.dumps(best) if a.json else f"largest micro-batch within {a.fit} GiB: {best['batch_size']} "
              f"(peak {best['peak_memory_gib']:.2f} GiB, {best['tokens_per_s']:,.0f} tokens/s)")
        return
    r = measure(a, a.batch_size)
    if a.json:
        print(json.dumps(r))
        return
    print(f"{r['preset']} on {r['device']}, {r['precision']}, compile={r['compile']}, batch "
          f"{r['batch_size']} x "
          f"{r['block_size']}, vocab {r['vocab_size']}, {r['params']:,} params, torch {r['torch']}")
    print(f"levers: attention {r['attention'] or 'not set'}, compile shapes {r['compile_shapes']}, host "
          f"sync {r['host_sync']}, prefetch {r['prefetch']}, host batches {r['host_batches']}, timing "
          f"{r['timing']}")
    if a.loss_check:
        print(f"loss over {a.loss_check} steps: " + " ".join(f"{x:.4f}" for x in r["losses"]))
        return
    print(f"{'tokens/s':>12s} {'ms/step':>9s} {'peak GiB':>9s} {'MFU':>6s}")
    mem = f"{r['peak_memory_gib']:.2f}" if r["peak_memory_gib"] is not None else "-"
    mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
    print(f"{r['tokens_per_s']:12,.0f} {r['ms_per_step']:9.1f} {mem:>9s} {mfu:>6s}")


if __name__ == "__main__":
    main()
