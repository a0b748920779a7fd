"""What a run trained on, by document: so a score can say whether it comes from code the model has seen.

A prepared split records every document's content hash (shards.py, `*_digests.npy`). When a language-model
run starts, it writes the keys of its training split, and of the runs it started from with --init-from, to
RUN/trained_documents.npy (rundir.TRAINED). `codeforge eval` then counts how many of the validation documents
it scores are among them: a split prepared again with another --val-fraction, or a corpus that gained files
the run trained on elsewhere, is said loudly instead of flattering the model in silence.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from .. import rundir
from .shards import split_digests


def _load(path: Path) -> np.ndarray | None:
    try:
        keys = np.load(path, allow_pickle=False)
    except (OSError, ValueError):
        return None
    return keys if keys.dtype == np.uint64 and keys.ndim == 1 else None


def trained_documents(run_dir: str | os.PathLike) -> np.ndarray | None:
    """The sorted keys of the documents a run trained on, or None when it did not record them (a run from
    before they were recorded, or one whose data lacked them)."""
    return _load(Path(run_dir) / rundir.TRAINED)


def record_trained(run_dir: str | os.PathLike, data_dir: str | os.PathLike,
                   started_from: str | os.PathLike | None = None) -> int | None:
    """Write RUN/trained_documents.npy: the training split's document keys, with those of the run
    `started_from` names (a run directory or one of its checkpoints). Returns the number of documents
    recorded, or None when that cannot be known (data prepared before keys were recorded, or a starting run
    that recorded none): then nothing is written, and evaluation says it cannot check."""
    run = Path(run_dir)
    keys = split_digests(data_dir, "train")
    if keys is not None and started_from:
        p = Path(started_from)
        before = trained_documents(p.parent.parent if p.parent.name == rundir.CHECKPOINTS else p)
        # a starting run that recorded nothing makes this run's record unknowable, not its own split alone
        keys = None if before is None else np.union1d(keys, before)
    if keys is None:
        # no stale record from an earlier start in this directory
        (run / rundir.TRAINED).unlink(missing_ok=True)
        return None
    run.mkdir(parents=True, exist_ok=True)
    tmp = run / f".{rundir.TRAINED}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        np.save(f, keys.astype(np.uint64))
    os.replace(tmp, run / rundir.TRAINED)
    return int(len(keys))


def seen_in_training(run_dir: str | os.PathLike, data_dir: str | os.PathLike,
                     split: str = "val") -> dict | None:
    """{"documents": the split's documents, "trained_on": how many of them the run trained on}, or None when
    either side has no record to compare."""
    trained = trained_documents(run_dir)
    keys = split_digests(data_dir, split)
    if trained is None or keys is None:
        return None
    return {"documents": int(len(keys)), "trained_on": int(np.isin(keys, trained, assume_unique=True).sum())}


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
