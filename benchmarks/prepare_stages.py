"""Where `codeforge prepare`'s time goes: each step of the pipeline timed alone on the same documents, in one
process, against the raw tokenizer and the whole command.

    python benchmarks/prepare_stages.py [--input DIR ...] [--tokenizer DIR] [--dedup near] [--json]
    python benchmarks/prepare_stages.py --profile secrets        # cProfile of one stage (or `prepare`)
    python benchmarks/prepare_stages.py --diagnose               # what the slow stages spend it on

Inputs: three directories of Go's standard library (net, go, crypto: ~8 MB of .go) where it is installed,
else the Python standard library's json, asyncio and email. Tokenizer: --tokenizer DIR (trained there with
codeforge's API, vocab 8192, when DIR does not exist yet; a temporary one when not given).

1. The whole command, `python -m codeforge prepare` with every hygiene step on (its defaults: HumanEval
   decontamination, secrets replaced; plus --dedup near unless --dedup says otherwise), each a fresh process:
   --workers 1 and the default. Wall time, MB/s of the bytes kept, and the engine's own line per stage.
2. The steps alone on documents held in memory, ONE process, no pool, in pipeline order: walk (the plan),
   read + decode (the read stage's reader, steps._read_inside), quality filters (corpus.reject_reason),
   content hash, exact-dedup signature (the engine's xxhash of the text), MinHash signature (shingles,
   hashes, the 128 minima: CodeMinhashSignature), the benchmark index (built once per process) and filter
   (decontam `benchmarks(...).hit`), secrets (corpus.scrub with prepare's options), encode (encode_batch in
   EncodeShards' batches, one thread: a worker is a core) and the shard writer (SplitWriter.add, close).
   A step sees the documents the one before it kept (near duplicates: those the whole command dropped).
3. The raw tokenizer: the kept texts, already in memory, through the same encode_batch in the same batches,
   on one thread and on every core (TOKENIZERS_PARALLELISM).

MB/s is the step's input bytes over its seconds (best of --repeats); CPU s is the process's CPU time (all
threads), steadier than wall time on a loaded machine. The load average is printed before and after.
"""

from __future__ import annotations

import argparse
import cProfile
import glob
import io
import json
import os
import pstats
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np
from datatrove.data import Document as EngineDocument

from codeforge.corpus import (CorpusOptions, CorpusStats, content_hash, iter_documents, read_unit,
                              reject_reason, scrub, source_units, split_of)
from codeforge.data.options import PrepareOptions
from codeforge.data.steps import (EXACT, CodeMinhashSignature, ExactSignature, _read_inside, minhash_config)
from codeforge.data.writer import BATCH_BYTES, SPLITS, SplitWriter, dtype_for
from codeforge.decontam import Benchmarks
from codeforge.tokenizer import CodeTokenizer, train_tokenizer

ROOT = Path(__file__).resolve().parent.parent
GO_DIRS = ("net", "go", "crypto")
PY_DIRS = ("json", "asyncio", "email")
STAGES = ("walk", "read", "quality", "hash", "exact", "minhash", "bench_index", "benchmarks", "secrets",
          "encode", "write")
LABELS = {"walk": "walk (plan)", "read": "read + decode", "quality": "quality filters",
          "hash": "content hash", "exact": "exact-dedup signature", "minhash": "MinHash signature",
          "bench_index": "benchmark index (once a process)", "benchmarks": "benchmark filter",
          "secrets": "secrets", "encode": "encode (1 thread)", "write": "shard writing"}
STAGE_LINE = re.compile(r"^\s+(\w+)\s+(\d+) task\(s\) on (.+?)(?:, \d+ done before)?: ([\d.]+)s$")


def default_inputs() -> list[str]:
    for root in sorted(glob.glob("/usr/lib/go*/src") + glob.glob("/usr/share/go*/src")):
        dirs = [os.path.join(root, d) for d in GO_DIRS]
        if all(os.path.isdir(d) for d in dirs):
            return dirs
    lib = os.path.dirname(os.__file__)
    return [os.path.join(lib, d) for d in PY_DIRS]


def prepare_options(dedup: str, pii: bool) -> CorpusOptions:
    """The corpus options `codeforge prepare` builds from its defaults (data/options.py: HumanEval out,
    secrets replaced), with --dedup and --redact-pii as given."""
    return PrepareOptions().corpus(CorpusOptions(dedup=dedup, redact_pii=pii))


