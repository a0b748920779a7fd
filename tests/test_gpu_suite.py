"""The GPU suite (benchmarks/gpu_suite.py) cannot rot between the rare runs on a
GPU: its smoke run takes every
part through the same job processes on the CPU at tiny shapes, and every job must come back with its figures.
Also the two GPU-path defects its first H100 run found, checked where a CPU can:
`--device cuda` under torchrun
takes the rank's own GPU, and `--parallel fsdp` on one torchrun rank runs FSDP2 (it silently did not)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from codeforge import device

ROOT = Path(__file__).resolve().parent.parent


def test_smoke_runs_every_part(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_suite.py"), "--smoke", "--out",
                        str(out), "--work", str(work)], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((out / "results.json").read_text())
    failed = {j["name"]: j["error"] for j in res["jobs"] if j["error"] or j["result"] is None}
    assert not failed, failed
    parts = {j["part"] for j in res["jobs"]}
    assert parts >= {"env", "levers", "profile", "train", "hf", "seed000", "data", "quality", "fsdp", "serve"}
    # levers and profile run first, right after env (a GPU session's budget goes to them before the rest)
    assert [j["part"] for j in res["jobs"]][:9] == ["env"] + ["levers"] * 7 + ["profile"]
    _check_levers_and_profile(res, out)
    jobs = {j["name"]: j["result"] for j in res["jobs"]}
    steps = [j["result"] for j in res["jobs"] if j["part"] in ("train", "hf", "seed000")]
    assert len(steps) >= 9
    for got in steps:
        assert (
            got["tokens_per_s"] > 0 and got["ms_per_step"] > 0 and torch.isfinite(torch.tensor(got["loss"]))
        )
    assert jobs["seed000 fp16, batch 2 x accum 8"]["batch_size"] == 2
    q = next(j["result"] for j in res["jobs"] if j["kind"] == "quality")
    assert q["steps"] > 0 and 0 < q["val_bpb"] < 20 and q["passes"] > 0
    f = next(j["result"] for j in res["jobs"] if j["part"] == "fsdp")
    # one rank under torchrun: FSDP2 ran (a sharded checkpoint), resumed, and matched the straight run exactly
    assert f["sharded_checkpoint"] and f["resumed"] and f["losses_match"], f
    s = next(j["result"] for j in res["jobs"] if j["part"] == "serve")
    assert [x["clients"] for x in s["streams"]] == [32, 8, 1]
    assert all(x["ok"] == x["requests"] and x["tokens"] > 0 for x in s["streams"])
    assert s["decode"]["codeforge_tokens_per_s"] > 0 and s["decode"]["transformers_tokens_per_s"] > 0
    table = (out / "table.md").read_text()
    assert "| gpt2 compile, chunked loss |" in table and "held-out" in table and "FSDP2 on one rank" in table
    assert "| + cudnn attention | not available on this device |" in table
    assert "**Quality guard**" in table and "**Profile**" in table and "| top ops by self CPU time |" in table


def _check_levers_and_profile(res: dict, out: Path) -> None:
    levers = {j["name"]: j["result"] for j in res["jobs"] if j["kind"] == "lever"}
    assert list(levers) == ["before", "+ cudnn attention", "+ static whole graph", "+ host-sync log",
                            "+ prefetch", "all levers"]
    # a CPU has no cuDNN attention: that row says so (the part goes on), the all-levers row runs flash instead
    assert levers.pop("+ cudnn attention")["not_available"].startswith("not available on this device")
    for name, r in levers.items():
        assert r["tokens_per_s"] > 0 and r["timing"] == "window" and r["host_batches"], name
        assert r["compile"] and torch.isfinite(torch.tensor(r["loss"])) and r["steps_skipped"] == 0, name
    assert (levers["before"]["compile_shapes"], levers["before"]["host_sync"], levers["before"]["prefetch"],
            levers["before"]["attention"]) == ("dynamic", "step", False, "flash")
    every = levers["all levers"]
    assert (every["compile_shapes"], every["host_sync"], every["prefetch"], every["attention"]) == (
        "static", "log", True, "flash")
    assert "cudnn attention not available" in every["fallback_note"]
    assert levers["+ static whole graph"]["whole_graph"] is True and every["whole_graph"] is True
    assert levers["+ host-sync log"]["host_sync"] == "log" and levers["+ prefetch"]["prefetch"]
    guard = next(j["result"] for j in res["jobs"] if j["kind"] == "losscheck")
    assert guard["steps"] == 3 and len(guard["before_losses"]) == len(guard["all_losses"]) == 3
    assert all(torch.isfinite(torch.tensor([guard["before_loss"], guard["all_loss"]])))
    assert guard["diff"] == guard["all_loss"] - guard["before_loss"]
    assert abs(guard["diff"]) < 1e-4  # fp32 on a CPU, the same attention: the levers change no arithmetic
    assert guard["before_heldout"] == pytest.approx(guard["all_heldout"], abs=1e-4)
    assert 0 < guard["before_heldout"] < 20
    prof = next(j["result"] for j in res["jobs"] if j["kind"] == "profile")
    assert prof["steps"] == 3 and prof["top"] and prof["top_by"] == "self CPU time"
    assert all(t["self_ms_per_step"] > 0 and t["name"] for t in prof["top"]) and len(prof["top"]) <= 10
    assert prof["host_ms_per_step"] > 0 and prof["wall_ms_per_step"] > 0
    assert prof["idle_gap_fraction"] is None and prof["device_busy_ms_per_step"] is None  # no GPU timeline
    assert prof["settings"]["host_sync"] == "log" and prof["settings"]["prefetch"]
    assert prof["trace"] == str(out / "profile-trace.json")
    assert "traceEvents" in json.loads((out / "profile-trace.json").read_text())


def test_failed_job_is_written_down_and_the_rest_runs(tmp_path):
    """A job that fails (here: the data it needs is not there) is listed with its
    error; the jobs after it run."""
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_suite.py"), "--smoke", "--out",
                        str(out),
                        "--work", str(tmp_path / "w"), "--data", str(tmp_path / "missing"), "--only",
                        "quality",
                        "seed000 fp16, batch 8,"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((out / "results.json").read_text())
    rows = {j["name"]: j for j in res["jobs"]}
    q = next(j for j in res["jobs"] if j["kind"] == "quality")
    assert q["result"] is None and "missing" in q["error"]
    assert rows["seed000 fp16, batch 8, chunked loss"]["result"]["tokens_per_s"] > 0
    assert rows["gpt2 eager, plain loss"]["error"] == "not run (--only)"
    assert "missing" in (out / "table.md").read_text()


def test_only_names_a_part_or_a_job(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_suite.py"), "--smoke", "--out",
                        str(tmp_path / "out"), "--only", "levers", "nonsense"], capture_output=True,
                       text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 2 and "--only nonsense" in r.stderr and "levers" in r.stderr, r.stderr[-2000:]


def test_device_timeline_counts_overlaps_once():
    """The profile's busy time and idle share of the GPU, from a Chrome trace's events (a GPU path, checked
    here on made-up events): kernels on two streams overlapping count once, CPU events not at all."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gpu_suite import device_timeline
    work = [("kernel", 0, 10), ("kernel", 5, 10), ("gpu_memcpy", 20, 5), ("cpu_op", 0, 100),
            ("kernel", 30, 10)]
    events = [{"ph": "X", "cat": c, "ts": t, "dur": d} for c, t, d in work]
    events.append({"ph": "i", "cat": "kernel", "ts": 90})  # an instant, not work
    busy, idle = device_timeline(events)
    assert busy == 30 and idle == pytest.approx(1 - 30 / 40)
    assert device_timeline([{"ph": "X", "cat": "cpu_op", "ts": 0, "dur": 1}]) == (None, None)


def test_cuda_without_index_takes_the_ranks_gpu(monkeypatch):
    """`--device cuda` under torchrun: each rank its LOCAL_RANK's GPU (torch.cuda.set_device refuses a bare
    "cuda", which stopped the first FSDP run on an H100), as --device auto already did."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert device.choose_device("cuda")[0] == torch.device("cuda", 3)
    assert device.choose_device("cuda:1")[0] == torch.device("cuda", 1)
    monkeypatch.delenv("LOCAL_RANK")
    assert device.choose_device("cuda")[0] == torch.device("cuda", 0)


@pytest.mark.parametrize("launched", [True, False])
def test_fsdp_on_one_rank_only_under_torchrun(launched, monkeypatch):
    from codeforge.train.parallel import choose_mode
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: launched)
    mode, why = choose_mode("fsdp", 1, torch.device("cpu"))
    assert mode == ("fsdp" if launched else "none"), why
    assert "torchrun" in why or launched
