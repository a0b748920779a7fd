"""benchmarks/train_throughput.py's GPU speed-lever flags, in-process on the CPU at tiny shapes: the levers
change when numbers are read and where batches come from, never the arithmetic, so the losses must match
the plain path's; and the defaults stay the figures' old path."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import train_throughput  # noqa: E402

TINY = ["--preset", "gpt2-small", "--set", "model.n_layer=2", "--set", "model.n_head=2", "--set",
        "model.n_embd=64", "--block-size", "32", "--vocab-size", "256", "--batch-size", "2", "--precision",
        "fp32", "--device", "cpu", "--steps", "2", "--warmup", "1"]


def run(*extra: str) -> dict:
    a = train_throughput.parser().parse_args([*TINY, *extra])
    return train_throughput.measure(a, a.batch_size)


def test_defaults_keep_the_old_path():
    a = train_throughput.parser().parse_args(TINY)
    assert (a.attention, a.compile_shapes, a.host_sync, a.prefetch, a.host_batches, a.timing,
            a.loss_check) == (None, "dynamic", "step", False, False, "median", 0)
    r = run()
    assert (r["attention"], r["compile_shapes"], r["host_sync"], r["prefetch"], r["host_batches"],
            r["timing"]) == (None, "dynamic", "step", False, False, "median")
    assert r["tokens_per_s"] > 0 and math.isfinite(r["loss"]) and r["attention_note"] is None


def test_host_sync_log_gives_the_step_path_losses():
    step = run("--loss-check", "3", "--host-sync", "step")
    log = run("--loss-check", "3", "--host-sync", "log")
    assert len(step["losses"]) == 3 and all(math.isfinite(x) for x in step["losses"])
    assert log["losses"] == pytest.approx(step["losses"], rel=1e-6, abs=1e-6)
    assert log["host_sync"] == "log" and log["steps_skipped"] == step["steps_skipped"] == 0


def test_prefetch_gives_the_inline_host_source_losses():
    inline = run("--loss-check", "3", "--host-batches")
    ahead = run("--loss-check", "3", "--prefetch", "--host-sync", "log")
    assert inline["host_batches"] and ahead["host_batches"] and ahead["prefetch"]
    assert ahead["losses"] == pytest.approx(inline["losses"], rel=1e-6, abs=1e-6)


def test_static_compile_and_attention_keep_the_losses():
    plain = run("--loss-check", "2", "--host-batches")
    levers = run("--loss-check", "2", "--host-batches", "--compile", "--compile-backend", "eager",
                 "--compile-shapes", "static", "--attention", "math")
    assert levers["whole_graph"] is True and "math" in levers["attention_note"]
    assert levers["losses"] == pytest.approx(plain["losses"], rel=1e-4, abs=1e-4)


def test_window_timing_reports_itself():
    r = run("--timing", "window", "--host-sync", "log", "--prefetch")
    assert r["timing"] == "window" and r["tokens_per_s"] > 0 and r["ms_per_step"] > 0
    assert math.isfinite(r["loss"]) and r["steps_timed"] == 2


def test_host_sync_log_refused_where_the_optimizer_cannot_skip_on_the_device():
    a = train_throughput.parser().parse_args([*TINY, "--set", "train.optimizer=muon", "--host-sync", "log"])
    with pytest.raises(train_throughput.LeverError, match="--host-sync step"):
        train_throughput.measure(a, a.batch_size)


def test_host_batches_resume_from_their_cursor():
    src = train_throughput.HostBatches(256, 2, 16, torch.device("cpu"))
    first = [next(src) for _ in range(3)]
    assert first[0][0].shape == (2, 16) and first[0][0].dtype == torch.int64
    assert torch.equal(first[0][0][:, 1:], first[0][1][:, :-1])  # targets are the inputs shifted by one
    src.load_state_dict({"pos": 1})
    assert torch.equal(next(src)[0], first[1][0]) and src.state_dict() == {"pos": 2}
