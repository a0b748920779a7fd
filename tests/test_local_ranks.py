"""--local-ranks N: one CPU run as N processes started by codeforge itself (stages/local.py), checked against
one process and torchrun's ranks: the same losses, the configuration a resume repeats, a killed rank ending
the job at once, the refusals, and the choices the quickstart makes."""

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from codeforge import device
from codeforge.config import ConfigError, resolve
from codeforge.stages import local

from test_parallel import COMMON, GLOBAL_BATCH, close, losses, records, train


def local_train(
    data_dir, out, ranks: int, *extra: str, steps: int = 8, check=True
) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "codeforge", "train", "--data", str(data_dir), "--out", str(out), *COMMON,
            "--batch-size", str(GLOBAL_BATCH // ranks), "--max-iters", str(steps), "--local-ranks",
            str(ranks), *extra]
    r = subprocess.run(args, capture_output=True, text=True, timeout=600)
    if check and r.returncode:
        pytest.fail(f"exit {r.returncode}\n{r.stdout[-1500:]}\n{r.stderr[-3000:]}", pytrace=False)
    return r


def test_local_ranks_equal_one_process_and_resume_as_saved(data_dir, tmp_path):
    """Two local ranks of half the batch train what one process does on the whole batch (float32 sums in
    another order); the run records its ranks, and a --resume with no flags continues on as many."""
    one, two = tmp_path / "one", tmp_path / "two"
    train(data_dir, one, 1)
    r = local_train(data_dir, two, 2)
    assert close(losses(two), losses(one))
    val = lambda run: {x["step"]: x["val_loss"] for x in records(run) if "val_loss" in x}  # noqa: E731
    assert close(val(two), val(one))
    assert "1 thread (each of 2 local processes" in r.stdout and "x 2 rank(s)" in r.stdout
    saved = (two / "config.toml").read_text()
    assert "local_ranks = 2" in saved and "batch_size = 4" in saved
    r = subprocess.run([sys.executable, "-m", "codeforge", "train", "--out", str(two), "--resume",
                        "--max-iters", "12", "--no-progress"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "x 2 rank(s)" in r.stdout and "resuming on" not in r.stdout  # the same ranks: nothing to rescale
    assert max(losses(two)) == 12


def test_a_killed_local_rank_ends_the_job_at_once(data_dir, tmp_path):
    """Rank 1 killed mid-run: rank 0 does not wait for it in a collective until --dist-timeout (600 s) but
    ends the job with a message naming the rank, and the checkpoint already written stays."""
    out = tmp_path / "run"
    args = [sys.executable, "-m", "codeforge", "train", "--data", str(data_dir), "--out", str(out), *COMMON,
            "--batch-size", "4", "--max-iters", "100000", "--local-ranks", "2", "--save-every", "2"]
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not list((out / "checkpoints").glob("step_*")) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert list((out / "checkpoints").glob("step_*")), "no checkpoint within 300 s"
        kids = subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True, text=True).stdout.split()
        assert len(kids) == 1, kids
        t0 = time.monotonic()
        os.kill(int(kids[0]), signal.SIGKILL)
        _, err = p.communicate(timeout=120)
        took = time.monotonic() - t0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode != 0
    assert "rank 1 of 2 exited with signal SIGKILL" in err, err[-2000:]
    assert took < 120  # not the 600 s collective timeout (a bound on a hang, not a timing)
    assert list((out / "checkpoints").glob("step_*"))


def test_refusals(monkeypatch):
    cfg = resolve([], None, [], {"train.local_ranks": 2, "train.device": "cpu"})
    monkeypatch.setenv("WORLD_SIZE", "2")  # already a torchrun rank
    with pytest.raises(ConfigError, match="--local-ranks 1 under torchrun"):
        local.check(cfg)
    monkeypatch.delenv("WORLD_SIZE")
    local.check(cfg)  # a CPU run, no torchrun: fine
    with pytest.raises(ConfigError, match="for training on the CPU"):
        local.check(resolve([], None, [], {"train.local_ranks": 2, "train.device": "cuda"}))
    monkeypatch.setenv(local.STARTED_ENV, "2")  # a rank run_local started does not start ranks again
    assert not local.launches(cfg)
    monkeypatch.delenv(local.STARTED_ENV)
    assert local.launches(cfg)


@pytest.mark.parametrize("cores,batch,want",
                         [(1, 16, 1), (2, 16, 2), (3, 16, 2), (8, 16, 4), (2, 3, 1), (4, 6, 3)])
def test_auto_ranks_divide_the_batch_and_follow_the_cores(monkeypatch, cores, batch, want):
    monkeypatch.setattr(local, "usable_cores", lambda: cores)
    monkeypatch.setattr(local, "_gpu_visible", lambda: False)
    cfg = resolve([], None, [], {"train.batch_size": batch})
    assert local.auto_ranks(cfg) == want
    monkeypatch.setattr(local, "_gpu_visible", lambda: True)
    assert local.auto_ranks(cfg) == 1  # a GPU: one process


def test_held_and_alone_threads_restore_what_was_set():
    before = torch.get_num_threads()
    with device.alone_threads():  # nothing held: no change
        assert torch.get_num_threads() == before
    with device.held_threads(1, "a test", alone=2):
        assert torch.get_num_threads() == 1 and "1 thread (a test" in device.apply_thread_policy()
        with device.alone_threads():
            assert torch.get_num_threads() == 2
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before


def test_rank0s_own_error_is_not_blamed_on_the_other_ranks(data_dir, tmp_path):
    """Rank 0 fails by itself (the run directory is in use by another training): the error is rank 0's, said
    once; the other rank, which then loses rank 0, is not named as the cause and
    its traceback is not shown."""
    from codeforge.rundir import run_lock
    out = tmp_path / "run"
    out.mkdir()
    with run_lock(out):
        r = local_train(data_dir, out, 2, check=False)
    assert r.returncode != 0
    assert "in use by another training process" in r.stderr
    assert "rank 1 of 2" not in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


def test_cpu_quota_of_a_container_bounds_the_cores(tmp_path, monkeypatch):
    """A cgroup v2 quota on the process's cgroup or a parent (the tightest wins), v1's cfs files, none."""
    root = tmp_path / "cg"
    (root / "a" / "b").mkdir(parents=True)
    proc = tmp_path / "cgroup"
    proc.write_text("0::/a/b\n")
    assert device.cpu_quota(str(proc), str(root)) is None
    (root / "a" / "b" / "cpu.max").write_text("max 100000\n")
    (root / "a" / "cpu.max").write_text("150000 100000\n")
    assert device.cpu_quota(str(proc), str(root)) == 1.5
    (root / "a" / "b" / "cpu.max").write_text("50000 100000\n")
    assert device.cpu_quota(str(proc), str(root)) == 0.5
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("200000\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert device.cpu_quota(str(tmp_path / "missing"), str(v1)) == 2.0
    monkeypatch.setattr(device, "cpu_quota", lambda: 1.5)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    assert device.usable_cores() == 2  # 1.5 CPUs of quota: 2 threads, not 8
    monkeypatch.setattr(device, "cpu_quota", lambda: None)
    assert device.usable_cores() == 8


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_the_other_ranks_die_with_rank0(data_dir, tmp_path):
    """Rank 0 killed outright (no chance to stop its ranks): the kernel ends rank 1 too, rather than leave it
    waiting in a collective."""
    out = tmp_path / "run"
    args = [sys.executable, "-m", "codeforge", "train", "--data", str(data_dir), "--out", str(out), *COMMON,
            "--batch-size", "4", "--max-iters", "100000", "--local-ranks", "2"]
    p, kids = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), []
    try:
        deadline = time.monotonic() + 120
        while not kids and time.monotonic() < deadline:
            time.sleep(0.5)
            kids = subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True, text=True).stdout.split()
        assert len(kids) == 1, kids
        p.kill()
        p.wait()
        deadline = time.monotonic() + 30
        while state(kids[0]) not in (None, "Z") and time.monotonic() < deadline:  # Z: ended, not yet reaped
            time.sleep(0.2)
        assert state(kids[0]) in (None, "Z"), f"rank 1 (pid {kids[0]}) outlived rank 0"
    finally:
        if p.poll() is None:
            p.kill()
        for k in kids:
            with contextlib.suppress(OSError):
                os.kill(int(k), signal.SIGKILL)


def state(pid) -> str | None:
    """A process's state letter (R, S, Z, ...), None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None
