"""The wire format: request bodies (pydantic, strict types: "0.5" is not a number; OpenAI's, and
llama-server's for /infill and /completion, whose replies llama_api.py builds), OpenAI's error shape, the
builders that turn generated text into OpenAI responses and stream chunks, and llama.cpp's sampler names.

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
from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

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
                           f"{getattr(cls, 'API', 'OpenAI')}'s, listed in the serving guide)", param=name,
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
    """A top-level request body: a field this server does not know is refused by name (400
    unsupported_parameter), never dropped, so a client never believes an option
    took effect when it did not."""
    API: ClassVar[str] = "OpenAI"  # whose fields the body takes (the refusal says)
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
    # llama-server's fields that llama.cpp clients send to /v1 too (llama.vim's instruct mode); the meaning
    # is theirs (llama_api.py), and OpenAI's defaults stay: samplers picks and orders the chain (without
    # "penalties" in it, no penalty applies), id_slot and cache_prompt the prompt cache
    n_predict: int | None = Field(None, ge=-1, description="llama-server's max_tokens: -1 as many as fit; "
                                                            "takes precedence; past what fits it is cut")
    id_slot: int | None = None
    cache_prompt: bool | None = None
    samplers: object = None
    min_p: float | None = Field(None, ge=0, le=1)
    n_indent: int | None = Field(None, ge=0)
    t_max_predict_ms: int | None = Field(None, ge=-1)
    t_max_prompt_ms: object = None  # accepted, unused (llama-server does not implement it either)
    response_fields: list[str] | None = None  # accepted; llama-server projects no OpenAI reply either

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


# -- llama-server's own API (/infill, /completion): llama_api.py ------------------------------------------

def _integral(v):
    """llama-server reads a whole number given as 3.0 as 3 (JSON numbers are numbers)."""
    return int(v) if isinstance(v, float) and v.is_integer() else v


Int = Annotated[int, BeforeValidator(_integral)]
INT32_MAX = 2**31 - 1

# llama-server's request fields (tools/server/server-schema.cpp at the pinned llama.cpp, and what
# handle_completions_impl and post_infill read) that codeforge takes but does not act on: accepted, whatever
# their value, and named in a Warning header when given (the serving guide lists them). A field neither
# server knows is refused by name.
LLAMA_IGNORED = (
    "verbose", "timings_per_token", "stream_options", "return_progress", "sse_ping_interval", "n_keep",
    "n_discard", "n_cache_reuse", "top_n_sigma", "xtc_probability", "xtc_threshold", "typical_p",
    "dynatemp_range", "dynatemp_exponent", "repeat_last_n", "dry_multiplier", "dry_base",
    "dry_allowed_length", "dry_penalty_last_n", "dry_sequence_breakers", "mirostat", "mirostat_tau",
    "mirostat_eta", "adaptive_target", "adaptive_decay", "n_probs", "logprobs", "min_keep",
    "backend_sampling", "post_sampling_probs", "lora", "json_schema", "grammar", "grammar_type",
    "grammar_lazy", "grammar_triggers", "preserved_tokens", "chat_format", "reasoning_format",
    "generation_prompt", "parse_tool_calls", "chat_parser", "continue_final_message", "echo",
    "reasoning_control", "reasoning_budget_tokens", "reasoning_budget_start_tag", "reasoning_budget_end_tags",
    "reasoning_budget_end_tag", "reasoning_budget_message", "logit_bias", "ignore_eos", "message_delimiters",
)
# (t_max_prompt_ms and model are accepted without a warning: llama-server ignores them too, the first a TODO
# of its schema, the second because it serves one model)


class LlamaBody(_Request):
    """What /infill and /completion both take: llama-server's completion fields. null is "not given" (the
    server's default), as in llama-server. Ranges llama-server enforces (n_predict, n_indent, n_cmpl,
    t_max_predict_ms) are enforced (422; n_cmpl past the slot count 400); those it clamps (top_k, top_p,
    min_p, temperature) are clamped."""
    API: ClassVar[str] = "llama-server"
    model_config = ConfigDict(strict=True, extra="forbid")

    stream: bool | None = None
    cache_prompt: bool | None = None
    return_tokens: bool | None = None
    n_predict: Int | None = Field(None, ge=-1, le=INT32_MAX)
    max_tokens: Int | None = Field(None, ge=-1, le=INT32_MAX)  # llama-server's aliases of n_predict
    max_completion_tokens: Int | None = Field(None, ge=-1, le=INT32_MAX)
    n_indent: Int | None = Field(None, ge=0, le=INT32_MAX)
    n_cmpl: Int | None = Field(None, ge=1, le=INT32_MAX)  # at most the slot count (--max-batch): 400 past it
    n: Int | None = Field(None, ge=1, le=INT32_MAX)  # n_cmpl's alias
    t_max_predict_ms: Int | None = Field(None, ge=-1, le=2**63 - 1)
    response_fields: list[str] | None = None
    top_k: Int | None = None
    top_p: float | None = Field(None, allow_inf_nan=False)
    min_p: float | None = Field(None, allow_inf_nan=False)
    temperature: float | None = Field(None, allow_inf_nan=False)
    repeat_penalty: float | None = Field(None, gt=0, allow_inf_nan=False)
    presence_penalty: float | None = Field(None, allow_inf_nan=False)
    frequency_penalty: float | None = Field(None, allow_inf_nan=False)
    seed: Int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    stop: str | Annotated[list[str], Field(max_length=64)] | None = None
    samplers: object = None  # names (a list) or letters (a string); any other JSON is ignored, as there
    id_slot: Int | None = None
    # accepted, not acted on
    t_max_prompt_ms: object = None
    model: object = None
    verbose: object = None
    timings_per_token: object = None
    stream_options: object = None
    return_progress: object = None
    sse_ping_interval: object = None
    n_keep: object = None
    n_discard: object = None
    n_cache_reuse: object = None
    top_n_sigma: object = None
    xtc_probability: object = None
    xtc_threshold: object = None
    typical_p: object = None
    dynatemp_range: object = None
    dynatemp_exponent: object = None
    repeat_last_n: object = None
    dry_multiplier: object = None
    dry_base: object = None
    dry_allowed_length: object = None
    dry_penalty_last_n: object = None
    dry_sequence_breakers: object = None
    mirostat: object = None
    mirostat_tau: object = None
    mirostat_eta: object = None
    adaptive_target: object = None
    adaptive_decay: object = None
    n_probs: object = None
    logprobs: object = None
    min_keep: object = None
    backend_sampling: object = None
    post_sampling_probs: object = None
    lora: object = None
    json_schema: object = None
    grammar: object = None
    grammar_type: object = None
    grammar_lazy: object = None
    grammar_triggers: object = None
    preserved_tokens: object = None
    chat_format: object = None
    reasoning_format: object = None
    generation_prompt: object = None
    parse_tool_calls: object = None
    chat_parser: object = None
    continue_final_message: object = None
    echo: object = None
    reasoning_control: object = None
    reasoning_budget_tokens: object = None
    reasoning_budget_start_tag: object = None
    reasoning_budget_end_tags: object = None
    reasoning_budget_end_tag: object = None
    reasoning_budget_message: object = None
    logit_bias: object = None
    ignore_eos: object = None
    message_delimiters: object = None

    def predict(self) -> int:
        """n_predict, or its aliases in llama-server's order; -1 (no limit but the context) when none."""
        for v in (self.n_predict, self.max_completion_tokens, self.max_tokens):
            if v is not None:
                return v
        return -1

    def completions(self) -> int:
        return self.n_cmpl if self.n_cmpl is not None else (self.n if self.n is not None else 1)

    def stops(self) -> list[str]:
        """The stop strings that can match (llama-server stops at once on an empty one; here it is passed
        over, as /v1 does)."""
        s = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return [x for x in s if x]

    def ignored(self) -> list[str]:
        """The fields given that llama-server acts on and this server does not."""
        return [f for f in LLAMA_IGNORED if getattr(self, f) is not None]


