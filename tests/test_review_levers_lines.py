"""Review: under --host-sync log the time-based progress line (RunLogger.line_due: at least one a minute)
adds a record at the step after each one, which --host-sync step does not write. line_due() is asked before
the waiting line (which resets the logger's clock) is written, so it is still due one step later."""

import json

from codeforge.cli.main import main

TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--block-size", "32", "--batch-size", "2",
        "--eval-every", "0", "--sample-every", "0", "--device", "cpu", "--precision", "fp32", "--threads", "1",
        "--no-progress", "--warmup-steps", "0", "--log-every", "100", "--max-iters", "8"]


def logged_steps(run):
    return [r["step"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def test_time_based_lines_are_the_same_under_host_sync_log(data_dir, tmp_path, monkeypatch):
    from codeforge.stages import lm
    from codeforge.train import logging as tlog
    from codeforge.train.losses import lm_loss_fn
    clock = [0.0]
    monkeypatch.setattr(tlog.time, "monotonic", lambda: clock[0])  # logging.py's clock only

    def slow(model, batch):  # every step takes 40 s on the logger's clock
        clock[0] += 40.0
        return lm_loss_fn(model, batch)

    monkeypatch.setattr(lm, "lm_loss_fn", slow)
    got = {}
    for sync in ("step", "log"):
        clock[0] = 0.0
        out = tmp_path / sync
        assert main(["train", "--data", str(data_dir), "--out", str(out), *TINY, "--host-sync", sync]) in (0, None)
        got[sync] = logged_steps(out)
    assert got["log"] == got["step"], got