def best_of(fn, repeats: int):
    """(wall s, CPU s, fn's result) of the fastest of `repeats` calls."""
    best = None
    for _ in range(max(1, repeats)):
        w0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
        if best is None or wall < best[0]:
            best = (wall, cpu, out)
    return best


def batches(texts: list[str]):
    """EncodeShards' batches: 512 documents or BATCH_BYTES of text, whichever comes first."""
    batch, size = [], 0
    for t in texts:
        batch.append(t)
        size += len(t.encode("utf-8"))
        if len(batch) >= 512 or size >= BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


class Parallelism:
    """TOKENIZERS_PARALLELISM set for a while (the Rust encoder reads it on every batch call)."""

    def __init__(self, on: bool):
        self.on = on

    def __enter__(self):
        self.before = os.environ.get("TOKENIZERS_PARALLELISM")
        os.environ["TOKENIZERS_PARALLELISM"] = "true" if self.on else "false"

    def __exit__(self, *exc):
        if self.before is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = self.before


# -- the whole command -------------------------------------------------------------------------------------

def run_command(inputs: list[str], tok_dir: str, opts: CorpusOptions, workers: int | None, tmp: Path) -> dict:
    """`python -m codeforge prepare` with prepare's hygiene defaults, a fresh process and output: wall time,
    the meta, the engine's stage lines, and the content-hash keys of the documents it kept."""
    out = tmp / f"e2e-{workers or 'default'}"
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "codeforge", "prepare", "--input", *inputs, "--tokenizer", tok_dir,
           "--out", str(out), "--dedup", opts.dedup]
    if opts.redact_pii:
        cmd.append("--redact-pii")
    if workers:
        cmd += ["--workers", str(workers)]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if p.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    meta = json.loads((out / "meta.json").read_text())
    stages = [{"stage": m[1], "tasks": int(m[2]), "on": m[3], "seconds": float(m[4])}
              for m in map(STAGE_LINE.match, p.stdout.splitlines()) if m]
    keys = set()
    for s in SPLITS:
        keys.update(np.load(out / f"{s}_digests.npy").tolist())
    shutil.rmtree(out, ignore_errors=True)
    return {"workers": workers or "default", "command": " ".join(cmd[1:]), "wall_s": wall,
            "meta_seconds": meta["seconds"], "bytes": meta["bytes"], "documents": meta["documents"],
            "tokens": meta["tokens"], "skipped": meta["skipped"], "secrets": meta["secrets_replaced"],
            "steps": meta["steps"], "stages": stages, "mb_per_s": meta["bytes"] / 1e6 / wall, "keys": keys}


# -- the steps alone ---------------------------------------------------------------------------------------