class LlamaExtraChunk(_Body):
    """One of /infill's input_extra chunks: text, an optional file name; other keys (llama.vim's "time") are
    ignored, as llama-server ignores them."""
    text: str
    filename: str | None = None  # absent: llama-server names the chunk "tmp" (fim.repo_infill); "" stays ""


Piece = str | Annotated[list[Int | str], Field(max_length=1 << 20)]


class InfillRequest(LlamaBody):
    """llama-server's /infill body: input_prefix and input_suffix (text, token ids or both mixed),
    input_extra (other files), prompt (text after the prefix, read with its special tokens)."""
    input_prefix: Piece = ""
    input_suffix: Piece = ""
    input_extra: list[LlamaExtraChunk] = Field(default_factory=list, max_length=256)
    prompt: str = ""


class LlamaCompletionRequest(LlamaBody):
    """llama-server's /completion body: prompt is text, token ids, ids and text mixed, an object with
    prompt_string, or a list of these (several prompts, an array in reply)."""
    prompt: object


# -- samplers (llama.cpp's common/sampling.cpp: common_sampler_types_from_names / _from_chars) ---------------
SAMPLERS = ("dry", "top_k", "top_p", "top_n_sigma", "typ_p", "min_p", "temperature", "xtc", "infill",
            "penalties", "adaptive_p")
