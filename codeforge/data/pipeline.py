"""`codeforge prepare` for code, as a datatrove pipeline: every core of this machine, or a Slurm cluster.

datatrove (the engine FineWeb was built with) schedules the work: its executors run each stage as tasks
(a process pool here, a job array on Slurm: slurm.py), mark every finished task on disk and skip those on a
rerun, and its staged exact and MinHash deduplication keep their state in files. The steps that read, filter
and encode are codeforge's (corpus.py's readers with their bounds on hostile input, its filters, decontam.py,
redact.py, the shard writer), written as datatrove steps.

The work directory, `.OUT.prepare-FINGERPRINT` beside OUT, holds everything between stages:
  plan/       units.jsonl (every file, in reading order, with its size), RANK.jsonl (one task's run of them),
              plan.json (the task count, the start time), stats.json (what the walk skipped)
  docs/       RANK.jsonl: the documents each task kept after reading and quality filters, with their content
              hash (taken before secrets are replaced: it picks the split); raw text, secrets included, so
              removed as soon as the encode stage is done (the merge starts by removing it)
  exact/, exact_dups/, sigs/, buckets/, clusters/   the engine's deduplication state
  tokens/     RANK/: one task's shards (train_000000.bin, ...), offsets, content hashes, summary.json
  stats/      STEP/RANK.json: each step's counts per task (documents and bytes in and out, skip reasons)
  logs/       STAGE/: the engine's logs per task and its completion markers (completions/RANK)
  out/        the merged dataset, renamed to OUT when complete
It is this user's alone and trusted no further (workdir.py): 0700, refused if another user owns it or it holds
a symlink, and never removed while a prepare or Slurm job may use it. A plan entry must lie under the inputs,
and a file is read only if the file opened is inside its input tree (_read_inside).

Stages (T tasks, T fixed by the corpus or --tasks, never by --workers, so any number of workers writes the
same shards):
  read     T  ReadUnits -> QualityFilter -> JsonlWriter(docs/) [-> ExactSignature (--dedup exact|near)]
  exact    1  ExactFindDedups                                    (--dedup exact|near)
  near     T  docs/ -> ExactDedupFilter -> CodeMinhashSignature   (--dedup near)
  buckets  B  MinhashDedupBuckets, one task per band             (--dedup near)
  clusters 1  MinhashDedupCluster                                (--dedup near)
  encode   T  docs/ -> [ExactDedupFilter] -> [MinhashDedupFilter] -> BenchmarkFilter -> RedactSecrets
              -> EncodeShards(tokens/RANK)   (Tally steps between them count what each dedup filter drops)
  merge    1  MergeShards: the tasks' shards concatenated in task order into out/, meta.json, out/ -> OUT
Killed at any point (kill -9 included), the same command finds the same work directory (same fingerprint),
skips the finished tasks and redoes the rest; every task rewrites its outputs from the start. A lock on
WORK/lock keeps a second command out while one runs; pool workers end within a second of the command that
started them, and so do the engine's helpers (its manager server, fork server and resource tracker). A stage
that fails (a task's error, a full disk) keeps the work directory (StageFailed); an
error in the data (an empty corpus, --strict) removes it. Not handled: a pool worker killed on its own (the
kernel's OOM killer) leaves the engine's pool waiting for it; stop the command and run it again.

A unit is a file of a walked directory, or a whole single-file source (a JSONL, a parquet, an hf: dataset):
a corpus given as one large JSONL is one task, on one core. Tasks are cut at directory changes where they
can be (a task may grow to twice its share first), so repo-level FIM documents rarely lose their context.

Near duplicates: MinHash over the same code-aware shingles as before (5 whitespace-separated words, so `a+b`
and `a + b` differ and punctuation counts), with 128 hashes in the bands datasketch's LSH picks for
--near-threshold (0.85: 8 bands of 16). Each cluster keeps one document (the engine's union-find root);
exact duplicates keep the first in reading order.
"""

from __future__ import annotations

import ctypes
import io
import json
import math
import os
import re
import resource
import shutil
import signal
import stat
import sys
import threading
import time
from pathlib import Path

import multiprocess  # noqa: E402
import numpy as np  # noqa: E402
import orjson  # noqa: E402
from datatrove.data import Document as EngineDocument  # noqa: E402
from datatrove.executor import LocalPipelineExecutor  # noqa: E402
from datatrove.pipeline.base import PipelineStep  # noqa: E402
from datatrove.pipeline.dedup.exact_dedup import (ExactDedupConfig, ExactDedupFilter, ExactDedupSignature,  # noqa: E402
                                                  ExactFindDedups)
from datatrove.pipeline.dedup.minhash import (MinhashConfig, MinhashDedupBuckets, MinhashDedupCluster,  # noqa: E402
                                              MinhashDedupFilter, MinhashDedupSignature)
from datatrove.pipeline.writers import JsonlWriter  # noqa: E402
from datatrove.utils.logging import setup_default_logger  # noqa: E402
from datatrove.utils.word_tokenizers import WordTokenizer  # noqa: E402

