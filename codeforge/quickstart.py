"""`codeforge quickstart`: the whole pipeline on a corpus the machine already has, in about ten CPU minutes.

tokenizer -> prepare -> train -> eval -> sample, each stage writing under OUT/ so any of them can be re-run
alone with the regular commands. Re-running the quickstart reuses what is already there (the tokenizer,
identical shards) and resumes the training run.
"""

from __future__ import annotations

import glob
import json
import math
import os
import shutil
import sysconfig
import time
from dataclasses import replace
from pathlib import Path

from . import rundir
from .checkpoint import find_checkpoint, load_model
from .config import ConfigError, load_file, resolve
from .corpus import (EXT_TO_LANG, CorpusOptions, CorpusStats, describe_secrets, describe_skipped,
                     iter_documents, sized_val_fraction, walk_tree)
from .data.hrm_batches import PlanData
from .data.shards import ShardError, prepare
from .device import choose_device
from .engine import Engine, SamplingParams
from .evaluation.lm import EvalError
from .evaluation.repo import run_repo_eval
from .evaluation.run import run_eval
from .evaluation.tool_calls import chat_end_rate, tool_calling_eval
from .mining.plans import write_plans
from .mining.sft import write_sft
from .open_model import estimate_first, has_fim, imported_model, tune_settings
from .sandbox import SandboxUnavailable, check_available
from .stages import run as run_stage
from .stages.local import resolve_auto
from .stages.lm import MANY_PASSES
from .tasks.tool_calls import TOOLS as TOOL_SCHEMAS, TOOLS_FILE, write_tool_data, write_tools_file
from .tokenizer import CodeTokenizer, train_tokenizer

# The recipe is two presets: the `cpu-small` model (3.4M parameters at this vocabulary) and the `lowend-cpu`
# training profile (Muon, batch 16 x 256 tokens, learning rates for a run this short), chosen for held-out
# bits per byte at equal CPU seconds (benchmarks/quality_per_minute.py; docs/LOG.md, 2026-11-23). On 2 cores
# with native bfloat16, 560 steps of 4,096 tokens take about 7.3 minutes (~5,200 tokens/s).
MODEL_PRESET = "cpu-small"
PRESETS = [MODEL_PRESET, "lowend-cpu"]
STEPS = 560
TIME_BUDGET = 8.0  # minutes of pretraining by default: 560 steps fit on a CPU with native bfloat16 (~7.3 min)
RUN = {"eval_every": 100, "eval_tokens": 32_768, "save_every": 200, "log_every": 10}
VOCAB = 8192
# repo-level fill-in-the-middle: this share of the training files also becomes a document in the layout
# llama-server's /infill builds from an editor's request (prepare --repo-fim).
# benchmarks/fim_mix.py, 2 seeds x
# 3 held-out libraries (docs/LOG.md, 2026-11-27, eleventh session): edit
# similarity with other files as context
# 0.219 (file-level FIM alone) / 0.236 (0.25) / 0.211 (0.5), parseable fills 13% / 17% / 16%, held-out bits
# per byte +1.2% for either share
REPO_FIM = 0.25
# --chat: a context that holds a tool-calling conversation (up to ~600 tokens with five tool schemas; at 512,
# 347 of 1,500 were dropped), ~2,300 tokens per step. Then SFT and tools start from
# it at learning rates for a 5M
# model (the seeds' 5e-5 and 3e-6 are for 100M+ models). Fewer pretraining steps
# than the plain quickstart's 560
# buy the tools stage 400 steps (200 first), at 3e-3 (1e-3 reached a higher
# validation loss at equal steps), with
# evaluations of 32k tokens (the whole validation split, ~120k tokens, four times a stage, cost ~a minute);
# docs/LOG.md, 2026-11-25.
CHAT_MODEL = {"block_size": 768}
CHAT_TRAIN = {"batch_size": 3}
CHAT_STEPS = 400
TOOL_EXAMPLES = 3000  # synthetic tool-calling conversations for training (and 100 held out)
TOOL_CASES = 50  # held-out cases the tool-calling scores are measured on
SFT = {"learning_rate": 1e-3, "warmup_steps": 10, "max_iters": 150, "eval_every": 75, "save_every": 75,
       "eval_tokens": 32_768, "batch_size": 3}
TOOLS = {"learning_rate": 3e-3, "warmup_steps": 10, "max_iters": 400, "eval_every": 200, "save_every": 200,
         "eval_tokens": 32_768, "batch_size": 3}


def corpus_path(corpus: str) -> tuple[str, list[str]]:
    """(path, languages) of a named corpus or a user path."""
    if corpus == "python-stdlib":
        return sysconfig.get_paths()["stdlib"], ["python"]
    if corpus == "go":
        roots = sorted(glob.glob("/usr/share/go-*/src") + glob.glob("/usr/lib/go-*/src")
                       + glob.glob("/usr/local/go/src"))
        if shutil.which("go"):
            import subprocess
            root = subprocess.run(["go", "env", "GOROOT"], capture_output=True, text=True).stdout.strip()
            if root and os.path.isdir(os.path.join(root, "src")):
                roots.append(os.path.join(root, "src"))
        if not roots:
            raise FileNotFoundError("no Go standard library source found: install it with "
                                    "`sudo apt-get install golang-src` "
                                    "(Debian/Ubuntu) or from go.dev, then rerun")
        return roots[-1], ["go"]
    if not os.path.exists(corpus):
        raise FileNotFoundError(f"--corpus {corpus!r}: not python-stdlib, go, or an existing path")
    return corpus, None


