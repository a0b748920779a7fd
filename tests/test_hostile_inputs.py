"""Hostile inputs lose nothing (issue 9): FIFOs, devices, sockets, broken and looping symlinks, unreadable
files and damaged compressed files are skipped and counted by reason (or refused under --strict, naming the
path) while the rest of the corpus is prepared; a killed writer's staging directories are cleaned up later.

Anything that could hang or read forever runs in a subprocess with a timeout, so a regression fails the test
instead of blocking the suite."""

from __future__ import annotations

import gzip
import json
import os
import random
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from codeforge import atomic
from codeforge.corpus import REASON_WORDS, CorpusError, CorpusOptions, CorpusStats, check_sources, iter_documents
from conftest import make_go_file, make_py_file

TIMEOUT = 60
GOOD = "def good():\n    return 1\n"


def _bounded() -> None:
    """In the child: a regression that reads /dev/zero fails at 8 GiB of address space, not by exhausting the host."""
    import resource
    resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "codeforge", *args], capture_output=True, text=True,
                          timeout=TIMEOUT, preexec_fn=_bounded)


def make_socket(path: Path) -> bool:
    try:
        os.mknod(path, stat.S_IFSOCK | 0o600)
        return True
    except (OSError, AttributeError):
        pass
    try:
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(path))
        s.close()  # the socket file stays
        return True
    except OSError:
        return False


def jsonl_gz(path: Path, n: int, seed: int = 0) -> list[str]:
    """n records of incompressible text, so a cut in the middle of the file leaves whole records before it."""
    rng = random.Random(seed)
    texts = [f"x_{i} = '{rng.randbytes(40).hex()}'\n" for i in range(n)]
    with gzip.open(path, "wt") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    return texts


def truncate(path: Path, fraction: float) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * fraction)])


# -- one hostile entry at a time, through the real iter_documents in a subprocess --------------------------

def _fifo(d):
    os.mkfifo(d / "tree" / "pipe.py")
    return d / "tree" / "pipe.py", "not_regular_file", False


def _dev_zero(d):
    (d / "tree" / "zero.go").symlink_to("/dev/zero")
    return d / "tree" / "zero.go", "not_regular_file", False


def _socket(d):
    if not make_socket(d / "tree" / "sock.py"):
        pytest.skip("cannot create a unix socket file here")
    return d / "tree" / "sock.py", "not_regular_file", False


def _self_loop(d):
    (d / "tree" / "loop.py").symlink_to("loop.py")
    return d / "tree" / "loop.py", "broken_symlink", False


def _dangling(d):
    (d / "tree" / "gone.go").symlink_to(d / "nowhere.go")
    return d / "tree" / "gone.go", "broken_symlink", False


def _not_gzip(d):
    (d / "plain.jsonl.gz").write_text(json.dumps({"text": "a = 1\n"}) + "\n")
    return d / "plain.jsonl.gz", "corrupt_compressed", True


def _truncated_gz(d):
    jsonl_gz(d / "cut.jsonl.gz", 50)
    truncate(d / "cut.jsonl.gz", 0.5)
    return d / "cut.jsonl.gz", "corrupt_compressed", True


