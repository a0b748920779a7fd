"""`codeforge prepare` on datatrove (codeforge/data/pipeline.py): the same shards for any number of workers,
a resume after kill -9, near-duplicates found in the engine's staged MinHash, Slurm job scripts, and
e-mail / IP address replacement."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import make_go_file

from codeforge.corpus import CorpusOptions, CorpusStats, iter_documents
from codeforge.data import local, pipeline
from codeforge.data.shards import ShardError, ShardSet, prepare
from codeforge.data.steps import lsh_bands
from codeforge.redact import redact_pii
from codeforge.tokenizer import CodeTokenizer

ROOT = Path(__file__).resolve().parent.parent
VARYING = ("seconds", "mb_per_s", "tokens_per_s")


def _quiet(*a):
    pass


def _files(d: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(d.iterdir()) if f.suffix in (".bin", ".npy")}


def _same_meta(a: dict, b: dict) -> None:
    assert {k: v for k, v in a.items() if k not in VARYING} == {k: v for k, v in b.items()
                                                                if k not in VARYING}


@pytest.fixture(scope="module")
def planted(tmp_path_factory, code_corpus) -> Path:
    """The test corpus plus 12 near-duplicates (one line changed) of files in other directories, a secret,
    an e-mail address and a HumanEval solution."""
    root = tmp_path_factory.mktemp("planted")
    rng = random.Random(7)
    (root / "base").mkdir()
    (root / "copies").mkdir()
    for i in range(12):
        text = make_go_file(rng, 100 + i) + "".join(f"// note {j} on the design of part {i}\n"
                                                    for j in range(80))
        (root / "base" / f"b{i}.go").write_text(text)
        lines = text.splitlines(keepends=True)
        lines[len(lines) // 2] = "// one line changed here\n"
        (root / "copies" / f"c{i}.go").write_text("".join(lines))
    (root / "base" / "cfg.py").write_text('AWS_KEY = "AKIAIOSFODNN7REALKEY1"\nOWNER = "jane.doe@gmail.com"\n'
                                          'HOST = "8.8.4.4"\n')
    return root


def test_workers_do_not_change_the_shards(tmp_path, code_corpus, planted, tokenizer_dir):
    """1 and 3 workers: identical shard files, offsets, content hashes and report, with every step on."""
    sources = [str(code_corpus), str(planted)]
    opts = CorpusOptions(dedup="near", redact_secrets=True, redact_pii=True, decontaminate=["humaneval"],
                         val_fraction=0.2)
    said: list[str] = []
    one = prepare(sources, tokenizer_dir, tmp_path / "one", opts, log=_quiet, workers=1, tasks=5,
                  repo_fim=0.5)
    three = prepare(sources, tokenizer_dir, tmp_path / "three", opts, log=said.append, workers=3, tasks=5,
                    repo_fim=0.5)
    assert any("on 3 worker(s)" in m for m in said)  # the read, near and encode stages ran 3 at once
    _same_meta(one, three)
    assert _files(tmp_path / "one") == _files(tmp_path / "three") and len(_files(tmp_path / "one")) >= 5
    assert one["engine"]["tasks"] == 5 and one["skipped"]["near_duplicate"] >= 12
    assert one["secrets_replaced"]["AWS Access Key"] == 1 and one["secrets_replaced"]["Email Address"] == 1
    assert one["secrets_replaced"]["IP Address"] == 1 and one["repo_fim_documents"] > 0
    # decoded, the shards hold none of the replaced values and every kept document ends with end-of-text
    tok = CodeTokenizer.load(tokenizer_dir)
    text = ""
    for split in ("train", "val"):
        ss = ShardSet(tmp_path / "one", split)
        stream = np.concatenate(ss.arrays) if ss.arrays else np.zeros(0, dtype=np.uint16)
        starts = ss.doc_starts()
        assert len(starts) == ss.documents and all(stream[e - 1] == tok.eot_id for e in list(starts[1:])
                                                   + [len(stream)])
        text += tok.decode(stream.tolist())
    assert "AKIAIOSFODNN7REALKEY1" not in text and "jane.doe@gmail.com" not in text and "8.8.4.4" not in text
    assert "REDACTED_EMAIL_ADDRESS" in text and "REDACTED_AWS_ACCESS_KEY" in text
    steps = one["steps"]
    assert list(steps) == ["read", "quality filters", "deduplication", "benchmarks out", "secrets replaced"]
    assert steps["deduplication"]["documents_in"] - steps["deduplication"]["documents_out"] == \
        one["skipped"]["duplicate"] + one["skipped"]["near_duplicate"]


def test_near_dedup_finds_at_least_what_the_single_process_path_finds(tmp_path, planted, tokenizer_dir):
    old = CorpusStats()
    list(iter_documents([str(planted)], CorpusOptions(dedup="near"), old))
    meta = prepare([str(planted)], tokenizer_dir, tmp_path / "d", CorpusOptions(dedup="near"), log=_quiet,
                   workers=1, tasks=4)
    assert old.skipped["near_duplicate"] == 12  # every planted copy, by datasketch in one process
    assert meta["skipped"]["near_duplicate"] >= old.skipped["near_duplicate"]
    assert meta["documents"] == 13  # 12 originals (or their copies) and the config file


def test_lsh_bands_are_datasketchs():
    from datasketch import MinHashLSH
    for t in (0.7, 0.85, 0.9):
        lsh = MinHashLSH(threshold=t, num_perm=128)
        assert lsh_bands(t) == (lsh.b, lsh.r)


def test_task_count_and_plan_do_not_depend_on_workers(tmp_path, code_corpus):
    assert pipeline.task_count(3, 10) == 3 and pipeline.task_count(10_000, 10) == pipeline.MIN_TASKS
    assert pipeline.task_count(10**7, 10**12) == pipeline.MAX_TASKS
    t = pipeline.make_plan([str(code_corpus)], CorpusOptions(), tmp_path / "w")
    rows = [[json.loads(x) for x in (tmp_path / "w" / "plan" / f"{r:05d}.jsonl").read_text().splitlines()]
            for r in range(t)]
    assert all(rows) and [u for r in rows for u in r] == \
        [json.loads(x) for x in (tmp_path / "w" / "plan" / "units.jsonl").read_text().splitlines()]


def _cli(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "codeforge", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True, cwd=ROOT, **kw)


def test_kill_9_then_the_same_command_resumes(tmp_path, code_corpus, planted, tokenizer_dir):
    """kill -9 of prepare and its workers part way; the same command skips the finished tasks and writes the
    dataset a clean run writes."""
    out = tmp_path / "d"
    args = ["prepare", "--input", str(code_corpus), str(planted), "--tokenizer", str(tokenizer_dir), "--out",
            str(out), "--dedup", "near", "--workers", "2", "--tasks", "12"]
    p = _cli(*args)
    deadline = time.time() + 120
    done: list[Path] = []
    while time.time() < deadline and not done:
        done = list(tmp_path.glob(".d.prepare-*/logs/read/completions/*"))
        time.sleep(0.01)
    import psutil
    server = [c for c in psutil.Process(p.pid).children() if "forkserver" in " ".join(c.cmdline())]
    workers = [w for f in server for w in f.children()]
    os.kill(p.pid, signal.SIGKILL)  # the command alone: its pool's workers must not go on writing
    p.wait()
    assert done and not out.exists(), "the run finished before it could be killed"
    assert workers and psutil.wait_procs(workers, timeout=15)[1] == []  # every worker ended with the command
    work = next(tmp_path.glob(".d.prepare-*"))
    finished = sorted(f.name for f in (work / "logs" / "read" / "completions").iterdir())
    kept = {r: (work / "docs" / f"{r}.jsonl").stat().st_mtime_ns for r in finished
            if (work / "docs" / f"{r}.jsonl").exists()}
    q = _cli(*args)
    said, _ = q.communicate(timeout=300)
    assert q.returncode == 0, said
    assert "resuming" in said and f"{len(finished)} done before" in said
    for r, mtime in kept.items():  # a finished task was not run again (its output is untouched)
        assert not (work / "docs").exists() or (work / "docs" / f"{r}.jsonl").stat().st_mtime_ns == mtime
    assert not work.exists()
    # the engine's helpers (its manager, fork server, resource tracker) ended with the first run
    with pytest.raises(ProcessLookupError):
        os.killpg(p.pid, 0)
    # the command's defaults
    opts = CorpusOptions(dedup="near", redact_secrets=True, decontaminate=["humaneval"])
    prepare([str(code_corpus), str(planted)], tokenizer_dir, tmp_path / "clean", opts, log=_quiet, workers=1,
            tasks=12)
    assert _files(out) == _files(tmp_path / "clean")
    for s in ("train", "val"):
        ShardSet(out, s)  # every shard whole: its size matches meta.json


def test_kill_keeps_finished_work_before_the_rerun(tmp_path, code_corpus, tokenizer_dir, monkeypatch):
    """The same in one process: a task failing mid-stage leaves the finished tasks' markers, and the rerun
    runs only the others."""
    real = pipeline.EncodeShards.run

    def flaky(self, data, rank=0, world_size=1):
        if rank == 2:
            raise KeyboardInterrupt
        return real(self, data, rank, world_size)

    monkeypatch.setattr(pipeline.EncodeShards, "run", flaky)
    with pytest.raises(KeyboardInterrupt):
        prepare([str(code_corpus)], tokenizer_dir, tmp_path / "d", CorpusOptions(), log=_quiet, workers=1,
                tasks=4)
    work = next(tmp_path.glob(".d.prepare-*"))
    assert sorted(f.name for f in (work / "logs" / "encode" / "completions").iterdir()) == ["00000", "00001"]
    ran = []
    monkeypatch.setattr(pipeline.EncodeShards, "run",
                        lambda self, d, rank=0, ws=1: (ran.append(rank), real(self, d, rank, ws))[1])
    prepare([str(code_corpus)], tokenizer_dir, tmp_path / "d", CorpusOptions(), log=_quiet, workers=1,
            tasks=4)
    assert ran == [2, 3]


def test_slurm_writes_one_job_array_per_stage(tmp_path, code_corpus, tokenizer_dir, monkeypatch):
    """--executor slurm: sbatch gets one script per stage, each after the one before; the pickled pipeline
    is codeforge's steps; the work directory holds the plan the jobs read."""
    import dill
    bindir = tmp_path / "bin"
    bindir.mkdir()
    calls = tmp_path / "calls"
    calls.mkdir()
    (bindir / "sbatch").write_text(  # records each call (arguments, script) and answers as sbatch does
        "#!/bin/sh\nn=$(ls %s | grep -c args)\nfor a in \"$@\"; do last=\"$a\"; done\n"
        "echo \"$@\" > %s/$n.args\ncp \"$last\" %s/$n.sh\necho \"Submitted batch job $((100 + n))\"\n"
        % (calls, calls, calls))
    (bindir / "sbatch").chmod(0o755)
    # squeue cannot answer (no cluster), as on a machine without Slurm: a rerun cannot tell the jobs left
    (bindir / "squeue").write_text("#!/bin/sh\necho 'squeue: error: no controller' >&2\nexit 1\n")
    (bindir / "squeue").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    with pytest.raises(ShardError, match="--slurm-partition"):
        prepare([str(code_corpus)], tokenizer_dir, tmp_path / "d", CorpusOptions(dedup="near"), log=_quiet,
                executor="slurm", tasks=6)
    said = []
    got = prepare([str(code_corpus)], tokenizer_dir, tmp_path / "d", CorpusOptions(dedup="near"),
                  log=said.append, executor="slurm", tasks=6,
                  slurm={"partition": "cpu", "time": "01:00:00", "env_command": "true"})
    assert got is None and not (tmp_path / "d").exists() and any("submitted 7 Slurm job arrays" in m
                                                                 for m in said)
    n_calls = len(list(calls.glob("*.args")))
    jobs = [(100 + i, (calls / f"{i}.sh").read_text(), (calls / f"{i}.args").read_text())
            for i in range(n_calls)]
    arrays = [j for j in jobs if "launch_pickled_pipeline" in j[1]]  # (the others merge the engine's stats)
    names = ["read", "exact", "near", "buckets", "clusters", "encode", "merge"]
    sizes = [6, 1, 6, 8, 1, 6, 1]
    assert len(arrays) == 7
    work = next(tmp_path.glob(".d.prepare-*"))
    for i, (name, n) in enumerate(zip(names, sizes)):
        job, script, argv = arrays[i]
        assert f"#SBATCH --job-name=codeforge-prepare-{name}" in script
        assert "#SBATCH --partition=cpu" in script and "#SBATCH --time=01:00:00" in script
        assert f"#SBATCH --array=0-{n - 1}" in script
        assert f"launch_pickled_pipeline {work / 'logs' / name / 'executor.pik'}" in script
        assert (f"--dependency=afterok:{arrays[i - 1][0]}" in argv) if i else "--dependency" not in argv
    with open(work / "logs" / "encode" / "executor.pik", "rb") as f:
        ex = dill.load(f)
    assert ex.tasks == 6 and type(ex.pipeline[-1]).__name__ == "EncodeShards"
    assert (work / "plan" / "plan.json").exists() and json.loads((work / "plan" / "plan.json").read_text())[
        "tasks"
    ] == 6
    # the same command again while those jobs may still run: refused (two chains never share a directory)
    with pytest.raises(pipeline.KeepWork, match="were submitted"):
        prepare([str(code_corpus)], tokenizer_dir, tmp_path / "d", CorpusOptions(dedup="near"), log=_quiet,
                executor="slurm", tasks=6, slurm={"partition": "cpu"})
    assert (
        json.loads((work / "submitted.json").read_text())["jobs"] == [str(j[0]) for j in arrays]
        and work.exists()
    )


