"""The `codeforge` command: parse arguments, call the library, print. No work happens here."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


class CLIError(Exception):
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

    tok, meta = train_tokenizer(texts(), a.vocab_size, a.out, show_progress=sys.stderr.isatty())
    print(f"trained tokenizer: vocab {meta['vocab_size']} on {meta['train_documents']} documents "
          f"({meta['train_bytes'] / 1e6:.1f} MB) in {meta['train_seconds']:.1f}s -> {a.out} (hash {meta['hash']})")
    if stats.skipped:
        print(f"skipped: {dict(stats.skipped)}")
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
    from .shards import prepare
    if a.workers:
        # Rust's thread pool reads this once, before the first parallel encode.
        os.environ["RAYON_NUM_THREADS"] = str(a.workers)
    opts = _corpus_opts(a, dedup=a.dedup, val_fraction=a.val_fraction)
    meta = prepare(a.input, a.tokenizer, a.out, opts, overwrite=a.overwrite, shard_tokens=a.shard_tokens)
    _print_data_info(meta, a.out, sample=False)
    return 0


def _print_data_info(meta: dict, path: str, sample: bool = True) -> None:
    print(f"{path}: {meta['documents']} documents, {meta['tokens']:,} tokens, {meta['bytes'] / 1e6:.1f} MB, "
          f"dtype {meta['dtype']}, tokenizer {meta['tokenizer_hash']}")
    for s, v in meta["splits"].items():
        print(f"  {s:5s}: {v['documents']} documents, {v['tokens']:,} tokens in {len(v['shards'])} shard(s)")
    if meta.get("skipped"):
        print("  skipped: " + ", ".join(f"{k} {v}" for k, v in meta["skipped"].items()))
    print(f"  prepared in {meta['seconds']}s ({meta['mb_per_s']} MB/s, {meta['tokens_per_s']:,} tokens/s)")
    if sample:
        from .shards import ShardSet
        from .tokenizer import CodeTokenizer
        ss = ShardSet(path, "train")
        tok = CodeTokenizer.load(os.path.join(path, "tokenizer"))
        print("  sample of the first document:\n" + "\n".join(
            "    | " + line for line in tok.decode(ss.arrays[0][:64].tolist()).splitlines()))


def cmd_data_info(a: argparse.Namespace) -> int:
    from .shards import ShardSet
    _print_data_info(ShardSet(a.dir).meta, a.dir)
    return 0


# -- parser ----------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="codeforge", description="Train code language models from scratch.")
    sub = p.add_subparsers(dest="command", required=True)

    tk = sub.add_parser("tokenizer", help="train or evaluate a byte-level BPE code tokenizer")
    tks = tk.add_subparsers(dest="tokenizer_command", required=True)
    t = tks.add_parser("train", help="train a tokenizer from a corpus")
    _corpus_args(t)
    t.add_argument("--vocab-size", type=int, default=32000)
    t.add_argument("--out", required=True)
    t.add_argument("--max-train-bytes", type=float, default=None, help="stop reading after this many characters")
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
    pr.set_defaults(func=cmd_prepare)

    d = sub.add_parser("data", help="inspect prepared data")
    ds = d.add_subparsers(dest="data_command", required=True)
    di = ds.add_parser("info", help="counts and a decoded sample")
    di.add_argument("dir")
    di.set_defaults(func=cmd_data_info)

    _register_later_commands(sub)
    return p


def _register_later_commands(sub) -> None:
    """Training, evaluation and generation commands (they import torch lazily)."""
    try:
        from .cli_train import register
    except ImportError:
        return
    register(sub)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from .corpus import CorpusError
    from .shards import ShardError
    from .tokenizer import TokenizerError
    known: tuple[type[BaseException], ...] = (CLIError, CorpusError, ShardError, TokenizerError)
    try:
        from .config import ConfigError
        known += (ConfigError,)
    except ImportError:
        pass
    t0 = time.perf_counter()
    try:
        return args.func(args)
    except known as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"interrupted after {time.perf_counter() - t0:.0f}s", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