def corpus_languages(src: str, langs: list[str] | None) -> dict[str, int]:
    """Files per known language in a corpus, most first (a named corpus: its own
    language alone, uncounted)."""
    if langs:
        return {lang: 0 for lang in langs}
    counts: dict[str, int] = {}
    paths = [Path(src)] if os.path.isfile(src) else (Path(r) / f for r, _, fs in walk_tree(src) for f in fs)
    for i, f in enumerate(paths):
        if i >= 200_000:
            break
        lang = EXT_TO_LANG.get(f.suffix)
        if lang:
            counts[lang] = counts.get(lang, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def corpus_language(counts: dict[str, int]) -> str | None:
    """The corpus's language for prompts, benchmarks and hints (counts: corpus_languages'): the one most files
    are in when it is one the prompts know (python or go), else None."""
    best = next(iter(counts), None)
    return best if best in ("python", "go") else None


def describe_corpus(counts: dict[str, int], langs: list[str] | None) -> str:
    """The corpus line's parenthesis: what will be read, in the words of what is there."""
    if langs:
        return f"{', '.join(langs)}, test files excluded"
    if not counts:
        return "no file of a known language found"
    found = ", ".join(f"{n:,} {lang}" for lang, n in list(counts.items())[:4]) + (
        " ..." if len(counts) > 4 else ""
    )
    return f"{found} file(s) by extension, test files excluded"


CORPUS_RECORD = "quickstart.json"  # in --out: the corpus the quickstart there was made from


def same_corpus(out_dir: Path, src: str, langs: list[str] | None) -> None:
    """Refuse a corpus other than the one --out was made from (its tokenizer,
    shards and run would be mixed with
    the new corpus's, and the old run's data overwritten); record the corpus on first use. A directory made
    before the record is judged by the sources its shards name."""
    record = out_dir / CORPUS_RECORD
    now = {"corpus": os.path.realpath(src), "languages": langs}
    try:
        was = json.loads(record.read_text())
        seen = [was["corpus"]] if was != now else None
    except FileNotFoundError:
        try:
            sources = json.loads((out_dir / "data" / "meta.json").read_text())["sources"]
            seen = sources if [os.path.realpath(x) for x in sources] != [now["corpus"]] else None
        except (OSError, ValueError, KeyError, TypeError):
            seen = None
    except (OSError, ValueError, KeyError, TypeError):
        seen = [f"an unreadable {record}"]
    if seen:
        raise ConfigError(f"{out_dir} holds a quickstart made from "
                          f"{', '.join(map(str, seen))}, not {now['corpus']}; "
                          f"give this corpus its own directory with --out (e.g. --out {out_dir}-new), or "
                          f"delete {out_dir} to start over there")
    if not record.exists():
        out_dir.mkdir(parents=True, exist_ok=True)
        record.write_text(json.dumps(now) + "\n")


# A small repository (the default run would pass over its training files more than MANY_PASSES times, and
# learn them by heart) first trains a base on a public corpus of its language, then goes on on the repository
# from the base's best weights, at a lower learning rate, for at most MANY_PASSES passes; the tokenizer is
# trained on both, the repository's files weighted REPO_TOKENIZER_WEIGHT times, so its identifiers stay whole
# (docs/LOG.md, 2026-11-27, eleventh session: held-out bits per byte -9% and -14% on
# two libraries at equal steps).
BASE_OF = {"python": "python-stdlib", "go": "go"}
RUN_TOKENS_PER_STEP = 16 * 256  # the quickstart recipe's batch x context (cpu-small + lowend-cpu; tested)
BASE_SHARE = 0.75  # of the pretraining time (or --max-iters) the base takes; the repository stage the rest
REPO_STAGE = {"learning_rate": 0.004, "muon_lr": 0.006, "warmup_steps": 10}
REPO_TOKENIZER_WEIGHT = 4
BYTES_PER_TOKEN = 3.5  # code per token of the quickstart's 8k tokenizer (3.8 on the Python standard library)
DECONTAMINATE = ("humaneval",)  # benchmark sources no training document may overlap (decontam.py)
# the least share of files kept for validation; a small corpus gets more (corpus.sized_val_fraction)
QUICK_VAL = 0.02


def _prepared_meta(data_dir: Path) -> dict | None:
    try:
        meta = json.loads((data_dir / "meta.json").read_text())
        return meta if isinstance(meta.get("options"), dict) and "val_fraction" in meta["options"] else None
    except (OSError, ValueError, AttributeError):
        return None


def _sized_split(src: str, langs: list[str] | None, val_fraction: float | None) -> float:
    """The share of files kept for validation: val_fraction when given, else QUICK_VAL, or more where that
    leaves a validation split too small to score on. Stops here, at step 1, when the corpus holds no code."""
    stats = CorpusStats()
    docs, code = [], 0
    for d in iter_documents([src], CorpusOptions(languages=langs, exclude_tests=True), stats):
        docs.append((d.digest, d.nbytes))
        code += d.nbytes if EXT_TO_LANG.get(Path(d.source).suffix) != "text" else 0  # README.md is not code
    if not code:
        raise ConfigError(f"no code found in {src}: the quickstart reads source files by extension (.py, "
                          f".go, .rs, .js, ...; test files left out) and found none it could use (skipped: "
                          f"{describe_skipped(stats.skipped)}). Point --corpus at a directory of source code")
    return val_fraction if val_fraction is not None else sized_val_fraction(docs, QUICK_VAL)


def eval_cadence(cfg, train_tokens: int) -> int:
    """Evaluations every RUN's 100 steps; on a corpus the run passes over many times (a small repository,
    which it starts to memorise within a few passes), every two passes (at least every 20 steps), so the best
    weights are found near where validation turns up rather than up to 100 steps past it."""
    t = cfg.train
    per_pass = max(train_tokens, 1) / (t.batch_size * max(t.local_ranks, 1) * cfg.model.block_size)
    if t.max_iters <= MANY_PASSES * per_pass:
        return t.eval_every
    return max(20, min(t.eval_every, int(round(2 * per_pass / 10)) * 10))


def _enough(meta: dict, cfg, src: str) -> None:
    """Stop before training when the training split cannot fill one step, in the quickstart's words (the
    trainer's own message names flags the quickstart does not have)."""
    need = cfg.train.batch_size * cfg.train.local_ranks * (cfg.model.block_size + 1)
    have = meta["splits"]["train"]["tokens"]
    if have < need:
        raise ConfigError(f"{src} gives {have:,} training tokens, fewer than one training step reads "
                          f"({need:,}): too little code to train on. Point --corpus at a larger directory")


def _same_split(out_dir: Path, old: dict, opts: CorpusOptions) -> None:
    """Refuse to prepare the data of a run that has trained on it with other options (another --val-fraction
    would move documents it trained on into validation, and every later score would flatter it)."""
    want = opts.to_dict()
    diff = [f"{k.replace('_', '-')} {old['options'].get(k)!r} -> {v!r}" for k, v in want.items()
            if old["options"].get(k) != v]
    if diff:
        raise ConfigError(f"{out_dir / 'run'} trained on data prepared with other settings "
                          f"({'; '.join(diff)}); "
                          f"preparing it again would move files between its training and validation splits, "
                          f"so later scores could count files it trained on. Give the new "
                          f"settings their own directory (--out {out_dir}-new), or drop --val-fraction to go "
                          f"on with this run (nothing was changed)")


def pretrain_config(data_dir: Path, run_dir: Path, meta: dict, steps: int, budget: float, device: str,
                    chat: bool = False, over: dict | None = None):
    """The quickstart's pretraining config: the presets, RUN's cadence, steps (or as many as fit in budget
    seconds, when budget > 0), evaluations every two passes on a small corpus."""
    train = {**RUN, **(CHAT_TRAIN if chat else {}), **({"local_ranks": 1} if chat else {})}
    flags = {**{f"model.{k}": v for k, v in (CHAT_MODEL if chat else {}).items()},
             **{f"train.{k}": v for k, v in train.items()},
             "train.data": str(data_dir), "train.out": str(run_dir), "train.max_iters": steps,
             "train.device": device, **(over or {})}
    if budget:
        flags["train.time_budget"] = budget  # the step count follows this CPU's pace (docs/pipeline.md)
    # going on from a base: the model is the base's (the model preset would override its vocabulary), the
    # recipe still the hardware profile's
    presets = [p for p in PRESETS if p != MODEL_PRESET] if "train.init_from" in flags else PRESETS
    cfg = resolve(presets, None, [], flags, vocab_from_data=True)
    cfg = replace(cfg,
                  train=replace(cfg.train, eval_every=eval_cadence(cfg, meta["splits"]["train"]["tokens"])))
    # the same global batch over one-thread processes: they keep their pace on shared cores
    cfg = resolve_auto(cfg)
    return cfg


def base_stage(out_dir: Path, base: tuple[str, list[str]], tok_dir: Path, repo_fim: float,
               max_iters: int | None,
               total: float, device: str, n: int, done: bool) -> tuple[Path | None, float]:
    """Step 4 of a small repository's quickstart: prepare the base corpus (OUT/base/data) and train the base
    (OUT/base/run) for BASE_SHARE of the time or of --max-iters; a re-run resumes it where it stopped. done:
    the repository stage has trained from it, so it is left as it is (nothing prepared or trained: training
    it further would change nothing the repository run started from). (the base run, or None when
    interrupted; seconds it has trained, over every invocation)."""
    bdir = out_dir / "base"
    src, langs = base
    b_run = bdir / "run"
    if done:
        print(f"[4/{n}] base: done ({b_run}); your files' run goes on from where it is")
        return b_run, 0.0
    b_trained = (b_run / rundir.CHECKPOINTS).exists()
    bdir.mkdir(parents=True, exist_ok=True)
    # the seconds the base has trained so far, over every invocation: a stopped and resumed base keeps to its
    # share of the time, and the repository stage gets the rest
    before = float((_base_record(out_dir) or {}).get("seconds", 0.0)) if b_trained else 0.0

    def record(seconds: float) -> None:
        (bdir / CORPUS_RECORD).write_text(json.dumps({"corpus": src, "languages": langs, "seconds": seconds}))
    record(before)
    old = _prepared_meta(bdir / "data")
    opts = CorpusOptions(languages=langs, exclude_tests=True, val_fraction=old["options"]["val_fraction"]
                         if b_trained and old else _sized_split(src, langs, None),
                         decontaminate=old["options"].get("decontaminate", []) if b_trained and old
                         else list(DECONTAMINATE),
                         redact_secrets=bool(old["options"].get("redact_secrets")) if b_trained and old
                         else True)
    meta = _prepare(bdir, src, tok_dir, opts, keep=b_trained,
                    repo_fim=old["options"].get("repo_fim", 0.0) if b_trained and old else repo_fim)
    chosen = saved_step_count(b_run) if b_trained else None  # the count an earlier time budget chose
    if max_iters:
        steps, budget = max(1, round(BASE_SHARE * max_iters)), 0.0
    elif chosen:
        steps, budget = chosen, 0.0
    else:  # first run, or one stopped before its pace chose a count: what is left of its share
        steps, budget = STEPS, max(60.0, BASE_SHARE * total - before)
    cfg = pretrain_config(bdir / "data", b_run, meta, steps, budget, device)
    print(f"[4/{n}] base: {meta['documents']} files of {src} -> "
          f"{meta['splits']['train']['tokens']:,} training tokens; "
          + (f"as many of {steps} steps as fit in {budget / 60:.3g} minutes" if budget else f"{steps} steps")
          + f" -> {b_run}")
    t0 = time.perf_counter()
    result = run_stage(cfg, resume=b_trained)
    used = before + time.perf_counter() - t0
    record(used)
    return (None if result["interrupted"] else b_run), used


def _has_repo_tokens(tok_dir: Path) -> bool:
    special = CodeTokenizer.load(tok_dir).special_ids
    return all(special.get(t) is not None for t in ("<|repo_name|>", "<|file_sep|>"))


def _prepare(out_dir: Path, src: str, tok_dir: Path, opts: CorpusOptions, keep: bool,
             repo_fim: float = 0.0) -> dict:
    """The shards (a no-op when unchanged). keep: a run has trained on OUT/data, so it is never rewritten:
    if the corpus changed since, the run goes on with the data it started on, and says so."""
    data_dir = out_dir / "data"
    try:
        return prepare([src], tok_dir, data_dir, opts, overwrite=not keep, repo_fim=repo_fim,
                       log=lambda m: print(f"      {m}") if m.startswith("warning") else None)
    except ShardError:
        if not keep or not (data_dir / "meta.json").exists():
            raise
    print(f"      note: files in {src} changed since {data_dir} "
          f"was prepared; the run in {out_dir / 'run'} goes on "
          f"with the data it started on, so its scores stay on files it never trained on. To train on the "
          f"changed files, give them a new run (--out {out_dir}-new) or delete {out_dir}")
    return json.loads((data_dir / "meta.json").read_text())


def saved_step_count(run_dir: Path) -> int | None:
    """The step count a run saved once its time budget chose it (config.toml's train.max_iters with the
    budget spent), or None where the run has not chosen one yet (or its config cannot be read)."""
    try:  # load_file: the same checks --resume applies to a saved config (type, range, a regular file)
        saved = load_file(run_dir / rundir.CONFIG).get("train", {})
    except (OSError, ValueError):
        return None
    steps = saved.get("max_iters")
    return steps if isinstance(steps, int) and steps > 0 and not saved.get("time_budget") else None


def run_quickstart(out: str, corpus: str = "python-stdlib", max_iters: int | None = None,
                   device: str = "auto", chat: bool = False, hrm: bool = False,
                   val_fraction: float | None = None,
                   time_budget: float | None = None, base_dir: str | None = None, base: str = "auto",
                   from_hf: str | None = None, lora_rank: int = 0) -> dict:
    """The pipeline; with chat, then chat SFT on pairs mined from the same corpus, then tool calling; with
    hrm, the hierarchical planner/generator model on plans mined from the corpus instead. time_budget:
    minutes pretraining may take (None: TIME_BUDGET; it sets the step count from the measured pace, up to
    STEPS); max_iters pins the steps instead. base_dir: with chat, the plain quickstart's directory for the
    same corpus, whose tokenizer and shards are reused when it has them. base: a
    small repository's base corpus
    ("auto": the built-in corpus of its language; "none"; or python-stdlib, go, a path): choose_base.
    from_hf: an open model's Hugging Face directory, imported and fine-tuned on the corpus with its own
    tokenizer (lora_rank > 0: LoRA adapters of that rank; 0: every weight) instead of a model from scratch."""
    t_start = time.perf_counter()
    out_dir = Path(out)
    src, langs = corpus_path(corpus)
    same_corpus(out_dir, src, langs)
    counts = corpus_languages(src, langs)  # one walk of the tree for the language and the corpus line
    lang = corpus_language(counts)
    data_dir, run_dir = out_dir / "data", out_dir / "run"
    trained = (run_dir / rundir.CHECKPOINTS).exists()
    if chat and not trained:
        _from_plain(out_dir, Path(base_dir) if base_dir else None, src, langs)
    old = _prepared_meta(data_dir)
    if trained and not old and not hrm:
        raise ConfigError(f"{data_dir}, the data {run_dir} trained on, is "
                          "gone (or unreadable): preparing it again could "
                          f"split the files differently and score the run on files it trained on. Restore "
                          "it, give a new run its own directory (--out "
                          f"{out_dir}-new), or delete {out_dir} to start over")
    if val_fraction is None and trained and old:
        val_fraction = old["options"]["val_fraction"]  # the split the run trained on
    elif not trained or val_fraction is None:
        try:
            val_fraction = _sized_split(src, langs, val_fraction)
        except ConfigError:  # no code: said at step 1, after the line that says what was read
            print(f"[1/{8 if chat else 5}] corpus: {src} ({describe_corpus(counts, langs)})")
            raise
    # benchmarks out (decontam.py): HumanEval, which the quickstart scores; a run that has trained keeps the
    # options its data was prepared with
    decon = old["options"].get("decontaminate", []) if trained and old else list(DECONTAMINATE)
    # secrets out (redact.py)
    redact = bool(old["options"].get("redact_secrets")) if trained and old else True
    opts = CorpusOptions(languages=langs, exclude_tests=True, val_fraction=val_fraction, decontaminate=decon,
                         redact_secrets=redact)
    if trained and old and not hrm:
        _same_split(out_dir, old, opts)
    if from_hf and (chat or hrm):
        raise ConfigError("--from-hf fine-tunes an open model on your "
                          "code; --chat and --hrm train codeforge's own")
    base_corpus = None if chat or hrm or from_hf else choose_base(base, corpus, src, langs, lang, out_dir,
                                                                  trained, val_fraction)
    n = 8 if chat else 6 if base_corpus else 5  # the steps it announces: the chat stages are 5-8
    print(f"[1/{n}] corpus: {src} ({describe_corpus(counts, langs)})")
    if base_corpus:
        print(f"      a small repository: a base model trains on {base_corpus[0]} first, then goes on on "
              f"your files (--base none: your files alone)")
    imported = imported_model(out_dir, from_hf) if from_hf else None
    tok_dir = _tokenizer(out_dir, src, opts, n, base=base_corpus)
    if hrm:
        return hrm_quickstart(out_dir, src, langs, tok_dir, max_iters, device, t_start)

    # a run that has trained keeps the documents it trained on (data prepared before repo-level FIM had none)
    repo_fim = old["options"].get("repo_fim", 0.0) if trained and old else REPO_FIM
    if repo_fim and not _has_repo_tokens(tok_dir):
        print(f"      note: {from_hf}'s tokenizer has no repository tokens, so no repo-level "
              "fill-in-the-middle" if imported else
              f"      note: {tok_dir} was trained before <|repo_name|> and <|file_sep|> existed, so no "
              f"repo-level fill-in-the-middle; delete it (and {data_dir}) to train a tokenizer that has them")
        repo_fim = 0.0
    meta = _prepare(out_dir, src, tok_dir, opts, keep=trained, repo_fim=repo_fim)
    val = meta["splits"]["val"]
    reused = "reusing " if old and meta.get("fingerprint") == old.get("fingerprint") else ""
    print(f"[3/{n}] prepare: {reused}{meta['documents']} files -> {meta['tokens']:,} tokens "
          f"(train {meta['splits']['train']['tokens']:,}; validation {val['documents']} file(s), "
          f"{val['tokens']:,} tokens: --val-fraction {opts.val_fraction:g}); -> {data_dir}\n"
          f"      skipped: {describe_skipped(meta['skipped'])}"
          + (f"\n      secrets replaced: {describe_secrets(meta['secrets_replaced'])}"
             if meta.get("secrets_replaced") else ""))

    resume = trained
    kept = (
        saved_step_count(run_dir)
        if resume and not chat and max_iters is None and time_budget is None
        else None
    )
    total = 60 * (time_budget if time_budget is not None else TIME_BUDGET)  # seconds of pretraining
    over: dict = {}
    if base_corpus:  # the base first; the repository stage gets the rest, for at most MANY_PASSES passes
        base_run, used = base_stage(out_dir, base_corpus, tok_dir, repo_fim, max_iters, total, device, n,
                                    trained)
        if base_run is None:
            print(f"interrupted; {RESUME}")
            return {"interrupted": True, "step": 0}
        if kept:  # a re-run keeps the count the first run chose
            steps, budget = kept, 0.0
        elif max_iters:  # a pinned count is the two stages' total
            steps, budget = max(1, max_iters - round(BASE_SHARE * max_iters)), 0.0
        else:
            steps = max(1, math.ceil(MANY_PASSES * meta["splits"]["train"]["tokens"] / RUN_TOKENS_PER_STEP))
            budget = max(60.0, total - used)
        over = {**{f"train.{k}": v for k, v in REPO_STAGE.items()}, "train.init_from": str(base_run)}
    elif imported:  # an open model on your code: as many passes as fit, at most MANY_PASSES (STEPS at most)
        passes_fit, over = tune_settings(imported, lora_rank, meta["splits"]["train"]["tokens"],
                                         RUN_TOKENS_PER_STEP, STEPS, MANY_PASSES)
        steps = max_iters or kept or passes_fit
        budget = 0.0 if max_iters or kept else total
    else:
        steps = max_iters or kept or (CHAT_STEPS if chat else STEPS)  # a re-run keeps the count it chose
        budget = 0.0 if max_iters or kept or chat else total
    # precision and processes come from the lowend-cpu profile (`fastest`: bf16 where the CPU multiplies it
    # natively; local_ranks 0: one process per core, up to 4): the same recipe as `train --preset cpu-small
    # lowend-cpu`. --chat trains in one process (its batch of 3 does not split).
    cfg = pretrain_config(data_dir, run_dir, meta, steps, budget, device, chat, over)
    said: list[str] = []
    if imported:  # an open model (0.5B+ parameters): its time and memory, said before the long part
        cfg, said = estimate_first(cfg, run_dir, resume)
    _enough(meta, cfg, src)
    step_no = 5 if base_corpus else 4
    on = " on your files" if base_corpus or imported else ""
    print(f"[{step_no}/{n}] train{on}: {cfg.train.max_iters} steps"
          + (" (the count this run chose; --max-iters N "
          "trains on to N)" if kept else "") + f" -> {run_dir}" if not cfg.train.time_budget else
          f"[{step_no}/{n}] train{on}: as many of {cfg.train.max_iters} steps as fit in "
          f"{cfg.train.time_budget / 60:.3g} minutes on this CPU (--max-iters N pins the count) -> {run_dir}")
    if base_corpus:
        print(f"      from the base's best weights ({base_run}), at learning rate "
              f"{cfg.train.learning_rate:g}, at most {MANY_PASSES} passes over your training files")
    for line in said:
        print(f"      {line}")
    if imported:
        print(f"      from {imported}, "
              + (f"LoRA adapters of rank {lora_rank}" if lora_rank else "every weight")
              + f", AdamW at learning rate {cfg.train.learning_rate:g}, batch {cfg.train.batch_size} x "
              f"{cfg.model.block_size} tokens")
    if cfg.train.fim_rate and not chat:
        print("      fill-in-the-middle, as editors ask for completions: "
              f"{cfg.train.fim_rate:.0%} of the documents are "
              f"cut in three and trained middle-last ({cfg.train.fim_spm_rate:.0%} of those suffix first)")
    if meta.get("repo_fim_documents"):
        print(f"      and {meta['repo_fim_documents']:,} repo-level "
              f"ones ({meta['options']['repo_fim']:.0%} of the training "
              f"files, each after up to two files of its directory, as llama-server's /infill lays out an "
              f"editor's request with other files)")
    result = run_stage(cfg, resume=resume)
    if result["interrupted"]:
        print(f"interrupted; {RESUME}")
        return result

    if chat:
        return {**result, **chat_stages(out_dir, src, langs, run_dir, device, t_start)}
    print(f"[{n}/{n}] eval and sample (the validation loss is training's; syntax and HumanEval are new)")
    he, he_skip = 0, ""
    if lang != "python":
        he_skip = f"its problems are Python, and this corpus is {lang or 'in another language'}"
        print(f"      HumanEval skipped: {he_skip}")
    else:
        try:
            check_available()
            he = 5
        except SandboxUnavailable as e:
            he_skip = "no sandbox: see above"
            print(f"      HumanEval skipped: {e}")
    evals = validations(run_dir)
    best = find_checkpoint(run_dir, "auto")
    best_step = int(best.name.split("_")[-1]) if best.name.startswith("step_") else None
    ev = run_eval(str(best), syntax_samples=8, humaneval=he, ks=[1, 5], samples_per_problem=5,
                  max_new_tokens=128, timeout=5.0, device=device, language=lang,
                  validation=evals.get(best_step))
    eng = Engine.from_run(str(best), device)
    prompt = {"python": "def fibonacci(n):\n", "go": "func fibonacci(n int) int {\n"}.get(lang, "")
    sample = eng.generate([prompt], SamplingParams(max_new_tokens=96, temperature=0.7, top_k=40, seed=0))[0]
    if ev.get("eval_split") == "train":
        print(f"\nthe checkpoint at step {ev['step']}; there is "
              "no validation split, so this scores the training "
              f"split, which the model has seen (a corpus of more files gives one):\ntraining-split loss "
              f"{ev['val_loss']:.3f} (perplexity {ev['perplexity']:.1f}), "
              f"{ev['bits_per_byte']:.3f} bits per byte")
    else:
        print(f"\n{scored_checkpoint(ev['step'], result['step'], evals)}:\nvalidation loss "
              f"{ev['val_loss']:.3f} "
              f"(perplexity {ev['perplexity']:.1f}), {ev['bits_per_byte']:.3f} bits per byte")
    sv = ev["syntax_valid_rate"]
    sv_text = "n/a (no function in the validation files to prompt with)" if sv is None else share(
        round(sv * ev["syntax_samples"]), ev["syntax_samples"])
    he_text = (f"HumanEval not run ({he_skip or 'no problems scored'})" if ev["pass_at_1"] is None else
               f"HumanEval pass@1 {ev['pass_at_1']:.3f}, pass@5 {ev['pass_at_k'].get('5', 0.0):.3f} "
               f"on {ev['humaneval_problems']} problems"
               + ("" if imported else " (a model this small is not expected to pass any)"))
    print(f"syntax-valid completions: {sv_text}; {he_text}")
    fim = repo_fim_score(src, best, device) if not langs else None  # your own code: as an editor asks
    print(f"sample (step {ev['step']}):\n{prompt}{sample}\n")
    hint = {"python": "def ", "go": "func "}.get(lang, "")
    print(f"finished in {(time.perf_counter() - t_start) / 60:.1f} min. Next: codeforge generate --run "
          f"{run_dir} --prompt {hint!r}   |   codeforge eval --run {run_dir}   |   tensorboard --logdir "
          f"{run_dir}/tensorboard")
    # step: training's; scored: the checkpoint's
    return {**result, **ev, "step": result["step"], "scored_step": ev["step"],
            **({"repo_eval": fim} if fim else {})}


REPO_CASES = 10  # eval --repo cases of each kind the quickstart scores on your held-out files


def repo_fim_score(src: str, best: Path, device: str) -> dict | None:
    """`eval --repo` on your held-out files (the validation split: files the run trained on are left out),
    with the other files as context, printed in a line; None (and said) when no held-out file gives a case."""
    if not has_fim(CodeTokenizer.load(best / "tokenizer", log=lambda m: None).special_ids):
        print("fill-in-the-middle on your files: not scored (the model's tokenizer has no FIM "
              "tokens)")
        return None
    try:
        r = run_repo_eval(src, run=str(best), n=REPO_CASES, device=device)
    except EvalError as e:
        print(f"fill-in-the-middle on your held-out files: not scored ({str(e).splitlines()[0]})")
        return None
    a = r["scores"]["all"]
    held = r["held_out_checked"]  # the run's record is complete: no file it trained on is among these
    print(f"fill-in-the-middle on your {'held-out ' if held else ''}files (as an editor asks, with other "
          f"files as context): {r['cases']} cases from {r['held_out_files']} files, exact "
          f"{a['exact_match']:.0%}, edit similarity {a['edit_similarity']:.3f}, {a['syntax_valid']:.0%} "
          "of filled files parse (codeforge eval --repo)")
    if not held:  # a model imported with --from-hf trained on what nobody here knows, maybe these very files
        unknown = r.get("held_out_unknown") or "what the run trained on is not known"
        print(f"      not a held-out score: {unknown} (the {r['trained_on_files']} file(s) it is known to "
              f"have trained on were left out)")
    return r


def validations(run_dir: Path) -> dict[int, dict]:
    """Training's evaluations (RUN/metrics.jsonl) by step, in run_eval's names, so the quickstart's last stage
    does not score a checkpoint training already scored on the same tokens; the last record of a step wins
    (a resumed run may have evaluated it again)."""
    out: dict[int, dict] = {}
    try:
        with open(run_dir / rundir.METRICS) as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue  # a line cut by a crash
                if (
                    isinstance(rec, dict)
                    and "val_loss" in rec
                    and "val_bpb" in rec
                    and isinstance(rec.get("step"), int)
                ):
                    out[rec["step"]] = {"val_loss": rec["val_loss"], "perplexity": rec.get("val_perplexity"),
                                        "bits_per_byte": rec["val_bpb"], "eval_tokens": rec.get("val_tokens"),
                                        "validation_step": rec["step"]}
    except OSError:
        pass
    return out


# the one way to go on after a Ctrl-C, said by training (CODEFORGE_RESUME_HINT, set by the CLI) and here
RESUME = "run the same quickstart command again to continue"
# a later evaluation this share above the best is called a rise (0.003 nats on 3.4 was said to be one)
ROSE = 0.01


def scored_checkpoint(step: int, at: int, evals: dict[int, dict]) -> str:
    """Which weights the summary scores, by step, and where the run's last evaluation stands beside them."""
    if step == at:
        return f"the checkpoint at step {step} (the run's last, and its best on validation)"
    last = max(evals) if evals else None
    tail = ""
    if last is not None and last > step:
        rise = evals[last]["val_loss"] - evals[step]["val_loss"] if step in evals else None
        tail = f"; the last evaluation, at step {last}, scored {evals[last]['val_loss']:.3f}"
        if rise is not None and rise < ROSE * evals[step]["val_loss"]:
            # within the noise of a small validation split: no sign of memorising, and not said to be one
            tail += f", {rise:.3f} above it (no real rise)"
        else:
            tail += (f": validation loss rose after step {step} (the model memorising its training files, "
                     f"when there are few)")
    return f"the best checkpoint: step {step} of the run's {at}{tail}"


def share(k: int, n: int) -> str:
    """'k of n' where n is too small for a percentage to mean much, else 'p% of n'."""
    return f"{k} of {n} parse" if n < 10 else f"{k / n:.0%} of {n}"


def _from_plain(out_dir: Path, base: Path | None, src: str, langs: list[str] | None) -> None:
    """--chat pretrains a base model of its own: its context (768 tokens) holds a tool-calling conversation,
    and the plain quickstart's model (256 tokens, learned positions) cannot be stretched to it. Said, and the
    plain quickstart's tokenizer and shards of the same corpus are copied in when they are there."""
    say = ("      --chat pretrains its own base model: tool conversations need a context of 768 tokens, and "
           "the plain quickstart's model has 256")
    same = (
        base is not None
        and base.resolve() != out_dir.resolve()
        and _corpus_of(base) == _corpus_of(out_dir, src, langs)
    )
    if not same or not (base / "tokenizer" / "tokenizer.json").exists():
        print(f"{say}.")
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    copied = []
    for part in ("tokenizer", "data"):
        if (base / part).is_dir() and not (out_dir / part).exists():
            shutil.copytree(base / part, out_dir / part, symlinks=True)
            copied.append(part)
    print(f"{say}; it reuses {base}'s {' and '.join(copied) or 'nothing (its own are there)'}.")


def _corpus_of(out_dir: Path, src: str | None = None, langs: list[str] | None = None) -> dict | None:
    """The corpus record of a quickstart directory (what same_corpus wrote), or the one src would make."""
    if src is not None:
        return {"corpus": os.path.realpath(src), "languages": langs}
    try:
        return json.loads((out_dir / CORPUS_RECORD).read_text())
    except (OSError, ValueError):
        return None


def _tokenizer(out_dir: Path, src: str, opts: CorpusOptions, n: int = 5,
               base: tuple[str, list[str]] | None = None) -> Path:
    """OUT/tokenizer, trained on the corpus (and, with a base corpus, on both: the corpus's files
    REPO_TOKENIZER_WEIGHT times over, so a small repository's own names get their merges)."""
    tok_dir = out_dir / "tokenizer"
    if (tok_dir / "tokenizer.json").exists():
        print(f"[2/{n}] tokenizer: reusing {tok_dir}")
        return tok_dir
    stats = CorpusStats()

    def texts():
        for _ in range(REPO_TOKENIZER_WEIGHT if base else 1):
            yield from (d.text for d in iter_documents([src], opts, stats))
        if base:
            yield from (d.text for d in iter_documents([base[0]],
                                                       CorpusOptions(languages=base[1], exclude_tests=True),
                                                       CorpusStats()))
    _, meta = train_tokenizer(texts(), VOCAB, tok_dir)
    both = f", your files {REPO_TOKENIZER_WEIGHT} times over and {base[0]}" if base else ""
    print(f"[2/{n}] tokenizer: vocab {meta['vocab_size']} trained on {meta['train_documents']} files{both} "
          f"({meta['train_bytes'] / 1e6:.1f} MB) in {meta['train_seconds']:.1f}s -> {tok_dir}")
    return tok_dir


def choose_base(base: str, corpus: str, src: str, langs: list[str] | None, lang: str | None, out_dir: Path,
                trained: bool, val_fraction: float) -> tuple[str, list[str]] | None:
    """(path, languages) of the base corpus a repository trains on first, or None. base: "auto" (a small
    repository of a language with a built-in corpus), "none", or a corpus (python-stdlib, go, a path)."""
    if base == "none" or (langs and base == "auto"):  # a built-in corpus is its own base
        return None
    # the base this directory trained (its corpus
    if (out_dir / "base" / "run" / rundir.CHECKPOINTS).exists():
        rec = _base_record(out_dir)  # need not be there any more: its data is prepared)
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
    inside = os.path.realpath(src) + os.sep
    if inside.startswith(os.path.realpath(found[0]) + os.sep):  # its validation files would train the base
        print(f"      note: {src} is inside {found[0]}, so no "
              "base on it: your validation files would be in it")
        return None
    return found


def _base_record(out_dir: Path) -> dict | None:
    try:
        rec = json.loads((out_dir / "base" / CORPUS_RECORD).read_text())
        return rec if isinstance(rec, dict) and isinstance(rec.get("corpus"), str) else None
    except (OSError, ValueError):
        return None


# --hrm: seed 001's hierarchical model at a CPU's size (hrm-tiny's shape at this tokenizer's 8k vocabulary);
# ~2.5 steps/s on 2 idle cores: the whole quickstart took 7.2 minutes (docs/LOG.md).
HRM_TRAIN = {"batch_size": 8, "learning_rate": 2e-3, "warmup_steps": 50, "min_lr_ratio": 0.1,
             "eval_every": 250,
             "eval_tokens": 16_384, "save_every": 250, "log_every": 25, "weight_decay": 0.1}
HRM_CASES = 16


def hrm_quickstart(out_dir: Path, src: str, langs, tok_dir: Path, max_iters: int | None, device: str,
                   t_start: float) -> dict:
    """make-plans -> train --stage hrm -> eval: the seed's metrics table, and one function planned, written
    and refined."""
    plans = out_dir / "plans"
    if (plans / "train.jsonl").exists():
        print(f"[3/5] make-plans: reusing {plans}")
    else:
        st = write_plans([src], plans, overwrite=False, languages=langs, exclude_tests=True)
        print(f"[3/5] make-plans: {st['examples']:,} functions (train {st['train']:,}, val {st['val']:,}) -> "
              f"{plans}\n      skipped: {describe_skipped(st['skipped'])}")
    run_dir = out_dir / "run"
    flags = {"train.stage": "hrm", "train.data": str(plans), "train.tokenizer": str(tok_dir),
             "train.out": str(run_dir), "train.max_iters": max_iters or 500, "train.device": device,
             **{f"train.{k}": v for k, v in HRM_TRAIN.items()}}
    cfg = resolve(["hrm-tiny"], None, [], flags, vocab_from_data=True)
    print(f"[4/5] train --stage hrm: {cfg.train.max_iters} steps -> {run_dir}")
    result = run_stage(cfg, resume=(run_dir / rundir.CHECKPOINTS).exists())
    if result["interrupted"]:
        print(f"interrupted; {RESUME}")
        return result
    print(f"[5/5] eval: teacher-forced on the held-out functions, then {HRM_CASES} of them planned, written "
          f"and refined")
    ev = run_eval(str(run_dir), device=device, hrm_cases=HRM_CASES)
    rows = [("body bits per byte (given the gold plan)", ev["bits_per_byte"]),
            ("plan accuracy (next plan word, teacher-forced)", ev.get("plan_accuracy")),
            ("code accuracy (next body token, teacher-forced)", ev.get("code_accuracy")),
            ("refinement decision accuracy", ev.get("decision_accuracy")),
            ("plan exact match (generated)", ev.get("plan_exact")),
            ("code exact match (generated)", ev.get("code_exact")),
            ("code AST node F1 (generated)", ev.get("code_ast_f1")),
            ("syntax-valid rate (generated)", ev.get("syntax_valid_rate")),
            ("average refinement iterations", ev.get("avg_iterations"))]
    print("\nthe hierarchical model's metrics, measured:")
    for name, v in rows:
        print(f"  {name:48s} {'n/a' if v is None else f'{v:.3f}'}")
    dev, _ = choose_device(device)
    model, tok, _, _ = load_model(str(run_dir), dev)
    val = PlanData(plans, "val", tok)
    rec = val.records[0] if len(val) else {"prompt": "def fibonacci(n):\n"}
    g = model.generate(tok.encode(rec["prompt"]), max_plan_tokens=48, max_code_tokens=128)
    steps = ", ".join(f"{i['decision']} (p_done {i['p_done']:.2f})" for i in g["iterations"]) or "none"
    print(f"\nheld-out prompt:\n{rec['prompt']}\n# plan: {tok.decode(g['plan'])}\n# refinement: {steps}\n"
          f"{tok.decode(g['code'])}\n")
    print(f"finished in {(time.perf_counter() - t_start) / 60:.1f} min. Next: codeforge generate --run "
          f"{run_dir} --show-plan --prompt 'def f(x):'   |   codeforge eval --run {run_dir}")
    return {**result, **ev}


def _stage(name: str, data: Path, out: Path, init_from: Path, device: str, over: dict) -> dict:
    cfg = resolve([], None, [], {"train.stage": name, "train.data": str(data), "train.out": str(out),
                                 "train.init_from": str(init_from), "train.device": device,
                                 **{f"train.{k}": v for k, v in over.items()}}, vocab_from_data=True)
    return run_stage(cfg, resume=(out / rundir.CHECKPOINTS).exists())


def chat_stages(out_dir: Path, src: str, langs, base_run: Path, device: str, t_start: float) -> dict:
    """SFT on instruction pairs mined from the corpus mixed with synthetic tool-calling conversations, then a
    tools stage on the tool conversations alone; each stage's run directory holds its tokenizer with the chat
    template. Prints what changed at each stage and how long it took."""

    tok_dir = out_dir / "tokenizer"
    pairs = out_dir / "sft_pairs"
    t = time.perf_counter()
    if not (pairs / "train.jsonl").exists():
        st = write_sft([src], pairs, languages=langs, max_examples=4000, heldout_fraction=0.05)
        print(f"[5/8] make-sft: {st['examples']} instruction pairs mined from {st['functions']} documented "
              f"functions -> {pairs}")
    tools_pairs = out_dir / "tool_pairs"
    if not (tools_pairs / "train.jsonl").exists():
        write_tool_data(tools_pairs, TOOL_EXAMPLES, 100, seed=0)
        print(f"      make-tools: {TOOL_EXAMPLES} synthetic tool-calling conversations -> {tools_pairs}")
    tools_file = tools_pairs / TOOLS_FILE
    if not tools_file.exists():  # tool data from before it was written there
        write_tools_file(tools_pairs)
    opts = CorpusOptions(val_fraction=0.05)
    # SFT sees the tool conversations too, shuffled in with the mined pairs, so tool calling trains during the
    # SFT steps as well as the tools stage's (docs/LOG.md, 2026-11-25).
    sft_data = out_dir / "sft_data"
    meta = prepare([str(pairs / "train.jsonl"), str(tools_pairs / "train.jsonl")], tok_dir, sft_data, opts,
                   overwrite=True, log=lambda m: None, chat=True)
    print(f"      prepare --chat: {meta['documents']} conversations (mined pairs and tool calls), "
          f"{meta['tokens']:,} tokens ({sum(meta['loss_tokens'].values()):,} with loss) -> {sft_data}")
    tool_data = out_dir / "tool_data"
    meta = prepare([str(tools_pairs / "train.jsonl")], tok_dir, tool_data, opts, overwrite=True,
                   log=lambda m: None, chat=True)
    print(f"      prepare --chat: {meta['documents']} tool conversations alone, {meta['tokens']:,} tokens -> "
          f"{tool_data} ({_minutes(t)})")
    heldout = [json.loads(x) for x in (pairs / "heldout.jsonl").read_text().splitlines()]

    def engine(run):
        return Engine.from_run(str(run), device)

    t = time.perf_counter()
    before = chat_end_rate(engine(base_run), heldout, n=20)
    sft_run = out_dir / "sft"
    print(f"[6/8] SFT from {base_run} -> {sft_run}")
    r_sft = _stage("sft", sft_data, sft_run, base_run, device, SFT)
    if r_sft["interrupted"]:
        print(f"interrupted; {RESUME}")
        return r_sft
    after = chat_end_rate(engine(sft_run), heldout, n=20)
    print(f"      replies ending with <|im_end|> on held-out requests: {before['im_end_rate']:.0%} before "
          f"SFT, {after['im_end_rate']:.0%} after ({after['im_end_cases']} requests) ({_minutes(t)})")

    t = time.perf_counter()
    tools_before = tool_calling_eval(engine(sft_run), TOOL_CASES, constrained=False)
    tools_run = out_dir / "tools"
    print(f"[7/8] tools from {sft_run} -> {tools_run}")
    r_tools = _stage("tools", tool_data, tools_run, sft_run, device, TOOLS)
    if r_tools["interrupted"]:
        print(f"interrupted; {RESUME}")
        return r_tools
    print(f"      ({_minutes(t)})")
    t = time.perf_counter()
    eng = engine(tools_run)
    tools_after = tool_calling_eval(eng, TOOL_CASES, constrained=False)
    tools_grammar = tool_calling_eval(eng, TOOL_CASES, constrained=True)

    def fmt(r):
        def pct(v):
            return "n/a" if v is None else f"{v:.0%}"
        cut = f", {r['tool_cut_by_budget']} cut by the token budget" if r.get("tool_cut_by_budget") else ""
        bad = f", {r['tool_unknown_names']} naming no offered tool" if r.get("tool_unknown_names") else ""
        return (f"parse {pct(r['tool_parse_rate'])}{cut}, right tool {pct(r['tool_name_accuracy'])}, exact "
                f"arguments {pct(r['tool_args_exact'])}, no call when none needed "
                f"{pct(r['no_call_accuracy'])}{bad}")

    print(f"[8/8] tool calling on {tools_after['tool_cases']} held-out cases, greedy ({_minutes(t)}):\n"
          f"      the model alone, after SFT (tool calls mixed in): {fmt(tools_before)}\n"
          f"      the model alone, after the tools stage:           {fmt(tools_after)}\n"
          f"      constrained (grammar), after the tools stage:     {fmt(tools_grammar)}")
    ask = [{"role": "user", "content": "Please read the file src/parser.py"}]
    reply = eng.chat(ask, TOOL_SCHEMAS, SamplingParams(max_new_tokens=96, temperature=0.0))
    print(f"\nchat> {ask[0]['content']}\n{reply['text']}")
    print(f"\nfinished in {(time.perf_counter() - t_start) / 60:.1f} min. Next: codeforge chat --run "
          f"{tools_run} --tools {tools_file}   |   codeforge eval --run {tools_run} --json")
    return {"sft": r_sft, "tools": r_tools, "im_end_before": before, "im_end_after": after,
            "tools_before": tools_before, "tools_after": tools_after,
            "tools_after_constrained": tools_grammar}


def _minutes(t0: float) -> str:
    return f"{(time.perf_counter() - t0) / 60:.1f} min"
