"""Data commands: tokenizer train|eval, prepare, data info, and the miners make-sft, make-pairs, make-tasks,
make-tools, make-plans. Every flag is made from an options class (fields.add_flags): corpus.CorpusOptions for
the corpus, the classes of data/options.py, mining/options.py and tasks/options.py for the rest. Each command
body builds its objects back (fields.from_args), which checks every value against its declaration."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .. import CodeforgeError
from ..corpus import CorpusOptions
from ..data.options import (TOKENIZER_FIXED, DataInfoOptions, PrepareOptions, TokenizerEvalOptions,
                            TokenizerTrainOptions)
from ..fields import add_flags, from_args
from ..mining.options import PairsOptions, PlansOptions, SftOptions
from ..tasks.options import TasksOptions, ToolsOptions


def cmd_tokenizer_train(a: argparse.Namespace) -> int:
    from ..corpus import CorpusStats, describe_skipped, iter_documents
    from ..tokenizer import train_tokenizer
    o = from_args(TokenizerTrainOptions, a, "tokenizer train")
    opts = from_args(CorpusOptions, a, "tokenizer train", dedup="exact", val_fraction=0.0, redact_pii=False)
    stats = CorpusStats()
    budget = int(o.max_train_bytes) if o.max_train_bytes else None

    def texts():
        seen = 0
        for d in iter_documents(o.input, opts, stats):
            yield d.text
            seen += len(d.text)
            if budget and seen >= budget:
                return

    tok, meta = train_tokenizer(texts(), o.vocab_size, o.out, show_progress=sys.stderr.isatty(),
                                overwrite=o.overwrite, split=o.split)
    print(f"trained tokenizer: vocab {meta['vocab_size']} on {meta['train_documents']} documents "
          f"({meta['train_bytes'] / 1e6:.1f} MB) in {meta['train_seconds']:.1f}s -> {o.out} "
          f"(hash {meta['hash']})")
    if stats.skipped:
        print(f"skipped: {describe_skipped(stats.skipped)}")
    return 0


def cmd_tokenizer_eval(a: argparse.Namespace) -> int:
    from ..corpus import CorpusStats, iter_documents
    from ..tokenizer import CodeTokenizer, evaluate_tokenizer
    o = from_args(TokenizerEvalOptions, a, "tokenizer eval")
    opts = from_args(CorpusOptions, a, "tokenizer eval", dedup="none", val_fraction=0.0, redact_pii=False)
    tok = CodeTokenizer.load(o.tokenizer)
    r = evaluate_tokenizer(tok, (d.text for d in iter_documents(o.input, opts, CorpusStats())))
    if o.json:
        print(json.dumps(r))
    else:
        failed = "OK" if r["roundtrip_ok"] else f"FAILED on {r['roundtrip_failures']} documents"
        print(f"{r['documents']} documents, {r['bytes'] / 1e6:.2f} MB, {r['tokens']} tokens: "
              f"{r['bytes_per_token']:.3f} bytes/token; round-trip {failed}")
    return 0 if r["roundtrip_ok"] else 1


def cmd_prepare(a: argparse.Namespace) -> int:
    p = from_args(PrepareOptions, a, "prepare")
    if p.executor == "local" and p.workers != 1 and not p.chat:
        from ..data.fork_server import start_early
        start_early()  # its imports run on another core while this process makes the same (fork_server.py)
    from ..data.shards import prepare
    opts = p.corpus(from_args(CorpusOptions, a, "prepare"))
    if p.keep_secrets and not p.chat:
        print("WARNING: --keep-secrets: keys, tokens and passwords in these files go into the training data "
              "as they are; a model trained on it can complete them for anyone who prompts it",
              file=sys.stderr)
    if p.no_decontaminate:
        print("warning: --no-decontaminate: documents that overlap HumanEval or other benchmarks stay in the "
              "data, so scores on those benchmarks may count what the model read", file=sys.stderr)
    # 0 (the flags' default) leaves the worker and task counts to the engine (pipeline.py)
    meta = prepare(p.input, p.tokenizer, p.out, opts, overwrite=p.overwrite, shard_tokens=p.shard_tokens,
                   chat=p.chat, repo_fim=p.repo_fim, workers=p.workers or None, executor=p.executor,
                   tasks=p.tasks or None, slurm=p.slurm())
    if meta is None:  # submitted to a cluster: its last job writes the dataset
        return 0
    _print_data_info(meta, p.out, sample=False)
    return 0


def _print_data_info(meta: dict, path: str, sample: bool = True) -> None:
    print(f"{path}: {meta['documents']} documents, {meta['tokens']:,} tokens, {meta['bytes'] / 1e6:.1f} MB, "
          f"dtype {meta['dtype']}, tokenizer {meta['tokenizer_hash']}")
    for s, v in meta["splits"].items():
        print(f"  {s:5s}: {v['documents']} documents, {v['tokens']:,} tokens in {len(v['shards'])} shard(s)")
    if meta.get("skipped"):
        from ..corpus import describe_skipped
        print("  skipped: " + describe_skipped(meta["skipped"]))
    if meta.get("steps"):  # where the corpus went, step by step
        print(f"  {'step':18s} {'documents in -> out':>24s} {'MB in -> out':>22s}")
        for k, v in meta["steps"].items():
            print(f"  {k:18s} {v['documents_in']:>11,} -> {v['documents_out']:<9,} "
                  f"{v['bytes_in'] / 1e6:>10.2f} -> {v['bytes_out'] / 1e6:<8.2f}")
    if meta.get("secrets_replaced"):
        from ..corpus import describe_secrets
        print("  secrets replaced: " + describe_secrets(meta["secrets_replaced"]))
    print(f"  prepared in {meta['seconds']}s ({meta['mb_per_s']} MB/s, {meta['tokens_per_s']:,} tokens/s)")
    if sample:
        from ..data.shards import ShardSet
        from ..tokenizer import CodeTokenizer
        ss = ShardSet(path, "train")
        tok = CodeTokenizer.load(os.path.join(path, "tokenizer"))
        print("  sample of the first document:\n" + "\n".join(
            "    | " + line for line in tok.decode(ss.arrays[0][:64].tolist()).splitlines()))


def cmd_make_sft(a: argparse.Namespace) -> int:
    from ..mining.sft import write_sft
    o = from_args(SftOptions, a, "make-sft")
    st = write_sft(o.input, o.out, overwrite=o.overwrite, languages=o.languages, max_examples=o.max_examples,
                   heldout_fraction=o.heldout_fraction, seed=o.seed, max_chars=o.max_chars,
                   exclude_tests=not o.include_tests)
    print(f"mined {st['examples']} pairs from {st['functions']} documented functions in {st['files']} files "
          f"(train {st['train']}, held out {st['heldout']}) -> {o.out}")
    if st.get("skipped"):
        print("  skipped functions: " + ", ".join(f"{k} {v}" for k, v in st["skipped"].items()))
    print(f"next: codeforge prepare --chat --input {o.out}/train.jsonl --tokenizer TOK --out DATA")
    return 0


def cmd_make_pairs(a: argparse.Namespace) -> int:
    from ..mining.pairs import write_pairs, write_task_pairs
    o = from_args(PairsOptions, a, "make-pairs")
    if bool(o.input) == bool(o.tasks):
        raise CodeforgeError("make-pairs takes code (--input PATH ...) or tasks with solutions "
                             "(--tasks TASKS), one of the two")
    if o.tasks:
        st = write_task_pairs(o.tasks, o.out, overwrite=o.overwrite, seed=o.seed, per_task=o.per_function,
                              max_pairs=o.max_pairs, heldout_fraction=o.heldout_fraction)
        print(f"{st['pairs']} pairs (train {st['train']}, held out {st['heldout']}) from "
              f"{sum(st['tasks'].values())} tasks; every rejected side fails the task's tests -> {o.out}")
        print(f"  kinds: {st['kinds']}; dropped: {st['dropped'] or 'none'}")
    else:
        st = write_pairs(o.input, o.out, overwrite=o.overwrite, languages=o.languages, max_pairs=o.max_pairs,
                         heldout_fraction=o.heldout_fraction, seed=o.seed, per_function=o.per_function)
        print(f"{st['pairs']} pairs (train {st['train']}, held out {st['heldout']}) from {st['functions']} "
              f"functions in {st['files']} files -> {o.out}")
        print(f"  kinds: {st['kinds']}")
        if st.get("skipped"):
            print("  functions without a pair: " + ", ".join(f"{k} {v}" for k, v in st["skipped"].items()))
    print(f"next: codeforge train --stage dpo (or reward) --init-from SFT_RUN --data {o.out} --out RUN")
    return 0


def cmd_make_tasks(a: argparse.Namespace) -> int:
    from ..tasks.code_tasks import write_tasks
    o = from_args(TasksOptions, a, "make-tasks")
    st = write_tasks(o.out, n=o.count, seed=o.seed, overwrite=o.overwrite, validate=not o.no_validate)
    print(f"{st['kept']} tasks from {st['families']} families (train {st['train']}, held out {st['test']}; "
          f"{st['skipped']} skipped: their reference solution failed its tests) -> {o.out}")
    for sk in st["skipped_tasks"][:5]:
        print(f"  skipped {sk['id']}: {sk['reason']}")
    print(f"next: SFT on {o.out}/train.jsonl (`codeforge prepare --chat`), then codeforge train --stage grpo "
          f"--init-from SFT_RUN --data {o.out} --out RUN; codeforge eval --run RUN --tasks {o.out}")
    return 0


def cmd_make_tools(a: argparse.Namespace) -> int:
    from ..tasks.tool_calls import TOOLS_FILE, write_tool_data
    o = from_args(ToolsOptions, a, "make-tools")
    meta = write_tool_data(o.out, o.count, o.heldout, seed=o.seed, overwrite=o.overwrite)
    print(f"wrote {o.count} training and {o.heldout} held-out tool-calling conversations -> {o.out} (the "
          f"tools' schemas in {Path(o.out) / TOOLS_FILE}, for `codeforge chat --tools`)")
    if meta.get("kinds"):
        print(f"  kinds: {meta['kinds']}")
    return 0


def cmd_data_info(a: argparse.Namespace) -> int:
    from ..data.shards import ShardSet
    o = from_args(DataInfoOptions, a, "data info")
    _print_data_info(ShardSet(o.dir).meta, o.dir)
    return 0


def add_parsers(sub) -> None:
    """tokenizer train|eval, prepare, make-sft, make-pairs, make-tasks, make-tools, data info: every flag made
    from the command's options class (fields.add_flags)."""
    tk = sub.add_parser("tokenizer", help="train or evaluate a byte-level BPE code tokenizer")
    tks = tk.add_subparsers(dest="tokenizer_command", required=True)
    t = tks.add_parser("train", help="train a tokenizer from a corpus")
    add_flags(t, TokenizerTrainOptions)
    add_flags(t, CorpusOptions, group="corpus", skip=TOKENIZER_FIXED)
    t.set_defaults(func=cmd_tokenizer_train)
    e = tks.add_parser("eval", help="bytes per token and round-trip check on a corpus")
    add_flags(e, TokenizerEvalOptions)
    add_flags(e, CorpusOptions, group="corpus", skip=TOKENIZER_FIXED)
    e.set_defaults(func=cmd_tokenizer_eval)

    pr = sub.add_parser("prepare", help="tokenize a corpus into token shards")
    add_flags(pr, PrepareOptions)
    add_flags(pr, CorpusOptions, group="corpus")
    pr.set_defaults(func=cmd_prepare)

    ms = sub.add_parser("make-sft", help="mine chat instruction pairs (signature + doc -> the real function) "
                        "from Go/Python code")
    add_flags(ms, SftOptions)
    ms.set_defaults(func=cmd_make_sft)

    mpp = sub.add_parser("make-pairs", help="preference pairs from Go/Python code: the real function "
                         "(chosen) against a broken variant (rejected), for --stage reward and dpo")
    add_flags(mpp, PairsOptions)
    mpp.set_defaults(func=cmd_make_pairs)

    mk = sub.add_parser("make-tasks", help="small programming tasks with hidden tests (string, list, "
                        "arithmetic, dict; 3 levels), for --stage ppo and grpo and `eval --tasks`")
    add_flags(mk, TasksOptions)
    mk.set_defaults(func=cmd_make_tasks)

    mt = sub.add_parser("make-tools", help="synthetic tool-calling conversations (code tools: run tests, "
                        "read files, search code, evaluate expressions)")
    add_flags(mt, ToolsOptions)
    mt.set_defaults(func=cmd_make_tools)

    d = sub.add_parser("data", help="inspect prepared data")
    ds = d.add_subparsers(dest="data_command", required=True)
    di = ds.add_parser("info", help="counts and a decoded sample")
    add_flags(di, DataInfoOptions)
    di.set_defaults(func=cmd_data_info)


