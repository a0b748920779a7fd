"""The HTTP app: OpenAI-compatible completions and chat (with tool calls), llama.cpp-style /infill, models,
health and Prometheus metrics, over one continuous-batching generation loop (batcher.py).

Request flow: the connection layer (connections.py) has already bounded how long the head and body may take
and how many connections are open. The guard (a plain ASGI middleware) then refuses a Host header that names
neither a loopback name nor the server's own address (DNS rebinding) and an Origin that is not the server's
own page (another site's page, through the user's browser), both unless --allowed-hosts/--allowed-origins
widen them; checks the API key and the body size; and records every response in the metrics. With
--allowed-origins, Starlette's CORS middleware around it answers those pages' preflight requests. A handler
validates the body (protocol.py), encodes the prompt (in a worker thread, under the tokenizer lock: the
tokenizer's special-token switch is shared state), turns the request into rows (one per prompt and choice)
and queues them; the generation thread reports events that come back to the handler's asyncio queue, which
answers in one JSON body or streams them as server-sent events. A client that disconnects cancels its rows,
which leave the batch at the next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import StreamingResponse

from ..chat import CHAT_TEMPLATE, IM_END, encode_conversation
from ..constrain import ConstraintError, ToolGrammar, calls_kept_out
from ..tokenizer import EOT, TokenizerError
from ..fim import FIM_MIDDLE, FIM_PREFIX, FIM_SUFFIX, fit_infill, infill_ids, infill_stop_ids, repo_infill
from .batcher import Event, QueueFull, Row, RowParams, Scheduler
from .guard import Guard, error_response, page_security_headers
from .metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE, Metrics
from .options import ServeOptions
from .protocol import (ApiError, ChatRequest, CompletionRequest, DetokenizeRequest, InfillRequest,
                       NamedToolChoice, SSE_DONE, TokenizeRequest, chat_logprobs, chat_message, chat_response,
                       completion_logprobs,
                       completion_response, held_back, new_id, parse_body, sse, token_text, usage)

PLAYGROUND = Path(__file__).parent / "static" / "playground.html"
MAX_SCHEMA_CHARS = 32_768  # a response_format schema (compiling a grammar grows faster than its size)
MAX_LOGPROB_RECORDS = 200_000  # entries (tokens x (top + 1) x choices) one completions answer may hold
PLACEHOLDER = ("<!doctype html><html><head><meta charset='utf-8'><title>codeforge</title></head><body>"
               "<h1>codeforge</h1><p>playground not built: codeforge/serve/static/playground.html is "
               "missing. The API is at <code>/v1</code> (OpenAI-compatible).</p></body></html>")


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

    def row_params(self, b, max_new: int, choice: int, stop_ids: set[int], **more) -> RowParams:
        seed = None if b.seed is None else (b.seed + choice) % 2**63  # choice i of a seeded request: seed + i
        return RowParams(**more, max_new_tokens=max_new,
                         temperature=1.0 if b.temperature is None else b.temperature,
                         top_p=1.0 if b.top_p is None else b.top_p, top_k=max(0, b.top_k or 0), seed=seed,
                         presence_penalty=b.presence_penalty or 0.0,
                         frequency_penalty=b.frequency_penalty or 0.0,
                         repetition_penalty=b.repetition_penalty or 1.0, stop=b.stops(),
                         stop_ids=frozenset(stop_ids))

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


# -- handlers ------------------------------------------------------------------------------------------------

async def completions(srv: ServerState, request: Request):
    b = parse_body(CompletionRequest, await request.body())
    srv.check_model(b.model)
    b.check_unsupported()
    prompts = b.prompt
    if isinstance(prompts, str):
        prompts = [prompts]
    elif not prompts:
        prompts = [""]
    elif isinstance(prompts[0], int):
        prompts = [prompts]
    if b.suffix is not None and not all(isinstance(p, str) for p in prompts):
        raise ApiError(400, "suffix (fill in the middle) needs a text prompt", param="suffix")
    if b.suffix is not None and b.echo:
        raise ApiError(400, "echo with suffix is not supported: the prompt the model sees holds the suffix "
                            "and the fill-in-the-middle tokens, which the echoed text would not",
                       param="echo")
    n = b.n or 1
    srv.check_rows(len(prompts) * n)
    max_new = srv.budget(b.max_tokens, "max_tokens", default=16)  # OpenAI's default for completions
    score_only = max_new == 0
    for p in prompts:
        if isinstance(p, str):
            srv.check_chars(p + (b.suffix or ""))
        else:
            srv.check_prompt(list(p), score_only=score_only)  # ids checked before echo decodes them

    def encode():
        tok, out = srv.tok, []
        for p in prompts:
            if not isinstance(p, str):
                out.append((list(p), tok.decode(p) if b.echo else ""))
            elif b.suffix is not None:
                out.append((infill_ids(tok, p, b.suffix), p))
            else:
                out.append((srv.engine._encode_prompt(p), p))
        return out

    encoded = await srv.encode(encode)
    ids = [srv.check_prompt(x, score_only=score_only) for x, _ in encoded]
    if b.logprobs is not None:
        srv.check_logprobs(sum((len(x) if b.echo else 0) + max_new for x in ids), b.logprobs, n, "logprobs")
    stop_ids = {srv.tok.eot_id}
    lp = {"logprobs": b.logprobs, "prompt_logprobs": b.logprobs if b.echo else None}
    specs = [(i * n + j, x, srv.row_params(b, max_new, j, stop_ids, **lp)) for i, x in enumerate(ids)
             for j in range(n)]
    echo = {i * n + j: (t if b.echo else "") for i, (_, t) in enumerate(encoded) for j in range(n)}
    prompt_tokens = sum(len(x) for x in ids)
    gen = Generation(srv, specs)
    rid, model = new_id("cmpl"), srv.opts.model_name
    if b.stream:
        include_usage = bool(b.stream_options and b.stream_options.include_usage)
        return streaming(stream_completions(gen, request, rid, model, echo, prompt_tokens, include_usage,
                                            srv.tok if b.logprobs is not None else None))
    done = await gen.collect(request)

    def logprobs(ev: Event) -> dict | None:
        if b.logprobs is None:
            return None
        lp = completion_logprobs(srv.tok, (ev.prompt_logprobs or []) + (ev.logprobs or []))
        lp.pop("_end")
        return lp

    def build() -> bytes:  # in a worker thread: a body of many log-prob entries takes a while to write
        choices = [{"index": t, "text": echo[t] + done[t].text, "logprobs": logprobs(done[t]),
                    "finish_reason": done[t].finish_reason} for t in sorted(done)]
        use = usage(prompt_tokens, sum(e.completion_tokens for e in done.values()))
        return json.dumps(completion_response(rid, model, choices, use), ensure_ascii=False).encode()

    if b.logprobs is not None:
        return Response(await run_in_threadpool(build), media_type="application/json")
    return Response(build(), media_type="application/json")


async def stream_completions(gen: Generation, request: Request, rid: str, model: str, echo: dict[int, str],
                             prompt_tokens: int, include_usage: bool, tok=None) -> AsyncIterator[bytes]:
    """Chunks as they come; with `tok` (logprobs asked), each chunk carries the records of its tokens, offsets
    counted from the start of the choice's text, and an echoed prompt waits for its log-probs."""
    created = int(time.time())
    at = dict.fromkeys(echo, 0)  # characters of each choice's records so far (text_offset counts from there)
    sent_lp = dict.fromkeys(echo, 0)  # generated records sent so far

    def chunk(choices: list[dict], use: dict | None = None) -> bytes:
        d = {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices}
        if include_usage:
            d["usage"] = use
        return sse(d)

    def choice(tag: int, text: str, finish: str | None = None, records: list | None = None) -> dict:
        lp = None
        if tok is not None:
            lp = completion_logprobs(tok, records or [], at[tag])
            at[tag] = lp.pop("_end")  # the records' own text: offsets never go back when text is held
        return {"index": tag, "text": text, "logprobs": lp, "finish_reason": finish}

    for tag, text in echo.items():
        if text and tok is None:
            yield chunk([choice(tag, text)])
    completion_tokens = 0
    try:
        async with contextlib.aclosing(gen.events(request)) as evs:
            async for got in evs:
                for tag, ev in merged(got):
                    if ev.kind == "error":
                        yield error_event(ev)
                        yield SSE_DONE
                        return
                    if ev.kind == "prompt" and tok is not None:
                        yield chunk([choice(tag, echo[tag], records=ev.prompt_logprobs)])
                    elif ev.kind == "text" and ev.text:
                        sent_lp[tag] += len(ev.logprobs or [])
                        yield chunk([choice(tag, ev.text, records=ev.logprobs)])
                    elif ev.kind == "done":
                        completion_tokens += ev.completion_tokens
                        rest = (ev.logprobs or [])[sent_lp[tag]:]
                        yield chunk([choice(tag, "", ev.finish_reason, records=rest)])
    except ClientGone:
        return
    if include_usage:
        yield chunk([], usage(prompt_tokens, completion_tokens))
    yield SSE_DONE


