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
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
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
    t0, r0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
    # the command and every child it waited for
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    if p.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    meta = json.loads((out / "meta.json").read_text())
    stages = [{"stage": m[1], "tasks": int(m[2]), "on": m[3], "seconds": float(m[4])}
              for m in map(STAGE_LINE.match, p.stdout.splitlines()) if m]
    keys = set()
    for s in SPLITS:
        keys.update(np.load(out / f"{s}_digests.npy").tolist())
    shutil.rmtree(out, ignore_errors=True)
    return {"workers": workers or "default", "command": " ".join(cmd[1:]), "wall_s": wall, "cpu_s": cpu,
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
                "minhash": self.unique, "bench_index": None, "benchmarks": self.deduped,
                "secrets": self.clean, "encode": self.final, "write": self.final}[stage]
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
    return {"documents": len(docs), "lines": lines_total,
            "pem_docs": sum("PRIVATE KEY" in d.text for d in docs),
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


# -- the engine, in this process ---------------------------------------------------------------------------

ENGINE_STEPS = {"read": ("read", "quality", "hash", "exact"), "near": ("minhash",),
                "encode": ("bench_index", "benchmarks", "secrets", "encode", "write")}


def run_in_process(inputs: list[str], tok_dir: str, opts: CorpusOptions, tmp: Path) -> dict:
    """shards.prepare with --workers 1 in this process (the engine then runs every task here, no pool), with
    the plan and each stage timed (wall and CPU) by wrapping pipeline.make_plan and pipeline._run_stage, and
    the engine's per-task logging (loguru sinks added and removed) and tokenizer loads counted."""
    from datatrove.executor import base as executor_base
    from codeforge.data import pipeline, shards
    from codeforge.data import steps as steps_mod
    rows: list[dict] = []
    counts: Counter = Counter()
    cost: Counter = Counter()

    def timed_call(name, fn, *a, **k):
        w0, c0 = time.perf_counter(), time.process_time()
        try:
            return fn(*a, **k)
        finally:
            rows.append({"stage": name, "tasks": a[2] if name != "plan" else 1,
                         "seconds": time.perf_counter() - w0, "cpu_s": time.process_time() - c0})

    def counted(key, fn):
        def wrapper(*a, **k):
            c0 = time.process_time()
            try:
                return fn(*a, **k)
            finally:
                counts[key] += 1
                cost[key] += time.process_time() - c0
        return wrapper

    real = {"stage": pipeline._run_stage, "plan": pipeline.make_plan,
            "add": executor_base.add_task_logger, "close": executor_base.close_task_logger,
            "load": steps_mod.CodeTokenizer}
    pipeline._run_stage = lambda name, *a, **k: timed_call(name, real["stage"], name, *a, **k)
    pipeline.make_plan = lambda *a, **k: timed_call("plan", real["plan"], *a, **k)
    executor_base.add_task_logger = counted("task logger added", real["add"])
    executor_base.close_task_logger = counted("task logger closed", real["close"])

    class Tok:  # steps.CodeTokenizer.load, counted (EncodeShards and MergeShards load it per task)
        load = staticmethod(counted("tokenizer loads in tasks", real["load"].load))
    steps_mod.CodeTokenizer = Tok
    out = tmp / "in-process"
    try:
        w0, c0 = time.perf_counter(), time.process_time()
        meta = shards.prepare(inputs, tok_dir, out, opts, workers=1, log=lambda *a: None)
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    finally:
        pipeline._run_stage, pipeline.make_plan = real["stage"], real["plan"]
        executor_base.add_task_logger, executor_base.close_task_logger = real["add"], real["close"]
        steps_mod.CodeTokenizer = real["load"]
        shutil.rmtree(out, ignore_errors=True)
    return {"wall_s": wall, "cpu_s": cpu, "bytes": meta["bytes"], "documents": meta["documents"],
            "stages": rows, "calls": {k: {"calls": counts[k], "cpu_s": cost[k]} for k in counts}}


# -- output ------------------------------------------------------------------------------------------------

def _row(cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def markdown(res: dict) -> str:
    kept_mb = res["kept_bytes"] / 1e6
    out = [f"inputs: {' '.join(res['inputs'])}",
           f"options (prepare's defaults): {res['options']}",
           f"load average before {res['load_before']}, after {res['load_after']}; {res['cores']} cores",
           f"read: {res['documents_read']:,} documents, {res['input_bytes'] / 1e6:.2f} MB; kept: "
           f"{res['documents_kept']:,} documents, {kept_mb:.2f} MB, {res['tokens']:,} tokens", "",
           _row(("stage (alone, one process, one thread)", "seconds", "CPU s", "MB in", "MB/s", "share")),
           "|---|---:|---:|---:|---:|---:|"]
    for r in res["stages"]:
        out.append(_row((r["stage"], f"{r['seconds']:.3f}", f"{r['cpu_s']:.3f}", f"{r['bytes_in'] / 1e6:.2f}",
                         f"{r['mb_per_s']:.2f}", f"{r['share']:.1%}")))
    total = sum(r["seconds"] for r in res["stages"])
    total_cpu = sum(r["cpu_s"] for r in res["stages"])
    out.append(_row(("**all steps**", f"{total:.3f}", f"{total_cpu:.3f}", f"{kept_mb:.2f} kept",
                     f"{kept_mb / total:.2f}", "100%")))
    raw1, rawn = res["raw_1_thread"], res["raw_all_threads"]
    out += ["", _row(("raw tokenizer (kept texts, EncodeShards' batches)", "seconds", "CPU s", "MB/s")),
            "|---|---:|---:|---:|",
            _row(("encode_batch, 1 thread", f"{raw1['seconds']:.3f}", f"{raw1['cpu_s']:.3f}",
                  f"{raw1['mb_per_s']:.2f}")),
            _row(("encode_batch, every core", f"{rawn['seconds']:.3f}", f"{rawn['cpu_s']:.3f}",
                  f"{rawn['mb_per_s']:.2f}")),
            f"\nevery core / 1 thread: {rawn['mb_per_s'] / raw1['mb_per_s']:.2f}x (other jobs' load shows)"]
    runs = list(res["commands"])
    if res.get("in_process"):
        runs.append({**res["in_process"], "workers": "1, in this process", "mb_per_s":
                     res["in_process"]["bytes"] / 1e6 / res["in_process"]["wall_s"]})
    if runs:
        out += ["", _row(("whole command", "wall s", "CPU s", "kept MB", "MB/s kept",
                          "/ tokenizer every core", "/ tokenizer 1 thread", "tokenizer CPU / its CPU")),
                "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for c in runs:
            out.append(_row((f"prepare --workers {c['workers']}", f"{c['wall_s']:.2f}", f"{c['cpu_s']:.2f}",
                             f"{c['bytes'] / 1e6:.2f}", f"{c['mb_per_s']:.2f}",
                             f"{c['mb_per_s'] / rawn['mb_per_s']:.2f}",
                             f"{c['mb_per_s'] / raw1['mb_per_s']:.2f}", f"{raw1['cpu_s'] / c['cpu_s']:.2f}")))
        out.append("\nCPU s of a command: its process and the children it reaped (a pool's workers, forked by"
                   " the engine's fork server, are not counted: --workers N > 1 reads low); the last column,"
                   " the 1-thread tokenizer's CPU s over the command's, is the ratio least moved by other"
                   " jobs' load")
    ip = res.get("in_process")
    if ip:
        by_key = {r["key"]: r for r in res["stages"]}
        out += ["", _row(("engine stage (--workers 1, in this process)", "tasks", "wall s", "CPU s",
                          "its steps alone, CPU s", "engine's own CPU s")), "|---|---:|---:|---:|---:|---:|"]
        for r in ip["stages"]:
            alone = sum(by_key[k]["cpu_s"] for k in ENGINE_STEPS.get(r["stage"], ()) if k in by_key)
            if r["stage"] == "plan":
                alone = by_key["walk"]["cpu_s"]
            out.append(_row((r["stage"], r["tasks"], f"{r['seconds']:.2f}", f"{r['cpu_s']:.2f}",
                             f"{alone:.2f}", f"{r['cpu_s'] - alone:.2f}")))
        rest_w = ip["wall_s"] - sum(r["seconds"] for r in ip["stages"])
        rest_c = ip["cpu_s"] - sum(r["cpu_s"] for r in ip["stages"])
        out.append(_row(("outside stages and plan (fingerprint, tokenizer, work dir)", "", f"{rest_w:.2f}",
                         f"{rest_c:.2f}", "", "")))
        out.append("\nengine calls per run: " + ", ".join(f"{k} {v['calls']}x ({v['cpu_s']:.2f} CPU s)"
                                                        for k, v in ip["calls"].items()))
    if res["commands"]:
        names = [s["stage"] for s in res["commands"][0]["stages"]]
        out += ["", _row(["engine stage (its log line, separate process)"]
                         + [f"--workers {c['workers']}" for c in res["commands"]]),
                "|---|" + "---:|" * len(res["commands"])]
        for n in names:
            cells = []
            for c in res["commands"]:
                s = next((s for s in c["stages"] if s["stage"] == n), None)
                cells.append(f"{s['seconds']:.1f} s ({s['tasks']} tasks, {s['on']})" if s else "-")
            out.append(_row([n] + cells))
        out.append(_row(["outside the stages (start, imports, tokenizer, fingerprint, plan)"]
                        + [f"{c['wall_s'] - sum(s['seconds'] for s in c['stages']):.1f} s"
                           for c in res["commands"]]))
        for c in res["commands"]:
            out.append(f"\n`{c['command']}`: {c['documents']:,} documents kept, skipped {c['skipped']}, "
                       f"secrets {c['secrets']}")
    for name in ("secrets", "benchmarks"):
        d = res.get("diagnose", {}).get(name)
        if d:
            out.append(f"\n{name}: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                                  for k, v in d.items()))
    return "\n".join(out)


def profile(stage: str, steps: Steps | None, inputs, tok_dir, opts, top: int, sort: str) -> None:
    """cProfile of one step on the in-memory documents, or of the whole pipeline in this process (`prepare`,
    --workers 1): the top functions by `sort` (cumulative), then by their own time."""
    prof = cProfile.Profile()
    if stage == "prepare":
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
    for key, n in ((sort, top), ("tottime", 15)):
        if key == sort and key == "tottime" and n != top:
            continue
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(key).print_stats(n)
        print(s.getvalue())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--input", nargs="+", default=None, help="default: Go's net, go, crypto (else Python's "
                    "json, asyncio, email)")
    ap.add_argument("--tokenizer", default=None, help="a tokenizer directory; trained there (vocab 8192) if "
                    "it does not exist; default: a temporary one")
    ap.add_argument("--dedup", default="near", choices=("none", "exact", "near"))
    ap.add_argument("--redact-pii", action="store_true", help="also e-mail and IP addresses (off in prepare)")
    ap.add_argument("--repeats", type=int, default=1, help="each step's time is the best of this many")
    ap.add_argument("--workers", nargs="+", default=["1", "default"],
                    help="the whole-command runs, one per value (a number or `default`)")
    ap.add_argument("--no-command", action="store_true", help="skip the whole-command runs")
    ap.add_argument("--profile", choices=STAGES + ("prepare",), default=None,
                    help="cProfile one stage on the in-memory documents (or `prepare`: the whole pipeline in "
                    "this process, --workers 1) instead of the tables")
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
        commands, in_process = [], None
        if not a.no_command and not a.profile:
            commands = [run_command(inputs, tok_dir, opts, None if w == "default" else int(w), tmp)
                        for w in a.workers]
            in_process = run_in_process(inputs, tok_dir, opts, tmp)
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
    res = {
        "inputs": inputs, "options": dict(vars(opts)), "cores": os.cpu_count(),
        "load_before": load_before, "load_after": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "documents_read": len(steps.docs), "input_bytes": sum(d.nbytes for d in steps.docs),
        "documents_kept": len(steps.final), "kept_bytes": kept, "tokens": n_tok, "stages": rows,
        "raw_1_thread": raw[False], "raw_all_threads": raw[True],
        "commands": [{k: v for k, v in c.items() if k != "keys"} for c in commands],
        "in_process": in_process, "diagnose": diag,
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
