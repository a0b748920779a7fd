"""The wire format: request bodies (pydantic, strict types: "0.5" is not a number), OpenAI's error shape, and
the builders that turn generated text into OpenAI (and llama.cpp /infill) responses and stream chunks.

Errors are always {"error": {"message", "type", "param", "code"}}: 400 a request that is well-formed but
cannot be served (prompt too long, unsupported option, a message without content, a Host the server does not
answer to), 401 no or wrong API key, 403 a browser request from another site's page (Origin), 404 unknown
model or path, 413 body too large, 422 a field of the wrong type or out of range, 429 queue full
(Retry-After), 500 a failure inside the server, 503 every connection busy (connections.py), 504 a request
that ran past --request-timeout.
"""

from __future__ import annotations

import codecs
import json
import time
import uuid
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..chat import CALL_CLOSE, CALL_OPEN, IM_END, parse_assistant

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
               422: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
               503: "server_error", 504: "timeout_error"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None, type_: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}
        self.type = type_ or ERROR_TYPES.get(status,
                                             "invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _loc(loc: tuple) -> str:
    """A pydantic error location as the request's own path (messages.0.content), without union member tags
    (list[str], NamedToolChoice, literal[...])."""
    keep = [str(x) for x in loc if isinstance(x, int) or (
        isinstance(x, str) and x.replace("_", "").isalnum() and x.islower()
        and x not in ("str", "int", "float", "bool", "list", "dict", "none"))]
    return ".".join(keep)


def parse_body(cls: type[BaseModel], raw: bytes) -> BaseModel:
    """Validate a JSON body: malformed JSON -> 400, a wrong type or out-of-range value -> 422."""
    try:
        return cls.model_validate_json(raw or b"{}")
    except ValidationError as e:
        errs = e.errors(include_url=False)
        if errs and errs[0]["type"] == "json_invalid":
            raise ApiError(400, f"the request body is not valid JSON: {errs[0]['msg']}",
                           code="invalid_json") from None
        if errs and errs[0]["type"] == "model_type":
            raise ApiError(400, "the request body must be a JSON object", code="invalid_json") from None
        extra = next((x for x in errs if x["type"] == "extra_forbidden"), None)
        if extra is not None:
            name = ".".join(str(x) for x in extra["loc"])
            raise ApiError(400,
                           f"{name} is not supported by this server (leave it out; the fields it takes are "
                           f"OpenAI's, listed in the serving guide)", param=name,
                           code="unsupported_parameter") from None
        first = errs[0]
        param = _loc(first["loc"])
        same = [x for x in errs if _loc(x["loc"]) == param]
        msg = first["msg"] if len(same) == 1 else "; or ".join(dict.fromkeys(x["msg"] for x in same))
        got = first.get("input")
        shown = json.dumps(got)[:80] if isinstance(got, (str, int, float, bool,
                                                         type(None))) else type(got).__name__
        raise ApiError(422, f"{param or 'body'}: {msg} (got {shown})", param=param or None,
                       code="invalid_value") from None


# -- request bodies ----------------------------------------------------------------------------------------

class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class _Request(_Body):
    """A top-level OpenAI request body: a field this server does not know is refused by name (400
    unsupported_parameter), never dropped, so a client never believes an option
    took effect when it did not."""
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Body):
    include_usage: bool | None = False


