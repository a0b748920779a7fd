"""Continuous batching: one thread owns the model and decodes every active request one token per step.

Requests arrive as rows (one prompt, one choice). Between two decode steps the loop admits waiting rows: it
prefills each newcomer alone into a one-row cache, copies its keys and values into a free slot of the shared
slot cache, and samples its first token from the prefill's last logits. Then every active row advances one
token in a single forward pass, and a row that finished (end token, stop sequence, budget), was cancelled
(client gone) or ran past its deadline leaves at the step boundary and frees its slot. So a request never
waits for the whole batch to finish, and the model's cost per step is shared by up to `max_batch` rows
(on a CPU a step of a small model costs about the same for 1 or 8 rows: the work is dominated by per-layer
overhead and weight reads, not by the rows).

The slot cache: the model's own KV cache with `slots` rows and 2 x block_size columns, and one write column
shared by every row (the model writes column `len` for all rows at once). Row i owns the columns
[start_i, len): its prompt was copied to end at the write column when it joined, and each step appends one
column. The model is told each row's start_i: it counts the row's positions from there (a row that joined late
starts at position 0 in a later column) and hides the columns before it, so each row computes exactly what it
would alone. Each step
attends over [min start, len] only (a view of the cache), and when the write column reaches the end, all rows
shift left by the oldest row's start; since a row never holds more than block_size tokens that happens at
most once per block_size steps. Slots stay packed at the front: a leaving row's slot is filled by the last
row, so the forward pass runs on the first n rows, a view, never a gather.

A prompt cache (prompt_cache.py, llama-server's per-slot cache) keeps the one-row prefill caches of the last
prompts: a newcomer whose prompt shares a prefix with one copies those positions and computes the rest only
(Event.prompt_n says how many). Rows can also ask for llama-server's behaviours: its sampler chain
(RowParams.samplers, sampling.py, the infill sampler included), its n_indent and t_max_predict_ms stops
(Scheduler._limits), and its timings on the "done" event.
"""

from __future__ import annotations

import collections
import math
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..chat import CALL_CLOSE, CALL_OPEN
from ..constrain import fit_tokens, mask_logits
from ..device import autocast
from ..engine import apply_repetition_penalty, filter_logits
from ..models.cpu_decode import stepper
from ..models.cpu_linear import decode_threads
from .prompt_cache import PromptCache
from .sampling import SAMPLING_EPS, PieceIndex, piece_index, sample_chain

# SAMPLING_EPS (sampling.py): temperatures below it sample greedily: dividing by a near-zero temperature
# overflows the logits (vLLM draws the same line).
PROMPT_CHUNK = 256  # positions whose full-vocabulary logits exist at once when scoring a prompt (echo)


@dataclass
class RowParams:
    """Sampling for one row. temperature 0 is greedy; top_k 0 and top_p 1 are off; penalties as OpenAI's
    (presence/frequency: subtracted from the logits of tokens already generated) and CTRL's repetition
    penalty (tokens of the prompt and the output)."""
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)  # stop sequences, cut from the text
    # tokens that end the row (end of text, <|im_end|>), not in the text
    stop_ids: frozenset[int] = frozenset()
    logprobs: int | None = None  # report each generated token's log-prob and the top N alternatives (0: none)
    prompt_logprobs: int | None = None  # the same for the prompt's tokens (echo), from the prefill's logits
    hide_special: bool = False  # special tokens written but not shown in the text (llama-server's /infill)
    constraint: object | None = None  # constrain.Constraint: the tokens this row may sample, step by step;
    # given max_new_tokens (as the context cuts it) as its budget when the row is admitted, so that a tool
    # call or JSON reply always ends within it
    # llama-server's stops (see _limits): n_indent > 0 ends the reply at the first line (after the first
    # newline) indented by fewer than n_indent spaces/tabs, cut before its text; t_max_predict_ms > 0 ends it
    # on a newline once that many ms have passed since its first token. Both stop with stop_type "limit".
    n_indent: int = 0
    t_max_predict_ms: int = -1
    # llama.cpp's sampler chain (sampling.py): None samples as above (temperature, top_k, top_p); a tuple of
    # names from sampling.CHAIN_SAMPLERS runs them in that order, then draws (at T=1 unless "temperature" is
    # in it); min_p is used by the chain only
    samplers: tuple[str, ...] | None = None
    min_p: float = 0.05
    # the prompt cache (prompt_cache.py): the entry to use (None or < 0: the best shared prefix), and whether
    # to use one at all
    cache_slot: int | None = None
    cache_prompt: bool = True


