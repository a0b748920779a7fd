"""`codeforge prepare --executor ray`: every stage on datatrove's RayPipelineExecutor, one after the other, on
a Ray instance started here or on an existing cluster (--ray-address auto, or ray://HOST:PORT).

The stages, their steps and the task plan are pipeline.py's, as on the local executor, so the shards are the
same bytes; the completion markers are the engine's (WORK/logs/STAGE/completions), so a rerun skips the
finished tasks, whichever executor finished them. Each task is one Ray actor in a placement group of one
bundle (--ray-cpus CPUs, --ray-mem-gb GB of memory a CPU), which forks one process to run it.

The engine's Ray executor leaves three things to its caller, done here:
- a task that raises is logged (in its log file, at debug level) and the stage returns as if done: the
  completion markers are counted after each stage, and a missing one is pipeline.StageFailed, naming the
  task's log file and its last line;
- a task no node can hold (more CPUs or memory than any one node has) waits for its placement group for ever:
  refused before the first stage (fits);
- its chain of stages (depends=) looks at the one before every 2 minutes: the stages run one after another
  here instead.
The `ray` package is optional (the `ray` extra, hundreds of MB): it is imported only for --executor ray, and
its absence is said with the install command before any work is done (need_ray).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from datatrove.executor import RayPipelineExecutor

from .. import printable
from .local import raise_open_files
from .workdir import KeepWork
from .writer import ShardError

INSTALL = "pip install 'codeforge[ray]'"


def need_ray():
    """The `ray` module, or ShardError naming the install command."""
    try:
        import ray
    except ImportError as e:
        raise ShardError(f"--executor ray needs the `ray` package, which is not installed in this "
                         f"environment ({e}): {INSTALL} (on every node of the cluster, too), or choose "
                         f"--executor local") from e
    return ray


def options(ray_opts: dict | None) -> dict:
    """The --ray-* options with their defaults: address (None: RAY_ADDRESS, else a local instance: connected),
    cpus_per_task, mem_per_cpu_gb (0: no memory reserved)."""
    o = ray_opts or {}
    return {"address": o.get("address") or None, "cpus_per_task": int(o.get("cpus_per_task") or 1),
            "mem_per_cpu_gb": float(o.get("mem_per_cpu_gb", 2) or 0)}


@contextmanager
def connected(address: str | None, log=print) -> Iterator[object]:
    """`ray`, connected: to the instance this process is connected to already (a test's, a notebook's: left
    running), else ray.init at `address` ("auto": the cluster `ray start` joined this machine to; HOST:PORT;
    ray://HOST:PORT through Ray Client), at RAY_ADDRESS when none is given, else on a new local instance;
    disconnected after (a local instance started here is stopped with it).

    With no address, ray.init() itself would join the cluster /tmp/ray/ray_current_cluster names: one whose
    head was stopped without `ray stop` left that file, and ray.init() waited on its address for minutes
    (seen with ray 2.60). "local" starts a new instance whatever that file says; a cluster on this machine
    is --ray-address auto."""
    ray = need_ray()
    if ray.is_initialized():
        yield ray
        return
    address = address or os.environ.get("RAY_ADDRESS") or "local"
    # the tasks' output stays in their log files (WORK/logs), as on the local executor; Ray's own notes
    # (token authentication on, ...) stay off the console too
    kw: dict = {"log_to_driver": False, "logging_level": logging.ERROR}
    if address == "local":
        kw["include_dashboard"] = False  # no web server for an instance that lives as long as this command
    try:
        ray.init(address=address, **kw)
    except (ConnectionError, ValueError, RuntimeError, TimeoutError) as e:
        where = "a local Ray instance" if address == "local" else f"the Ray cluster at {address}"
        token = (" A cluster with token authentication (`ray start`'s default in Ray 2.60) needs, for "
                 "ray://, RAY_AUTH_MODE=token here and its token (RAY_AUTH_TOKEN, or the head's "
                 "~/.ray/auth_token)." if address.startswith("ray://") else "")
        raise KeepWork(printable(f"--executor ray: could not connect to {where}: {type(e).__name__}: {e} "
                                 f"(`ray start --head` on the head node starts a cluster; without "
                                 f"--ray-address, one is started here for this command).{token}")) from e
    try:
        res = ray.cluster_resources()
        nodes = sum(1 for n in ray.nodes() if n.get("Alive"))
        log(f"  Ray at {ray.get_runtime_context().gcs_address}: {nodes} node(s), "
            f"{res.get('CPU', 0):g} CPU(s)")
        yield ray
    finally:
        ray.shutdown()


def fits(ray, cpus: int, mem_gb: float) -> None:
    """Refuse (KeepWork) a task no live node of the cluster can hold: its placement group would wait for
    ever."""
    need = int(mem_gb * cpus * 1024**3)  # as the engine asks for it
    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    if any(r.get("CPU", 0) >= cpus and r.get("memory", 0) >= need for r in nodes):
        return
    have = ", ".join(f"{r.get('CPU', 0):g} CPU(s) and {r.get('memory', 0) / 1024**3:.1f} GB" for r in nodes)
    raise KeepWork(f"--executor ray: each task asks for {cpus} CPU(s) and {need / 1024**3:g} GB of memory "
                   f"(--ray-cpus, --ray-mem-gb a CPU), and no node of the Ray cluster has that much "
                   f"({have or 'no live node'}): lower them, or add a larger node")


class RayExecutor(RayPipelineExecutor):
    """The engine's Ray executor, each task with the soft limit on open files raised to the hard one (the
    exact-dedup stage holds files of every task open; local.Quiet does the same for the local executor)."""

    def _run_for_rank(self, rank: int, local_rank: int = 0, node_rank: int = -1):
        raise_open_files()
        return super()._run_for_rank(rank, local_rank, node_rank)


def executor(steps: list, n: int, workers: int | None, logs: Path, ray_opts: dict) -> RayExecutor:
    """One stage's executor: n tasks, at most `workers` at once (None: as many as the cluster holds)."""
    o = options(ray_opts)
    return RayExecutor(steps, tasks=n, workers=max(1, min(workers, n)) if workers else -1,
                       logging_dir=str(logs), cpus_per_task=o["cpus_per_task"],
                       mem_per_cpu_gb=o["mem_per_cpu_gb"])


def why_failed(logs: Path, ranks: list[int]) -> str:
    """What the first unfinished task's log ends with (its error, as the engine logged it), if anything."""
    path = logs / "logs" / f"task_{ranks[0]:05d}.log"
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 4096))
            lines = [x.strip() for x in f.read().decode("utf-8", "replace").splitlines() if x.strip()]
    except OSError:
        return f"task {ranks[0]} left no log"
    return printable(f"task {ranks[0]}: {lines[-1][:300]}") if lines else f"task {ranks[0]}'s log is empty"
