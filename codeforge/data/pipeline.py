"""`codeforge prepare` for code, as a datatrove pipeline: every core of this machine, a Slurm or Ray cluster.

datatrove (the engine FineWeb was built with) schedules the work: its executors run each stage as tasks
(a process pool here: local.py; a job array on Slurm: slurm.py; Ray actors: ray_executor.py), mark every
finished task on disk and skip those on a rerun, and its staged exact and MinHash deduplication keep their
state in files. The steps that read, filter and encode are codeforge's (corpus.py's readers with their bounds
on hostile input, its filters, decontam.py, redact.py, the shard writer), written as datatrove steps in
steps.py. This file makes the plan, puts the stages in order and runs them.

The work directory, `.OUT.prepare-FINGERPRINT` beside OUT, holds everything between stages:
  plan/       units.jsonl (every file or piece, in reading order, with its size), RANK.jsonl (one task's run
              of them), plan.json (the task count, the start time), stats.json (what the walk skipped),
              chunks/ (compressed inputs decompressed in pieces: removed with the work directory)
  docs/       RANK.jsonl: the documents each task kept after reading and quality filters, with their content
              hash (taken before secrets are replaced: it picks the split); raw text, secrets included, so
              removed as soon as the encode stage is done (the merge starts by removing it)
  exact/, exact_dups/, sigs/, buckets/, clusters/   the engine's deduplication state
  tokens/     RANK/: one task's shards (train_000000.bin, ...), offsets, content hashes, summary.json
  stats/      STEP/RANK.json: each step's counts per task (documents and bytes in and out, skip reasons)
  tally/      POINT/RANK.json: the documents and bytes passing each point around the dedup filters
  logs/       STAGE/: the engine's logs per task and its completion markers (completions/RANK)
  out/        the merged dataset, renamed to OUT when complete
It is this user's alone and trusted no further (workdir.py): 0700, refused if another user owns it or it holds
a symlink, and never removed while a prepare or Slurm job may use it. A plan entry must lie under the inputs,
and a file is read only if the file opened is inside its input tree (steps.py, _read_inside).

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
that fails (a task's error, a full disk) keeps the work directory (StageFailed); an error in the data (an
empty corpus, --strict) removes it. Not handled: a pool worker killed on its own (the kernel's OOM killer)
leaves the engine's pool waiting for it; stop the command and run it again.

A unit is a file of a walked directory, a single-file source (a JSONL, a parquet, an hf: dataset), or a
piece of a large single-file source: a JSONL, compressed JSONL or parquet file of more than two pieces'
worth is cut at plan time (pieces.py: byte ranges at line ends, decompressed chunks, runs of row groups), so
a corpus given as one large file is still many tasks, read as the whole file would be. Tasks are cut at
directory changes where they can (a task may grow to twice its share first), so repo-level FIM documents
rarely lose their context.

Near duplicates: MinHash over the same code-aware shingles as before (5 whitespace-separated words, so `a+b`
and `a + b` differ and punctuation counts), with 128 hashes in the bands datasketch's LSH picks for
--near-threshold (0.85: 8 bands of 16). Each cluster keeps one document (the engine's union-find root);
exact duplicates keep the first in reading order.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import threading
import time
from pathlib import Path

from datatrove.pipeline.dedup.exact_dedup import ExactDedupFilter, ExactFindDedups
from datatrove.pipeline.dedup.minhash import MinhashDedupBuckets, MinhashDedupCluster, MinhashDedupFilter
from datatrove.pipeline.writers import JsonlWriter

from .. import CodeforgeError, redact
from ..corpus import CorpusOptions, CorpusStats, check_sources, source_units
from . import fork_server, local, pieces, ray_executor, workdir
from . import slurm as slurm_jobs
from .steps import (EXACT, BenchmarkFilter, CodeMinhashSignature, EncodeShards, ExactSignature, MergeShards,
                    QualityFilter, ReadUnits, RedactSecrets, Tally, TaskDocs, minhash_config, save_stats)
from .workdir import KeepWork
from .writer import ShardError

TASK_BYTES = 32 << 20  # input bytes per task: the unit of work a worker takes, and of a rerun after a kill
MIN_TASKS = 16  # a small corpus is still cut in this many tasks (if it has the files), so 16 cores share it
MAX_TASKS = 300  # the exact-dedup stage holds up to 3 open files per task (the usual limit is 1,024;
# local.Quiet raises the soft limit to the hard one while the stages run, and run() refuses more tasks)
WORKER_BYTES = 8 << 20  # input bytes that pay for one more worker process (auto_workers)
EXECUTORS = ("local", "slurm", "ray")


# -- the plan: units of reading, cut into tasks -------------------------------------------------------------

def task_count(units: int, total_bytes: int) -> int:
    """T: about TASK_BYTES of input each, at least MIN_TASKS and at most MAX_TASKS, never more than units."""
    want = max(MIN_TASKS, math.ceil(total_bytes / TASK_BYTES))
    return max(1, min(units, want, MAX_TASKS))


def make_plan(sources: list[str], opts: CorpusOptions, work: Path, tasks: int | None = None) -> int:
    """Walk the sources once (nothing is read) into work/plan, cut into contiguous runs of about equal bytes,
    one per task, none empty; the number of tasks. Reused as it is when a previous run of the same command
    wrote it."""
    plan = work / "plan"
    if (plan / "plan.json").exists():
        return json.loads((plan / "plan.json").read_text())["tasks"]
    shutil.rmtree(plan, ignore_errors=True)
    plan.mkdir(parents=True)
    stats = CorpusStats()
    n, total = 0, 0
    with open(plan / "units.jsonl", "xb") as f:  # streamed: a corpus of millions of files is not held
        for src in sources:
            for path, tree, size in source_units(src, opts, stats):
                # a large JSONL or parquet input: in pieces, so that every worker reads part of it
                parts = pieces.split(path, size, TASK_BYTES, plan, opts.text_field) if tree is None else None
                for unit in ([[path, tree, size]] if parts is None else
                             [[path, None, _piece_size(p), p] for p in parts]):
                    f.write(json.dumps(unit).encode() + b"\n")  # json: a file name may hold surrogates
                    n += 1
                    total += unit[2]
    t = max(1, min(tasks, max(n, 1))) if tasks else task_count(n, total)
    outs = [open(plan / f"{r:05d}.jsonl", "xb") for r in range(t)]  # x: a new file, never through a link
    try:
        done, cur, cur_bytes, last_dir = 0, 0, 0, None
        with open(plan / "units.jsonl", "rb") as f:
            for i, line in enumerate(f):
                path, _, size, *piece = json.loads(line)
                here = (path, i) if piece else os.path.dirname(path)  # a file's pieces may go to any task
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
    save_stats(work, "plan", 0, stats)
    # plan.json marks the plan complete: written whole or not at all
    workdir.write_text(plan / "plan.json",
                       json.dumps({"tasks": t, "units": n, "bytes": total, "started": time.time()}))
    return t


def _piece_size(piece: dict) -> int:
    """The bytes a piece of a large input stands for (its share of the input, for cutting tasks)."""
    if "bytes" in piece:
        return piece["bytes"][1] - piece["bytes"][0]
    return piece.get("size", 0)


def auto_workers(total_bytes: int) -> int:
    """The default --workers: this machine's cores, but one per WORKER_BYTES of input at most (starting a
    pool of processes costs about a second a stage, more than a small repository takes on one core)."""
    return max(1, min(len(os.sched_getaffinity(0)), total_bytes // WORKER_BYTES))


# -- stages and executors ------------------------------------------------------------------------------------

class StageFailed(KeepWork):
    """A stage failed for a reason other than the data (a worker's error, a full disk): the work directory
    is kept, and the same command redoes only the unfinished tasks."""


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
    merge = MergeShards(w, str(out), str(tokenizer_dir), tasks, shard_tokens, list(sources), extra)
    out_stages.append(("merge", [merge], 1))
    return out_stages


def run(sources: list[str], tokenizer_dir, work: Path, out: Path, opts: CorpusOptions, shard_tokens: int,
        repo_fim: float, extra: dict, workers: int | None, executor: str = "local", tasks: int | None = None,
        slurm: dict | None = None, log=print) -> dict | None:
    """Plan, then run every stage on `executor`; the dataset's meta (local, ray), or None once the Slurm jobs
    are submitted (the last of them publishes OUT). slurm: the --slurm-* options (slurm.submit), and under
    "ray" the --ray-* ones (ray_executor.options: address, cpus_per_task, mem_per_cpu_gb)."""
    if executor not in EXECUTORS:
        raise ShardError(f"--executor {executor!r} is not one of {', '.join(EXECUTORS)}")
    if executor == "ray":
        ray_executor.need_ray()  # not installed: said before any work
    if tasks is not None and not 1 <= tasks <= MAX_TASKS:
        raise ShardError(f"--tasks {tasks}: give 1 to {MAX_TASKS} (dedup holds every task's files open)")
    check_sources(sources)  # a missing source, a FIFO or device named directly: refused before any work
    if executor == "slurm":
        slurm_jobs.check_paths(work)
    workdir.enter(work)
    # the engine's pool forks its workers from a fork server: with this module loaded there once, a worker
    # starts in milliseconds instead of importing codeforge and datatrove again (~1 s a worker, every stage)
    fork_server.preload()
    lock = workdir.lock(work)
    try:
        with local.ending_with_this_process():
            workdir.audit(work)
            with local.Quiet():
                t = make_plan(sources, opts, work, tasks)
                if executor == "ray":  # a task is a Ray actor with its own CPUs: the encoder stays on them
                    pipeline = stages(sources, tokenizer_dir, work, out, opts, t, shard_tokens, repo_fim,
                                      workers or 1, extra, threads=False)
                    ray_opts = ray_executor.options((slurm or {}).get("ray"))
                    with ray_executor.connected(ray_opts["address"], log) as ray:
                        ray_executor.fits(ray, ray_opts["cpus_per_task"], ray_opts["mem_per_cpu_gb"])
                        for name, steps, n in pipeline:
                            _run_stage(name, steps, n, workers, work, log, ray_opts)
                    return json.loads((out / "meta.json").read_text())
                threads = not workers  # the default: a single process encodes on every core
                if not workers:
                    workers = auto_workers(json.loads((work / "plan" / "plan.json").read_text())["bytes"])
                pipeline = stages(sources, tokenizer_dir, work, out, opts, t, shard_tokens, repo_fim, workers,
                                  extra, threads)
                if executor == "slurm":
                    return slurm_jobs.submit(pipeline, work, slurm or {}, log)
                if workers == 1 and opts.redact_secrets:  # the tasks run in this process: its scans
                    # compiled on a thread of their own while the read stage runs (a pool's workers have
                    # them from the fork server)
                    threading.Thread(target=redact.warm, daemon=True).start()
                for name, steps, n in pipeline:
                    _run_stage(name, steps, n, workers, work, log)
    finally:
        lock.close()
    return json.loads((out / "meta.json").read_text())


def _run_stage(name: str, steps: list, n: int, workers: int | None, work: Path, log,
               ray_opts: dict | None = None) -> None:
    """One stage's n tasks on the local executor, `workers` at a time, or with ray_opts on Ray (ray_executor:
    at most `workers` at once if given); its line of the log."""
    logs = work / "logs" / name
    done = len(list((logs / "completions").iterdir())) if (logs / "completions").is_dir() else 0
    t0 = time.perf_counter()
    if ray_opts is None:
        # the read stage's workers forked from this process itself, which has every module they need loaded
        # (the fork server may still be compiling the secrets step's scans, which only the encode stage
        # needs: 8.75 -> 8.43 s on Go's standard library), when it runs no other thread (a fork copies only
        # the forking thread); every other stage's from the fork server
        fork = name == "read" and threading.active_count() == 1
        ex = local.LocalExecutor(steps, tasks=n, workers=max(1, min(workers, n)), logging_dir=str(logs),
                                 start_method="fork" if fork else "forkserver")
        where = f"{max(1, min(workers, n))} worker(s)"
    else:
        ex = ray_executor.executor(steps, n, workers, logs, ray_opts)
        where = f"Ray, {ray_opts['cpus_per_task']} CPU(s) each"
    try:
        ex.run()
    except CodeforgeError:
        raise
    except Exception as e:
        why = f"{type(e).__name__}: {e}"
        raise StageFailed(f"prepare's {name} stage failed: {why} (each task's log is in {logs / 'logs'}; run "
                          f"the same command again to redo only the unfinished tasks)") from e
    left = ex.get_incomplete_ranks() if ray_opts is not None else []
    if left:  # the engine's Ray executor logs a task's error and returns as if the stage were done
        raise StageFailed(f"prepare's {name} stage failed: {len(left)} of {n} task(s) did not finish "
                          f"({ray_executor.why_failed(logs, left)}; each task's log is in {logs / 'logs'}; "
                          f"run the same command again to redo only the unfinished tasks)")
    note = f", {done} done before" if done else ""
    log(f"  {name:8s} {n:4d} task(s) on {where}{note}: {time.perf_counter() - t0:.1f}s")
