"""Would two Python threads, each running forward and backward on half the batch with PyTorch's pool at one
thread (so no OpenMP barrier after every operation), train faster than one process-wide pool? An experiment
(docs/LOG.md#2026-11-25-split-batch-threads); codeforge's trainer does not do this. Prints tokens/s as JSON,
for benchmarks/under_load.py:

    python benchmarks/split_batch_threads.py --mode intra1|intra2|dp2 [--preset cpu-small] [--vocab N]
    python benchmarks/under_load.py --loads none,spin6 -- python benchmarks/split_batch_threads.py --mode dp2
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import torch

from codeforge.config import resolve
from codeforge.models import build_model

p = argparse.ArgumentParser()
p.add_argument("--mode", choices=["intra1", "intra2", "dp2"], required=True)
p.add_argument("--steps", type=int, default=8)
p.add_argument("--batch", type=int, default=4)
p.add_argument("--preset", default="cpu-small")
p.add_argument("--vocab", type=int, default=0)
a = p.parse_args()
torch.set_num_threads(2 if a.mode == "intra2" else 1)
cfg = resolve([a.preset], None,
              ["model.block_size=256"] + ([f"model.vocab_size={a.vocab}"] if a.vocab else []))
torch.manual_seed(0)
model = build_model(cfg.model)
params = [q for q in model.parameters() if q.requires_grad]
opt = torch.optim.AdamW(params, lr=3e-4)
T, V = 256, cfg.model.vocab_size
g = torch.Generator().manual_seed(0)
b = torch.randint(0, V, (a.batch, T + 1), generator=g)
x, y = b[:, :-1], b[:, 1:]

def loss_of(xs, ys):
    out = model(xs, ys)
    return out[1] if isinstance(out, tuple) else out

def half(i, res):
    h = a.batch // 2
    xs, ys = x[i * h:(i + 1) * h], y[i * h:(i + 1) * h]
    loss = loss_of(xs, ys) / 2
    res[i] = torch.autograd.grad(loss, params)

def step():
    if a.mode == "dp2":
        res = [None, None]
        th = threading.Thread(target=half, args=(1, res))
        th.start()
        half(0, res)
        th.join()
        for q, g0, g1 in zip(params, res[0], res[1]):
            q.grad = g0 + g1
    else:
        loss = loss_of(x, y)
        loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)

step()
t0 = time.perf_counter()
for _ in range(a.steps):
    step()
dt = time.perf_counter() - t0
print(json.dumps({"tokens_per_s": a.steps * a.batch * T / dt, "mode": a.mode}))
