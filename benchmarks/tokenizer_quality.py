"""Bytes per token on held-out code: codeforge's code pre-tokenizer vs GPT-2's byte-level rule.

Trains both at the same vocab on a corpus minus held-out top-level directories, then encodes the held-out
directories. Default: the Go standard library (`apt-get install golang-src`), holding out net/ and crypto/.

    python benchmarks/tokenizer_quality.py [--root /usr/share/go-1.19/src] [--vocab-size 32000]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import tempfile
import time

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from codeforge.corpus import CorpusOptions, CorpusStats, iter_documents
from codeforge.tokenizer import SPECIAL_TOKENS, CodeTokenizer, evaluate_tokenizer, train_tokenizer


def main() -> None:
    ap = argparse.ArgumentParser()
    roots = sorted(glob.glob("/usr/share/go-*/src")) or sorted(glob.glob("/usr/lib/go-*/src"))
    ap.add_argument("--root", default=roots[-1] if roots else None)
    ap.add_argument("--language", default="go")
    ap.add_argument("--holdout", nargs="+", default=["net", "crypto"])
    ap.add_argument("--vocab-size", type=int, default=32000)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if not a.root or not os.path.isdir(a.root):
        raise SystemExit("no Go source found: apt-get install golang-src, or pass --root DIR")
    dirs = sorted(d for d in os.listdir(a.root) if os.path.isdir(os.path.join(a.root, d)))
    train = [os.path.join(a.root, d) for d in dirs if d not in a.holdout]
    held = [os.path.join(a.root, d) for d in dirs if d in a.holdout]
    opts = CorpusOptions(languages=[a.language], exclude_tests=True)
    train_texts = [d.text for d in iter_documents(train, opts, CorpusStats())]
    held_texts = [d.text for d in iter_documents(held, opts, CorpusStats())]

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        tok, meta = train_tokenizer(iter(train_texts), a.vocab_size, os.path.join(tmp, "codeforge"))
        r = evaluate_tokenizer(tok, held_texts)
        rows.append({"tokenizer": "codeforge (code pre-tokenizer)", "train_s": time.perf_counter() - t0, **r})

        # Baseline: the GPT-2 byte-level regex, trained identically.
        g = Tokenizer(models.BPE())
        g.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        g.decoder = decoders.ByteLevel()
        t0 = time.perf_counter()
        g.train_from_iterator(iter(train_texts), trainers.BpeTrainer(
            vocab_size=a.vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
        os.makedirs(os.path.join(tmp, "gpt2rule"))
        g.save(os.path.join(tmp, "gpt2rule", "tokenizer.json"))
        r = evaluate_tokenizer(CodeTokenizer.load(os.path.join(tmp, "gpt2rule")), held_texts)
        rows.append({"tokenizer": "GPT-2 byte-level rule", "train_s": time.perf_counter() - t0, **r})

    train_mb = sum(len(t.encode()) for t in train_texts) / 1e6
    if a.json:
        print(json.dumps({"train_mb": train_mb, "rows": rows}))
        return
    print(f"train: {len(train_texts)} files, {train_mb:.1f} MB from {a.root} minus {a.holdout}; "
          f"held out: {len(held_texts)} files; vocab {a.vocab_size}")
    print(f"{'tokenizer':34s} {'train s':>8s} {'bytes/token':>12s} {'round-trip':>10s}")
    for r in rows:
        print(f"{r['tokenizer']:34s} {r['train_s']:8.1f} {r['bytes_per_token']:12.3f} "
              f"{'ok' if r['roundtrip_ok'] else 'FAIL':>10s}")


if __name__ == "__main__":
    main()
