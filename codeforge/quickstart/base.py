"""A small repository's recipe: a base model first, then the repository.

A repository the default run would pass over more than MANY_PASSES times learns its training files by heart.
Instead it first trains a base on a public corpus of its language, then goes on on the repository from the
base's best weights, at a lower learning rate, for at most MANY_PASSES passes; the tokenizer is trained on
both, the repository's files weighted (pretrain.REPO_TOKENIZER_WEIGHT), so its identifiers stay whole
(docs/LOG.md#2026-11-27-base-then-repo: held-out bits per byte -9% and -14% on two libraries at equal
steps).
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

from .. import rundir
from ..config import RunConfig
from ..corpus import EXT_TO_LANG, CorpusOptions, CorpusStats, iter_documents
from ..stages import run as run_stage
from ..stages.lm import MANY_PASSES
from .pretrain import (RUN_TOKENS_PER_STEP, STEPS, Plan, kept_count, pretrain_config, pretraining_seconds,
                       prepare_corpus, saved_step_count)
from .survey import CORPUS_RECORD, DECONTAMINATE, Quickstart, corpus_path, prepared_meta, sized_split

BASE_OF = {"python": "python-stdlib", "go": "go"}
BASE_SHARE = 0.75  # of the pretraining time (or --max-iters) the base takes; the repository stage the rest
REPO_STAGE = {"learning_rate": 0.004, "muon_lr": 0.006, "warmup_steps": 10}
BYTES_PER_TOKEN = 3.5  # code per token of the quickstart's 8k tokenizer (3.8 on the Python standard library)


def choose_base(base: str, src: str, langs: list[str] | None, lang: str | None, out_dir: Path, trained: bool,
                val_fraction: float) -> tuple[str, list[str] | None] | None:
    """(path, languages) of the base corpus a repository trains on first, or None. base: "auto" (a small
    repository of a language with a built-in corpus), "none", or a corpus (python-stdlib, go, a path)."""
    if base == "none" or (langs and base == "auto"):  # a built-in corpus is its own base
        return None
    if (out_dir / "base" / "run" / rundir.CHECKPOINTS).exists():  # the base this directory trained
        rec = base_record(out_dir)  # its corpus need not be there any more: its data is prepared
        return (rec["corpus"], rec.get("languages")) if rec else corpus_path(BASE_OF.get(lang or "", base))
    if trained:  # a run that trained on the repository alone goes on alone
        return None
    if base != "auto":
        return corpus_path(base)
    if lang not in BASE_OF:
        return None
    code = sum(d.nbytes for d in iter_documents([src], CorpusOptions(languages=langs, exclude_tests=True),
                                                CorpusStats())
               if EXT_TO_LANG.get(Path(d.source).suffix) != "text")
    tokens = code * (1 - val_fraction) / BYTES_PER_TOKEN
    if tokens * MANY_PASSES >= STEPS * RUN_TOKENS_PER_STEP:
        return None
    try:
        found = corpus_path(BASE_OF[lang])
    except FileNotFoundError as e:
        print(f"      note: a base of {lang} code would help this small repository, but {e}")
        return None
    if (os.path.realpath(src) + os.sep).startswith(os.path.realpath(found[0]) + os.sep):
        # the base would train on the repository's own validation files
        print(f"      note: {src} is inside {found[0]}, so no base on it: your validation files would be in "
              f"it")
        return None
    return found


def base_record(out_dir: Path) -> dict | None:
    """OUT/base's record: the base corpus and the seconds the base has trained over every invocation."""
    try:
        rec = json.loads((out_dir / "base" / CORPUS_RECORD).read_text())
        return rec if isinstance(rec, dict) and isinstance(rec.get("corpus"), str) else None
    except (OSError, ValueError):
        return None


