"""The HTTP app: OpenAI-compatible completions and chat (with tool calls), models, health and Prometheus
metrics, and the route table, which also serves llama-server's own /infill and /completion (llama_api.py),
over one continuous-batching generation loop (batcher.py).

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

import contextlib
import json
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from ..chat import CHAT_TEMPLATE, IM_END, encode_conversation
from ..constrain import ConstraintError, ToolGrammar, calls_kept_out
from ..tokenizer import EOT, TokenizerError
from . import llama_api
from .batcher import Event
from .guard import Guard, error_response, page_security_headers
from .metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from .options import ServeOptions
from .protocol import (
    SSE_DONE,
    ApiError,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    NamedToolChoice,
    TokenizeRequest,
    chat_logprobs,
    chat_message,
    chat_response,
    completion_logprobs,
    completion_response,
    held_back,
    new_id,
    parse_body,
    sse,
    token_text,
    usage,
)
from .state import (
    ClientGone,
    Generation,
    ServerState,
    error_event,
    fit_fim,
    merged,
    notice_headers,
    streaming,
)

PLAYGROUND = Path(__file__).parent / "static" / "playground.html"
MAX_SCHEMA_CHARS = 32_768  # a response_format schema (compiling a grammar grows faster than its size)
PLACEHOLDER = ("<!doctype html><html><head><meta charset='utf-8'><title>codeforge</title></head><body>"
               "<h1>codeforge</h1><p>playground not built: codeforge/serve/static/playground.html is "
               "missing. The API is at <code>/v1</code> (OpenAI-compatible).</p></body></html>")


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
    # Fill in the middle (a suffix, or a prompt that is a FIM template as text, as editors send it) and
    # llama-server's n_predict take what fits, as llama-server does: a max_tokens past the cap or past what
    # the prompt leaves is cut to it (finish_reason "length" when the reply reaches it), and a suffix
    # request's prefix and suffix are cut at their far ends to fit the context, never refused. Otherwise a
    # max_tokens past the cap is OpenAI's 400.
    fim = b.suffix is not None or any(isinstance(p, str) and srv.fim_text(p) for p in prompts)
    want = b.max_tokens if b.n_predict is None else (None if b.n_predict < 0 else b.n_predict)
    param = "max_tokens" if b.n_predict is None else "n_predict"
    if fim or b.n_predict is not None:
        asked = (srv.max_tokens_cap if b.n_predict is not None else 16) if want is None else want
        max_new = min(asked, srv.max_tokens_cap)
    else:
        max_new = srv.budget(b.max_tokens, "max_tokens", default=16)  # OpenAI's default for completions
    score_only = max_new == 0
    # the characters the context could hold (more than that is never encoded)
    chars = (srv.block_size + 1) * srv.max_token_chars
    reserve = min(max_new, max(srv.opts.infill_predict, 16))  # a suffix request's reply keeps this room
    room = max(8, min(srv.max_prompt, srv.block_size - reserve))
    for p in prompts:
        if isinstance(p, str):
            if b.suffix is None:
                srv.check_chars(p)
        else:
            srv.check_prompt(list(p), score_only=score_only)  # ids checked before echo decodes them

    def encode():
        tok, out = srv.tok, []
        for p in prompts:
            if not isinstance(p, str):
                out.append((list(p), tok.decode(p) if b.echo else "", False))
            elif b.suffix is not None:
                ids, cut = fit_fim(tok, p[-chars:], b.suffix[:chars], room)
                out.append((ids, p, cut or len(p) > chars or len(b.suffix) > chars))
            else:
                out.append((srv.engine._encode_prompt(p), p, False))
        return out

    encoded = await srv.encode(encode)
    ids = [srv.check_prompt(x, score_only=score_only) for x, _, _ in encoded]
    notes = []
    if any(cut for _, _, cut in encoded):
        notes.append(f"the prompt was cut to fit the context of {srv.block_size} tokens (the start of the "
                     f"prefix, the end of the suffix)")
    fits = min(srv.block_size - len(x) for x in ids)
    if fim or b.n_predict is not None:
        if (want is not None and want > max_new) or max_new > fits:
            notes.append(f"{param} {want if want is not None else -1} is more than fits: at most "
                         f"{min(max_new, fits)} tokens (finish_reason \"length\" when the reply reaches it)")
    headers = {"Warning": "299 codeforge " + json.dumps("; ".join(notes))} if notes else {}
    if b.logprobs is not None:
        srv.check_logprobs(sum((len(x) if b.echo else 0) + max_new for x in ids), b.logprobs, n, "logprobs")
    stop_ids = {srv.tok.eot_id}
    lp = {"logprobs": b.logprobs, "prompt_logprobs": b.logprobs if b.echo else None}
    specs = [(i * n + j, x, srv.row_params(b, max_new, j, stop_ids, first=i == j == 0, **lp))
             for i, x in enumerate(ids) for j in range(n)]
    echo = {i * n + j: (t if b.echo else "") for i, (_, t, _) in enumerate(encoded) for j in range(n)}
    prompt_tokens = sum(len(x) for x in ids)
    gen = Generation(srv, specs)
    rid, model = new_id("cmpl"), srv.opts.model_name
    if b.stream:
        include_usage = bool(b.stream_options and b.stream_options.include_usage)
        return streaming(stream_completions(gen, request, rid, model, echo, prompt_tokens, include_usage,
                                            srv.tok if b.logprobs is not None else None), headers)
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
        return Response(await run_in_threadpool(build), media_type="application/json", headers=headers)
    return Response(build(), media_type="application/json", headers=headers)


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
    if b.n_predict is not None:  # llama-server's budget: what fits, never refused
        max_new = srv.max_tokens_cap if b.n_predict < 0 else min(b.n_predict, srv.max_tokens_cap)
    else:
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
              srv.row_params(b, max_new, j, stop_ids, first=j == 0,
                             constraint=grammar.new() if grammar else None, **lp))
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
              ("POST", "/infill", on_request(llama_api.infill)),
              ("POST", "/completion", on_request(llama_api.completion)),
              ("POST", "/completions", on_request(llama_api.completion)),
              ("POST", "/tokenize", on_request(tokenize)),
              ("POST", "/detokenize", on_request(detokenize)),
              ("GET", "/tokenizer_info", tokenizer_info_route),
              ("GET", "/", playground)]
    for method, path, fn in routes:
        app.add_api_route(path, fn, methods=[method])
    srv.metrics.use_routes([path for _, path, _ in routes])
    return app
