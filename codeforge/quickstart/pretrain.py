"""The stages every recipe of a language model shares: the corpus line, the tokenizer, the shards, and
pretraining (or the fine-tune of an imported model) into OUT/run, with the numbers of the recipe from scratch.

How many steps pretraining takes and with which flags is the recipe's `count` setting (a `Plan`): from
scratch here, --chat's in chat.py, a small repository's after its base in base.py, an open model's in
from_hf.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from .. import rundir
from ..config import load_file, resolve
from ..corpus import CorpusOptions, CorpusStats, describe_secrets, describe_skipped, iter_documents
from ..data.shards import ShardError, prepare
from ..fields import ConfigError
from ..stages import run as run_stage
from ..stages.lm import MANY_PASSES
from ..stages.local import resolve_auto
from ..tokenizer import CodeTokenizer, train_tokenizer
from .survey import Quickstart, describe_corpus, prepared_meta

# The recipe is two presets: the `cpu-small` model (3.4M parameters at this vocabulary) and the `lowend-cpu`
# training profile (Muon, batch 16 x 256 tokens, learning rates for a run this short), chosen for held-out
# bits per byte at equal CPU seconds (benchmarks/quality_per_minute.py;
# docs/LOG.md#2026-11-23-quality-per-minute-exploration). On 2 cores with native bfloat16, 560 steps of 4,096
# tokens take about 7.3 minutes (~5,200 tokens/s).
MODEL_PRESET = "cpu-small"
PRESETS = [MODEL_PRESET, "lowend-cpu"]
STEPS = 560
TIME_BUDGET = 8.0  # minutes of pretraining by default: 560 steps fit on a CPU with native bfloat16 (~7.3 min)
RUN = {"eval_every": 100, "eval_tokens": 32_768, "save_every": 200, "log_every": 10}
RUN_TOKENS_PER_STEP = 16 * 256  # the recipe's batch x context (cpu-small + lowend-cpu; tested)
VOCAB = 8192
# Repo-level fill-in-the-middle: this share of the training files also becomes a document in the layout
# llama-server's /infill builds from an editor's request (prepare --repo-fim). benchmarks/fim_mix.py, 2 seeds
# x 3 held-out libraries (docs/LOG.md#2026-11-27-fim-mix): edit similarity with other files as
# context 0.219 (file-level FIM alone) / 0.236 (0.25) / 0.211 (0.5), parseable fills 13% / 17% / 16%,
# held-out bits per byte +1.2% for either share.
REPO_FIM = 0.25
# With a base corpus the tokenizer reads the repository's files this many times over, so that a small
# repository's own identifiers get merges of their own and stay whole tokens (base.py).
REPO_TOKENIZER_WEIGHT = 4


@dataclass(frozen=True)
class Plan:
    """How pretraining runs: steps, or as many of them as fit in budget seconds (budget > 0); over: train
    flags over the recipe's; kept: steps is the count an earlier run's time budget chose."""

    steps: int
    budget: float = 0.0
    over: dict = field(default_factory=dict)
    kept: bool = False


def pretraining_seconds(q: Quickstart) -> float:
    return 60 * (q.opts.time_budget if q.opts.time_budget is not None else TIME_BUDGET)


def kept_count(q: Quickstart) -> int | None:
    """The step count a re-run keeps: the one its first run's time budget chose, unless this run gives a count
    or a budget of its own."""
    if not q.trained or q.opts.max_iters is not None or q.opts.time_budget is not None:
        return None
    return saved_step_count(q.run_dir)


def from_scratch(q: Quickstart) -> Plan:
    """--max-iters, or the count a first run chose, else as many of STEPS as fit in the time budget."""
    kept = kept_count(q)
    if q.opts.max_iters or kept:
        return Plan(q.opts.max_iters or kept, kept=bool(kept))
    return Plan(STEPS, pretraining_seconds(q))


def saved_step_count(run_dir: Path) -> int | None:
    """The step count a run saved once its time budget chose it (config.toml's train.max_iters with the
    budget spent), or None where the run has not chosen one yet (or its config cannot be read)."""
    try:  # load_file: the same checks --resume applies to a saved config (type, range, a regular file)
        saved = load_file(run_dir / rundir.CONFIG).get("train", {})
    except (OSError, ValueError):
        return None
    steps = saved.get("max_iters")
    return steps if isinstance(steps, int) and steps > 0 and not saved.get("time_budget") else None


def say_corpus(q: Quickstart) -> None:
    print(f"{q.head} corpus: {q.src} ({describe_corpus(q.counts, q.langs)})")
    if q.base:
        print(f"      a small repository: a base model trains on {q.base[0]} first, then goes on on your "
              f"files (--base none: your files alone)")


def make_tokenizer(q: Quickstart) -> None:
    q.tok_dir = corpus_tokenizer(q.out_dir, q.src, q.corpus, q.head, q.base)


def corpus_tokenizer(out_dir: Path, src: str, opts: CorpusOptions, head: str = "[2/5]",
                     base: tuple[str, list[str] | None] | None = None) -> Path:
    """OUT/tokenizer, trained on the corpus (with a base corpus, on both: the corpus's files
    REPO_TOKENIZER_WEIGHT times over), or reused where it is there."""
    tok_dir = out_dir / "tokenizer"
    if (tok_dir / "tokenizer.json").exists():
        print(f"{head} tokenizer: reusing {tok_dir}")
        return tok_dir
    stats = CorpusStats()

    def texts():
        for _ in range(REPO_TOKENIZER_WEIGHT if base else 1):
            yield from (d.text for d in iter_documents([src], opts, stats))
        if base:
            base_opts = CorpusOptions(languages=base[1], exclude_tests=True)
            yield from (d.text for d in iter_documents([base[0]], base_opts, CorpusStats()))
    _, meta = train_tokenizer(texts(), VOCAB, tok_dir)
    both = f", your files {REPO_TOKENIZER_WEIGHT} times over and {base[0]}" if base else ""
    print(f"{head} tokenizer: vocab {meta['vocab_size']} trained on {meta['train_documents']} files{both} "
          f"({meta['train_bytes'] / 1e6:.1f} MB) in {meta['train_seconds']:.1f}s -> {tok_dir}")
    return tok_dir


def has_repo_tokens(tok_dir: Path) -> bool:
    special = CodeTokenizer.load(tok_dir).special_ids
    return all(special.get(t) is not None for t in ("<|repo_name|>", "<|file_sep|>"))


def prepare_data(q: Quickstart, repo_fim: float) -> None:
    """OUT/data: the corpus in shards, repo_fim of its training files also as repo-level FIM documents."""
    old = prepared_meta(q.data_dir)
    if q.trained and old:  # the run keeps the documents it trained on (data from before repo FIM had none)
        repo_fim = old["options"].get("repo_fim", 0.0)
    if repo_fim and not has_repo_tokens(q.tok_dir):
        if q.imported:
            print(f"      note: {q.opts.from_hf}'s tokenizer has no repository tokens, so no repo-level "
                  f"fill-in-the-middle")
        else:
            print(f"      note: {q.tok_dir} was trained before <|repo_name|> and <|file_sep|> existed, so "
                  f"no repo-level fill-in-the-middle; delete it (and {q.data_dir}) to train a tokenizer that "
                  f"has them")
        repo_fim = 0.0
    q.repo_fim = repo_fim
    meta = q.meta = prepare_corpus(q.out_dir, q.src, q.tok_dir, q.corpus, keep=q.trained, repo_fim=repo_fim)
    val = meta["splits"]["val"]
    reused = "reusing " if old and meta.get("fingerprint") == old.get("fingerprint") else ""
    secrets = (f"\n      secrets replaced: {describe_secrets(meta['secrets_replaced'])}"
               if meta.get("secrets_replaced") else "")
    print(f"{q.head} prepare: {reused}{meta['documents']} files -> {meta['tokens']:,} tokens (train "
          f"{meta['splits']['train']['tokens']:,}; validation {val['documents']} file(s), {val['tokens']:,} "
          f"tokens: --val-fraction {q.corpus.val_fraction:g}); -> {q.data_dir}\n"
          f"      skipped: {describe_skipped(meta['skipped'])}{secrets}")


def prepare_corpus(out_dir: Path, src: str, tok_dir: Path, opts: CorpusOptions, keep: bool,
                   repo_fim: float = 0.0) -> dict:
    """OUT/data's shards (a no-op when unchanged). keep: a run has trained on OUT/data, so it is never
    rewritten: if the corpus changed since, the run goes on with the data it started on, and says so."""
    data_dir = out_dir / "data"
    try:
        return prepare([src], tok_dir, data_dir, opts, overwrite=not keep, repo_fim=repo_fim,
                       log=lambda m: print(f"      {m}") if m.startswith("warning") else None)
    except ShardError:
        if not keep or not (data_dir / "meta.json").exists():
            raise
    print(f"      note: files in {src} changed since {data_dir} was prepared; the run in {out_dir / 'run'} "
          f"goes on with the data it started on, so its scores stay on files it never trained on. To train "
          f"on the changed files, give them a new run (--out {out_dir}-new) or delete {out_dir}")
    return json.loads((data_dir / "meta.json").read_text())


def eval_cadence(cfg, train_tokens: int) -> int:
    """Evaluations every RUN's 100 steps; on a corpus the run passes over many times (a small repository,
    which it starts to memorise within a few passes), every two passes (at least every 20 steps), so the best
    weights are found near where validation turns up rather than up to 100 steps past it."""
    t = cfg.train
    per_pass = max(train_tokens, 1) / (t.batch_size * max(t.local_ranks, 1) * cfg.model.block_size)
    if t.max_iters <= MANY_PASSES * per_pass:
        return t.eval_every
    return max(20, min(t.eval_every, int(round(2 * per_pass / 10)) * 10))


def pretrain_config(data_dir: Path, run_dir: Path, meta: dict, steps: int, budget: float, device: str,
                    over: dict | None = None, model: dict | None = None, training: dict | None = None):
    """The quickstart's pretraining config: the presets, RUN's cadence (model and training: a recipe's own
    settings over them), steps (or as many as fit in budget seconds, when budget > 0), evaluations every two
    passes on a small corpus; over: train flags over all of these."""
    flags = {**{f"model.{k}": v for k, v in (model or {}).items()},
             **{f"train.{k}": v for k, v in {**RUN, **(training or {})}.items()},
             "train.data": str(data_dir), "train.out": str(run_dir), "train.max_iters": steps,
             "train.device": device, **(over or {})}
    if budget:
        flags["train.time_budget"] = budget  # the step count follows this CPU's pace (docs/pipeline.md)
    # going on from a base, the model is the base's (the model preset would override its vocabulary); the
    # recipe is still the hardware profile's
    presets = [p for p in PRESETS if p != MODEL_PRESET] if "train.init_from" in flags else PRESETS
    cfg = resolve(presets, None, [], flags, vocab_from_data=True)
    cadence = eval_cadence(cfg, meta["splits"]["train"]["tokens"])
    cfg = replace(cfg, train=replace(cfg.train, eval_every=cadence))
    # the same global batch over one-thread processes: they keep their pace on shared cores
    return resolve_auto(cfg)


def enough(meta: dict, cfg, src: str) -> None:
    """Stop before training when the training split cannot fill one step, in the quickstart's words (the
    trainer's own message names flags the quickstart does not have)."""
    need = cfg.train.batch_size * cfg.train.local_ranks * (cfg.model.block_size + 1)
    have = meta["splits"]["train"]["tokens"]
    if have < need:
        raise ConfigError(f"{src} gives {have:,} training tokens, fewer than one training step reads "
                          f"({need:,}): too little code to train on. Point --corpus at a larger directory")


