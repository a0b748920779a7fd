"""Quality per CPU-minute: the quickstart's default recipe against a minimal GPT trainer's CPU recipe, each
trained for the same seconds on the same corpus, scored in bits per byte on the corpus' own validation split
and on held-out projects it never saw.

The baseline is the CPU recipe in the README of a well-known minimal GPT trainer, rebuilt here with
codeforge's own model and trainer: GPT-2 blocks (LayerNorm, learned positions, GELU, tied embeddings, no
bias), 4 layers, 4 heads, width 128, context 64, batch 12, AdamW lr 1e-3 (betas 0.9/0.99, weight decay 0.1,
clip 1.0), 100 warm-up steps and cosine decay to 1e-4 at the last step, no dropout, on a 32k byte-level BPE
with the GPT-4-style split (`--split llama3`). "Default" is what the quickstart trains: its presets
(`cpu-small` + `lowend-cpu`), its 8k tokenizer, and bf16 autocast where the CPU has native bfloat16.

Same seconds: each recipe is first timed for a few dozen steps on this machine, then trained for
seconds x measured steps/s steps (the schedule decays to its end in that budget). The training seconds each
run actually took (evaluation and saves excluded, as the trainer counts them) are printed beside the result.

Held-out code (nothing of it is in the training corpus):
  go:     12 libraries from Debian's golang-github-*-dev packages under /usr/share/gocode/src (apt-get install
          the packages named in HELDOUT below)
  python: pure-Python libraries installed with codeforge's own dependencies (site-packages: click, jinja2,
          h11, anyio, starlette, httpx, markdown_it)

    python benchmarks/quality_per_minute.py --lang go python --seconds 442
    python benchmarks/quality_per_minute.py --lang go --seconds 200 --recipe default \
        --variant wide:model.n_embd=256,model.n_head=4
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from codeforge import quickstart
from codeforge.checkpoint import load_model
from codeforge.config import resolve
from codeforge.corpus import CorpusOptions, CorpusStats, iter_documents
from codeforge.device import choose_device
from codeforge.tokenizer import token_byte_lengths
from codeforge.evaluation.lm import validation_loss
from codeforge.data.shards import ShardSet, prepare
from codeforge.stages import run as run_stage
from codeforge.tokenizer import train_tokenizer

GOCODE = "/usr/share/gocode/src/github.com"
HELDOUT = {
    # Debian packages: golang-github-{gin-gonic-gin,gorilla-mux,gorilla-websocket,spf13-cobra,sirupsen-logrus,
    # stretchr-testify,google-go-cmp,burntsushi-toml,hashicorp-go-multierror,fsnotify-fsnotify}-dev
    "go": [f"{GOCODE}/{p}" for p in ("gin-gonic/gin", "gorilla/mux", "gorilla/websocket", "spf13/cobra",
                                     "sirupsen/logrus", "stretchr/testify", "google/go-cmp",
                                     "BurntSushi/toml", "hashicorp/go-multierror", "fsnotify/fsnotify")],
    "python": ["click", "jinja2", "h11", "anyio", "starlette", "httpx", "markdown_it"],
}

BASELINE = {
    "vocab": 32000, "split": "llama3",
    "model": {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 64, "bias": False, "embd_dropout": 0.0,
              "attn_dropout": 0.0, "resid_dropout": 0.0},
    "train": {"batch_size": 12, "grad_accum_steps": 1, "learning_rate": 1e-3, "beta2": 0.99,
              "weight_decay": 0.1, "warmup_steps": 100, "min_lr_ratio": 0.1, "grad_clip": 1.0},
}


def default_recipe() -> dict:
    """What `codeforge quickstart` trains: its presets (bf16 where this CPU has
    it natively), in one process."""
    return {"vocab": quickstart.VOCAB, "split": "code", "presets": list(quickstart.PRESETS), "model": {},
            "train": {"local_ranks": 1}}


def heldout_sources(lang: str) -> list[str]:
    if lang == "go":
        paths = HELDOUT["go"]
    else:
        import importlib.util
        paths = [str(Path(importlib.util.find_spec(m).origin).parent) for m in HELDOUT["python"]]
    missing = [p for p in paths if not Path(p).is_dir()]
    if missing:
        sys.exit(f"held-out sources missing: {missing}; install them (see this script's docstring)")
    return paths


def data_for(work: Path, lang: str, vocab: int, split: str) -> tuple[Path, Path, Path]:
    """(tokenizer, train/val shards, held-out shards) for this corpus and tokenizer, made once and reused."""
    src, langs = quickstart.corpus_path("python-stdlib" if lang == "python" else "go")
    opts = CorpusOptions(languages=langs, exclude_tests=True, val_fraction=0.02)
    base = work / f"{lang}-{split}-{vocab}"
    tok = base / "tokenizer"
    if not (tok / "tokenizer.json").exists():
        # as the quickstart does: on the corpus' files (test files excluded), validation split included
        train_tokenizer((d.text for d in iter_documents([src], opts, CorpusStats())), vocab, tok, split=split)
    data = base / "data"
    prepare([src], tok, data, opts, overwrite=True, log=lambda m: None)
    held = base / "heldout"
    prepare(heldout_sources(lang), tok, held,
            CorpusOptions(languages=langs, exclude_tests=True, val_fraction=0.0),
            overwrite=True, log=lambda m: None)
    return tok, data, held


def config(recipe: dict, data: Path, out: Path, iters: int, seed: int):
    return resolve(recipe.get("presets", []), None, [],
                   {**{f"model.{k}": v for k, v in recipe["model"].items()},
            **{f"train.{k}": v for k, v in recipe["train"].items()},
            "train.data": str(data), "train.out": str(out), "train.max_iters": iters, "train.device": "cpu",
            "train.eval_every": 0, "train.eval_tokens": 4096, "train.save_every": 0, "train.log_every": 5,
            "train.tensorboard": False, "train.progress": False, "train.seed": seed},
                   vocab_from_data=True)


def train_seconds(run: Path) -> tuple[float, int]:
    """Training seconds as the trainer timed them (evaluation and saves excluded), and steps."""
    secs, tokens, step = 0.0, 0, 0
    for line in (run / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "tokens_per_s" in r:
            secs += (r["tokens"] - tokens) / r["tokens_per_s"]
            tokens, step = r["tokens"], r["step"]
    return secs, step


def train(recipe: dict, data: Path, out: Path, seconds: float, seed: int, steps: int | None = None) -> dict:
    """Time the recipe for 40 steps, then train seconds x that rate; `steps` pins the count instead (to re-run
    one whose probe misjudged the rate: the printed train seconds tell)."""
    import shutil
    probe = out.with_name(out.name + "-probe")
    shutil.rmtree(probe, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    cfg = config(recipe, data, out, 1, seed)
    tokens_per_step = cfg.train.batch_size * cfg.train.grad_accum_steps * cfg.model.block_size
    sps = None
    if not steps:
        run_stage(config(recipe, data, probe, 40, seed))
        rows = [json.loads(x) for x in (probe / "metrics.jsonl").read_text().splitlines()]
        rows = [r for r in rows if "tokens_per_s" in r]
        # tokens over seconds after the first 10 steps (warm-up); a mean of the per-line rates would run high
        pairs = [(b["tokens"] - a["tokens"], b["tokens_per_s"]) for a, b in zip(rows, rows[1:])
                 if a["step"] >= 10]
        sps = sum(n for n, _ in pairs) / sum(n / r for n, r in pairs)
        shutil.rmtree(probe, ignore_errors=True)
    iters = steps or max(1, round(seconds * sps / tokens_per_step))
    run_stage(config(recipe, data, out, iters, seed))
    secs, steps = train_seconds(out)
    return {"iters": steps, "train_seconds": secs, "tokens": steps * tokens_per_step,
            "probe_tokens_per_s": sps}


def score(run: Path, data: Path, held: Path, val_tokens: int) -> dict:
    dev, _ = choose_device("cpu")
    model, tok, _, cfg = load_model(str(run), dev, which="final")
    T = cfg["model"]["block_size"]
    tb = token_byte_lengths(tok, cfg["model"]["vocab_size"])
    with torch.no_grad():
        val = validation_loss(model, ShardSet(data, "val"), T, tok.special_ids, val_tokens, dev, "fp32", tb)
        ho = validation_loss(model, ShardSet(held, "train"), T, tok.special_ids, 0, dev, "fp32", tb)
    return {"val_bpb": val["bits_per_byte"], "heldout_bpb": ho["bits_per_byte"],
            "heldout_tokens": ho["eval_tokens"], "params": sum(p.numel() for p in model.parameters())}


def parse_variant(text: str, base: dict) -> tuple[str, dict]:
    """NAME:section.key=value,...  (section: model, train, or tok for vocab/split) on top of `base`."""
    name, _, body = text.partition(":")
    r = {**base, "model": dict(base["model"]), "train": dict(base["train"])}
    for item in filter(None, body.split(",")):
        key, _, value = item.partition("=")
        section, _, field = key.partition(".")
        try:
            v = json.loads(value)
        except json.JSONDecodeError:
            v = value
        if section == "tok":
            r[field] = v
        else:
            r[section][field] = v
    return name, r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lang", nargs="+", default=["go", "python"], choices=["go", "python"])
    ap.add_argument("--seconds", type=float, default=442.0, help="training seconds per recipe")
    ap.add_argument("--recipe", nargs="*", default=["baseline", "default"], choices=["baseline", "default"])
    ap.add_argument("--variant", action="append", default=[],
                    help="NAME:model.k=v,train.k=v,tok.vocab=N on top of the default recipe (repeatable)")
    ap.add_argument("--work", default="/tmp/cf-quality")
    ap.add_argument("--val-tokens", type=int, default=65_536, help="own-validation targets scored")
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--steps", action="append", default=[], metavar="LANG:RECIPE=N",
                    help="pin a recipe's step count instead of timing it (repeatable)")
    a = ap.parse_args()
    pins = {k: int(v) for k, _, v in (x.partition("=") for x in a.steps)}
    work = Path(a.work)
    recipes = {"baseline": BASELINE, "default": default_recipe()}
    todo = [(n, recipes[n]) for n in a.recipe] + [parse_variant(v, default_recipe()) for v in a.variant]
    results = []
    for lang in a.lang:
        for name, recipe in todo:
            t0 = time.perf_counter()
            tok, data, held = data_for(work, lang, recipe["vocab"], recipe["split"])
            out = work / "runs" / f"{lang}-{name}"
            tr = train(recipe, data, out, a.seconds, a.seed, pins.get(f"{lang}:{name}"))
            sc = score(out, data, held, a.val_tokens)
            row = {"lang": lang, "recipe": name, **tr, **sc, "wall_s": time.perf_counter() - t0,
                   "config": recipe}
            results.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n{'lang':7s} {'recipe':14s} {'params':>9s} {'steps':>6s} {'train s':>8s} {'tokens':>10s} "
          f"{'val bpb':>8s} {'held-out bpb':>12s}")
    for r in results:
        print(f"{r['lang']:7s} {r['recipe']:14s} {r['params']:9,d} {r['iters']:6d} {r['train_seconds']:8.0f} "
              f"{r['tokens']:10,d} {r['val_bpb']:8.3f} {r['heldout_bpb']:12.3f}")
    for lang in a.lang:
        base = next((r for r in results if r["lang"] == lang and r["recipe"] == "baseline"), None)
        if base:
            for r in results:
                if r["lang"] == lang and r is not base:
                    print(f"{lang}: {r['recipe']} / baseline held-out bpb = "
                          f"{r['heldout_bpb'] / base['heldout_bpb']:.3f}"
                          f" (goal <= 0.9); own validation {r['val_bpb'] / base['val_bpb']:.3f}")


if __name__ == "__main__":
    main()