def _truncated_zst(d):
    import zstandard
    data = "".join(json.dumps({"text": f"z{i} = {i}\n"}) + "\n" for i in range(3000)).encode()
    c = zstandard.ZstdCompressor().compress(data)
    (d / "cut.jsonl.zst").write_bytes(c[:len(c) // 2])  # zstandard itself would just stop early, silently
    return d / "cut.jsonl.zst", "corrupt_compressed", True


def _not_parquet(d):
    (d / "junk.parquet").write_bytes(b"PAR1 not really")
    return d / "junk.parquet", "corrupt_parquet", True


RUN_CORPUS = r"""
import json, sys
from codeforge.corpus import CorpusError, CorpusOptions, CorpusStats, iter_documents
stats = CorpusStats()
try:
    docs = [d.text for d in iter_documents(json.loads(sys.argv[1]), CorpusOptions(strict=sys.argv[2] == "1"), stats)]
    print(json.dumps({"docs": docs, "skipped": dict(stats.skipped)}))
except CorpusError as e:
    print(json.dumps({"error": str(e)}))
"""


def run_corpus(sources: list[Path], strict: bool) -> dict:
    r = subprocess.run([sys.executable, "-c", RUN_CORPUS, json.dumps([str(s) for s in sources]), str(int(strict))],
                       capture_output=True, text=True, timeout=TIMEOUT, preexec_fn=_bounded)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.parametrize("make", [_fifo, _dev_zero, _socket, _self_loop, _dangling, _not_gzip, _truncated_gz,
                                  _truncated_zst, _not_parquet], ids=lambda f: f.__name__.strip("_"))
def test_each_hostile_entry_is_counted_or_refused_under_strict(tmp_path, make):
    (tmp_path / "tree").mkdir()
    (tmp_path / "tree" / "good.py").write_text(GOOD)
    path, reason, direct = make(tmp_path)
    sources = [tmp_path / "tree"] + ([path] if direct else [])
    r = run_corpus(sources, strict=False)
    assert GOOD in r["docs"]
    assert r["skipped"] == {reason: 1}
    r = run_corpus(sources, strict=True)
    assert str(path) in r["error"] and reason in r["error"] and "--strict" in r["error"]


# -- the commands a user runs ------------------------------------------------------------------------------

@pytest.fixture
def hostile(tmp_path) -> dict:
    """Normal Go and Python files with hostile entries among them, and two damaged .jsonl.gz files."""
    root = tmp_path / "tree"
    rng = random.Random(1)
    good = []
    for i in range(12):
        d = root / f"pkg{i % 2}"
        d.mkdir(parents=True, exist_ok=True)
        text = make_go_file(rng, i) if i % 2 else make_py_file(rng, i)
        (d / (f"f{i}.go" if i % 2 else f"m{i}.py")).write_text(text)
        good.append(text)
    os.mkfifo(root / "pkg0" / "pipe.py")
    (root / "pkg0" / "zero.go").symlink_to("/dev/zero")
    (root / "pkg1" / "loop.go").symlink_to("loop.go")
    (root / "pkg1" / "gone.py").symlink_to(root / "missing.py")
    (root / "pkg1" / "up").symlink_to("..")  # a directory symlink loop
    counts = {"not_regular_file": 2, "broken_symlink": 2, "symlinked_dir": 1, "corrupt_compressed": 2}
    if make_socket(root / "pkg0" / "sock.py"):
        counts["not_regular_file"] += 1
    if os.geteuid() != 0:  # root reads a chmod 000 file; test_unreadable_* covers root
        (root / "pkg0" / "secret.py").write_text("secret = 1\n")
        (root / "pkg0" / "secret.py").chmod(0)
        counts["unreadable"] = 1
    records = jsonl_gz(tmp_path / "cut.jsonl.gz", 2000)
    truncate(tmp_path / "cut.jsonl.gz", 0.6)
    (tmp_path / "fake.jsonl.gz").write_text(json.dumps({"text": "not = 'gzip'\n"}) + "\n")
    return {"root": root, "good": good, "records": records, "counts": counts,
            "sources": [str(root), str(tmp_path / "cut.jsonl.gz"), str(tmp_path / "fake.jsonl.gz")]}


def test_cli_tokenizer_train_and_prepare_skip_hostile_entries(tmp_path, hostile, tokenizer_dir):
    from codeforge.data.shards import ShardSet
    from codeforge.tokenizer import CodeTokenizer

    r = cli("tokenizer", "train", "--input", *hostile["sources"], "--vocab-size", "300", "--out", str(tmp_path / "tok"))
    assert r.returncode == 0, r.stderr
    assert "trained tokenizer" in r.stdout
    for reason, n in hostile["counts"].items():
        assert f"{n} {REASON_WORDS[reason]}" in r.stdout
    assert str(hostile["root"] / "pkg0" / "pipe.py") in r.stderr  # warned with the path

    data = tmp_path / "data"
    r = cli("prepare", "--input", *hostile["sources"], "--tokenizer", str(tokenizer_dir), "--out", str(data),
            "--val-fraction", "0")
    assert r.returncode == 0, r.stderr
    meta = json.loads((data / "meta.json").read_text())
    for reason, n in hostile["counts"].items():
        assert meta["skipped"][reason] == n
        assert f"{n} {REASON_WORDS[reason]}" in r.stdout
    assert meta["skipped_examples"]["broken_symlink"].startswith(str(hostile["root"]))
    tok, ss = CodeTokenizer.load(data / "tokenizer"), ShardSet(data, "train")
    texts = [tok.decode(ss.document(i)) for i in range(ss.documents)]
    assert set(hostile["good"]) <= set(texts)
    kept = [t for t in texts if t not in hostile["good"]]
    assert 0 < len(kept) < len(hostile["records"]) and kept == hostile["records"][:len(kept)]  # the part before the cut
    assert not list(tmp_path.glob(".data.*"))  # no staging left behind


def test_cli_strict_refuses_a_hostile_entry_naming_it(tmp_path, code_corpus, tokenizer_dir):
    root = tmp_path / "tree"
    root.mkdir()
    (root / "good.py").write_text(GOOD)
    os.mkfifo(root / "pipe.go")
    r = cli("prepare", "--input", str(root), "--tokenizer", str(tokenizer_dir), "--out", str(tmp_path / "d"), "--strict")
    assert r.returncode == 2
    assert f"{root / 'pipe.go'}: not_regular_file: a FIFO" in r.stderr and "--strict" in r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "d").exists() and not list(tmp_path.glob(".d.*"))


def test_cli_refuses_a_fifo_given_as_a_source(tmp_path, code_corpus, tokenizer_dir):
    os.mkfifo(tmp_path / "pipe.jsonl")
    r = cli("prepare", "--input", str(code_corpus), str(tmp_path / "pipe.jsonl"), "--tokenizer", str(tokenizer_dir),
            "--out", str(tmp_path / "d"))
    assert r.returncode == 2
    assert f"input '{tmp_path / 'pipe.jsonl'}' is a FIFO (named pipe)" in r.stderr and "Traceback" not in r.stderr


# -- the same rules, in process (nothing here can block) ----------------------------------------------------

def test_sources_given_directly_are_checked_before_any_work(tmp_path):
    os.mkfifo(tmp_path / "pipe.txt")
    (tmp_path / "zero.txt").symlink_to("/dev/zero")
    (tmp_path / "loop.txt").symlink_to("loop.txt")
    (tmp_path / "gone.txt").symlink_to(tmp_path / "missing.txt")
    for name, what in [("pipe.txt", "is a FIFO"), ("zero.txt", "is a character device"), ("loop.txt", "symlink loop"),
                       ("gone.txt", "broken symlink"), ("nope.txt", "does not exist")]:
        with pytest.raises(CorpusError, match=what) as e:
            check_sources([str(tmp_path / name)])
        assert str(tmp_path / name) in str(e.value)


def test_unreadable_file_and_directory_are_counted(tmp_path, monkeypatch):
    """Root can read a chmod 000 file, so the open and the listing are made to fail as they would for others."""
    root = tmp_path / "tree"
    (root / "locked").mkdir(parents=True)
    (root / "good.py").write_text(GOOD)
    (root / "secret.py").write_text("secret = 1\n")
    (root / "locked" / "hidden.py").write_text("hidden = 1\n")
    secret, locked = str(root / "secret.py"), str(root / "locked")
    real_open, real_scandir = os.open, os.scandir

    def fake_open(path, *a, **k):
        if str(path) == secret:
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *a, **k)

    def fake_scandir(path="."):
        if str(path) == locked:
            raise PermissionError(13, "Permission denied", str(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "open", fake_open)
    monkeypatch.setattr(os, "scandir", fake_scandir)
    stats = CorpusStats()
    docs = [d.text for d in iter_documents([str(root)], CorpusOptions(), stats)]
    assert docs == [GOOD] and stats.skipped == {"unreadable": 2}
    with pytest.raises(CorpusError, match=f"{secret}: unreadable: Permission denied"):
        list(iter_documents([str(root)], CorpusOptions(strict=True), CorpusStats()))
    (root / "secret.py").unlink()
    with pytest.raises(CorpusError, match=f"{locked}: unreadable: directory not listed"):
        list(iter_documents([str(root)], CorpusOptions(strict=True), CorpusStats()))


def test_truncated_gz_keeps_the_records_before_the_cut(tmp_path):
    path = tmp_path / "cut.jsonl.gz"
    records = jsonl_gz(path, 3000)
    truncate(path, 0.5)
    stats = CorpusStats()
    docs = [d.text for d in iter_documents([str(path)], CorpusOptions(), stats)]
    assert 0 < len(docs) < len(records) and docs == records[:len(docs)]
    assert stats.skipped == {"corrupt_compressed": 1} and stats.examples["corrupt_compressed"] == str(path)


def test_directory_symlinks_are_not_followed(tmp_path):
    root = tmp_path / "tree"
    (root / "a").mkdir(parents=True)
    (root / "a" / "good.py").write_text(GOOD)
    (root / "a" / "loop").symlink_to("..")
    (root / "b").symlink_to("a")
    (root / "vendor").symlink_to("a")  # vendored anyway: not counted as a symlink
    stats = CorpusStats()
    docs = [d.text for d in iter_documents([str(root)], CorpusOptions(), stats)]
    assert docs == [GOOD] and stats.skipped == {"symlinked_dir": 2}
    # The target given as its own input is read (the top of a walk may be a symlink).
    assert [d.text for d in iter_documents([str(root / "b")], CorpusOptions(dedup="none"), CorpusStats())] == [GOOD]


# -- staging directories left by killed writers -------------------------------------------------------------

@pytest.fixture
def pids():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # reaped: its PID names no process now
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield dead.pid, live.pid
    live.kill()
    live.wait()


def test_staging_dir_removes_leftovers_of_dead_processes_only(tmp_path, pids):
    dead, live = pids
    out = tmp_path / "data"
    out.mkdir()
    (out / "meta.json").write_text("{}")
    made = {}
    for key, name in [("dead_tmp", f".data.tmp-{dead}"), ("dead_old", f".data.old-{dead}"),
                      ("dead_ckpt", f".step_000100.tmp-{dead}"), ("live_tmp", f".data.tmp-{live}"),
                      ("live_old", f".data.old-{live}"), ("parent_tmp", f".data.tmp-{os.getppid()}"),
                      ("not_ours", f"data.tmp-{dead}"), ("not_pid", ".data.tmp-abc")]:
        made[key] = tmp_path / name
        made[key].mkdir()
        (made[key] / "part.bin").write_bytes(b"x" * 100)
    (tmp_path / f".file.tmp-{dead}").write_text("a file, not a staging directory")

    tmp = atomic.staging_dir(out)
    assert tmp == tmp_path / f".data.tmp-{os.getpid()}" and tmp.is_dir() and not any(tmp.iterdir())
    gone = {k for k, p in made.items() if not p.exists()}
    assert gone == {"dead_tmp", "dead_old", "dead_ckpt"}
    assert (out / "meta.json").exists() and (tmp_path / f".file.tmp-{dead}").exists()


def test_stale_old_copy_is_restored_when_its_target_is_missing(tmp_path, pids):
    """Killed between publish's two renames: `.NAME.old-PID` is the only complete copy of NAME."""
    dead, _ = pids
    old = tmp_path / f".data.old-{dead}"
    old.mkdir()
    (old / "meta.json").write_text('{"complete": true}')
    (tmp_path / f".data.tmp-{dead}").mkdir()
    atomic.staging_dir(tmp_path / "other")
    assert json.loads((tmp_path / "data" / "meta.json").read_text()) == {"complete": True}
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".other.tmp-{os.getpid()}", "data"]


