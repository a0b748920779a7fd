"""`codeforge prepare` cleans up after itself and trusts nothing it did not write (issue 55, item 4): the
engine's helper processes end with the command, a corpus directory swapped for a symlink is not followed,
another prepare's live work directory is left alone, a work directory it does not own or with planted
symlinks is refused, raw text is not left readable to others, Slurm scripts quote their paths, and printed
file names are escaped."""

import json
import os
import re
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import sysconfig
import time
import uuid
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parent.parent
STDLIB = Path(sysconfig.get_paths()["stdlib"])


def _quiet(*a):
    pass


def _tagged(tag: str) -> list[int]:
    """The pids of live processes whose environment holds TAG=tag (set on the command; its children inherit
    it, whatever process group or parent they end up in)."""
    want = f"CODEFORGE_TEST_TAG={tag}".encode()
    pids = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            env = Path(f"/proc/{d}/environ").read_bytes().split(b"\0")
            state = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if want in env and state != "Z":  # a zombie has ended; only its parent has not reaped it yet
            pids.append(int(d))
    return pids


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "(gone)"


def test_kill_9_of_prepare_leaves_no_process_behind(tmp_path, code_corpus, tokenizer_dir):
    """Before: the engine's manager server, fork server and resource tracker lived on under init after a
    kill -9 of the command (~170 MB each time). Now every process the command started ends with it."""
    tag = uuid.uuid4().hex
    out = tmp_path / "d"
    p = subprocess.Popen([sys.executable, "-m", "codeforge", "prepare", "--input", str(code_corpus),
                          str(STDLIB / "email"), str(STDLIB / "json"), "--tokenizer", str(tokenizer_dir),
                          "--out", str(out), "--workers", "2", "--tasks", "16"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                         cwd=ROOT, env={**os.environ, "CODEFORGE_TEST_TAG": tag})
    try:
        deadline = time.time() + 120
        # part way through the encode stage: the fork server started in the read stage, before this stage's
        # manager, which holds the pipes that keep the fork server and the resource tracker alive
        while time.time() < deadline and not list(tmp_path.glob(".d.prepare-*/logs/encode/completions/*")):
            time.sleep(0.01)
        before = {pid: _cmdline(pid) for pid in _tagged(tag)}
        os.kill(p.pid, signal.SIGKILL)  # the command alone, as an OOM killer or `kill -9 PID` does
        p.wait()
        assert not out.exists(), "the run finished before it could be killed"
        # the helpers were running: the fork server, and a manager (a fork of the command: its command line)
        assert any("forkserver" in c for c in before.values()), before
        assert any(pid != p.pid and "codeforge prepare" in c for pid, c in before.items()), before
        deadline = time.time() + 20
        while time.time() < deadline and _tagged(tag):
            time.sleep(0.2)
        left = {pid: _cmdline(pid) for pid in _tagged(tag)}
        assert not left, f"still running after the command was killed: {left}"
    finally:
        for pid in _tagged(tag):  # whatever the outcome, nothing of this test stays
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


# -- helpers for the tests below, which call prepare in this process -----------------------------------------

def _text(out: Path, tokenizer_dir: Path) -> str:
    """Every document of a prepared dataset, decoded."""
    import numpy as np

    from codeforge.data.shards import ShardSet
    from codeforge.tokenizer import CodeTokenizer
    tok = CodeTokenizer.load(tokenizer_dir)
    text = ""
    for split in ("train", "val"):
        ss = ShardSet(out, split)
        if ss.arrays:
            text += tok.decode(np.concatenate(ss.arrays).tolist())
    return text


def _small_tree(root: Path, n: int = 6) -> Path:
    """A directory of `n` small Go files in two packages."""
    import random

    from conftest import make_go_file
    rng = random.Random(3)
    for i in range(n):
        d = root / f"pkg{i % 2}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"f{i}.go").write_text(make_go_file(rng, 500 + i))
    return root


def _interrupted(monkeypatch, tmp_path: Path, sources: list[str], tokenizer_dir: Path, out: Path,
                 **kw) -> Path:
    """Run prepare until its encode stage, as a kill there would leave it: its work directory."""
    from codeforge.corpus import CorpusOptions
    from codeforge.data import pipeline
    from codeforge.data.shards import prepare

    def interrupted(self, data, rank=0, world_size=1):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(pipeline.EncodeShards, "run", interrupted)
        with pytest.raises(KeyboardInterrupt):
            prepare(sources, tokenizer_dir, out, kw.pop("opts", CorpusOptions()), log=_quiet, workers=1,
                    **kw)
    return next(out.parent.glob(f".{out.name}.prepare-*"))


# -- a corpus directory swapped for a symlink after the walk -------------------------------------------------

def test_a_directory_swapped_for_a_symlink_after_the_plan_is_not_followed(tmp_path, tokenizer_dir,
                                                                          monkeypatch):
    """Before: the plan names tree/pkg1/f1.go; pkg1 is then swapped for a symlink to a directory outside the
    tree, and the read stage followed it (only a file's own name was checked for a link), reading the
    outside file into the dataset. Now the opened file's real path is checked: counted as symlink_outside,
    never read."""
    from codeforge.corpus import CorpusOptions
    from codeforge.data import pipeline
    from codeforge.data.shards import prepare
    tree = _small_tree(tmp_path / "tree")
    outside = tmp_path / "private" / "pkg1"
    outside.mkdir(parents=True)
    for f in (tree / "pkg1").iterdir():  # same names, so every planned path resolves there
        (outside / f.name).write_text(f"package secret\n\n// LEAKEDOUTSIDE {f.name}\nfunc Leak() int {{\n"
                                      f"\treturn 42\n}}\n")
    real_plan = pipeline.make_plan

    def plan_then_swap(*a, **k):
        t = real_plan(*a, **k)
        (tree / "pkg1").rename(tmp_path / "pkg1.moved")
        (tree / "pkg1").symlink_to(outside, target_is_directory=True)
        return t

    monkeypatch.setattr(pipeline, "make_plan", plan_then_swap)
    meta = prepare([str(tree)], tokenizer_dir, tmp_path / "d", CorpusOptions(), log=_quiet, workers=1,
                   tasks=2)
    assert "LEAKEDOUTSIDE" not in _text(tmp_path / "d", tokenizer_dir)
    assert meta["skipped"].get("symlink_outside") == 3 and meta["documents"] == 3, meta["skipped"]


# -- the work directory: this user's, 0700, nothing planted in it --------------------------------------------

def test_a_work_directory_another_user_owns_is_refused_and_left(tmp_path, tokenizer_dir, monkeypatch):
    """Before: prepare worked in (and then removed) a `.OUT.prepare-FP` directory whatever its owner, so
    another user could plant its contents. Now it is refused, naming the owner, and left as it is."""
    from codeforge.corpus import CorpusOptions
    from codeforge.data import pipeline
    from codeforge.data.shards import prepare
    tree = _small_tree(tmp_path / "tree")
    work = _interrupted(monkeypatch, tmp_path, [str(tree)], tokenizer_dir, tmp_path / "d", tasks=2)
    if os.geteuid() == 0:
        for top, dirs, files in os.walk(work):
            for name in [top, *(os.path.join(top, n) for n in dirs + files)]:
                os.lchown(name, 4242, 4242)
    else:  # only root can give a directory away: this user then looks like another one to prepare
        real = os.geteuid()
        monkeypatch.setattr(os, "geteuid", lambda: real + 4242)
    with pytest.raises(pipeline.KeepWork, match="belongs to .*not to you"):
        prepare([str(tree)], tokenizer_dir, tmp_path / "d", CorpusOptions(), log=_quiet, workers=1, tasks=2)
    assert (work / "plan" / "plan.json").exists() and not (tmp_path / "d").exists()


def test_a_plan_entry_outside_the_inputs_is_refused(tmp_path, tokenizer_dir, monkeypatch):
    """Before: whatever the plan named was read, an entry pointing outside the inputs included (a file, or
    `..` out of an input directory). Now each entry must name an input or a file under one: refused."""
    from codeforge.corpus import CorpusOptions
    from codeforge.data import pipeline
    from codeforge.data.shards import prepare
    tree = _small_tree(tmp_path / "tree")
    secret = tmp_path / "secret.go"
    secret.write_text("package secret\n\n// LEAKEDOUTSIDE\nfunc Leak() int {\n\treturn 42\n}\n")
    real_plan = pipeline.make_plan
    for entry in ([str(secret), os.path.realpath(tree), 80], [f"{tree}/pkg0/../../secret.go",
                                                             os.path.realpath(tree), 80],
                  [str(secret), None, 80]):
        def plan_then_add(sources, opts, work, tasks=None, entry=entry):
            t = real_plan(sources, opts, work, tasks)
            with open(work / "plan" / "00000.jsonl", "a") as f:
                f.write(json.dumps(entry) + "\n")
            return t

        monkeypatch.setattr(pipeline, "make_plan", plan_then_add)
        with pytest.raises(pipeline.KeepWork, match="not a unit of the inputs"):
            prepare([str(tree)], tokenizer_dir, tmp_path / "d", CorpusOptions(), log=_quiet, workers=1,
                    tasks=2)
        for work in tmp_path.glob(".d.prepare-*"):
            shutil.rmtree(work)


def test_symlinks_planted_in_the_work_directory_are_refused_never_written_through(tmp_path, tokenizer_dir,
                                                                                  monkeypatch):
    """Before: a symlink planted at stats/STEP/RANK.json.tmp or tally/STEP/RANK.json in the work directory
    was written through on the rerun, overwriting the file it points to. Now a work directory holding a
    symlink is refused, and prepare's own writes never follow one (O_NOFOLLOW, written aside)."""
    from codeforge.corpus import CorpusOptions
    from codeforge.data import pipeline
    from codeforge.data.shards import prepare
    tree = _small_tree(tmp_path / "tree")
    opts = CorpusOptions(redact_secrets=True)  # its step saves stats/secrets/RANK.json
    work = _interrupted(monkeypatch, tmp_path, [str(tree)], tokenizer_dir, tmp_path / "d", tasks=2, opts=opts)
    victims = []
    for i, name in enumerate(["tally/before dedup/00000.json", "stats/secrets/00001.json.tmp"]):
        victim = tmp_path / f"victim{i}.txt"
        victim.write_text("precious")
        (work / name).parent.mkdir(parents=True, exist_ok=True)
        (work / name).symlink_to(victim)
        victims.append(victim)
    with pytest.raises(pipeline.KeepWork, match="is a symlink.*which prepare never makes"):
        prepare([str(tree)], tokenizer_dir, tmp_path / "d", opts, log=_quiet, workers=1, tasks=2)
    assert [v.read_text() for v in victims] == ["precious", "precious"]
    # prepare's own writes, should a link appear after that check: the link is replaced, never followed
    from codeforge.data import workdir
    d = tmp_path / "w"
    d.mkdir()
    for name in ("a.json", "a.json.tmp"):
        (d / name).symlink_to(victims[0])
        workdir.write_text(d / "a.json", "[1, 2]")
        assert (d / "a.json").read_text() == "[1, 2]" and not (d / "a.json").is_symlink()
        assert victims[0].read_text() == "precious" and not (d / "a.json.tmp").exists()
        (d / "a.json").unlink()


def test_a_fifo_in_a_work_directory_is_refused_never_waited_on(tmp_path, tokenizer_dir, monkeypatch):
    """Before: a FIFO planted at WORK/docs/RANK.jsonl hung the rerun for ever (the engine opened it to
    write), one at a sibling's submitted.json hung the next prepare in reading it, and one at WORK/lock
    raised a traceback. Now each is refused with KeepWork, naming it; an alarm turns a hang into a failure."""
    from codeforge.corpus import CorpusOptions
    from codeforge.data import pipeline
    from codeforge.data.shards import prepare
    tree = _small_tree(tmp_path / "tree")

    def hung(*_):
        raise AssertionError("prepare waited on a FIFO")
    old = signal.signal(signal.SIGALRM, hung)
    try:
        for i, name in enumerate(["docs/00000.jsonl", "lock"]):
            out = tmp_path / f"d{i}"
            work = _interrupted(monkeypatch, tmp_path, [str(tree)], tokenizer_dir, out, tasks=2)
            (work / name).unlink(missing_ok=True)
            os.mkfifo(work / name)
            signal.alarm(60)
            with pytest.raises(pipeline.KeepWork, match="FIFO"):
                prepare([str(tree)], tokenizer_dir, out, CorpusOptions(), log=_quiet, workers=1, tasks=2)
            signal.alarm(0)
        # another options' prepare of the same --out, with a FIFO for its submitted.json: not read, refused
        out = tmp_path / "d2"
        sibling = _interrupted(monkeypatch, tmp_path, [str(tree)], tokenizer_dir, out, tasks=2)
        os.mkfifo(sibling / "submitted.json")
        signal.alarm(60)
        with pytest.raises(pipeline.KeepWork, match=f"{re.escape(str(sibling))}.*unreadable list"):
            prepare([str(tree)], tokenizer_dir, out, CorpusOptions(redact_secrets=True), log=_quiet,
                    workers=1, tasks=2)
        signal.alarm(0)
        assert sibling.exists()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def test_raw_text_is_private_and_removed_once_encoded(tmp_path, tokenizer_dir, monkeypatch):
    """Before: a killed run left every kept document's raw text, secrets included, readable by every user
    in WORK/docs/ (0755), and it stayed there until the dataset was published. Now the work directory is
    0700 (an older 0755 one is made 0700 on the rerun), and docs/ is removed once the encode stage is done."""
    from codeforge.corpus import CorpusOptions
    from codeforge.data import pipeline
    from codeforge.data.shards import prepare
    tree = _small_tree(tmp_path / "tree")
    work = _interrupted(monkeypatch, tmp_path, [str(tree)], tokenizer_dir, tmp_path / "d", tasks=2)
    assert stat.S_IMODE(work.stat().st_mode) == 0o700 and any((work / "docs").iterdir())
    work.chmod(0o755)  # as an earlier version left it

    def full_disk(self, *a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pipeline.MergeShards, "_join", full_disk)
    with pytest.raises(pipeline.StageFailed, match="merge stage failed"):
        prepare([str(tree)], tokenizer_dir, tmp_path / "d", CorpusOptions(), log=_quiet, workers=1, tasks=2)
    assert stat.S_IMODE(work.stat().st_mode) == 0o700
    assert (work / "tokens").is_dir() and not (work / "docs").exists()


def test_another_prepares_live_work_directory_is_left_alone(tmp_path, tokenizer_dir, monkeypatch):
    """Before: a second prepare of the same --out with other options removed the first one's work directory
    while it ran (or while its Slurm jobs were queued). Now a work directory whose lock is held, or that
    Slurm jobs were submitted for, is left alone, and the second prepare is refused, naming it; one that
    nothing uses is still removed."""
    from codeforge.corpus import CorpusOptions
    from codeforge.data import pipeline
    from codeforge.data.shards import prepare
    tree = _small_tree(tmp_path / "tree")
    first = _interrupted(monkeypatch, tmp_path, [str(tree)], tokenizer_dir, tmp_path / "d", tasks=2)
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'a+'); "
                               "fcntl.lockf(f, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)",
                               str(first / "lock")], stdout=subprocess.PIPE, text=True)
    try:  # the first prepare, still running: it holds its lock
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(pipeline.KeepWork, match=f"{re.escape(str(first))}.*running now"):
            prepare([str(tree)], tokenizer_dir, tmp_path / "d", CorpusOptions(), log=_quiet, workers=1,
                    tasks=3)
        assert (first / "plan" / "plan.json").exists()
    finally:
        holder.kill()
        holder.wait()
    (first / "submitted.json").write_text(json.dumps({"jobs": ["101", "102"], "at": time.time()}))
    submitted = f"{re.escape(str(first))}.*jobs 101, 102 were submitted.*squeue -j 101,102"
    with pytest.raises(pipeline.KeepWork, match=submitted):
        prepare([str(tree)], tokenizer_dir, tmp_path / "d", CorpusOptions(), log=_quiet, workers=1, tasks=3)
    assert (first / "plan" / "plan.json").exists()
    (first / "submitted.json").unlink()  # the jobs have ended: the directory is stale now, and removed
    said: list[str] = []
    prepare([str(tree)], tokenizer_dir, tmp_path / "d", CorpusOptions(), log=said.append, workers=1, tasks=3)
    assert not first.exists() and any(f"removing {first}" in m for m in said)


