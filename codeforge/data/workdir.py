"""prepare's work directory (`.OUT.prepare-FINGERPRINT` beside OUT, pipeline.py): made by this user, for
this user alone, and trusted no further than that.

- `enter` makes it mode 0700 (it holds every kept document's raw text, secrets not yet replaced), or accepts
  an existing one only if it is a real directory this user owns, then locks it (`lock`) and refuses it if
  anything inside is a symlink or another user's: prepare never makes either, and a write through a planted
  link lands outside. Files prepare writes itself are opened with O_NOFOLLOW and written aside then renamed
  (`write_text`), so a link planted after the check is replaced, never written through.
- `remove_others` removes the work directories of prepares of the same OUT with other inputs or options,
  except one a running prepare holds (its lock) or one Slurm jobs were submitted for (submitted.json):
  those are refused with the way out, never removed under a running job.
- `plan_units` trusts the plan no further: an entry must name an input, or a file under an input directory
  (no `..` on the way) whose tree is that directory's real path.
- Errors here are KeepWork: the directory is left as it is, for its owner to look at.
"""

from __future__ import annotations

import errno
import fcntl
import glob
import json
import os
import re
import shutil
import stat
import time
from collections.abc import Iterator
from pathlib import Path

from .. import printable
from ..corpus import record_kind
from .writer import ShardError

LOCK = "lock"
SUBMITTED = "submitted.json"  # the Slurm jobs working here (slurm.submit), until the user deletes it


class KeepWork(ShardError):
    """An error after which the work directory is kept (prepare removes it after errors in the data)."""


class Busy(KeepWork):
    """Another process holds the work directory's lock: a prepare is running in it."""


def _owner(uid: int) -> str:
    try:
        import pwd  # POSIX only; only for the message
        return f"user {pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def enter(work: Path) -> None:
    """Make `work` (0700), or check an existing one is a directory of this user and make it 0700 (one made by
    an earlier version was 0755: its raw text readable by every user of the machine)."""
    work.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(work, 0o700)
    except FileExistsError:
        pass
    try:  # the checks and the chmod on one descriptor: the name cannot be swapped in between
        fd = os.open(work, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as e:
        what = "a symlink" if e.errno == errno.ELOOP else "not a directory" if e.errno == errno.ENOTDIR \
            else f"unusable ({e.strerror})"
        raise KeepWork(f"{work} is {what}: prepare works only in a directory it made itself there; remove it "
                       f"or choose another --out") from None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise KeepWork(f"{work} belongs to {_owner(st.st_uid)}, not to you: prepare works only in a work "
                           f"directory it made itself (this one is another user's prepare of the same --out, "
                           f"or planted): leave it to its owner and choose another --out, or have it removed")
        if stat.S_IMODE(st.st_mode) != 0o700:
            os.fchmod(fd, 0o700)
    finally:
        os.close(fd)


def audit(work: Path) -> None:
    """Refuse a work directory holding a symlink, a FIFO, socket or device, or another user's entry (prepare
    makes none: someone else put it there; a write through a link lands outside, and opening a FIFO hangs).
    Run under the lock, after `enter`."""
    me = os.geteuid()
    for top, dirs, files in os.walk(work):  # a symlinked directory is listed in dirs, never entered
        for name in dirs + files:
            path = os.path.join(top, name)
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                continue
            odd = not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode))
            if odd or st.st_uid != me:
                what = (f"a symlink (to {os.readlink(path)!r})" if stat.S_ISLNK(st.st_mode)
                        else "not a regular file or directory (a FIFO, socket or device)" if odd
                        else f"owned by {_owner(st.st_uid)}")
                raise KeepWork(f"{path!r} is {what}, which prepare never makes: something other than prepare "
                               f"changed {work}. Look at it, delete the directory and run the same command "
                               f"again (it starts that dataset afresh)")


def plan_units(work: Path, rank: int, sources: list[str]) -> Iterator[tuple[str, str | None, dict | None]]:
    """Task `rank`'s (path, tree, piece) units of the plan (plan/RANK.jsonl, pipeline.make_plan), each
    checked against the inputs (_planned; a piece's chunk file must be one of plan/chunks/): one that is not
    refused (KeepWork), never read."""
    trees: dict[str, list[str]] = {}
    for src in sources:
        if not src.startswith("hf:") and os.path.isdir(src):
            trees.setdefault(os.path.realpath(src), []).append(src)
    name = work / "plan" / f"{rank:05d}.jsonl"
    with open(name, "rb") as f:
        for i, line in enumerate(f, 1):
            try:
                path, tree, _, *piece = json.loads(line)
            except (ValueError, TypeError):
                path = tree = None
                piece = []
            piece = piece[0] if piece else None
            if not _planned(path, tree, sources, trees) or not _piece_ok(path, tree, piece):
                raise KeepWork(printable(
                    f"{name} line {i} is not a unit of the inputs ({line[:200]!r}): prepare reads only the "
                    f"inputs' files (an input directory that resolves elsewhere now, or a plan changed by "
                    f"something other than prepare). Delete {work} and run the same command again"))
            if piece is not None and "file" in piece:  # a chunk, named within this work directory's chunks/
                piece = {**piece, "file": str(work / "plan" / "chunks" / piece["file"])}
            yield path, tree, piece


CHUNK_NAME = re.compile(r"\d{5}/\d{5}\.jsonl")


