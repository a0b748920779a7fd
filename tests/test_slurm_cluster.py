"""`codeforge prepare --executor slurm` through a real Slurm cluster: one node on this machine (munged,
slurmctld and slurmd, as tests/slurm_one_node.py starts them, on free ports with their state in a tmp dir,
stopped at the end). The jobs' shards are the local executor's, byte for byte; a stage's job cancelled
mid-run (scancel) takes the later stages' jobs with it, and the same command again submits the unfinished
tasks and writes the same shards.

Slow (about a minute and a half on 2 cores): python -m pytest -m slow tests/test_slurm_cluster.py. Skipped
unless root with slurm-wlm and munge installed (apt-get install slurm-wlm munge)."""

import json
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import make_go_file
from slurm_one_node import OneNodeCluster, why_not

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
VARYING = ("seconds", "mb_per_s", "tokens_per_s")  # meta.json's timings
# every stage: read 3, exact 1, near 3, buckets 8, clusters 1, encode 3, merge 1 (7 job arrays)
OPTIONS = ["--dedup", "near", "--tasks", "3"]
STAGES = ["read", "exact", "near", "buckets", "clusters", "encode", "merge"]
CHAIN_SECONDS = 240  # the whole chain takes about 45 s on 2 cores


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    why = why_not()
    if why:
        pytest.skip(f"no one-node Slurm cluster here: {why}")
    with OneNodeCluster(tmp_path_factory.mktemp("slurm")) as c:
        yield c