class Steps:
    """The documents at each point of the pipeline, read once, and a function per step that does that step's
    work on them (its input made before, untimed)."""

    def __init__(self, inputs: list[str], opts: CorpusOptions, tok: CodeTokenizer, kept_keys: set | None):
        self.inputs, self.opts, self.tok = inputs, opts, tok
        self.units = self.walk()
        self.docs = self.read()
        self.kept = [d for d, r in zip(self.docs, self.quality()) if not r]
        for d, h in zip(self.kept, self.hash()):
            d.digest = h
        self.engine_docs = [EngineDocument(text=d.text, id=f"0/{i}", metadata={"source": d.source,
                                                                             "nbytes": d.nbytes})
                            for i, d in enumerate(self.kept)]
        seen: set[bytes] = set()
        self.unique = []  # exact dedup: the first in reading order
        for d in self.kept:
            if d.digest not in seen and not (opts.dedup == "none"):
                seen.add(d.digest)
                self.unique.append(d)
            elif opts.dedup == "none":
                self.unique.append(d)
        self.minhasher = CodeMinhashSignature(tempfile.gettempdir(), minhash_config(opts.near_threshold))
        self.bench = Benchmarks(tuple(opts.decontaminate)) if opts.decontaminate else None
        # near duplicates: what the whole command dropped that the benchmark filter does not (its kept keys)
        if opts.dedup == "near" and kept_keys is not None:
            self.deduped = [d for d in self.unique if int.from_bytes(d.digest[:8], "big") in kept_keys
                            or (self.bench is not None and self.bench.hit(d.text))]
        else:
            self.deduped = self.unique
        hits = self.benchmarks()
        self.clean = [d for d, h in zip(self.deduped, hits) if not h]
        self.final = []
        for d, (text, found) in zip(self.clean, self.secrets()):
            self.final.append(d if not found else type(d)(text, d.source, digest=d.digest))
        self.final_texts = [d.text for d in self.final]
        self.ids = self.encode()

    def bytes_in(self, stage: str) -> int:
        docs = {"walk": None, "read": None, "quality": self.docs, "hash": self.kept, "exact": self.kept,
                "minhash": self.unique, "bench_index": None, "benchmarks": self.deduped, "secrets": self.clean,
                "encode": self.final, "write": self.final}[stage]
        if docs is None:
            return sum(d.nbytes for d in self.docs)
        return sum(d.nbytes for d in docs)

    def walk(self):
        stats = CorpusStats()
        return [u for src in self.inputs for u in source_units(src, self.opts, stats)]

    def read(self):
        stats, out = CorpusStats(), []
        for path, tree, _ in self.units:
            docs = read_unit(path, None, self.opts, stats) if tree is None else \
                _read_inside(path, tree, self.opts, stats)
            out.extend(docs)
        return out

    def quality(self):
        opts = self.opts
        return [reject_reason(d.text, opts) for d in self.docs]

    def hash(self):
        return [content_hash(d.text) for d in self.kept]

    def exact(self):
        sig = ExactSignature(tempfile.gettempdir(), config=EXACT)
        return [h for i, doc in enumerate(self.engine_docs) for h in sig.get_hashes(doc, i)]

    def minhash(self):
        m, out = self.minhasher, []
        for d in self.unique:
            sh = m.get_shingles(d.text)
            if sh.size:
                out.append(m.get_signature(sh))
        return out

    def bench_index(self):
        return Benchmarks(tuple(self.opts.decontaminate)) if self.opts.decontaminate else None

    def benchmarks(self):
        if self.bench is None:
            return [None] * len(self.deduped)
        hit = self.bench.hit
        return [hit(d.text) for d in self.deduped]

    def secrets(self):
        opts = self.opts
        if not (opts.redact_secrets or opts.redact_pii):
            return [(d.text, Counter()) for d in self.clean]
        return [scrub(d.text, d.source, opts) for d in self.clean]

    def encode(self):
        with Parallelism(False):
            return [ids for b in batches(self.final_texts) for ids in self.tok.encode_batch(b)]

    def write(self):
        """EncodeShards' flush after the encoder: the end-of-text id, the split by content hash, one
        SplitWriter.add per split and batch, then close (offsets and hashes saved)."""
        tmp = Path(tempfile.mkdtemp(prefix="prepare-stages-"))
        try:
            dtype = dtype_for(self.tok.vocab_size)
            writers = {s: SplitWriter(tmp, s, dtype, 100_000_000) for s in SPLITS}
            i, eot = 0, self.tok.eot_id
            for b in batches(self.final_texts):
                out = {s: ([], [], []) for s in SPLITS}
                for doc, ids in zip(self.final[i:i + len(b)], self.ids[i:i + len(b)]):
                    ids = ids + [eot]
                    docs, nb, dg = out[split_of(doc.digest, self.opts.val_fraction)]
                    docs.append(ids)
                    nb.append(doc.nbytes)
                    dg.append(doc.digest)
                for s, (docs, nb, dg) in out.items():
                    if docs:
                        writers[s].add(docs, sum(nb), digests=dg)
                i += len(b)
            return {s: w.close() for s, w in writers.items()}
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def raw(self, parallel: bool) -> int:
        """The raw tokenizer on the final texts, in the same batches; the token count."""
        with Parallelism(parallel):
            return sum(len(ids) for b in batches(self.final_texts) for ids in self.tok.encode_batch(b))


def time_steps(steps: Steps, repeats: int, dedup: str) -> list[dict]:
    rows = []
    for stage in STAGES:
        if stage == "minhash" and dedup != "near":
            continue
        if stage in ("bench_index", "benchmarks") and steps.bench is None:
            continue
        wall, cpu, _ = best_of(getattr(steps, stage), repeats)
        rows.append({"stage": LABELS[stage], "key": stage, "seconds": wall, "cpu_s": cpu,
                     "bytes_in": steps.bytes_in(stage)})
    total = sum(r["seconds"] for r in rows)
    for r in rows:
        r["mb_per_s"] = r["bytes_in"] / 1e6 / r["seconds"] if r["seconds"] else float("inf")
        r["share"] = r["seconds"] / total
    return rows


