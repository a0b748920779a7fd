"""What a run trained on, by document: so a score can say whether it comes from code the model has seen.

A prepared split records every document's content hash (shards.py, `*_digests.npy`). Every training stage
writes, when it starts, the keys of the documents it trains on, with those of the runs it started from, to
RUN/trained_documents.npy (rundir.TRAINED), and beside them RUN/trained_documents.json (rundir.TRAINED_INFO):
what else went into the model that has no key, in words. A record with nothing unknown is complete. What
cannot be keyed is said, never left out: an imported open model (what it was trained on is not known), a run
from before the records, data prepared before keys were recorded, and data whose text quotes files under
other keys (chat conversations, preference pairs and plans mined from your files' functions).

Readers take `trained_record(RUN)`: evaluation leaves out every document whose key is recorded, and calls
what is left held-out only when the record is complete; otherwise it says what is not known (`.unknown`).
`trained_documents(RUN)` is the old reader: the keys of a complete record, or None.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .. import CodeforgeError, printable, rundir
from ..checkpoint import find_checkpoint, read_config
from .shards import split_digests

EMPTY = np.zeros(0, dtype=np.uint64)


@dataclass(frozen=True)
class TrainedRecord:
    """What a run trained on as far as it is known: `keys`, the sorted uint64 content-hash keys of the
    documents it (and the runs it started from) trained on; `reasons`, each thing it also trained on whose
    documents have no key, in the user's words (none: the record is complete)."""
    keys: np.ndarray
    reasons: tuple[str, ...] = ()

    @property
    def complete(self) -> bool:
        """Every document the model was trained on is among `keys`: what is not among them is held out."""
        return not self.reasons

    @property
    def unknown(self) -> str | None:
        """What the record cannot say, in words (None: nothing; the record is complete)."""
        return "; ".join(self.reasons) or None


def run_of(path: str | os.PathLike) -> Path:
    """The run directory of a run or of one of its checkpoints (RUN/checkpoints/step_NNNNNN)."""
    p = Path(path)
    return p.parent.parent if p.parent.name == rundir.CHECKPOINTS else p


def imported_reason(name: str) -> str:
    """What an imported model's record says it does not know (`codeforge import --hf`): `name`, its Hub name
    (ORG/NAME) or the name of the directory it came from."""
    return f"the imported model {printable(name)}: what it was trained on is not known"


def adapter_reason(name: str) -> str:
    """What a run merged from an adapter (`codeforge import --adapter`) does not know, beside its base's."""
    return f"the adapter {printable(name)}: what it was trained on is not known"


def _load(path: Path) -> np.ndarray | None:
    try:
        keys = np.load(path, allow_pickle=False)
    except (OSError, ValueError):
        return None
    return keys if keys.dtype == np.uint64 and keys.ndim == 1 else None


def _sha256(keys: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(keys, dtype="<u8").tobytes()).hexdigest()


def _info(path: Path) -> dict | None:
    """RUN/trained_documents.json as {"sha256", "unknown"}, or None when it is not one."""
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    ok = (isinstance(info, dict) and isinstance(info.get("sha256"), str)
          and isinstance(info.get("unknown"), list) and all(isinstance(x, str) for x in info["unknown"]))
    return info if ok else None


def _unrecorded(run: Path, depth: int = 0) -> TrainedRecord:
    """The record of a run that left none: an imported model's says where it came from; an adapter merged
    onto a base (`codeforge import --adapter`) keeps the base's record, and says the adapter's is unknown."""
    try:
        cfg = read_config(find_checkpoint(run, "auto", log=lambda m: None, verify=False))
    except (CodeforgeError, OSError, ValueError):
        cfg = {}
    imported = cfg.get("imported_from")
    imported = imported if isinstance(imported, dict) else {}
    hub, path, adapter = imported.get("hub"), imported.get("path"), imported.get("adapter")
    if isinstance(hub, str) and hub:  # ORG/NAME says more than the cache directory it was read from
        return TrainedRecord(EMPTY, (imported_reason(hub),))
    if isinstance(path, str) and path:
        return TrainedRecord(EMPTY, (imported_reason(Path(path).name or path),))
    lora_base = cfg.get("lora_base")
    base = lora_base.get("checkpoint") if isinstance(lora_base, dict) else None
    if isinstance(adapter, str) and adapter:
        why = adapter_reason(Path(adapter).name or adapter)
        # a chain of merged adapters ends at a run with a record or without one; 8 deep is past any real one
        before = _record(run_of(base), depth + 1) if isinstance(base, str) and depth < 8 else None
        return TrainedRecord(EMPTY if before is None else before.keys,
                             (why, *(before.reasons if before is not None else ())))
    return TrainedRecord(EMPTY, (f"the run {printable(str(run))}: it left no record of what it trained on "
                                 f"(trained before codeforge recorded it, or made elsewhere)",))


def _stored(run: Path) -> TrainedRecord | None:
    """The record RUN holds, or None when it holds none or a damaged one."""
    keys = _load(run / rundir.TRAINED)
    if not (run / rundir.TRAINED_INFO).exists():
        # written before the .json existed, when only a complete record was written at all
        return None if keys is None else TrainedRecord(keys)
    info = _info(run / rundir.TRAINED_INFO)
    if info is None or keys is None or _sha256(keys) != info["sha256"]:
        return None
    return TrainedRecord(keys, tuple(info["unknown"]))


def trained_record(run_dir: str | os.PathLike) -> TrainedRecord:
    """What the run (a run directory or one of its checkpoints) trained on, as far as it is known."""
    return _record(run_of(run_dir), 0)


