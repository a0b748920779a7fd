"""The CPU thread policy (device.thread_policy, OMP_WAIT_POLICY set in codeforge/__init__.py) changes how fast
a run goes, not what it computes: the same training losses and greedy text with 1 or 2 threads (validation
losses to 1e-6) and every number identical with OpenMP's waiting threads spinning or sleeping; and the
policy's choice follows the flag, the environment and the cores other work keeps busy."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from codeforge import device

TRAIN = ("import sys; from codeforge.cli import main; "
         "sys.exit(main(['train', '--data', {data!r}, '--out', {out!r}, "
         "'--n-layer', '2', '--n-head', '2', '--n-embd', '64', '--block-size', '64', '--batch-size', '4', "
         "'--max-iters', '4', '--eval-every', '2', '--eval-tokens', '256', '--no-progress', '--device', "
         "'cpu', '--dropout', '0', '--warmup-steps', '1']))")
GEN = ("import sys; from codeforge.cli import main; sys.exit(main(['generate', '--run', {out!r}, '--prompt', "
       "'def ', '--max-new-tokens', '24', '--temperature', '0', '--device', 'cpu']))")


def run(code: str, **env) -> tuple[str, str]:
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                       env={**os.environ, **env})
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout, r.stderr


def losses(out) -> list:
    rows = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]
    return [(r.get("loss"), r.get("val_loss")) for r in rows]


def test_threads_and_wait_policy_change_no_number(data_dir, tmp_path):
    seen = {}
    for name, env in {"t1_passive": {"CODEFORGE_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"},
                      "t2_passive": {"CODEFORGE_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"},
                      "t2_active": {"CODEFORGE_THREADS": "2", "OMP_WAIT_POLICY": "ACTIVE"},
                      "t2_malloc": {"CODEFORGE_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE",
                                    "CODEFORGE_MALLOC": "system"}}.items():
        out = str(tmp_path / name)
        said = "".join(run(TRAIN.format(data=str(data_dir), out=out), **env))
        threads = env["CODEFORGE_THREADS"]
        # the device line
        assert f"{threads} thread" in said and f"waits {env['OMP_WAIT_POLICY'].lower()}" in said
        assert ("the C library's ($CODEFORGE_MALLOC=system)" in said) == ("CODEFORGE_MALLOC" in env), said
        text = run(GEN.format(out=out), **env)[0]  # stdout: the prompt and its completion
        seen[name] = (losses(out), text)
    first = seen["t1_passive"]
    assert len(first[0]) >= 4
    for name, (rows, text) in seen.items():
        assert text == first[1], name  # greedy text: identical
        assert [r[0] for r in rows] == [r[0] for r in first[0]], name  # training losses: bit for bit
        # validation losses: equal to 1e-6 (1 and 2 threads reduce the vocabulary's log-sum-exp in another
        # order, which moves the 8th digit; docs/LOG.md#2026-11-25-thread-policy)
        assert all(a[1] is None and b[1] is None or abs(a[1] - b[1]) < 1e-6
                   for a, b in zip(rows, first[0])), name
    assert seen["t2_active"] == seen["t2_passive"]  # the wait policy: every number identical
    assert seen["t2_malloc"] == seen["t2_passive"]  # the memory policy: every number identical


FAULTS = """
import resource, sys, torch
from codeforge import device
said = device.keep_freed_memory()
def step():  # the pattern of a training step: large tensors of a few sizes, allocated, written and freed
    x = torch.ones(48 << 18)  # 48 MiB of float32 (written, so every page is touched)
    y = torch.ones(8 << 18) * x[: 8 << 18]
    z = torch.ones(16 << 18) + x[: 16 << 18]
    return float(z[-1])
for _ in range(8):  # warm-up: the heap settles into the sizes the steps ask for
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(8):
    step()
print(said); print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 8)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's allocator")
def test_freed_memory_is_reused_not_mapped_again(monkeypatch):
    """80 MiB of tensors allocated, written and freed step after step: with the memory policy the pages are
    reused (a few faults a step of the 20,480 pages touched); glibc's default unmaps and maps them again each
    step (about 20,000 faults of 4 KiB pages, or a few dozen where transparent huge pages back every mapping,
    hence no assertion on that side)."""
    for k in ("CODEFORGE_MALLOC", "MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_",
              "GLIBC_TUNABLES"):  # the children see the policy's own default, whatever this shell set
        monkeypatch.delenv(k, raising=False)
    said, faults = run(FAULTS)[0].split("\n")[:2]
    assert said == "freed memory kept for reuse"
    # 0 usually; 1,024 (one 4 MiB block) seen on some runs; ~20,000 without
    assert float(faults) < 2000, faults
    said = run(FAULTS, CODEFORGE_MALLOC="system")[0].split("\n")[0]
    assert said == "memory policy: the C library's ($CODEFORGE_MALLOC=system)"
    said = run(FAULTS, GLIBC_TUNABLES="glibc.malloc.trim_threshold=131072")[0].split("\n")[0]
    # the user's own knob
    assert said == "memory policy: the C library's, as its environment variables set it"
    monkeypatch.setenv("CODEFORGE_MALLOC", "fast")
    monkeypatch.setattr(device, "_MALLOC", None)
    with pytest.raises(device.DeviceError, match="CODEFORGE_MALLOC"):
        device.keep_freed_memory()


