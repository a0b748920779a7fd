"""Data commands: tokenizer train|eval, prepare, data info, and the miners make-sft, make-pairs, make-tasks,
make-tools, make-plans."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .. import CodeforgeError
from .args import corpus_args, corpus_opts


def cmd_tokenizer_train(a: argparse.Namespace) -> int:
    from ..corpus import CorpusStats, iter_documents
    from ..tokenizer import train_tokenizer
    opts = corpus_opts(a, dedup="exact", val_fraction=0.0)
    stats = CorpusStats()
    budget = int(a.max_train_bytes) if a.max_train_bytes else None

    def texts():
        seen = 0
        for d in iter_documents(a.input, opts, stats):
            yield d.text
            seen += len(d.text)
            if budget and seen >= budget:
                return

    tok, meta = train_tokenizer(texts(), a.vocab_size, a.out, show_progress=sys.stderr.isatty(),
                                overwrite=a.overwrite, split=a.split)
    print(f"trained tokenizer: vocab {meta['vocab_size']} on {meta['train_documents']} documents "
          f"({meta['train_bytes'] / 1e6:.1f} MB) in "
          f"{meta['train_seconds']:.1f}s -> {a.out} (hash {meta['hash']})")
    if stats.skipped:
        from ..corpus import describe_skipped
        print(f"skipped: {describe_skipped(stats.skipped)}")
    return 0


def cmd_tokenizer_eval(a: argparse.Namespace) -> int:
    from ..corpus import CorpusStats, iter_documents
    from ..tokenizer import CodeTokenizer, evaluate_tokenizer
    tok = CodeTokenizer.load(a.tokenizer)
    opts = corpus_opts(a, dedup="none", val_fraction=0.0)
    r = evaluate_tokenizer(tok, (d.text for d in iter_documents(a.input, opts, CorpusStats())))
    if a.json:
        print(json.dumps(r))
    else:
        print(f"{r['documents']} documents, {r['bytes'] / 1e6:.2f} MB, {r['tokens']} tokens: "
              f"{r['bytes_per_token']:.3f} bytes/token; round-trip "
              f"{'OK' if r['roundtrip_ok'] else 'FAILED on %d documents' % r['roundtrip_failures']}")
    return 0 if r["roundtrip_ok"] else 1


def cmd_prepare(a: argparse.Namespace) -> int:
    from ..data.shards import prepare
    if a.workers < 0 or a.tasks < 0:
        raise SystemExit("error: --workers and --tasks take a positive number (or 0: the default)")
    # benchmarks and secrets are taken out of code documents; chat JSONL (--chat) is read as conversations,
    # which these steps do not see yet, so its options do not claim them
    opts = corpus_opts(a, dedup=a.dedup, val_fraction=a.val_fraction,
                       decontaminate=[] if a.no_decontaminate or a.chat
                       else list(dict.fromkeys(a.decontaminate)),
                       redact_secrets=not a.keep_secrets and not a.chat,
                       redact_pii=a.redact_pii and not a.chat)
    if a.keep_secrets and not a.chat:
        print("WARNING: --keep-secrets: keys, tokens and passwords "
              "in these files go into the training data as "
              "they are; a model trained on it can complete them for anyone who prompts it", file=sys.stderr)
    if a.no_decontaminate:
        print("warning: --no-decontaminate: documents that overlap HumanEval or other benchmarks stay in the "
              "data, so scores on those benchmarks may count what the model read", file=sys.stderr)
    slurm = {"partition": a.slurm_partition, "time": a.slurm_time, "cpus_per_task": a.slurm_cpus,
             "mem_per_cpu_gb": a.slurm_mem_gb, "env_command": a.slurm_env}
    meta = prepare(a.input, a.tokenizer, a.out, opts, overwrite=a.overwrite, shard_tokens=a.shard_tokens,
                   chat=a.chat, repo_fim=a.repo_fim, workers=a.workers or None, executor=a.executor,
                   tasks=a.tasks or None, slurm=slurm)
    if meta is None:  # submitted to a cluster: its last job writes the dataset
        return 0
    _print_data_info(meta, a.out, sample=False)
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
    from ..mining.pairs import write_pairs, write_task_pairs
    if bool(a.input) == bool(a.tasks):
        raise CodeforgeError("make-pairs takes code (--input PATH ...) or tasks with solutions (--tasks "
                             "TASKS), one of the two")
    if a.tasks:
        st = write_task_pairs(a.tasks, a.out, overwrite=a.overwrite, seed=a.seed, per_task=a.per_function,
                              max_pairs=a.max_pairs, heldout_fraction=a.heldout_fraction)
        print(f"{st['pairs']} pairs (train {st['train']}, held out {st['heldout']}) from "
              f"{sum(st['tasks'].values())} tasks; every rejected side fails the task's tests -> {a.out}")
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
    from ..tasks.code_tasks import write_tasks
    st = write_tasks(a.out, n=a.count, seed=a.seed, overwrite=a.overwrite, validate=not a.no_validate)
    print(f"{st['kept']} tasks from {st['families']} families (train {st['train']}, held out {st['test']}; "
          f"{st['skipped']} skipped: their reference solution failed its tests) -> {a.out}")
    for sk in st["skipped_tasks"][:5]:
        print(f"  skipped {sk['id']}: {sk['reason']}")
    print(f"next: SFT on {a.out}/train.jsonl (`codeforge prepare --chat`), then codeforge train --stage grpo "
          f"--init-from SFT_RUN --data {a.out} --out RUN; codeforge eval --run RUN --tasks {a.out}")
    return 0


def cmd_make_tools(a: argparse.Namespace) -> int:
    from ..tasks.tool_calls import TOOLS_FILE, write_tool_data
    meta = write_tool_data(a.out, a.count, a.heldout, seed=a.seed, overwrite=a.overwrite)
    print(f"wrote {a.count} training and {a.heldout} held-out tool-calling conversations -> {a.out} (the "
          f"tools' schemas in {Path(a.out) / TOOLS_FILE}, for `codeforge chat --tools`)")
    if meta.get("kinds"):
        print(f"  kinds: {meta['kinds']}")
    return 0


def cmd_data_info(a: argparse.Namespace) -> int:
    from ..data.shards import ShardSet
    _print_data_info(ShardSet(a.dir).meta, a.dir)
    return 0


def add_parsers(sub) -> None:
    """tokenizer train|eval, prepare, make-sft, make-pairs, make-tasks, make-tools, data info."""
    tk = sub.add_parser("tokenizer", help="train or evaluate a byte-level BPE code tokenizer")
    tks = tk.add_subparsers(dest="tokenizer_command", required=True)
    t = tks.add_parser("train", help="train a tokenizer from a corpus")
    corpus_args(t)
    t.add_argument("--vocab-size", type=int, default=32000,
                   help="tokens in the vocabulary, special tokens included (default 32000)")
    t.add_argument("--out", required=True,
                   help="directory to write the tokenizer to (tokenizer.json and its settings)")
    t.add_argument("--max-train-bytes", type=float, default=None,
                   help="stop reading after this many characters")
    t.add_argument("--overwrite", action="store_true", help="replace what --out already holds")
    t.add_argument("--split", choices=["llama3", "code"], default="llama3",
                   help="pre-tokenizer rule: llama3 (default: what "
                        "llama.cpp implements, so the model exports to "
                        "GGUF) or code (identifiers with _ and digits whole, indentation after punctuation: "
                        "8-12%% fewer tokens on code, but no GGUF export)")
    t.set_defaults(func=cmd_tokenizer_train)
    e = tks.add_parser("eval", help="bytes per token and round-trip check on a corpus")
    corpus_args(e)
    e.add_argument("--tokenizer", required=True, help="directory holding tokenizer.json")
    e.add_argument("--json", action="store_true", help="print the numbers as one JSON object")
    e.set_defaults(func=cmd_tokenizer_eval)

    pr = sub.add_parser("prepare", help="tokenize a corpus into token shards")
    corpus_args(pr)
    pr.add_argument("--tokenizer", required=True, help="directory holding tokenizer.json")
    pr.add_argument("--out", required=True,
                    help="directory to write the token shards, the tokenizer copy and meta.json to")
    pr.add_argument("--decontaminate", nargs="+", default=["humaneval"], metavar="SRC",
                    help="drop every document that shares a 13-token run, or most of a solution's "
                         "shape (names and layout aside), with a benchmark: humaneval (the default), "
                         "a JSONL file of benchmark records (every string field), or a directory of held-out "
                         "files (those `eval --repo` will score); counted in the report")
    pr.add_argument("--no-decontaminate", action="store_true",
                    help="keep documents that overlap benchmarks (their later scores may then be inflated)")
    pr.add_argument("--keep-secrets", action="store_true",
                    help="keep API keys, tokens, private keys and "
                         "passwords found in the code (by default each is "
                         "replaced with a placeholder per kind, REDACTED_AWS_ACCESS_KEY, ..., and counted): "
                         "a model learns them and completes them for anyone")
    pr.add_argument("--redact-pii", action="store_true",
                    help="also replace e-mail addresses and public IP addresses (REDACTED_EMAIL_ADDRESS, "
                         "REDACTED_IP_ADDRESS; example domains and private, loopback and documentation "
                         "ranges stay), counted with the secrets")
    pr.add_argument("--repo-fim", type=float, default=0.0, metavar="SHARE",
                    help="also train repo-level fill-in-the-middle: this share of the training files (chosen "
                         "by hash) gets a second document with up to 2 "
                         "earlier files of its directory as context, in "
                         "the layout llama-server's /infill builds for editors (<|repo_name|>, <|file_sep|>; "
                         "default 0: off; the quickstart uses 0.25, the measured best)")
    pr.add_argument("--val-fraction", type=float, default=0.01,
                    help="share of documents kept for validation, chosen by a stable hash of each document "
                         "(default 0.01)")
    pr.add_argument("--dedup", choices=["none", "exact", "near"], default="exact",
                    help="drop duplicate documents: exact (same text), near (MinHash, similar text) or none "
                         "(default exact)")
    pr.add_argument("--workers", type=int, default=0,
                    help="processes working at once, one core each "
                         "(default: this machine's cores, one per 8 MB "
                         "of input at most; a single one then encodes on every core); the shards are the "
                         "same for any number")
    pr.add_argument("--executor", choices=["local", "slurm"], default="local",
                    help="local: a process pool here (default); slurm: one job array per stage, submitted "
                         "with sbatch (needs --slurm-partition), the last job writes --out")
    pr.add_argument("--tasks", type=int, default=0,
                    help="cut the corpus into this many tasks (default: about 32 MB of input each, 16 to "
                         "1000); the shards depend on it, so keep it when you rerun")
    pr.add_argument("--slurm-partition", default=None, help="--executor slurm: the partition the jobs run in")
    pr.add_argument("--slurm-time", default="04:00:00",
                    help="--executor slurm: time limit per job (default 04:00:00)")
    pr.add_argument("--slurm-cpus", type=int, default=1, help="--executor slurm: CPUs per task (default 1)")
    pr.add_argument("--slurm-mem-gb", type=int, default=2,
                    help="--executor slurm: memory per CPU in GB (default 2)")
    pr.add_argument("--slurm-env", default=None,
                    help="--executor slurm: the shell command a job runs first (default: activate the "
                         "virtual environment this command runs in, if any)")
    pr.add_argument("--shard-tokens", type=int, default=100_000_000,
                    help="tokens per shard file (default 100,000,000)")
    pr.add_argument("--overwrite", action="store_true", help="replace an existing, different dataset")
    pr.add_argument("--chat", action="store_true",
                    help="inputs are chat JSONL ({\"messages\": [...], \"tools\": "
                    "[...]}); render with ChatML and write a loss "
                    "mask (assistant turns only) for --stage sft/tools")
    pr.set_defaults(func=cmd_prepare)

    ms = sub.add_parser("make-sft",
                        help="mine chat instruction pairs (signature + doc -> the real function) from "
                                         "Go/Python code")
    ms.add_argument("--input", nargs="+", required=True, metavar="PATH", help="directories or files of code")
    ms.add_argument("--out", required=True, help="directory: train.jsonl, heldout.jsonl, meta.json")
    ms.add_argument("--languages", nargs="+", default=None, choices=["go", "python"],
                    help="mine only these languages (default: both)")
    ms.add_argument("--max-examples", type=int, default=0, help="cap on pairs (0: all)")
    ms.add_argument("--heldout-fraction", type=float, default=0.05,
                    help="share of examples held out for evaluation (default 0.05)")
    ms.add_argument("--max-chars", type=int, default=4000, help="skip longer functions")
    ms.add_argument("--include-tests", action="store_true", help="also mine test files")
    ms.add_argument("--seed", type=int, default=0,
                    help="random seed: the same seed writes the same examples (default 0)")
    ms.add_argument("--overwrite", action="store_true", help="replace an existing --out directory")
    ms.set_defaults(func=cmd_make_sft)

    mpp = sub.add_parser("make-pairs",
                         help="preference pairs from Go/Python code: the real function (chosen) "
                                            "against a broken variant (rejected), for --stage reward and dpo")
    mpp.add_argument("--input", nargs="+", default=None, metavar="PATH", help="directories or files of code")
    mpp.add_argument("--tasks", default=None, metavar="TASKS",
                     help="instead of code: tasks with reference "
                          "solutions (a `codeforge make-tasks` directory's "
                          "train split, or JSONL); every rejected variant is run and must fail the tests")
    mpp.add_argument("--out", required=True, help="directory: train.jsonl, heldout.jsonl, meta.json")
    mpp.add_argument("--languages", nargs="+", default=None, choices=["go", "python"],
                     help="mine only these languages (default: both)")
    mpp.add_argument("--max-pairs", type=int, default=0, help="cap on pairs (0: all)")
    mpp.add_argument("--per-function", type=int, default=1, help="broken variants per function")
    mpp.add_argument("--heldout-fraction", type=float, default=0.05,
                     help="share of pairs held out for evaluation (default 0.05)")
    mpp.add_argument("--seed", type=int, default=0,
                     help="random seed: the same seed writes the same pairs (default 0)")
    mpp.add_argument("--overwrite", action="store_true", help="replace an existing --out directory")
    mpp.set_defaults(func=cmd_make_pairs)

    mk = sub.add_parser("make-tasks",
                        help="small programming tasks with hidden tests (string, list, arithmetic, "
                                           "dict; 3 levels), for --stage ppo and grpo and `eval --tasks`")
    mk.add_argument("--out", required=True, help="directory: train.jsonl, heldout.jsonl, meta.json")
    mk.add_argument("--count", type=int, default=2000, help="tasks in all (about a fifth are held out)")
    mk.add_argument("--seed", type=int, default=0,
                    help="random seed: the same seed writes the same tasks (default 0)")
    mk.add_argument("--no-validate", action="store_true",
                    help="skip running every reference solution against its tests in the sandbox")
    mk.add_argument("--overwrite", action="store_true", help="replace an existing --out directory")
    mk.set_defaults(func=cmd_make_tasks)

    mt = sub.add_parser("make-tools",
                        help="synthetic tool-calling conversations (code tools: run tests, read "
                                           "files, search code, evaluate expressions)")
    mt.add_argument("--out", required=True, help="directory: train.jsonl, heldout.jsonl, meta.json")
    mt.add_argument("--count", type=int, default=2000, help="training conversations")
    mt.add_argument("--heldout", type=int, default=200, help="held-out conversations")
    mt.add_argument("--seed", type=int, default=0,
                    help="random seed: the same seed writes the same conversations (default 0)")
    mt.add_argument("--overwrite", action="store_true", help="replace an existing --out directory")
    mt.set_defaults(func=cmd_make_tools)

    d = sub.add_parser("data", help="inspect prepared data")
    ds = d.add_subparsers(dest="data_command", required=True)
    di = ds.add_parser("info", help="counts and a decoded sample")
    di.add_argument("dir", help="a prepared data directory (from `codeforge prepare` or make-plans)")
    di.set_defaults(func=cmd_data_info)


def add_plans_parser(sub) -> None:
    mp = sub.add_parser("make-plans",
                        help="mine (prompt, plan, body) records from Go/Python functions for the "
                                           "hierarchical model: the plan is the body's statement skeleton")
    mp.add_argument("--input", nargs="+", required=True, metavar="PATH", help="directories or files of code")
    mp.add_argument("--out", required=True, help="directory: train.jsonl, val.jsonl, meta.json")
    mp.add_argument("--languages", nargs="+", default=None, choices=["go", "python"],
                    help="mine only these languages (default: both)")
    mp.add_argument("--max-examples", type=int, default=0, help="cap on records (0: all)")
    mp.add_argument("--val-fraction", type=float, default=0.05,
                    help="share of functions kept for validation (default 0.05)")
    mp.add_argument("--max-chars", type=int, default=4000, help="skip longer functions")
    mp.add_argument("--max-plan-words", type=int, default=128, help="cut longer plans (ending them with ...)")
    mp.add_argument("--exclude-tests", action="store_true",
                    help="skip test files (_test.go, test_*.py, tests/)")
    mp.add_argument("--seed", type=int, default=0, help="0: the split make-sft uses; another value salts it")
    mp.add_argument("--overwrite", action="store_true", help="replace an existing --out directory")

    mp.set_defaults(func=cmd_make_plans)


def cmd_make_plans(a: argparse.Namespace) -> int:
    from ..mining.plans import write_plans
    st = write_plans(a.input, a.out, overwrite=a.overwrite, languages=a.languages,
                     max_examples=a.max_examples,
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
