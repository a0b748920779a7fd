"""Decode throughput of the KV-cache engine at batch 1 and 8, beside a full-recompute baseline (the whole
sequence re-run for every new token, as a model without a cache must), on random weights of a preset.

    python benchmarks/generate_throughput.py [--preset fragment-lowend] [--new-tokens 512] [--vocab-size 8192]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from codeforge.config import resolve
from codeforge.device import choose_device
from codeforge.engine import Engine, SamplingParams
from codeforge.models import build_model
from codeforge.tokenizer import train_tokenizer


@torch.no_grad()
def recompute(model, prompts: torch.Tensor, n: int) -> torch.Tensor:
    idx = prompts
    for _ in range(n):
        nxt = model(idx)[:, -1].argmax(-1, keepdim=True)
        idx = torch.cat([idx, nxt], dim=1)
    return idx


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", nargs="+", default=["fragment-lowend"])
    ap.add_argument("--new-tokens", type=int, default=512)
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--no-recompute", action="store_true",
                    help="time the engine only (the recompute baseline is " "slow at 100M+ parameters)")
    a = ap.parse_args()
    device, _ = choose_device(a.device)
    cfg = resolve(a.preset, None, [f"model.vocab_size={a.vocab_size}"]).model
    cfg.block_size = max(cfg.block_size, a.prompt_tokens + a.new_tokens)
    torch.manual_seed(0)
    model = build_model(cfg).to(device).eval()
    with tempfile.TemporaryDirectory() as tmp:
        tok, _ = train_tokenizer(iter([" ".join(f"w{i}" for i in range(5000))]), 512, tmp + "/tok")
        eng = Engine(model, tok, device)
        eng.tok.vocab_size = cfg.vocab_size  # sample over the model's whole (random) vocabulary
        print(f"{'+'.join(a.preset)}: {model.num_params():,} params, {a.prompt_tokens}-token prompts, "
              f"{a.new_tokens} new tokens, device {device}, {torch.get_num_threads()} threads")
        print(f"{'batch':>5s} {'engine tok/s':>13s} {'recompute tok/s':>16s} {'speed-up':>9s}")
        for B in a.batches:
            prompts = torch.randint(0, cfg.vocab_size, (B, a.prompt_tokens))
            p = SamplingParams(max_new_tokens=a.new_tokens, temperature=0, stop_at_eot=False)
            sum(1
                # warm-up
                for _ in eng.generate_ids(prompts.tolist(), SamplingParams(max_new_tokens=8, temperature=0)))
            eng_tps = rec_tps = 0.0
            for _ in range(a.repeats):  # best of N: this machine's other load only ever slows a run down
                t0 = time.perf_counter()
                n = sum(1 for _ in eng.generate_ids(prompts.tolist(), p))
                eng_tps = max(eng_tps, B * n / (time.perf_counter() - t0))
                if not a.no_recompute:
                    t0 = time.perf_counter()
                    recompute(model, prompts.to(device), a.new_tokens)
                    rec_tps = max(rec_tps, B * a.new_tokens / (time.perf_counter() - t0))
            if a.no_recompute:
                print(f"{B:5d} {eng_tps:13,.1f} {'-':>16s} {'-':>9s}")
            else:
                print(f"{B:5d} {eng_tps:13,.0f} {rec_tps:16,.0f} {eng_tps / rec_tps:8.1f}x")


if __name__ == "__main__":
    main()