def train_base(q: Quickstart) -> dict | None:
    """Prepare the base corpus (OUT/base/data) and train the base (OUT/base/run) for BASE_SHARE of the time or
    of --max-iters; a re-run resumes it where it stopped. Once the repository's run has trained from it, it
    is left as it is: training it further would change nothing that run started from."""
    bdir = q.out_dir / "base"
    src, langs = q.base
    b_run = bdir / "run"
    if q.trained:
        print(f"{q.head} base: done ({b_run}); your files' run goes on from where it is")
        q.base_run = b_run
        return None
    b_trained = (b_run / rundir.CHECKPOINTS).exists()
    bdir.mkdir(parents=True, exist_ok=True)
    # the seconds the base has trained so far, over every invocation: a stopped and resumed base keeps to its
    # share of the time, and the repository stage gets the rest
    before = float((base_record(q.out_dir) or {}).get("seconds", 0.0)) if b_trained else 0.0

    def record(seconds: float) -> None:
        (bdir / CORPUS_RECORD).write_text(json.dumps({"corpus": src, "languages": langs, "seconds": seconds}))
    record(before)
    old = prepared_meta(bdir / "data")
    kept = old["options"] if b_trained and old else None  # a base that has trained keeps its data's options
    opts = CorpusOptions(languages=langs, exclude_tests=True,
                         val_fraction=kept["val_fraction"] if kept else sized_split(src, langs, None),
                         decontaminate=kept.get("decontaminate", []) if kept else list(DECONTAMINATE),
                         redact_secrets=bool(kept.get("redact_secrets")) if kept else True)
    meta = prepare_corpus(bdir, src, q.tok_dir, opts, keep=b_trained,
                          repo_fim=kept.get("repo_fim", 0.0) if kept else q.repo_fim)
    chosen = saved_step_count(b_run) if b_trained else None  # the count an earlier time budget chose
    if q.opts.max_iters:
        steps, budget = max(1, round(BASE_SHARE * q.opts.max_iters)), 0.0
    elif chosen:
        steps, budget = chosen, 0.0
    else:  # a first run, or one stopped before its pace chose a count: what is left of its share
        steps, budget = STEPS, max(60.0, BASE_SHARE * pretraining_seconds(q) - before)
    cfg = pretrain_config(bdir / "data", b_run, meta, steps, budget, q.opts.device)
    plan = f"as many of {steps} steps as fit in {budget / 60:.3g} minutes" if budget else f"{steps} steps"
    print(f"{q.head} base: {meta['documents']} files of {src} -> {meta['splits']['train']['tokens']:,} "
          f"training tokens; {plan} -> {b_run}")
    t0 = time.perf_counter()
    result = run_stage(cfg, resume=b_trained)
    q.base_seconds = before + time.perf_counter() - t0
    record(q.base_seconds)
    if result["interrupted"]:
        return {"interrupted": True, "step": 0}
    q.base_run = b_run
    return None


def from_base(q: Quickstart) -> Plan:
    """The repository stage after the base: what is left of the time (or of --max-iters), for at most
    MANY_PASSES passes over the repository's training files, from the base's best weights at REPO_STAGE's
    rates; a re-run keeps the count its first run chose."""
    over = {**{f"train.{k}": v for k, v in REPO_STAGE.items()}, "train.init_from": str(q.base_run)}
    kept, pinned = kept_count(q), q.opts.max_iters
    if kept:
        return Plan(kept, over=over, kept=True)
    if pinned:  # a pinned count is the two stages' total
        return Plan(max(1, pinned - round(BASE_SHARE * pinned)), over=over)
    steps = max(1, math.ceil(MANY_PASSES * q.meta["splits"]["train"]["tokens"] / RUN_TOKENS_PER_STEP))
    return Plan(steps, max(60.0, pretraining_seconds(q) - q.base_seconds), over)


def said_from_base(q: Quickstart, cfg: RunConfig) -> tuple[RunConfig, list[str]]:
    return cfg, [f"from the base's best weights ({q.base_run}), at learning rate "
                 f"{cfg.train.learning_rate:g}, at most {MANY_PASSES} passes over your training files"]