from .. import CodeforgeError, printable  # noqa: E402
from ..atomic import publish  # noqa: E402
from ..corpus import (CorpusOptions, CorpusStats, Document, check_sources, content_hash, read_unit,  # noqa: E402
                      reject_reason, scrub, source_units, split_of)
from ..decontam import benchmarks  # noqa: E402
from ..tokenizer import CodeTokenizer  # noqa: E402
from . import slurm as slurm_jobs  # noqa: E402
from . import workdir  # noqa: E402
from .workdir import KeepWork  # noqa: E402
from .writer import BATCH_BYTES, SPLITS, RepoDocs, ShardError, SplitWriter, dtype_for, finish_meta  # noqa: E402

ENGINE = "datatrove"
TASK_BYTES = 32 << 20  # input bytes per task: the unit of work a worker takes, and of a rerun after a kill
MIN_TASKS = 16  # a small corpus is still cut in this many tasks (if it has the files), so 16 cores share it
MAX_TASKS = 300  # the exact-dedup stage holds up to 3 open files per task (the usual limit is 1,024; run()
# raises the soft limit to the hard one, and refuses a --tasks the limit cannot hold)
WORKER_BYTES = 8 << 20  # input bytes that pay for one more worker process (auto_workers)
SHINGLE_WORDS = 5
NUM_PERM = 128
EXECUTORS = ("local", "slurm")


# -- the plan: units of reading, cut into tasks -------------------------------------------------------------

def task_count(units: int, total_bytes: int) -> int:
    """T: about TASK_BYTES of input each, at least MIN_TASKS and at most MAX_TASKS, never more than units."""
    want = max(MIN_TASKS, math.ceil(total_bytes / TASK_BYTES))
    return max(1, min(units, want, MAX_TASKS))


