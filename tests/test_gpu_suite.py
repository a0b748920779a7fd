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
    assert parts >= {"env", "train", "hf", "seed000", "data", "quality", "fsdp", "serve"}
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
