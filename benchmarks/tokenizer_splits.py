"""Bytes per token on held-out Go and Python for codeforge's code split and the pre-tokenizers llama.cpp
implements (the regexes of llama.cpp's src/llama-vocab.cpp, as the models' tokenizer.json files write them).

For each language, the corpus is split by top-level directory: the held-out directories are never seen in
training. Each split trains a byte-level BPE at each vocab size on the same training text (capped at
--train-mb), then encodes the held-out text. Splits with several regexes apply them in turn, as llama.cpp
and HF's Sequence pre-tokenizer do.

    python benchmarks/tokenizer_splits.py [--vocab 8000 32000] [--train-mb 12] [--json]

Go: the Go standard library (`apt-get install golang-src`), holding out net/ and crypto/. Python: this
interpreter's standard library, holding out email/, asyncio/, json/, xml/ and the test suite's files.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import sysconfig
import time

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from codeforge.corpus import CorpusOptions, CorpusStats, iter_documents
from codeforge.tokenizer import CODE_SPLIT_PATTERN, SPECIAL_TOKENS

C = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
SPLITS = {
    "code (codeforge)": [CODE_SPLIT_PATTERN],
    "llama-bpe (llama3)": [C + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| "
                               r"?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
    "qwen2": [C + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
    "gpt-2": [r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"],
    "starcoder / refact / smollm / codeshell": [r"\p{N}", r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| "
                                                          r"?[^\s\p{L}\p{N}]+|\s+(?!\S)"],
    "deepseek-coder": [r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", r"[一-龥ࠀ-一가-퟿]+", r"\p{N}"],
    "seed-coder": [C + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+"],
    "gpt-4o": [r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+" + C + r"?"
               r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*" + C + r"?"
               r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
    "exaone-moe": [C
                   + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]?"
                   r"|\s*[\r\n]|\s+(?!\S)|\s+"],
}


def build(regexes: list[str]) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated", invert=False) for r in regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok


def corpus(language: str) -> tuple[list[str], list[str]]:
    if language == "go":
        roots = sorted(glob.glob("/usr/share/go-*/src")) or sorted(glob.glob("/usr/lib/go-*/src"))
        if not roots:
            raise SystemExit("no Go source: apt-get install golang-src")
        root, held = roots[-1], {"net", "crypto"}
    else:
        root, held = sysconfig.get_paths()["stdlib"], {"email", "asyncio", "json", "xml", "test"}
    opts = CorpusOptions(languages=[language], exclude_tests=(language == "go"))
    dirs = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d))
                  and d != "site-packages")
    train = [os.path.join(root, d) for d in dirs if d not in held]
    test = [os.path.join(root, d) for d in dirs if d in held]
    return ([d.text for d in iter_documents(train, opts, CorpusStats())],
            [d.text for d in iter_documents(test, opts, CorpusStats())])


def cap(texts: list[str], mb: float) -> list[str]:
    out, n = [], 0
    for t in texts:
        if n > mb * 2**20:
            break
        out.append(t)
        n += len(t.encode())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, nargs="+", default=[8000, 32000])
    ap.add_argument("--languages", nargs="+", default=["go", "python"])
    ap.add_argument("--train-mb", type=float, default=12.0)
    ap.add_argument("--splits", nargs="+", default=None, help="names (prefixes) of the splits to measure")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    rows = []
    for lang in a.languages:
        train, held = corpus(lang)
        train = cap(train, a.train_mb)
        held_bytes = sum(len(t.encode()) for t in held)
        print(f"{lang}: train {sum(len(t.encode()) for t in train) / 2**20:.1f} MB in {len(train)} files, "
              f"held out {held_bytes / 2**20:.1f} MB in {len(held)} files", file=sys.stderr)
        for name, regexes in SPLITS.items():
            if a.splits and not any(name.startswith(s) for s in a.splits):
                continue
            for vocab in a.vocab:
                tok = build(regexes)
                t0 = time.perf_counter()
                tok.train_from_iterator(iter(train), trainers.BpeTrainer(
                    vocab_size=vocab, min_frequency=2, special_tokens=SPECIAL_TOKENS,
                    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
                n_tok = sum(len(e.ids) for e in tok.encode_batch(held, add_special_tokens=False))
                row = {"language": lang, "split": name, "vocab": vocab, "bytes_per_token": held_bytes / n_tok,
                       "train_s": round(time.perf_counter() - t0, 1)}
                rows.append(row)
                print(f"  {name:42s} {vocab:6d}  {row['bytes_per_token']:.3f} bytes/token", file=sys.stderr)
    if a.json:
        print(json.dumps(rows))
        return
    base = {(r["language"], r["vocab"]): r["bytes_per_token"] for r in rows if r["split"].startswith("code")}
    cols = [(lang, v) for lang in a.languages for v in a.vocab]
    print("| split | " + " | ".join(f"{lang} {v // 1000}k" for lang, v in cols) + " |")
    print("| --- |" + " --- |" * len(cols))
    for name in dict.fromkeys(r["split"] for r in rows):
        cells = []
        for lang, v in cols:
            r = next((r for r in rows if r["split"] == name and r["language"] == lang and r["vocab"] == v),
                     None)
            if r is None:
                cells.append("")
                continue
            b = base.get((lang, v))
            cells.append(f"{r['bytes_per_token']:.3f}"
                         + (f" ({(r['bytes_per_token'] / b - 1) * 100:+.1f}%)" if b else ""))
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