def test_redact_pii_keeps_what_identifies_no_one():
    text, found = redact_pii('to = "bob.smith@company.io"  # cc test@example.com\nip = "93.184.216.34"; '
                             'lo = "127.0.0.1"; lan = "10.1.2.3"; doc = "192.0.2.1"; v = '
                             '"2001:4860:4860::8888"\n'
                             'version = "1.2.3.4"; std::vector<int> xs; mac = "aa:bb:cc:dd:ee:ff"\n')
    assert found == {"Email Address": 1, "IP Address": 2}
    for keep in ("test@example.com", "127.0.0.1", "10.1.2.3", "192.0.2.1", 'version = "1.2.3.4"',
                 "std::vector", "aa:bb:cc:dd:ee:ff"):
        assert keep in text
    assert "bob.smith" not in text and "93.184.216.34" not in text and "2001:4860" not in text


def test_pii_false_positives_in_code_stay():
    code = ('y = inputs@self.kernel; h = x@self.weight + b; '
            'AssemblyVersion("1.0.0.0"); __version__ = "1.2.3.4"\n'
            'dead::beef(); ab::cd; face::cafe(); git@github.com:org/repo.git; ssh git@gitlab.com; 12:30:45\n')
    text, found = redact_pii(code)
    assert text == code and not found