def test_publish_kill_during_delete_leaves_only_garbage(tmp_path, monkeypatch):
    out = tmp_path / "data"
    out.mkdir()
    (out / "v").write_text("1")
    tmp = atomic.staging_dir(out)
    (tmp / "v").write_text("2")

    def killed(path, *a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(atomic.shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        atomic.publish(tmp, out)
    assert (out / "v").read_text() == "2"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == [tmp.name]  # a .tmp-, never an .old-
    monkeypatch.undo()
    atomic.publish(atomic.staging_dir(out), out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]


def test_prepare_cleans_a_killed_prepare(tmp_path, pids, code_corpus, tokenizer_dir):
    from codeforge.data.shards import prepare
    dead, live = pids
    (tmp_path / f".shards.tmp-{dead}").mkdir()
    (tmp_path / f".shards.tmp-{dead}" / "train_000000.bin").write_bytes(b"\0" * 1000)
    (tmp_path / f".shards.tmp-{live}").mkdir()  # a prepare still running elsewhere: left alone
    prepare([str(code_corpus / "pkg0")], tokenizer_dir, tmp_path / "shards", CorpusOptions(languages=["go"]),
            log=lambda *a: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".shards.tmp-{live}", "shards"]


def test_chat_reader_counts_hostile_files_and_keeps_the_rest(tmp_path):
    from codeforge.chat import read_conversations
    from codeforge.corpus import CorpusStats
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    d = tmp_path / "chats"
    d.mkdir()
    (d / "a.jsonl").write_text(json.dumps(good) + "\n")
    (d / "b.jsonl.gz").write_bytes(b"this is not gzip\n")
    os.mkfifo(d / "c.jsonl")
    stats = CorpusStats()
    got = list(read_conversations([str(d)], stats))
    assert [m for m, _, _ in got] == [good["messages"]]
    assert stats.skipped["corrupt_compressed"] == 1 and stats.skipped["not_regular_file"] == 1
    with pytest.raises(CorpusError, match="b.jsonl.gz"):
        list(read_conversations([str(d)], CorpusStats(), strict=True))