# -- Slurm job scripts ---------------------------------------------------------------------------------------

def _fake_bin(d: Path, names: dict[str, str]) -> Path:
    d.mkdir(parents=True)
    for name, body in names.items():
        (d / name).write_text("#!/bin/sh\n" + body)
        (d / name).chmod(0o755)
    return d


def test_slurm_scripts_quote_every_path(tmp_path, tokenizer_dir, monkeypatch):
    """Before: the engine wrote paths into the job scripts bare: an --out with a space broke the job, and
    one holding $(...) ran that command when the job started. Now every path is quoted, on the command lines
    as bash reads them and on the #SBATCH lines as sbatch does: each script parses (bash -n), runs the
    engine's command on the exact paths and runs nothing else; a path no quoting carries is refused."""
    from codeforge.corpus import CorpusOptions
    from codeforge.data import pipeline
    from codeforge.data.shards import ShardError, prepare
    tree = _small_tree(tmp_path / "tree")
    calls = tmp_path / "calls"
    calls.mkdir()
    sbatch = ('n=$(ls %s | grep -c sh)\nfor a in "$@"; do last="$a"; done\ncp "$last" %s/$n.sh\n'
              'echo "Submitted batch job $((100 + n))"\n' % (calls, calls))
    bindir = _fake_bin(tmp_path / "bin", {"sbatch": sbatch})
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    parent = tmp_path / "my data $(touch pwned) `touch pwned2` \\ \" ' #x"
    out = parent / "d"
    assert prepare([str(tree)], tokenizer_dir, out, CorpusOptions(), log=_quiet, executor="slurm", tasks=2,
                   slurm={"partition": "cpu", "env_command": "true"}) is None
    work = next(parent.glob(".d.prepare-*"))
    scripts = sorted(calls.glob("*.sh"))
    assert len(scripts) >= 4  # read, exact, encode, merge, and the engine's stats merges
    # each script run with stand-ins for srun and the engine's commands, which record their arguments
    record = tmp_path / "argv"
    run_bin = _fake_bin(tmp_path / "runbin", {
        "srun": 'while [ "$1" != launch_pickled_pipeline ]; do shift; done; exec "$@"\n',
        **{c: f'printf "%s\\n" {c} "$@" >> {record}\n' for c in ("launch_pickled_pipeline", "merge_stats")}})
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    for script in scripts:
        text = script.read_text()
        assert subprocess.run(["bash", "-n", str(script)]).returncode == 0, text
        for line in text.splitlines():  # sbatch reads #SBATCH lines with quotes, as shlex does
            if line.startswith("#SBATCH --output="):
                assert shlex.split(line[len("#SBATCH "):]) == [
                    f"--output={work / 'logs'}/{line.split('/logs/')[1].split('/')[0]}/slurm_logs/%A_%a.out"]
        r = subprocess.run(["bash", str(script)], cwd=cwd, capture_output=True, text=True,
                           env={**os.environ, "PATH": f"{run_bin}:{os.environ['PATH']}"})
        assert r.returncode == 0, r.stderr
    argv = record.read_text().splitlines()
    stages = ["read", "exact", "encode", "merge"]
    assert [a for a in argv if a.endswith("executor.pik")] == [str(work / "logs" / s / "executor.pik")
                                                               for s in stages]
    assert {str(work / "logs" / "read" / n) for n in ("stats", "stats.json")} <= set(argv)
    assert not list(tmp_path.rglob("pwned*")), "a command in the path ran"
    # what no quoting carries: a newline ends an #SBATCH line, and the rest would run as a command
    with pytest.raises(ShardError, match="cannot carry"):
        prepare([str(tree)], tokenizer_dir, tmp_path / "new\nline" / "d", CorpusOptions(), log=_quiet,
                executor="slurm", tasks=2, slurm={"partition": "cpu", "env_command": "true"})
    assert pipeline.slurm_jobs.env_command() == "" or pipeline.slurm_jobs.env_command().startswith("source ")


