"""How long a fine-tuning run will take and how much memory it needs, said before it starts (`quickstart
--from-hf`): measured on a CPU, estimated for a GPU, and labelled which.

CPU (measured). benchmarks/lora_estimates.py times a few LoRA steps of random-initialised models of the real
Qwen2.5-Coder-0.5B and 1.5B configurations (codeforge's own model, built from those config.json files the way
`import --hf` builds it; LoRA as train.lora_rank attaches it), each in a one-thread process, and records
below (MEASURED_CPU), per run: the pace in FLOP/s of this module's count (train_flops_per_token), that
machine's one-thread matrix-product rate (device.matmul_flops) and its peak resident memory beside `codeforge
plan`'s estimate for the same run. Another run's time is its FLOPs per step over the nearest row's pace (the
same precision, the closest size), scaled by this CPU's matrix-product rate per core against the measuring
one's and by its cores; its memory is the plan's estimate times the row's measured peak over its plan (1.4-1.7
on the Qwen shapes: what the plan leaves out, PEFT's extra activations, the chunked loss's output-matrix
gradient, Python, torch and the allocator), once per process.

GPU (estimated, not measured: no GPU run of LoRA yet). Time: the FLOPs at an assumed share of the datasheet
peak (GPU_ASSUMED: 37.6%, what codeforge's compiled 124M and 142M models reached training every weight on an
H100, docs/LOG.md#2026-11-27-gpu-suite-h100; an eager LoRA step of a larger model may reach more or less).
Memory: the plan's estimate in bf16 times the nearest CPU row's peak over plan, plus the CUDA context.

FLOPs: a full-training step is 6 per weight (forward 2, backward 4: the input's gradient and the weight's)
plus attention (GPTModel.flops_per_token). LoRA computes no frozen weight's gradient, so its weights cost 4,
the adapters 6 each, attention the same.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from ..checkpoint.guard import available_memory
from ..device import choose_precision, matmul_flops, peak_flops, usable_cores
from ..models import build_model
from .memory import GIB, estimate as plan

# benchmarks/lora_estimates.py, on one machine: see its docstring for the command. flops_per_s is the
# measured pace in this module's FLOPs; matmul_flops the machine's rate at that precision with the row's
# threads (device.matmul_flops); peak_rss_gib what the process held at most, plan_gib `codeforge plan`'s
# estimate of the same run.
MEASURED_CPU: list[dict] = [
    {"shape": "Qwen2.5-Coder-0.5B", "params": 502075264, "lora_rank": 16, "batch": 2, "context": 1024,
     "precision": "bf16", "threads": 1, "seconds_per_step": 33.13, "flops_per_s": 1.414e11,
     "matmul_flops": 3.119e11, "peak_rss_gib": 8.96, "plan_gib": 5.17},
    {"shape": "Qwen2.5-Coder-1.5B", "params": 1560702464, "lora_rank": 16, "batch": 2, "context": 1024,
     "precision": "bf16", "threads": 1, "seconds_per_step": 65.3, "flops_per_s": 2.134e11,
     "matmul_flops": 3.34e11, "peak_rss_gib": 19.12, "plan_gib": 13.74},
    {"shape": "Qwen2.5-Coder-0.5B", "params": 502075264, "lora_rank": 16, "batch": 2, "context": 1024,
     "precision": "fp32", "threads": 1, "seconds_per_step": 60.87, "flops_per_s": 7.698e10,
     "matmul_flops": 1.076e11, "peak_rss_gib": 11.16, "plan_gib": 6.55},
    {"shape": "Qwen2.5-Coder-0.5B", "params": 502075264, "lora_rank": 16, "batch": 1, "context": 256,
     "precision": "bf16", "threads": 1, "seconds_per_step": 3.47, "flops_per_s": 1.541e11,
     "matmul_flops": 2.182e11, "peak_rss_gib": 4.49, "plan_gib": 3.17},
]
# the date and the machine the rows were measured on (another job shared its 2 cores: load average 3-5)
MEASURED_ON = "2026-11-29, one core of an AMD EPYC (Zen 5, AVX512-BF16; 2 cores, 24 GiB), torch 2.13"

GPU_ASSUMED = {"name": "H100 SXM", "peak_tflops": 989.0, "mfu": 0.376,
               "why": "what codeforge's compiled 124M/142M models reached training every weight on an H100, "
                      "docs/LOG.md#2026-11-27-gpu-suite-h100; assumed for LoRA"}
CUDA_CONTEXT = 1.0 * GIB  # the CUDA context and allocator slack beyond the plan (memory.py says ~0.5-1 GiB)


@dataclass
class Estimate:
    where: str                 # "this CPU", "one H100 SXM"
    seconds_per_step: float
    steps: int
    memory: float              # bytes, every local process together
    processes: int
    measured: bool             # from a measured pace (the CPU table) or an assumed one (GPU)
    basis: str                 # where the numbers come from, in one clause

    @property
    def seconds(self) -> float:
        return self.seconds_per_step * self.steps


def _targets(train_cfg) -> set[str]:
    return {x.strip() for x in str(getattr(train_cfg, "lora_targets", "")).split(",") if x.strip()}


def train_flops_per_token(model_cfg, train_cfg) -> float:
    """FLOPs per trained token of a step of `model_cfg` at its block_size: full training (every weight) or
    LoRA (train_cfg.lora_rank > 0): no frozen weight's gradient, so 4 per weight, 6 per adapter weight."""
    with torch.device("meta"):
        model = build_model(model_cfg)
    T = model_cfg.block_size
    full = float(model.flops_per_token(T))
    rank = int(getattr(train_cfg, "lora_rank", 0) or 0)
    if not rank:
        return full
    attention = 12.0 * model_cfg.n_layer * model_cfg.n_embd * T
    targets = _targets(train_cfg)
    adapters = sum(rank * (m.in_features + m.out_features) for b in model.blocks
                   for name, m in b.named_modules()
                   if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in targets)
    return (full - attention) * 4 / 6 + attention + 6 * adapters


