"""Documents -> token shards on disk, and the memmap reader.

Layout of a prepared directory:
  meta.json                 tokenizer hash, dtype, counts per split, skipped counts by reason, sources, options
  tokenizer/                a copy of the tokenizer the shards were made with
  train_000000.bin ...      raw token ids (uint16 when the vocab fits, else uint32), documents back to back,
  val_000000.bin ...        each followed by the end-of-text token
  train_docs.npy, val_docs.npy   int64 start offset of every document in the split's token stream
  train_digests.npy, val_digests.npy   uint64: the first 8 bytes of every document's content hash, in order,
                            so a run can record what it trained on and an evaluation can check its split
                            against it (data prepared before these files existed lacks them)
  train_000000.mask ...     chat data only (meta "chat": true): one uint8 per token, 1 where the token is
                            written by an assistant and carries loss as a target (chat.py)

Speed: one reader thread decodes and filters documents into a bounded queue while the main thread hands
batches to `encode_batch_fast`, which runs in Rust on all cores and releases the GIL, so reading overlaps
encoding and memory stays bounded by the queue. Order is kept, so the same inputs give identical bytes.

Memory: a batch closes at `batch_docs` documents or BATCH_BYTES (1 MiB) of text, whichever comes first.
The Rust tokenizer holds 150-320 bytes per byte of text while it encodes a document (measured with a
300-token vocabulary: 900 KB of code 140 MB, 900 KB of `b = 1` lines 290 MB), so one 512-document batch of
900 KB documents (a few KB as .jsonl.zst, or one parquet dictionary value repeated) took 20 GB. Now a batch
holds at most 1 MiB plus one document, so at most two documents of --max-file-bytes are encoded at once
(the Python stdlib: 1.06 GB peak before, 0.40 GB now, at the same speed).
"""

from __future__ import annotations

import array
import hashlib
import itertools
import json
import math
import os
import queue
import random
import shutil
import threading
import time
from pathlib import Path

import numpy as np

from .. import CodeforgeError, __version__
from ..atomic import publish, staging_dir
from ..chat import encode_conversation, read_conversations, render_text
from ..corpus import CorpusOptions, CorpusStats, content_hash, iter_documents, line_limit, split_of, walk_tree
from ..decontam import sources_state
from ..fim import repo_fim_document
from ..redact import RULES as REDACT_RULES
from ..tokenizer import CodeTokenizer, META_FILE, TOKENIZER_FILE, write_hf_config

SPLITS = ("train", "val")
FORMAT = "codeforge-shards-v1"
BATCH_BYTES = 1 << 20  # text per encoded batch (see Memory above)


class ShardError(CodeforgeError):
    """Prepared data is missing, incomplete or does not fit what it is used with."""