class _Sampling(_Request):
    model: str | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, description="extension (vLLM): -1 or 0 is off")
    n: int | None = Field(None, ge=1, le=128)
    stop: str | Annotated[list[str], Field(max_length=16)] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, ge=0.01, le=10, description="extension (vLLM, CTRL)")
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    metadata: dict | None = None  # OpenAI: stored with the request; accepted, kept nowhere
    store: bool | None = None  # OpenAI: keep the completion for distillation; this server keeps nothing
    safety_identifier: str | None = None  # OpenAI: who the end user is (user's successor); accepted, unused
    prompt_cache_key: str | None = None  # OpenAI: a cache hint; accepted, unused
    service_tier: str | None = None  # OpenAI: a billing tier; accepted, unused

    def stops(self) -> list[str]:
        s = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return [x for x in s if x]

    def check_unsupported(self) -> None:
        if self.logit_bias:
            raise ApiError(400, "logit_bias is not supported by this server", param="logit_bias",
                           code="unsupported_parameter")
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options is only allowed with stream: true", param="stream_options")


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]] = ""
    suffix: str | None = None
    max_tokens: int | None = Field(None, ge=0, description="0 with echo: score the prompt, generate nothing")
    echo: bool | None = False
    logprobs: int | None = Field(None, ge=0, le=20)
    best_of: int | None = Field(None, ge=1, le=128)

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.max_tokens == 0 and self.stream:
            raise ApiError(400, "max_tokens 0 generates nothing to stream; leave out stream",
                           param="max_tokens")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise ApiError(400, "best_of other than n is not supported by this server", param="best_of",
                           code="unsupported_parameter")


class ContentPart(_Body):
    type: str
    text: str | None = None


class FunctionCall(_Body):
    name: str = Field(min_length=1)
    arguments: str | dict = "{}"


class ToolCall(_Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def text(self, i: int) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise ApiError(400,
                               f"messages.{i}.content: only text parts are supported (got a {part.type!r} "
                               f"part)", param=f"messages.{i}.content", code="unsupported_content")
        return "".join(p.text for p in self.content)


class FunctionSpec(_Body):
    model_config = ConfigDict(strict=True, extra="allow")
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict | None = None


class ToolSpec(_Body):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(_Body):
    name: str = Field(min_length=1)


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: dict | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.top_logprobs and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        if self.response_format and self.response_format.get("type") not in ("text", "json_object",
                                                                             "json_schema"):
            raise ApiError(400,
                           f"response_format {self.response_format.get('type')!r} is not supported (text, "
                           f"json_object or json_schema)", param="response_format",
                                code="unsupported_parameter")

    def rendered_messages(self) -> list[dict]:
        """The messages as chat.py renders them (developer is system; content parts joined). content is
        required, as OpenAI requires it, but for an assistant message that carries tool_calls."""
        out = []
        for i, m in enumerate(self.messages):
            if m.content is None and not (m.role == "assistant" and m.tool_calls):
                raise ApiError(400,
                               f"messages.{i}.content is missing: a {m.role} message needs content (a string "
                               f"or a list of text parts); only an assistant message with tool_calls "
                               f"may leave it out", param=f"messages.{i}.content",
                                    code="missing_required_parameter")
            d: dict = {"role": "system" if m.role == "developer" else m.role, "content": m.text(i)}
            if m.tool_calls:
                if m.role != "assistant":
                    raise ApiError(400, f"messages.{i}: only assistant messages carry tool_calls",
                                   param=f"messages.{i}.tool_calls")
                d["tool_calls"] = [{"type": "function", "function": c.function.model_dump()}
                                   for c in m.tool_calls]
            out.append(d)
        return out


class ExtraChunk(_Body):
    filename: str | None = None  # absent: llama-server names the chunk "tmp" (fim.repo_infill); "" stays ""
    text: str = ""


class TokenizeRequest(_Request):
    """vLLM's /tokenize: text (`prompt`) or a conversation (`messages`, rendered as the chat template)."""
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ToolSpec] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True  # accepted: codeforge's tokenizer adds no BOS/EOS either way
    return_token_strs: bool = False


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int] = Field(max_length=1 << 20)


class InfillRequest(_Body):
    """llama.cpp server's /infill body (the fields codeforge uses; others are ignored)."""
    model: str | None = None
    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[ExtraChunk] = Field(default_factory=list, max_length=256)
    prompt: str = ""  # appended to input_prefix (llama.cpp: the text of the current line)
    n_predict: int = Field(-1, ge=-1)
    temperature: float = Field(0.8, ge=0, le=5)
    top_k: int = Field(40, ge=-1)
    top_p: float = Field(0.95, gt=0, le=1)
    seed: int = Field(-1, ge=-1, le=2**64 - 1)
    stop: list[str] = Field(default_factory=list, max_length=16)
    stream: bool = False


