"""Stop requests: SIGINT and SIGTERM recorded, so the run stops after the step (or evaluation) under way with
a checkpoint, and, with several ranks, the step at which every rank stops agreed before any of them acts on
it (a rank that stopped alone would leave the others waiting in an all-reduce)."""

from __future__ import annotations

import os
import signal
import sys

import torch

# how the user continues a stopped run, said when a stop saves a checkpoint: a command that wraps training
# (the quickstart) sets its own in the environment (its training ranks may be processes of their own), so a
# Ctrl-C is answered with one way to go on, not two
RESUME_HINT = "CODEFORGE_RESUME_HINT"


def resume_hint() -> str:
    return os.environ.get(RESUME_HINT) or "continue with --resume"


class StopRequests:
    """install() records SIGINT/SIGTERM (a second Ctrl-C stops at once, without a checkpoint), restore() puts
    the handlers back (keep() leaves them recording until the process ends), agreed(trainer) says whether
    this step stops."""

    def __init__(self, master: bool):
        self.master = master
        self.signal: str | None = None  # the signal asked for, by name
        self.old: dict = {}

    def install(self) -> "StopRequests":
        self.old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def _on_signal(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.signal and signum == signal.SIGINT:  # a second Ctrl-C: now, without a checkpoint
            raise KeyboardInterrupt
        self.signal = name
        if self.master:  # an evaluation or a long step can take minutes: say that it was heard
            again = "; Ctrl-C again stops at once, without one" if signum == signal.SIGINT else ""
            print(f"\n{name}: stopping after this step (or evaluation), with a checkpoint{again}",
                  file=sys.stderr, flush=True)

    def keep(self) -> None:
        """Leave the handlers recording (the process is about to end with its own message)."""
        self.old = {}

    def restore(self) -> None:
        for s, h in self.old.items():
            signal.signal(s, h)
        self.old = {}

    def agreed(self, trainer) -> bool:
        """Whether this step stops. One rank: whether a signal came. Several: stop if one came to any rank,
        and publish a sharded checkpoint written in the background once every rank's part is done (agreed in
        the same all-reduce)."""
        if not trainer.ddp:
            return bool(self.signal)
        pending = trainer.pending
        # [stop asked anywhere, background save unfinished anywhere]
        flag = torch.tensor([1 if self.signal else 0, 1 if pending is not None and not pending.done() else 0],
                            device=trainer.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        stopping, writing = (bool(v) for v in flag.tolist())
        if stopping and not self.signal:
            self.signal = "SIGTERM"  # a signal that lands after this is acted on next step
        if trainer.pending is not None and not writing:  # every rank's shards are written: publish
            trainer._finish_pending()
        return stopping