# One log-prob record: (token id, log-prob of that token, [(id, log-prob) of the top N, most likely first]);
# the prompt's first token has none (log-prob None: nothing comes before it).
# Log-probs are of the model's own next-token distribution (log-softmax of the raw logits), before
# temperature, penalties or a grammar: what a harness scoring the model needs, whatever the sampling.
LogProb = tuple[int, float | None, list[tuple[int, float]]]


@dataclass
class Event:
    """What the loop reports for a row: "prompt" (the prompt's log-probs, once, before any text, when asked),
    "text" (a new piece, safe to show: no partial character, no possible start of a stop sequence), "done"
    (finish_reason "stop" or "length"; text is the whole output), or "error" (status and message).
    Every generated token has a log-prob record when asked, the end token too (it is not in the text)."""
    kind: str
    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int = 0
    status: int = 0
    stop_type: str = ""  # done: "eos" (an end token), "word" (a stop sequence) or "limit" (the budget)
    # text: the records of tokens since the last event; done: all of them
    logprobs: list[LogProb] | None = None
    prompt_logprobs: list[LogProb] | None = None  # "prompt" (and done): one per prompt token
    # done: llama-server's timings (zeros where nothing ran): prompt tokens computed (those the prompt cache
    # held are not), ms from the row's admission to its first token (or to the end of a prefill that
    # samples none), tokens sampled (an end token and text a stop cut included), ms from the first token to
    # the last; the tokens whose keys and values the row held at the end (prompt + sampled - 1, as
    # llama-server's tokens_cached; the prompt for a row that samples none) and the context
    prompt_n: int = 0
    prompt_ms: float = 0.0
    predicted_n: int = 0
    predicted_ms: float = 0.0
    tokens_cached: int = 0
    n_ctx: int = 0


class Row:
    """One prompt being completed. `emit(event)` is called from the loop thread, or, when `loop` (an asyncio
    event loop) is given, in that loop's thread: the events of a step for every row of one loop travel in
    one call_soon_threadsafe, so the HTTP side wakes once per step, not once per row."""

    def __init__(self, prompt: list[int], params: RowParams, emit: Callable[[Event], None],
                 deadline: float | None = None, tag: int = 0, loop=None):
        self.prompt, self.p, self.emit, self.deadline, self.tag = prompt, params, emit, deadline, tag
        self.loop = loop
        self.cancelled = False
        self.out: list[int] = []
        self.text = ""  # decoded so far (settled characters only)
        self.sent = 0  # characters of text already emitted
        self._prefix_off = self._read_off = 0  # incremental detokenization (offsets into out)
        self.last = -1  # token to feed at the next step
        self.done = False
        self.t_submit = time.monotonic()
        self.t_first: float | None = None
        self.gen: torch.Generator | None = None
        self.counts: torch.Tensor | None = None  # (vocab,) output token counts, for penalties
        self.seen: torch.Tensor | None = None  # (vocab,) bool, prompt and output, for repetition_penalty
        self.lp: list[LogProb] = []  # log-prob records of out (when params.logprobs is set)
        self.lp_sent = 0  # records already handed out with text events
        self.prompt_lp: list[LogProb] | None = None
        self.t_start: float | None = None  # admitted (its prefill began)
        self.t_prefilled: float | None = None
        self.t_last: float | None = None  # its last token sampled
        self.prompt_n = 0  # prompt tokens its prefill computed
        # llama-server's process_token state for n_indent / t_max_predict_ms (_limits): characters of text
        # released by its stop-word rule, the start of the line checked next, a newline released yet
        self.ll_sent = 0
        self.last_nl = 0
        self.has_new_line = False


class QueueFull(Exception):
    def __init__(self, retry_after: int):
        super().__init__(f"queue full; retry after {retry_after}s")
        self.retry_after = retry_after


class _CacheView:
    """The model's cache surface (k, v lists of (B, n_kv_head, L, head_dim), len) over part of a cache."""

    def __init__(self, k, v, length: int):
        self.k, self.v, self.len, self.max_len = k, v, length, k[0].size(2)


