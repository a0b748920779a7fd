"""codeforge's training step against a minimal eager GPT trainer, same shape, same CPU, interleaved.

The minimal trainer is what a user would write from a textbook: a GPT-2 block (LayerNorm, causal
self-attention through PyTorch's scaled_dot_product_attention, GELU MLP, tied embedding), logits for every
position, cross-entropy, `torch.optim.AdamW` with its defaults (foreach), no clipping, no checks. codeforge's
step is `trainer.train_step` on the `fragment-lowend` preset at the same shape (4 layers x 256, 4 heads,
context 256, vocab 10,000, dropout 0, fp32): clipping, the non-finite check and everything else it does.

Each side runs in a process of its own, as a user would run it: the minimal trainer with PyTorch's and the C
library's defaults (threads: one per core), codeforge's step after what `codeforge train` sets up first (the
device module's thread policy and memory policy). Each round times both, A then B then B then A, each a fresh
process timing --steps steps after --warmup; the ratio of each round is printed, and the median over rounds.
--minimal-malloc keep gives the minimal trainer codeforge's memory policy too
(what the policy alone is worth).

    python benchmarks/step_vs_minimal.py [--rounds 3] [--steps 20] [--batch-size 4] [--threads N] [--compile]
        [--minimal-malloc system|keep] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

if __name__ == "__main__" and sys.argv[-2:] == ["--side", "codeforge"]:
    import codeforge  # noqa: F401  before torch, as the CLI does: it sets OpenMP's wait policy before torch loads
import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d: int, h: int):
        super().__init__()
        self.h = h
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.h, C // self.h).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class MinimalGPT(nn.Module):
    def __init__(self, vocab: int, ctx: int, n_layer: int, n_head: int, d: int):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


def batches(vocab: int, bs: int, ctx: int):
    gen = torch.Generator().manual_seed(0)
    data = [torch.randint(0, vocab, (bs, ctx + 1), generator=gen) for _ in range(4)]
    i = 0
    while True:
        b = data[i % 4]
        i += 1
        yield b[:, :-1], b[:, 1:]


def minimal_stepper(a):
    torch.manual_seed(0)
    model = MinimalGPT(a.vocab_size, a.block_size, 4, 4, 256)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    it = batches(a.vocab_size, a.batch_size, a.block_size)

    def step():
        x, y = next(it)
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()
    return step


def codeforge_stepper(a):
    from codeforge.config import resolve
    from codeforge.models import build_model
    from codeforge.train.losses import lm_loss_fn
    from codeforge.train.optim import build_optimizer
    from codeforge.train.step import train_step
    cfg = resolve(["fragment-lowend"], None,
                  [f"model.block_size={a.block_size}", f"model.vocab_size={a.vocab_size}"])
    m = cfg.model
    m.embd_dropout = m.attn_dropout = m.resid_dropout = 0.0
    torch.manual_seed(0)
    model = build_model(m)
    t = cfg.train
    device = torch.device("cpu")
    opt = build_optimizer(model, t.optimizer, t.learning_rate, t.weight_decay, (t.beta1, t.beta2), device,
                          t.muon_lr, t.muon_momentum, t.muon_weight_decay)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    it = batches(a.vocab_size, a.batch_size, a.block_size)

    fwd = torch.compile(model) if a.compile else model  # train.compile: what --compile does in training

    def step():
        return train_step(fwd, model, opt, scaler, it, lm_loss_fn, 1, 1.0, device, "fp32")[0]
    return step


def time_steps(step, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        loss = step()
    dt = time.perf_counter() - t0
    assert math.isfinite(loss)
    return dt / n


def side(a) -> None:
    """One side's timing, in this process: print {"tokens_per_s", "threads", "device_line"} as JSON."""
    line = ""
    if a.side == "codeforge":
        from codeforge.device import choose_device
        # the thread and memory policy, as `codeforge train` applies them
        line = choose_device("cpu", a.threads)[1]
    else:
        if a.threads:
            torch.set_num_threads(a.threads)
        if a.minimal_malloc == "keep":
            from codeforge.device import keep_freed_memory
            line = keep_freed_memory()
    step = minimal_stepper(a) if a.side == "minimal" else codeforge_stepper(a)
    for _ in range(a.warmup):
        step()
    dt = time_steps(step, a.steps)
    print(json.dumps({"tokens_per_s": a.batch_size * a.block_size / dt, "threads": torch.get_num_threads(),
                      "device_line": line}))


def timed(a, which: str) -> dict:
    args = (
        [sys.executable, os.path.abspath(__file__), "--steps", str(a.steps), "--warmup", str(a.warmup),
         "--batch-size", str(a.batch_size), "--block-size", str(a.block_size), "--vocab-size",
         str(a.vocab_size), "--minimal-malloc", a.minimal_malloc]
        + (["--threads", str(a.threads)] if a.threads else [])
        + (["--compile"] if a.compile else [])
    )
    args += ["--side", which]  # last: the child looks for it before it imports torch
    r = subprocess.run(args, capture_output=True, text=True, check=False)
    if r.returncode:
        raise SystemExit(f"{which} side failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--block-size", type=int, default=256)
    ap.add_argument("--vocab-size", type=int, default=10000)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--compile", action="store_true",
                    help="codeforge's model under torch.compile (train --compile)")
    ap.add_argument("--minimal-malloc", choices=["system", "keep"], default="system",
                    help="the minimal trainer's memory policy: the C library's (default) or codeforge's")
    ap.add_argument("--side", choices=["minimal", "codeforge"], help=argparse.SUPPRESS)  # a child process
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.side:
        return side(a)
    tokens = a.batch_size * a.block_size
    rows, line = [], ""
    for r in range(a.rounds):
        m1 = timed(a, "minimal")
        c1 = timed(a, "codeforge")
        c2 = timed(a, "codeforge")
        m2 = timed(a, "minimal")
        tm = (m1["tokens_per_s"] + m2["tokens_per_s"]) / 2
        tc = (c1["tokens_per_s"] + c2["tokens_per_s"]) / 2
        line = c1["device_line"]
        rows.append({"round": r, "minimal_tokens_per_s": tm, "codeforge_tokens_per_s": tc, "ratio": tc / tm,
                     "threads": [m1["threads"], c1["threads"]]})
        if not a.json:
            print(f"round {r}: minimal {tm:,.0f} tokens/s, codeforge {tc:,.0f} tokens/s, ratio {tc / tm:.3f} "
                  f"(threads {m1['threads']} / {c1['threads']})", flush=True)
    med = statistics.median(r["ratio"] for r in rows)
    out = {"compile": a.compile, "minimal_malloc": a.minimal_malloc, "torch": torch.__version__,
           "codeforge_device": line, "rounds": rows, "median_ratio": med, "tokens_per_step": tokens}
    if a.json:
        print(json.dumps(out))
    else:
        print(f"codeforge's device line: {line}")
        print(f"median ratio codeforge / minimal: {med:.3f} (torch {torch.__version__}, "
              f"minimal trainer's memory policy: {a.minimal_malloc})")


if __name__ == "__main__":
    main()