async def chat_completions(srv: ServerState, request: Request):
    b = parse_body(ChatRequest, await request.body())
    srv.check_model(b.model)
    b.check_unsupported()
    msgs = b.rendered_messages()
    tools = [t.model_dump(exclude_none=True) for t in b.tools] if b.tools else None
    choice = b.tool_choice
    if choice not in (None, "none", "auto") and not tools:
        raise ApiError(400, "tool_choice requires tools", param="tool_choice")
    if choice == "none" or not tools:
        tools = None  # the model is not told about the tools, and nothing is parsed as a call
    rf = b.response_format if b.response_format and b.response_format.get("type") != "text" else None
    mode = (
        ("none" if calls_kept_out(srv.tok, None, rf) else "auto")
        if tools is None
        else "auto"
        if choice in (None, "auto")
        else "required"
        if choice == "required"
        else choice.function.name
    )
    if isinstance(choice, NamedToolChoice) and choice.function.name not in {
        t["function"]["name"] for t in tools
    }:
        raise ApiError(400, f"tool_choice names {choice.function.name!r}, which is not among the tools",
                       param="tool_choice")
    # The grammar (constrain.py): a tool call, once opened (or from the start, tool_choice required or
    # named), can only be a JSON object naming one of the tools with arguments of its schema; a JSON
    # response_format holds the whole reply to its schema; "none" keeps call tokens out of the reply.
    constrained = bool(tools) or rf is not None or mode == "none"
    tools_active = bool(tools)
    names = {t["function"]["name"] for t in tools} if tools else set()
    parallel = b.parallel_tool_calls is not False
    n = b.n or 1
    srv.check_rows(n)
    max_new = srv.budget(b.max_completion_tokens or b.max_tokens,
                         "max_completion_tokens" if b.max_completion_tokens else "max_tokens")

    def encode():
        return encode_conversation(srv.tok, msgs, tools, add_generation_prompt=True)[0]

    size = len(json.dumps(rf)) if rf is not None else 0
    if size > MAX_SCHEMA_CHARS:
        raise ApiError(400, f"response_format: a schema of {size:,} characters; this server takes at most "
                            f"{MAX_SCHEMA_CHARS:,}", param="response_format", code="invalid_schema")

    srv.check_chars("".join(str(m.get("content") or "") + json.dumps(m.get("tool_calls") or "") for m in msgs)
                    + json.dumps(tools or ""), "messages")
    try:
        ids = await srv.encode(encode)
        # the grammar compiles outside the tokenizer lock, which the generation loop needs for every token
        grammar = await run_in_threadpool(lambda: ToolGrammar(srv.tok, tools, mode, rf, parallel)) \
            if constrained else None
    except ConstraintError as e:  # a tool's parameters or a response_format schema the grammar cannot take
        raise ApiError(400, str(e), param="response_format" if "response_format" in str(e) else "tools",
                       code="invalid_schema") from None
    except ValueError as e:  # chat.ChatFormatError: a tool call in the history that cannot be rendered
        raise ApiError(400, str(e), param="messages") from None
    except RecursionError:  # tool-call arguments nested past the JSON parser's recursion limit
        raise ApiError(400, "a tool call's arguments in messages are nested too deeply to read",
                       param="messages", code="tool_call_not_json") from None
    ids = srv.check_prompt(ids, "messages")
    # A reply the grammar must complete (a forced call, a JSON reply) keeps the tokens that end it in reserve
    # within the budget (constrain.py); a budget too small for the shortest such reply is refused up front.
    need = grammar.min_tokens if grammar is not None else None
    room = min(max_new, srv.block_size - len(ids))
    if need is not None and room < need:
        param = "max_completion_tokens" if b.max_completion_tokens else "max_tokens"
        if max_new < need:
            raise ApiError(400,
                           f"{param} {max_new} is too small for {grammar.describe()}: the shortest one takes "
                           f"{need} tokens; set {param} to at least {need}", param=param,
                           code="max_tokens_too_small")
        raise ApiError(400, f"the prompt of {len(ids)} tokens leaves {room} of the model's context of "
                            f"{srv.block_size} for the reply, and {grammar.describe()} takes at least "
                            f"{need}: shorten the messages", param="messages", code="context_length_exceeded")
    stop_ids = {srv.tok.eot_id, srv.tok.special_ids[IM_END]}
    top = b.top_logprobs or 0
    if b.logprobs:
        srv.check_logprobs(max_new, top, n, "top_logprobs")
    lp = {"logprobs": top if b.logprobs else None}
    specs = [(j, ids,
              srv.row_params(b, max_new, j, stop_ids, constraint=grammar.new() if grammar else None, **lp))
             for j in range(n)]
    gen = Generation(srv, specs)
    rid, model = new_id("chatcmpl"), srv.opts.model_name
    if b.stream:
        include_usage = bool(b.stream_options and b.stream_options.include_usage)
        return streaming(stream_chat(gen, request, rid, model, n, tools_active, len(ids), include_usage,
                                     names, parallel, (srv.tok, top) if b.logprobs else None),
                         notice_headers(srv))
    done = await gen.collect(request)

    def build() -> bytes:  # in a worker thread when log-probs are asked: their entries take a while to write
        choices = []
        for t in sorted(done):
            # a call the model did not complete comes back as what it wrote, finish_reason "length": the
            # budget's outcome, not a server fault (vLLM answers the same way)
            msg, finish = chat_message(done[t].text, done[t].finish_reason, tools_active, names, parallel)
            lps = chat_logprobs(srv.tok, done[t].logprobs or [], top) if b.logprobs else None
            choices.append({"index": t, "message": msg, "logprobs": lps, "finish_reason": finish})
        body = chat_response(rid, model, choices,
                             usage(len(ids), sum(e.completion_tokens for e in done.values())))
        return json.dumps(body, ensure_ascii=False).encode()

    body = await run_in_threadpool(build) if b.logprobs else build()
    return Response(body, media_type="application/json", headers=notice_headers(srv))


