"""`codeforge quickstart`: the whole pipeline on a corpus the machine already has, in about ten CPU minutes.

tokenizer -> prepare -> train -> eval -> sample, each stage writing under OUT/ so any of them can be re-run
alone with the regular commands. Re-running the quickstart reuses what is already there (the tokenizer,
identical shards) and resumes the training run.
"""

from __future__ import annotations

import glob
import os
import shutil
import sysconfig
import time
from pathlib import Path

from .config import resolve
from .corpus import CorpusOptions, CorpusStats, iter_documents
from .engine import Engine, SamplingParams
from .evaluate import run_eval
from .shards import prepare
from .tokenizer import train_tokenizer
from .stages import run as run_stage

# Sized for a 2-core laptop CPU: ~3,000 tokens/s for this model, so 600 steps of 2,048 tokens take about
# 7 minutes (docs/LOG.md has the measured run).
MODEL = {"n_layer": 4, "n_head": 4, "n_embd": 256, "block_size": 256, "embd_dropout": 0.0,
         "attn_dropout": 0.0, "resid_dropout": 0.0}
TRAIN = {"batch_size": 8, "grad_accum_steps": 1, "learning_rate": 2e-3, "warmup_steps": 50, "min_lr_ratio": 0.1,
         "eval_every": 100, "eval_iters": 10, "save_every": 200, "log_every": 10, "weight_decay": 0.1}
VOCAB = 8192


def corpus_path(corpus: str) -> tuple[str, list[str]]:
    """(path, languages) of a named corpus or a user path."""
    if corpus == "python-stdlib":
        return sysconfig.get_paths()["stdlib"], ["python"]
    if corpus == "go":
        roots = sorted(glob.glob("/usr/share/go-*/src") + glob.glob("/usr/lib/go-*/src") + glob.glob("/usr/local/go/src"))
        if shutil.which("go"):
            import subprocess
            root = subprocess.run(["go", "env", "GOROOT"], capture_output=True, text=True).stdout.strip()
            if root and os.path.isdir(os.path.join(root, "src")):
                roots.append(os.path.join(root, "src"))
        if not roots:
            raise FileNotFoundError("no Go standard library source found: install it with "
                                    "`sudo apt-get install golang-src` (Debian/Ubuntu) or from go.dev, then rerun")
        return roots[-1], ["go"]
    if not os.path.exists(corpus):
        raise FileNotFoundError(f"--corpus {corpus!r}: not python-stdlib, go, or an existing path")
    return corpus, None


def run_quickstart(out: str, corpus: str = "python-stdlib", max_iters: int | None = None,
                   device: str = "auto") -> dict:
    t_start = time.perf_counter()
    out_dir = Path(out)
    src, langs = corpus_path(corpus)
    opts = CorpusOptions(languages=langs, exclude_tests=True, val_fraction=0.02)
    print(f"[1/5] corpus: {src} ({', '.join(langs or ['all known languages'])}, test files excluded)")

    tok_dir = out_dir / "tokenizer"
    if (tok_dir / "tokenizer.json").exists():
        print(f"[2/5] tokenizer: reusing {tok_dir}")
    else:
        stats = CorpusStats()
        _, meta = train_tokenizer((d.text for d in iter_documents([src], opts, stats)), VOCAB, tok_dir)
        print(f"[2/5] tokenizer: vocab {meta['vocab_size']} trained on {meta['train_documents']} files "
              f"({meta['train_bytes'] / 1e6:.1f} MB) in {meta['train_seconds']:.1f}s -> {tok_dir}")

    data_dir = out_dir / "data"
    meta = prepare([src], tok_dir, data_dir, opts, overwrite=True, log=lambda m: None)  # no-op when unchanged
    print(f"[3/5] prepare: {meta['documents']} files -> {meta['tokens']:,} tokens "
          f"(train {meta['splits']['train']['tokens']:,}, val {meta['splits']['val']['tokens']:,}); "
          f"skipped {meta['skipped']} -> {data_dir}")

    run_dir = out_dir / "run"
    flags = {**{f"model.{k}": v for k, v in MODEL.items()}, **{f"train.{k}": v for k, v in TRAIN.items()},
             "train.data": str(data_dir), "train.out": str(run_dir), "train.max_iters": max_iters or 600,
             "train.device": device}
    cfg = resolve([], None, [], flags, vocab_from_data=True)
    print(f"[4/5] train: {cfg.train.max_iters} steps -> {run_dir}")
    resume = (run_dir / "checkpoints").exists()
    result = run_stage(cfg, resume=resume)
    if result["interrupted"]:
        print("interrupted; run the quickstart again to resume")
        return result

    print("[5/5] eval and sample")
    ev = run_eval(str(run_dir), eval_iters=20, batch_size=8, syntax_samples=8, humaneval=5, ks=[1, 5],
                  samples_per_problem=5, max_new_tokens=128, timeout=5.0, device=device)
    eng = Engine.from_run(str(run_dir), device)
    prompt = "def fibonacci(n):\n" if (langs or ["python"])[0] == "python" else "func fibonacci(n int) int {\n"
    sample = eng.generate([prompt], SamplingParams(max_new_tokens=96, temperature=0.7, top_k=40, seed=0))[0]
    print(f"\nvalidation loss {ev['val_loss']:.3f} (perplexity {ev['perplexity']:.1f}), "
          f"{ev['bits_per_byte']:.3f} bits per byte")
    sv = ev["syntax_valid_rate"]
    sv_text = "n/a" if sv is None else f"{sv:.0%} of {ev['syntax_samples']}"
    print(f"syntax-valid completions: {sv_text}; "
          f"HumanEval pass@1 {ev['pass_at_1']:.3f}, pass@5 {ev['pass_at_k'].get('5', 0.0):.3f} "
          f"on {ev['humaneval_problems']} problems (a model this small is not expected to pass any)")
    print(f"sample:\n{prompt}{sample}\n")
    print(f"finished in {(time.perf_counter() - t_start) / 60:.1f} min. Next: codeforge generate --run {run_dir} "
          f"--prompt 'def '   |   codeforge eval --run {run_dir}   |   tensorboard --logdir {run_dir}/tensorboard")
    return {**result, **ev}