def dtype_for(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


class _SplitWriter:
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
        content hashes. A document never straddles two shards: one larger than a shard gets a shard of its own."""
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


def split_digests(data_dir: str | os.PathLike, split: str) -> np.ndarray | None:
    """The sorted, unique content-hash keys of a prepared split's documents, or None for data prepared before
    they were recorded (or a split file that does not match its document count)."""
    d = Path(data_dir)
    try:
        keys = np.load(d / f"{split}_digests.npy", allow_pickle=False)
        docs = json.loads((d / "meta.json").read_text())["splits"][split]["documents"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if keys.dtype != np.uint64 or keys.ndim != 1 or len(keys) != docs:
        return None
    return np.unique(keys)


def _fingerprint(sources: list[str], tok_hash: str, options: dict) -> str:
    """Identifies a dataset: the sources (with every file's size and modification time, so an edited or
    added file makes a new one), the tokenizer and the options."""
    h = hashlib.sha256(json.dumps({"tokenizer": tok_hash, "options": options}, sort_keys=True).encode())
    for src in sources:
        # os.fsencode: a file name need not be UTF-8 (Python holds its odd bytes as surrogates)
        h.update(os.fsencode(src if src.startswith("hf:") else os.path.abspath(src)))
        if os.path.isdir(src):
            for dirpath, dirnames, filenames in walk_tree(src):  # any depth (os.walk recurses)
                dirnames.sort()
                for name in sorted(filenames):
                    try:
                        st = os.stat(os.path.join(dirpath, name))
                    except OSError:
                        continue
                    h.update(os.fsencode(f"{dirpath}/{name}:{st.st_size}:{st.st_mtime_ns}"))
        elif os.path.exists(src):
            st = os.stat(src)
            h.update(f":{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def prepare(sources: list[str], tokenizer_dir: str | os.PathLike, out_dir: str | os.PathLike,
            opts: CorpusOptions | None = None, overwrite: bool = False, shard_tokens: int = 100_000_000,
            batch_docs: int = 512, log=print, chat: bool = False, repo_fim: float = 0.0) -> dict:
    """Read, filter, dedup, split and tokenize `sources` into shards under `out_dir`; return meta.
    chat: the sources are chat JSONL (chat.py); conversations are rendered with ChatML and a loss mask is
    written beside the tokens. repo_fim: the share of training files that also become a repo-level FIM
    document (fim.repo_fim_document: up to REPO_CONTEXT_FILES earlier files of the same directory as context,
    the file in PSM order after them), the layout llama-server's /infill builds for editors."""
    opts = opts or CorpusOptions()
    opts.validate()
    tok = CodeTokenizer.load(tokenizer_dir)
    out = Path(out_dir)
    if not 0.0 <= repo_fim <= 1.0:
        raise ShardError(f"--repo-fim {repo_fim}: give a share of the training files between 0 and 1")
    options = {**opts.to_dict(), "shard_tokens": shard_tokens, "chat": chat}
    if opts.decontaminate:  # what the benchmark sources hold now, and the rules secrets are replaced by
        options["decontaminate_state"] = sources_state(opts.decontaminate)
    if opts.redact_secrets:
        options["redact_rules"] = REDACT_RULES
    if repo_fim:  # only when asked: data prepared before this option keeps its fingerprint
        options["repo_fim"] = repo_fim
        missing = [t for t in ("<|repo_name|>", "<|file_sep|>", "<fim_prefix>") if tok.special_ids.get(t) is None]
        if missing:
            raise ShardError(f"--repo-fim needs the tokenizer's {', '.join(missing)} token(s), which {tokenizer_dir} "
                             f"lacks (it was trained before they existed): train a tokenizer again (`codeforge "
                             f"tokenizer train`), or leave out --repo-fim")
    fp = _fingerprint(sources, tok.hash, options)
    if out.exists() and any(out.iterdir()):
        old = out / "meta.json"
        same = old.exists() and json.loads(old.read_text()).get("fingerprint") == fp
        if same:
            log(f"{out} already holds this dataset (fingerprint {fp}); nothing to do")
            return json.loads(old.read_text())
        if not overwrite:
            raise ShardError(f"{out} already holds {'a different dataset' if old.exists() else 'other files'}; "
                             f"pass --overwrite to replace it or choose another --out")

    tmp = staging_dir(out)
    try:
        if chat:
            meta = _write_chat(sources, tok, tmp, opts, shard_tokens, batch_docs, log)
        else:
            meta = _write(sources, tok, tmp, opts, shard_tokens, batch_docs, log, repo_fim)
        meta.update(fingerprint=fp, options=options)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
        publish(tmp, out)  # only when complete: an interrupted run never leaves a directory that looks done
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    note = empty_validation_note(meta, opts.val_fraction)
    if note:
        log(note)
    return meta


SMALL_VALIDATION_TOKENS = 4096  # fewer validation tokens than one quickstart step reads: a noisy, easily flattered score


def empty_validation_note(meta: dict, val_fraction: float) -> str | None:
    """A warning when the validation split came out empty or too small to score on (a small corpus at a small
    --val-fraction), with the fraction that would give it a few documents and some thousands of tokens."""
    val = meta["splits"].get("val", {})
    docs, tokens = val.get("documents", 0), val.get("tokens", 0)
    total, all_tokens = meta.get("documents", 0), meta.get("tokens", 0)
    if total < 2 or val_fraction <= 0 or (docs >= 3 and (tokens >= SMALL_VALIDATION_TOKENS or tokens >= 0.1 * all_tokens)):
        return None
    share = max(3 / total, 5 * SMALL_VALIDATION_TOKENS / max(all_tokens, 1), 1.5 * val_fraction)  # always more
    want = min(0.5, max(0.05, math.ceil(share * 100) / 100))
    if not docs:
        return (f"warning: the validation split is empty: {total} documents at --val-fraction {val_fraction:g} left "
                f"none for it, so evaluation would score the training split (which flatters the model). Prepare "
                f"again with --val-fraction {want:g} (about {max(1, round(want * total))} documents) or with more files")
    return (f"warning: the validation split is small: {docs} document(s), {tokens:,} tokens at --val-fraction "
            f"{val_fraction:g}, too few to tell a model that learns from one that memorises. Prepare again with "
            f"--val-fraction {want:g} (about {max(1, round(want * total))} documents) or with more files")


REPO_CONTEXT_FILES, REPO_CONTEXT_CHARS = 2, 1500  # a repo-level document's context: files, characters each


class _RepoDocs:
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


def _write(sources, tok: CodeTokenizer, tmp: Path, opts: CorpusOptions, shard_tokens: int,
           batch_docs: int, log, repo_fim: float = 0.0) -> dict:
    dtype = dtype_for(tok.vocab_size)
    stats = CorpusStats()
    writers = {s: _SplitWriter(tmp, s, dtype, shard_tokens) for s in SPLITS}
    q: queue.Queue = queue.Queue(maxsize=4)  # bounded: at most ~6 batches of text in memory
    failure: list[BaseException] = []

    def reader() -> None:
        try:
            batch: list = []
            nbytes = 0
            for doc in iter_documents(sources, opts, stats):
                batch.append(doc)
                nbytes += doc.nbytes
                if len(batch) >= batch_docs or nbytes >= BATCH_BYTES:
                    q.put(batch)
                    batch, nbytes = [], 0
            if batch:
                q.put(batch)
        except BaseException as e:  # surfaced in the main thread
            failure.append(e)
        finally:
            q.put(None)

    t0 = time.perf_counter()
    th = threading.Thread(target=reader, daemon=True)
    th.start()
    repo = _RepoDocs(tok, sources, repo_fim) if repo_fim else None
    while (batch := q.get()) is not None:
        out: dict[str, tuple[list, list, list]] = {s: ([], [], []) for s in SPLITS}
        for doc, ids in zip(batch, tok.encode_batch([d.text for d in batch])):
            ids.append(tok.eot_id)
            split = split_of(doc.digest, opts.val_fraction)
            docs, nb, dg = out[split]
            docs.append(ids)
            nb.append(doc.nbytes)
            dg.append(doc.digest)
            if repo is not None and split == "train":  # never built from (or around) a validation file
                extra = repo.after(doc)
                if extra is not None:
                    docs.append(extra)
                    nb.append(0)  # its bytes are the file's, counted once
                    dg.append(doc.digest)
        for s, (docs, nb, dg) in out.items():
            if docs:
                writers[s].add(docs, sum(nb), digests=dg)
    th.join()
    if failure:
        raise failure[0]
    seconds = time.perf_counter() - t0
    splits = {s: w.close() for s, w in writers.items()}
    if stats.documents == 0:
        raise ShardError(f"the corpus is empty after filtering (skipped: {dict(stats.skipped) or 'nothing found'});"
                         f" check --languages, --max-file-bytes and the inputs")
    meta = _finish(tok, tmp, stats, splits, sources, seconds)
    if repo is not None:
        meta["repo_fim_documents"] = repo.made
    return meta


def _finish(tok: CodeTokenizer, tmp: Path, stats: CorpusStats, splits: dict, sources, seconds: float) -> dict:
    """Copy the tokenizer (with the chat template in its HF config) beside the shards; the meta dict."""
    shutil.copytree(tok.path, tmp / "tokenizer",
                    ignore=lambda d, names: [n for n in names if n not in (TOKENIZER_FILE, META_FILE)])
    write_hf_config(tmp / "tokenizer")
    total_bytes = sum(v["bytes"] for v in splits.values())
    total_tokens = sum(v["tokens"] for v in splits.values())
    return {
        "format": FORMAT, "codeforge_version": __version__, "tokenizer_hash": tok.hash,
        "vocab_size": tok.vocab_size, "eot_id": tok.eot_id, "dtype": dtype_for(tok.vocab_size).name, "splits": splits,
        "documents": stats.documents, "tokens": total_tokens, "bytes": total_bytes,
        "skipped": dict(sorted(stats.skipped.items())), "skipped_examples": stats.examples,
        "secrets_replaced": dict(sorted(stats.secrets.items())),
        "steps": {k: dict(zip(("documents_in", "bytes_in", "documents_out", "bytes_out"), v))
                  for k, v in stats.steps.items()},
        "sources": list(sources), "seconds": round(seconds, 2),
        "mb_per_s": round(total_bytes / 1e6 / max(seconds, 1e-9), 2),
        "tokens_per_s": round(total_tokens / max(seconds, 1e-9)),
    }


def _write_chat(sources, tok: CodeTokenizer, tmp: Path, opts: CorpusOptions, shard_tokens: int,
                batch_docs: int, log) -> dict:
    """Chat JSONL -> shards plus loss masks. Conversations are deduplicated exactly and split train/val by
    the hash of their rendered text; each ends with end-of-text (no loss)."""
    dtype = dtype_for(tok.vocab_size)
    stats = CorpusStats()
    writers = {s: _SplitWriter(tmp, s, dtype, shard_tokens, with_mask=True) for s in SPLITS}
    seen: set[bytes] = set()
    t0 = time.perf_counter()
    for messages, tools, where in read_conversations(sources, stats, opts.strict, line_limit(opts.max_file_bytes)):
        text = render_text(messages, tools)
        digest = content_hash(text)
        if digest in seen:
            stats.skip("duplicate", where)
            continue
        seen.add(digest)
        ids, mask = encode_conversation(tok, messages, tools)
        stats.documents += 1
        nbytes = len(text.encode("utf-8"))
        stats.bytes += nbytes
        writers[split_of(digest, opts.val_fraction)].add([ids + [tok.eot_id]], nbytes, [mask + [0]], [digest])
    splits = {s: w.close() for s, w in writers.items()}
    if stats.documents == 0:
        raise ShardError(f"no usable conversation in {list(sources)} (skipped: {dict(stats.skipped) or 'nothing found'}); "
                         f"each JSONL line needs {{\"messages\": [{{\"role\": ..., \"content\": ...}}, ...]}} with "
                         f"an assistant turn")
    meta = _finish(tok, tmp, stats, splits, sources, time.perf_counter() - t0)
    meta["chat"] = True
    meta["loss_tokens"] = {s: int(sum(np.fromfile(tmp / sh["file"].replace(".bin", ".mask"), dtype=np.uint8).sum()
                                      for sh in v["shards"])) for s, v in splits.items()}
    return meta


class ShardSet:
    """Read side: the token stream of one split as a list of memmaps, plus the document index."""

    def __init__(self, data_dir: str | os.PathLike, split: str = "train"):
        self.dir = Path(data_dir)
        meta_path = self.dir / "meta.json"
        if not meta_path.exists():
            raise ShardError(f"{self.dir} is not a prepared data directory (no meta.json); "
                             f"run `codeforge prepare --input SRC --tokenizer TOK --out {self.dir}`")
        self.meta = json.loads(meta_path.read_text())
        if self.meta.get("format") != FORMAT:
            raise ShardError(f"{meta_path}: unknown format {self.meta.get('format')!r}, expected {FORMAT}")
        if split not in self.meta["splits"]:
            raise ShardError(f"{self.dir} has no split {split!r}; it has {list(self.meta['splits'])}")
        info = self.meta["splits"][split]
        self.split = split
        dtype = np.dtype(self.meta["dtype"])
        self.arrays = []
        for s in info["shards"]:
            path = self.dir / s["file"]
            if not path.exists() or path.stat().st_size != s["tokens"] * dtype.itemsize:
                raise ShardError(f"shard {path} is missing or truncated; prepare the data again")
            self.arrays.append(np.memmap(path, dtype=dtype, mode="r"))
        self.chat = bool(self.meta.get("chat"))
        self.masks = []  # chat data: per shard, 1 where the token carries loss
        for s in info["shards"] if self.chat else []:
            path = self.dir / s["file"].replace(".bin", ".mask")
            if not path.exists() or path.stat().st_size != s["tokens"]:
                raise ShardError(f"loss mask {path} is missing or truncated; prepare the data again")
            self.masks.append(np.memmap(path, dtype=np.uint8, mode="r"))
        self.tokens = info["tokens"]
        self.documents = info["documents"]

    @property
    def tokenizer_hash(self) -> str:
        return self.meta["tokenizer_hash"]

    def check_tokenizer(self, tok_hash: str, what: str = "the given tokenizer") -> None:
        """Refuse to use shards with a tokenizer other than the one they were made with."""
        if tok_hash != self.tokenizer_hash:
            raise ShardError(f"{self.dir} was prepared with tokenizer {self.tokenizer_hash} but {what} is "
                             f"{tok_hash}; prepare the data again with this tokenizer or use the matching one")

    def doc_starts(self) -> np.ndarray:
        return np.load(self.dir / f"{self.split}_docs.npy")

    def span(self, start: int, end: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Tokens [start, end) of the split's stream (within one shard, as every document is) and their
        loss mask (chat data) or None."""
        bounds = self._bounds()
        s = int(np.searchsorted(bounds, start, side="right") - 1)
        a, b = start - bounds[s], end - bounds[s]
        return self.arrays[s][a:b], (self.masks[s][a:b] if self.chat else None)

    def _bounds(self) -> np.ndarray:
        if not hasattr(self, "_bounds_cache"):
            self._bounds_cache = np.cumsum([0] + [len(a) for a in self.arrays])
        return self._bounds_cache

    def document(self, i: int) -> np.ndarray:
        """Token ids of document i, without its end-of-text separator, sliced from its shard's memmap
        (the writer never splits a document across shards)."""
        starts = self.doc_starts()
        start, end = int(starts[i]), int(starts[i + 1]) if i + 1 < len(starts) else self.tokens
        bounds = np.cumsum([0] + [len(a) for a in self.arrays])
        s = int(np.searchsorted(bounds, start, side="right") - 1)
        return self.arrays[s][start - bounds[s]:end - bounds[s] - 1]