async def stream_chat(gen: Generation, request: Request, rid: str, model: str, n: int,
                      tools_active: bool, prompt_tokens: int, include_usage: bool,
                      names: set[str] | None = None,
                      parallel: bool = True, logprobs: tuple | None = None) -> AsyncIterator[bytes]:
    """Chunks as they come. With logprobs (tokenizer, top N), a chunk carries the records of the tokens
    generated since the last chunk; tool-call text is held back, so its records ride with the call."""
    created = int(time.time())
    pending: dict[int, list] = {t: [] for t in range(n)}  # records not sent yet
    counted = dict.fromkeys(range(n), 0)  # records that came with text events

    def chunk(choices: list[dict], use: dict | None = None) -> bytes:
        d = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
             "system_fingerprint": None, "choices": choices}
        if include_usage:
            d["usage"] = use
        return sse(d)

    def delta(tag: int, d: dict, finish: str | None = None) -> dict:
        lp = None
        if logprobs is not None and (pending[tag] or finish):
            lp, pending[tag] = chat_logprobs(logprobs[0], pending[tag], logprobs[1]), []
        return {"index": tag, "delta": d, "logprobs": lp, "finish_reason": finish}

    raw = {t: "" for t in range(n)}  # what each choice generated
    shown = {t: 0 for t in range(n)}  # characters of raw already sent as content
    for t in range(n):
        yield chunk([delta(t, {"role": "assistant", "content": ""})])
    completion_tokens = 0
    try:
        async with contextlib.aclosing(gen.events(request)) as evs:
            async for got in evs:
                for tag, ev in merged(got):
                    if ev.kind == "error":
                        yield error_event(ev)
                        yield SSE_DONE
                        return
                    if ev.kind == "text":
                        pending[tag] += ev.logprobs or []
                        counted[tag] += len(ev.logprobs or [])
                        raw[tag] += ev.text
                        upto = held_back(raw[tag]) if tools_active else len(raw[tag])
                        if upto > shown[tag]:
                            yield chunk([delta(tag, {"content": raw[tag][shown[tag]:upto]})])
                            shown[tag] = upto
                    elif ev.kind == "done":
                        completion_tokens += ev.completion_tokens
                        if ev.logprobs is not None:  # the records no text event carried (the end token)
                            pending[tag] += ev.logprobs[counted[tag]:]
                        msg, finish = chat_message(ev.text, ev.finish_reason, tools_active, names,
                                                   parallel)
                        content = msg.get("content") or ""
                        sent = raw[tag][:shown[tag]]
                        if msg.get("tool_calls"):
                            # the text outside the blocks that was not streamed yet (after a block, say)
                            if content.startswith(sent.strip()) and len(content) > len(sent.strip()):
                                yield chunk([delta(tag, {"content": content[len(sent.strip()):]})])
                            calls = [{"index": k, **c} for k, c in enumerate(msg["tool_calls"])]
                            yield chunk([delta(tag, {"tool_calls": calls})])
                        elif content.startswith(sent) and len(content) > len(sent):
                            yield chunk([delta(tag, {"content": content[len(sent):]})])
                        yield chunk([delta(tag, {}, finish)])
    except ClientGone:
        return
    if include_usage:
        yield chunk([], usage(prompt_tokens, completion_tokens))
    yield SSE_DONE


