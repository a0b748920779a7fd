"""Documents -> token shards on disk, and the memmap reader.

Layout of a prepared directory:
  meta.json                 tokenizer hash, dtype, counts per split, skipped counts by reason, sources,
                            options
  tokenizer/                a copy of the tokenizer the shards were made with
  train_000000.bin ...      raw token ids (uint16 when the vocab fits, else uint32), documents back to back,
  val_000000.bin ...        each followed by the end-of-text token
  train_docs.npy, val_docs.npy   int64 start offset of every document in the split's token stream
  train_digests.npy, val_digests.npy   uint64: the first 8 bytes of every document's content hash, in order,
                            so a run can record what it trained on and an evaluation can check its split
                            against it (data prepared before these files existed lacks them)
  train_000000.mask ...     chat data only (meta "chat": true): one uint8 per token, 1 where the token is
                            written by an assistant and carries loss as a target (chat.py)

Speed: code runs as a datatrove pipeline (pipeline.py): tasks of whole files on --workers processes, the
same shards for any number of them. Chat data (--chat) is read and encoded here, in one process.

Memory: a batch closes at 512 documents (`batch_docs` for chat) or BATCH_BYTES (1 MiB) of text, whichever
comes first. The Rust tokenizer holds 150-320 bytes per byte of text while it encodes a document (measured
with a 300-token vocabulary: 900 KB of code 140 MB, 900 KB of `b = 1` lines 290 MB), so one 512-document
batch of 900 KB documents (a few KB as .jsonl.zst, or one parquet dictionary value repeated) took 20 GB. Now
a batch holds at most 1 MiB plus one document, so at most two documents of --max-file-bytes are encoded at
once (the Python stdlib: 1.06 GB peak before, 0.40 GB now, at the same speed).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import time
from pathlib import Path

import numpy as np

from .. import CodeforgeError
from ..atomic import clean_stale, publish, staging_dir
from ..chat import encode_conversation, read_conversations, render_text
from ..corpus import CorpusOptions, CorpusStats, content_hash, line_limit, split_of, walk_tree
from ..decontam import sources_state
from ..fields import check_fields
from ..redact import RULES as REDACT_RULES
from ..tokenizer import CodeTokenizer
from . import pipeline  # the engine (datatrove: ~0.4 s to import, and it resets loguru's default handler)
from . import workdir
from .options import PrepareOptions
from .writer import FORMAT, SPLITS, ShardError, SplitWriter, digest_key, dtype_for, finish_meta

__all__ = ["FORMAT", "SPLITS", "ShardError", "ShardSet", "digest_key", "prepare", "split_digests"]


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
            batch_docs: int = 512, log=print, chat: bool = False, repo_fim: float = 0.0,
            workers: int | None = None, executor: str = "local", tasks: int | None = None,
            slurm: dict | None = None) -> dict | None:
    """Read, filter, dedup, split and tokenize `sources` into shards under `out_dir`; return meta.
    Code runs as a datatrove pipeline (pipeline.py): `workers` processes (default: pipeline.auto_workers) on
    `executor` "local", or Slurm job arrays ("slurm", options in `slurm`; returns None once submitted); the
    same command resumes after a kill. `tasks` overrides the task count the corpus sets (the shards depend on
    it, never on the workers). chat: the sources are chat JSONL (chat.py); conversations are rendered with
    ChatML and a loss mask is written beside the tokens (in this process). repo_fim: the share of training
    files that also become a repo-level FIM document (fim.repo_fim_document: up to REPO_CONTEXT_FILES earlier
    files of the same directory as context, the file in PSM order after them), the layout llama-server's
    /infill builds for editors."""
    opts = opts or CorpusOptions()
    # what the CLI checked already (fields.from_args), for callers in code: against the same declarations
    opts.validate("prepare")
    check_fields(PrepareOptions(repo_fim=repo_fim, shard_tokens=shard_tokens, workers=workers or 0),
                 "prepare", via_set=False)
    tok = CodeTokenizer.load(tokenizer_dir)
    out = Path(out_dir)
    options = {**opts.to_dict(), "shard_tokens": shard_tokens, "chat": chat}
    if opts.decontaminate:  # what the benchmark sources hold now, and the rules secrets are replaced by
        options["decontaminate_state"] = sources_state(opts.decontaminate)
    if opts.redact_secrets:
        options["redact_rules"] = REDACT_RULES
    if tasks:  # the shards depend on the task count: a given --tasks is part of the dataset's identity
        options["tasks"] = tasks
    if repo_fim:  # only when asked: data prepared before this option keeps its fingerprint
        options["repo_fim"] = repo_fim
        missing = [t for t in ("<|repo_name|>", "<|file_sep|>", "<fim_prefix>")
                   if tok.special_ids.get(t) is None]
        if missing:
            raise ShardError(f"--repo-fim needs the tokenizer's {', '.join(missing)} token(s), which "
                             f"{tokenizer_dir} lacks (it was trained before they existed): train a tokenizer "
                             "again (`codeforge tokenizer train`), or leave out --repo-fim")
    if chat and executor != "local":
        raise ShardError(f"--chat data is prepared in this process: leave out --executor {executor}")
    fp = _fingerprint(sources, tok.hash, options)
    if out.exists() and any(out.iterdir()):
        old = out / "meta.json"
        same = old.exists() and json.loads(old.read_text()).get("fingerprint") == fp
        if same:
            log(f"{out} already holds this dataset (fingerprint {fp}); nothing to do")
            shutil.rmtree(work_dir(out, fp), ignore_errors=True)  # left by a cluster run that published it
            return json.loads(old.read_text())
        if not overwrite:
            what = "a different dataset" if old.exists() else "other files"
            raise ShardError(f"{out} already holds {what}; pass --overwrite to replace it or choose another "
                             "--out")

    if chat:
        tmp = staging_dir(out)
        try:
            meta = _write_chat(sources, tok, tmp, opts, shard_tokens, batch_docs, log)
            meta.update(fingerprint=fp, options=options)
            (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
            # only when complete: an interrupted run never leaves a directory that looks done
            publish(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    else:
        meta = _run_pipeline(sources, tokenizer_dir, out, opts, fp, options, shard_tokens, repo_fim, workers,
                             executor, tasks, slurm, log)
        if meta is None:  # submitted to a cluster
            return None
    note = empty_validation_note(meta, opts.val_fraction)
    if note:
        log(note)
    return meta


def work_dir(out: Path, fingerprint: str) -> Path:
    """Where a code dataset is built between stages (pipeline.py), beside OUT: the same command (the same
    fingerprint) finds it again and resumes."""
    return out.parent / f".{out.name}.prepare-{fingerprint}"


def _run_pipeline(sources, tokenizer_dir, out: Path, opts: CorpusOptions, fp: str, options: dict,
                  shard_tokens: int, repo_fim: float, workers: int | None, executor: str, tasks: int | None,
                  slurm: dict | None, log) -> dict | None:
    """pipeline.run in this dataset's work directory; work directories of other fingerprints for the same
    OUT are removed (their inputs or options changed), unless a prepare still runs in one (its lock is held)
    or Slurm jobs may (refused, with the directory named: workdir.remove_others). A data error (an empty
    corpus, --strict) removes the work directory too; an interruption keeps it, for the rerun."""
    work = work_dir(out, fp)
    out.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(out.parent)  # what killed prepares of the single-process kind (chat) left behind
    # other inputs or options: never resumed; but one a prepare runs in, or Slurm jobs may, is refused
    workdir.remove_others(out, work, log)
    if work.exists():
        log(f"resuming the unfinished prepare in {work}")
    extra = {"fingerprint": fp, "options": options}
    try:
        meta = pipeline.run(sources, tokenizer_dir, work, out, opts, shard_tokens, repo_fim, extra, workers,
                            executor, tasks, slurm, log)
    # a stage that failed, a busy or submitted directory: the work stays for the rerun
    except pipeline.KeepWork:
        raise
    except CodeforgeError:  # in the data (an empty corpus, --strict): a rerun would meet it again
        shutil.rmtree(work, ignore_errors=True)
        raise
    if meta is not None:
        shutil.rmtree(work, ignore_errors=True)
    return meta


# fewer validation tokens than one quickstart step reads: a noisy, easily flattered score
SMALL_VALIDATION_TOKENS = 4096


def empty_validation_note(meta: dict, val_fraction: float) -> str | None:
    """A warning when the validation split came out empty or too small to score on (a small corpus at a small
    --val-fraction), with the fraction that would give it a few documents and some thousands of tokens."""
    val = meta["splits"].get("val", {})
    docs, tokens = val.get("documents", 0), val.get("tokens", 0)
    total, all_tokens = meta.get("documents", 0), meta.get("tokens", 0)
    if total < 2 or val_fraction <= 0 or (docs >= 3 and (tokens >= SMALL_VALIDATION_TOKENS
                                                         or tokens >= 0.1 * all_tokens)):
        return None
    # the share that would give 3 documents and 5 times SMALL_VALIDATION_TOKENS, always more than was given
    share = max(3 / total, 5 * SMALL_VALIDATION_TOKENS / max(all_tokens, 1), 1.5 * val_fraction)
    want = min(0.5, max(0.05, math.ceil(share * 100) / 100))
    about = f"--val-fraction {want:g} (about {max(1, round(want * total))} documents)"
    if not docs:
        return (f"warning: the validation split is empty: {total} documents at --val-fraction "
                f"{val_fraction:g} left none for it, so evaluation would score the training split (which "
                f"flatters the model). Prepare again with {about} or with more files")
    return (f"warning: the validation split is small: {docs} document(s), {tokens:,} tokens at "
            f"--val-fraction {val_fraction:g}, too few to tell a model that learns from one that memorises. "
            f"Prepare again with {about} or with more files")


def _write_chat(sources, tok: CodeTokenizer, tmp: Path, opts: CorpusOptions, shard_tokens: int,
                batch_docs: int, log) -> dict:
    """Chat JSONL -> shards plus loss masks. Conversations are deduplicated exactly and split train/val by
    the hash of their rendered text; each ends with end-of-text (no loss)."""
    dtype = dtype_for(tok.vocab_size)
    stats = CorpusStats()
    writers = {s: SplitWriter(tmp, s, dtype, shard_tokens, with_mask=True) for s in SPLITS}
    seen: set[bytes] = set()
    t0 = time.perf_counter()
    for messages, tools, where in read_conversations(sources, stats, opts.strict,
                                                     line_limit(opts.max_file_bytes)):
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
        raise ShardError(f"no usable conversation in {list(sources)} (skipped: "
                         f"{dict(stats.skipped) or 'nothing found'}); each JSONL line needs "
                         '{"messages": [{"role": ..., "content": ...}, ...]} with an assistant turn')
    meta = finish_meta(tok, tmp, stats, splits, sources, time.perf_counter() - t0)
    meta["chat"] = True
    meta["loss_tokens"] = {s: int(sum(np.fromfile(tmp / sh["file"].replace(".bin", ".mask"),
                                                  dtype=np.uint8).sum()
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
                             f"{tok_hash}; prepare the data again with this one or use the one they match")

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
