"""Small hostile files must not cost large memory, time or secrets (the issue of that name).

A few kilobytes on disk can hold hundreds of megabytes once read: one JSONL line of 'a's without a newline
compressed by zstd (32,000:1) or gzip (1,000:1), one parquet value compressed in its page, or one value a
dictionary page repeats for every row. Each is read bounded here: the over-long record is skipped and
counted (`oversized_record`) without ever being held whole, and the good records around it are kept.
Memory is measured in a child process (peak RSS as VmHWM, and an address-space limit so a regression fails
the test instead of taking the machine). Also: a file name that is not UTF-8 must not abort `prepare`, and a
symlink inside a corpus tree that points out of it must not be read (it could name ~/.ssh/id_rsa).
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import STDLIB, make_py_file

TIMEOUT = 120
PEAK_MB = 500  # the bound on a command's peak memory for any of these inputs
HUGE = 300 << 20  # bytes of one over-long record: the old readers held it 4-6 times over
GOOD_PAIR = {"prompt": "add", "chosen": "a + b", "rejected": "a - b"}
GOOD_CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
GOOD_TEXT = {"text": "ok = 1\n"}


def _limit_memory() -> None:
    """In the child: 2 GiB of address space, so an unbounded read fails fast
    instead of exhausting the host."""
    import resource
    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))


CHILD = r"""
import json, sys
from collections import Counter
spec = json.loads(sys.argv[1])
out = {}
try:
    if spec["reader"] == "corpus":
        from codeforge.corpus import CorpusOptions, CorpusStats, iter_documents
        stats = CorpusStats()
        opts = CorpusOptions(**spec.get("opts", {}))
        out["kept"] = [d.text for d in iter_documents(spec["paths"], opts, stats)]
        out["skipped"] = dict(stats.skipped)
    elif spec["reader"] == "chat":
        from codeforge.chat import read_conversations
        from codeforge.corpus import CorpusStats
        stats = CorpusStats()
        out["kept"] = [m for m, _, _ in read_conversations(spec["paths"], stats)]
        out["skipped"] = dict(stats.skipped)
    elif spec["reader"] == "prepare":
        from codeforge.corpus import CorpusOptions
        from codeforge.data.shards import prepare
        meta = prepare(spec["paths"][:-2], spec["paths"][-2], spec["paths"][-1],
                       CorpusOptions(**spec.get("opts", {})), log=lambda *a: None)
        out["kept"], out["skipped"] = meta["documents"], meta["skipped"]
    elif spec["reader"] == "pairs":
        from codeforge.mining.pairs import PairError, load_pairs
        skipped = Counter()
        out["kept"] = [r["chosen"] for r in load_pairs(spec["paths"][0], skipped=skipped)]
        out["skipped"] = dict(skipped)
        try:
            load_pairs(spec["paths"][0])
        except PairError as e:
            out["error"] = str(e)
except MemoryError:
    out["memory_error"] = True