def test_a_failed_stage_keeps_the_work_and_the_rerun_finishes_it(tmp_path, code_corpus, tokenizer_dir,
                                                                 monkeypatch):
    real = pipeline.EncodeShards.run

    def full_disk(self, data, rank=0, world_size=1):
        if rank == 1:
            raise OSError(28, "No space left on device")
        return real(self, data, rank, world_size)

    monkeypatch.setattr(pipeline.EncodeShards, "run", full_disk)
    with pytest.raises(pipeline.StageFailed,
                       match="encode stage failed.*No space left.*run the same command again"):
        prepare([str(code_corpus)], tokenizer_dir, tmp_path / "d", CorpusOptions(), log=_quiet, workers=1,
                tasks=3)
    work = next(tmp_path.glob(".d.prepare-*"))
    assert (work / "logs" / "encode" / "completions" / "00000").exists()
    monkeypatch.setattr(pipeline.EncodeShards, "run", real)
    said = []
    prepare([str(code_corpus)], tokenizer_dir, tmp_path / "d", CorpusOptions(), log=said.append, workers=1,
            tasks=3)
    assert any("encode" in m and "1 done before" in m for m in said) and not work.exists()


def test_a_busy_work_directory_is_refused_and_kept(tmp_path, code_corpus, tokenizer_dir, monkeypatch):
    """A second command while the first still works there (holds the lock): refused, nothing removed."""
    real = pipeline.EncodeShards.run

    def interrupted(self, data, rank=0, world_size=1):
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeline.EncodeShards, "run", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prepare([str(code_corpus)], tokenizer_dir, tmp_path / "d", CorpusOptions(), log=_quiet, workers=1,
                tasks=2)
    monkeypatch.setattr(pipeline.EncodeShards, "run", real)
    work = next(tmp_path.glob(".d.prepare-*"))
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'a+'); "
                               "fcntl.lockf(f, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)",
                               str(work / "lock")], stdout=subprocess.PIPE, text=True)
    try:  # another process holds the lock, as the first command does while it runs
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(pipeline.KeepWork, match="another prepare is working"):
            prepare([str(code_corpus)], tokenizer_dir, tmp_path / "d", CorpusOptions(), log=_quiet, workers=1,
                    tasks=2)
        assert (work / "plan" / "plan.json").exists()
    finally:
        holder.kill()
        holder.wait()
    meta = prepare([str(code_corpus)], tokenizer_dir, tmp_path / "d", CorpusOptions(), log=_quiet, workers=1,
                   tasks=2)
    assert meta["documents"] > 0 and not work.exists()