# -- diagnosis of the slow steps ---------------------------------------------------------------------------

def diagnose_secrets(steps: Steps) -> dict:
    """Where the secrets step's time goes and how many documents and lines reach each of its parts: the
    PEM check, the marking scan (MARK_WORDS/MARK_FORMATS), detect-secrets' line scan (its plugins) on the
    marked lines, and our own patterns on them."""
    from codeforge import redact as R
    settings, transient, line_scan, _, _ = R._detector()
    docs = steps.clean
    t0 = time.perf_counter()
    marks = [R._marked_lines(d.text) for d in docs]
    t_mark = time.perf_counter() - t0
    lines_total = sum(d.text.count("\n") + 1 for d in docs)
    marked_docs = [(d, m) for d, m in zip(docs, marks) if m]
    n_marked = sum(len(m) for _, m in marked_docs)
    ds_found, ds_docs, t_ds, t_pat, pat_found = Counter(), 0, 0.0, 0.0, 0
    per_plugin_lines: Counter = Counter()
    for d, m in marked_docs:
        lines = d.text.split("\n")
        cands = [(i + 1, lines[i]) for i in m]
        scan_as, config = R._scan_name(d.source, d.text)
        t0 = time.perf_counter()
        with transient(settings):
            got = list(line_scan(cands, scan_as))
        t_ds += time.perf_counter() - t0
        if got:
            ds_docs += 1
        for s in got:
            ds_found[s.type] += 1
            per_plugin_lines[s.type] += 1
        t0 = time.perf_counter()
        for n, _ in cands:
            pat_found += sum(1 for _ in R._pattern_findings(lines, n - 1, config))
        t_pat += time.perf_counter() - t0
    redacted = sum(1 for _, f in (scrub(d.text, d.source, steps.opts) for d in docs) if f)
    words = sum(1 for d in docs for m in [R.MARK_WORDS.search(d.text.lower())] if m)
    formats = sum(1 for d in docs if R.MARK_FORMATS.search(d.text))
    return {"documents": len(docs), "lines": lines_total, "pem_docs": sum("PRIVATE KEY" in d.text for d in docs),
            "marked_documents": len(marked_docs), "marked_lines": n_marked,
            "docs_marked_by_words": words, "docs_marked_by_formats": formats,
            "mark_scan_s": t_mark, "detect_secrets_s": t_ds, "our_patterns_s": t_pat,
            "detect_secrets_findings": dict(ds_found), "detect_secrets_docs": ds_docs,
            "pattern_findings": pat_found, "documents_redacted": redacted}


def diagnose_benchmarks(steps: Steps) -> dict:
    """The benchmark filter's two checks apart: the word n-grams (a Python loop over every word) and the
    solution shapes (only documents with `def `)."""
    from codeforge import decontam as D
    b = steps.bench
    if b is None:
        return {}
    texts = [d.text for d in steps.deduped]
    t0 = time.perf_counter()
    words = sum(len(D.TOKEN.findall(t)) for t in texts)
    t_find = time.perf_counter() - t0
    t0 = time.perf_counter()
    w_hits = sum(1 for t in texts if b.word_hit(t))
    t_word = time.perf_counter() - t0
    t0 = time.perf_counter()
    s_hits = sum(1 for t in texts if b.shape_hit(t))
    t_shape = time.perf_counter() - t0
    with_def = sum(1 for t in texts if D._DEF.search(t))
    return {"documents": len(texts), "words": words, "grams_indexed": len(b.grams),
            "findall_s": t_find, "word_hit_s": t_word, "shape_hit_s": t_shape,
            "documents_with_def": with_def, "word_hits": w_hits, "shape_hits": s_hits}


# -- output ------------------------------------------------------------------------------------------------