async def tokenize(srv: ServerState, request: Request):
    """vLLM's /tokenize: special-token text in a prompt becomes the special token (as Hugging Face tokenizers
    read it; lm-eval finds the end-of-text id this way); messages are rendered as the chat template."""
    b = parse_body(TokenizeRequest, await request.body())
    srv.check_model(b.model)
    if (b.prompt is None) == (b.messages is None):
        raise ApiError(400, "give either prompt (text) or messages (a conversation)", param="prompt")
    if b.prompt is not None:
        srv.check_chars(b.prompt)

        def encode():
            return srv.tok.encode(b.prompt, allow_special=True)
    else:
        if not b.messages:
            raise ApiError(400, "messages is empty: give at least one message", param="messages")
        msgs = ChatRequest(messages=b.messages).rendered_messages()
        tools = [t.model_dump(exclude_none=True) for t in b.tools] if b.tools else None
        srv.check_chars("".join(m["content"] + json.dumps(m.get("tool_calls") or "") for m in msgs)
                        + json.dumps(tools or ""), "messages")

        def encode():
            return encode_conversation(srv.tok, msgs, tools, add_generation_prompt=b.add_generation_prompt)[0]
    try:
        ids = await srv.encode(encode)
    except ValueError as e:  # chat.ChatFormatError
        raise ApiError(400, str(e), param="messages") from None
    except RecursionError:  # tool-call arguments nested past the JSON parser's recursion limit
        raise ApiError(400, "a tool call's arguments in messages are nested too deeply to read",
                       param="messages", code="tool_call_not_json") from None
    out = {"count": len(ids), "max_model_len": srv.block_size, "tokens": ids, "token_strs": None}
    if b.return_token_strs:
        out["token_strs"] = [token_text(srv.tok, i) for i in ids]
    return out