class SlotCache:
    """A KV cache of `slots` rows whose rows join and leave independently (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, slots: int, block_size: int, device, dtype):
        self.width = 2 * block_size
        self.cache = model.new_kv_cache(slots, self.width, device, dtype)
        if not all(hasattr(self.cache, a) for a in ("k", "v", "len")):
            raise TypeError(f"{type(model).__name__}.new_kv_cache() has no k/v/len lists; the server's slot "
                            f"cache needs them")
        self.device = device
        self.len = 0  # the next column to write (shared by every row)
        self.starts: list[int] = []  # first column of each occupied slot (slots 0..n-1)

    @property
    def n(self) -> int:
        return len(self.starts)

    def _shift(self, d: int) -> None:
        """Move every occupied row's columns by d (right if d > 0, left if d < 0)."""
        n, lo = self.n, min(self.starts, default=0)
        for t in self.cache.k + self.cache.v:
            t[:n, :, lo + d:self.len + d] = t[:n, :, lo:self.len].clone()
        self.starts = [s + d for s in self.starts]
        self.len += d

    def add(self, k: list[torch.Tensor], v: list[torch.Tensor]) -> int:
        """Put a prefilled row (per layer (n_kv_head, P, head_dim)) into the next free slot, ending at the
        write column; returns the slot."""
        P = k[0].size(1)
        if not self.starts:
            self.len = 0
        if self.len < P:
            self._shift(P - self.len)
        s = self.n
        for dst, src in zip(self.cache.k + self.cache.v, k + v):
            dst[s, :, self.len - P:self.len] = src
        self.starts.append(self.len - P)
        return s

    def remove(self, i: int) -> None:
        """Free slot i; the last occupied slot moves into it (callers reorder their rows the same way)."""
        last = self.n - 1
        if i != last:
            lo = self.starts[last]
            for t in self.cache.k + self.cache.v:
                t[i, :, lo:self.len] = t[last, :, lo:self.len]
            self.starts[i] = self.starts[last]
        self.starts.pop()

    def step_view(self) -> tuple[_CacheView, list[int] | None]:
        """The cache view for one decode step of every occupied row, and each row's first column in it (the
        model's `starts`), or None when every row owns every column of the view."""
        if self.len >= self.width:
            self._shift(-min(self.starts))
        base, n = min(self.starts), self.n
        view = _CacheView([t[:n, :, base:] for t in self.cache.k], [t[:n, :, base:] for t in self.cache.v],
                          self.len - base)
        if all(s == base for s in self.starts):
            return view, None
        return view, [s - base for s in self.starts]

    def advance(self) -> None:
        self.len += 1