def markdown(res: dict) -> str:
    out = [f"inputs: {' '.join(res['inputs'])}", f"options: {res['options']}",
           f"load average before {res['load_before']}, after {res['load_after']}; {res['cores']} cores",
           f"read: {res['documents_read']:,} documents, {res['input_bytes'] / 1e6:.2f} MB; kept (in memory): "
           f"{res['documents_kept']:,} documents, {res['kept_bytes'] / 1e6:.2f} MB, {res['tokens']:,} tokens",
           "", "| stage | seconds | CPU s | MB in | MB/s | share |", "|---|---:|---:|---:|---:|---:|"]
    for r in res["stages"]:
        out.append(f"| {r['stage']} | {r['seconds']:.3f} | {r['cpu_s']:.3f} | {r['bytes_in'] / 1e6:.2f} | "
                   f"{r['mb_per_s']:.2f} | {r['share']:.1%} |")
    total = sum(r["seconds"] for r in res["stages"])
    kept_mb = res["kept_bytes"] / 1e6
    out.append(f"| **all steps, one core** | {total:.3f} | {sum(r['cpu_s'] for r in res['stages']):.3f} | "
               f"{kept_mb:.2f} kept | {kept_mb / total:.2f} | 100% |")
    raw1, rawn = res["raw_1_thread"], res["raw_all_threads"]
    out += ["", "| raw tokenizer (encode_batch, same batches) | seconds | MB/s |", "|---|---:|---:|",
            f"| 1 thread | {raw1['seconds']:.3f} | {raw1['mb_per_s']:.2f} |",
            f"| every core | {rawn['seconds']:.3f} | {rawn['mb_per_s']:.2f} |"]
    out.append(f"\nall steps on one core: {kept_mb / total / raw1['mb_per_s']:.2f} of the 1-thread tokenizer, "
               f"{kept_mb / total / rawn['mb_per_s']:.2f} of the every-core one")
    if res["commands"]:
        out += ["", "| whole command | wall s | kept MB | MB/s kept | / tokenizer (every core) | "
                "/ tokenizer (1 thread) |", "|---|---:|---:|---:|---:|---:|"]
        for c in res["commands"]:
            out.append(f"| prepare --workers {c['workers']} | {c['wall_s']:.2f} | {c['bytes'] / 1e6:.2f} | "
                       f"{c['mb_per_s']:.2f} | {c['mb_per_s'] / rawn['mb_per_s']:.2f} | "
                       f"{c['mb_per_s'] / raw1['mb_per_s']:.2f} |")
        names = [s["stage"] for s in res["commands"][0]["stages"]]
        out += ["", "| engine stage (its own log line) | " + " | ".join(f"--workers {c['workers']}"
                                                                      for c in res["commands"]) + " |",
                "|---|" + "---:|" * len(res["commands"])]
        for n in names:
            cells = []
            for c in res["commands"]:
                s = next((s for s in c["stages"] if s["stage"] == n), None)
                cells.append(f"{s['seconds']:.1f} s ({s['tasks']} tasks, {s['on']})" if s else "-")
            out.append(f"| {n} | " + " | ".join(cells) + " |")
        cells = [f"{c['wall_s'] - sum(s['seconds'] for s in c['stages']):.1f} s" for c in res["commands"]]
        out.append("| outside the stages (start, imports, tokenizer, fingerprint, plan) | " + " | ".join(cells)
                   + " |")
        inside = res.get("steps_per_engine_stage", {})
        if inside:
            out.append("\nthe same steps timed alone, per engine stage (the rest of an engine stage is the "
                       "engine's: JSON to docs/ and back, Document objects, stats, logs, dedup files): "
                       + ", ".join(f"{k} {v:.2f} s" for k, v in inside.items()))
        for c in res["commands"]:
            out.append(f"`{c['command']}`: {c['documents']:,} documents kept, skipped {c['skipped']}, "
                       f"secrets {c['secrets']}")
    for name in ("secrets", "benchmarks"):
        d = res.get("diagnose", {}).get(name)
        if d:
            out.append(f"\n{name}: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                                  for k, v in d.items()))
    return "\n".join(out)


ENGINE_STEPS = {"read": ("read", "quality", "hash", "exact"), "near": ("minhash",),
                "encode": ("bench_index", "benchmarks", "secrets", "encode", "write")}


def profile(stage: str, steps: Steps | None, inputs, tok_dir, opts, top: int, sort: str) -> None:
    prof = cProfile.Profile()
    if stage == "prepare":  # the whole pipeline in this process: --workers 1 runs its tasks here
        from codeforge.data.shards import prepare
        with tempfile.TemporaryDirectory() as tmp:
            prof.enable()
            prepare(inputs, tok_dir, Path(tmp) / "out", opts, workers=1, log=lambda *a: None)
            prof.disable()
    else:
        fn = getattr(steps, stage)
        prof.enable()
        fn()
        prof.disable()
    s = io.StringIO()
    st = pstats.Stats(prof, stream=s)
    st.sort_stats(sort).print_stats(top)
    print(s.getvalue())
    if sort != "tottime":
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(15)
        print(s.getvalue())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--input", nargs="+", default=None, help="default: Go's net, go, crypto (else Python's "
                    "json, asyncio, email)")
    ap.add_argument("--tokenizer", default=None, help="a tokenizer directory; trained there (vocab 8192) if "
                    "it does not exist; default: a temporary one")
    ap.add_argument("--dedup", default="near", choices=("none", "exact", "near"))
    ap.add_argument("--redact-pii", action="store_true", help="also e-mail and IP addresses (off in prepare)")
    ap.add_argument("--repeats", type=int, default=1, help="timings are the best of this many")
    ap.add_argument("--no-command", action="store_true", help="skip the whole-command runs")
    ap.add_argument("--profile", choices=STAGES + ("prepare",), default=None,
                    help="cProfile one stage on the in-memory documents (or the whole pipeline in this "
                    "process, --workers 1) instead of the table")
    ap.add_argument("--sort", default="cumulative", help="pstats sort key for --profile")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--diagnose", action="store_true", help="also count and time the parts of the secrets "
                    "and benchmark steps")
    ap.add_argument("--json", action="store_true", help="print the results as JSON instead of Markdown")
    a = ap.parse_args()
    inputs = a.input or default_inputs()
    opts = prepare_options(a.dedup, a.redact_pii)
    load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    with tempfile.TemporaryDirectory(prefix="prepare-stages-") as tmpdir:
        tmp = Path(tmpdir)
        tok_dir = a.tokenizer or str(tmp / "tokenizer")
        if not (Path(tok_dir) / "tokenizer.json").exists():
            # as tests/conftest.py's tokenizer_dir does: the documents of the inputs, no hygiene
            train_tokenizer((d.text for d in iter_documents(inputs, CorpusOptions(), CorpusStats())), 8192,
                            tok_dir)
        tok = CodeTokenizer.load(tok_dir)
        if a.profile == "prepare":
            profile("prepare", None, inputs, tok_dir, opts, a.top, a.sort)
            return
        commands = []
        if not a.no_command and not a.profile:
            commands = [run_command(inputs, tok_dir, opts, w, tmp) for w in (1, None)]
        keys = commands[0]["keys"] if commands else None
        steps = Steps(inputs, opts, tok, keys)
        if a.profile:
            profile(a.profile, steps, inputs, tok_dir, opts, a.top, a.sort)
            return
        rows = time_steps(steps, a.repeats, a.dedup)
        n_tok = sum(map(len, steps.ids))
        kept = sum(d.nbytes for d in steps.final)
        raw = {}
        for par in (False, True):
            wall, cpu, _ = best_of(lambda: steps.raw(par), a.repeats)
            raw[par] = {"seconds": wall, "cpu_s": cpu, "mb_per_s": kept / 1e6 / wall}
        diag = {}
        if a.diagnose:
            diag = {"secrets": diagnose_secrets(steps), "benchmarks": diagnose_benchmarks(steps)}
    by_key = {r["key"]: r["seconds"] for r in rows}
    res = {
        "inputs": inputs, "options": {k: v for k, v in vars(opts).items()}, "cores": os.cpu_count(),
        "load_before": load_before, "load_after": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "documents_read": len(steps.docs), "input_bytes": sum(d.nbytes for d in steps.docs),
        "documents_kept": len(steps.final), "kept_bytes": kept, "tokens": n_tok, "stages": rows,
        "raw_1_thread": raw[False], "raw_all_threads": raw[True],
        "commands": [{k: v for k, v in c.items() if k != "keys"} for c in commands],
        "steps_per_engine_stage": {k: sum(by_key.get(s, 0.0) for s in v) for k, v in ENGINE_STEPS.items()},
        "diagnose": diag,
    }
    if commands and (commands[0]["documents"], commands[0]["bytes"]) != (len(steps.final), kept):
        res["mismatch"] = (f"the command kept {commands[0]['documents']} documents, {commands[0]['bytes']} "
                           f"bytes; the steps in memory {len(steps.final)}, {kept}")
    if a.json:
        print(json.dumps(res, indent=2, default=str))
    else:
        print(markdown(res))
        if "mismatch" in res:
            print("\nWARNING: " + res["mismatch"])


if __name__ == "__main__":
    main()
