"""The checkpoint format on disk: names, errors, the latest/best/final pointers, the manifest and its
verification, finding the checkpoint a path means, its saved config, the vet before a model is built from it
and the compatibility checks. Every file is read through guard.py: a regular file, of a size its kind can
have."""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

from safetensors import SafetensorError, safe_open

from .. import rundir
from .. import CodeforgeError
from .guard import (CONFIG_BYTES, MANIFEST_BYTES, POINTER_BYTES, STATE_BYTES, check_files, check_memory,
                    check_regular, declared_shapes, dims, header_bytes, model_config_from, not_regular,
                    read_json, read_regular, safetensors_header, weights_problem)


STEP_PREFIX = "step_"


STEP_RE = re.compile(r"step_\d+")


POINTERS = ("latest", "best", "final")


MANIFEST = "manifest.json"


MANIFEST_FORMAT = "codeforge-checkpoint/2"


STATE_TENSORS = "train_state.safetensors"


STATE_JSON = "train_state.json"


LEGACY_STATE = "train_state.pt"  # pickled by codeforge before the manifest; read only with weights_only=True


SHARDED = "sharded"  # the DCP directory of an FSDP run's checkpoint


class CheckpointError(CodeforgeError):
    pass


class NoCheckpointError(CheckpointError):
    """The run has no checkpoint at all (as opposed to only damaged ones)."""


class CheckpointWriteError(CheckpointError):
    """A checkpoint could not be written; nothing earlier was lost."""


DAMAGED = "the checkpoint was damaged or edited: use another checkpoint"


def write_pointer(ckpt_root: Path, name: str, target: str) -> None:
    tmp = ckpt_root / f".{name}.tmp"
    try:
        tmp.write_text(target + "\n")
        os.replace(tmp, ckpt_root / name)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


def pointer_target(ckpt_root: Path, name: str) -> Path | None:
    """The step directory a pointer names (whether or not it exists), or None without a readable pointer (a
    FIFO or anything but a small regular file is not one)."""
    try:
        text = read_regular(ckpt_root / name, POINTER_BYTES, CheckpointError, "").decode().strip()
    except (CheckpointError, UnicodeDecodeError):
        return None
    return ckpt_root / text if STEP_RE.fullmatch(text) else None


def read_pointer(ckpt_root: Path, name: str) -> Path | None:
    p = pointer_target(ckpt_root, name)
    return p if p is not None and ((p / "model.safetensors").exists() or is_sharded(p)) else None


def step_of(p: Path) -> int:
    """The step of a step_NNNNNN directory: numeric, so step_1000000 sorts after step_999500."""
    return int(p.name[len(STEP_PREFIX):])


def step_dirs(root: Path) -> list[Path]:
    """step_NNNNNN directories under checkpoints/, oldest first."""
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if STEP_RE.fullmatch(p.name) and p.is_dir()), key=step_of)


