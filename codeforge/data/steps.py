"""prepare's steps, as datatrove pipeline steps: what each stage of pipeline.py does to a task's documents.

  read stage    ReadUnits (corpus.read_unit on this task's units of the plan; a walked directory's files only
                if the file opened lies inside it), QualityFilter, ExactSignature
  near stage    CodeMinhashSignature: MinHash over 5-word shingles of code (case and punctuation kept), in the
                bands datasketch's LSH would pick for the threshold (lsh_bands)
  encode stage  TaskDocs (the documents the read stage kept), Tally (counts between the dedup filters),
                BenchmarkFilter (decontam.py), RedactSecrets (redact.py), EncodeShards (token ids into the
                task's own shards, split train/val by content hash)
  merge stage   MergeShards: the tasks' shards joined in task order, meta.json, OUT published

The reading and filtering steps count what they keep and drop into WORK/stats/STEP/RANK.json (save_stats),
Tally into WORK/tally/; the merge sums them, in task order, into the dataset's report. The engine's own steps
(JsonlWriter, the exact and MinHash dedup filters and stages) sit between these; pipeline.stages puts them in
order.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import os
import shutil
import stat
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import orjson
from datatrove.data import Document as EngineDocument
from datatrove.pipeline.base import PipelineStep
from datatrove.pipeline.dedup.exact_dedup import ExactDedupConfig, ExactDedupSignature
from datatrove.pipeline.dedup.minhash import MinhashConfig, MinhashDedupSignature
from datatrove.utils.word_tokenizers import WordTokenizer

from ..atomic import publish
from ..corpus import (CorpusOptions, CorpusStats, Document, content_hash, read_unit, reject_reason, scrub,
                      split_of)
from ..decontam import benchmarks
from ..redact import scanning as redact_scanning
from ..tokenizer import TOKENIZER_FILE, CodeTokenizer
from . import workdir
from .writer import BATCH_BYTES, SPLITS, RepoDocs, ShardError, SplitWriter, dtype_for, finish_meta

ENGINE = "datatrove"
# corpus.Deduper's shingles and datasketch's default number of hashes: --near-threshold keeps the meaning it
# had when prepare deduplicated in one process
SHINGLE_WORDS = 5
NUM_PERM = 128


# -- the counts each step keeps, per task ------------------------------------------------------------------

def _stats_dict(stats: CorpusStats) -> dict:
    return {"documents": stats.documents, "bytes": stats.bytes, "skipped": dict(stats.skipped),
            "examples": stats.examples, "secrets": dict(stats.secrets), "steps": stats.steps}


def save_stats(work, step: str, rank: int, stats: CorpusStats) -> None:
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


# -- reading inside the walked tree ------------------------------------------------------------------------

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
        save_stats(self.work, self.step, rank, stats)

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
        for path, tree, piece in workdir.plan_units(Path(self.work), rank, self.sources):
            docs = read_unit(path, None, self.opts, stats, piece) if tree is None else \
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
        docs = iter(data)
        # detect-secrets' settings entered once for a run of documents, not for each; never held across a
        # yield (the settings are the process's, and a step after this one may run meanwhile)
        while batch := list(itertools.islice(docs, 64)):
            with redact_scanning():
                for doc in batch:
                    self._replace(doc, stats)
            yield from batch

    def _replace(self, doc, stats) -> None:
        before = doc.metadata["nbytes"]
        text, found = scrub(doc.text, doc.metadata["source"], self.opts)
        if found:
            stats.secrets.update(found)
            doc.text = text
            doc.metadata["nbytes"] = len(text.encode("utf-8"))
        stats.step("secrets replaced", before, True, doc.metadata["nbytes"])


def _text(doc: EngineDocument) -> str:
    return doc.text


def _first_task_first(doc: EngineDocument) -> int:
    """Of exact duplicates the engine keeps the highest priority, then the lowest index in its task: the
    earlier task ranks higher, so the first in reading order is kept."""
    # the engine stores a priority in 16 bits and needs it in [1, 65535]: pipeline.MAX_TASKS tasks fit
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


class _Inline:
    """A pool of no threads: submit() runs the call at once (EncodeShards without a thread of its own)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def submit(self, fn, *args) -> Future:
        done: Future = Future()
        done.set_result(fn(*args))
        return done


@functools.lru_cache(maxsize=4)
def _loaded(tokenizer_dir: str, stamp: tuple[int, int]) -> CodeTokenizer:
    return CodeTokenizer.load(tokenizer_dir)


def _tokenizer(tokenizer_dir: str) -> CodeTokenizer:
    """The tokenizer, loaded once per worker process (a worker runs many encode tasks), again if its file
    changed."""
    st = os.stat(Path(tokenizer_dir) / TOKENIZER_FILE)
    return _loaded(str(tokenizer_dir), (st.st_mtime_ns, st.st_size))


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
        tok = _tokenizer(self.tokenizer_dir)
        dest = Path(self.work) / "tokens" / f"{rank:05d}"
        tmp = dest.with_name(dest.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        dtype = dtype_for(tok.vocab_size)
        writers = {s: SplitWriter(tmp, s, dtype, self.shard_tokens) for s in SPLITS}
        repo = RepoDocs(tok, self.sources, self.repo_fim) if self.repo_fim else None
        kept = {"documents": 0, "bytes": 0}

        def flush(batch: list[Document], encoded: list[list[int]]) -> None:
            out: dict[str, tuple[list, list, list]] = {s: ([], [], []) for s in SPLITS}
            for doc, ids in zip(batch, encoded):
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
        # a lone process that may use every core (threads) encodes a batch on a thread of its own (the Rust
        # encoder leaves the GIL) while this thread pulls the next one through the filters, dedup, benchmark
        # and secret steps; written in order, one batch ahead at most. A worker of many is one core: inline.
        pool = ThreadPoolExecutor(1, thread_name_prefix="codeforge-encode") if self.threads else _Inline()
        with pool:
            ahead = None  # (batch, its encoding's future)

            def hand_on(batch: list[Document]) -> None:
                nonlocal ahead
                job = (batch, pool.submit(tok.encode_batch, [d.text for d in batch]))
                if ahead is not None:
                    flush(ahead[0], ahead[1].result())
                ahead = job

            for d in data:
                doc = Document(d.text, d.metadata["source"], d.metadata["nbytes"],
                               bytes.fromhex(d.metadata["digest"]))
                kept["documents"] += 1
                kept["bytes"] += doc.nbytes
                batch.append(doc)
                size += doc.nbytes
                if len(batch) >= 512 or size >= BATCH_BYTES:  # one encode_batch a batch, bounded in memory
                    hand_on(batch)
                    batch, size = [], 0
            if batch:
                hand_on(batch)
            if ahead is not None:
                flush(ahead[0], ahead[1].result())
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
        shutil.rmtree(work / "plan" / "chunks", ignore_errors=True)  # compressed inputs' decompressed pieces
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
            skipped = dict(stats.skipped) or "nothing found"
            raise ShardError(f"the corpus is empty after filtering (skipped: {skipped}); check --languages, "
                             f"--max-file-bytes and the inputs")
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
