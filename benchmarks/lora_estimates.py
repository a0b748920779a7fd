"""CPU time and memory of LoRA on the real Qwen2.5-Coder-0.5B and 1.5B shapes: the measured rows behind the
estimate `quickstart --from-hf` prints before it trains (codeforge/train/estimate.py, MEASURED_CPU).

Nothing is downloaded: each model is codeforge's own GPT built from the published config.json (the mapping
`codeforge import --hf` uses, export/hf.py's config_from_hf) with random weights, its context cut to the
measured one (rotary positions: no weight depends on it). LoRA goes on as train.lora_rank puts it
(models/lora.py: rank 16, alpha 32, every block matrix), AdamW on the adapters, the trainer's own train_step
on random tokens, at the precision given. Each row runs in a fresh process, which reports its peak resident
memory (getrusage), the seconds of each timed step after one warm-up step, and this machine's matrix-product
rate at that precision (device.matmul_flops, what estimate.py scales other CPUs by). Printed: a Markdown table
beside `codeforge plan`'s estimate for the same run, and the rows to paste into MEASURED_CPU.

    python benchmarks/lora_estimates.py                  # every row (~20 min on an AVX-512 core)
    python benchmarks/lora_estimates.py --only 0.5B-bf16-1x256 --steps 2

GPU rows are not measured here (no GPU); estimate.py derives them from FLOPs at an assumed utilisation.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# The published config.json of each model (huggingface.co/Qwen/Qwen2.5-Coder-0.5B and -1.5B), the fields the
# import reads; both tie their embeddings.
QWEN = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "sliding_window": 32768, "use_sliding_window": False, "tie_word_embeddings": True,
        "vocab_size": 151936}
SHAPES = {
    "Qwen2.5-Coder-0.5B": {**QWEN, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                           "num_attention_heads": 14, "num_key_value_heads": 2},
    "Qwen2.5-Coder-1.5B": {**QWEN, "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
                           "num_attention_heads": 12, "num_key_value_heads": 2},
}
RANK, ALPHA = 16, 32.0
CHUNK = 1024  # quickstart --from-hf's chunked loss rows (a 151,936-token vocabulary's logits are large)
# name -> (shape, precision, batch, context). 2 x 1024: one rank's share of quickstart --from-hf's step on 2
# cores (4 x 1024 tokens over two one-thread processes); 1 x 256: a small step, where the frozen weights'
# per-step casts to bfloat16 weigh most
RUNS = {
    "0.5B-bf16-2x1024": ("Qwen2.5-Coder-0.5B", "bf16", 2, 1024),
    "1.5B-bf16-2x1024": ("Qwen2.5-Coder-1.5B", "bf16", 2, 1024),
    "0.5B-fp32-2x1024": ("Qwen2.5-Coder-0.5B", "fp32", 2, 1024),
    "0.5B-bf16-1x256": ("Qwen2.5-Coder-0.5B", "bf16", 1, 256),
}


def configs(shape: str, batch: int, context: int):
    from codeforge.config import TrainConfig
    from codeforge.export.hf import config_from_hf
    m, _ = config_from_hf(SHAPES[shape], f"{shape}/config.json")
    m = replace(m, block_size=context)
    t = replace(TrainConfig(), batch_size=batch, lora_rank=RANK, lora_alpha=ALPHA, optimizer="adamw",
                loss_chunk_rows=CHUNK, weight_decay=0.0)
    return m, t


def child(name: str, steps: int, threads: int) -> dict:
    """One row, in this process with `threads` intra-op threads: build, attach, warm up one step, time
    `steps`."""
    import torch
    torch.set_num_threads(threads)
    load = os.getloadavg()[0]

    from codeforge.device import matmul_flops
    from codeforge.models import build_model, lora
    from codeforge.train import estimate as est
    from codeforge.train.memory import estimate as plan
    from codeforge.train.optim import build_optimizer
    from codeforge.train.step import train_step
    shape, precision, batch, context = RUNS[name]
    m, t = configs(shape, batch, context)
    cpu = torch.device("cpu")
    rate = matmul_flops(cpu, precision)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    model = build_model(m)
    lora.attach(model, RANK, ALPHA)
    model.loss_chunk_rows = CHUNK
    model.train()
    built = time.perf_counter() - t0
    opt = build_optimizer(model, "adamw", 1e-3, 0.0, (0.9, 0.95), cpu)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    g = torch.Generator().manual_seed(1)

    def batches():
        while True:
            x = torch.randint(0, m.vocab_size, (batch, context + 1), generator=g)
            yield x[:, :-1], x[:, 1:]

    def loss_fn(fwd, b):
        return fwd(b[0], b[1]), {}

    it = batches()
    times = []
    for i in range(steps + 1):  # the first is the warm-up (allocations, first-touch pages)
        s = time.perf_counter()
        loss, _, _ = train_step(model, model, opt, scaler, it, loss_fn, 1, 1.0, cpu, precision)
        if i:
            times.append(time.perf_counter() - s)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    trainable, total = lora.counts(model)
    fpt = est.train_flops_per_token(m, t)
    sps = sorted(times)[len(times) // 2]  # the median step
    planned = plan(m, t, 1, precision).total("ddp")
    return {"shape": shape, "params": total, "adapters": trainable, "lora_rank": RANK, "batch": batch,
            "context": context, "precision": precision, "threads": torch.get_num_threads(),
            "seconds_per_step": round(sps, 2), "steps_timed": len(times),
            "tokens_per_s": round(batch * context / sps, 1),
            "flops_per_s": float(f"{fpt * batch * context / sps:.4g}"),
            "matmul_flops": float(f"{rate:.4g}"), "peak_rss_gib": round(peak / 2**30, 2),
            "plan_gib": round(planned / 2**30, 2), "overhead_gib": round((peak - planned) / 2**30, 2),
            "build_s": round(built, 1), "loss": round(loss, 3),
            "load": [round(load, 1), round(os.getloadavg()[0], 1)]}


def machine() -> str:
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    isa = "AVX512-BF16" if "avx512_bf16" in flags else "AVX-512" if "avx512f" in flags else "AVX2" \
        if "avx2" in flags else "?"
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{name}, {os.cpu_count()} cores, {isa}, {mem:.0f} GiB, torch {torch.__version__}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="*", choices=sorted(RUNS), help="these rows only")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per row (after one warm-up step)")
    ap.add_argument("--threads", type=int, default=1,
                    help="intra-op threads of each row's process (1: one of the quickstart's per-core ranks)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.steps, a.threads)))
        return 0
    rows = []
    for name in a.only or list(RUNS):
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, __file__, "--child", name, "--steps", str(a.steps), "--threads",
                            str(a.threads)],
                           capture_output=True, text=True)
        if r.returncode:
            print(f"{name}: failed (exit {r.returncode})\n{r.stderr[-3000:]}", file=sys.stderr)
            continue
        row = json.loads(r.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(f"{name}: {row['seconds_per_step']} s/step, peak {row['peak_rss_gib']} GiB "
              f"(plan {row['plan_gib']}), {time.perf_counter() - t0:.0f} s wall, load average "
              f"{row['load'][0]} -> {row['load'][1]}", flush=True)
    print(f"\n{time.strftime('%Y-%m-%d')}, {machine()}\n")
    print("| shape | LoRA | batch x context | precision | s/step | tokens/s | GFLOP/s (matmul) | peak RSS "
          "| plan |")
    print("| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['shape']} ({r['params'] / 1e9:.2f}B) | r{r['lora_rank']}, {r['adapters']:,} trainable | "
              f"{r['batch']} x {r['context']} | {r['precision']} | {r['seconds_per_step']} | "
              f"{r['tokens_per_s']} | {r['flops_per_s'] / 1e9:.0f} ({r['matmul_flops'] / 1e9:.0f}) | "
              f"{r['peak_rss_gib']} GiB | {r['plan_gib']} GiB |")
    keep = ("shape", "params", "lora_rank", "batch", "context", "precision", "threads", "seconds_per_step",
            "flops_per_s", "matmul_flops", "peak_rss_gib", "plan_gib")
    print("\nMEASURED_CPU rows:")
    for r in rows:
        print("    " + json.dumps({k: r[k] for k in keep}) + ",")
    return 0


if __name__ == "__main__":
    sys.exit(main())
