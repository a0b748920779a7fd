"""`codeforge prepare --executor slurm`: one job array per stage (datatrove's SlurmPipelineExecutor), each
after the one before it, the last one publishing OUT.

The engine writes paths into its job scripts bare: an --out with a space broke the job, and one holding
$(...) ran that command. Here every value of an #SBATCH line is quoted as sbatch reads it (_sbatch_word),
every path on a command line as bash reads it (shlex.quote), and a work directory no quoting can carry (a
control character; a %, which Slurm expands in log file names) is refused before anything is written.

Run on a real (one-node) cluster (tests/test_slurm_cluster.py), two things did not work as the docs said:
- a job that failed or was cancelled left every later stage's job pending for ever (DependencyNeverSatisfied:
  Slurm keeps an afterok job whose dependency failed), so "once all have ended" never came: every job is now
  submitted with --kill-on-invalid-dep=yes, and Slurm cancels the rest of the chain;
- the same command again refused while submitted.json was there, even with the queue empty: it now asks
  squeue, and submits the unfinished tasks once none of the recorded jobs is pending or running (if squeue
  cannot say, it refuses as before).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

from datatrove.executor import SlurmPipelineExecutor

from .. import printable
from . import workdir
from .workdir import KeepWork
from .writer import ShardError


def env_command() -> str:
    """The command a Slurm job runs first: the virtual environment this command runs in, if any."""
    if sys.prefix != sys.base_prefix:
        return f"source {shlex.quote(str(Path(sys.prefix) / 'bin' / 'activate'))}"
    return ""


def check_paths(work: Path) -> None:
    """Refuse a work directory whose path no quoting carries into a job script's #SBATCH lines (the log
    files are under it): a control character (a newline ends the line, and the rest is run as a command),
    or a % (Slurm expands %j, %u, ... in log file names)."""
    bad = sorted({c for c in str(work) if ord(c) < 32 or ord(c) == 127 or c == "%"})
    if bad:
        raise ShardError(printable(
            f"--executor slurm: the work directory {str(work)!r} (beside --out) holds "
            f"{', '.join(map(repr, bad))}, which a job script cannot carry (a newline ends an #SBATCH line; "
            f"Slurm expands % in its log file names): choose an --out path without it"))


def _sbatch_word(value) -> str:
    """A value as an #SBATCH line carries it. sbatch splits the line at white space, ends it at a # outside
    quotes, and takes quotes and backslash escapes as a shell does: a value that needs it is put in double
    quotes, its backslashes and quotes escaped; a plain one stays as it is."""
    v = str(value)
    if any(ord(c) < 32 or ord(c) == 127 for c in v):
        raise ShardError(printable(f"--executor slurm: {v!r} cannot go into a job script: it holds a control "
                                   f"character (a newline would end the #SBATCH line)"))
    return v if shlex.quote(v) == v else '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'


class _Slurm(SlurmPipelineExecutor):
    """The engine's Slurm executor, its job scripts with every value and path quoted: it writes them in
    bare, so an --out with a space broke the job, and one holding $(...) ran that command in it."""

    def get_launch_file_contents(self, sbatch_args: dict, run_script: str) -> str:
        # the engine's command lines name these paths (its job, or its stats merge), each one word
        paths = sorted((self.logging_dir.resolve_paths(n) for n in ("executor.pik", "stats.json", "stats")),
                       key=len, reverse=True)
        whole = "|".join(re.escape(p) for p in paths)
        quoted = re.sub(rf"(?<= )({whole})(?= |$)", lambda m: shlex.quote(m[1]), run_script)
        words = shlex.split(quoted)
        if any(p in run_script and p not in words for p in paths):
            raise ShardError(printable(f"--executor slurm: the engine's job command {run_script!r} names its "
                                       f"files in a way codeforge cannot quote (a datatrove version it does "
                                       f"not know?): not submitted"))
        args = {k: _sbatch_word(v) if v else v for k, v in sbatch_args.items()}
        return super().get_launch_file_contents(args, quoted)


def submit(pipeline: list[tuple[str, list, int]], work: Path, slurm: dict, log=print) -> None:
    """One Slurm job array per stage of `pipeline` (pipeline.stages), each after the one before it
    (afterok); submitted.json in `work` records the jobs."""
    if not slurm.get("partition"):
        raise KeepWork("--executor slurm needs --slurm-partition NAME (the partition the jobs run in)")
    marker = work / workdir.SUBMITTED
    why = workdir.submitted(work)
    if why:
        left = queued(marker)
        if left is None:  # squeue could not say: the user checks
            raise KeepWork(f"{why}: it submits only the unfinished tasks")
        if left:
            raise KeepWork(f"Slurm jobs {', '.join(left)} submitted for {work} are still in the queue "
                           f"(squeue -j {','.join(left)}): wait for them to end, or cancel them (scancel "
                           f"{' '.join(left)}), then run the same command again to submit the unfinished "
                           f"tasks")
        log(f"the Slurm jobs submitted before for {work} have all left the queue: submitting the unfinished "
            f"tasks")
        marker.unlink()
    # a job that fails or is cancelled: Slurm cancels the jobs after it (without this they wait for ever,
    # pending with DependencyNeverSatisfied, and "once all have ended" never comes)
    sbatch_args = {"kill-on-invalid-dep": "yes", **(slurm.get("sbatch_args") or {})}
    prev, executors = None, []
    for name, steps, n in pipeline:
        ex = _Slurm(
            steps, tasks=n, time=slurm.get("time", "04:00:00"), partition=slurm["partition"],
            cpus_per_task=slurm.get("cpus_per_task", 1), mem_per_cpu_gb=slurm.get("mem_per_cpu_gb", 2),
            job_name=f"codeforge-prepare-{name}", logging_dir=str(work / "logs" / name), depends=prev,
            env_command=slurm.get("env_command") or env_command(), qos=slurm.get("qos", ""),
            sbatch_args=sbatch_args, workers=slurm.get("workers", -1), mail_user=None)
        executors.append(ex)
        prev = ex
    prev.run()  # launches its dependencies first, each with --dependency=afterok on the one before
    ids = [e.job_id for e in executors if e.job_id not in (None, -1)]
    workdir.write_text(marker, json.dumps({"jobs": ids, "at": time.time()}))
    log(f"submitted {len(pipeline)} Slurm job arrays (jobs {', '.join(map(str, ids))}; scripts and logs "
        f"under {work / 'logs'}); the last one writes the dataset. If one fails, Slurm cancels the ones "
        f"after it: once none is in the queue, run the same command again to submit only the unfinished "
        f"tasks")
    return None


QUEUED_TIMEOUT = 60  # seconds squeue may take to answer


def queued(marker: Path) -> list[str] | None:
    """The jobs recorded in `marker` (submitted.json) that are still pending, running or completing, as
    squeue lists this user's jobs (an array by its job id); None when that cannot be known: the list is
    unreadable, or squeue is missing or failed (no cluster configured here, the controller unreachable)."""
    try:
        with open(workdir.open_nofollow(marker, os.O_RDONLY), "rb") as f:  # as workdir.submitted reads it
            ids = {str(j) for j in json.loads(f.read(1 << 20))["jobs"]}
        got = subprocess.run(["squeue", "--noheader", "--me", "--format=%F"], capture_output=True, text=True,
                             timeout=QUEUED_TIMEOUT)
    except (OSError, ValueError, KeyError, TypeError, KeepWork, subprocess.SubprocessError):
        return None
    if got.returncode:
        return None
    listed = {line.strip() for line in got.stdout.splitlines()}
    return sorted(ids & listed, key=lambda j: (len(j), j))
