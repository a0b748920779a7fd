"""Under --host-sync log the time-based progress lines (RunLogger.line_due: at least one a minute) fall at the
steps they fall at under --host-sync step: the line written a step late carries its own time, and is written
before the next line's due time is asked."""

import json
from types import SimpleNamespace

from codeforge.cli.main import main

TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--block-size", "32", "--batch-size", "2",
        "--eval-every", "0", "--sample-every", "0", "--device", "cpu", "--precision", "fp32",
        "--threads", "1",
        "--no-progress", "--warmup-steps", "0", "--log-every", "100", "--max-iters", "8"]


def logged_steps(run):
    rows = map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
    return [r["step"] for r in rows if "loss" in r]


def test_time_based_lines_are_the_same_under_host_sync_log(data_dir, tmp_path, monkeypatch):
    from codeforge.stages import lm
    from codeforge.train import logging as tlog
    from codeforge.train.losses import lm_loss_fn
    clock = [0.0]
    monkeypatch.setattr(tlog, "time", SimpleNamespace(monotonic=lambda: clock[0]))  # logging.py's clock only

    def slow(model, batch):  # every step takes 40 s on the logger's clock
        clock[0] += 40.0
        return lm_loss_fn(model, batch)

    monkeypatch.setattr(lm, "lm_loss_fn", slow)
    got = {}
    for sync in ("step", "log"):
        clock[0] = 0.0
        out = tmp_path / sync
        argv = ["train", "--data", str(data_dir), "--out", str(out), *TINY, "--host-sync", sync]
        assert main(argv) in (0, None)
        got[sync] = logged_steps(out)
    assert got["log"] == got["step"], got