async def detokenize(srv: ServerState, request: Request):
    b = parse_body(DetokenizeRequest, await request.body())
    srv.check_model(b.model)
    bad = next((t for t in b.tokens if not 0 <= t < srv.tok.vocab_size), None)
    if bad is not None:
        raise ApiError(400, f"token id {bad} is outside the vocabulary [0, {srv.tok.vocab_size})",
                       param="tokens", code="invalid_token")
    return {"prompt": await srv.encode(lambda: srv.tok.decode(b.tokens))}


def tokenizer_info(srv: ServerState) -> dict:
    """vLLM's /tokenizer_info: the tokenizer's special tokens, context and chat template."""
    sp = srv.tok.special_ids
    return {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOT, "bos_token": None,
            "pad_token": "<pad>" if sp.get("<pad>") is not None else None, "unk_token": None,
            "model_max_length": srv.block_size, "vocab_size": srv.tok.vocab_size,
            "chat_template": CHAT_TEMPLATE, "special_tokens": {t: i for t, i in sp.items() if i is not None}}


def _clip_extra(chunks, chars: int) -> list[tuple[str | None, str]]:
    """input_extra as (filename, text), the last `chars` characters of it in all (the prompt keeps the end of
    the extra context, so what is clipped here is never what llama.cpp's rule would keep)."""
    out: list[tuple[str | None, str]] = []
    for c in reversed(chunks):
        if chars <= 0:
            break
        out.append((c.filename, c.text[-chars:]))
        chars -= len(c.text) + len(c.filename or "") + 1
    return out[::-1]


