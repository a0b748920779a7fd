"""`codeforge prepare` on datatrove: MB/s for 1 and N workers against the single-process path it replaced,
and the memory of each stage (near-dedup's above all) as the corpus grows.

    python benchmarks/prepare_engine.py speed  [--input DIR ...] [--old-rev REV] [--workers 1 2]
    python benchmarks/prepare_engine.py memory [--sizes 100 1000]
    python benchmarks/prepare_engine.py bigfile [--mb 200] [--gzip] [--workers 1 2]

speed: the same command (`codeforge prepare` with its defaults: exact dedup, HumanEval decontamination,
secrets replaced) on the same input, each run a fresh process: the engine at each --workers, and the code
of --old-rev (the last single-process version) from a git worktree. MB/s is the kept bytes over the wall
time of the whole command (process start included), as the user waits for it.

memory: --dedup near on corpora of about 100 MB and 1 GB made of Go's and Python's standard libraries: the
first copy as it is, every further copy with one line of every file changed (a near-duplicate of the first,
so the dedup stages have real clusters to find). A sampler reads the RSS of the command's whole process
tree every 0.2 s and books it to the stage running (the newest WORK/logs/STAGE): the largest single process
and the tree's sum. Flat memory: the per-stage peaks do not grow with the corpus.

bigfile: one large JSONL file (or .jsonl.gz) as the whole corpus: before pieces (data/pieces.py) it was one
task on one core whatever --workers said; now every worker reads part of it, with the same shards.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
GO = "/usr/share/go-1.19/src"
PY = os.path.dirname(os.__file__)


def _train_tokenizer(inputs: list[str], out: Path) -> None:
    subprocess.run([sys.executable, "-m", "codeforge", "tokenizer", "train", "--input", *inputs,
                    "--vocab-size", "8192", "--out", str(out)], check=True, capture_output=True, cwd=ROOT)


def _sample(proc: psutil.Process, logs_parent: Path, out: dict, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            procs = [proc] + proc.children(recursive=True)
            rss = []
            for p in procs:
                try:
                    rss.append(p.memory_info().rss)
                except psutil.Error:
                    pass
        except psutil.Error:
            break
        stage = "plan"
        dirs = [d for w in logs_parent.glob(".*.prepare-*") for d in (w / "logs").glob("*") if d.is_dir()]
        if dirs:
            stage = max(dirs, key=lambda d: d.stat().st_mtime_ns).name
        one, tree = out.setdefault(stage, [0, 0])
        out[stage] = [max(one, max(rss, default=0)), max(tree, sum(rss))]
        stop.wait(0.2)


def run_prepare(argv: list[str], env: dict | None = None, sample_in: Path | None = None,
                cwd: Path = ROOT) -> tuple[float, dict, dict]:
    """(wall seconds, meta.json, per-stage memory) of one `codeforge prepare` process."""
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-m", "codeforge", "prepare", *argv], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, env=env, cwd=cwd)
    mem: dict = {}
    stop = threading.Event()
    th = threading.Thread(target=_sample, args=(psutil.Process(p.pid), sample_in, mem, stop), daemon=True) \
        if sample_in else None
    if th:
        th.start()
    said, _ = p.communicate()
    wall = time.perf_counter() - t0
    stop.set()
    if th:
        th.join()
    if p.returncode:
        raise SystemExit(f"prepare failed ({p.returncode}):\n{said[-3000:]}")
    out = Path(argv[argv.index("--out") + 1])
    return wall, json.loads((out / "meta.json").read_text()), mem


def speed(a) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="prep-speed-"))
    try:
        tok = tmp / "tok"
        _train_tokenizer(a.input, tok)
        old = tmp / "old"
        subprocess.run(["git", "worktree", "add", "--detach", str(old), a.old_rev], cwd=ROOT, check=True,
                       capture_output=True)
        rows = []
        runs = [("single process (" + a.old_rev + ")", None, {**os.environ, "PYTHONPATH": str(old)})] + \
               [(f"datatrove, {w} worker(s)", w, None) for w in a.workers]
        for rep in range(a.repeats):
            for name, w, env in runs:
                out = tmp / f"out-{rep}-{w}"
                argv = ["--input", *a.input, "--tokenizer", str(tok), "--out", str(out)]
                if w:
                    argv += ["--workers", str(w)]
                wall, meta, _ = run_prepare(argv, env, cwd=old if env else ROOT)
                # the old code has no engine
                assert ("engine" in meta) == bool(w), f"{name} ran the wrong code"
                rows.append((name, rep, wall, meta["bytes"], meta["documents"], meta["tokens"]))
                print(f"{name:34s} run {rep}: {wall:7.1f}s  {meta['bytes'] / 1e6 / wall:6.2f} MB/s  "
                      f"{meta['documents']:,} documents, {meta['tokens']:,} tokens", flush=True)
                shutil.rmtree(out)
        print(f"\ninput {a.input}; {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}")
        best = {}
        for name, _, wall, nbytes, *_ in rows:
            best[name] = max(best.get(name, 0), nbytes / 1e6 / wall)
        for name, v in best.items():
            print(f"  best {name:34s} {v:6.2f} MB/s")
        names = list(best)
        if len(names) >= 3:
            print(f"  {names[2]} / {names[1]}: {best[names[2]] / best[names[1]]:.2f}x; engine at 1 worker / "
                  f"single process: {best[names[1]] / best[names[0]]:.2f}x")
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(tmp / "old")], cwd=ROOT,
                       capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)


def _copy_changed(src: str, dest: Path, ext: str, seed: int) -> int:
    """Every `ext` file under src copied to dest with one line changed (seed 0: unchanged); bytes written."""
    rng = random.Random(seed)
    n = 0
    for dirpath, _, files in os.walk(src):
        if "site-packages" in dirpath or "testdata" in dirpath:
            continue
        for f in files:
            if not f.endswith(ext):
                continue
            try:
                text = Path(dirpath, f).read_text()
            except (OSError, UnicodeDecodeError):
                continue
            if seed:
                lines = text.split("\n")
                i = rng.randrange(len(lines))
                lines[i] = f"// changed in copy {seed}: {rng.random()}" if ext == ".go" else f"# copy {seed}"
                text = "\n".join(lines)
            d = dest / os.path.relpath(dirpath, src)
            d.mkdir(parents=True, exist_ok=True)
            (d / f).write_text(text)
            n += len(text.encode())
    return n


def memory(a) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="prep-mem-", dir=a.tmp))
    try:
        corpus = tmp / "corpus"
        size, copies = 0, 0
        tok = tmp / "tok"
        _train_tokenizer([GO, PY], tok)
        for target in sorted(a.sizes):
            while size < target * 1e6 * 0.95:
                size += _copy_changed(GO, corpus / f"go{copies}", ".go", copies)
                size += _copy_changed(PY, corpus / f"py{copies}", ".py", copies)
                copies += 1
            out = tmp / f"out{target}"
            argv = ["--input", str(corpus), "--tokenizer", str(tok), "--out", str(out), "--dedup", "near",
                    "--workers", str(a.workers), "--keep-secrets", "--no-decontaminate"]
            wall, meta, mem = run_prepare(argv, sample_in=tmp)
            print(f"\n{size / 1e6:,.0f} MB in {copies} copies: {wall:.0f}s, {meta['bytes'] / 1e6 / wall:.2f} "
                  f"MB/s, {meta['engine']['tasks']} tasks, kept {meta['documents']:,} documents "
                  f"({meta['skipped'].get('near_duplicate', 0):,} near and "
                  f"{meta['skipped'].get('duplicate', 0):,} exact duplicates dropped)", flush=True)
            print(f"  {'stage':10s} {'largest process MiB':>20s} {'all processes MiB':>18s}")
            for stage, (one, tree) in mem.items():
                print(f"  {stage:10s} {one / 2**20:20.0f} {tree / 2**20:18.0f}")
            shutil.rmtree(out)
        print(f"\n{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def bigfile(a) -> None:
    """One large JSONL (Go's standard library, each file a record, every copy after the first with one line
    changed so that exact dedup keeps it) prepared with the defaults at each --workers: wall time, MB/s of
    kept bytes, the speed-up over the first, and whether the shards are byte for byte the same."""
    import gzip
    tmp = Path(tempfile.mkdtemp(prefix="prep-big-", dir=a.tmp))
    try:
        tok = tmp / "tok"
        _train_tokenizer([GO], tok)
        files = []
        for dirpath, _, names in os.walk(GO):
            if "testdata" not in dirpath:
                files += [Path(dirpath, f) for f in sorted(names) if f.endswith(".go")]
        texts = []
        for f in sorted(files):
            try:
                texts.append(f.read_text())
            except (OSError, UnicodeDecodeError):
                continue
        path = tmp / ("big.jsonl.gz" if a.gzip else "big.jsonl")
        rng = random.Random(0)
        size, copy = 0, 0
        with (gzip.open(path, "wt") if a.gzip else open(path, "w")) as out:
            while size < a.mb * 1e6:
                for t in texts:
                    if copy:
                        lines = t.split("\n")
                        lines[rng.randrange(len(lines))] = f"// copy {copy}: {rng.random()}"
                        t = "\n".join(lines)
                    line = json.dumps({"text": t}) + "\n"
                    out.write(line)
                    size += len(line.encode())
                    if size >= a.mb * 1e6:
                        break
                copy += 1
        print(f"{path.name}: {size / 1e6:,.0f} MB of JSONL ({path.stat().st_size / 1e6:,.0f} MB on disk), "
              f"{copy} pass(es) over Go's standard library", flush=True)
        rows, first = [], None
        for w in a.workers:
            out_dir = tmp / f"out{w}"
            wall, meta, _ = run_prepare(["--input", str(path), "--tokenizer", str(tok), "--out", str(out_dir),
                                         "--workers", str(w)])
            shards = {f.name: f.read_bytes() for f in sorted(out_dir.iterdir())
                      if f.suffix in (".bin", ".npy")}
            same = "" if first is None else ("; shards identical" if shards == first else "; SHARDS DIFFER")
            first = first if first is not None else shards
            rate = meta["bytes"] / 1e6 / wall
            rows.append(rate)
            print(f"  --workers {w}: {wall:7.1f}s  {rate:6.2f} MB/s kept  {meta['engine']['tasks']} tasks, "
                  f"{meta['documents']:,} documents{same}; x{rate / rows[0]:.2f} of --workers "
                  f"{a.workers[0]}", flush=True)
        print(f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("speed")
    s.add_argument("--input", nargs="+", default=[GO, PY])
    s.add_argument("--old-rev", default="e4b3f79", help="the last commit with the single-process prepare")
    s.add_argument("--workers", nargs="+", type=int, default=[1, 2])
    s.add_argument("--repeats", type=int, default=1)
    m = sub.add_parser("memory")
    m.add_argument("--sizes", nargs="+", type=int, default=[100, 1000], help="corpus sizes in MB")
    m.add_argument("--workers", type=int, default=2)
    m.add_argument("--tmp", default=None)
    b = sub.add_parser("bigfile")
    b.add_argument("--mb", type=float, default=200.0, help="size of the one JSONL file, in MB")
    b.add_argument("--gzip", action="store_true", help="the file as .jsonl.gz")
    b.add_argument("--workers", nargs="+", type=int, default=[1, 2])
    b.add_argument("--tmp", default=None)
    a = ap.parse_args()
    {"speed": speed, "memory": memory, "bigfile": bigfile}[a.cmd](a)


if __name__ == "__main__":
    main()