def _piece_ok(path: str, tree, piece) -> bool:
    """No piece, or a piece of a whole input in one of pieces.py's shapes: byte ranges and a first line of a
    JSONL input (and the name of its decompressed chunk, N/M.jsonl under plan/chunks/, for a compressed
    one), or a run of row groups of a parquet input."""
    if piece is None:
        return True
    if tree is not None or not isinstance(piece, dict):
        return False

    def count(v) -> bool:
        return type(v) is int and v >= 0

    if set(piece) == {"groups", "row", "size"}:
        g = piece["groups"]
        return (record_kind(path) == "parquet" and isinstance(g, list) and len(g) == 2
                and all(map(count, g)) and g[0] < g[1] and count(piece["row"]) and count(piece["size"]))
    keys = {"bytes", "line"} | ({"file"} if "file" in piece else set())
    b = piece.get("bytes")
    return (set(piece) == keys and record_kind(path) == "jsonl" and isinstance(b, list) and len(b) == 2
            and all(map(count, b)) and b[0] <= b[1] and count(piece["line"]) and piece["line"] >= 1
            and ("file" not in piece or isinstance(piece["file"], str) and CHUNK_NAME.fullmatch(piece["file"])
                 is not None))


def _planned(path, tree, sources: list[str], trees: dict[str, list[str]]) -> bool:
    """A whole input (tree None), or a file under an input directory (by its name as the walk joined it, no
    `.` or `..` in between) whose tree is that directory's real path now."""
    if not isinstance(path, str):
        return False
    if tree is None:
        return path in sources
    for src in trees.get(tree, []) if isinstance(tree, str) else []:
        top = src if src.endswith(os.sep) else src + os.sep
        if path.startswith(top) and not {"", ".", ".."} & set(path[len(top):].split(os.sep)):
            return True
    return False


def open_nofollow(path: Path, flags: int, mode: int = 0o600) -> int:
    """`path` opened without following a symlink and without blocking on a FIFO (O_NONBLOCK, cleared once
    the file is known to be a regular one): anything else there is refused, never waited on."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0), mode)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise KeepWork(f"{path} is a symlink, which prepare never makes there: delete {path.parent} and "
                           f"run the same command again") from None
        if e.errno == errno.ENXIO:  # a FIFO opened for writing with no reader
            raise KeepWork(f"{path} is a FIFO, which prepare never makes there: delete {path.parent} and "
                           f"run the same command again") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise KeepWork(f"{path} is not a regular file (a FIFO, socket or device), which prepare never makes "
                       f"there: delete {path.parent} and run the same command again")
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    return fd


def write_text(path: Path, text: str) -> None:
    """`text` into `path`, written aside and renamed over it: a file written whole or not at all, and a
    symlink found at either name is replaced, never written through."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        os.unlink(tmp)  # a leftover of a killed task, or a planted link: O_EXCL below creates a new file
    except FileNotFoundError:
        pass
    fd = open_nofollow(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    with open(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def lock(work: Path):
    """An exclusive lock on the work directory for this command's life: two runs never share one. The
    returned file holds it; closing it lets go."""
    fd = open_nofollow(work / LOCK, os.O_RDWR | os.O_CREAT)
    f = open(fd, "a+")
    try:  # a POSIX record lock: held by this process alone (the engine's forked helpers do not inherit it)
        fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        raise Busy(f"another prepare is working in {work} (the same command, still running): wait for "
                       f"it, or stop it first") from None
    return f


def submitted(work: Path) -> str | None:
    """When Slurm jobs were submitted for `work` and may still run: what to do about it; else None."""
    marker = work / SUBMITTED
    try:
        with open(open_nofollow(marker, os.O_RDONLY), "rb") as f:
            jobs = json.loads(f.read(1 << 20))  # a job list is a few KB
        ids = ", ".join(map(str, jobs["jobs"]))
        when = time.ctime(jobs["at"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, KeepWork):
        ids, when = "(unreadable list)", "an unknown time"
    return (f"Slurm jobs {ids} were submitted for {work} at {when} and may still be queued or running "
            f"(squeue -j {ids.replace(', ', ',')}). Once they have all ended, delete {marker} and run the "
            f"command again")


def remove_others(out: Path, keep: Path, log=print) -> None:
    """Remove the work directories of other prepares of `out` (other inputs or options: never resumed), each
    under its own lock so that no prepare can start in it meanwhile. One that a running prepare holds, or
    that Slurm jobs were submitted for, is refused (KeepWork, naming it and what to do); one that is not a
    directory of this user is not ours to remove, and stays."""
    me = os.geteuid()
    for old in sorted(out.parent.glob(f".{glob.escape(out.name)}.prepare-*")):
        if old == keep:
            continue
        try:
            st = os.lstat(old)
        except FileNotFoundError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != me:
            continue
        why = submitted(old)
        if why:
            raise KeepWork(f"{old} is the work of another prepare of {out} (other inputs or options). {why}; "
                           f"or choose another --out")
        try:
            held = lock(old)
        except Busy:
            raise KeepWork(f"{old} is the work of another prepare of {out} (other inputs or options) that is "
                           f"running now: wait for it to finish or stop it, then run this command again; or "
                           f"choose another --out") from None
        try:
            log(f"removing {old}: an unfinished prepare of {out} with other inputs or options")
            shutil.rmtree(old, ignore_errors=True)
        finally:
            held.close()