# -- responses ---------------------------------------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def tool_call_json(name: str, arguments: dict) -> dict:
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def chat_message(text: str, finish_reason: str, tools_active: bool, names: set[str] | None = None,
                 parallel: bool = True) -> tuple[dict, str]:
    """(assistant message, finish_reason) for generated text. With tools on, complete <tool_call>{"name":
    ..., "arguments": {...}}</tool_call> blocks naming a declared tool (`names`; all when None) become
    message.tool_calls (finish_reason "tool_calls"; only the first unless `parallel`) and the text outside
    them the content (None when empty); when no such block parses, the whole text is the content, so
    nothing the model wrote is lost. A reply cut by the token budget keeps finish_reason "length", and a
    call it left unfinished stays in the content as written (the calls before it are tool_calls)."""
    text = text.split(IM_END, 1)[0]
    if tools_active and CALL_OPEN in text:
        cut = ""
        last = text.rfind(CALL_OPEN)
        if finish_reason == "length" and CALL_CLOSE not in text[last:]:
            text, cut = text[:last], text[last:]  # an unfinished call: the model's outcome, kept as text
        try:
            parsed = parse_assistant(text)
        except RecursionError:  # JSON nested past Python's recursion limit: not a call
            parsed = {"tool_calls": []}
        calls = [c for c in parsed["tool_calls"] if names is None or c["name"] in names]
        if calls:
            calls = [tool_call_json(c["name"], c["arguments"]) for c in calls[:None if parallel else 1]]
            content = (parsed["content"] + cut) or None
            return ({"role": "assistant", "content": content, "tool_calls": calls},
                    "length" if cut else "tool_calls")
        text += cut
    return {"role": "assistant", "content": text}, finish_reason


def held_back(text: str, marker: str = CALL_OPEN) -> int:
    """How many characters of text may be streamed as content: up to a tool-call block, and not a possible
    start of one at the end."""
    i = text.find(marker)
    if i >= 0:
        return i
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return len(text) - k
    return len(text)


def token_text(tok, i: int) -> str:
    """A token as the logprobs fields show it: its text, or "bytes:\\xNN..." when it holds part of a UTF-8
    character (OpenAI's and vLLM's convention)."""
    b = tok.token_bytes(i)
    try:
        return b.decode()
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{x:02x}" for x in b)


def completion_logprobs(tok, records: list, start: int = 0) -> dict:
    """The legacy completions `logprobs` object for records (batcher.LogProb; the first prompt token's
    log-prob is None, null in JSON): tokens, token_logprobs, top_logprobs (the top N plus the chosen token, as
    vLLM does) and each token's character offset in the choice's text."""
    dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
    tokens, lps, tops, offsets, at = [], [], [], [], start
    for rec in records:
        tid = rec[0]
        tokens.append(token_text(tok, tid))
        offsets.append(at)
        at += len(dec.decode(tok.token_bytes(tid)))
        if rec[1] is None:
            lps.append(None)
            tops.append(None)
            continue
        lps.append(rec[1])
        top = {token_text(tok, i): lp for i, lp in rec[2]}
        top.setdefault(tokens[-1], rec[1])
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets,
            "_end": at + len(dec.decode(b"", final=True))}


def chat_logprobs(tok, records: list, top: int) -> dict:
    """The chat schema's `logprobs`: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}."""
    def entry(i: int, lp: float) -> dict:
        return {"token": token_text(tok, i), "logprob": lp, "bytes": list(tok.token_bytes(i))}
    return {"content": [{**entry(t, lp), "top_logprobs": [entry(i, v) for i, v in alts[:top]]}
                        for t, lp, alts in records], "refusal": None}


def completion_response(rid: str, model: str, choices: list[dict], use: dict) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": use}


def chat_response(rid: str, model: str, choices: list[dict], use: dict) -> dict:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "system_fingerprint": None, "choices": choices, "usage": use}


def sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
