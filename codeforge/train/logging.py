"""Where training reports go: metrics.jsonl (always), TensorBoard, W&B (when asked), a progress bar."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

from tqdm import tqdm

from .. import rundir


def duration(s: float) -> str:
    """4s, 12m05s, 3h20m, 20.4 days."""
    s = max(int(round(s)), 0)
    if s < 90:
        return f"{s}s"
    if s < 5400:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 2 * 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s / 86400:,.1f} days"


class RunLogger:
    LINE_SECONDS = 60.0       # without a bar: a progress line at least this often
    MIN_LINE_SECONDS = 5.0    # and at most this often

    def __init__(self, run_dir: Path, total_steps: int, start_step: int, tensorboard: bool = True,
                 wandb: bool = False, wandb_project: str = "codeforge", config: dict | None = None,
                 progress: bool = True, enabled: bool = True):
        self.enabled = enabled
        self.path = run_dir / rundir.METRICS
        self.tb = self.wb = self.bar = None
        if not enabled:
            return
        if start_step > 0 and self.path.exists():
            self._truncate_after(start_step)
        self.f = open(self.path, "a", buffering=1)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(str(run_dir / rundir.TENSORBOARD), purge_step=start_step or None)
        if wandb:
            try:
                import wandb as wb
            except ImportError as e:
                raise ValueError("--wandb needs the wandb package: pip install 'codeforge[wandb]' "
                                 "(WANDB_MODE=offline works without a network)") from e
            self.wb = wb.init(project=wandb_project, dir=str(run_dir), config=config, resume="allow",
                              id=run_dir.name)
        if progress:
            self.bar = tqdm(total=total_steps, initial=start_step, dynamic_ncols=True, file=sys.stderr,
                            disable=None, unit="step")
            if self.bar.disable:  # not a terminal: plain progress lines instead
                self.bar = None
        self.total = total_steps
        self.last_line = time.monotonic()

    def _truncate_after(self, step: int) -> None:
        """On resume, drop records of steps after the checkpoint (they will be produced again) and a last line
        cut short by a crash."""
        keep = []
        for ln in self.path.read_text().splitlines():
            try:
                rec = json.loads(ln)
            except json.JSONDecodeError:
                continue
            if rec["step"] <= step:
                keep.append(ln)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(ln + "\n" for ln in keep))
        tmp.replace(self.path)

    def log(self, rec: dict) -> None:
        if not self.enabled:
            return
        self.f.write(json.dumps(rec) + "\n")
        step = rec["step"]
        for k, v in rec.items():
            if k != "step" and isinstance(v, (int, float)) and math.isfinite(v):
                if self.tb:
                    self.tb.add_scalar(k if "/" in k else ("val/" if k.startswith("val_") else "train/") + k,
                                       v, step)
        if self.wb:
            self.wb.log(rec, step=step)

    def line_due(self) -> bool:
        """Without a progress bar, whether a progress line is due because LINE_SECONDS passed (so a slow run
        whose log_every is many minutes away still says how it goes)."""
        return self.enabled and self.bar is None and time.monotonic() - self.last_line >= self.LINE_SECONDS

    def set_total(self, total: int) -> None:
        """The run's step count changed (a time budget chose it)."""
        self.total = total
        if self.bar is not None:
            self.bar.total = total
            self.bar.refresh()

    def now(self) -> float:
        """The clock progress lines are spaced by."""
        return time.monotonic()

    def progress(self, step: int, postfix: dict, eta: float | None = None, when: float | None = None) -> None:
        """The progress bar on a terminal; otherwise (output redirected, or --no-progress) a compact line
        every log_every steps, at most one per MIN_LINE_SECONDS, and at least one per LINE_SECONDS. when: the
        time (now()) the line is of, where it is written later (--host-sync log writes it a step late)."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.n = step
            self.bar.set_postfix(postfix, refresh=False)
            self.bar.refresh()
            return
        now = time.monotonic() if when is None else when
        if now - self.last_line < self.MIN_LINE_SECONDS and step != self.total and step != 1:
            return
        self.last_line = now
        parts = [f"step {step}/{self.total}"] + [f"{k} {v}" for k, v in postfix.items()]
        if eta is not None:
            parts.append(f"ETA {duration(eta)}")
        print(" | ".join(parts), file=sys.stderr, flush=True)

    def message(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if not self.enabled:
            return
        self.f.close()
        if self.tb:
            self.tb.close()
        if self.wb:
            self.wb.finish()
        if self.bar is not None:
            self.bar.close()