async def infill(srv: ServerState, request: Request):
    """llama.cpp's /infill: the middle between input_prefix (+ prompt) and input_suffix, with the files of
    input_extra before it in the repo-level layout llama-server builds
    (fim.repo_infill_ids: the same tokens for
    the same request, given --infill-batch and --infill-predict as llama-server's -b and -n, and the model's
    context as its -c). A prompt still too long for the context (llama-server refuses it) loses extra context
    first, then the start of the prefix; "truncated" says when anything was cut. Special tokens are never part
    of the text returned (as in llama-server)."""
    b = parse_body(InfillRequest, await request.body())
    srv.check_model(b.model)
    missing = [t for t in (FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE) if srv.tok.special_ids.get(t) is None]
    if missing:
        raise ApiError(400,
                       f"this model's tokenizer has no {', '.join(missing)} token, so it cannot fill in the "
                       "middle: /infill needs a codeforge tokenizer (every `codeforge tokenizer train` has "
                       "them) or an imported one with FIM tokens", code="infill_not_supported")
    max_new = srv.max_tokens_cap if b.n_predict < 0 else min(b.n_predict, srv.max_tokens_cap)
    # the reply keeps some room even where llama-server's rule would fill the context (its -n -1)
    reserve = min(max_new, max(srv.opts.infill_predict, 16))
    room = max(8, min(srv.max_prompt, srv.block_size - reserve))
    # more characters than the context holds: never encoded
    chars = (srv.block_size + 1) * srv.max_token_chars
    prefix_text = b.input_prefix[-chars:]
    suffix_text = b.input_suffix[:chars]
    prompt_text = b.prompt[-chars:]
    for c in b.input_extra:
        if c.filename is not None and len(c.filename) > 4096:  # a name is a path, not a file's worth of text
            c.filename = c.filename[:4096]
    clipped = (len(prefix_text), len(suffix_text), len(prompt_text)) != (len(b.input_prefix),
                                                                         len(b.input_suffix), len(b.prompt))

    def encode():
        extra = _clip_extra(b.input_extra, chars)
        # n_predict: the server's --infill-predict, as llama-server's rule reads its own -n, not the request's
        ids, cut = repo_infill(srv.tok, prefix_text, suffix_text, extra, prompt_text, n_ctx=srv.block_size,
                               n_batch=srv.infill_batch, n_predict=srv.opts.infill_predict)
        if len(ids) > room:
            ids, cut = fit_infill(ids, room, srv.tok.special_ids), True
        return ids, cut or clipped

    ids, truncated = await srv.encode(encode)
    ids = srv.check_prompt(ids)
    model = srv.opts.model_name
    final = {"stop": True, "model": model, "tokens_evaluated": len(ids), "truncated": truncated}
    if max_new == 0:
        return {"content": "", **final, "tokens_predicted": 0, "stop_type": "limit"}
    p = RowParams(max_new_tokens=max_new, temperature=b.temperature, top_p=b.top_p, top_k=max(0, b.top_k),
                  seed=None if b.seed == -1 else b.seed % 2**63, stop=[s for s in b.stop if s],
                  stop_ids=infill_stop_ids(srv.tok), hide_special=True)
    gen = Generation(srv, [(0, ids, p)])
    if b.stream:
        async def events() -> AsyncIterator[bytes]:
            try:
                async with contextlib.aclosing(gen.events(request)) as evs:
                    async for got in evs:
                        for _, ev in merged(got):
                            if ev.kind == "error":
                                yield error_event(ev)
                                return
                            if ev.kind == "text" and ev.text:
                                yield sse({"content": ev.text, "stop": False, "index": 0})
                            elif ev.kind == "done":
                                yield sse({"content": "", "index": 0, **final,
                                           "tokens_predicted": ev.completion_tokens,
                                           "stop_type": ev.stop_type})
            except ClientGone:
                return
        return streaming(events())
    ev = (await gen.collect(request))[0]
    return {"content": ev.text, "index": 0, **final, "tokens_predicted": ev.completion_tokens,
            "stop_type": ev.stop_type}


