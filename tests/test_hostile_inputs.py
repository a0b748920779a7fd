"""Hostile inputs lose nothing (issue 9): FIFOs, devices, sockets, broken and looping symlinks, unreadable
files and damaged compressed files are skipped and counted by reason (or refused under --strict, naming the
path) while the rest of the corpus is prepared; a killed writer's staging directories are cleaned up later.
Small hostile checkpoints and Hugging Face directories cost no large memory, time or secrets: a config that
declares more than its weights hold, a model bigger than the memory there is, FIFOs, links out of the
directory, values out of range and garbage weights are each one error line naming the file and the field.

Anything that could hang or read forever runs in a subprocess with a timeout, so a regression fails the test
instead of blocking the suite."""

from __future__ import annotations

import gzip
import json
import os
import random
import shutil
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from codeforge import atomic
from codeforge.corpus import (REASON_WORDS, CorpusError, CorpusOptions, CorpusStats, check_sources,
                              iter_documents)
from conftest import make_go_file, make_py_file

TIMEOUT = 60
GOOD = "def good():\n    return 1\n"


def _bounded() -> None:
    """In the child: a regression that reads /dev/zero fails at 8 GiB of address space,
    not by exhausting the host."""
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
    opts = CorpusOptions(strict=sys.argv[2] == "1")
    docs = [d.text for d in iter_documents(json.loads(sys.argv[1]), opts, stats)]
    print(json.dumps({"docs": docs, "skipped": dict(stats.skipped)}))
except CorpusError as e:
    print(json.dumps({"error": str(e)}))