class Scheduler:
    """The generation loop. `submit(rows)` queues rows (QueueFull past max_queue), `cancel(rows)` drops them
    at the next step boundary; events come back through each row's emit callback."""

    def __init__(self, engine, max_batch: int = 8, max_queue: int = 64,
                 tok_lock: threading.Lock | None = None,
                 on_first_token: Callable[[float], None] | None = None,
                 prompt_cache_entries: int | None = None):
        self.engine = engine
        self.model, self.tok, self.device = engine.model, engine.tok, engine.device
        self.block_size = engine.block_size
        self.max_batch, self.max_queue = max_batch, max_queue
        self.tok_lock = tok_lock or threading.Lock()
        self.on_first_token = on_first_token
        self.waiting: collections.deque[Row] = collections.deque()
        self.active: list[Row] = []
        self.logits: torch.Tensor | None = None  # (len(active), vocab): next-token logits per active row
        self.cv = threading.Condition()
        self.cache: SlotCache | None = None
        self._stop = False
        self._held = 0  # > 0: admit nobody (tests use hold() to line up arrivals)
        self.step_delay = 0.0  # seconds slept per step (tests use it to catch rows mid-generation)
        # counters read by /metrics
        self.stats = {"generated_tokens": 0, "prompt_tokens": 0, "steps": 0, "step_rows": 0,
                      "rows_admitted": 0,
                      "rows_finished": 0, "rows_cancelled": 0, "rows_timed_out": 0, "rows_failed": 0,
                      "max_active": 0, "loop_errors": 0, "prompt_tokens_cached": 0}
        # llama-server's per-slot prompt cache (prompt_cache.py): as many entries as rows run at once, at
        # least its 4 slots (0: none)
        n_cache = max(max_batch, 4) if prompt_cache_entries is None else prompt_cache_entries
        self.prompt_cache: PromptCache | None = PromptCache(n_cache) if n_cache > 0 else None
        self._pieces: PieceIndex | None = None  # the tokenizer's pieces, for the infill sampler
        self._outbox: dict = {}  # event loop -> [(row, event)] of the current step
        self.mean_row_seconds = 1.0  # moving average of a row's time in the server (for Retry-After)
        self.thread = threading.Thread(target=self._loop, name="codeforge-generate", daemon=True)

    # -- called from request handlers ---------------------------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        with self.cv:
            self._stop = True
            self.cv.notify_all()
        if self.thread.is_alive():
            self.thread.join(timeout=10)

    def submit(self, rows: list[Row]) -> None:
        with self.cv:
            if self._stop or not self.thread.is_alive():
                raise RuntimeError("the generation loop is not running")
            if len(self.waiting) + len(rows) > self.max_queue:
                per_wave = self.mean_row_seconds
                waves = (len(self.waiting) + len(rows)) / self.max_batch
                raise QueueFull(max(1, min(60, math.ceil(per_wave * waves))))
            self.waiting.extend(rows)
            self.cv.notify()

    def cancel(self, rows: list[Row]) -> None:
        for r in rows:
            r.cancelled = True
        with self.cv:
            self.cv.notify()

    def queue_length(self) -> int:
        return len(self.waiting)

    def active_rows(self) -> int:
        return len(self.active)

    def hold(self):
        """Context manager: nobody is admitted while held (rows queue up), so tests can make rows arrive at
        the same step boundary."""
        sched = self

        class _Hold:
            def __enter__(self):
                with sched.cv:
                    sched._held += 1

            def __exit__(self, *exc):
                with sched.cv:
                    sched._held -= 1
                    sched.cv.notify()

        return _Hold()

    # -- the loop -----------------------------------------------------------------------------------------
    def _loop(self) -> None:
        with torch.inference_mode():
            while True:
                with self.cv:
                    while not self._stop and not self.active and (not self.waiting or self._held):
                        self.cv.wait(timeout=1.0)
                        self._expire_waiting()
                        self._flush()
                    if self._stop:
                        break
                    self._expire_waiting()
                    newcomers = []
                    while (
                        not self._held and self.waiting and len(self.active) + len(newcomers) < self.max_batch
                    ):
                        r = self.waiting.popleft()
                        if r.cancelled:
                            self._finish(r, None, cancelled=True)
                        else:
                            newcomers.append(r)
                try:
                    self._step(newcomers)
                except Exception as e:  # a failed step fails its rows, never the server
                    self.stats["loop_errors"] += 1
                    traceback.print_exc(file=sys.stderr)
                    for r in {id(r): r for r in self.active + newcomers}.values():
                        if not r.done:
                            self._fail(r, 500, f"generation failed: {type(e).__name__}: {e}")
                    self.active, self.logits, self.cache = [], None, None
                    if self.prompt_cache is not None:
                        self.prompt_cache.clear()
                self._flush()
                if self.step_delay:
                    time.sleep(self.step_delay)
            for r in self.active + list(self.waiting):
                self._fail(r, 503, "the server is shutting down")
            self._flush()

    def _expire_waiting(self) -> None:
        now = time.monotonic()
        for r in [r for r in self.waiting if r.cancelled or (r.deadline is not None and now > r.deadline)]:
            self.waiting.remove(r)
            if r.cancelled:
                self._finish(r, None, cancelled=True)
            else:
                self.stats["rows_timed_out"] += 1
                self._fail(r, 504, "the request timed out waiting for a free batch slot")

    def _step(self, newcomers: list[Row]) -> None:
        for r in newcomers:
            self._admit(r)
        if not self.active:
            return
        self.stats["max_active"] = max(self.stats["max_active"], len(self.active))
        for r, t in zip(list(self.active), self._sample()):
            if t is not None and not r.done:
                self._accept(r, t)
        now = time.monotonic()
        for i in reversed(range(len(self.active))):
            r = self.active[i]
            if not r.done and r.deadline is not None and now > r.deadline:
                self.stats["rows_timed_out"] += 1
                self._fail(r, 504, "the request timed out")
            if r.done or r.cancelled:
                if not r.done:
                    self._finish(r, None, cancelled=True)
                self.cache.remove(i)
                self.active[i] = self.active[-1]
                self.active.pop()
        if self.active:
            self._decode()
        else:
            self.logits = None

    def _admit(self, r: Row) -> None:
        """Prefill a newcomer alone, move its cache into a slot and keep its next-token logits. The prefix
        its prompt shares with a prompt-cache entry is copied from there, not computed (the model runs on
        the rest, after those positions), and the entry then holds this prompt."""
        r.t_start = time.monotonic()
        if self.cache is None:
            self.cache = SlotCache(self.model, self.max_batch, self.block_size, self.device,
                                   self.engine.cache_dtype)
        P = len(r.prompt)
        # max_tokens 0: echo's prompt log-probs, or a warm-up (llama-server's n_predict 0) that fills the
        # prompt cache; nothing is generated
        score_only = r.p.max_new_tokens == 0
        if not 0 < P <= self.block_size - (0 if score_only else 1):
            self._fail(r, 400, f"prompt of {P} tokens does not fit the context of {self.block_size}")
            return
        r.p.max_new_tokens = min(r.p.max_new_tokens, self.block_size - P)
        if r.p.constraint is not None and not score_only:
            # the grammar keeps the tokens that end its reply in reserve within this budget (constrain.py)
            r.p.constraint.set_budget(r.p.max_new_tokens)
        # echo scores every position: it computes the whole prompt and leaves the cache alone
        cached = self.prompt_cache is not None and r.p.cache_prompt and r.p.prompt_logprobs is None
        if score_only and r.p.prompt_logprobs is None and not cached:
            self.stats["rows_admitted"] += 1
            self._finish(r, "length", stop_type="limit")
            return
        tmp = self.model.new_kv_cache(1, P, self.device, self.engine.cache_dtype)
        n_past = entry = 0
        if cached:
            entry = self.prompt_cache.choose(r.prompt, r.p.cache_slot)
            n_past, ck, cv = self.prompt_cache.reuse(entry, r.prompt)
            if n_past:
                for dst, src in zip(tmp.k + tmp.v, ck + cv):
                    dst[0, :, :n_past] = src[:, :n_past]
                tmp.len = n_past
        idx = torch.tensor([r.prompt[n_past:]], device=self.device)
        with autocast(self.device, self.engine.precision):
            if r.p.prompt_logprobs is None:
                logits = self.model(idx, kv_cache=tmp, last_only=True)[:, -1, :]  # (1, model vocab)
            else:  # every position's log-probs, from the hidden states a chunk of positions at a time
                h = self.model(idx, kv_cache=tmp, return_hidden=True)[0]  # (P, n_embd)
                head = self.model.lm_head.weight
                logits = F.linear(h[-1:], head)
                r.prompt_lp = [(r.prompt[0], None, [])]
                for s in range(0, P - 1, PROMPT_CHUNK):
                    e = min(P - 1, s + PROMPT_CHUNK)
                    r.prompt_lp += prompt_logprobs(F.linear(h[s:e], head), r.prompt[s + 1:e + 1],
                                                   self.tok.vocab_size, r.p.prompt_logprobs)
                self._emit(r, Event("prompt", prompt_logprobs=r.prompt_lp))
        r.prompt_n, r.t_prefilled = P - n_past, time.monotonic()
        if cached:  # the one-row cache holds exactly this prompt: the entry keeps it (not copied)
            self.prompt_cache.store(entry, r.prompt, [t[0] for t in tmp.k], [t[0] for t in tmp.v])
        self.stats["prompt_tokens"] += P - n_past
        self.stats["prompt_tokens_cached"] += n_past
        if score_only:
            self.stats["rows_admitted"] += 1
            self._finish(r, "length", stop_type="limit")
            return
        self.cache.add([t[0] for t in tmp.k], [t[0] for t in tmp.v])
        r.gen = torch.Generator(device=self.device)
        r.gen.manual_seed(r.p.seed if r.p.seed is not None
                          else int.from_bytes(os.urandom(8), "little") % 2**63)
        V = logits.size(-1)
        if r.p.presence_penalty or r.p.frequency_penalty:
            r.counts = torch.zeros(V, device=self.device)
        if r.p.repetition_penalty != 1.0:
            r.seen = torch.zeros(V, dtype=torch.bool, device=self.device)
            r.seen[torch.tensor(r.prompt, device=self.device)] = True
        self.active.append(r)
        self.logits = logits if self.logits is None else torch.cat([self.logits,
                                                                    logits.to(self.logits.dtype)])
        self.stats["rows_admitted"] += 1

    def _sample(self) -> list[int]:
        """One token per active row, each with its own settings and generator (a row samples exactly as
        Engine.generate_ids would for it alone)."""
        V = self.tok.vocab_size
        raw = self.logits.float()  # every row of the head: log-probs are normalised over them all
        logits = raw[:, :V]  # padded vocab rows are never sampled
        rows = self.active
        out: list[int | None] = [None] * len(rows)
        constraints = [r.p.constraint for r in rows]
        if any(c is not None for c in constraints):
            logits = mask_logits(constraints, logits)
        if all(r.p.temperature == 0 and r.counts is None and r.seen is None and r.p.samplers is None
               for r in rows):
            out = logits.argmax(-1).tolist()
        else:
            for i, r in enumerate(rows):
                try:
                    out[i] = self._sample_row(r, logits[i:i + 1], V)
                except Exception as e:  # this row's settings failed it; the batch goes on without it
                    self._fail(r, 400, f"sampling failed with these settings: {type(e).__name__}: {e}")
        if any(c is not None for c in constraints):  # a drawn token that leaves no room to end is replaced
            out = fit_tokens(constraints, logits, [None if r.done else t for r, t in zip(rows, out)])
        for i, r in enumerate(rows):
            if out[i] is None or r.done:
                continue
            if r.p.constraint is not None:
                try:
                    r.p.constraint.advance(out[i])
                # the grammar failed mid-reply (an engine limit its schema reaches): this row only
                except Exception as e:
                    msg = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
                    self._fail(r, 400,
                               f"constrained decoding failed: the schema reaches a limit of the grammar "
                               f"engine ({msg}); simplify it (fewer properties, no recursive $ref)")
                    out[i] = None
                    continue
            if r.p.logprobs is not None:
                r.lp.append(token_logprobs(raw[i], out[i], r.p.logprobs, V))
        return out

    def _sample_row(self, r: Row, x: torch.Tensor, V: int) -> int:
        if r.seen is not None:
            x = apply_repetition_penalty(x, r.seen[:V].unsqueeze(0), r.p.repetition_penalty)
        if r.counts is not None:
            c = r.counts[:V]
            x = x - r.p.frequency_penalty * c - r.p.presence_penalty * (c > 0).float()
        if r.p.samplers is not None:  # llama.cpp's chain, after the penalties (sampling.py)
            # the infill sampler's forced end: end-of-text where it ends the row (as llama.cpp's EOT), else
            # one of the row's end tokens
            stop_ids, eot = r.p.stop_ids, self.tok.eot_id
            if stop_ids and eot not in stop_ids:
                eot = min(stop_ids)
            return sample_chain(x[0], r.p.samplers, top_k=r.p.top_k, top_p=r.p.top_p, min_p=r.p.min_p,
                                temperature=r.p.temperature, gen=r.gen, eog=stop_ids, eot=eot,
                                index=self._piece_index)
        if r.p.temperature < SAMPLING_EPS:  # 0, or so small that x / temperature overflows: greedy
            return int(x.argmax(-1))
        x = torch.nan_to_num(x / r.p.temperature, nan=-float("inf"), posinf=torch.finfo(x.dtype).max)
        probs = filter_logits(x, r.p.top_k, r.p.top_p).softmax(-1)
        return int(torch.multinomial(probs, 1, generator=r.gen))

    def _piece_index(self) -> PieceIndex:
        """The tokenizer's pieces for the infill sampler, made on first use (a decode per token id)."""
        if self._pieces is None:
            with self.tok_lock:
                self._pieces = piece_index(self.tok)
        return self._pieces

    def _accept(self, r: Row, t: int) -> None:
        """Append a sampled token to a row: decode, check stops and budget (and llama-server's n_indent and
        t_max_predict_ms after them, in its order: _limits), emit the settled text."""
        if r.cancelled:
            return
        now = time.monotonic()
        if r.t_first is None:
            r.t_first = now
            if self.on_first_token is not None:
                self.on_first_token(now - r.t_submit)
        r.t_last = now
        self.stats["generated_tokens"] += 1
        llama = r.p.n_indent > 0 or r.p.t_max_predict_ms > 0
        if t in r.p.stop_ids:
            r.out.append(t)  # counted as generated, never shown
            # llama-server checks the indentation on an end token too (the cut stands); "eos" wins
            if llama and self._limits(r, now, eog=True, word=False)[1]:
                self._finish(r, "stop", decoded=True, stop_type="eos")
            else:
                self._finish(r, "stop", drop_last=True, stop_type="eos")
            return
        r.out.append(t)
        r.last = t
        if r.counts is not None:
            r.counts[t] += 1
        if r.seen is not None:
            r.seen[t] = True
        with self.tok_lock:
            prev = self.tok.decode(r.out[r._prefix_off:r._read_off], skip_special=r.p.hide_special)
            new = self.tok.decode(r.out[r._prefix_off:], skip_special=r.p.hide_special)
        word = False
        if len(new) > len(prev) and not new.endswith("\ufffd"):
            before = len(r.text)
            r.text += new[len(prev):]
            r._prefix_off, r._read_off = r._read_off, len(r.out)
            stops, calls = _stops_of(r.p)
            if stops:
                longest = max(len(s) for s in stops)
                hit = _first_stop(r.text, stops, max(0, before - longest + 1), calls)
                if hit is not None:
                    r.text = r.text[:hit]
                    if not llama:
                        self._finish(r, "stop", decoded=True, stop_type="word")
                        return
                    word = True
        budget = not word and len(r.out) >= r.p.max_new_tokens
        if budget and not llama:
            self._finish(r, "length", stop_type="limit")
            return
        if llama:
            if self._limits(r, now, eog=False, word=word)[0]:  # llama-server's LIMIT, over a stop word too
                self._finish(r, "length", decoded=True, stop_type="limit")
                return
            if word:
                self._finish(r, "stop", decoded=True, stop_type="word")
                return
            if budget:
                self._finish(r, "length", stop_type="limit")
                return
        hold = max((len(s) for s in _stops_of(r.p)[0]), default=1) - 1
        safe = len(r.text) - hold
        if safe > r.sent:
            piece, r.sent = r.text[r.sent:safe], safe
            self._emit(r, Event("text", piece, completion_tokens=len(r.out), logprobs=self._new_lp(r)))

    @staticmethod
    def _limits(r: Row, now: float, eog: bool, word: bool) -> tuple[bool, bool]:
        """llama-server's n_indent and t_max_predict_ms checks for the token just accepted
        (tools/server/server-context.cpp process_token, 1884-1931): (stop with "limit", the text was cut).

        Its text sent this token is the text not yet released, held back while its end could start a stop
        sequence (not on an end token or once a stop sequence matched). n_indent: once an earlier token
        released a newline, the line starting at last_nl (a line is judged from the token after the one
        that moved last_nl to it, and nothing before the first line's newline is) is checked when a
        character other than a space or tab follows its indentation: fewer than n_indent spaces/tabs cut the
        text there (the newline and the short indentation stay) and stop; then last_nl moves past the next
        newline (one per token). t_max_predict_ms: a token whose released text has a newline stops once
        more than that many ms have passed since the first token."""
        text = r.text
        unsent = text[min(r.ll_sent, len(text)):]
        stops = _stops_of(r.p)[0]
        held = not eog and not word and any(unsent.endswith(s[:n]) for s in stops
                                            for n in range(min(len(s), len(unsent)), 0, -1))
        released = "" if held else unsent
        r.ll_sent = min(r.ll_sent, len(text)) + len(released)
        limit = cut = False
        if r.has_new_line and r.p.n_indent > 0:
            if r.last_nl > 0:  # the first line is never judged
                pos = r.last_nl
                while pos < len(text) and text[pos] in " \t":
                    pos += 1
                if pos < len(text) and pos - r.last_nl < r.p.n_indent:
                    r.text = text = text[:pos]
                    limit = cut = True
            nl = text.find("\n", r.last_nl)
            if nl >= 0:
                r.last_nl = nl + 1
        if "\n" in released:
            r.has_new_line = True
            if r.p.t_max_predict_ms > 0 and (now - r.t_first) * 1000 > r.p.t_max_predict_ms:
                limit = True
        return limit, cut

    def _finish(self, r: Row, reason: str | None, cancelled: bool = False, drop_last: bool = False,
                decoded: bool = False, stop_type: str = "") -> None:
        r.done = True
        if cancelled:
            self.stats["rows_cancelled"] += 1
            return
        if not decoded:
            with self.tok_lock:
                text = self.tok.decode(r.out[:-1] if drop_last else r.out, skip_special=r.p.hide_special)
            stops, calls = _stops_of(r.p)
            cut = _first_stop(text, stops, 0, calls) if stops else None
            if cut is not None:
                text, reason, stop_type = text[:cut], "stop", "word"
            r.text = text if text.startswith(r.text[:r.sent]) else r.text
        self.stats["rows_finished"] += 1
        now = time.monotonic()
        self.mean_row_seconds = 0.9 * self.mean_row_seconds + 0.1 * (now - r.t_submit)
        if len(r.text) > r.sent:
            self._emit(r,
                       Event("text", r.text[r.sent:], completion_tokens=len(r.out), logprobs=self._new_lp(r)))
            r.sent = len(r.text)
        # llama-server's timings: the prompt until the first token (or the prefill's end), generation from
        # the first token to the last (at least 1 us once there is one)
        ends = r.t_first if r.t_first is not None else r.t_prefilled
        prompt_ms = (ends - r.t_start) * 1000 if r.t_start is not None and ends is not None else 0.0
        predicted_ms = max(0.001, (r.t_last - r.t_first) * 1000) if r.t_first is not None else 0.0
        held = len(r.prompt) + len(r.out) - 1 if r.out else len(r.prompt) if r.t_prefilled is not None else 0
        self._emit(r, Event("done", r.text, reason, completion_tokens=len(r.out), stop_type=stop_type,
                            logprobs=r.lp if r.p.logprobs is not None else None, prompt_logprobs=r.prompt_lp,
                            prompt_n=r.prompt_n, prompt_ms=prompt_ms, predicted_n=len(r.out),
                            predicted_ms=predicted_ms, tokens_cached=held, n_ctx=self.block_size))

    @staticmethod
    def _new_lp(r: Row) -> list[LogProb] | None:
        if r.p.logprobs is None:
            return None
        new, r.lp_sent = r.lp[r.lp_sent:], len(r.lp)
        return new

    def _fail(self, r: Row, status: int, message: str) -> None:
        r.done = True
        self.stats["rows_failed"] += 1
        self._emit(r, Event("error", message, status=status))

    def _emit(self, r: Row, ev: Event) -> None:
        if r.loop is not None:
            self._outbox.setdefault(r.loop, []).append((r, ev))
            return
        try:
            r.emit(ev)
        except Exception:  # nobody is listening any more
            r.cancelled = True

    def _flush(self) -> None:
        """Hand the step's events to their event loops, one call per loop."""
        outbox, self._outbox = self._outbox, {}
        for loop, items in outbox.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # the event loop is closed: nobody is listening any more
                for r, _ in items:
                    r.cancelled = True

    def _decode(self) -> None:
        """Feed each active row's last token at its own position; one forward pass for all of them."""
        rows = self.active
        idx = torch.tensor([[r.last] for r in rows], device=self.device)  # (n, 1)
        view, starts = self.cache.step_view()
        with autocast(self.device, self.engine.precision), decode_threads(self.model, len(rows)):
            fast = stepper(self.model, self.device, self.engine.precision, len(rows))
            if fast is not None:  # numpy on the CPU (models/cpu_decode.py), the same logits
                self.logits = fast.step(idx, view, starts)[:, -1, :]
            else:
                self.logits = self.model(idx, kv_cache=view, starts=starts, last_only=True)[:, -1, :]
        self.cache.advance()
        self.stats["steps"] += 1
        self.stats["step_rows"] += len(rows)


