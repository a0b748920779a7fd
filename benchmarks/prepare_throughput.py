"""`codeforge prepare` end to end vs the tokenizer's raw `encode_batch` on the same files.

The raw figure encodes texts already in memory (no reading, filtering, dedup or writing), batched as the
pipeline batches them, on all cores; the ratio says how much of the tokenizer's speed the pipeline keeps.
Peak memory is the process's max RSS.

    python benchmarks/prepare_throughput.py [--input DIR ...] [--tokenizer DIR] [--languages go]
"""

from __future__ import annotations

import argparse
import glob
import os
import resource
import sys
import tempfile
import time

from codeforge.corpus import CorpusOptions, CorpusStats, iter_documents
from codeforge.data.shards import prepare
from codeforge.tokenizer import CodeTokenizer, train_tokenizer


def main() -> None:
    ap = argparse.ArgumentParser()
    roots = sorted(glob.glob("/usr/share/go-*/src"))
    ap.add_argument("--input", nargs="+", default=roots[-1:] or [os.path.dirname(os.__file__)])
    ap.add_argument("--languages", nargs="+", default=None)
    ap.add_argument("--tokenizer", default=None, help="default: train a 32k one on the input first")
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()
    opts = CorpusOptions(languages=a.languages)
    with tempfile.TemporaryDirectory() as tmp:
        tok_dir = a.tokenizer or os.path.join(tmp, "tok")
        if not a.tokenizer:
            train_tokenizer((d.text for d in iter_documents(a.input, opts, CorpusStats())), 32000, tok_dir)
        tok = CodeTokenizer.load(tok_dir)
        texts = [d.text for d in iter_documents(a.input, opts, CorpusStats())]
        n_bytes = sum(len(t.encode()) for t in texts)
        raw_best = pipe_best = 0.0
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            n_tok = 0
            for i in range(0, len(texts), 512):
                n_tok += sum(map(len, tok.encode_batch(texts[i:i + 512])))
            raw_best = max(raw_best, n_bytes / (time.perf_counter() - t0))
        for r in range(a.repeats):
            t0 = time.perf_counter()
            meta = prepare(a.input, tok_dir, os.path.join(tmp, f"data{r}"), opts, log=lambda *x: None)
            pipe_best = max(pipe_best, meta["bytes"] / (time.perf_counter() - t0))
        rss_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"input: {a.input}  {len(texts)} documents, {n_bytes / 1e6:.1f} MB, {n_tok:,} tokens, "
          f"{os.cpu_count()} cores, python {sys.version.split()[0]}")
    print(f"{'path':28s} {'MB/s':>8s} {'tokens/s':>12s}")
    tpb = n_tok / n_bytes
    print(f"{'raw encode_batch':28s} {raw_best / 1e6:8.2f} {raw_best * tpb:12,.0f}")
    print(f"{'codeforge prepare (e2e)':28s} {pipe_best / 1e6:8.2f} {pipe_best * tpb:12,.0f}")
    print(f"ratio: {pipe_best / raw_best:.1%} of raw; peak RSS {rss_gib:.2f} GiB (includes the in-memory "
          f"copy of the corpus the raw baseline needs)")


if __name__ == "__main__":
    main()