HANDED_BACK = """
import contextlib, resource, sys, torch
from codeforge import device
if "first-keep" in sys.argv:  # the policy already in force in this process when the server chooses glibc's
    device.keep_freed_memory()
with device.system_memory("a long-running server") if "server" in sys.argv else contextlib.nullcontext():
    said = device.choose_device("cpu")[1]
    def rss():
        return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS:")).split()[1]) >> 10
    x = torch.ones(256 << 18)  # 256 MiB, every page written
    held = rss()
    del x
    released = held - rss()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(50):  # a 4 MiB block freed and asked for again: reused, not mapped afresh each time
        torch.ones(1 << 20)
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 50
print(said); print(released); print(faults); print(device.keep_freed_memory())
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's allocator")
@pytest.mark.parametrize("case", ["train", "server", "first-keep server", "server keep"])
def test_the_server_hands_freed_memory_back(monkeypatch, case):
    """A training keeps a freed 256 MiB tensor's pages for reuse; the server (device.system_memory) hands them
    back to the kernel at once, also where the keeping policy was already in force in the process, unless
    $CODEFORGE_MALLOC=keep asks it to keep them. Either way a 4 MiB block freed and asked for again is reused
    (4 MiB is 1,024 pages: mapped afresh each time, every round would fault them all). The device line says
    which policy holds, and after the server's block the process has the policy it had before."""
    for k in ("CODEFORGE_MALLOC", "MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_",
              "GLIBC_TUNABLES"):
        monkeypatch.delenv(k, raising=False)
    env = {"CODEFORGE_MALLOC": "keep"} if case.endswith("keep") else {}
    r = subprocess.run([sys.executable, "-c", HANDED_BACK, *case.split()], capture_output=True, text=True,
                       timeout=300, env={**os.environ, **env})
    assert r.returncode == 0, r.stderr[-3000:]
    said, released, faults, after = r.stdout.strip().split("\n")[-4:]
    if case in ("train", "server keep"):
        assert "freed memory kept for reuse" in said and int(released) < 16, (said, released)
    else:
        assert ("the C library's (a long-running server; "
                "$CODEFORGE_MALLOC=keep keeps freed memory)") in said, said
        assert int(released) > 200, (said, released)
    assert float(faults) < 300, (case, faults)
    # the training default again after the server's block
    assert after == "freed memory kept for reuse", after


def test_the_policy_follows_flag_environment_and_busy_cores(monkeypatch):
    cores = len(os.sched_getaffinity(0))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv(device.THREADS_ENV, raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(device, "runnable_elsewhere", lambda *a, **k: 0)
    assert device.thread_policy() == (cores, f"{cores} cores, none busy at start")
    monkeypatch.setattr(device, "runnable_elsewhere", lambda *a, **k: 99)
    assert device.thread_policy()[0] == 1  # everything busy: one thread, never zero
    assert device.thread_policy(3) == (3, "--threads")
    monkeypatch.setenv(device.THREADS_ENV, "2")
    assert device.thread_policy() == (2, "$CODEFORGE_THREADS")
    monkeypatch.setenv(device.THREADS_ENV, "many")
    with pytest.raises(device.DeviceError, match="CODEFORGE_THREADS"):
        device.thread_policy()
    monkeypatch.delenv(device.THREADS_ENV)
    monkeypatch.setattr(device, "runnable_elsewhere", lambda *a, **k: 0)
    # torchrun ranks share the cores, at least one each
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(2 * cores))
    assert device.thread_policy()[0] == 1
    assert os.environ.get("OMP_WAIT_POLICY")  # codeforge/__init__.py set it before torch loaded


def test_this_process_own_busy_threads_are_not_counted_as_other_work():
    import threading
    import time

    import torch
    stop = threading.Event()

    def busy():  # a thread of this process that stays runnable (PyTorch releases the GIL in the product)
        a = torch.randn(256, 256)
        while not stop.is_set():
            a @ a
    t = threading.Thread(target=busy, daemon=True)
    t.start()
    try:
        time.sleep(0.05)
        own = max(device._own_runnable() for _ in range(20))
    finally:
        stop.set()
        t.join()
    assert own >= 2  # the asking thread and the busy one: both subtracted from the machine's runnable count
    assert device._own_runnable() >= 1