def tokens_per_step(train_cfg, model_cfg, processes: int) -> int:
    """Tokens one optimizer step trains on, over every local process (batch_size is per process)."""
    return train_cfg.batch_size * model_cfg.block_size * max(1, train_cfg.grad_accum_steps) * processes


def _beyond_plan(row: dict) -> float:
    """The measured peak over the plan's estimate (never under 1: the plan is a floor)."""
    return max(1.0, row["peak_rss_gib"] / row["plan_gib"])


def _nearest(rows: list[dict], params: int, precision: str, tokens: int) -> dict | None:
    """The row of `precision` (any, where none is) closest in size and in tokens per step and process (both
    on a log scale: a step of few tokens spends more of its time casting the frozen weights)."""
    same = [r for r in rows if r["precision"] == precision] or rows
    return min(same, key=lambda r: abs(math.log(params / r["params"]))
               + abs(math.log(tokens / (r["batch"] * r["context"])))) if same else None


def core_rate(precision: str) -> float:
    """This CPU's matrix-product FLOP/s on one thread at `precision` (device.matmul_flops, ~0.3 s once)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return matmul_flops(torch.device("cpu"), precision)
    finally:
        torch.set_num_threads(before)


def cpu_estimate(model_cfg, train_cfg, precision: str, processes: int, steps: int,
                 per_core: float | None = None, cores: int = 1,
                 rows: list[dict] | None = None) -> Estimate | None:
    """The run on this CPU from the nearest measured row (None when the table is empty). per_core: this CPU's
    one-thread matrix-product rate at `precision` (core_rate), cores: how many it trains on (as threads or
    one-thread processes); None: one core as fast as the measuring one's. The rows are one-thread
    processes, so the pace scales by the rate per core and by the cores (an assumption: linear)."""
    rows = MEASURED_CPU if rows is None else rows
    p = plan(model_cfg, train_cfg, 1, precision)
    row = _nearest(rows, p.params, precision, train_cfg.batch_size * model_cfg.block_size)
    if row is None:
        return None
    scale = (per_core / row["matmul_flops"] if per_core else 1.0) * max(1, cores) / row.get("threads", 1)
    pace = row["flops_per_s"] * scale
    flops = train_flops_per_token(model_cfg, train_cfg) * tokens_per_step(train_cfg, model_cfg, processes)
    per_process = p.total("ddp") * _beyond_plan(row)
    basis = (f"measured: {row['shape']} shape, LoRA r{row['lora_rank']}, {row['batch']} x {row['context']} "
             f"tokens, {row['precision']}, one core: {row['seconds_per_step']:.0f} s a step, {MEASURED_ON}"
             + (f"; scaled to this CPU's {cores} core(s) at {per_core / 1e9:.0f} GFLOP/s each (measured "
                f"{row['matmul_flops'] / 1e9:.0f})" if per_core else ""))
    return Estimate("this CPU", flops / pace, steps, per_process * processes, processes, True, basis)


def gpu_estimate(model_cfg, train_cfg, steps: int, peak: float | None = None, name: str | None = None,
                 precision: str = "bf16", rows: list[dict] | None = None) -> Estimate:
    """The run on one GPU of `peak` FLOP/s (None: GPU_ASSUMED's H100) at GPU_ASSUMED's utilisation: an
    estimate, not a measurement."""
    peak = peak or GPU_ASSUMED["peak_tflops"] * 1e12
    name = name or GPU_ASSUMED["name"]
    flops = train_flops_per_token(model_cfg, train_cfg) * tokens_per_step(train_cfg, model_cfg, 1)
    p = plan(model_cfg, train_cfg, 1, precision)
    row = _nearest(MEASURED_CPU if rows is None else rows, p.params, "bf16",
                   train_cfg.batch_size * model_cfg.block_size)
    beyond = _beyond_plan(row) if row else 1.0
    mem = p.total("ddp") * beyond + CUDA_CONTEXT
    basis = (f"estimated, not measured: FLOPs at {GPU_ASSUMED['mfu']:.1%} of {peak / 1e12:.0f} TFLOP/s "
             f"({GPU_ASSUMED['why']}); memory `codeforge plan`'s"
             + (f" x {beyond:.2f} (the CPU's measured peak over plan)" if row else "")
             + " + the CUDA context")
    return Estimate(f"one {name}", flops / (peak * GPU_ASSUMED["mfu"]), steps, mem, 1, False, basis)


def duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    if seconds < 48 * 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


def describe(est: Estimate, budget_s: float = 0.0, available: float | None = None) -> list[str]:
    """Lines for the run's log: the pace, the steps' total (what a time budget trains of them), the memory
    (against what is available, when known), and where the figures come from."""
    per = f"{est.seconds_per_step:.2g} s" if est.seconds_per_step < 10 else f"{est.seconds_per_step:.0f} s"
    line = f"{est.where}: ~{per} a step, {est.steps:,} steps ~{duration(est.seconds)}"
    if budget_s and est.seconds > budget_s:
        fit = max(1, int(budget_s / est.seconds_per_step))
        line += f" (the {duration(budget_s)} budget trains ~{fit:,} of them)"
    mem = f"{est.memory / GIB:.1f} GiB" + (f" ({est.processes} processes)" if est.processes > 1 else "")
    line += f"; memory ~{mem}"
    if available is not None and est.memory > available:
        line += f", more than the {available / GIB:.1f} GiB available"
    return [line, f"  ({est.basis})"]


def _on_gpu(device: str) -> bool:
    return device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())


def before_training(cfg, room: float = 0.85, fit: bool = True) -> tuple[object, list[str]]:
    """What `quickstart --from-hf` says before it trains, and the config it trains with: on a GPU, the GPU
    estimate; on a CPU, the measured estimate and, for comparison, one GPU's. A CPU run that would take more
    than `room` of the memory available is fitted, the global batch kept: local processes (each holds a whole
    copy of the model) become one, then its batch is halved and the steps accumulated, while that helps.
    fit=False: said only (a resumed run keeps the batch it saved)."""
    t = cfg.train
    steps = t.max_iters
    budget = float(t.time_budget or 0.0)
    if _on_gpu(t.device):
        dev = torch.device("cuda", 0)
        precision = choose_precision(dev, t.precision)[0]
        peak = peak_flops(dev)
        name = torch.cuda.get_device_name(0) + ("" if peak else " (peak not in device.PEAK_TFLOPS: an H100's "
                                                                  "assumed)")
        g = gpu_estimate(cfg.model, t, steps, peak, name, precision)
        return cfg, ["estimate before training:"] + describe(g, budget)
    precision = choose_precision(torch.device("cpu"), t.precision)[0]
    have = available_memory()
    avail = float(have[0]) if have else None
    per_core = core_rate(precision)
    ranks = max(1, t.local_ranks)
    cores = max(ranks, usable_cores())
    est = cpu_estimate(cfg.model, t, precision, ranks, steps, per_core, cores)
    lines = ["estimate before training:"]
    if fit and est is not None and ranks > 1 and avail is not None and est.memory > room * avail:
        cfg = replace(cfg, train=replace(t, local_ranks=1, batch_size=t.batch_size * ranks))
        lines.append(f"  one process, not {ranks}: {ranks} copies of the model would take "
                     f"~{est.memory / GIB:.1f} GiB of the {avail / GIB:.1f} GiB available")
        t, ranks = cfg.train, 1
        est = cpu_estimate(cfg.model, t, precision, 1, steps, per_core, cores)
    if fit and est is not None and avail is not None and est.memory > room * avail and t.batch_size > 1:
        was = est.memory
        while est.memory > room * avail and t.batch_size > 1 and t.batch_size % 2 == 0:
            t = replace(t, batch_size=t.batch_size // 2, grad_accum_steps=t.grad_accum_steps * 2)
            est = cpu_estimate(cfg.model, t, precision, ranks, steps, per_core, cores)
        cfg = replace(cfg, train=t)
        lines.append(f"  batch {t.batch_size} x {t.grad_accum_steps} accumulated (the same tokens a step): "
                     f"the whole batch at once would take ~{was / GIB:.1f} GiB of the {avail / GIB:.1f} "
                     f"GiB available")
    if est is None:
        lines.append("  (no CPU measurement recorded: benchmarks/lora_estimates.py)")
    else:
        lines += ["  " + x for x in describe(est, budget, avail)]
    # on a GPU the quickstart trains the global batch in one process, unaccumulated
    whole = replace(t, batch_size=t.batch_size * ranks * t.grad_accum_steps, grad_accum_steps=1)
    lines += ["  " + x for x in describe(gpu_estimate(cfg.model, whole, steps), 0.0)]
    if est is not None and avail is not None and est.memory > avail:
        lines.append("  warning: this run needs more memory than this machine has free, and will likely be "
                     "killed; run the same command on a GPU, or choose a smaller model")
    elif est is not None and budget and est.seconds > 4 * budget:
        lines.append(f"  the time budget stops it after a small part of the steps; for all of them, run the "
                     f"same command on a GPU (or give --time-budget {math.ceil(est.seconds / 60)})")
    return cfg, lines
