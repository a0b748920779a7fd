"""Token ids -> shard files, and what every prepared directory's meta.json says.

SplitWriter appends documents to numbered shard files of one split (with the documents' start offsets and
content hashes beside them); RepoDocs makes the repo-level FIM documents of `prepare --repo-fim`; finish_meta
copies the tokenizer beside the shards and gathers the report. shards.py (chat) and pipeline.py (code) write
through them, so both give the same layout (shards.py's docstring describes it).
"""

from __future__ import annotations

import array
import itertools
import os
import random
import shutil
from pathlib import Path

import numpy as np

from .. import CodeforgeError, __version__
from ..corpus import CorpusStats
from ..fim import repo_fim_document
from ..tokenizer import CodeTokenizer, META_FILE, TOKENIZER_FILE, write_hf_config

SPLITS = ("train", "val")
FORMAT = "codeforge-shards-v1"
BATCH_BYTES = 1 << 20  # text per encoded batch (see shards.py's Memory)


class ShardError(CodeforgeError):
    """Prepared data is missing, incomplete or does not fit what it is used with."""


def dtype_for(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


class SplitWriter:
    """Appends documents' token ids to numbered shard files of at most `shard_tokens` tokens."""

    def __init__(self, out: Path, split: str, dtype: np.dtype, shard_tokens: int, with_mask: bool = False):
        self.out, self.split, self.dtype, self.shard_tokens = out, split, dtype, shard_tokens
        self.with_mask = with_mask
        self._m = None
        self.shards: list[dict] = []
        self.doc_starts = array.array("q")  # 8 bytes per document, not a Python int object each
        self.digests = array.array("Q")  # the documents' content hashes (first 8 bytes), in the same order
        self.tokens = 0
        self.bytes = 0
        self._f = None
        self._in_shard = 0

    def _open_next(self) -> None:
        if self._f:
            self._f.close()
        name = f"{self.split}_{len(self.shards):06d}.bin"
        self.shards.append({"file": name, "tokens": 0})
        self._f = open(self.out / name, "wb")
        if self.with_mask:
            if self._m:
                self._m.close()
            self._m = open(self.out / name.replace(".bin", ".mask"), "wb")
        self._in_shard = 0

    def add(self, docs: list[list[int]], n_bytes: int, masks: list[list[int]] | None = None,
            digests: list[bytes] = ()) -> None:
        """Append documents (id lists already ending in end-of-text) in one write per shard touched, and their
        content hashes. A document never straddles two shards: one larger than a shard gets a shard of its
        own."""
        self.digests.extend(digest_key(d) for d in digests)
        flat = np.fromiter(itertools.chain.from_iterable(docs), dtype=self.dtype)
        flat_m = np.fromiter(itertools.chain.from_iterable(masks), dtype=np.uint8) if self.with_mask else None
        lens = [len(d) for d in docs]
        i = 0  # first document not yet written
        while i < len(docs):
            if self._f is None or (self._in_shard and self._in_shard + lens[i] > self.shard_tokens):
                self._open_next()
            j, room, n = i, self.shard_tokens - self._in_shard, 0
            while j < len(docs) and (n + lens[j] <= room or (j == i and self._in_shard == 0)):
                self.doc_starts.append(self.tokens + n)
                n += lens[j]
                j += 1
            start = sum(lens[:i]) if i else 0
            flat[start:start + n].tofile(self._f)
            if flat_m is not None:
                flat_m[start:start + n].tofile(self._m)
            self._in_shard += n
            self.shards[-1]["tokens"] += n
            self.tokens += n
            i = j
        self.bytes += n_bytes

    def close(self) -> dict:
        if self._f:
            self._f.close()
        if self._m:
            self._m.close()
        np.save(self.out / f"{self.split}_docs.npy", np.frombuffer(self.doc_starts, dtype=np.int64))
        np.save(self.out / f"{self.split}_digests.npy", np.frombuffer(self.digests, dtype=np.uint64))
        return {"shards": self.shards, "tokens": self.tokens, "documents": len(self.doc_starts),
                "bytes": self.bytes}


def digest_key(digest: bytes) -> int:
    """A document's content hash as the uint64 the *_digests.npy files hold."""
    return int.from_bytes(digest[:8], "big")


REPO_CONTEXT_FILES, REPO_CONTEXT_CHARS = 2, 1500  # a repo-level document's context: files, characters each


class RepoDocs:
    """Repo-level FIM documents for training files (prepare's repo_fim): each chosen file (by its content
    hash) with up to REPO_CONTEXT_FILES of the training files read just before it from the same directory.
    Deterministic: the walk's order, the hash's choice and cut."""

    def __init__(self, tok: CodeTokenizer, sources, rate: float):
        self.tok, self.rate = tok, rate
        self.roots = [os.path.abspath(s) for s in sources if os.path.isdir(s)]
        self.dir, self.recent = None, []
        self.made = 0

    def after(self, doc) -> list[int] | None:
        """The repo-level document for this training file, or None; remembers it as context for the next."""
        src = os.path.abspath(doc.source)
        root = next((r for r in self.roots if src.startswith(r + os.sep)), None)
        if root is None:
            return None
        rel = os.path.relpath(src, root)
        here = (root, os.path.dirname(rel))
        if here != self.dir:
            self.dir, self.recent = here, []
        out = None
        if int.from_bytes(doc.digest[8:16], "big") / 2**64 < self.rate and len(doc.text) >= 2:
            rng = random.Random(doc.digest)
            cut = tuple(sorted(rng.randint(0, len(doc.text)) for _ in range(2)))
            out = repo_fim_document(self.tok, os.path.basename(root), list(self.recent), rel, doc.text, cut)
            self.made += 1
        self.recent = (self.recent + [(rel, doc.text[:REPO_CONTEXT_CHARS])])[-REPO_CONTEXT_FILES:]
        return out


def finish_meta(tok: CodeTokenizer, tmp: Path, stats: CorpusStats, splits: dict, sources,
                seconds: float) -> dict:
    """Copy the tokenizer (with the chat template in its HF config) beside the shards; the meta dict."""
    shutil.copytree(tok.path, tmp / "tokenizer",
                    ignore=lambda d, names: [n for n in names if n not in (TOKENIZER_FILE, META_FILE)])
    write_hf_config(tmp / "tokenizer")
    total_bytes = sum(v["bytes"] for v in splits.values())
    total_tokens = sum(v["tokens"] for v in splits.values())
    return {
        "format": FORMAT, "codeforge_version": __version__, "tokenizer_hash": tok.hash,
        "vocab_size": tok.vocab_size, "eot_id": tok.eot_id, "dtype": dtype_for(tok.vocab_size).name,
        "splits": splits, "documents": stats.documents, "tokens": total_tokens, "bytes": total_bytes,
        "skipped": dict(sorted(stats.skipped.items())), "skipped_examples": stats.examples,
        "secrets_replaced": dict(sorted(stats.secrets.items())),
        "steps": {k: dict(zip(("documents_in", "bytes_in", "documents_out", "bytes_out"), v))
                  for k, v in stats.steps.items()},
        "sources": list(sources), "seconds": round(seconds, 2),
        "mb_per_s": round(total_bytes / 1e6 / max(seconds, 1e-9), 2),
        "tokens_per_s": round(total_tokens / max(seconds, 1e-9)),
    }