def make_plan(sources: list[str], opts: CorpusOptions, work: Path, tasks: int | None = None) -> int:
    """Walk the sources once (nothing is read) into work/plan, cut into contiguous runs of about equal bytes,
    one per task, none empty; the number of tasks. Reused as it is when a previous run
    of the same command wrote it."""
    plan = work / "plan"
    if (plan / "plan.json").exists():
        return json.loads((plan / "plan.json").read_text())["tasks"]
    shutil.rmtree(plan, ignore_errors=True)
    plan.mkdir(parents=True)
    stats = CorpusStats()
    n, total = 0, 0
    with open(plan / "units.jsonl", "xb") as f:  # streamed: a corpus of millions of files is not held
        for src in sources:
            for unit in source_units(src, opts, stats):
                f.write(json.dumps(list(unit)).encode() + b"\n")  # json: a file name may hold surrogates
                n += 1
                total += unit[2]
    t = max(1, min(tasks, max(n, 1))) if tasks else task_count(n, total)
    outs = [open(plan / f"{r:05d}.jsonl", "xb") for r in range(t)]  # x: a new file, never through a link
    try:
        done, cur, cur_bytes, last_dir = 0, 0, 0, None
        with open(plan / "units.jsonl", "rb") as f:
            for i, line in enumerate(f):
                path, _, size = json.loads(line)
                here = os.path.dirname(path)
                # by bytes before this unit; a directory stays in one task unless that task is already twice
                # its share (repo-level FIM takes context from the files before it in the same directory)
                r = min(t - 1, done * t // max(total, 1), i)
                if r > cur and here == last_dir and cur_bytes < 2 * total / t:
                    r = cur
                # one task at a time, and never fewer units left than tasks left
                r = max(min(r, cur + 1), t - (n - i))
                if r != cur:
                    cur, cur_bytes = r, 0
                outs[r].write(line)
                done += size
                cur_bytes += size
                last_dir = here
    finally:
        for o in outs:
            o.close()
    _save_stats(work, "plan", 0, stats)
    # plan.json marks the plan complete: written whole or not at all
    workdir.write_text(plan / "plan.json",
                       json.dumps({"tasks": t, "units": n, "bytes": total, "started": time.time()}))
    return t


def auto_workers(total_bytes: int) -> int:
    """The default --workers: this machine's cores, but one per WORKER_BYTES of input at most (starting a
    pool of processes costs about a second a stage, more than a small repository takes on one core)."""
    return max(1, min(len(os.sched_getaffinity(0)), total_bytes // WORKER_BYTES))


def _real_path(fd: int, path: str) -> str | None:
    """The real path of the file open on `fd` (opened from `path`), or None when it cannot be told (the file
    at `path` is no longer the one open)."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")  # Linux: where the kernel opened it, every link resolved
    except OSError:
        pass
    real = os.path.realpath(path)  # elsewhere: resolved again, and the same file only if dev and inode match
    try:
        st, now = os.fstat(fd), os.stat(real)
    except OSError:
        return None
    return real if (st.st_dev, st.st_ino) == (now.st_dev, now.st_ino) else None


def _read_inside(path: str, tree: str, opts: CorpusOptions, stats: CorpusStats):
    """Documents of one file of the walked directory `tree`, read only if the file opened is inside it: a
    directory swapped for a symlink after the walk would be followed by the name (the reader checks only the
    file's own name for a link). Opened once, its real path checked, and on Linux read through that same
    descriptor (/proc/self/fd/N): nothing can be swapped in between. Not a regular file: the reader's."""
    try:
        regular = stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        regular = False
    fd = -1
    if regular:  # never opened otherwise: opening a device can have effects of its own
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
        except OSError:
            pass
    if fd < 0:
        yield from read_unit(path, tree, opts, stats)
        return
    try:
        real = _real_path(fd, path)
        if real is None or os.path.commonpath([real, tree]) != tree:
            how = ("name the target as an input to read it" if os.path.islink(path) else
                   "a directory on its way was replaced by a symlink after the walk")
            stats.skip("symlink_outside", path, False,
                       f"opened, it is {real or 'a file swapped while it was opened'}, outside {tree}: not "
                       f"read; {how}")
            return
        via = f"/proc/self/fd/{fd}"
        if not os.path.exists(via):
            via = path  # no /proc: read by name again (a swap in between is not caught there)
        for doc in read_unit(via, tree, opts, stats):
            doc.source = path
            yield doc
        for reason, where in stats.examples.items():  # the reader's own skips name the file as it got it
            if where == via:
                stats.examples[reason] = path
    finally:
        os.close(fd)


def _stats_dict(stats: CorpusStats) -> dict:
    return {"documents": stats.documents, "bytes": stats.bytes, "skipped": dict(stats.skipped),
            "examples": stats.examples, "secrets": dict(stats.secrets), "steps": stats.steps}


def _save_stats(work, step: str, rank: int, stats: CorpusStats) -> None:
    d = Path(work) / "stats" / step
    d.mkdir(parents=True, exist_ok=True)
    workdir.write_text(d / f"{rank:05d}.json", json.dumps(_stats_dict(stats)))


def _load_stats(work: Path, tasks: int) -> CorpusStats:
    """Every step's counts, summed over tasks in task order (the first example of a reason is the first
    task's), with the steps in the order a document meets them."""
    total = CorpusStats()
    for step in ("plan", "read", "quality", "benchmarks", "secrets", "dedup"):
        d = work / "stats" / step
        for r in range(1 if step == "plan" else tasks):
            f = d / f"{r:05d}.json"
            if not f.exists():
                continue
            s = json.loads(f.read_text())
            total.skipped.update(s["skipped"])
            for k, v in s["examples"].items():
                total.examples.setdefault(k, v)
            total.secrets.update(s["secrets"])
            for k, v in s["steps"].items():
                row = total.steps.setdefault(k, [0, 0, 0, 0])
                for i in range(4):
                    row[i] += v[i]
    return total


# -- steps of the read stage ---------------------------------------------------------------------------------

class _Step(PipelineStep):
    """A codeforge step: counts into its own CorpusStats, saved per task when its input is exhausted."""
    type = "codeforge"
    step = ""

    def __init__(self, work: str, opts: CorpusOptions):
        super().__init__()
        self.work, self.opts = str(work), opts

    def run(self, data, rank: int = 0, world_size: int = 1):
        stats = CorpusStats()
        yield from self.apply(data, rank, stats)
        _save_stats(self.work, self.step, rank, stats)

    def apply(self, data, rank: int, stats: CorpusStats):
        raise NotImplementedError


class ReadUnits(_Step):
    """This task's units of the plan, checked, read by corpus.read_unit (every bound on hostile input there),
    a directory's files through _read_inside."""
    name, step = "read", "read"

    def __init__(self, work: str, opts: CorpusOptions, sources: list[str]):
        super().__init__(work, opts)
        self.sources = list(sources)

    def apply(self, data, rank, stats):
        n = 0
        for path, tree in workdir.plan_units(Path(self.work), rank, self.sources):
            docs = read_unit(path, None, self.opts, stats) if tree is None else \
                _read_inside(path, tree, self.opts, stats)
            for doc in docs:
                stats.step("read", doc.nbytes, True)
                yield EngineDocument(text=doc.text, id=f"{rank}/{n}",
                                     metadata={"source": _printable(doc.source),
                                                                               "nbytes": doc.nbytes})
                n += 1


def _printable(path: str) -> str:
    """A path as JSON can hold it: a file name that is not UTF-8 (held with surrogates) gets \\x escapes."""
    try:
        path.encode("utf-8")
        return path
    except UnicodeEncodeError:
        return path.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


class QualityFilter(_Step):
    """corpus.reject_reason (empty, too large, binary, minified, generated); the content hash of the kept."""
    name, step = "quality filters", "quality"

    def apply(self, data, rank, stats):
        for doc in data:
            nbytes = doc.metadata["nbytes"]
            reason = reject_reason(doc.text, self.opts)
            stats.step("quality filters", nbytes, not reason)
            if reason:
                stats.skip(reason, doc.metadata["source"])
                continue
            doc.metadata["digest"] = content_hash(doc.text).hex()
            yield doc


class BenchmarkFilter(_Step):
    """Documents sharing a 13-token run, or most of a solution's shape, with a benchmark are dropped
    (decontam.py)."""
    name, step = "benchmarks out", "benchmarks"

    def apply(self, data, rank, stats):
        bench = benchmarks(self.opts.decontaminate)
        for doc in data:
            hit = bench.hit(doc.text)
            stats.step("benchmarks out", doc.metadata["nbytes"], not hit)
            if hit:
                stats.skip("benchmark", doc.metadata["source"])
                continue
            yield doc


class RedactSecrets(_Step):
    """Secrets replaced by a placeholder per kind (redact.py, detect-secrets), and e-mail and IP addresses
    with --redact-pii, counted per kind."""
    name, step = "secrets replaced", "secrets"

    def apply(self, data, rank, stats):
        for doc in data:
            before = doc.metadata["nbytes"]
            text, found = scrub(doc.text, doc.metadata["source"], self.opts)
            if found:
                stats.secrets.update(found)
                doc.text = text
                doc.metadata["nbytes"] = len(text.encode("utf-8"))
            stats.step("secrets replaced", before, True, doc.metadata["nbytes"])
            yield doc


def _text(doc: EngineDocument) -> str:
    return doc.text


def _first_task_first(doc: EngineDocument) -> int:
    """Of exact duplicates the engine keeps the highest priority, then the lowest index in its task: the
    earlier task ranks higher, so the first in reading order is kept."""
    return 65535 - int(doc.id.split("/", 1)[0])


EXACT = ExactDedupConfig(content_getter=_text, document_priority=_first_task_first)


class ExactSignature(ExactDedupSignature):
    """The engine's exact-dedup signatures, passing the documents on (its own step ends the stream)."""

    def run(self, data, rank: int = 0, world_size: int = 1):
        sigs = []
        for i, doc in enumerate(data):
            sigs.extend(self.get_hashes(doc, i))
            yield doc
        self.save_hashes(rank, sigs)


# -- near duplicates: the engine's MinHash stages on codeforge's shingles ------------------------------------

class _Whitespace(WordTokenizer):
    """Words as whitespace separates them: code's punctuation and case stay (the engine's default is an
    English tokenizer that lowercases and drops punctuation)."""

    def word_tokenize(self, text: str) -> list[str]:
        return text.split()

    def sent_tokenize(self, text: str) -> list[str]:
        return text.splitlines()

    def span_tokenize(self, text: str) -> list[tuple[int, int]]:
        raise NotImplementedError


class CodeMinhashSignature(MinhashDedupSignature):
    """MinHash signatures of a document's set of 5-word shingles (as corpus.Deduper has them): code is not
    lowercased or stripped of punctuation first."""

    def __init__(self, output_folder, config: MinhashConfig):
        super().__init__(output_folder, config=config, language=_Whitespace())

    def get_shingles(self, text: str) -> np.ndarray:
        words = text.split()
        grams = {" ".join(words[i:i + SHINGLE_WORDS]) for i in range(max(1, len(words) - SHINGLE_WORDS + 1))}
        return np.fromiter((self._hash_func(g) for g in grams), dtype=np.uint64,
                           count=len(grams)).reshape(-1, 1)


def lsh_bands(threshold: float, num_perm: int = NUM_PERM) -> tuple[int, int]:
    """(bands, rows per band) with bands * rows <= num_perm that minimise the false positives below
    `threshold` plus the false negatives above it (both integrals of the LSH S-curve), as datasketch's
    MinHashLSH chooses them, so --near-threshold means what it meant."""
    def area(b: int, r: int, lo: float, hi: float, above: bool) -> float:
        s = np.linspace(lo, hi, 1001)
        p = 1 - (1 - s ** r) ** b
        y = (1 - p) if above else p
        return float(np.sum((y[1:] + y[:-1]) / 2 * np.diff(s)))

    best, pick = math.inf, (1, num_perm)
    for b in range(1, num_perm + 1):
        for r in range(1, num_perm // b + 1):
            err = 0.5 * area(b, r, 0.0, threshold, False) + 0.5 * area(b, r, threshold, 1.0, True)
            if err < best:
                best, pick = err, (b, r)
    return pick


def minhash_config(threshold: float) -> MinhashConfig:
    b, r = lsh_bands(threshold)
    return MinhashConfig(n_grams=SHINGLE_WORDS, num_buckets=b, hashes_per_bucket=r)


# -- the encode and merge stages -----------------------------------------------------------------------------

class TaskDocs(PipelineStep):
    """This task's kept documents, as the read stage wrote them (docs/RANK.jsonl; none if it kept none)."""
    type, name = "codeforge", "task documents"

    def __init__(self, work: str):
        super().__init__()
        self.work = str(work)

    def run(self, data=None, rank: int = 0, world_size: int = 1):
        path = Path(self.work) / "docs" / f"{rank:05d}.jsonl"
        if not path.exists():
            return
        with open(path, "rb") as f:
            for line in f:
                d = orjson.loads(line)
                yield EngineDocument(text=d["text"], id=d["id"], metadata=d["metadata"])


class Tally(PipelineStep):
    """Counts the documents and bytes passing (between the dedup filters: what each one removed)."""
    type = "codeforge"

    def __init__(self, work: str, step: str):
        super().__init__()
        self.work, self.name = str(work), step

    def run(self, data, rank: int = 0, world_size: int = 1):
        docs = nbytes = 0
        for doc in data:
            docs += 1
            nbytes += doc.metadata["nbytes"]
            yield doc
        d = Path(self.work) / "tally" / self.name
        d.mkdir(parents=True, exist_ok=True)
        workdir.write_text(d / f"{rank:05d}.json", json.dumps([docs, nbytes]))


class EncodeShards(PipelineStep):
    """Token ids of this task's documents into tokens/RANK/ (shard files of at most shard_tokens, the
    documents' offsets and content hashes), split train/val by each document's content hash; repo-level FIM
    documents after training files when asked. Written aside and renamed when whole."""
    type, name = "codeforge", "encode"

    def __init__(self, work: str, tokenizer_dir: str, val_fraction: float, shard_tokens: int, repo_fim: float,
                 sources: list[str], threads: bool):
        super().__init__()
        self.work, self.tokenizer_dir, self.val_fraction = str(work), str(tokenizer_dir), val_fraction
        self.shard_tokens, self.repo_fim = shard_tokens, repo_fim
        self.sources, self.threads = sources, threads

    def run(self, data, rank: int = 0, world_size: int = 1):
        before = os.environ.get("TOKENIZERS_PARALLELISM")
        if not self.threads:  # a worker is a core: the Rust encoder stays on this worker's core
            os.environ["TOKENIZERS_PARALLELISM"] = "false"
        try:
            self._encode(data, rank)
        finally:
            if before is None:
                os.environ.pop("TOKENIZERS_PARALLELISM", None)
            else:
                os.environ["TOKENIZERS_PARALLELISM"] = before

    def _encode(self, data, rank: int) -> None:
        tok = CodeTokenizer.load(self.tokenizer_dir)
        dest = Path(self.work) / "tokens" / f"{rank:05d}"
        tmp = dest.with_name(dest.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        dtype = dtype_for(tok.vocab_size)
        writers = {s: SplitWriter(tmp, s, dtype, self.shard_tokens) for s in SPLITS}
        repo = RepoDocs(tok, self.sources, self.repo_fim) if self.repo_fim else None
        kept = {"documents": 0, "bytes": 0}

        def flush(batch: list[Document]) -> None:
            out: dict[str, tuple[list, list, list]] = {s: ([], [], []) for s in SPLITS}
            for doc, ids in zip(batch, tok.encode_batch([d.text for d in batch])):
                ids.append(tok.eot_id)
                split = split_of(doc.digest, self.val_fraction)
                docs, nb, dg = out[split]
                docs.append(ids)
                nb.append(doc.nbytes)
                dg.append(doc.digest)
                if repo is not None and split == "train":  # never built from (or around) a validation file
                    extra = repo.after(doc)
                    if extra is not None:
                        docs.append(extra)
                        nb.append(0)  # its bytes are the file's, counted once
                        dg.append(doc.digest)
            for s, (docs, nb, dg) in out.items():
                if docs:
                    writers[s].add(docs, sum(nb), digests=dg)

        batch: list[Document] = []
        size = 0
        for d in data:
            doc = Document(d.text, d.metadata["source"], d.metadata["nbytes"],
                           bytes.fromhex(d.metadata["digest"]))
            kept["documents"] += 1
            kept["bytes"] += doc.nbytes
            batch.append(doc)
            size += doc.nbytes
            if len(batch) >= 512 or size >= BATCH_BYTES:
                flush(batch)
                batch, size = [], 0
        if batch:
            flush(batch)
        summary = {"splits": {s: w.close() for s, w in writers.items()}, **kept,
                   "repo_fim_documents": repo.made if repo is not None else 0}
        (tmp / "summary.json").write_text(json.dumps(summary))
        shutil.rmtree(dest, ignore_errors=True)
        tmp.rename(dest)


class MergeShards(PipelineStep):
    """The tasks' shards, concatenated in task order into shard files of at most shard_tokens (a task's shard
    is never split, so no document straddles two), their offsets and content hashes joined, meta.json
    written, and out/ published as OUT. out/ is rebuilt from the start on a rerun."""
    type, name = "codeforge", "merge"

    def __init__(self, work: str, out: str, tokenizer_dir: str, tasks: int, shard_tokens: int,
                 sources: list[str], extra: dict):
        super().__init__()
        self.work, self.out, self.tokenizer_dir, self.tasks = str(work), str(out), str(tokenizer_dir), tasks
        self.shard_tokens, self.sources, self.extra = shard_tokens, sources, extra

    def run(self, data=None, rank: int = 0, world_size: int = 1):
        work = Path(self.work)
        # the documents' raw text, secrets not yet replaced: every encode task is done with it (the merge runs
        # after the whole encode stage, here and on Slurm), and no later stage or rerun reads it again
        shutil.rmtree(work / "docs", ignore_errors=True)
        dest = work / "out"
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir()
        summaries = [json.loads((work / "tokens" / f"{r:05d}" / "summary.json").read_text())
                     for r in range(self.tasks)]
        splits = {s: self._join(work, dest, s, summaries) for s in SPLITS}
        stats = _load_stats(work, self.tasks)
        _dedup_steps(work, self.tasks, stats, self.extra["options"]["dedup"])
        stats.documents = sum(x["documents"] for x in summaries)
        stats.bytes = sum(x["bytes"] for x in summaries)
        if stats.documents == 0:
            raise ShardError("the corpus is empty after filtering (skipped: "
                             f"{dict(stats.skipped) or 'nothing found'});"
                             f" check --languages, --max-file-bytes and the inputs")
        plan = json.loads((work / "plan" / "plan.json").read_text())
        meta = finish_meta(CodeTokenizer.load(self.tokenizer_dir), dest, stats, splits, self.sources,
                           time.time() - plan["started"])
        meta["repo_fim_documents"] = sum(x["repo_fim_documents"] for x in summaries)
        if not meta["repo_fim_documents"] and not self.extra["options"].get("repo_fim"):
            del meta["repo_fim_documents"]
        meta["engine"] = {"name": ENGINE, "tasks": self.tasks, "units": plan["units"]}
        meta.update(self.extra)
        (dest / "meta.json").write_text(json.dumps(meta, indent=2))
        publish(dest, Path(self.out))

    def _join(self, work: Path, dest: Path, split: str, summaries: list[dict]) -> dict:
        shards, starts, digests, tokens, nbytes = [], [], [], 0, 0
        f = None
        try:
            for r, summ in enumerate(summaries):
                src = work / "tokens" / f"{r:05d}"
                info = summ["splits"][split]
                for sh in info["shards"]:
                    if f is None or shards[-1]["tokens"] + sh["tokens"] > self.shard_tokens:
                        if f is not None:
                            f.close()
                        shards.append({"file": f"{split}_{len(shards):06d}.bin", "tokens": 0})
                        f = open(dest / shards[-1]["file"], "wb")
                    with open(src / sh["file"], "rb") as part:
                        shutil.copyfileobj(part, f, 1 << 22)
                    shards[-1]["tokens"] += sh["tokens"]
                starts.append(np.load(src / f"{split}_docs.npy") + tokens)
                digests.append(np.load(src / f"{split}_digests.npy"))
                tokens += info["tokens"]
                nbytes += info["bytes"]
        finally:
            if f is not None:
                f.close()
        np.save(dest / f"{split}_docs.npy", np.concatenate(starts).astype(np.int64))
        np.save(dest / f"{split}_digests.npy", np.concatenate(digests).astype(np.uint64))
        return {"shards": shards, "tokens": tokens, "documents": int(sum(len(a) for a in starts)),
                "bytes": nbytes}


def _dedup_steps(work: Path, tasks: int, stats: CorpusStats, mode: str) -> None:
    """The deduplication row of the report and the duplicates' skip counts, from the tallies around the
    dedup filters; the report's rows put in the order a document meets the steps."""
    def total(name: str) -> tuple[int, int]:
        d = work / "tally" / name
        vals = [json.loads((d / f"{r:05d}.json").read_text()) for r in range(tasks)
                if (d / f"{r:05d}.json").exists()]
        return sum(v[0] for v in vals), sum(v[1] for v in vals)

    before, after = total("before dedup"), total("after dedup")
    if mode == "none":
        stats.steps["deduplication"] = [before[0], before[1], before[0], before[1]]
    else:
        exact = total("after exact") if mode == "near" else after
        stats.steps["deduplication"] = [before[0], before[1], after[0], after[1]]
        if before[0] - exact[0]:
            stats.skipped["duplicate"] += before[0] - exact[0]
        if exact[0] - after[0]:
            stats.skipped["near_duplicate"] += exact[0] - after[0]
    order = ["read", "quality filters", "deduplication", "benchmarks out", "secrets replaced"]
    stats.steps = {k: stats.steps[k]
                   for k in sorted(stats.steps, key=lambda k: order.index(k) if k in order else 99)}


# -- executors -----------------------------------------------------------------------------------------------

_ENGINE_LOG_LINE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} \| ")


class StageFailed(KeepWork):
    """A stage failed for a reason other than the data (a worker's error, a full disk): the work directory
    is kept, and the same command redoes only the unfinished tasks."""


# tqdm's redrawn line: "\rname:  50%|#####     | 8/16 [00:01<..."
_PROGRESS_BAR = re.compile(r"\r|\d+/\d+ \[\d")


class _Escaped(io.TextIOBase):
    """stderr with control characters written as escapes (codeforge.printable, as every printed name from
    outside is): the reader's warnings name files, and a name can hold an ESC that retitles the terminal."""

    def __init__(self, real):
        self.real = real

    def write(self, s: str) -> int:
        self.real.write(printable(s))
        return len(s)

    def flush(self) -> None:
        self.real.flush()


class _WithoutEngineLog(_Escaped):
    """stderr, escaped, less the engine's log records (loguru writes each, traceback included, in one call)
    and its progress bars (tqdm, when it was imported before TQDM_DISABLE could turn them off): the records
    stay in the task's log file, and a failure reaches the user as codeforge's error naming that file."""

    def __init__(self, real):
        super().__init__(real)
        self.dropped = False

    def write(self, s: str) -> int:
        drop = bool(_ENGINE_LOG_LINE.match(s) or _PROGRESS_BAR.search(s) or (s == "\n" and self.dropped))
        self.dropped = drop
        if not drop:
            super().write(s)
        return len(s)


def _exit_with(owner: int) -> None:
    """In a pool worker: end this process when `owner` (the prepare command) is gone, so a kill -9 of the
    command alone leaves no worker writing into the work directory a rerun is using."""
    def watch() -> None:
        while True:
            time.sleep(0.5)
            try:
                os.kill(owner, 0)
            except ProcessLookupError:
                os._exit(1)
            except OSError:
                pass
    threading.Thread(target=watch, daemon=True).start()


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
try:
    _prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: a forked child only calls it
except (OSError, AttributeError):  # not Linux
    _prctl = None
_command: int | None = None  # the prepare command's pid while run() runs in it; None in every other process


def _die_with_command() -> None:
    """In each child the command forks while run() runs (os.register_at_fork), the engine's manager servers
    (multiprocess.Manager(), one a stage): end it with the command. A kill -9 left them under init for good,
    and with them the fork server and resource tracker, which end when the last holder of their pipe closes
    it (a manager forked after they started holds both): ~170 MB each time. Pool workers watch the command
    themselves (_exit_with)."""
    global _command
    owner, _command = _command, None  # a grandchild is its own parent's business
    if owner is None:
        return
    if _prctl is not None:  # the kernel's: SIGKILL when the thread that forked this one ends
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    else:
        _exit_with(owner)
    if os.getppid() != owner:  # the command ended before that took effect
        os._exit(1)


os.register_at_fork(after_in_child=_die_with_command)


class _Local(LocalPipelineExecutor):
    """The engine's local executor, its per-task log records kept to its log files; its workers end with
    the command that started them."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.owner = os.getpid()

    def _run_for_rank(self, rank: int, local_rank: int = 0, node_rank: int = -1):
        if os.getpid() != self.owner and not getattr(_Local, "_watching", False):
            _Local._watching = True
            _exit_with(self.owner)
        real = sys.stderr
        sys.stderr = _WithoutEngineLog(real)  # the engine points its console log at sys.stderr per task
        try:
            return super()._run_for_rank(rank, max(local_rank, 1), node_rank)
        finally:
            sys.stderr = real


def stages(sources: list[str], tokenizer_dir, work: Path, out: Path, opts: CorpusOptions, tasks: int,
           shard_tokens: int, repo_fim: float, workers: int, extra: dict,
           threads: bool = True) -> list[tuple[str, list, int]]:
    """The pipeline: (stage name, steps, task count) in the order they run. A document meets the steps in
    the order the report lists them: read, quality filters, deduplication, benchmarks out, secrets replaced.
    threads: a lone encode process may use every core (not when the user asked for --workers: a worker is
    then a core)."""
    w = str(work)
    dedup = opts.dedup in ("exact", "near")
    read = [ReadUnits(w, opts, sources), QualityFilter(w, opts),
            JsonlWriter(f"{w}/docs", output_filename="${rank}.jsonl", compression=None)]
    encode: list = [TaskDocs(w), Tally(w, "before dedup")]
    out_stages: list[tuple[str, list, int]] = [("read", read, tasks)]
    if dedup:
        read.append(ExactSignature(f"{w}/exact", config=EXACT))
        encode.append(ExactDedupFilter(f"{w}/exact_dups", config=EXACT))
        out_stages.append(("exact", [ExactFindDedups(f"{w}/exact", f"{w}/exact_dups", config=EXACT)], 1))
    if opts.dedup == "near":
        mh = minhash_config(opts.near_threshold)
        near = [TaskDocs(w), ExactDedupFilter(f"{w}/exact_dups", config=EXACT),
                CodeMinhashSignature(f"{w}/sigs", mh)]
        out_stages += [("near", near, tasks),
                       ("buckets", [MinhashDedupBuckets(f"{w}/sigs", f"{w}/buckets", config=mh)],
                        mh.num_buckets),
                       ("clusters", [MinhashDedupCluster(f"{w}/buckets", f"{w}/clusters", config=mh)], 1)]
        encode += [Tally(w, "after exact"), MinhashDedupFilter(f"{w}/clusters")]
    encode.append(Tally(w, "after dedup"))
    if opts.decontaminate:
        encode.append(BenchmarkFilter(w, opts))
    if opts.redact_secrets or opts.redact_pii:
        encode.append(RedactSecrets(w, opts))
    encode.append(EncodeShards(w, str(tokenizer_dir), opts.val_fraction, shard_tokens, repo_fim,
                               list(sources), threads=threads and min(workers, tasks) == 1))
    out_stages.append(("encode", encode, tasks))
    out_stages.append(("merge",
                       [MergeShards(w, str(out), str(tokenizer_dir), tasks, shard_tokens, list(sources),
                                             extra)], 1))
    return out_stages


class _Quiet:
    """While the stages run: the engine's progress bars off and its console log at warnings (its logs stay
    in WORK/logs), stderr escaped and without the engine's records (_WithoutEngineLog), the soft limit on
    open files raised to the hard one; all put back after."""

    def __enter__(self):
        # the engine's records (its closing stats table, emoji and all, logged in this process after the
        # workers end) stay in WORK/logs, as the workers' do
        self.stderr, sys.stderr = sys.stderr, _WithoutEngineLog(sys.stderr)
        setup_default_logger()  # loguru's console handler holds the stderr of its making: this one now
        self.env = {k: os.environ.get(k) for k in ("TQDM_DISABLE", "LOGURU_LEVEL")}
        os.environ.update(TQDM_DISABLE="1", LOGURU_LEVEL="WARNING")
        self.nofile = resource.getrlimit(resource.RLIMIT_NOFILE)
        soft, hard = self.nofile
        want = hard if hard != resource.RLIM_INFINITY else 65536
        if soft != resource.RLIM_INFINITY and soft < want:
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            except (ValueError, OSError):
                pass
        return self

    def __exit__(self, *exc) -> None:
        sys.stderr = self.stderr
        for k, v in self.env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, self.nofile)
        except (ValueError, OSError):
            pass
        setup_default_logger()  # loguru's default console handler on the real stderr again


def run(sources: list[str], tokenizer_dir, work: Path, out: Path, opts: CorpusOptions, shard_tokens: int,
        repo_fim: float, extra: dict, workers: int | None, executor: str = "local", tasks: int | None = None,
        slurm: dict | None = None, log=print) -> dict | None:
    """Plan, then run every stage on `executor`; the dataset's meta (local), or None once the Slurm jobs are
    submitted (the last of them publishes OUT)."""
    global _command
    if executor not in EXECUTORS:
        raise ShardError(f"--executor {executor!r} is not one of {', '.join(EXECUTORS)}")
    if tasks is not None and not 1 <= tasks <= MAX_TASKS:
        raise ShardError(f"--tasks {tasks}: give 1 to {MAX_TASKS} (the "
                         "dedup stages keep files of every task open)")
    check_sources(sources)  # a missing source, a FIFO or device named directly: refused before any work
    if executor == "slurm":
        slurm_jobs.check_paths(work)
    workdir.enter(work)
    # the engine's pool forks its workers from a fork server: with this module loaded there once, a worker
    # starts in milliseconds instead of importing codeforge and datatrove again (~1 s a worker, every stage)
    multiprocess.set_forkserver_preload(["codeforge.data.pipeline"])
    lock = workdir.lock(work)
    _command = os.getpid()
    try:
        workdir.audit(work)
        with _Quiet():
            t = make_plan(sources, opts, work, tasks)
            threads = not workers  # the default: a single process encodes on every core
            if not workers:
                workers = auto_workers(json.loads((work / "plan" / "plan.json").read_text())["bytes"])
            pipeline = stages(sources, tokenizer_dir, work, out, opts, t, shard_tokens, repo_fim, workers,
                              extra, threads)
            if executor == "slurm":
                return slurm_jobs.submit(pipeline, work, slurm or {}, log)
            for name, steps, n in pipeline:
                _run_stage(name, steps, n, workers, work, log)
    finally:
        _command = None
        lock.close()
    return json.loads((out / "meta.json").read_text())


def _run_stage(name: str, steps: list, n: int, workers: int, work: Path, log) -> None:
    logs = work / "logs" / name
    done = len(list((logs / "completions").iterdir())) if (logs / "completions").is_dir() else 0
    t0 = time.perf_counter()
    ex = _Local(steps, tasks=n, workers=max(1, min(workers, n)), logging_dir=str(logs))
    try:
        ex.run()
    except CodeforgeError:
        raise
    except Exception as e:
        raise StageFailed(f"prepare's {name} stage failed: {type(e).__name__}: {e} (each task's log is in "
                          f"{logs / 'logs'}; run the same command "
                          "again to redo only the unfinished tasks)") from e
    note = f", {done} done before" if done else ""
    log(f"  {name:8s} {n:4d} task(s) on {max(1, min(workers, n))} worker(s){note}: "
        f"{time.perf_counter() - t0:.1f}s")
