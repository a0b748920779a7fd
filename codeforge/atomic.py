"""Write a directory aside, then rename it into place: a crash never leaves one that looks complete.

Used for tokenizers, prepared shards, checkpoints and the miners' JSONL directories (output_dir,
write_splits). `staging_dir(out)` gives an empty hidden sibling of `out` (same filesystem, so the rename is
atomic); `publish(tmp, out)` moves it into place, replacing an existing `out` only after the new one is
complete.

Names, with the writing process's PID: `.NAME.tmp-PID` is being written (or is garbage), `.NAME.old-PID` is
the previous complete `NAME` during the two renames of a replacement. A process killed midway leaves them
behind; the next `staging_dir` in the same parent directory cleans up after processes that are gone:
  - `.NAME.tmp-PID` of a dead PID is removed (never complete: publish renames a finished one away at once);
  - `.NAME.old-PID` of a dead PID is removed when `NAME` exists (it was superseded), and renamed back to
    `NAME` when it does not: the process died between the two renames, and this is the only complete copy.
A PID is alive when os.kill(pid, 0) succeeds or is refused (PermissionError: another user's process). A
dead PID since reused by an unrelated process keeps its directory until that process ends: only a delay.
Liveness is judged on this machine: a parent directory shared by several hosts (NFS) must not have two of
them writing there at once. On Windows (where os.kill would terminate) nothing is cleaned.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path

_LEFTOVER = re.compile(r"\.(?P<name>.+)\.(?P<kind>tmp|old)-(?P<pid>\d+)")


def _alive(pid: int) -> bool:
    """True unless `pid` certainly names no process on this machine."""
    if os.name == "nt" or pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, OSError):
        return True  # exists but not ours, or unknowable: leave it
    return True


def clean_stale(parent: Path) -> list[Path]:
    """Remove (or restore, for `.old-`) the leftovers of dead processes in `parent`, as the module says;
    best effort, never raises. Returns the paths acted on."""
    acted: list[Path] = []
    try:
        entries = sorted(os.scandir(parent), key=lambda e: e.name)
    except OSError:
        return acted
    me = os.getpid()
    for e in entries:
        m = _LEFTOVER.fullmatch(e.name)
        if not m or int(m["pid"]) == me:
            continue
        try:
            if not e.is_dir(follow_symlinks=False) or _alive(int(m["pid"])):
                continue
            path, target = Path(e.path), parent / m["name"]
            if m["kind"] == "old" and not os.path.lexists(target):
                path.rename(target)
                print(f"note: restored {target} from {path.name}, left by a process that died while "
                      "replacing it", file=sys.stderr)
            else:
                shutil.rmtree(path)
            acted.append(path)
        except OSError:  # a concurrent cleaner got there first, or no permission: not our problem here
            continue
    return acted


def staging_dir(out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(out.parent)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def publish(tmp: Path, out: Path) -> None:
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        out.rename(old)
        tmp.rename(out)
        # Rename the superseded copy to the (now free) staging name before deleting it, so a kill during the
        # slow rmtree leaves a `.tmp-` (garbage) and a leftover `.old-` is always a complete copy.
        old.rename(tmp)
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        tmp.rename(out)


def output_dir(out_dir: str | Path, overwrite: bool, error: type[Exception]) -> Path:
    """A miner's --out, checked before any work: a directory, new or empty unless `overwrite`; `error`: the
    exception class the command raises for its bad input."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise error(f"--out {str(out)!r} is a file: pass a directory path")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise error(f"--out {str(out)!r} exists and is not empty: choose a new directory or pass --overwrite")
    return out


def write_splits(out: Path, files: dict[str, list[dict]], meta: dict) -> None:
    """Each named JSONL file (one record per line) and meta.json, written aside and renamed into place
    as above, so a crash never leaves a half-written directory. Shared by the miners and make-tasks."""
    tmp = staging_dir(out)
    try:
        for name, rows in files.items():
            with open(tmp / name, "w", encoding="utf-8") as f:
                f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n",
                                       encoding="utf-8")
        publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_jsonl(path: str | Path, rows: list[dict]) -> None:
    """One JSON record per line, written beside the target and renamed over it: a crash leaves the old file
    (or none), never half of the new one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
