"""prepare's fork server, started before the command imports its engine.

The local executor's pools fork their workers from multiprocess's fork server, which imports PRELOAD once
(codeforge and datatrove: ~0.7 s) so that a worker starts in milliseconds. Started at the first pool, that
import was a serial wait before the first task; started as the command begins, it runs on another core
while the command imports the same modules itself. This module imports nothing heavy for that reason.
"""

from __future__ import annotations

import os

# the pipeline's modules, and the secrets step's Hyperscan databases compiled once (warm_scans.py)
PRELOAD = ["codeforge.data.pipeline", "codeforge.data.warm_scans"]


def preload() -> None:
    """What the fork server imports before it forks a worker."""
    import multiprocess
    multiprocess.set_forkserver_preload(PRELOAD)


def start_early() -> None:
    """The fork server started now, importing PRELOAD in its own process, where a pool may follow: a machine
    with more than one core. A command that then runs no pool (one worker) leaves it idle; it ends with the
    command."""
    if len(os.sched_getaffinity(0)) < 2:
        return
    preload()
    from multiprocess import forkserver
    forkserver.ensure_running()