# VmHWM: this program's peak RSS. Not ru_maxrss: with a preexec_fn the child is forked, and ru_maxrss keeps
# the RSS it had before exec, that of the whole pytest process.
out["peak_mb"] = int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0]) / 1024
print(json.dumps(out))
"""


def run_reader(reader: str, paths: list[Path], **opts) -> dict:
    """reader: corpus, chat, pairs, or prepare (paths: the sources, then the tokenizer and the output)."""
    spec = {"reader": reader, "paths": [str(p) for p in paths], "opts": opts}
    r = subprocess.run([sys.executable, "-c", CHILD, json.dumps(spec)], capture_output=True, text=True,
                       timeout=TIMEOUT, preexec_fn=_limit_memory)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert not out.get("memory_error"), ("ran out of the child's 2 GiB address space (peak "
                                         f"{out['peak_mb']:.0f} MB)")
    return out


def giant_line_file(path: Path, prefix: bytes, good: dict) -> Path:
    """`prefix` then HUGE bytes of 'a' with no newline, then a newline and one good record, compressed by
    the file's extension: a few kilobytes (.zst) or about a megabyte (.gz) on disk."""
    if path.suffix == ".zst":
        import zstandard
        f = zstandard.ZstdCompressor(level=3).stream_writer(open(path, "wb"))
    else:
        f = gzip.open(path, "wb", compresslevel=1)
    with f:
        f.write(prefix)
        chunk = b"a" * (1 << 20)
        for _ in range(HUGE // len(chunk)):
            f.write(chunk)
        f.write(b'"}\n' + json.dumps(good).encode() + b"\n")
    assert path.stat().st_size < 2 << 20
    return path


# -- 1. one over-long line, compressed: corpus, chat and pair readers --------------------------------------

@pytest.mark.parametrize("ext", [".zst", ".gz"])
def test_corpus_jsonl_giant_line_is_skipped_without_holding_it(tmp_path, ext):
    path = giant_line_file(tmp_path / f"d.jsonl{ext}", b'{"text": "', GOOD_TEXT)
    out = run_reader("corpus", [path])
    assert out["peak_mb"] < PEAK_MB
    assert out["kept"] == [GOOD_TEXT["text"]]
    assert out["skipped"] == {"oversized_record": 1}


def test_chat_jsonl_giant_line_is_skipped_without_holding_it(tmp_path):
    path = giant_line_file(tmp_path / "c.jsonl.zst", b'{"messages": [{"role": "user", "content": "',
                           GOOD_CHAT)
    out = run_reader("chat", [path])
    assert out["peak_mb"] < PEAK_MB
    assert out["kept"] == [GOOD_CHAT["messages"]]
    assert out["skipped"] == {"oversized_record": 1}


def test_pair_jsonl_giant_line_is_counted_or_refused_naming_the_line(tmp_path):
    path = giant_line_file(tmp_path / "p.jsonl.zst", b'{"prompt": "x", "chosen": "', GOOD_PAIR)
    out = run_reader("pairs", [path])
    assert out["peak_mb"] < PEAK_MB
    assert out["kept"] == [GOOD_PAIR["chosen"]]
    assert out["skipped"] == {"oversized_record": 1}
    # the file, the line, the limit
    assert f"{path}: line 1: " in out["error"] and "characters" in out["error"]


def test_line_reader_keeps_lines_up_to_the_limit_and_counts_longer(tmp_path):
    """The boundary, in process: a line of exactly `limit` characters is kept whole, one more is not."""
    import io

    from codeforge.corpus import bounded_lines
    text = "x" * 10 + "\n" + "y" * 11 + "\n" + "z" * 25 + "\nlast" + "\r\n" + "w" * 11
    got = list(bounded_lines(io.StringIO(text, newline=None), 10))
    assert got == [(1, "x" * 10 + "\n"), (2, None), (3, None), (4, "last\n"), (5, None)]


def test_corpus_jsonl_record_of_max_file_bytes_escaped_is_kept(tmp_path):
    """The line limit never cuts a record whose text passes --max-file-bytes, however it is escaped."""
    text = "\U0001f600" * 1000  # 1,000 characters; 12,000 once JSON-escaped (two \\uXXXX each)
    (tmp_path / "e.jsonl").write_text(json.dumps({"text": text}) + "\n")
    out = run_reader("corpus", [tmp_path / "e.jsonl"], max_file_bytes=1000)
    assert out["kept"] == [text] and out["skipped"] == {}


# -- 1. parquet: one huge value, and one value a dictionary repeats ----------------------------------------

PARQUET_HUGE = r"""
import sys
import numpy as np, pyarrow as pa, pyarrow.parquet as pq
n = int(sys.argv[2])
data = pa.py_buffer(b"a" * n)
huge = pa.StringArray.from_buffers(1, pa.py_buffer(np.array([0, n], dtype=np.int32).tobytes()), data)
with pq.ParquetWriter(sys.argv[1], pa.schema([("text", pa.string())]), compression="zstd") as w:
    w.write_table(pa.table({"text": ["before = 1\n", "before = 2\n"]}))
    w.write_table(pa.table({"text": pa.concat_arrays([pa.array(["lost = 1\n"]), huge])}))
    w.write_table(pa.table({"text": ["after = 1\n"]}))
"""


def test_parquet_huge_value_skips_its_row_group_without_reading_it(tmp_path):
    path = tmp_path / "big.parquet"
    subprocess.run([sys.executable, "-c", PARQUET_HUGE, str(path), str(HUGE)], check=True, timeout=TIMEOUT)
    assert path.stat().st_size < 100_000
    out = run_reader("corpus", [path])
    assert out["kept"] == ["before = 1\n", "before = 2\n", "after = 1\n"]
    assert out["skipped"] == {"oversized_record": 2}  # the row group's two rows: its page is over the limit
    assert out["peak_mb"] < PEAK_MB


def test_parquet_dictionary_repeating_one_large_value_is_read_in_small_batches(tmp_path):
    """1,000 rows that all point at one 900 KB dictionary entry: a 1,024-row batch is 900 MB decoded (twice:
    Arrow's dense copy, then Python's). One long line, so the filters reject each row at once (minified)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    value = "b" * 900_000
    col = pa.DictionaryArray.from_arrays(pa.array([0] * 1000, pa.int32()), pa.array([value]))
    path = tmp_path / "dict.parquet"
    pq.write_table(pa.table({"text": col}), path, compression="zstd")
    assert path.stat().st_size < 100_000
    out = run_reader("corpus", [path])
    assert out["peak_mb"] < PEAK_MB
    assert out["kept"] == [] and out["skipped"] == {"minified": 1000}


@pytest.mark.parametrize("dictionary,version", [(True, "1.0"), (False, "1.0"), (True, "2.0"), (False, "2.0")])
def test_parquet_ordinary_file_reads_every_row(tmp_path, dictionary, version):
    """Many row groups and pages, dictionary or plain, v1 or v2 page headers, nulls: every row is read."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    texts = [f"row_{i} = {i}\n" if i % 7 else None for i in range(5000)]
    path = tmp_path / "ok.parquet"
    pq.write_table(pa.table({"id": list(range(5000)), "text": texts}), path, row_group_size=1200,
                   data_page_size=4096, use_dictionary=dictionary, data_page_version=version)
    out = run_reader("corpus", [path], dedup="none")
    assert out["kept"] == [t for t in texts if t]
    assert out["skipped"] == {"missing_field": texts.count(None)}


def test_parquet_pages_of_large_documents_are_read(tmp_path):
    """pyarrow's writer closes a page every 1,024 rows at the earliest: 20 KB documents make a 20 MB page,
    a page limit as low as the JSONL line limit (12 MB) would drop them."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    texts = [f"# {i}\n" + "x = 1\n" * 3400 for i in range(1100)]
    path = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"text": texts}), path)
    from codeforge.corpus import parquet_page_sizes
    meta = pq.ParquetFile(path).metadata
    with open(path, "rb") as f:
        assert max(parquet_page_sizes(f.fileno(), meta.row_group(0).column(0))) > 12 << 20
    out = run_reader("corpus", [path])
    assert out["kept"] == texts and out["skipped"] == {}


def test_prepare_encodes_large_documents_a_few_at_a_time(tmp_path, tokenizer_dir):
    """A 100 KB .jsonl.zst of 200 distinct 100 KB documents (zstd finds each in the one before): `prepare`
    encoded them as one 512-document batch, and the Rust tokenizer holds ~50-300 bytes per byte of text
    while encoding (1.0 GB peak here, 210 MB now; 512 documents of 900 KB took 20 GB). Batches close at
    1 MiB of text now."""
    import zstandard
    body = (STDLIB / "typing.py").read_text()[:100_000]
    lines = [json.dumps({"text": f"# document {i}\n" + body}) + "\n" for i in range(200)]
    path = tmp_path / "many.jsonl.zst"
    path.write_bytes(zstandard.ZstdCompressor(level=19).compress("".join(lines).encode()))
    assert path.stat().st_size < 200_000
    out = run_reader("prepare", [path, tokenizer_dir, tmp_path / "data"], val_fraction=0.0)
    assert out["peak_mb"] < PEAK_MB
    assert out["kept"] == 200


# -- 2. a file name that is not UTF-8 ----------------------------------------------------------------------

def test_prepare_and_tokenizer_train_take_a_file_name_that_is_not_utf8(tmp_path, tokenizer_dir):
    import random
    root = tmp_path / "tree"
    root.mkdir()
    good = make_py_file(random.Random(3), 3)
    odd = make_py_file(random.Random(4), 4)
    (root / "good.py").write_text(good)
    with open(os.path.join(os.fsencode(root), b"caf\xe9-\xff.py"), "wb") as f:  # latin-1 bytes, not UTF-8
        f.write(odd.encode())
    direct = os.path.join(os.fsencode(tmp_path), b"lone\xff.jsonl")
    with open(direct, "wb") as f:
        f.write(json.dumps(GOOD_TEXT).encode() + b"\n")
    inputs = [str(root), os.fsdecode(direct)]  # as Python hands a non-UTF-8 argv to the command
    data = tmp_path / "data"
    r = subprocess.run([sys.executable, "-m", "codeforge", "prepare", "--input", *inputs, "--tokenizer",
                        str(tokenizer_dir), "--out", str(data), "--val-fraction", "0"],
                       capture_output=True, timeout=TIMEOUT, preexec_fn=_limit_memory)
    assert r.returncode == 0, r.stderr.decode(errors="replace")[-2000:]
    from codeforge.data.shards import ShardSet
    from codeforge.tokenizer import CodeTokenizer
    tok, ss = CodeTokenizer.load(data / "tokenizer"), ShardSet(data, "train")
    assert sorted(tok.decode(ss.document(i)) for i in range(ss.documents)) == sorted(
        [good, odd, GOOD_TEXT["text"]]
    )
    r = subprocess.run([sys.executable, "-m", "codeforge", "tokenizer", "train", "--input", *inputs,
                        "--vocab-size", "300", "--out", str(tmp_path / "tok")],
                       capture_output=True, timeout=TIMEOUT, preexec_fn=_limit_memory)
    assert r.returncode == 0, r.stderr.decode(errors="replace")[-2000:]


# -- 3. symlinks out of the tree, FIFOs --------------------------------------------------------------------

def test_symlink_out_of_the_tree_is_not_read(tmp_path):
    secret = tmp_path / "home" / ".aws" / "credentials"
    secret.parent.mkdir(parents=True)
    secret.write_text("aws_secret_access_key = 'hunter2'\n")
    root = tmp_path / "tree"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "a.py").write_text("a = 1\n")
    (root / "pkg" / "notes.py").symlink_to(secret)  # absolute, out of the tree
    (root / "pkg" / "up.txt").symlink_to(Path("..") / ".." / "home" / ".aws" / "credentials")  # relative
    (root / "alias.py").symlink_to(Path("pkg") / "a.py")  # stays inside: read (then a duplicate)
    out = run_reader("corpus", [root])
    assert out["kept"] == ["a = 1\n"]
    assert out["skipped"] == {"symlink_outside": 2, "duplicate": 1}
    # The tree's root may itself be a symlink; a link inside it to a sibling file is still inside.
    (tmp_path / "link").symlink_to(root)
    out = run_reader("corpus", [tmp_path / "link"])
    assert out["kept"] == ["a = 1\n"] and out["skipped"] == {"symlink_outside": 2, "duplicate": 1}
    # Named directly, the file is the user's choice and is read.
    assert run_reader("corpus", [root / "pkg" / "notes.py"])["kept"] == [secret.read_text()]


def test_chat_directory_symlink_out_of_the_tree_is_not_read(tmp_path):
    outside = tmp_path / "private.jsonl"
    outside.write_text(json.dumps({"messages": [{"role": "user", "content": "my password?"},
                                                {"role": "assistant", "content": "hunter2"}]}) + "\n")
    d = tmp_path / "chats"
    d.mkdir()
    (d / "a.jsonl").write_text(json.dumps(GOOD_CHAT) + "\n")
    (d / "b.jsonl").symlink_to(outside)
    os.mkfifo(d / "c.jsonl")  # never opened for reading: nothing hangs
    out = run_reader("chat", [d])
    assert out["kept"] == [GOOD_CHAT["messages"]]
    assert out["skipped"] == {"symlink_outside": 1, "not_regular_file": 1}


# -- 4. a directory nest deeper than Python's recursion limit ----------------------------------------------

DEEP = 1100  # levels: past Python's default recursion limit of 1,000 (os.walk recurses per level before 3.12)


@pytest.fixture
def deep_tree(tmp_path):
    """tmp_path/tree/d/d/.../d, DEEP levels, with top.py at the top and deep.py at the bottom. Built 100
    levels at a time (os.makedirs itself recurses once per missing level) and removed level by level
    afterwards (shutil.rmtree, and so pytest's own cleanup of tmp_path, recurses too). Single-letter names
    keep the deepest path (2 bytes a level) under PATH_MAX."""
    root = tmp_path / "tree"
    root.mkdir()
    (root / "top.py").write_text("top = 1\n")
    for n in range(100, DEEP + 100, 100):
        os.makedirs(root.joinpath(*["d"] * min(n, DEEP)))
    bottom = root.joinpath(*["d"] * DEEP)
    (bottom / "deep.py").write_text("deep = 2\n")
    yield root
    (bottom / "deep.py").unlink()
    for n in range(DEEP, 0, -1):
        os.rmdir(root.joinpath(*["d"] * n))


def test_corpus_walk_of_a_nest_deeper_than_the_recursion_limit_reads_the_deep_file(deep_tree):
    out = run_reader("corpus", [deep_tree])
    assert sorted(out["kept"]) == ["deep = 2\n", "top = 1\n"]
    assert out["skipped"] == {}


def test_tokenizer_train_takes_a_nest_deeper_than_the_recursion_limit(tmp_path, deep_tree):
    r = subprocess.run([sys.executable, "-m", "codeforge", "tokenizer", "train", "--input", str(deep_tree),
                        "--vocab-size", "300", "--out", str(tmp_path / "tok")],
                       capture_output=True, text=True, timeout=TIMEOUT, preexec_fn=_limit_memory)
    assert r.returncode == 0 and "RecursionError" not in r.stderr, r.stderr[-2000:]


def test_prepare_takes_a_nest_deeper_than_the_recursion_limit(tmp_path, deep_tree, tokenizer_dir):
    data = tmp_path / "data"
    r = subprocess.run([sys.executable, "-m", "codeforge", "prepare", "--input", str(deep_tree),
                        "--tokenizer", str(tokenizer_dir), "--out", str(data), "--val-fraction", "0"],
                       capture_output=True, text=True, timeout=TIMEOUT, preexec_fn=_limit_memory)
    assert r.returncode == 0 and "RecursionError" not in r.stderr, r.stderr[-2000:]
    from codeforge.data.shards import ShardSet
    from codeforge.tokenizer import CodeTokenizer
    tok, ss = CodeTokenizer.load(data / "tokenizer"), ShardSet(data, "train")
    assert sorted(tok.decode(ss.document(i)) for i in range(ss.documents)) == ["deep = 2\n", "top = 1\n"]


def test_walk_tree_yields_what_os_walk_yields(tmp_path):
    """walk_tree is os.walk without recursion: same entries, same order, same pruning, links not followed."""
    from codeforge.corpus import walk_tree
    for d in ["a/b/c", "a/x", "b", "node_modules/m"]:
        (tmp_path / d).mkdir(parents=True)
    for f in ["top.py", "a/one.py", "a/b/c/two.py", "node_modules/m/skip.js"]:
        (tmp_path / f).write_text("x = 1\n")
    (tmp_path / "a" / "loop").symlink_to(tmp_path)  # a directory link: named, never descended into
    os.mkfifo(tmp_path / "b" / "pipe")

    def walk(it):
        out = []
        for dirpath, dirnames, filenames in it:
            dirnames.sort(reverse=True)  # the caller's order decides the walk's, as with os.walk
            if "node_modules" in dirnames:
                dirnames.remove("node_modules")
            out.append((dirpath, list(dirnames), sorted(filenames)))
        return out

    assert walk(walk_tree(str(tmp_path))) == walk(os.walk(str(tmp_path)))
    errors = []
    assert list(walk_tree(str(tmp_path / "missing"), onerror=errors.append)) == []
    assert [e.filename for e in errors] == [str(tmp_path / "missing")]