@pytest.fixture(scope="module")
def sources(tmp_path_factory, code_corpus) -> list[str]:
    """The test corpus (its exact duplicate and files for each filter) and 6 near-duplicates of files in
    another directory, so every stage has something to do."""
    root = tmp_path_factory.mktemp("near")
    rng = random.Random(3)
    for d in ("base", "copies"):
        (root / d).mkdir()
    for i in range(6):
        text = make_go_file(rng, 200 + i) + "".join(f"// note {j} on part {i}\n" for j in range(80))
        (root / "base" / f"b{i}.go").write_text(text)
        lines = text.splitlines(keepends=True)
        lines[len(lines) // 2] = "// one line changed here\n"
        (root / "copies" / f"c{i}.go").write_text("".join(lines))
    return [str(code_corpus), str(root)]


def _command(sources, tokenizer_dir, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "codeforge", "prepare", "--input", *sources, "--tokenizer",
            str(tokenizer_dir), "--out", str(out), *OPTIONS, *extra]


def _run(cmd: list[str], env=None, ok: bool = True) -> str:
    got = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    said = got.stdout + got.stderr
    assert (got.returncode == 0) == ok, f"exit {got.returncode}:\n{said}"
    return said


@pytest.fixture(scope="module")
def local(tmp_path_factory, sources, tokenizer_dir) -> Path:
    """The same command on the local executor: the shards the cluster must write."""
    out = tmp_path_factory.mktemp("local") / "data"
    _run(_command(sources, tokenizer_dir, out))
    return out


def _slurm(cluster: OneNodeCluster) -> list[str]:
    return ["--executor", "slurm", "--slurm-partition", cluster.partition, "--slurm-time", "00:15:00"]


def _work(out: Path) -> Path:
    [work] = out.parent.glob(f".{out.name}.prepare-*")
    return work


def _job_logs(work: Path, chars: int = 1500) -> str:
    """The end of every job's output under the work directory, for a failure's message."""
    parts = []
    for f in sorted((work / "logs").glob("*/slurm_logs/*.out")):
        parts.append(f"--- {f.relative_to(work)}\n{f.read_text(errors='replace')[-chars:]}")
    return "\n".join(parts)[-12000:]


def _wait(cluster: OneNodeCluster, work: Path, seconds: float = CHAIN_SECONDS) -> None:
    if not cluster.wait_empty(seconds):
        squeue = cluster._run("squeue", check=False).stdout
        pytest.fail(f"jobs still queued after {seconds:.0f} s:\n{squeue}\n{_job_logs(work)}")


def _same_dataset(a: Path, b: Path, work: Path) -> None:
    """Every file of a and b the same bytes (shards, document index, digests, tokenizer), and meta.json the
    same but for the timings."""
    assert (b / "meta.json").exists(), f"no dataset was written to {b}:\n{_job_logs(work)}"
    files = sorted(str(p.relative_to(a)) for p in a.rglob("*") if p.is_file())
    assert files == sorted(str(p.relative_to(b)) for p in b.rglob("*") if p.is_file())
    assert any(f.endswith(".bin") for f in files) and "train_docs.npy" in files
    for f in files:
        if f != "meta.json":
            assert (a / f).read_bytes() == (b / f).read_bytes(), f
    ma, mb = (json.loads((d / "meta.json").read_text()) for d in (a, b))
    assert {k: v for k, v in ma.items() if k not in VARYING} == {k: v for k, v in mb.items()
                                                                if k not in VARYING}
    assert ma["documents"] > 100 and ma["skipped"]["near_duplicate"] >= 6 and ma["skipped"]["duplicate"] >= 1


def test_a_slurm_run_writes_the_local_shards(cluster, sources, tokenizer_dir, local, tmp_path):
    out = tmp_path / "data"
    cmd = _command(sources, tokenizer_dir, out, *_slurm(cluster))
    t0 = time.monotonic()
    said = _run(cmd, cluster.env)
    assert "submitted 7 Slurm job arrays" in said and not out.exists()
    work = _work(out)
    jobs = json.loads((work / "submitted.json").read_text())["jobs"]
    assert len(jobs) == 7 and "#SBATCH --kill-on-invalid-dep=yes" in (
        work / "logs" / "read" / "launch_script.slurm").read_text()
    # the same command while the jobs are queued: refused, naming them
    again = _run(cmd, cluster.env, ok=False)
    assert "still in the queue" in again and jobs[-1] in again
    _wait(cluster, work)
    took = time.monotonic() - t0
    _same_dataset(local, out, work)
    for stage in STAGES:  # every stage ran as its job array, every task to the end
        n = len(json.loads((work / "logs" / stage / "ranks_to_run.json").read_text()))
        assert len(list((work / "logs" / stage / "completions").iterdir())) == n
    # once more: the dataset is there; the work directory goes
    assert "already holds this dataset" in _run(cmd, cluster.env) and not work.exists()
    print(f"the chain of 7 stages took {took:.0f} s")


def test_scancel_mid_run_then_the_same_command_writes_the_same_shards(cluster, sources, tokenizer_dir, local,
                                                                      tmp_path):
    out = tmp_path / "data"
    cmd = _command(sources, tokenizer_dir, out, *_slurm(cluster))
    assert "submitted 7 Slurm job arrays" in _run(cmd, cluster.env)
    work = _work(out)
    jobs = json.loads((work / "submitted.json").read_text())["jobs"]
    # once the read stage's job array has finished a task: cancel the stage running then
    done = work / "logs" / "read" / "completions"
    deadline = time.monotonic() + CHAIN_SECONDS
    while not (done.is_dir() and any(done.iterdir())):
        assert time.monotonic() < deadline, f"the read stage finished no task:\n{_job_logs(work)}"
        time.sleep(0.05)
    queued = [j for j in jobs if j in cluster.jobs()]
    assert queued, "the chain ended before it could be cancelled"
    cancelled = queued[0]
    subprocess.run(["scancel", cancelled], env=cluster.env, check=True)
    # Slurm cancels the jobs after it (--kill-on-invalid-dep), so the queue empties without a dataset
    _wait(cluster, work, 60)
    assert not out.exists()
    stage = STAGES[jobs.index(cancelled)]
    finished = {s: sorted(p.name for p in (work / "logs" / s / "completions").iterdir())
                if (work / "logs" / s / "completions").is_dir() else [] for s in STAGES}
    assert not finished["merge"]
    said = _run(cmd, cluster.env)
    assert "resuming" in said and "have all left the queue" in said and "submitted" in said
    # only the unfinished tasks were submitted: a finished stage was skipped, a stage cut short redone in part
    for s in STAGES:
        ranks = json.loads((work / "logs" / s / "ranks_to_run.json").read_text())
        if finished[s] and len(finished[s]) == len(ranks):
            continue  # a stage finished before the cancel: not submitted again (its list is the old one)
        assert not set(f"{r:05d}" for r in ranks) & set(finished[s]), s
    _wait(cluster, work)
    _same_dataset(local, out, work)
    print(f"cancelled job {cancelled} ({stage} stage) with {len(finished[stage])} of its tasks done; the "
          f"rerun finished it")
