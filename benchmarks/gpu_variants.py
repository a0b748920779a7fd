"""Every GPU speed/memory variant of issue 5 in one run, each in its own process (clean peak-memory and
compile state), printed as one table. Needs CUDA; prints the device and software versions first.

    python benchmarks/gpu_variants.py [--steps 30] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
GPT2 = ["--preset", "gpt2-small", "--batch-size", "16", "--block-size", "1024", "--vocab-size", "50304"]
MODERN = ["--preset", "qwen-small", "--batch-size", "16", "--block-size", "1024", "--vocab-size", "50304",
          "--set", "model.n_kv_head=12"]
SEED000 = ["--preset", "gpt2-small", "--block-size", "1024", "--vocab-size", "50000", "--precision", "fp16"]

VARIANTS = {
    "gpt2 eager, plain loss": GPT2 + ["--precision", "bf16"],
    "gpt2 eager, chunked loss": GPT2 + ["--precision", "bf16", "--loss-chunk-rows", "4096"],
    "gpt2 compile, plain loss": GPT2 + ["--precision", "bf16", "--compile"],
    "gpt2 compile, chunked loss": GPT2 + ["--precision", "bf16", "--compile", "--loss-chunk-rows", "4096"],
    "modern compile, plain loss": MODERN + ["--precision", "bf16", "--compile"],
    "modern compile, chunked loss": MODERN + ["--precision", "bf16", "--compile", "--loss-chunk-rows", "4096"],
    "seed000 fp16 batch 2": SEED000 + ["--batch-size", "2", "--compile"],
    "seed000 fp16 batch 8": SEED000 + ["--batch-size", "8", "--compile"],
    "seed000 fp16 batch 8 chunked": SEED000 + ["--batch-size", "8", "--compile", "--loss-chunk-rows", "4096"],
    "seed000 fp16 batch 8 + ckpt": SEED000 + ["--batch-size", "8", "--gradient-checkpointing", "--compile"],
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--only", nargs="+", default=None)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_variants needs a CUDA/ROCm device")
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    print(f"{'variant':32s} {'tokens/s':>10s} {'ms/step':>8s} {'peak GiB':>9s} {'MFU':>6s} {'loss':>7s}")
    for name, args in VARIANTS.items():
        if a.only and name not in a.only:
            continue
        cmd = [sys.executable, os.path.join(HERE, "train_throughput.py"), *args, "--steps", str(a.steps), "--json"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            print(f"{name:32s} failed: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode}")
            continue
        m = json.loads(r.stdout.strip().splitlines()[-1])
        mfu = f"{m['mfu']:.1%}" if m["mfu"] is not None else "-"
        print(f"{name:32s} {m['tokens_per_s']:10,.0f} {m['ms_per_step']:8.1f} {m['peak_memory_gib']:9.2f} {mfu:>6s} "
              f"{m['loss']:7.3f}")


if __name__ == "__main__":
    main()