def _deliver(items: list[tuple[Row, Event]]) -> None:
    for r, ev in items:
        try:
            r.emit(ev)
        except Exception:  # noqa: BLE001 - one broken consumer must not starve the others
            r.cancelled = True


# Log-probs are the model's own distribution: a log-softmax over every row of its head, the padding rows past
# the tokenizer's vocabulary included, as training's loss and validation, transformers on the Hugging Face
# export and llama.cpp on the GGUF all take it (a padded vocabulary normalised over the real tokens only gave
# every token ~0.016 nats more than transformers did). Padding rows are never sampled nor listed among the
# alternatives: they have no text.

def token_logprobs(logits: torch.Tensor, token: int, top: int, vocab: int) -> LogProb:
    """The record of one sampled token from its row's raw logits over the model's whole head (model vocab,);
    alternatives among the tokenizer's `vocab` tokens."""
    lsm = torch.log_softmax(logits.float(), -1)
    alts: list[tuple[int, float]] = []
    if top:
        v, i = torch.topk(lsm[:vocab], min(top, vocab))
        alts = list(zip(i.tolist(), v.tolist()))
    return token, float(lsm[token]), alts


def prompt_logprobs(logits: torch.Tensor, targets: list[int], vocab: int, top: int) -> list[LogProb]:
    """Records of prompt tokens 1.. from the prefill's logits at positions 0.. ((P-1, model vocab))."""
    lsm = torch.log_softmax(logits.float(), -1)
    t = torch.tensor(targets, device=lsm.device)
    chosen = lsm.gather(1, t.unsqueeze(1)).squeeze(1).tolist()
    if top:
        v, i = torch.topk(lsm[:, :vocab], min(top, vocab), dim=-1)
        alts = [list(zip(a, b)) for a, b in zip(i.tolist(), v.tolist())]
    else:
        alts = [[] for _ in targets]
    return [(tok, lp, alt) for tok, lp, alt in zip(targets, chosen, alts)]


