"""Write a directory aside, then rename it into place: a crash never leaves one that looks complete.

Used for tokenizers, prepared shards and checkpoints. `staging_dir(out)` gives an empty hidden sibling of
`out` (same filesystem, so the rename is atomic); `publish(tmp, out)` moves it into place, replacing an
existing `out` only after the new one is complete.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def staging_dir(out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def publish(tmp: Path, out: Path) -> None:
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(out)