"""


def run_corpus(sources: list[Path], strict: bool) -> dict:
    r = subprocess.run([sys.executable, "-c", RUN_CORPUS, json.dumps([str(s) for s in sources]),
                        str(int(strict))],
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

    r = cli("tokenizer", "train", "--input", *hostile["sources"], "--vocab-size", "300", "--out",
            str(tmp_path / "tok"))
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
    # the part before the cut
    assert 0 < len(kept) < len(hostile["records"]) and kept == hostile["records"][:len(kept)]
    assert not list(tmp_path.glob(".data.*"))  # no staging left behind


def test_cli_strict_refuses_a_hostile_entry_naming_it(tmp_path, code_corpus, tokenizer_dir):
    root = tmp_path / "tree"
    root.mkdir()
    (root / "good.py").write_text(GOOD)
    os.mkfifo(root / "pipe.go")
    r = cli("prepare", "--input", str(root), "--tokenizer", str(tokenizer_dir), "--out", str(tmp_path / "d"),
            "--strict")
    assert r.returncode == 2
    assert f"{root / 'pipe.go'}: not_regular_file: a FIFO" in r.stderr and "--strict" in r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "d").exists() and not list(tmp_path.glob(".d.*"))


def test_cli_refuses_a_fifo_given_as_a_source(tmp_path, code_corpus, tokenizer_dir):
    os.mkfifo(tmp_path / "pipe.jsonl")
    r = cli("prepare", "--input", str(code_corpus), str(tmp_path / "pipe.jsonl"), "--tokenizer",
            str(tokenizer_dir), "--out", str(tmp_path / "d"))
    assert r.returncode == 2
    assert (
        f"input '{tmp_path / 'pipe.jsonl'}' is a FIFO (named pipe)" in r.stderr
        and "Traceback" not in r.stderr
    )


# -- the same rules, in process (nothing here can block) ----------------------------------------------------

def test_sources_given_directly_are_checked_before_any_work(tmp_path):
    os.mkfifo(tmp_path / "pipe.txt")
    (tmp_path / "zero.txt").symlink_to("/dev/zero")
    (tmp_path / "loop.txt").symlink_to("loop.txt")
    (tmp_path / "gone.txt").symlink_to(tmp_path / "missing.txt")
    for name, what in [("pipe.txt", "is a FIFO"), ("zero.txt", "is a character device"),
                       ("loop.txt", "symlink loop"),
                       ("gone.txt", "broken symlink"), ("nope.txt", "does not exist")]:
        with pytest.raises(CorpusError, match=what) as e:
            check_sources([str(tmp_path / name)])
        assert str(tmp_path / name) in str(e.value)


def test_unreadable_file_and_directory_are_counted(tmp_path, monkeypatch):
    """Root can read a chmod 000 file, so the open and the listing are made to
    fail as they would for others."""
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
    assert [d.text
            for d in iter_documents([str(root / "b")], CorpusOptions(dedup="none"), CorpusStats())] == [GOOD]


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
    # a .tmp-, never an .old-
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == [tmp.name]
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


# -- hostile checkpoints and model directories -------------------------------------------------------------
# A checkpoint's manifest proves only that its files are the ones it lists: anyone can edit config.json and
# hash the files again. So a declared model is checked against the weights' header and the memory there is,
# before anything is built; every file is a regular one inside the checkpoint; every value is in its range.

CAP = 3 << 30  # the address space a command may take here: without the checks it hit this, not the machine's


def _capped() -> None:
    import resource
    resource.setrlimit(resource.RLIMIT_AS, (CAP, CAP))


def capped_cli(*args: str, timeout: int = TIMEOUT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "codeforge", *args], capture_output=True, text=True,
                          timeout=timeout, preexec_fn=_capped, stdin=subprocess.DEVNULL)


def error_line(stderr: str) -> str:
    """The one error line a refused command prints (warnings may come before it; a traceback may not)."""
    assert "Traceback" not in stderr, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("error: "), stderr[-3000:]
    return last


def tiny_model_cfg(tok_dir: Path):
    from codeforge.models.gpt import GPTConfig
    from codeforge.tokenizer import CodeTokenizer
    tok = CodeTokenizer.load(tok_dir)
    return GPTConfig(vocab_size=64 * -(-tok.vocab_size // 64), block_size=64, n_layer=2, n_head=2,
                     n_embd=32), tok


@pytest.fixture
def tiny_run(tmp_path, tokenizer_dir) -> tuple[Path, Path]:
    """(run, its one checkpoint) of a tiny random GPT, with the tokenizer, as training writes them."""
    from codeforge.checkpoint import save_checkpoint
    from codeforge.models import build_model
    m, tok = tiny_model_cfg(tokenizer_dir)
    run = tmp_path / "run"
    ck = save_checkpoint(run, 1, build_model(m),
                         {"model": m.to_dict(), "train": {}, "tokenizer_hash": tok.hash},
                         {}, {"tokenizer": tokenizer_dir}, keep_last=1)
    return run, ck


def rehash(ck: Path) -> None:
    """What anyone who edits a checkpoint can do: write the manifest again over the edited files."""
    from codeforge.checkpoint.store import MANIFEST, step_of, write_manifest
    (ck / MANIFEST).unlink(missing_ok=True)
    write_manifest(ck, step_of(ck))


def edit_model_config(ck: Path, manifest: bool = True, **model) -> None:
    cfg = json.loads((ck / "config.json").read_text())
    cfg["model"].update(model)
    (ck / "config.json").write_text(json.dumps(cfg))
    rehash(ck) if manifest else (ck / "manifest.json").unlink()


BIG = {"24x4096": dict(n_layer=24, n_embd=4096, n_head=32),
       "range-maxima": dict(n_layer=256, n_embd=16_384, n_head=256, vocab_size=200_000, block_size=131_072,
                            ffn_hidden=1 << 20)}


@pytest.mark.parametrize("big,command", [("24x4096", "generate"), ("24x4096", "export"), ("24x4096", "train"),
                                         ("range-maxima", "generate")])
def test_declared_model_the_weights_do_not_hold_is_refused_before_it_is_built(
    tiny_run, tmp_path, big, command, data_dir
):
    """Before: the model was built first (24 x 4096: 19 GB of float32; the maxima: 36 TB) and the command
    allocated until killed, here until the 3 GiB cap (MemoryError traceback)."""
    run, ck = tiny_run
    edit_model_config(ck, **BIG[big])
    args = {"generate": ["generate", "--run", str(run), "--prompt", "x", "--max-new-tokens", "2"],
            "export": ["export", "--run", str(run), "--format", "hf", "--out", str(tmp_path / "hf"),
                       "--no-verify"],
            "train": ["train", "--data", str(data_dir), "--out", str(tmp_path / "ft"), "--init-from",
                      str(run),
                      "--max-iters", "1", "--device", "cpu", "--no-progress", "--no-tensorboard"]}[command]
    line = error_line(capped_cli(*args).stderr)
    assert str(ck / "model.safetensors") in line and "config.json" in line and "model.n_embd" in line
    assert "use another checkpoint" in line
    assert not (tmp_path / "hf").exists() and not (tmp_path / "ft" / "checkpoints").exists()


def sparse_weights(path: Path, m) -> int:
    """A model.safetensors whose header holds every tensor of model config `m` at its true size, the data a
    hole in a sparse file: a few KB on disk that say the model is real. Returns its parameter count."""
    import torch
    from codeforge.models import build_model
    with torch.device("meta"):
        model = build_model(m)
    header, at, seen = {}, 0, set()
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in seen:
            continue
        seen.add(id(t))
        n = t.numel() * 4
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [at, at + n]}
        at += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        f.truncate(8 + len(raw) + at)
    return at // 4


def test_model_bigger_than_the_memory_there_is_is_refused_with_the_numbers(tiny_run):
    """Config and weights agree (a checkpoint without a manifest, 607M parameters in a sparse file): it is
    refused for the memory it would take, here the 3 GiB address-space cap. Before: built until the cap."""
    run, ck = tiny_run
    m, _ = tiny_model_cfg(ck / "tokenizer")
    big = type(m)(**{**m.to_dict(), "n_layer": 12, "n_embd": 2048, "n_head": 16, "n_kv_head": 16,
                     "ffn_hidden": 8192})
    edit_model_config(ck, manifest=False, **big.to_dict())
    params = sparse_weights(ck / "model.safetensors", big)
    line = error_line(capped_cli("generate", "--run", str(run), "--prompt", "x").stderr)
    assert str(ck / "config.json") in line and "model.n_layer=12" in line and "model.n_embd=2048" in line
    assert f"{params:,} parameters" in line and "needs about" in line and "RLIMIT_AS" in line


@pytest.mark.parametrize("where",
                         ["tokenizer/tokenizer.json", "manifest.json", "config.json", "model.safetensors"])
def test_a_fifo_in_a_checkpoint_is_refused_not_waited_on(tiny_run, where):
    """Before: opening a FIFO for reading waits for a writer, forever (the test's timeout)."""
    run, ck = tiny_run
    if where != "manifest.json":
        (ck / "manifest.json").unlink()  # older checkpoints have none: only the files themselves can tell
    (ck / where).unlink()
    os.mkfifo(ck / where)
    line = error_line(capped_cli("generate", "--run", str(run), "--prompt", "x").stderr)
    assert f"{where} is a FIFO (named pipe), not a regular file" in line and "JSON" not in line


def test_a_fifo_pointer_is_passed_over(tiny_run):
    """`latest` is a hint: a FIFO in its place is unreadable like a missing one,
    and the newest step is used."""
    run, ck = tiny_run
    (run / "checkpoints" / "latest").unlink()
    os.mkfifo(run / "checkpoints" / "latest")
    r = capped_cli("generate", "--run", str(run), "--prompt", "x", "--max-new-tokens", "2")
    assert r.returncode == 0, r.stderr[-3000:]


def test_a_link_out_of_a_checkpoint_is_refused(tiny_run, tmp_path, capsys):
    """A tokenizer file that is a link to a file elsewhere would be read, and copied into every export."""
    run, ck = tiny_run
    secret = tmp_path / "secret.json"
    secret.write_text('{"token": "s3cret"}')
    (ck / "tokenizer" / "tokenizer_config.json").unlink(missing_ok=True)
    (ck / "tokenizer" / "tokenizer_config.json").symlink_to(secret)
    rehash(ck)
    from codeforge.cli import main
    assert main(["export", "--run", str(run), "--format", "hf", "--out", str(tmp_path / "hf"),
                 "--no-verify"]) == 2
    line = error_line(capsys.readouterr().err)
    assert f"{ck / 'tokenizer' / 'tokenizer_config.json'} is a link to {secret}, outside {ck}" in line
    assert not (tmp_path / "hf").exists()


BAD_MODEL = {  # config.json's model section -> words of the error
    "n_layer=0": ({"n_layer": 0}, "model.n_layer = 0 is out of range [1, 256]"),
    "n_layer=-5": ({"n_layer": -5}, "model.n_layer = -5 is out of range [1, 256]"),
    "n_embd=-1": ({"n_embd": -1}, "model.n_embd = -1 is out of range [16, 16384]"),
    "n_embd='x'": ({"n_embd": "x"}, "model.n_embd = 'x' is not an integer"),
    "n_head=null": ({"n_head": None}, "model.n_head = None is not an integer"),
    "n_layer=1e18": ({"n_layer": 1e18}, "model.n_layer = 1e+18 is not an integer"),
    "n_head=3": ({"n_head": 3}, "model.n_embd = 32 is not divisible by model.n_head = 3"),
    "bias='yes'": ({"bias": "yes"}, "model.bias = 'yes' is not true or false"),
}


@pytest.mark.parametrize("case", list(BAD_MODEL))
def test_a_model_config_out_of_range_gets_one_line(tiny_run, capsys, case):
    """Before: tracebacks (TypeError, RuntimeError, ValueError) from deep inside the model's construction."""
    from codeforge.cli import main
    run, ck = tiny_run
    change, words = BAD_MODEL[case]
    edit_model_config(ck, manifest=case != "n_layer=-5", **change)
    assert main(["generate", "--run", str(run), "--prompt", "x", "--max-new-tokens", "2"]) == 2
    line = error_line(capsys.readouterr().err)
    assert f"{ck / 'config.json'}: {words}" in line and "use another checkpoint" in line


@pytest.mark.parametrize("text,words", [("[1, 2]", "is a list, not an object"),
                                        ('{"model": [1]}', "model is a list, not an object"),
                                        ('{"train": {}}', "has no model section"),
                                        ("{no json", "is not JSON")])
def test_a_config_json_that_is_no_config_gets_one_line(tiny_run, capsys, text, words):
    from codeforge.cli import main
    run, ck = tiny_run
    (ck / "config.json").write_text(text)
    rehash(ck)
    assert main(["generate", "--run", str(run), "--prompt", "x"]) == 2
    line = error_line(capsys.readouterr().err)
    assert str(ck / "config.json") in line and words in line


def garbage_weights(kind: str) -> bytes:
    header = json.dumps({"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 64]}}).encode()
    return {"random": random.Random(0).randbytes(4096),
            "header longer than the file": (10**6).to_bytes(8, "little") + b"{}",
            "header not JSON": (10).to_bytes(8, "little") + b"not json!!",
            "header a list": (2).to_bytes(8, "little") + b"[]",
            "data beyond the file": len(header).to_bytes(8, "little") + header + b"\0" * 16,
            "shorter than 8 bytes": b"\1\2"}[kind]


GARBAGE_WORDS = {"random": "header length", "header longer than the file": "header length 1,000,000",
                 "header not JSON": "header is not JSON", "header a list": "header is not a JSON object",
                 "data beyond the file": "w: data_offsets [0, 64]", "shorter than 8 bytes": "shorter than"}


@pytest.mark.parametrize("kind", list(GARBAGE_WORDS))
def test_garbage_weights_in_a_checkpoint_get_one_line(tiny_run, capsys, kind):
    """A checkpoint's weights were already refused by safetensors' own message, in one line (this pins it and
    the field named); the same files handed to `import --hf` were a traceback (the test below)."""
    from codeforge.cli import main
    run, ck = tiny_run
    (ck / "model.safetensors").write_bytes(garbage_weights(kind))
    rehash(ck)
    assert main(["generate", "--run", str(run), "--prompt", "x"]) == 2
    line = error_line(capsys.readouterr().err)
    assert str(ck / "model.safetensors") in line and GARBAGE_WORDS[kind] in line


# -- import --hf --------------------------------------------------------------------------------------------

@pytest.fixture
def hf_dir(tiny_run, tmp_path) -> Path:
    """A Hugging Face model directory (Llama family) written by `codeforge export`."""
    from codeforge.cli import main
    run, ck = tiny_run
    cfg = json.loads((ck / "config.json").read_text())
    cfg["model"].update(pos="rope", norm="rmsnorm", mlp="swiglu", bias=False, ffn_hidden=96)
    from codeforge.checkpoint import save_checkpoint
    from codeforge.models import build_model
    from codeforge.models.gpt import GPTConfig
    m = GPTConfig(**cfg["model"])
    llama = tmp_path / "llama-run"
    save_checkpoint(llama, 1, build_model(m), {**cfg, "model": m.to_dict()}, {},
                    {"tokenizer": ck / "tokenizer"}, keep_last=1)
    out = tmp_path / "hf"
    assert main(["export", "--run", str(llama), "--format", "hf", "--out", str(out), "--no-verify"]) == 0
    return out


def test_import_of_a_well_formed_directory_still_works(hf_dir, tmp_path):
    from codeforge.cli import main
    assert main(["import", "--hf", str(hf_dir), "--out", str(tmp_path / "imp"), "--no-verify"]) == 0


@pytest.mark.parametrize("name", ["special_tokens_map.json", "tokenizer_config.json", "model.safetensors"])
def test_import_refuses_a_link_that_leaves_the_model_directory(hf_dir, tmp_path, capsys, name):
    """Before: the file the link names was copied into the run, and into every checkpoint and export of it."""
    from codeforge.cli import main
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    secret = outside / name
    shutil.move(hf_dir / name, secret)
    if name.endswith(".json"):
        secret.write_text(json.dumps({"pad_token": "AWS_SECRET_ACCESS_KEY=abc"}))
    (hf_dir / name).symlink_to(secret)
    assert main(["import", "--hf", str(hf_dir), "--out", str(tmp_path / "imp"), "--no-verify"]) == 2
    line = error_line(capsys.readouterr().err)
    assert f"{hf_dir / name} is a link to {secret}, outside {hf_dir}" in line
    assert not (tmp_path / "imp").exists()


def test_import_follows_links_of_the_hugging_face_cache(hf_dir, tmp_path):
    """The hub cache keeps a model's files in blobs/ and links them from
    snapshots/REV/: that is not leaving."""
    from codeforge.cli import main
    repo = tmp_path / "hub" / "models--someone--tiny"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "0123abc"
    snap.mkdir(parents=True)
    for i, f in enumerate(sorted(hf_dir.iterdir())):
        shutil.move(f, repo / "blobs" / f"blob{i}")
        (snap / f.name).symlink_to(Path("..") / ".." / "blobs" / f"blob{i}")
    assert main(["import", "--hf", str(snap), "--out", str(tmp_path / "imp"), "--no-verify"]) == 0


def edit_hf_config(d: Path, **change) -> None:
    c = json.loads((d / "config.json").read_text())
    c.update(change)
    (d / "config.json").write_text(json.dumps(c))


BAD_HF = {  # config.json changes -> words of the error
    "num_hidden_layers=1e6": ({"num_hidden_layers": 10**6},
                              "num_hidden_layers = 1000000 (codeforge's model.n_layer) "
                              "is out of range [1, 256]"),
    "hidden_size='x'": ({"hidden_size": "x"},
                        "hidden_size = 'x' (codeforge's model.n_embd) is not an integer"),
    "num_attention_heads=0": ({"num_attention_heads": 0},
                              "num_attention_heads = 0 (codeforge's model.n_head) is out "
                              "of range [1, 256]"),
    "vocab_size=null": ({"vocab_size": None},
                        "vocab_size = None (codeforge's model.vocab_size) is not an integer"),
    "intermediate_size=-3": ({"intermediate_size": -3},
                             "intermediate_size = -3 (codeforge's model.ffn_hidden) is out "
                             "of range"),
}


@pytest.mark.parametrize("case", list(BAD_HF))
def test_import_checks_the_config_ranges_before_building(hf_dir, tmp_path, capsys, case):
    """Before: 10^6 layers were built (on the meta device: minutes of CPU, here the 3 GiB cap); strings, nulls
    and zeros were tracebacks (TypeError, ZeroDivisionError)."""
    from codeforge.cli import main
    change, words = BAD_HF[case]
    edit_hf_config(hf_dir, **change)
    args = ["import", "--hf", str(hf_dir), "--out", str(tmp_path / "imp"), "--no-verify"]
    if case == "num_hidden_layers=1e6":  # the one that could take the machine: in a capped child
        line = error_line(capped_cli(*args).stderr)
    else:
        assert main(args) == 2
        line = error_line(capsys.readouterr().err)
    assert f"{hf_dir / 'config.json'}: {words}" in line and not (tmp_path / "imp").exists()


@pytest.mark.parametrize("kind", ["random", "header not JSON", "data beyond the file"])
def test_import_of_garbage_weights_gets_one_line(hf_dir, tmp_path, capsys, kind):
    """Before: safetensors' own error escaped as a traceback."""
    from codeforge.cli import main
    (hf_dir / "model.safetensors").write_bytes(garbage_weights(kind))
    assert main(["import", "--hf", str(hf_dir), "--out", str(tmp_path / "imp"), "--no-verify"]) == 2
    line = error_line(capsys.readouterr().err)
    assert str(hf_dir / "model.safetensors") in line and GARBAGE_WORDS[kind] in line


@pytest.mark.parametrize("name", ["tokenizer.json", "special_tokens_map.json", "config.json"])
def test_import_refuses_a_fifo(hf_dir, tmp_path, name):
    """Before: tokenizer.json as a FIFO waited forever; special_tokens_map.json was a traceback."""
    (hf_dir / name).unlink()
    os.mkfifo(hf_dir / name)
    line = error_line(capped_cli("import", "--hf", str(hf_dir), "--out", str(tmp_path / "imp"),
                                 "--no-verify").stderr)
    assert f"{hf_dir / name} is a FIFO (named pipe), not a regular file" in line


def _model_configs():
    from codeforge.models.gpt import GPTConfig
    from codeforge.models.hrm import HRMConfig
    from codeforge.models.reward import RewardConfig
    small = dict(vocab_size=320, block_size=32, n_layer=2, n_head=4, n_embd=32)
    for pos in ("learned", "rope"):
        for norm in ("layernorm", "rmsnorm"):
            for mlp in ("gelu", "swiglu", "relu2"):
                for qk_norm in (False, True):
                    for bias in (False, True):
                        yield GPTConfig(**small, pos=pos, norm=norm, mlp=mlp, qk_norm=qk_norm, bias=bias,
                                        tie_embeddings=bias, n_kv_head=2 if qk_norm else 4)
                yield HRMConfig(vocab_size=320, n_embd=32, n_head=4, planner_layers=2, generator_layers=1,
                                refiner_layers=1, plan_len=16, code_len=24, pos=pos, norm=norm, mlp=mlp,
                                qk_norm=mlp == "gelu", bias=norm == "layernorm")
        yield RewardConfig(**small, pos=pos, tie_embeddings=pos == "rope")


def test_the_shapes_a_model_declares_are_those_it_builds():
    """The vet compares a weights file with models.state_shapes (the config alone, nothing built): equal to
    the built model's state dict, names, shapes and tied tensors, for every architecture and option."""
    from codeforge.checkpoint.guard import declared_shapes, model_shapes
    from codeforge.models import build_model
    for cfg in _model_configs():
        model = build_model(cfg)
        shapes, groups = model_shapes(model)
        declared, declared_groups, params = declared_shapes(cfg)
        assert declared == shapes, cfg
        assert sorted(map(sorted, declared_groups)) == sorted(map(sorted, groups)), cfg
        assert params == sum(p.numel() for p in model.parameters()), cfg


def test_a_checkpoint_linked_from_outside_the_run_is_not_followed(tmp_path, data_dir):
    """Found in the second hostile review: RUN/checkpoints/step_N as a link to a
    directory elsewhere was loaded
    (whatever it names came into the run, its exports and its resumes). Now such a step is passed over like
    a damaged one, and said; RUN/checkpoints itself may still be a link (to a bigger disk)."""
    import shutil

    from codeforge.checkpoint import CheckpointError, find_checkpoint
    from codeforge.cli import main
    run = tmp_path / "run"
    assert main(["train", "--data", str(data_dir), "--out", str(run), "--n-layer", "1", "--n-head", "2",
                 "--n-embd", "32", "--block-size", "32", "--max-iters", "4", "--save-every", "2", "--device",
                 "cpu", "--no-progress", "--eval-every", "0"]) == 0
    ckpts = run / "checkpoints"
    newest = sorted(ckpts.glob("step_*"))[-1]
    assert find_checkpoint(run) == newest
    elsewhere = tmp_path / "elsewhere" / newest.name
    elsewhere.parent.mkdir()
    shutil.move(str(newest), elsewhere)
    newest.symlink_to(elsewhere, target_is_directory=True)
    said = []
    got = find_checkpoint(run, log=said.append)
    assert got != newest and got.name == "step_000002", got  # the link is passed over, the step before taken
    assert "outside the run's" in " ".join(said), said
    with pytest.raises(CheckpointError, match="outside the run's"):
        find_checkpoint(run, "final")  # final points at the link: refused, never swapped
    # the whole checkpoints folder on another disk, linked in: still the run's own
    newest.unlink()
    shutil.move(str(elsewhere), newest)
    moved = tmp_path / "bigdisk"
    shutil.move(str(ckpts), moved)
    ckpts.symlink_to(moved, target_is_directory=True)
    assert find_checkpoint(run).name == newest.name