def _record(run: Path, depth: int) -> TrainedRecord:
    """trained_record; depth: how many merged adapters deep `run` is (a guard against a cycle of them)."""
    stored = _stored(run)
    if stored is not None:
        return stored
    if not _any_file(run):
        return _unrecorded(run, depth)
    # a start cut short between the two files, or an edited one: the keys there are still documents left out
    # of a score (leaving out more never flatters the model), but nothing is called complete
    keys = _load(run / rundir.TRAINED)
    return TrainedRecord(EMPTY if keys is None else keys,
                         (f"the run {printable(str(run))}: its {rundir.TRAINED} and {rundir.TRAINED_INFO} do "
                          f"not match (a start cut short, or edited); `codeforge train --resume` writes them "
                          f"again",))


def _any_file(run: Path) -> bool:
    return (run / rundir.TRAINED).exists() or (run / rundir.TRAINED_INFO).exists()


def recorded(run_dir: str | os.PathLike) -> bool:
    """Whether the run holds an intact record (complete or not) of what it trained on."""
    return _stored(run_of(run_dir)) is not None


def trained_documents(run_dir: str | os.PathLike) -> np.ndarray | None:
    """The sorted keys of the documents a run trained on when its record is complete, else None (use
    trained_record for the keys that are known and what is not)."""
    r = trained_record(run_dir)
    return r.keys if r.complete else None


def write_record(run_dir: str | os.PathLike, keys: np.ndarray, unknown: Iterable[str] = ()) -> TrainedRecord:
    """Write RUN's record: `keys` (sorted and made unique here) and what else it trained on, in words."""
    run = Path(run_dir)
    run.mkdir(parents=True, exist_ok=True)
    keys = np.unique(np.asarray(keys, dtype=np.uint64))
    reasons = tuple(dict.fromkeys(unknown))  # once each, in order: a chain of runs repeats its base's
    info = {"documents": int(len(keys)), "sha256": _sha256(keys), "unknown": list(reasons)}

    def put(name: str, write) -> None:
        tmp = run / f".{name}.tmp-{os.getpid()}"
        with open(tmp, "wb") as f:
            write(f)
        os.replace(tmp, run / name)
    # the .json first: a start cut short before the keys follow leaves a checksum that does not match them,
    # read as an incomplete record, never as a complete one of the keys an earlier start left
    put(rundir.TRAINED_INFO, lambda f: f.write((json.dumps(info, indent=1) + "\n").encode()))
    put(rundir.TRAINED, lambda f: np.save(f, keys))
    return TrainedRecord(keys, reasons)


def record_trained(run_dir: str | os.PathLike, data_dir: str | os.PathLike | None = None,
                   started_from: str | os.PathLike | None = None, *,
                   also_from: Iterable[str | os.PathLike] = (), unknown: Iterable[str] = ()) -> TrainedRecord:
    """Write RUN's record: the training split of the prepared `data_dir` (None: the stage's data has no
    document keys; say why in `unknown`), with the records of the run `started_from` names (a run directory
    or one of its checkpoints) and of the runs in `also_from` (a reward model that scores the samples), and
    `unknown`. What cannot be keyed makes the record incomplete; nothing known is dropped."""
    keys, reasons = [], list(unknown)
    if data_dir is not None:
        own = split_digests(data_dir, "train")
        if own is None:
            reasons.append(f"the data {printable(str(data_dir))}: prepared before codeforge recorded its "
                           f"documents (prepare it again to record them)")
        else:
            keys.append(own)
        try:
            chat = bool(json.loads((Path(data_dir) / "meta.json").read_text()).get("chat"))
        except (OSError, ValueError, AttributeError):
            chat = False
        if chat:  # a conversation's key is its own text's: the files its code came from go unrecorded
            reasons.append(f"the conversations in {printable(str(data_dir))}: each is recorded whole, not by "
                           f"the files whose code it quotes (make-sft answers with your files' functions)")
    for start in ([started_from] if started_from else []) + list(also_from):
        before = trained_record(start)
        keys.append(before.keys)
        reasons.extend(before.reasons)
    return write_record(run_dir, np.concatenate(keys) if keys else EMPTY, reasons)


def seen_in_training(run_dir: str | os.PathLike, data_dir: str | os.PathLike,
                     split: str = "val") -> dict | None:
    """{"documents": the split's documents, "trained_on": how many of them the run is known to have trained
    on, "complete": whether that is all of them, "unknown": what the record cannot say}, or None when there
    is nothing to compare: the split has no keys, or the record is incomplete and finds none of them (a
    count of 0 would read as "none trained on")."""
    record = trained_record(run_dir)
    keys = split_digests(data_dir, split)
    if keys is None:
        return None
    n = int(np.isin(keys, record.keys, assume_unique=True).sum())
    if not n and not record.complete:
        return None
    return {"documents": int(len(keys)), "trained_on": n, "complete": record.complete,
            "unknown": record.unknown}


def data_identity(data_dir: str | Path, sample: int = 1 << 16) -> dict:
    """What the training split of a prepared data directory is, cheaply enough to take at every start: the
    tokenizer, the kind of data, its token and document counts, and for every train_* file its size and the
    sha256 of three `sample`-byte pieces (start, middle, end): a changed, added or removed shard shows."""
    d = Path(data_dir)
    meta = json.loads((d / "meta.json").read_text())
    files = {}
    for f in sorted(d.glob("train_*")):
        n = f.stat().st_size
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            for off in sorted({0, max(0, n // 2 - sample // 2), max(0, n - sample)}):
                fh.seek(off)
                h.update(fh.read(sample))
        files[f.name] = f"{n} bytes, sha256 of samples {h.hexdigest()[:16]}"
    tr = meta["splits"]["train"]
    return {"tokenizer_hash": meta.get("tokenizer_hash"), "chat": bool(meta.get("chat")),
            "tokens": tr["tokens"], "documents": tr["documents"], "files": files}