def add_plans_parser(sub) -> None:
    mp = sub.add_parser("make-plans", help="mine (prompt, plan, body) records from Go/Python functions for "
                        "the hierarchical model: the plan is the body's statement skeleton")
    add_flags(mp, PlansOptions)
    mp.set_defaults(func=cmd_make_plans)


def cmd_make_plans(a: argparse.Namespace) -> int:
    from ..mining.plans import write_plans
    o = from_args(PlansOptions, a, "make-plans")
    st = write_plans(o.input, o.out, overwrite=o.overwrite, languages=o.languages,
                     max_examples=o.max_examples, val_fraction=o.val_fraction, max_chars=o.max_chars,
                     max_plan_words=o.max_plan_words, exclude_tests=o.exclude_tests, seed=o.seed)
    print(f"mined {st['examples']} plan records from {st['functions']} functions in {st['files']} files "
          f"(train {st['train']}, val {st['val']}, plans cut {st['truncated_plans']}) -> {o.out}")
    if st.get("skipped"):
        print("  skipped functions: " + ", ".join(f"{k} {v}" for k, v in st["skipped"].items()))
    if st.get("corpus_skipped"):
        print("  skipped files: " + ", ".join(f"{k} {v}" for k, v in st["corpus_skipped"].items()))
    print("  example record:\n" + json.dumps(st["example"], indent=2, ensure_ascii=False))
    return 0
