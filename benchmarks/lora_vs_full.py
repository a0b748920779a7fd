"""LoRA against full fine-tuning of an imported model on the CPU, and the merged export's parity.

The "open model" is a codeforge run exported to Hugging Face format and imported back with `codeforge import
--hf` (nothing downloaded; the path a user takes with a downloaded checkpoint). Both arms fine-tune it on the
same library prepared with its tokenizer, for the same steps, batch and context, in one process each
(`codeforge train --init-from IMPORTED`), full (every weight, AdamW) or `--lora-rank R` (adapters only).
Printed per arm: trainable parameters, peak resident memory of the training process, tokens/s (training
time only, as the trainer counts it), and the best held-out validation loss (bits per byte).

Then the LoRA run's merged exports against codeforge's own logits on held-out code: the HF export in
transformers (max |logit difference|), and the f32 GGUF in llama.cpp's llama-server (greedy tokens equal,
where a built llama-server is found: $CODEFORGE_LLAMA_SERVER or benchmarks/build_llama_server.py's cache).

    python benchmarks/lora_vs_full.py --base-run /tmp/fim_mix/run-fim0.5-repo0-seed0
    --lib attr --out /tmp/lora_bench
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import torch


def sh(args: list[str]) -> None:
    r = subprocess.run(args, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"{' '.join(args)} failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")


PEAK = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
        "sys.stderr.write(r.stdout[-2000:] + r.stderr[-2000:]) if r.returncode else None; "
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(r.returncode)")


def sh_peak(args: list[str]) -> int:
    """Run args in a fresh wrapper process; the peak resident KiB of that command alone."""
    r = subprocess.run([sys.executable, "-c", PEAK, *args], capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"{' '.join(args)} failed:\n{r.stderr[-3000:]}")
    return int(r.stdout.strip().splitlines()[-1])


def train_arm(name: str, out: Path, imported: Path, data: Path, steps: int, extra: list[str]) -> dict:
    run = out / name
    t0 = time.perf_counter()
    peak = sh_peak([sys.executable, "-m", "codeforge", "train", "--init-from", str(imported), "--data",
                    str(data), "--out", str(run),
        "--max-iters", str(steps), "--batch-size", "8", "--eval-every", str(max(1, steps // 4)),
        "--eval-tokens", "0",
        "--save-every", str(steps), "--optimizer", "adamw", "--warmup-steps", "10", "--device", "cpu",
        "--local-ranks", "1", "--no-tensorboard", "--no-progress", *extra])
    wall = time.perf_counter() - t0
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    vals = [r for r in recs if "val_loss" in r]
    best = min(vals, key=lambda r: r["val_loss"])
    tps = [r["tokens_per_s"] for r in recs if "tokens_per_s" in r and r["step"] > 10]  # past the first steps
    from codeforge.checkpoint import find_checkpoint, load_model
    from codeforge.models import lora
    model = load_model(run, torch.device("cpu"), "latest")[0]
    trainable = sum(v.numel() for v in lora.read_adapter(find_checkpoint(run, "latest"))[1].values()) \
        if "--lora-rank" in extra else model.num_params()
    return {"arm": name, "trainable": trainable, "params": model.num_params(), "peak_rss_mib": peak / 1024,
            "tok_per_s": sorted(tps)[len(tps) // 2] if tps else None, "best_val_loss": best["val_loss"],
            "best_bpb": best.get("val_bpb"), "best_step": best["step"], "start_val_loss": vals[0]["val_loss"],
            "wall_s": round(wall, 1), "run": str(run)}


def parity(run: Path, data: Path, out: Path) -> dict:
    import numpy as np
    import transformers

    from codeforge.checkpoint import load_model
    model, tok, ck, _ = load_model(run, torch.device("cpu"), "latest")
    val = np.fromfile(data / "val_000000.bin", dtype=np.uint16 if tok.vocab_size < 65536 else np.uint32)
    rows = torch.tensor(val[: 4 * 128].astype(np.int64)).view(4, 128)
    hf_dir = out / "merged-hf"
    sh([sys.executable, "-m", "codeforge", "export", "--run", str(run), "--format", "hf", "--out",
        str(hf_dir), "--checkpoint", "latest"])
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        diff = (hf(rows).logits - model(rows)).abs().max().item()
    res = {"hf_max_abs_logit_diff": diff, "hf_positions": int(rows.numel())}
    server = os.environ.get("CODEFORGE_LLAMA_SERVER")
    if server:
        from codeforge.engine import Engine, SamplingParams
        from codeforge.evaluation.llama_server import running
        g = out / "merged.f32.gguf"
        sh([sys.executable, "-m", "codeforge", "export", "--run", str(run), "--format", "gguf", "--out",
            str(g), "--checkpoint", "latest"])
        eng = Engine(model, tok, torch.device("cpu"), "fp32")
        same = total = 0
        import urllib.request
        with running(str(g), server, log=lambda m: None) as url:
            for r in rows[:3]:
                prompt = r[:32].tolist()
                ours = [s[0]
                        for s in eng.generate_ids([prompt], SamplingParams(max_new_tokens=48, temperature=0,
                                                                                stop_at_eot=False))]
                req = urllib.request.Request(url + "/completion", json.dumps(
                    {"prompt": prompt, "n_predict": 48, "temperature": 0, "top_k": 1, "cache_prompt": False,
                     "return_tokens": True, "ignore_eos": True}).encode(),
                                             {"Content-Type": "application/json"})
                theirs = json.load(urllib.request.urlopen(req, timeout=120))["tokens"]
                same += sum(a == b for a, b in zip(ours, theirs))
                total += len(ours)
        res.update(gguf_greedy_tokens_equal=same, gguf_greedy_tokens=total)
    return res


def random_qwen2(base_run: str, out: Path, width: int, layers: int) -> None:
    import transformers

    from codeforge.checkpoint import find_checkpoint
    from codeforge.export.hf import write_tokenizer_files
    from codeforge.tokenizer import CodeTokenizer
    tok_dir = find_checkpoint(base_run, "auto") / "tokenizer"
    vocab = 64 * -(-CodeTokenizer.load(tok_dir).vocab_size // 64)
    heads = max(1, width // 64)
    cfg = transformers.Qwen2Config(vocab_size=vocab, hidden_size=width,
                                   intermediate_size=width * 8 // 3 // 64 * 64,
                                   num_hidden_layers=layers, num_attention_heads=heads,
                                   num_key_value_heads=max(1, heads // 4), max_position_embeddings=256,
                                   tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(out)
    write_tokenizer_files(tok_dir, out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-run", required=True, help="a codeforge run to stand in for a downloaded model")
    ap.add_argument("--lib", default="attr",
                    help="the code to fine-tune on: a package beside codeforge, or a path")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--full-lr", type=float, default=1e-3)
    ap.add_argument("--lora-lr", type=float, default=5e-3)
    ap.add_argument("--random-qwen2", default=None, metavar="WIDTH:LAYERS",
                    help="instead of the base run's weights: a random "
                         "Qwen2 of this shape (with the base run's "
                         "tokenizer), for memory and tokens/s at a size where the weights dominate (its "
                         "losses mean nothing)")
    ap.add_argument("--out", default="/tmp/lora_bench")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    hf, imported, data = out / "hf", out / "imported", out / "data"
    if not (imported / "checkpoints").exists():
        if a.random_qwen2:
            random_qwen2(a.base_run, hf, *(int(x) for x in a.random_qwen2.split(":")))
        else:
            sh([sys.executable, "-m", "codeforge", "export", "--run", a.base_run, "--format", "hf", "--out",
                str(hf)])
        sh([sys.executable, "-m", "codeforge", "import", "--hf", str(hf), "--out", str(imported),
            "--no-verify"])
    lib = Path(a.lib) if "/" in a.lib else Path(sysconfig.get_paths()["purelib"]) / a.lib
    if not (data / "meta.json").exists():
        from codeforge.checkpoint import find_checkpoint
        sh([sys.executable, "-m", "codeforge", "prepare", "--input", str(lib), "--tokenizer",
            str(find_checkpoint(imported, "auto") / "tokenizer"), "--out", str(data), "--val-fraction",
            "0.2"])
    rows = [train_arm("full", out, imported, data, a.steps, ["--learning-rate", str(a.full_lr)]),
            train_arm(f"lora-r{a.rank}", out, imported, data, a.steps,
                      ["--learning-rate", str(a.lora_lr), "--lora-rank", str(a.rank), "--lora-alpha",
                       str(2 * a.rank)])]
    check = parity(Path(rows[1]["run"]), data, out)
    print("\n| arm | trainable | peak RSS | tokens/s | held-out loss: start -> best (step) | bits/byte |")
    print("| --- " * 6 + "|")
    for r in rows:
        print(f"| {r['arm']} | {r['trainable']:,} of {r['params']:,} ({r['trainable'] / r['params']:.1%}) | "
              f"{r['peak_rss_mib']:.0f} MiB | {r['tok_per_s'] or 0:,.0f} | {r['start_val_loss']:.3f} -> "
              f"{r['best_val_loss']:.3f} ({r['best_step']}) | {r['best_bpb'] or 0:.3f} |")
    print(json.dumps(check))
    (out / "results.json").write_text(json.dumps({"arms": rows, "parity": check}, indent=1))


if __name__ == "__main__":
    main()