# -- the app -------------------------------------------------------------------------------------------------

def create_app(engine, opts: ServeOptions) -> FastAPI:
    """The FastAPI app over an Engine; the generation thread starts and stops with the app (lifespan)."""
    srv = ServerState(engine, opts)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        srv.sched.start()
        yield
        srv.sched.stop()
        st = srv.sched.stats
        print(f"server stopped after {time.time() - srv.created:.0f}s: {st['rows_finished']} completions, "
              f"{st['generated_tokens']:,} tokens generated", file=sys.stderr, flush=True)

    app = FastAPI(title="codeforge", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.srv = srv
    app.add_middleware(Guard, srv=srv)
    if opts.allowed_origins:  # outside the guard: preflights answered, CORS headers on the guard's errors too
        app.add_middleware(CORSMiddleware,
                           allow_origins=[o.strip().lower().rstrip("/") for o in opts.allowed_origins],
                           allow_methods=["GET", "POST"], allow_headers=["Authorization", "Content-Type"],
                           max_age=600)
    # read once: a file opened per request would cost a descriptor per connection (connections.py's budget)
    page = PLAYGROUND.read_bytes() if PLAYGROUND.is_file() else PLACEHOLDER.encode()
    page_headers = page_security_headers(page)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        return error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        if e.status_code == 404:
            return error_response(ApiError(404, f"no such endpoint: {request.method} {request.url.path}",
                                           code="unknown_url"))
        if e.status_code == 405:
            return error_response(ApiError(405, f"{request.method} is not allowed on {request.url.path}",
                                           code="method_not_allowed"))
        return error_response(ApiError(e.status_code, str(e.detail)))

    @app.exception_handler(TokenizerError)  # tokenizer work outside ServerState.encode: the same 400
    async def _tokenizer_error(request: Request, e: TokenizerError):
        return error_response(ApiError(400, str(e), code="tokenizer_failed"))

    @app.exception_handler(ClientGone)
    async def _gone(request: Request, e: ClientGone):
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it

    def model_card() -> dict:
        return {"id": opts.model_name, "object": "model", "created": srv.created, "owned_by": "codeforge",
                "max_model_len": srv.block_size, "stage": opts.stage, "checkpoint": opts.checkpoint_name,
                "chat": opts.chat_note is None, "language": opts.language}

    async def health():
        if not srv.sched.thread.is_alive():
            raise ApiError(503, "the generation loop is not running", code="unavailable")
        return {"status": "ok", "model": opts.model_name, "queue_length": srv.sched.queue_length(),
                "active_rows": srv.sched.active_rows()}

    async def metrics():
        return Response(srv.metrics.render(), media_type=METRICS_CONTENT_TYPE)

    async def models():
        return {"object": "list", "data": [model_card()]}

    async def model(model_id: str):
        srv.check_model(model_id)
        return model_card()

    async def playground():
        return HTMLResponse(page, headers=page_headers)

    # THE route table: what the app answers, and the labels /metrics counts requests under (one per route;
    # any other path is "other", so a scanner cannot grow the series). A new endpoint is one row here.
    def on_request(handler):  # a module-level handler(srv, request) as a route's endpoint
        async def endpoint(request: Request):
            return await handler(srv, request)
        return endpoint

    async def tokenizer_info_route():
        return tokenizer_info(srv)

    routes = [("GET", "/health", health), ("GET", "/metrics", metrics), ("GET", "/v1/models", models),
              ("GET", "/v1/models/{model_id:path}", model),
              ("POST", "/v1/completions", on_request(completions)),
              ("POST", "/v1/chat/completions", on_request(chat_completions)),
              ("POST", "/infill", on_request(infill)),
              ("POST", "/tokenize", on_request(tokenize)),
              ("POST", "/detokenize", on_request(detokenize)),
              ("GET", "/tokenizer_info", tokenizer_info_route),
              ("GET", "/", playground)]
    for method, path, fn in routes:
        app.add_api_route(path, fn, methods=[method])
    srv.metrics.use_routes([path for _, path, _ in routes])
    return app