def train(q: Quickstart, count: Callable[[Quickstart], Plan], fit: Callable | None = None, on: str = "",
          model: dict | None = None, training: dict | None = None, says_fim: bool = True) -> dict:
    """Pretraining on OUT/data into OUT/run, resumed where a run is there. count: the plan (steps, time
    budget, flags); fit(q, cfg): the config to train with and the lines said under the stage's own; on: what
    the stage line says it trains on; model, training: the recipe's settings over the presets; says_fim:
    the line on fill-in-the-middle (not for a model that goes on to chat)."""
    plan = count(q)
    # precision and processes come from the lowend-cpu profile (`fastest`: bf16 where the CPU multiplies it
    # natively; local_ranks 0: one process per core, up to 4): the same recipe as `train --preset cpu-small
    # lowend-cpu`
    cfg = pretrain_config(q.data_dir, q.run_dir, q.meta, plan.steps, plan.budget, q.opts.device, plan.over,
                          model, training)
    cfg, notes = fit(q, cfg) if fit else (cfg, [])
    enough(q.meta, cfg, q.src)
    t = cfg.train
    if t.time_budget:
        print(f"{q.head} train{on}: as many of {t.max_iters} steps as fit in {t.time_budget / 60:.3g} "
              f"minutes on this CPU (--max-iters N pins the count) -> {q.run_dir}")
    else:
        chose = " (the count this run chose; --max-iters N trains on to N)" if plan.kept else ""
        print(f"{q.head} train{on}: {t.max_iters} steps{chose} -> {q.run_dir}")
    for line in notes:
        print(f"      {line}")
    if t.fim_rate and says_fim:
        print(f"      fill-in-the-middle, as editors ask for completions: {t.fim_rate:.0%} of the documents "
              f"are cut in three and trained middle-last ({t.fim_spm_rate:.0%} of those suffix first)")
    if q.meta.get("repo_fim_documents"):
        print(f"      and {q.meta['repo_fim_documents']:,} repo-level ones "
              f"({q.meta['options']['repo_fim']:.0%} of the training files, each after up to two files of "
              f"its directory, as llama-server's /infill lays out an editor's request with other files)")
    return run_stage(cfg, resume=q.trained)