def _stops_of(p: RowParams) -> tuple[list[str], bool]:
    """(the stop sequences that apply to a row, whether a hit inside a tool call is passed over). A grammar
    that holds the whole reply (a JSON response_format, tool_choice "required" or a named tool) ignores them:
    a stop would cut the JSON or the call it keeps whole (and within the budget). In auto mode with tools
    they apply to the text outside calls: a call, from <tool_call> to </tool_call>, is never cut."""
    kind = getattr(getattr(p.constraint, "grammar", None), "kind", None)
    return ([], False) if kind == "whole" else (p.stop, kind == "text")


def _first_stop(text: str, stops: list[str], start: int, calls: bool = False) -> int | None:
    """Where the first stop sequence starts in text[start:] (with `calls`, one that overlaps no tool call)."""
    spans = []
    at = text.find(CALL_OPEN) if calls else -1
    while at >= 0:
        close = text.find(CALL_CLOSE, at)
        end = len(text) if close < 0 else close + len(CALL_CLOSE)  # a call still open runs to the end
        spans.append((at, end))
        at = text.find(CALL_OPEN, end) if close >= 0 else -1
    hits = []
    for s in stops:
        i = text.find(s, start) if s else -1
        while i >= 0 and any(a < i + len(s) and i < b for a, b in spans):
            i = text.find(s, i + 1)
        if i >= 0:
            hits.append(i)
    return min(hits) if hits else None