def sha256(f: Path) -> str:
    with open(f, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def weights_sha256(ck: Path) -> str | None:
    """The sha256 of a checkpoint's model.safetensors as its manifest records it (hashed here for a
    checkpoint without one); None where there is neither."""
    try:
        return str(json.loads((Path(ck) / MANIFEST).read_text())["files"]["model.safetensors"]["sha256"])
    except (OSError, ValueError, KeyError, TypeError):
        f = Path(ck) / "model.safetensors"
        return sha256(f) if f.is_file() else None


def file_entries(d: Path, files) -> dict:
    return {f.relative_to(d).as_posix(): {"bytes": f.stat().st_size, "sha256": sha256(f)} for f in files}


def write_manifest(d: Path, step: int, known: dict | None = None) -> None:
    """known: entries already hashed (by the ranks that wrote those files)."""
    known = known or {}
    files = {**file_entries(d, (f for f in sorted(d.rglob("*"))
                                 if f.is_file() and f.relative_to(d).as_posix() not in known)), **known}
    files = dict(sorted(files.items()))
    (d / MANIFEST).write_text(json.dumps({"format": MANIFEST_FORMAT, "step": step, "files": files}, indent=1)
                              + "\n")


# (checkpoint, train_state, every file's (name, size, mtime)) -> result
_verified: dict[tuple, str | None] = {}


def verify_checkpoint(ck: str | Path, train_state: bool = True) -> str | None:
    """None if checkpoint `ck` is intact, else why not (naming the file). train_state=False checks only what
    inference needs (weights, config, tokenizer). Results are remembered while no file changes."""
    ck = Path(ck)
    try:
        sig = tuple(sorted((str(f.relative_to(ck)), st.st_size, st.st_mtime_ns)
                           for f in ck.rglob("*") if f.is_file() for st in [f.stat()]))
    except OSError as e:
        return f"it cannot be read ({e})"
    key = (str(ck.resolve()), train_state, sig)
    if key not in _verified:
        if len(_verified) > 64:
            _verified.clear()
        _verified[key] = _verify(ck, train_state)
    return _verified[key]


def _verify(ck: Path, train_state: bool) -> str | None:
    if not (ck / MANIFEST).exists():
        return _verify_legacy(ck, train_state)
    try:
        man = read_json(ck / MANIFEST, MANIFEST_BYTES, CheckpointError, "")
        files = {str(k): (int(v["bytes"]), str(v["sha256"])) for k, v in man["files"].items()}
    except CheckpointError as e:
        return _relative(str(e), ck).rstrip("; ")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"{MANIFEST} is unreadable ({type(e).__name__}: {e})"
    weights = f"{SHARDED}/.metadata" if any(k.startswith(f"{SHARDED}/")
                                            for k in files) else "model.safetensors"
    needed = {weights, "config.json"} | ({STATE_TENSORS, STATE_JSON} if train_state else set())
    unlisted = sorted(needed - set(files))
    if unlisted:
        return f"{unlisted[0]} is not in {MANIFEST}"
    no_tokenizer = not (ck / "tokenizer").exists()  # removed as a whole: load_model says what to do
    for rel, (size, sha) in files.items():
        if (not train_state and rel.startswith("train_state")) or (no_tokenizer
                                                                   and rel.startswith("tokenizer/")):
            continue
        if rel.startswith("/") or ".." in Path(rel).parts:
            return f"{MANIFEST} names a file outside the checkpoint ({rel})"
        f = ck / rel
        try:
            st = f.stat()
        except OSError:
            return f"{rel} is missing"
        if not_regular(st.st_mode):
            return f"{rel} is {not_regular(st.st_mode)}, not a regular file"
        have = st.st_size
        if have != size:
            return f"{rel} is {have:,} bytes but was saved with {size:,} (truncated or overwritten)"
        if sha256(f) != sha:
            return f"{rel} does not match the sha256 recorded when it was saved (damaged or changed on disk)"
    return None


def _verify_legacy(ck: Path, train_state: bool) -> str | None:
    """A checkpoint without a manifest. For inference only its weights' presence (load_weights reports a file
    that does not load); for --resume, that every file opens, without unpickling anything."""
    try:
        check_regular(ck / "model.safetensors", CheckpointError, "")
        if not train_state:
            return None
        read_json(ck / "config.json", CONFIG_BYTES, CheckpointError, "")
        # the new state without its manifest: by hand, or the manifest lost
        new_state = (ck / STATE_JSON).exists()
        if new_state:
            read_json(ck / STATE_JSON, STATE_BYTES, CheckpointError, "")
            check_regular(ck / STATE_TENSORS, CheckpointError, "")
        elif (ck / LEGACY_STATE).exists():
            check_regular(ck / LEGACY_STATE, CheckpointError, "")
        else:
            return f"it has no training state ({STATE_JSON} or {LEGACY_STATE})"
    except CheckpointError as e:
        return _relative(str(e), ck).rstrip("; ")
    for name in ("model.safetensors", STATE_TENSORS) if new_state else ("model.safetensors",):
        try:
            with safe_open(str(ck / name), "pt") as f:
                list(f.keys())
        except (OSError, SafetensorError, ValueError, RuntimeError) as e:
            return f"{name} is unreadable ({e})"
    if new_state:
        return None
    try:
        with zipfile.ZipFile(ck / LEGACY_STATE) as z:
            bad = z.testzip()  # CRC of every member: reads the bytes, unpickles nothing
    except (OSError, zipfile.BadZipFile, EOFError, ValueError) as e:
        return f"{LEGACY_STATE} is unreadable ({e})"
    if bad is not None:
        return f"{LEGACY_STATE} is damaged (checksum error in {bad})"
    return None


def warn(msg: str) -> None:
    print(f"warning: {msg}", file=sys.stderr)


def is_checkpoint_dir(p: Path) -> bool:
    return (p / "model.safetensors").exists() or (p / MANIFEST).exists() or is_sharded(p)


def is_sharded(ck: str | Path) -> bool:
    """True for a checkpoint written by an FSDP run (weights and optimizer state in DCP shards)."""
    return (Path(ck) / SHARDED).is_dir()


def latest_step(run_dir: str | Path) -> Path | None:
    """The step directory RUN/checkpoints/latest names (unverified), or None."""
    return pointer_target(Path(run_dir) / rundir.CHECKPOINTS, "latest")


def find_checkpoint(path: str | Path, which: str = "latest", *, train_state: bool = False,
                    log: Callable[[str], None] | None = None, verify: bool = True) -> Path:
    """An intact checkpoint directory from a checkpoint path, or from a run directory by pointer: "latest",
    "best", "final", or "auto" (best if the run has one, else latest). train_state: it will be resumed, so
    its training state must be intact too.

    `latest` that is missing or damaged falls back to the newest intact step before it, and so does `auto`
    whose best is damaged; `log` (default: stderr) says which was skipped and why. A checkpoint directory
    given by path, `best` and `final` are never swapped for another: damaged, they are refused. Asking for
    best or final when the run has none says so by name. NoCheckpointError: the run has no checkpoint.
    verify=False: follow the pointers without hashing the files (to read a configuration; whatever loads the
    weights verifies them)."""
    check = verify_checkpoint if verify else (lambda c, state: None)
    if which not in (*POINTERS, "auto"):
        raise CheckpointError(f"checkpoint {which!r} is not one of {POINTERS + ('auto',)}")
    say = log or warn
    p = Path(path)
    if is_checkpoint_dir(p):
        why = check(p, train_state)
        if why:
            run = f" ({p.parent.parent})" if p.parent.name == rundir.CHECKPOINTS else ""
            raise CheckpointError(f"checkpoint {p} is damaged: {why}. Use another checkpoint, or pass the "
                                  f"run directory{run} to take its newest intact one")
        return p
    if not p.exists():
        raise CheckpointError(f"{p} does not exist: pass a run directory (from `codeforge train --out`) or a "
                              f"checkpoint directory")
    root = p / rundir.CHECKPOINTS
    inside, checked = root.resolve(), check  # RUN/checkpoints may itself be a link (to a bigger disk)

    def check(c: Path, state: bool) -> str | None:  # the same check; a step linked elsewhere refused
        real = c.resolve()
        if inside not in real.parents:
            return (f"it is a link to {real}, outside the run's {root} (codeforge never writes one); copy "
                    f"that checkpoint into {root} if it belongs to this run")
        return checked(c, state)
    steps = step_dirs(root)
    if not steps and step_dirs(p):  # RUN/checkpoints itself was given
        raise CheckpointError(f"{p} is the checkpoints folder of a run: pass the run directory {p.parent} "
                              f"(or one checkpoint, e.g. {step_dirs(p)[-1]})")
    if not steps:
        # a directory that holds runs (a quickstart's: DIR/run, DIR/base) is not itself one: name them
        inner = [d for d in sorted(p.iterdir()) if d.is_dir() and step_dirs(d / rundir.CHECKPOINTS)] if (
            p.is_dir()) else []
        if inner:
            runs = " or ".join(str(d) for d in inner[:4])
            raise NoCheckpointError(f"{p} is not a run but holds {'runs' if len(inner) > 1 else 'a run'}: "
                                    f"pass {runs} (a quickstart's model is in its run/ directory)")
        raise NoCheckpointError(f"no checkpoint in {p}: train first (`codeforge train --out {p}`) or pass a "
                                f"checkpoint directory")
    if which == "auto":
        best = pointer_target(root, "best")
        if best is None:
            which = "latest"
        else:
            why = check(best, train_state) if best.is_dir() else "it is missing"
            if why is None:
                return best
            say(f"the best checkpoint {best} is damaged: {why}; taking the newest intact one instead")
            which = "latest"
    if which in ("best", "final"):
        target = pointer_target(root, which)
        if target is None:
            why = ("no evaluated step was saved (no validation split, or --eval-every 0)" if which == "best"
                   else "the run has not finished")
            raise CheckpointError(f"{p} has no '{which}' checkpoint: {why}; use --checkpoint latest")
        why = check(target, train_state) if target.is_dir() else "it is missing"
        if why:
            raise CheckpointError(f"the '{which}' checkpoint {target} is damaged: {why}. Use --checkpoint "
                                  f"latest for the newest intact one, or pass another step directory")
        return target
    target = pointer_target(root, "latest")  # None after a crash between save and pointer: the newest step
    candidates = steps[::-1] if target is None else [target] + [s for s in steps[::-1]
                                                                if step_of(s) < step_of(target)]
    bad: list[tuple[Path, str]] = []
    for c in candidates:
        why = check(c, train_state) if c.is_dir() else "it is missing"
        if why is None:
            if bad:
                skipped = "; ".join(f"{b} is damaged: {w}" for b, w in bad)
                say(f"{skipped}; using {c.name}, the newest intact checkpoint")
            return c
        bad.append((c, why))
    listing = "; ".join(f"{b.name}: {w}" for b, w in bad)
    raise CheckpointError(f"no intact checkpoint in {root} ({listing}). Start again with another --out (or "
                          f"remove {root} to train from scratch here)")


def _relative(msg: str, ck: Path) -> str:
    """A guard.py message about a file of checkpoint `ck`, with the file named relative to it."""
    return msg.replace(f"{ck}/", "", 1)


def read_config(ckpt: Path) -> dict:
    """The checkpoint's config.json: a JSON object with a `model` object (its fields are checked where a model
    is built from them: vet_checkpoint)."""
    f = Path(ckpt) / "config.json"
    cfg = read_json(f, CONFIG_BYTES, CheckpointError, DAMAGED)
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{f} is a {type(cfg).__name__}, not an object of settings; {DAMAGED}")
    if "model" not in cfg:
        raise CheckpointError(f"{f} has no model section; {DAMAGED}")
    if not isinstance(cfg["model"], dict):
        raise CheckpointError(f"{f}: model is a {type(cfg['model']).__name__}, not an object of model "
                              f"settings; {DAMAGED}")
    return cfg


def shape_diff(saved: dict, current: dict) -> dict:
    """Model fields whose difference makes saved weights unusable: {field: (saved, current)}. Dropout rates
    may change between stages, so they are not compared."""
    saved = {"arch": "gpt", **saved}
    return {k: (v, current.get(k)) for k, v in saved.items() if not k.endswith("dropout")
            and current.get(k) != v}


def vet_checkpoint(ck: Path):
    """The model config of checkpoint `ck` once its files are safe to load (guard.py): every file a regular
    one inside it, config.json's model section valid field by field, model.safetensors' header holding
    exactly the declared model, and that model fitting in memory (built in float32, plus the weights read
    from disk). Nothing is built (models.state_shapes); CheckpointError names the file and the field."""
    ck = Path(ck)
    check_files(ck, CheckpointError, DAMAGED)
    m = model_config_from(read_config(ck)["model"], ck / "config.json", CheckpointError, DAMAGED)
    shapes, groups, params = declared_shapes(m)
    stored = 0
    if not is_sharded(ck):
        f = ck / "model.safetensors"
        header = safetensors_header(f, CheckpointError, DAMAGED)
        problem = weights_problem(header, shapes, groups)
        if problem:
            raise CheckpointError(f"{f} does not hold the model {ck / 'config.json'} declares ({dims(m)}): "
                                  f"{problem}; {DAMAGED}")
        stored = header_bytes(header)
    check_memory(4 * params + stored, f"{ck / 'config.json'} declares a model of {params:,} parameters "
                                      f"({dims(m)}): building it in float32 and reading its weights",
                                      CheckpointError)
    return m


def check_compatible(ck: Path, model_cfg: dict, tokenizer_hash: str, what: str,
                     data: str = "the data") -> None:
    """Refuse a checkpoint whose weights do not fit `model_cfg` or whose tokenizer is not `tokenizer_hash`,
    or that does not pass vet_checkpoint (--resume calls this before its model is built; --init-from's
    checkpoint was vetted when the configuration was resolved, config.resolve)."""
    vet_checkpoint(ck)
    saved = read_config(ck)
    diff = shape_diff(saved["model"], model_cfg)
    if diff:
        raise CheckpointError(f"{what} {ck}: model shape differs (field: (checkpoint, this run)) {diff}; use "
                              f"the same model settings as the run you continue from")
    if saved.get("tokenizer_hash") != tokenizer_hash:
        raise CheckpointError(f"{what} {ck}: it was trained with tokenizer {saved.get('tokenizer_hash')} but "
                              f"{data} uses {tokenizer_hash}; prepare the data with that tokenizer")
