"""What the handlers of every endpoint share: the server's state (engine, scheduler, metrics, limits and the
checks a request goes through), a request's generation over the scheduler's rows, and the streaming helpers.
app.py (the OpenAI-style endpoints and the route table) and llama_api.py (llama-server's /infill and
/completion) both build on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator

from fastapi import Request
from starlette.concurrency import run_in_threadpool
from starlette.responses import StreamingResponse

from ..fim import FIM_PREFIX, FIM_SUFFIX, fim_ids
from ..tokenizer import TokenizerError
from .batcher import Event, QueueFull, Row, RowParams, Scheduler
from .metrics import Metrics
from .options import ServeOptions
from .protocol import (
    ApiError,
    chain,
    parse_samplers,
    sse,
)


MAX_LOGPROB_RECORDS = 200_000  # entries (tokens x (top + 1) x choices) one completions answer may hold

class ClientGone(Exception):
    pass


class ServerState:
    """What the handlers share: engine, scheduler, metrics, limits."""

    def __init__(self, engine, opts: ServeOptions):
        self.engine, self.opts, self.tok = engine, opts, engine.tok
        self.block_size = engine.block_size
        self.tok_lock = threading.Lock()
        self.metrics = Metrics()
        self.sched = Scheduler(engine, opts.max_batch, opts.max_queue, self.tok_lock,
                               on_first_token=self.metrics.observe_ttft)
        self.metrics.attach(self.sched)
        self.max_prompt = min(opts.max_prompt_tokens or self.block_size - 1, self.block_size - 1)
        self.infill_batch = opts.infill_batch or self.block_size // 2
        self.max_tokens_cap = opts.max_tokens_cap or self.block_size
        self.created = int(time.time())
        self.max_token_chars = max(len(self.tok.decode([i])) for i in range(self.tok.vocab_size))

    # -- checks -------------------------------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model and model != self.opts.model_name:
            raise ApiError(404, f"the model {model!r} does not exist; this server serves "
                                f"{self.opts.model_name!r} (GET /v1/models)", param="model",
                                code="model_not_found")

    def check_chars(self, text: str, param: str = "prompt") -> None:
        """Refuse, before tokenizing it, a text too long to fit whatever it encodes to: no token covers
        more than max_token_chars characters. (Encoding a megabyte holds the tokenizer lock the generation
        loop needs for every token, so it must not happen for a request that will be refused anyway.)"""
        if len(text) > (self.max_prompt + 1) * self.max_token_chars:
            raise ApiError(400, f"{param}: {len(text):,} characters, more than the {self.max_prompt} tokens "
                                f"this server takes could hold (model context {self.block_size}, "
                                "--max-prompt-tokens)", param=param, code="context_length_exceeded")

    def check_prompt(self, ids: list[int], param: str = "prompt", score_only: bool = False) -> list[int]:
        """Ids of a prompt that fits: at most --max-prompt-tokens, or the whole context when nothing is to be
        generated (max_tokens 0 with echo scores every token of a full-context prompt)."""
        if not ids:
            ids = [self.tok.eot_id]  # an empty prompt starts a new document (as Engine does)
        limit = self.block_size if score_only else self.max_prompt
        if len(ids) > limit:
            raise ApiError(400, f"the prompt has {len(ids)} tokens; this server takes at most {limit} "
                                f"(model context {self.block_size}, --max-prompt-tokens)", param=param,
                           code="context_length_exceeded")
        bad = next((t for t in ids if not 0 <= t < self.tok.vocab_size), None)
        if bad is not None:
            raise ApiError(400, f"token id {bad} is outside the vocabulary [0, {self.tok.vocab_size})",
                           param=param, code="invalid_token")
        return ids

    def budget(self, requested: int | None, param: str, default: int | None = None) -> int:
        """max_tokens as asked (the context still cuts a row short: finish_reason "length")."""
        if requested is not None and requested > self.max_tokens_cap:
            raise ApiError(400, f"{param} {requested} exceeds this server's cap of {self.max_tokens_cap} "
                                f"(--max-tokens-cap; model context {self.block_size})", param=param,
                           code="max_tokens_exceeded")
        return requested if requested is not None else min(default or self.max_tokens_cap,
                                                           self.max_tokens_cap)

    def check_rows(self, n: int) -> None:
        if n > self.opts.max_queue:
            raise ApiError(400,
                           f"the request asks for {n} completions (prompts x n); this server queues at most "
                           f"{self.opts.max_queue} (--max-queue)", param="n", code="too_many_choices")

    def check_logprobs(self, tokens: int, top: int, n: int, param: str) -> None:
        """Refuse an answer of more log-prob entries than MAX_LOGPROB_RECORDS: `tokens` scored per choice (the
        echoed prompt's and the generated), each with its own and `top` alternatives, times `n` choices. One
        limit for /v1/completions and /v1/chat/completions: a bigger body takes seconds to build and tens of
        megabytes to hold."""
        entries = tokens * (top + 1) * n
        if entries > MAX_LOGPROB_RECORDS:
            raise ApiError(400, f"this request asks for {entries:,} log-prob entries (tokens x "
                                f"({param} + 1) x n); this server answers at most "
                                f"{MAX_LOGPROB_RECORDS:,}: lower {param}, n, max_tokens or the "
                                "number of prompts", param=param, code="too_many_logprobs")

    def row_params(self, b, max_new: int, choice: int, stop_ids: set[int], first: bool = True,
                   **more) -> RowParams:
        """A /v1 row: OpenAI's sampling (temperature 1, top_p 1, top_k off unless given), and llama-server's
        fields where a client sends them (llama.vim's instruct mode does): samplers picks and orders the
        chain (one without "penalties" applies none), min_p, n_indent, t_max_predict_ms, and the prompt
        cache: cache_prompt, and id_slot for the request's first row."""
        seed = None if b.seed is None else (b.seed + choice) % 2**63  # choice i of a seeded request: seed + i
        names = parse_samplers(b.samplers)
        if names is None and b.min_p is not None:  # min_p alone: today's order, then min_p
            names = ["penalties", "temperature", "top_k", "top_p", "min_p"]
        pen = names is None or "penalties" in names
        return RowParams(
            **more, max_new_tokens=max_new, temperature=1.0 if b.temperature is None else b.temperature,
            top_p=1.0 if b.top_p is None else b.top_p, top_k=max(0, b.top_k or 0), seed=seed,
            presence_penalty=(b.presence_penalty or 0.0) if pen else 0.0,
            frequency_penalty=(b.frequency_penalty or 0.0) if pen else 0.0,
            repetition_penalty=(b.repetition_penalty or 1.0) if pen else 1.0, stop=b.stops(),
            stop_ids=frozenset(stop_ids), samplers=None if names is None else chain(names),
            min_p=b.min_p or 0.0, n_indent=b.n_indent or 0,
            t_max_predict_ms=-1 if b.t_max_predict_ms is None else b.t_max_predict_ms,
            cache_slot=self.slot(b.id_slot) if first else None,
            cache_prompt=True if b.cache_prompt is None else b.cache_prompt)

    def slot(self, id_slot: int | None) -> int | None:
        """The prompt-cache entry a request's id_slot names (the batcher wraps it at the entry count, as
        llama-server wraps slot ids); None: the one that shares the longest prefix."""
        return None if id_slot is None or id_slot < 0 else id_slot

    def slot_shown(self, id_slot: int | None) -> int:
        """The id_slot a reply shows: the entry id_slot named, -1 where the server chose one."""
        cache = self.sched.prompt_cache
        entries = 0 if cache is None else len(cache)
        return -1 if id_slot is None or id_slot < 0 or not entries else id_slot % entries

    def fim_text(self, text: str) -> bool:
        """Whether a text prompt is read as a FIM prompt, with its special tokens (Engine._encode_prompt's
        rule: it starts with a FIM token, codeforge's spelling or the tokenizer's own)."""
        fim = tuple(t for t in {FIM_PREFIX, FIM_SUFFIX, self.tok.special_text(FIM_PREFIX),
                                self.tok.special_text(FIM_SUFFIX)} if t)
        return text.lstrip().startswith(fim)

    async def encode(self, fn):
        """Tokenizer work off the event loop and under the tokenizer lock; a text the tokenizer fails on is
        the request's fault (a 400), not the server's."""
        def locked():
            with self.tok_lock:
                return fn()
        try:
            return await run_in_threadpool(locked)
        except TokenizerError as e:
            raise ApiError(400, str(e), code="tokenizer_failed") from None


def fit_fim(tok, prefix: str, suffix: str, room: int) -> tuple[list[int], bool]:
    """The PSM prompt (fim.infill_ids) for prefix and suffix in at most `room` tokens, fitted as /infill
    fits one: the far ends go (the start of the prefix, the end of the suffix), the prefix's end keeping 3/4
    of the room and the suffix's start the rest, and a part that needs less leaving the other more (as
    llama-server's 3/4 and 1/4 of -b). (ids, whether anything was cut)."""
    pre, mid, suf = fim_ids(tok.special_ids)
    p, s = tok.encode(prefix), tok.encode(suffix)
    room = max(0, room - 3)
    cut = len(p) + len(s) > room
    if cut:
        n_s = min(len(s), max(room // 4, room - len(p)))
        p, s = p[len(p) - min(len(p), room - n_s):], s[:n_s]
    return [pre] + p + [suf] + s + [mid], cut


class Generation:
    """The rows of one request and the asyncio queue their events come back on."""

    def __init__(self, srv: ServerState, specs: list[tuple[int, list[int], RowParams]]):
        self.srv = srv
        loop = asyncio.get_running_loop()
        self.q: asyncio.Queue = asyncio.Queue()
        t = srv.opts.request_timeout
        deadline = time.monotonic() + t if t else None

        def emitter(tag: int):
            return lambda ev: self.q.put_nowait((tag, ev))  # runs in this event loop (Row.loop)

        self.rows = [Row(ids, p, emitter(tag), deadline, tag, loop=loop) for tag, ids, p in specs]
        self.pending = {r.tag for r in self.rows}
        try:
            srv.sched.submit(self.rows)
        except QueueFull as e:
            raise ApiError(429, f"the server is busy: {srv.sched.queue_length()} requests are waiting "
                                f"(--max-queue {srv.opts.max_queue}); retry after {e.retry_after}s",
                           code="queue_full", headers={"Retry-After": str(e.retry_after)}) from None
        except RuntimeError as e:
            raise ApiError(503, str(e), code="unavailable") from None

    def _cancel(self) -> None:
        if self.pending:
            self.srv.sched.cancel([r for r in self.rows if r.tag in self.pending])

    async def _watch(self, request: Request) -> None:
        """Cancel the rows when the client disconnects (also when nobody reads the events any more)."""
        while True:
            msg = await request.receive()
            if msg["type"] == "http.disconnect":
                self._cancel()
                self.q.put_nowait((None, None))
                return

    async def events(self, request: Request) -> AsyncIterator[list[tuple[int, Event]]]:
        """Batches of (tag, event): everything that arrived since the last batch, so a slow reader gets
        fewer, larger chunks. Ends when every row is done; closing it early cancels the rest."""
        watcher = asyncio.create_task(self._watch(request))
        try:
            while self.pending:
                got = [await self.q.get()]
                while not self.q.empty():
                    got.append(self.q.get_nowait())
                if any(tag is None for tag, _ in got):
                    raise ClientGone()
                for tag, ev in got:
                    if ev.kind in ("done", "error"):
                        self.pending.discard(tag)
                yield got
        finally:
            watcher.cancel()
            self._cancel()

    async def collect(self, request: Request) -> dict[int, Event]:
        """The done event of every row (an error event raises it as an ApiError)."""
        out: dict[int, Event] = {}
        async with contextlib.aclosing(self.events(request)) as evs:
            async for got in evs:
                for tag, ev in got:
                    if ev.kind == "error":
                        raise ApiError(ev.status, ev.text, code="timeout" if ev.status == 504 else None)
                    if ev.kind == "done":
                        out[tag] = ev
        return out


def merged(got: list[tuple[int, Event]]) -> list[tuple[int, Event]]:
    """Consecutive text events of one row joined into one."""
    out: list[tuple[int, Event]] = []
    for tag, ev in got:
        if ev.kind == "text" and out and out[-1][0] == tag and out[-1][1].kind == "text":
            prev = out[-1][1]
            lps = None if prev.logprobs is None else prev.logprobs + (ev.logprobs or [])
            out[-1] = (tag, Event("text", prev.text + ev.text, completion_tokens=ev.completion_tokens,
                                  logprobs=lps))
        else:
            out.append((tag, ev))
    return out


def error_event(ev: Event) -> bytes:
    return sse(ApiError(ev.status, ev.text, code="timeout" if ev.status == 504 else None).body())


def streaming(gen: AsyncIterator[bytes], headers: dict | None = None) -> StreamingResponse:
    return StreamingResponse(gen, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                      **(headers or {})})


def notice_headers(srv: ServerState) -> dict:
    """A chat answer from a model no chat stage trained says so in a header (HTTP's Warning, code 299),
    since OpenAI's body has no place for it."""
    note = srv.opts.chat_note
    return {"Warning": f'299 codeforge "{note}"'} if note else {}
