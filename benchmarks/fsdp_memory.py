"""Per-rank memory of DDP against FSDP on CPU ranks (gloo), measured, beside `codeforge plan`'s estimate.

    python benchmarks/fsdp_memory.py                       # medium and large: 1 process,
                                                           DDP and FSDP on 2 and 4
    python benchmarks/fsdp_memory.py --presets medium --worlds 2 --steps 3

Each configuration is one torchrun job of this file. The model is built as `codeforge train` builds it:
under DDP every rank builds the whole model (in turn, so that their build peaks do not add up); under FSDP
rank 0 builds it and the others on the meta device (parallel.materialises). It is wrapped with codeforge's
own `parallel.wrap` (DDP, or FSDP2 per block and root; under FSDP it fills every rank's shards from rank 0)
and the optimizer is built; then its peak-RSS mark is reset (Linux: /proc/self/clear_refs) and it trains
`--steps` optimizer steps of random tokens through the trainer's own `train_step`. Measured per rank:
  - train peak: the highest resident memory during those steps, less the resident memory the process had
    before the model was built (Python, torch, the process group): what the training state, activations and
    communication buffers take. This is the number the planner estimates.
  - build peak: the same before the steps (under FSDP rank 0 holds the whole model until it is sharded and
    broadcast; the other ranks only their shards).
glibc's dynamic mmap threshold is fixed (MALLOC_MMAP_THRESHOLD_) so that freed large tensors return to the
system and resident memory follows the live tensors. A configuration whose estimate does not fit this
machine's memory (all ranks share it) is skipped and said so; `--force` runs it anyway.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

GIB = 2**30


def status_kib(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def host_memory() -> int:
    for line in open("/proc/meminfo"):
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def config(a):
    from codeforge.config import resolve
    return resolve([a.preset], None, [], {"model.block_size": a.block_size, "train.batch_size": a.batch_size,
                                         "train.grad_checkpointing": a.grad_checkpointing,
                                         "train.device": "cpu"})


def worker(a) -> None:
    import torch
    import torch.distributed as dist

    from codeforge.models import build_model
    from codeforge.train import parallel
    from codeforge.train.losses import lm_loss_fn
    from codeforge.train.optim import build_optimizer
    from codeforge.train.step import train_step
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        from datetime import timedelta
        dist.init_process_group("gloo", timeout=timedelta(seconds=900))
    cfg = config(a)
    m, t = cfg.model, cfg.train
    device = torch.device("cpu")
    libc = ctypes.CDLL("libc.so.6")
    gc.collect()
    libc.malloc_trim(0)
    base = status_kib("VmRSS") * 1024
    mode = a.mode if world > 1 else "none"
    for r in range(world):  # one rank at a time builds (wrapping is collective: all ranks together, below)
        if r == rank:
            torch.manual_seed(0)
            with contextlib.nullcontext() if parallel.materialises(mode, rank) else torch.device("meta"):
                model = build_model(m)
            model.grad_checkpointing = t.grad_checkpointing
        if world > 1:
            dist.barrier()
    fwd = parallel.wrap(model, device, mode)
    opt = build_optimizer(model, "adamw", 1e-4, 0.1, (0.9, 0.95), device)
    gc.collect()
    libc.malloc_trim(0)
    build_peak = status_kib("VmHWM") * 1024 - base
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak-RSS mark to the current RSS
    ready = status_kib("VmRSS") * 1024 - base
    g = torch.Generator().manual_seed(rank)

    def batches():
        while True:
            x = torch.randint(0, m.vocab_size, (t.batch_size, m.block_size + 1), generator=g)
            yield x[:, :-1], x[:, 1:]

    src = batches()
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    t0 = time.perf_counter()
    for _ in range(a.steps):
        loss, norm, _ = train_step(fwd, model, opt, scaler, src, lm_loss_fn, 1, 1.0, device, "fp32", mode)
    seconds = time.perf_counter() - t0
    peak = status_kib("VmHWM") * 1024 - base
    rec = {"rank": rank, "base": base, "build_peak": build_peak, "ready": ready, "train_peak": peak,
           "seconds_per_step": seconds / a.steps, "loss": loss}
    out = [None] * world
    if world > 1:
        dist.all_gather_object(out, rec)
        dist.destroy_process_group()
    else:
        out = [rec]
    if rank == 0:
        print("FSDPMEM " + json.dumps(out), flush=True)


def launch(a, preset: str, mode: str, world: int) -> list[dict] | str:
    from codeforge.train.memory import estimate
    cfg = config(argparse.Namespace(**{**vars(a), "preset": preset}))
    plan = estimate(cfg.model, cfg.train, world, "fp32")
    train_need = world * (plan.total(mode) + 0.3 * GIB)  # 0.3 GiB: Python, torch and gloo of one process
    # FSDP: rank 0's whole model plus every rank's shard (of it, and of the
    # broadcast); DDP: a whole model each
    build_need = (4 * plan.params * 2 if mode == "fsdp" else world * 4 * plan.params) + world * 0.3 * GIB
    need = max(train_need, build_need)
    if need > 0.95 * host_memory() and not a.force:
        return (f"skipped: about {need / GIB:.1f} GiB for {world} rank(s) on this host, "
                f"{host_memory() / GIB:.1f} available")
    args = [__file__, "--worker", "--preset", preset, "--mode", mode, "--steps", str(a.steps), "--block-size",
            str(a.block_size), "--batch-size", str(a.batch_size)] + (["--grad-checkpointing"]
                                                                     if a.grad_checkpointing
                                                                      else [])
    cmd = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world)]
           + args if world > 1 else [sys.executable] + args)
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072",
           "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // world))}
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=a.timeout)
    except subprocess.TimeoutExpired:
        return f"timed out after {a.timeout} s"
    for line in r.stdout.splitlines():
        if line.startswith("FSDPMEM "):
            return json.loads(line[8:])
    return f"failed (rc {r.returncode}): {(r.stderr or r.stdout)[-600:]}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", nargs="+", default=["medium", "large"])
    ap.add_argument("--modes", nargs="+", default=["ddp", "fsdp"], choices=["ddp", "fsdp"])
    ap.add_argument("--worlds", nargs="+", type=int, default=[1, 2, 4],
                    help="1: one process, which holds per rank what DDP holds (its row is labelled ddp)")
    ap.add_argument("--block-size", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--grad-checkpointing", action="store_true")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per configuration")
    ap.add_argument("--force", action="store_true", help="run configurations estimated not to fit")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--preset", help=argparse.SUPPRESS)
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker(a)
    from codeforge.train.memory import estimate
    print(f"per-rank memory on CPU ranks (gloo, fp32, AdamW), micro-batch {a.batch_size} x {a.block_size} "
          f"tokens, {a.steps} steps{', gradient checkpointing' if a.grad_checkpointing else ''}; GiB")
    print(f"{'preset':8s} {'mode':5s} {'ranks':>5s} {'planned':>8s} {'train peak (min-max over ranks)':>32s} "
          f"{'ratio':>6s} {'build peak':>12s} {'s/step':>7s}  (build peak: rank 0/the others' highest)")
    for preset in a.presets:
        for world in a.worlds:
            for mode in a.modes:
                if world == 1 and mode == "fsdp":
                    continue
                cfg = config(argparse.Namespace(**{**vars(a), "preset": preset}))
                planned = estimate(cfg.model, cfg.train, world, "fp32").total(mode)
                r = launch(a, preset, mode, world)
                if isinstance(r, str):
                    print(f"{preset:8s} {mode:5s} {world:5d} {planned / GIB:8.2f}  {r}", flush=True)
                    continue
                peaks = [x["train_peak"] / GIB for x in r]
                others = [x["build_peak"] / GIB for x in r if x["rank"] != 0]
                builds = f"{r[0]['build_peak'] / GIB:.2f}" + (f"/{max(others):.2f}" if others else "")
                sps = max(x["seconds_per_step"] for x in r)
                mean = sum(peaks) / len(peaks)
                print(f"{preset:8s} {mode:5s} {world:5d} {planned / GIB:8.2f} "
                      f"{f'{mean:.2f} ({min(peaks):.2f}-{max(peaks):.2f})':>32s} "
                      f"{mean / (planned / GIB):6.2f} {builds:>12s} {sps:7.1f}", flush=True)


if __name__ == "__main__":
    main()
