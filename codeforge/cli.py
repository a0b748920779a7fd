"""The `codeforge` command: parse arguments, call the library, print. No work happens here."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from . import CodeforgeError
from . import rundir


class CLIError(CodeforgeError):
    pass


def _corpus_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input", nargs="+", required=True, metavar="PATH",
                   help="directories, .txt, .jsonl[.gz|.zst], .parquet files, or hf:NAME[:SPLIT]")
    p.add_argument("--languages", nargs="+", default=None, help="keep files of these languages (by extension)")
    p.add_argument("--text-field", default="text", help="JSONL/parquet field that holds the text")
    p.add_argument("--max-file-bytes", type=int, default=1_000_000, help="skip larger documents")
    p.add_argument("--max-line-length", type=int, default=1000, help="a longer line marks a file minified")
    p.add_argument("--exclude-tests", action="store_true", help="skip test files (_test.go, test_*.py, tests/)")
    p.add_argument("--strict", action="store_true", help="fail on a malformed input instead of skipping it")


def _corpus_opts(a: argparse.Namespace, **kw):
    from .corpus import CorpusOptions
    return CorpusOptions(languages=a.languages, text_field=a.text_field, max_file_bytes=a.max_file_bytes,
                         max_line_length=a.max_line_length, exclude_tests=a.exclude_tests, strict=a.strict, **kw)


# -- tokenizer -------------------------------------------------------------------------------------------

def cmd_tokenizer_train(a: argparse.Namespace) -> int:
    from .corpus import CorpusStats, iter_documents
    from .tokenizer import train_tokenizer
    opts = _corpus_opts(a, dedup="exact", val_fraction=0.0)
    stats = CorpusStats()
    budget = int(a.max_train_bytes) if a.max_train_bytes else None

    def texts():
        seen = 0
        for d in iter_documents(a.input, opts, stats):
            yield d.text
            seen += len(d.text)
            if budget and seen >= budget:
                return

    tok, meta = train_tokenizer(texts(), a.vocab_size, a.out, show_progress=sys.stderr.isatty(), overwrite=a.overwrite,
                                split=a.split)
    print(f"trained tokenizer: vocab {meta['vocab_size']} on {meta['train_documents']} documents "
          f"({meta['train_bytes'] / 1e6:.1f} MB) in {meta['train_seconds']:.1f}s -> {a.out} (hash {meta['hash']})")
    if stats.skipped:
        from .corpus import describe_skipped
        print(f"skipped: {describe_skipped(stats.skipped)}")
    return 0


def cmd_tokenizer_eval(a: argparse.Namespace) -> int:
    from .corpus import CorpusStats, iter_documents
    from .tokenizer import CodeTokenizer, evaluate_tokenizer
    tok = CodeTokenizer.load(a.tokenizer)
    opts = _corpus_opts(a, dedup="none", val_fraction=0.0)
    r = evaluate_tokenizer(tok, (d.text for d in iter_documents(a.input, opts, CorpusStats())))
    if a.json:
        print(json.dumps(r))
    else:
        print(f"{r['documents']} documents, {r['bytes'] / 1e6:.2f} MB, {r['tokens']} tokens: "
              f"{r['bytes_per_token']:.3f} bytes/token; round-trip "
              f"{'OK' if r['roundtrip_ok'] else 'FAILED on %d documents' % r['roundtrip_failures']}")
    return 0 if r["roundtrip_ok"] else 1


# -- data ------------------------------------------------------------------------------------------------

def cmd_prepare(a: argparse.Namespace) -> int:
    from .data.shards import prepare
    if a.workers:
        # Rust's thread pool reads this once, before the first parallel encode.
        os.environ["RAYON_NUM_THREADS"] = str(a.workers)
    opts = _corpus_opts(a, dedup=a.dedup, val_fraction=a.val_fraction)
    meta = prepare(a.input, a.tokenizer, a.out, opts, overwrite=a.overwrite, shard_tokens=a.shard_tokens,
                   chat=a.chat)
    _print_data_info(meta, a.out, sample=False)
    return 0


def _print_data_info(meta: dict, path: str, sample: bool = True) -> None:
    print(f"{path}: {meta['documents']} documents, {meta['tokens']:,} tokens, {meta['bytes'] / 1e6:.1f} MB, "
          f"dtype {meta['dtype']}, tokenizer {meta['tokenizer_hash']}")
    for s, v in meta["splits"].items():
        print(f"  {s:5s}: {v['documents']} documents, {v['tokens']:,} tokens in {len(v['shards'])} shard(s)")
    if meta.get("skipped"):
        from .corpus import describe_skipped
        print("  skipped: " + describe_skipped(meta["skipped"]))
    print(f"  prepared in {meta['seconds']}s ({meta['mb_per_s']} MB/s, {meta['tokens_per_s']:,} tokens/s)")
    if sample:
        from .data.shards import ShardSet
        from .tokenizer import CodeTokenizer
        ss = ShardSet(path, "train")
        tok = CodeTokenizer.load(os.path.join(path, "tokenizer"))
        print("  sample of the first document:\n" + "\n".join(
            "    | " + line for line in tok.decode(ss.arrays[0][:64].tolist()).splitlines()))


def cmd_make_sft(a: argparse.Namespace) -> int:
    from .mining.sft import write_sft
    st = write_sft(a.input, a.out, overwrite=a.overwrite, languages=a.languages, max_examples=a.max_examples,
                   heldout_fraction=a.heldout_fraction, seed=a.seed, max_chars=a.max_chars,
                   exclude_tests=not a.include_tests)
    print(f"mined {st['examples']} pairs from {st['functions']} documented functions in {st['files']} files "
          f"(train {st['train']}, held out {st['heldout']}) -> {a.out}")
    if st.get("skipped"):
        print("  skipped functions: " + ", ".join(f"{k} {v}" for k, v in st["skipped"].items()))
    print(f"next: codeforge prepare --chat --input {a.out}/train.jsonl --tokenizer TOK --out DATA")
    return 0


def cmd_make_pairs(a: argparse.Namespace) -> int:
    from .mining.pairs import write_pairs, write_task_pairs
    if bool(a.input) == bool(a.tasks):
        raise CodeforgeError("make-pairs takes code (--input PATH ...) or tasks with solutions (--tasks TASKS), "
                             "one of the two")
    if a.tasks:
        st = write_task_pairs(a.tasks, a.out, overwrite=a.overwrite, seed=a.seed, per_task=a.per_function,
                              max_pairs=a.max_pairs, heldout_fraction=a.heldout_fraction)
        print(f"{st['pairs']} pairs (train {st['train']}, held out {st['heldout']}) from {sum(st['tasks'].values())} "
              f"tasks; every rejected side fails the task's tests -> {a.out}")
        print(f"  kinds: {st['kinds']}; dropped: {st['dropped'] or 'none'}")
    else:
        st = write_pairs(a.input, a.out, overwrite=a.overwrite, languages=a.languages, max_pairs=a.max_pairs,
                         heldout_fraction=a.heldout_fraction, seed=a.seed, per_function=a.per_function)
        print(f"{st['pairs']} pairs (train {st['train']}, held out {st['heldout']}) from {st['functions']} "
              f"functions in {st['files']} files -> {a.out}")
        print(f"  kinds: {st['kinds']}")
        if st.get("skipped"):
            print("  functions without a pair: " + ", ".join(f"{k} {v}" for k, v in st["skipped"].items()))
    print(f"next: codeforge train --stage dpo (or reward) --init-from SFT_RUN --data {a.out} --out RUN")
    return 0


def cmd_make_tasks(a: argparse.Namespace) -> int:
    from .tasks.code_tasks import write_tasks
    st = write_tasks(a.out, n=a.count, seed=a.seed, overwrite=a.overwrite, validate=not a.no_validate)
    print(f"{st['kept']} tasks from {st['families']} families (train {st['train']}, held out {st['test']}; "
          f"{st['skipped']} skipped: their reference solution failed its tests) -> {a.out}")
    for sk in st["skipped_tasks"][:5]:
        print(f"  skipped {sk['id']}: {sk['reason']}")
    print(f"next: SFT on {a.out}/train.jsonl (`codeforge prepare --chat`), then codeforge train --stage grpo "
          f"--init-from SFT_RUN --data {a.out} --out RUN; codeforge eval --run RUN --tasks {a.out}")
    return 0


def cmd_make_tools(a: argparse.Namespace) -> int:
    from .tasks.tool_calls import write_tool_data
    meta = write_tool_data(a.out, a.count, a.heldout, seed=a.seed, overwrite=a.overwrite)
    print(f"wrote {a.count} training and {a.heldout} held-out tool-calling conversations -> {a.out}")
    if meta.get("kinds"):
        print(f"  kinds: {meta['kinds']}")
    return 0


def cmd_data_info(a: argparse.Namespace) -> int:
    from .data.shards import ShardSet
    _print_data_info(ShardSet(a.dir).meta, a.dir)
    return 0


# -- parser ----------------------------------------------------------------------------------------------

class _Parser(argparse.ArgumentParser):
    """No silent abbreviations (--max-iter must not pass for --max-iters); subcommands inherit this class."""

    def __init__(self, *a, **k):
        k.setdefault("allow_abbrev", False)
        super().__init__(*a, **k)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="codeforge", description="Train code language models from scratch.")
    sub = p.add_subparsers(dest="command", required=True)

    tk = sub.add_parser("tokenizer", help="train or evaluate a byte-level BPE code tokenizer")
    tks = tk.add_subparsers(dest="tokenizer_command", required=True)
    t = tks.add_parser("train", help="train a tokenizer from a corpus")
    _corpus_args(t)
    t.add_argument("--vocab-size", type=int, default=32000)
    t.add_argument("--out", required=True)
    t.add_argument("--max-train-bytes", type=float, default=None, help="stop reading after this many characters")
    t.add_argument("--overwrite", action="store_true", help="replace what --out already holds")
    t.add_argument("--split", choices=["code", "llama3"], default="code",
                   help="pre-tokenizer rule: code (identifiers with _ and digits whole, indentation after "
                        "punctuation) or llama3 (what llama.cpp implements: needed for `export --format gguf`)")
    t.set_defaults(func=cmd_tokenizer_train)
    e = tks.add_parser("eval", help="bytes per token and round-trip check on a corpus")
    _corpus_args(e)
    e.add_argument("--tokenizer", required=True)
    e.add_argument("--json", action="store_true")
    e.set_defaults(func=cmd_tokenizer_eval)

    pr = sub.add_parser("prepare", help="tokenize a corpus into token shards")
    _corpus_args(pr)
    pr.add_argument("--tokenizer", required=True, help="directory holding tokenizer.json")
    pr.add_argument("--out", required=True)
    pr.add_argument("--val-fraction", type=float, default=0.01)
    pr.add_argument("--dedup", choices=["none", "exact", "near"], default="exact")
    pr.add_argument("--workers", type=int, default=0, help="encoding threads (default: all cores)")
    pr.add_argument("--shard-tokens", type=int, default=100_000_000)
    pr.add_argument("--overwrite", action="store_true", help="replace an existing, different dataset")
    pr.add_argument("--chat", action="store_true", help="inputs are chat JSONL ({\"messages\": [...], \"tools\": "
                    "[...]}); render with ChatML and write a loss mask (assistant turns only) for --stage sft/tools")
    pr.set_defaults(func=cmd_prepare)

    ms = sub.add_parser("make-sft", help="mine chat instruction pairs (signature + doc -> the real function) from "
                                         "Go/Python code")
    ms.add_argument("--input", nargs="+", required=True, metavar="PATH", help="directories or files of code")
    ms.add_argument("--out", required=True, help="directory: train.jsonl, heldout.jsonl, meta.json")
    ms.add_argument("--languages", nargs="+", default=None, choices=["go", "python"])
    ms.add_argument("--max-examples", type=int, default=0, help="cap on pairs (0: all)")
    ms.add_argument("--heldout-fraction", type=float, default=0.05)
    ms.add_argument("--max-chars", type=int, default=4000, help="skip longer functions")
    ms.add_argument("--include-tests", action="store_true", help="also mine test files")
    ms.add_argument("--seed", type=int, default=0)
    ms.add_argument("--overwrite", action="store_true")
    ms.set_defaults(func=cmd_make_sft)

    mpp = sub.add_parser("make-pairs", help="preference pairs from Go/Python code: the real function (chosen) "
                                            "against a broken variant (rejected), for --stage reward and dpo")
    mpp.add_argument("--input", nargs="+", default=None, metavar="PATH", help="directories or files of code")
    mpp.add_argument("--tasks", default=None, metavar="TASKS",
                     help="instead of code: tasks with reference solutions (a `codeforge make-tasks` directory's "
                          "train split, or JSONL); every rejected variant is run and must fail the tests")
    mpp.add_argument("--out", required=True, help="directory: train.jsonl, heldout.jsonl, meta.json")
    mpp.add_argument("--languages", nargs="+", default=None, choices=["go", "python"])
    mpp.add_argument("--max-pairs", type=int, default=0, help="cap on pairs (0: all)")
    mpp.add_argument("--per-function", type=int, default=1, help="broken variants per function")
    mpp.add_argument("--heldout-fraction", type=float, default=0.05)
    mpp.add_argument("--seed", type=int, default=0)
    mpp.add_argument("--overwrite", action="store_true")
    mpp.set_defaults(func=cmd_make_pairs)

    mk = sub.add_parser("make-tasks", help="small programming tasks with hidden tests (string, list, arithmetic, "
                                           "dict; 3 levels), for --stage ppo and grpo and `eval --tasks`")
    mk.add_argument("--out", required=True, help="directory: train.jsonl, test.jsonl (held out), meta.json")
    mk.add_argument("--count", type=int, default=2000, help="tasks in all (about a fifth are held out)")
    mk.add_argument("--seed", type=int, default=0)
    mk.add_argument("--no-validate", action="store_true",
                    help="skip running every reference solution against its tests in the sandbox")
    mk.add_argument("--overwrite", action="store_true")
    mk.set_defaults(func=cmd_make_tasks)

    mt = sub.add_parser("make-tools", help="synthetic tool-calling conversations (code tools: run tests, read "
                                           "files, search code, evaluate expressions)")
    mt.add_argument("--out", required=True, help="directory: train.jsonl, heldout.jsonl, meta.json")
    mt.add_argument("--count", type=int, default=2000, help="training conversations")
    mt.add_argument("--heldout", type=int, default=200, help="held-out conversations")
    mt.add_argument("--seed", type=int, default=0)
    mt.add_argument("--overwrite", action="store_true")
    mt.set_defaults(func=cmd_make_tools)

    d = sub.add_parser("data", help="inspect prepared data")
    ds = d.add_subparsers(dest="data_command", required=True)
    di = ds.add_parser("info", help="counts and a decoded sample")
    di.add_argument("dir")
    di.set_defaults(func=cmd_data_info)

    _train_parser(sub)
    _quickstart_parser(sub)
    _generate_parser(sub)
    _eval_parser(sub)
    _chat_parser(sub)
    _export_parser(sub)
    _serve_parser(sub)
    _plans_parser(sub)
    return p


def _plans_parser(sub) -> None:
    mp = sub.add_parser("make-plans", help="mine (prompt, plan, body) records from Go/Python functions for the "
                                           "hierarchical model: the plan is the body's statement skeleton")
    mp.add_argument("--input", nargs="+", required=True, metavar="PATH", help="directories or files of code")
    mp.add_argument("--out", required=True, help="directory: train.jsonl, val.jsonl, meta.json")
    mp.add_argument("--languages", nargs="+", default=None, choices=["go", "python"])
    mp.add_argument("--max-examples", type=int, default=0, help="cap on records (0: all)")
    mp.add_argument("--val-fraction", type=float, default=0.05)
    mp.add_argument("--max-chars", type=int, default=4000, help="skip longer functions")
    mp.add_argument("--max-plan-words", type=int, default=128, help="cut longer plans (ending them with ...)")
    mp.add_argument("--exclude-tests", action="store_true", help="skip test files (_test.go, test_*.py, tests/)")
    mp.add_argument("--seed", type=int, default=0, help="0: the split make-sft uses; another value salts it")
    mp.add_argument("--overwrite", action="store_true")

    def cmd_make_plans(a: argparse.Namespace) -> int:
        from .mining.plans import write_plans
        st = write_plans(a.input, a.out, overwrite=a.overwrite, languages=a.languages, max_examples=a.max_examples,
                         val_fraction=a.val_fraction, max_chars=a.max_chars, max_plan_words=a.max_plan_words,
                         exclude_tests=a.exclude_tests, seed=a.seed)
        print(f"mined {st['examples']} plan records from {st['functions']} functions in {st['files']} files "
              f"(train {st['train']}, val {st['val']}, plans cut {st['truncated_plans']}) -> {a.out}")
        if st.get("skipped"):
            print("  skipped functions: " + ", ".join(f"{k} {v}" for k, v in st["skipped"].items()))
        if st.get("corpus_skipped"):
            print("  skipped files: " + ", ".join(f"{k} {v}" for k, v in st["corpus_skipped"].items()))
        print("  example record:\n" + json.dumps(st["example"], indent=2, ensure_ascii=False))
        return 0

    mp.set_defaults(func=cmd_make_plans)


# -- training --------------------------------------------------------------------------------------------

def _train_parser(sub) -> None:

    t = sub.add_parser("train", help="train a model on prepared shards (any stage)",
                       usage="codeforge train --data DIR --out RUN [--stage S] [--preset NAME ...] [--resume] "
                             "[options]",
                       description="Every config field is a flag (generated from its declaration in config.py "
                                   "and models/gpt.py); precedence, later wins: defaults < --stage defaults < "
                                   "--preset < --config < --set < flags.")
    t.add_argument("--resume", action="store_true", help="continue from the run's latest checkpoint")
    _config_flags(t)
    t.set_defaults(func=cmd_train)
    pl = sub.add_parser("plan", help="memory per rank (parameters, gradients, optimizer state, activations) under "
                                     "DDP and FSDP, before launching",
                        usage="codeforge plan --preset NAME [--world-size N] [--gpu-memory GIB] [train options]",
                        description="An estimate from the model's shapes and the training settings (the same "
                                    "presets, --set and flags as `train`); benchmarks/fsdp_memory.py checks it "
                                    "against measured peaks.")
    pl.add_argument("--world-size", type=int, default=1, metavar="N", help="ranks (all nodes together)")
    pl.add_argument("--gpu-memory", type=float, default=None, metavar="GIB",
                    help="memory of one device, to say what fits (default: this machine's GPU, if any)")
    _config_flags(pl)
    pl.set_defaults(func=cmd_plan)
    p = sub.add_parser("presets", help="list model presets (with parameter counts) and hardware profiles")
    p.set_defaults(func=cmd_presets)
    c = sub.add_parser("config", help="`config keys`: every settable key (--set KEY=VALUE, config files)")
    c.add_argument("what", choices=["keys"])
    c.set_defaults(func=cmd_config_keys)


def _config_flags(t) -> None:
    """--preset, --config, --set, --dropout and a flag per config field."""
    from dataclasses import fields

    from .config import SECTIONS
    from .fields import describe, flag_name
    t.add_argument("--preset", nargs="+", action="extend", default=[], metavar="NAME",
                   help="model and/or hardware presets, applied in order (see `codeforge presets`)")
    t.add_argument("--config", help="TOML or YAML file with [model] and [train] tables")
    t.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="any config field, e.g. --set train.warmup_steps=50 (`codeforge config keys` lists them)")
    t.add_argument("--dropout", type=float, default=None, help="sets embedding, attention and residual dropout")
    for section, cls in SECTIONS.items():
        g = t.add_argument_group(f"{section} settings")
        for f in fields(cls):
            if not f.metadata.get("cli", True):
                continue
            kw: dict = {"dest": f"{section}.{f.name}", "default": None, "help": describe(f)}
            if isinstance(f.default, bool):
                kw["action"] = argparse.BooleanOptionalAction
            else:
                kw["type"] = type(f.default)
                kw["metavar"] = None if f.metadata.get("choices") else (
                    f.metadata.get("metavar") or {int: "N", float: "X"}.get(type(f.default), "TEXT"))
                if f.metadata.get("choices"):
                    kw["choices"] = f.metadata["choices"]
            g.add_argument(flag_name(f), **kw)


def cmd_config_keys(a: argparse.Namespace) -> int:
    from dataclasses import fields

    from .config import SECTIONS
    from .fields import describe, flag_name
    for section, cls in SECTIONS.items():
        print(f"[{section}]")
        for f in fields(cls):
            flag = flag_name(f) if f.metadata.get("cli", True) else "(config file or --set only)"
            print(f"  {section}.{f.name:22s} {type(f.default).__name__:5s} {flag:24s} {describe(f)}")
    return 0


def _train_config(a: argparse.Namespace):
    from .config import load_file, resolve
    flags = {k: v for k, v in vars(a).items() if k.startswith(("model.", "train.")) and v is not None}
    if a.dropout is not None:
        flags.update({"model.embd_dropout": a.dropout, "model.attn_dropout": a.dropout, "model.resid_dropout": a.dropout})
    out = flags.get("train.out")
    if not flags.get("train.data") or not out:
        raise CLIError("train needs --data DIR (from `codeforge prepare`) and --out RUN")
    base = None
    if a.resume and os.path.exists(os.path.join(out, rundir.CONFIG)):
        base = load_file(os.path.join(out, rundir.CONFIG))  # the saved run, then this command's changes
    return resolve(a.preset, a.config, a.set, flags, base=base, vocab_from_data=True)


def cmd_plan(a: argparse.Namespace) -> int:
    import torch

    from .config import resolve
    from .train.memory import estimate, report
    if a.world_size < 1:
        raise CLIError(f"--world-size {a.world_size}: give the number of ranks, 1 or more")
    if a.gpu_memory is not None and a.gpu_memory <= 0:
        raise CLIError(f"--gpu-memory {a.gpu_memory}: give one device's memory in GiB, e.g. 24")
    flags = {k: v for k, v in vars(a).items() if k.startswith(("model.", "train.")) and v is not None}
    cfg = resolve(a.preset, a.config, a.set, flags)
    if cfg.model.vocab_size == 0:  # from the data's tokenizer, as train does
        if not cfg.train.data:
            raise CLIError("plan needs the vocabulary size: a model --preset, --vocab-size N, or --data DIR "
                           "(prepared data; its tokenizer gives it)")
        from dataclasses import replace

        from .stages.common import round_up
        from .tokenizer import CodeTokenizer
        tok = CodeTokenizer.load(os.path.join(cfg.train.data, "tokenizer"))
        cfg.model = replace(cfg.model, vocab_size=round_up(tok.vocab_size, 64))
    gpu = a.gpu_memory * 2**30 if a.gpu_memory else (
        torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None)
    t = cfg.train
    precision = t.precision if t.precision != "auto" else ("fp32" if t.device == "cpu" or not gpu else "bf16")
    plan = estimate(cfg.model, t, a.world_size, precision, t.fsdp_offload)
    print(report(plan, cfg.model, t, precision, gpu, " + ".join(a.preset)))
    return 0


def cmd_train(a: argparse.Namespace) -> int:
    from .stages import run
    cfg = _train_config(a)
    r = run(cfg, resume=a.resume)
    if os.environ.get("RANK", "0") != "0":
        return 0
    msg = f"{'stopped' if r.get('interrupted') else 'done'}: step {r['step']}, {r['tokens']:,} tokens"
    when = "" if r.get("val_step") == r["step"] else f" (evaluated at step {r['val_step']})"
    if r.get("evaluation"):  # preference and RL stages say what they measured
        msg += f"; {r['evaluation']}{when}"
    elif r["val_loss"] is not None:
        msg += f", val loss {r['val_loss']:.4f}{when}"
    print(msg + f"; run directory {r['run_dir']}")
    return 0


def cmd_presets(a: argparse.Namespace) -> int:
    from .config import preset_names, resolve
    import torch

    from .models import build_model
    names = preset_names()
    print(f"{'model preset':20s} {'params':>14s} {'layers':>6s} {'heads':>5s} {'kv':>3s} {'width':>6s} "
          f"{'ffn':>6s} {'ctx':>6s} {'vocab':>6s}  arch")
    for n in names["model"]:
        m = resolve([n]).model
        with torch.device("meta"):
            count = build_model(m).num_params()
        print(f"{n:20s} {count:14,d} {m.n_layer:6d} {m.n_head:5d} {m.n_kv_head:3d} {m.n_embd:6d} {m.ffn_hidden:6d} "
              f"{m.block_size:6d} {m.vocab_size:6d}  {m.norm}/{m.pos}/{m.mlp}")
    print("hardware profiles: " + ", ".join(names["train"]))
    return 0


def _quickstart_parser(sub) -> None:
    q = sub.add_parser("quickstart", help="the whole pipeline on a built-in corpus: tokenizer, prepare, train, "
                                          "eval, sample")
    q.add_argument("--out", default=None, help="default runs/quickstart (runs/quickstart-chat with --chat)")
    q.add_argument("--corpus", default="python-stdlib", help="python-stdlib | go | PATH")
    q.add_argument("--max-iters", type=int, default=None, help="training steps (default: about 7 CPU minutes)")
    q.add_argument("--device", default="auto")
    q.add_argument("--chat", action="store_true", help="then chat SFT on pairs mined from the corpus and tool "
                   "calling (about 20 CPU minutes; default --out runs/quickstart-chat)")
    q.add_argument("--hrm", action="store_true", help="seed 001's hierarchical planner/generator model instead: "
                   "mine plans from the corpus, train it, print the seed's metrics (about 7 CPU minutes; default "
                   "--out runs/quickstart-hrm)")
    q.set_defaults(func=cmd_quickstart)


def cmd_quickstart(a: argparse.Namespace) -> int:
    from .quickstart import run_quickstart
    try:
        if a.chat and a.hrm:
            raise CLIError("--chat and --hrm are two different quickstarts: pick one")
        default = "runs/quickstart-chat" if a.chat else "runs/quickstart-hrm" if a.hrm else "runs/quickstart"
        run_quickstart(a.out or default, a.corpus, a.max_iters, a.device, chat=a.chat, hrm=a.hrm)
    except FileNotFoundError as e:
        raise CLIError(str(e)) from e
    return 0


# -- generation and evaluation --------------------------------------------------------------------------

def _export_parser(sub) -> None:
    e = sub.add_parser("export", help="write a run as a Hugging Face model directory or a GGUF file (llama.cpp)",
                       description="Hugging Face: GPT2LMHeadModel, LlamaForCausalLM, Qwen2/Qwen3ForCausalLM or "
                                   "ArceeForCausalLM, whichever computes exactly this model (else refused with what "
                                   "does not map); the logits are checked against transformers when it is installed. "
                                   "GGUF: llama.cpp's gpt2/llama/qwen2/qwen3/arcee architectures.")
    e.add_argument("--run", required=True, metavar="RUN", help="run directory or checkpoint directory")
    e.add_argument("--format", required=True, choices=["hf", "gguf"])
    e.add_argument("--out", required=True, metavar="PATH", help="hf: a directory; gguf: a file (.gguf)")
    e.add_argument("--checkpoint", default="auto", choices=["auto", "best", "latest", "final"],
                   help="auto: best if the run has one, else latest")
    e.add_argument("--dtype", default="f32", choices=["f32", "f16", "q8_0"], help="gguf: tensor type of the matrices")
    e.add_argument("--allow-tokenizer-mismatch", action="store_true",
                   help="gguf: write the file even though llama.cpp would split text differently from codeforge's "
                        "tokenizer (the model then sees other tokens than it was trained on); see the README")
    e.add_argument("--overwrite", action="store_true", help="replace what --out holds")
    e.add_argument("--no-verify", action="store_true", help="hf: skip the logits check against transformers")
    e.set_defaults(func=cmd_export)
    i = sub.add_parser("import", help="a codeforge run from a local Hugging Face model directory (GPT-2, Llama, "
                                      "Qwen2, Qwen3, Arcee), to train from with --init-from RUN")
    i.add_argument("--hf", required=True, metavar="DIR", help="directory with config.json, *.safetensors, tokenizer.json")
    i.add_argument("--out", required=True, metavar="RUN")
    i.add_argument("--overwrite", action="store_true", help="replace what --out holds")
    i.add_argument("--no-verify", action="store_true", help="skip the logits check against transformers")
    i.set_defaults(func=cmd_import)


def cmd_export(a: argparse.Namespace) -> int:
    if a.format == "hf":
        from .export.hf import export_hf
        r = export_hf(a.run, a.out, a.checkpoint, overwrite=a.overwrite, verify=not a.no_verify)
        print(f"exported {r['checkpoint']} as {r['family']} -> {r['out']}")
    else:
        from .export.gguf import export_gguf
        r = export_gguf(a.run, a.out, a.checkpoint, dtype=a.dtype, overwrite=a.overwrite,
                        allow_tokenizer_mismatch=a.allow_tokenizer_mismatch)
        print(f"exported {r['checkpoint']} as GGUF ({r['arch']}, {a.dtype}, pre-tokenizer {r['pre']}, "
              f"{r['bytes'] / 2**20:,.1f} MiB) -> {r['out']}")
    if r.get("max_abs_diff") is not None:
        print(f"parity: transformers' logits equal codeforge's to {r['max_abs_diff']:.2e} (max abs) on a code sample")
    return 0


def cmd_import(a: argparse.Namespace) -> int:
    from .export.hf import import_hf
    r = import_hf(a.hf, a.out, overwrite=a.overwrite, verify=not a.no_verify)
    print(f"imported {a.hf} ({r['family']}, {r['params']:,} parameters) -> {r['checkpoint']}")
    if r["max_abs_diff"] is not None:
        print(f"parity: codeforge's logits equal transformers' to {r['max_abs_diff']:.2e} (max abs) on a code sample")
    print(f"next: codeforge train --init-from {r['out']} --data DATA --out NEW_RUN ... (prepare DATA with "
          f"--tokenizer {r['checkpoint']}/tokenizer)")
    return 0


def _generate_parser(sub) -> None:
    g = sub.add_parser("generate", help="generate text from a trained run")
    g.add_argument("--run", required=True, help="run directory or checkpoint directory")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="prompt text ('-' reads stdin)")
    src.add_argument("--prompt-file", help="one prompt per file; with --prompts-jsonl, one JSON string per line")
    suf = g.add_mutually_exclusive_group()
    suf.add_argument("--suffix", help="fill in the middle: the text after the gap (the prompt is the text before "
                                      "it); prints the whole filled text")
    suf.add_argument("--suffix-file", help="--suffix read from a file")
    g.add_argument("--show-plan", action="store_true",
                   help="hrm runs: print the plan and each refinement round (the decision head's p_done) before "
                        "the code")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.8)
    g.add_argument("--top-k", type=int, default=50)
    g.add_argument("--top-p", type=float, default=0.95)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--num-samples", type=int, default=1)
    g.add_argument("--stop", action="append", default=[], help="stop sequence, repeatable; \\n and \\t are read as "
                   "newline and tab (e.g. --stop '\\ndef ')")
    g.add_argument("--checkpoint", default="auto", choices=["auto", "best", "latest", "final"],
                   help="auto: best if the run has one, else latest")
    g.add_argument("--device", default="auto")
    g.set_defaults(func=cmd_generate)


def cmd_generate(a: argparse.Namespace) -> int:
    from .engine import Engine, SamplingParams
    if a.prompt == "-" or (a.prompt is None and a.prompt_file is None):
        if sys.stdin.isatty() and a.prompt is None:
            raise CLIError("no prompt: pass --prompt TEXT, --prompt-file FILE, or pipe text on stdin "
                           "(--prompt '' generates from the start of a document)")
        prompt = sys.stdin.read()
    elif a.prompt_file:
        if not os.path.exists(a.prompt_file):
            raise CLIError(f"--prompt-file {a.prompt_file} does not exist")
        prompt = open(a.prompt_file, encoding="utf-8").read()
    else:
        prompt = a.prompt
    suffix = a.suffix
    if a.suffix_file:
        if not os.path.isfile(a.suffix_file):
            raise CLIError(f"--suffix-file {a.suffix_file} is not a file")
        suffix = open(a.suffix_file, encoding="utf-8").read()
    from .checkpoint import load_model
    from .device import choose_device, choose_precision
    dev, _ = choose_device(a.device)
    model, tok, _, _ = load_model(a.run, dev, a.checkpoint)
    if getattr(model.cfg, "arch", "gpt") == "hrm":
        return _generate_hrm(a, model, tok, prompt)
    eng = Engine(model, tok, dev, choose_precision(dev, "auto")[0])
    try:
        stops = [x.replace("\\n", "\n").replace("\\t", "\t") for x in a.stop]
        params = SamplingParams(a.max_new_tokens, a.temperature, a.top_k, a.top_p, a.repetition_penalty, a.seed, stops)
        params.validate()
    except ValueError as e:
        raise CLIError(str(e)) from e
    if not prompt:
        print("note: empty prompt; generating from the start of a document", file=sys.stderr)
    for i in range(a.num_samples):
        if a.num_samples > 1:
            print(f"--- sample {i + 1} ---")
        if a.seed is not None:
            params.seed = a.seed + i
        sys.stdout.write(prompt)
        for piece in eng.stream(prompt, params, suffix=suffix):
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write((suffix or "") + "\n")
    return 0


def _generate_hrm(a: argparse.Namespace, model, tok, prompt: str) -> int:
    """Plan, write, refine (models/hrm.py generate): the final code after the prompt; with --show-plan, the
    plan and every refinement round first. Sampling: temperature and top-k (the hierarchical decoder has no
    top-p, stop sequences or fill-in-the-middle)."""
    if a.suffix is not None or a.suffix_file:
        raise CLIError("--suffix: an hrm run does not fill in the middle; pass the function's signature and doc as "
                       "--prompt")
    if not prompt:
        raise CLIError("an hrm run plans from a prompt: pass a function's signature and doc comment as --prompt")
    for i in range(a.num_samples):
        if a.num_samples > 1:
            print(f"--- sample {i + 1} ---")
        seed = None if a.seed is None else a.seed + i
        r = model.generate(tok.encode(prompt), max_plan_tokens=min(128, a.max_new_tokens),
                           max_code_tokens=a.max_new_tokens, temperature=a.temperature, top_k=a.top_k, seed=seed)
        if a.show_plan:
            print(f"# plan: {tok.decode(r['plan'])}")
            print(f"# draft:\n{prompt}{tok.decode(r['draft'])}")
            for it in r["iterations"]:
                print(f"# refinement {it['iteration'] + 1}: {it['decision']} (p_done {it['p_done']:.2f})")
            print("# final:")
        sys.stdout.write(prompt + tok.decode(r["code"]) + "\n")
    return 0


def _chat_parser(sub) -> None:
    c = sub.add_parser("chat", help="chat with a chat run (after --stage sft/tools) at the terminal, or reply to "
                                    "stdin when it is not a terminal")
    c.add_argument("--run", required=True, help="run directory or checkpoint directory")
    c.add_argument("--system", default=None, help="system message")
    c.add_argument("--tools", default=None, help="JSON file with a list of tool schemas offered to the model")
    c.add_argument("--max-new-tokens", type=int, default=256)
    c.add_argument("--temperature", type=float, default=0.7)
    c.add_argument("--top-k", type=int, default=50)
    c.add_argument("--top-p", type=float, default=0.95)
    c.add_argument("--seed", type=int, default=None)
    c.add_argument("--checkpoint", default="auto", choices=["auto", "best", "latest", "final"])
    c.add_argument("--device", default="auto")
    c.set_defaults(func=cmd_chat)


def _serve_parser(sub) -> None:
    s = sub.add_parser("serve", help="serve a run over HTTP: OpenAI-compatible completions, chat and tool calls, "
                                     "/infill, a playground page; continuous batching",
                       usage="codeforge serve --run RUN [--host 127.0.0.1] [--port 8000] [--api-key KEY] [options]")
    s.add_argument("--run", required=True, metavar="RUN", help="run directory or checkpoint directory (required)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine "
                                                       "only; 0.0.0.0 for every interface)")
    s.add_argument("--port", type=int, default=8000, metavar="N", help="TCP port (default 8000; 0 picks a free one)")
    s.add_argument("--checkpoint", default="auto", choices=["auto", "best", "latest", "final"],
                   help="auto (default): best if the run has one, else latest")
    s.add_argument("--device", default="auto", help="auto (default), cpu, cuda, cuda:N or mps")
    s.add_argument("--api-key", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health and / (default: none)")
    s.add_argument("--max-batch", type=int, default=8, metavar="N", help="rows decoded together (default 8)")
    s.add_argument("--max-queue", type=int, default=64, metavar="N",
                   help="rows waiting for a batch slot before requests get 429 (default 64)")
    s.add_argument("--max-prompt-tokens", type=int, default=0, metavar="N",
                   help="longest prompt accepted (default 0: the model's context minus one)")
    s.add_argument("--max-tokens-cap", type=int, default=0, metavar="N",
                   help="largest max_tokens accepted (default 0: the model's context)")
    s.add_argument("--request-timeout", type=float, default=600.0, metavar="S",
                   help="seconds from arrival to the last token before a request is stopped with 504 (default 600; "
                        "0: none)")
    s.add_argument("--max-body-bytes", type=int, default=1 << 20, metavar="N",
                   help="largest request body (default 1048576); larger ones get 413")
    s.add_argument("--model-name", default=None, metavar="NAME",
                   help="the model's id in the API (default: the run directory's name)")
    s.add_argument("--access-log", action="store_true", help="log every request (default: warnings only)")

    def cmd_serve(a: argparse.Namespace) -> int:
        from .serve import serve_command
        return serve_command(a)

    s.set_defaults(func=cmd_serve)


def cmd_chat(a: argparse.Namespace) -> int:
    """Interactive: each line is a user turn, the reply streams, history is kept; /reset clears it, /system
    TEXT sets the system message, /quit (or Ctrl-D) leaves. Piped: stdin is one user message (or a JSON
    object {"messages": [...], "tools": [...]}); the reply is printed and the command exits."""
    from .engine import Engine, SamplingParams
    tools = None
    if a.tools:
        try:
            tools = json.loads(open(a.tools, encoding="utf-8").read())
        except (OSError, json.JSONDecodeError) as e:
            raise CLIError(f"--tools {a.tools}: {e}") from e
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise CLIError(f"--tools {a.tools}: expected a JSON list of tool schema objects")
    params = SamplingParams(a.max_new_tokens, a.temperature, a.top_k, a.top_p, seed=a.seed)
    try:
        params.validate()
    except ValueError as e:
        raise CLIError(str(e)) from e
    eng = Engine.from_run(a.run, a.device, a.checkpoint)
    system = [{"role": "system", "content": a.system}] if a.system else []

    def show_calls(r: dict) -> None:
        for call in r["tool_calls"]:
            print(f"[tool call] {json.dumps(call, ensure_ascii=False)}")
        for err in r["errors"]:
            print(f"[unparsed tool call] {err}")

    if not sys.stdin.isatty():
        text = sys.stdin.read()
        try:
            obj = json.loads(text)
        except json.JSONDecodeError:
            obj = None
        if isinstance(obj, dict) and "messages" in obj:
            from .chat import ChatFormatError, validate
            try:
                messages, tools = validate({**obj, "messages": obj["messages"] + [{"role": "assistant"}]})
            except ChatFormatError as e:
                raise CLIError(f"stdin: {e}") from e
            messages = messages[:-1]
        else:
            messages = system + [{"role": "user", "content": text.strip()}]
        r = eng.chat(messages, tools, params)
        print(r["content"])
        show_calls(r)
        return 0
    history = list(system)
    print("chat: /reset clears the history, /system TEXT sets the system message, /quit or Ctrl-D leaves",
          file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print()
            return 0
        if line.strip() in ("/quit", "/exit"):
            return 0
        if line.strip() == "/reset":
            history = list(system)
            continue
        if line.startswith("/system"):
            system = [{"role": "system", "content": line[len("/system"):].strip()}]
            history = system + [m for m in history if m["role"] != "system"]
            continue
        history.append({"role": "user", "content": line})
        r = eng.chat(history, tools, params, on_text=lambda piece: print(piece, end="", flush=True))
        print()
        show_calls(r)
        msg: dict = {"role": "assistant", "content": r["content"]}
        if r["tool_calls"]:
            msg["tool_calls"] = [{"type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                                 for c in r["tool_calls"]]
        history.append(msg)


def _eval_parser(sub) -> None:
    e = sub.add_parser("eval", help="loss, perplexity, bits per byte, syntax validity and pass@k of a run")
    e.add_argument("--run", required=True)
    e.add_argument("--data", default=None, help="prepared directory (default: the run's training data)")
    e.add_argument("--eval-tokens", type=int, default=None, metavar="N",
                   help="validation targets to score, the first N of the split in order (0: the whole split; "
                        "default: the run's own train.eval_tokens, so the number equals training's)")
    e.add_argument("--syntax-samples", type=int, default=16, help="completions checked for syntax (0: skip)")
    e.add_argument("--language", default=None, help="go | python (default: the data's majority language)")
    e.add_argument("--humaneval", type=int, default=0, metavar="N", help="run pass@k on the first N HumanEval problems")
    e.add_argument("--k", type=int, nargs="+", default=[1, 10])
    e.add_argument("--samples-per-problem", type=int, default=10)
    e.add_argument("--max-new-tokens", type=int, default=256)
    e.add_argument("--timeout", type=float, default=5.0, help="seconds per sandboxed program")
    e.add_argument("--infill", type=int, default=0, metavar="N",
                   help="fill-in-the-middle: N masked lines and N masked 2-4 line spans from held-out files; exact "
                        "match, syntax validity of the filled file, bits per byte of the middle (default 0: off)")
    e.add_argument("--hrm-cases", type=int, default=32, metavar="N",
                   help="hrm runs: held-out functions planned, written and refined for the decoded metrics (plan "
                        "and code exact match, AST F1, syntax validity, avg_iterations; default 32, 0: off)")
    e.add_argument("--unsafe-no-sandbox", action="store_true",
                   help="run model-written programs WITHOUT the bubblewrap sandbox (limits only, no isolation): "
                        "only where bubblewrap cannot be installed and you trust what runs")
    e.add_argument("--checkpoint", default="auto", choices=["auto", "best", "latest", "final"],
                   help="auto: best if the run has one, else latest")
    e.add_argument("--tool-cases", type=int, default=100, help="held-out tool-calling cases for chat runs (0: skip)")
    e.add_argument("--tasks", default=None, metavar="TASKS",
                   help="pass rate on programming tasks with hidden tests: a `codeforge make-tasks` directory (its "
                        "held-out split) or a JSONL of prompt/tests; the programs run in the sandbox")
    e.add_argument("--task-samples", type=int, default=1, help="samples per task (with --task-temperature > 0)")
    e.add_argument("--task-temperature", type=float, default=0.0, help="0: greedy, one sample per task")
    e.add_argument("--task-limit", type=int, default=0, metavar="N", help="only the first N tasks (0: all)")
    e.add_argument("--device", default="auto")
    e.add_argument("--json", action="store_true")
    e.set_defaults(func=cmd_eval)


def cmd_eval(a: argparse.Namespace) -> int:
    from .evaluation.run import run_eval
    r = run_eval(a.run, data=a.data, eval_tokens=a.eval_tokens,
                 syntax_samples=a.syntax_samples, language=a.language, humaneval=a.humaneval, ks=a.k,
                 samples_per_problem=a.samples_per_problem, max_new_tokens=a.max_new_tokens,
                 timeout=a.timeout, which=a.checkpoint, device=a.device, tool_cases=a.tool_cases,
                 unsafe_no_sandbox=a.unsafe_no_sandbox, infill=a.infill,
                 hrm_cases=a.hrm_cases, tasks=a.tasks, task_samples=a.task_samples,
                 task_temperature=a.task_temperature, task_limit=a.task_limit)
    if a.json:
        print(json.dumps(r))
    else:
        print(format_report(r))
    return 0


def format_report(r: dict) -> str:
    """key/value lines aligned in one column; numbers to 4 decimals (counts with thousands separators);
    dicts flattened (pass@k 10: 0.1234); what was not measured listed once at the end instead of None."""
    rows, skipped = [], []
    for k, v in r.items():
        if v is None or v == {}:
            skipped.append(k)
        elif isinstance(v, dict):
            rows += [(f"{k} {kk}", vv) for kk, vv in v.items()]
        else:
            rows.append((k, v))
    width = max((len(k) for k, _ in rows), default=0)
    lines = []
    for k, v in rows:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            text = str(v)
        elif isinstance(v, int):
            text = f"{v:,}"
        else:
            text = f"{v:.4f}"
        lines.append(f"{k:{width}s}  {text}")
    if skipped:
        lines.append(f"{'not measured':{width}s}  {', '.join(skipped)} (see `codeforge eval --help`)")
    return "\n".join(lines)


def _chosen_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The (sub)subcommand parser `args` came from, for its usage line in errors."""
    current = parser
    while True:
        subs = [a for a in current._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs or getattr(args, subs[0].dest, None) is None:
            return current
        current = subs[0].choices[getattr(args, subs[0].dest)]


def _parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """parse_args, but an unknown option is reported by the subcommand it was given to, with the nearest
    known options ("did you mean --max-iters?")."""
    import difflib
    args, extra = parser.parse_known_args(argv)
    if extra:
        sub = _chosen_parser(parser, args)
        known = [o for a in sub._actions for o in a.option_strings if o.startswith("--")]
        hints = []
        for tok in extra:
            if tok.startswith("--"):
                near = difflib.get_close_matches(tok.split("=", 1)[0], known, n=3, cutoff=0.6)
                if near:
                    hints.append(f"{tok.split('=', 1)[0]}: did you mean {' or '.join(near)}?")
        sub.error(f"unrecognized arguments: {' '.join(extra)}" + ("\n" + "\n".join(hints) if hints else "")
                  + f"\n(`{sub.prog} --help` lists every option)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(build_parser(), argv)
    t0 = time.perf_counter()
    try:
        return args.func(args)
    except CodeforgeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into e.g. `head`, which stopped reading: not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        print(f"interrupted after {time.perf_counter() - t0:.0f}s", file=sys.stderr)
        return 130


def entry() -> None:
    """The `codeforge` command and `python -m codeforge`: main(), then the process ends (see exit_process)."""
    from .distributed import exit_process
    try:
        code = main()
    except SystemExit as e:  # argparse's --help and usage errors
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    except KeyboardInterrupt:  # before main's own handler (while the parser is built)
        code = 130
    except BaseException:
        import traceback
        traceback.print_exc()
        code = 1
    exit_process(code)


if __name__ == "__main__":
    entry()