SAMPLER_NAMES = {**{s: s for s in SAMPLERS},
                 **{s.replace("_", "-"): s for s in SAMPLERS if "_" in s},
                 **{s.replace("_", ""): s for s in SAMPLERS if "_" in s},
                 "nucleus": "top_p", "temp": "temperature", "typ": "typ_p"}
SAMPLER_CHARS = {"d": "dry", "k": "top_k", "y": "typ_p", "p": "top_p", "s": "top_n_sigma", "m": "min_p",
                 "t": "temperature", "x": "xtc", "i": "infill", "e": "penalties", "a": "adaptive_p"}
# llama-server's chain when a request names none (common/common.h)
DEFAULT_SAMPLERS = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc",
                    "temperature")
# the samplers the generation loop runs (batcher.RowParams.samplers, in chain order). Of the others, the
# penalties are applied apart (first, where llama-server's default chain has them), and dry, top_n_sigma,
# typ_p, xtc and adaptive_p do nothing at llama-server's defaults (their settings are ignored fields)
CHAIN = ("top_k", "top_p", "min_p", "temperature", "infill")
MAX_SAMPLERS = 64


def parse_samplers(value) -> list[str] | None:
    """The canonical sampler names a request's `samplers` gives, read as llama-server reads it: a list of
    names (any case; kebab-case, no-underscore and nucleus/temp/typ aliases), or a string of letters; names
    and letters it does not know are dropped. None: no chain given (any other JSON is ignored, as there).
    At most MAX_SAMPLERS entries: the chain runs for every token of the shared generation loop, so a chain of
    a million steps (a body under the size limit can hold one) would slow every request on the server."""
    if isinstance(value, (list, str)) and len(value) > MAX_SAMPLERS:
        raise ApiError(422, f"samplers: {len(value):,} entries; at most {MAX_SAMPLERS} (the chain runs for "
                            "every token)", param="samplers", code="invalid_value")
    if isinstance(value, list):
        if not all(isinstance(x, str) for x in value):
            raise ApiError(422, "samplers: a list of sampler names (strings), or a string of sampler letters",
                           param="samplers", code="invalid_value")
        return [SAMPLER_NAMES[x.lower()] for x in value if x.lower() in SAMPLER_NAMES]
    if isinstance(value, str):
        return [SAMPLER_CHARS[c] for c in value if c in SAMPLER_CHARS]
    return None


def chain(names: list[str]) -> tuple[str, ...]:
    """The samplers of `names` the generation loop runs, in their order."""
    return tuple(n for n in names if n in CHAIN)


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
