"""Training throughput of codeforge's real training step (trainer.train_step: autocast, accumulation,
clipping, the preset's optimizer (AdamW, or Muon with lowend-cpu), non-finite check) for a preset on the
current device, on random tokens.

Prints a table (or one JSON object with --json): tokens/s and ms/step (the median of the timed steps, each
synchronised), the first step's seconds (compilation with --compile), peak memory, MFU (GPU devices in the
peak table only). --fit GIB searches the largest micro-batch whose peak memory fits the budget.

    python benchmarks/train_throughput.py --preset fragment-lowend --batch-size 4 --vocab-size 10000
    python benchmarks/train_throughput.py --preset gpt2-small --batch-size 16 --precision bf16 --compile
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from codeforge.config import resolve
from codeforge.device import choose_device, choose_precision, peak_flops
from codeforge.models import build_model
from codeforge.train.optim import build_optimizer
from codeforge.train.losses import lm_loss_fn
from codeforge.train.step import train_step


def measure(a, batch_size: int) -> dict:
    sets = [f"model.{k}={v}" for k, v in (("block_size", a.block_size), ("vocab_size", a.vocab_size)) if v]
    cfg = resolve(a.preset, None, sets + a.set)
    m = cfg.model
    if a.dropout is not None:
        m.embd_dropout = m.attn_dropout = m.resid_dropout = a.dropout
    device, _ = choose_device(a.device)
    precision, _ = choose_precision(device, a.precision)
    torch.manual_seed(0)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    model = build_model(m).to(device)
    model.grad_checkpointing = a.gradient_checkpointing
    model.loss_chunk_rows = a.loss_chunk_rows
    fwd = torch.compile(model, backend=a.compile_backend) if a.compile else model
    t = cfg.train  # --set train.optimizer=muon etc.
    opt = build_optimizer(model, t.optimizer, t.learning_rate, t.weight_decay, (t.beta1, t.beta2), device,
                          t.muon_lr, t.muon_momentum, t.muon_weight_decay)
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    T = m.block_size
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, m.vocab_size, (batch_size, T + 1), generator=gen) for _ in range(4)]
    batches = [(b[:, :-1].to(device), b[:, 1:].to(device)) for b in batches]
    i = {"n": 0}

    def cycle():
        while True:
            i["n"] += 1
            yield batches[i["n"] % len(batches)]
    next_batch = cycle()

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    t0 = time.perf_counter()
    first_step_s = None
    for _ in range(max(1, a.warmup)):  # the first step compiles (with --compile): its seconds are reported
        train_step(fwd, model, opt, scaler, next_batch, lm_loss_fn, a.grad_accum_steps, 1.0, device,
                   precision)
        sync()
        first_step_s = time.perf_counter() - t0 if first_step_s is None else first_step_s
    times = []
    for _ in range(a.steps):  # each step timed on its own (synchronised): the median is the figure
        t0 = time.perf_counter()
        loss, _, _ = train_step(fwd, model, opt, scaler, next_batch, lm_loss_fn, a.grad_accum_steps, 1.0,
                                device, precision)
        sync()
        times.append(time.perf_counter() - t0)
    dt = statistics.median(times)
    tokens = batch_size * T * a.grad_accum_steps
    tps = tokens / dt
    peak = peak_flops(device)
    return {"preset": "+".join(a.preset),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else
            f"cpu ({torch.get_num_threads()} threads)", "precision": precision, "compile": a.compile,
            "batch_size": batch_size, "block_size": T, "vocab_size": m.vocab_size,
            "params": model.num_params(),
            "tokens_per_s": tps, "ms_per_step": dt * 1e3, "ms_per_step_mean": statistics.mean(times) * 1e3,
            "first_step_s": first_step_s, "steps_timed": a.steps,
            "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda"
            else None, "mfu": tps * model.flops_per_token(T) / peak if peak else None, "loss": loss,
            "torch": torch.__version__}


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
    return ap


def main() -> None:
    a = parser().parse_args()
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
    print(f"{'tokens/s':>12s} {'ms/step':>9s} {'peak GiB':>9s} {'MFU':>6s}")
    mem = f"{r['peak_memory_gib']:.2f}" if r["peak_memory_gib"] is not None else "-"
    mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
    print(f"{r['tokens_per_s']:12,.0f} {r['ms_per_step']:9.1f} {mem:>9s} {mfu:>6s}")


if __name__ == "__main__":
    main()