# -- printed file names --------------------------------------------------------------------------------------

def test_file_names_prepare_prints_are_escaped(tmp_path, tokenizer_dir):
    """Before: prepare's warnings printed a file name as it is, so a name holding ESC ] 0 ; ... BEL retitled
    the terminal (or ESC [ 2 J cleared it). Now they are escaped as every printed name from outside is
    (codeforge.printable), from the walk (the command's process) and from the read stage (its workers)."""
    tree = _small_tree(tmp_path / "tree")
    (tree / "b\x1b]0;pwned\x07.go").symlink_to(tmp_path / "missing.go")  # read stage: broken_symlink
    (tree / "d\x1b[2J").symlink_to(tree / "pkg0", target_is_directory=True)  # the walk: symlinked_dir
    r = subprocess.run([sys.executable, "-m", "codeforge", "prepare", "--input", str(tree), "--tokenizer",
                        str(tokenizer_dir), "--out", str(tmp_path / "d"), "--workers", "2", "--tasks", "2"],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr
    said = r.stdout + r.stderr
    assert "\x1b" not in said and "\x07" not in said, said
    assert "b\\x1b]0;pwned\\x07.go" in said and "d\\x1b[2J" in said, said


def test_the_engines_log_stays_off_the_console_with_workers(tmp_path, tokenizer_dir):
    """With --workers 2 the engine's closing stats table (a loguru SUCCESS record with emoji, logged in the
    command's own process after the workers end) reached the console; it stays in WORK/logs now."""
    tree = _small_tree(tmp_path / "tree")
    r = subprocess.run([sys.executable, "-m", "codeforge", "prepare", "--input", str(tree), "--tokenizer",
                        str(tokenizer_dir), "--out", str(tmp_path / "d"), "--workers", "2",
                        "--val-fraction", "0"], capture_output=True, text=True, timeout=300)
    said = r.stdout + r.stderr
    assert r.returncode == 0, said
    assert "datatrove" not in said and "SUCCESS" not in said and "\U0001f4c9" not in said, said
    assert "encode" in said and "documents" in said  # codeforge's own report is all there is
