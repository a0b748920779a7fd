"""`codeforge prepare --executor ray` (codeforge/data/ray_executor.py): on a local Ray instance the test
starts, every stage on datatrove's Ray executor writes the local executor's dataset byte for byte; a failed
task is a failed stage (the engine's executor only logs it); without the `ray` package, the install command
is said before any work."""

from __future__ import annotations

import builtins
import json
import time
from pathlib import Path

import pytest

from codeforge.corpus import CorpusOptions
from codeforge.data import local, pipeline, ray_executor
from codeforge.data.shards import ShardError, prepare
from codeforge.data.steps import MergeShards

VARYING = ("seconds", "mb_per_s", "tokens_per_s")  # meta.json's timings
# datatrove 0.10.1 places its actors with ray's older placement_group= options, which ray 2.60 still takes
pytestmark = pytest.mark.filterwarnings("ignore:placement_group.*parameter is deprecated:DeprecationWarning")


def _quiet(*a):
    pass


def _tree(d: Path) -> dict[str, bytes]:
    """Every file under d by its relative path, meta.json without its timings."""
    got = {}
    for f in sorted(p for p in d.rglob("*") if p.is_file()):
        data = f.read_bytes()
        if f.name == "meta.json":
            meta = {k: v for k, v in json.loads(data).items() if k not in VARYING}
            data = json.dumps(meta, sort_keys=True).encode()
        got[str(f.relative_to(d))] = data
    return got


def test_without_ray_the_install_command_is_said(tmp_path, code_corpus, tokenizer_dir, monkeypatch):
    """`ray` not importable: ShardError naming pip install 'codeforge[ray]', before any work directory."""
    real = builtins.__import__

    def no_ray(name, *a, **k):
        if name == "ray" or name.startswith("ray."):
            raise ModuleNotFoundError("No module named 'ray'", name="ray")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_ray)
    with pytest.raises(ShardError, match=r"pip install 'codeforge\[ray\]'"):
        prepare([str(code_corpus)], tokenizer_dir, tmp_path / "d", CorpusOptions(), log=_quiet,
                executor="ray", tasks=2)
    assert not list(tmp_path.iterdir())  # no work directory, no --out


def test_ray_flags_reach_prepare(monkeypatch):
    """--executor ray and the --ray-* flags reach prepare (in the cluster options pipeline.run reads); the
    local executor's options are as before."""
    import codeforge.data.shards as shards
    from codeforge.cli import main
    got = {}
    monkeypatch.setattr(shards, "prepare", lambda *a, **kw: got.update(kw))
    args = ["prepare", "--input", "a", "--tokenizer", "t", "--out", "o"]
    assert main([*args, "--executor", "ray", "--ray-address", "ray://head:10001", "--ray-cpus", "2",
                 "--ray-mem-gb", "0.5"]) == 0
    assert got["executor"] == "ray"
    assert got["slurm"]["ray"] == {"address": "ray://head:10001", "cpus_per_task": 2, "mem_per_cpu_gb": 0.5}
    assert main(args) == 0 and "ray" not in got["slurm"] and got["executor"] == "local"


def test_ray_options_reach_the_executor():
    o = ray_executor.options({"address": "auto", "cpus_per_task": 2, "mem_per_cpu_gb": 0.5})
    assert o == {"address": "auto", "cpus_per_task": 2, "mem_per_cpu_gb": 0.5}
    assert ray_executor.options(None) == {"address": None, "cpus_per_task": 1, "mem_per_cpu_gb": 2.0}
    ex = ray_executor.executor([], 5, None, Path("/nonexistent/logs"), o)
    assert (ex.tasks, ex.workers, ex.cpus_per_task, ex.mem_per_cpu_gb) == (5, 5, 2, 0.5)
    assert ray_executor.executor([], 5, 3, Path("/nonexistent/logs"), o).workers == 3


@pytest.fixture
def local_ray():
    """A local Ray instance of 2 CPUs for this test, stopped after it."""
    ray = pytest.importorskip("ray", reason="no `ray` package here: pip install 'codeforge[ray]'")
    if ray.is_initialized():
        ray.shutdown()
    # "local": a new instance, whatever cluster /tmp/ray/ray_current_cluster names (a stale one waits)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.mark.slow
def test_ray_writes_the_local_executors_dataset(tmp_path, code_corpus, tokenizer_dir, local_ray):
    """--dedup near (every kind of stage: 7 of them) on the local executor, then on Ray: every file of --out
    the same bytes (meta.json but its timings); the same command again finds the dataset in place."""
    opts = CorpusOptions(dedup="near", val_fraction=0.2)
    sources = [str(code_corpus)]
    t0 = time.perf_counter()
    local_meta = prepare(sources, tokenizer_dir, tmp_path / "local", opts, log=_quiet, workers=2, tasks=3,
                         repo_fim=0.5)
    t1 = time.perf_counter()
    said: list[str] = []
    ray_meta = prepare(sources, tokenizer_dir, tmp_path / "ray", opts, log=said.append, executor="ray",
                       tasks=3, repo_fim=0.5)
    t2 = time.perf_counter()
    print(f"local {t1 - t0:.1f}s, ray {t2 - t1:.1f}s")
    stages = [m.split()[0] for m in said if "task(s) on Ray" in m]
    assert stages == ["read", "exact", "near", "buckets", "clusters", "encode", "merge"], said
    assert _tree(tmp_path / "local") == _tree(tmp_path / "ray")
    assert ray_meta["documents"] == local_meta["documents"] > 0 and ray_meta["engine"]["tasks"] == 3
    assert ray_meta["skipped"]["duplicate"] >= 1  # the planted copy of f0.go
    assert not list(tmp_path.glob(".ray.prepare-*"))  # the work directory is gone once --out is written
    said.clear()
    again = prepare(sources, tokenizer_dir, tmp_path / "ray", opts, log=said.append, executor="ray", tasks=3,
                    repo_fim=0.5)
    assert any("already holds this dataset" in m for m in said) and again == ray_meta


@pytest.mark.slow
def test_a_failed_ray_task_fails_the_stage(tmp_path, tokenizer_dir, local_ray):
    """The engine's Ray executor logs a task's error and returns; the stage is then StageFailed, naming the
    task's error and log, and keeps the work (a KeepWork)."""
    work = tmp_path / "work"
    work.mkdir()
    merge = MergeShards(str(work), str(tmp_path / "out"), str(tokenizer_dir), 2, 1000, [], {})  # no tokens/
    with pytest.raises(pipeline.StageFailed, match=r"merge stage failed: 1 of 1 task\(s\) did not finish "
                                                   r"\(task 0: .*FileNotFoundError.*summary\.json"):
        with local.Quiet():  # as prepare runs it: the engine's records kept off the console
            pipeline._run_stage("merge", [merge], 1, None, work, _quiet, ray_executor.options(None))
    assert (work / "logs" / "merge" / "logs" / "task_00000.log").exists()


@pytest.mark.slow
def test_a_task_no_node_holds_is_refused(local_ray):
    with pytest.raises(pipeline.KeepWork, match="no node of the Ray cluster has that much"):
        ray_executor.fits(local_ray, 64, 2)
    ray_executor.fits(local_ray, 1, 0)