def test_tasks_are_part_of_the_datasets_identity(tmp_path, code_corpus, tokenizer_dir):
    a = prepare([str(code_corpus)], tokenizer_dir, tmp_path / "d", CorpusOptions(), log=_quiet, workers=1,
                tasks=3)
    b = prepare([str(code_corpus)], tokenizer_dir, tmp_path / "d", CorpusOptions(), log=_quiet, workers=1,
                tasks=5, overwrite=True)
    assert (a["engine"]["tasks"], b["engine"]["tasks"]) == (3, 5) and a["fingerprint"] != b["fingerprint"]
    with pytest.raises(ShardError, match="--tasks 5000"):
        prepare([str(code_corpus)], tokenizer_dir, tmp_path / "e", CorpusOptions(), log=_quiet, tasks=5000)


def test_engine_output_stays_off_the_console():
    """The engine's log records and progress bars are dropped from stderr; codeforge's own lines pass."""
    import io
    sink = io.StringIO()
    err = local._WithoutEngineLog(sink)
    for s in ("2026-11-28 00:00:00.000 | ERROR    | datatrove:run:1 - boom\nTraceback ...\n",
              "\rInitializing pq...:   0%|          | 0/16 [00:00<?, ?it/s]", "\n",
              "warning: skipping a.jsonl:3: bad_json", "\n"):
        err.write(s)
    assert sink.getvalue() == "warning: skipping a.jsonl:3: bad_json\n"
