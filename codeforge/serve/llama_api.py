"""llama.cpp's own server API, as `llama-server` answers it (the llama.cpp that the pinned llama-cpp-python
vendors): POST /infill (fill in the middle, with an editor's other files) and POST /completion (and its alias
/completions), for the editor plugins written against it: llama.vim, llama.vscode and Continue's `llama.cpp`
provider.

Requests: every field llama-server reads is accepted (its schema, tools/server/server-schema.cpp, plus what
its handlers read: prompt, id_slot, input_*). Those codeforge acts on have llama-server's meaning: n_predict
(and its aliases; 0 warms the prompt cache), n_indent, t_max_predict_ms, the sampler chain `samplers` with
top_k, top_p, min_p, temperature and the infill sampler, seed, stop, stream, cache_prompt and id_slot (the
prompt cache), n_cmpl, response_fields and return_tokens. The rest (mirostat, grammar, lora, ...) are
accepted and ignored, and a Warning header names those a request gave; a field neither server knows is a 400
that names it (protocol.LlamaBody).

Replies: llama-server's objects, keys in its order, compact JSON (llama.vim matches `"content":"` in the
raw reply): content, tokens, id_slot, stop, model, tokens_predicted, tokens_evaluated,
generation_settings (with n_ctx, which llama.vscode's status bar reads), prompt, has_new_line, truncated,
stop_type, stopping_word, tokens_cached and timings; an array for several prompts or n_cmpl > 1;
response_fields projects the object to flat "a/b" keys. Streaming: one `data:` event per piece of text,
then the whole final object with empty content, and no `data: [DONE]` (llama-server sends none on these
two endpoints).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from ..fim import FIM_MIDDLE, FIM_PREFIX, FIM_SUFFIX, fit_infill, infill_stop_ids, repo_infill
from .batcher import Event, RowParams
from .protocol import (
    DEFAULT_SAMPLERS,
    ApiError,
    InfillRequest,
    LlamaBody,
    LlamaCompletionRequest,
    chain,
    parse_body,
    parse_samplers,
    sse,
)
from .state import ClientGone, Generation, ServerState, error_event, streaming

# llama-server's defaults (its CLI's, common/common.h), which a request's null or absent field keeps
DEFAULT_TEMPERATURE, DEFAULT_TOP_K, DEFAULT_TOP_P, DEFAULT_MIN_P = 0.8, 40, 0.95, 0.05
RANDOM_SEED = 0xFFFFFFFF  # LLAMA_DEFAULT_SEED: a new seed for every request


@dataclasses.dataclass
class Sampling:
    """One request's sampling as llama-server resolves it (clamped, defaults filled in)."""
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int  # RANDOM_SEED: random
    samplers: list[str]
    repeat_penalty: float
    presence_penalty: float
    frequency_penalty: float

    @classmethod
    def of(cls, b) -> Sampling:
        names = parse_samplers(b.samplers)
        seed = RANDOM_SEED if b.seed is None or b.seed % 2**32 == RANDOM_SEED else b.seed

        def num(v, default, lo, hi):
            return default if v is None else max(lo, min(hi, v))
        return cls(temperature=num(b.temperature, DEFAULT_TEMPERATURE, 0.0, float("inf")),
                   top_k=num(b.top_k, DEFAULT_TOP_K, 0, 2**31 - 1),
                   top_p=num(b.top_p, DEFAULT_TOP_P, 0.0, 1.0),
                   min_p=num(b.min_p, DEFAULT_MIN_P, 0.0, 1.0), seed=seed,
                   samplers=list(DEFAULT_SAMPLERS) if names is None else names,
                   repeat_penalty=1.0 if b.repeat_penalty is None else b.repeat_penalty,
                   presence_penalty=b.presence_penalty or 0.0, frequency_penalty=b.frequency_penalty or 0.0)

    def row_seed(self, choice: int) -> int | None:
        """Choice j of a seeded request samples with seed + j (llama-server's child tasks); else random."""
        return None if self.seed == RANDOM_SEED else (self.seed + choice) % 2**63

    def params(self, **kw) -> RowParams:
        pen = "penalties" in self.samplers  # a chain without them applies none, as llama-server's
        return RowParams(
            temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
            samplers=chain(self.samplers), presence_penalty=self.presence_penalty if pen else 0.0,
            frequency_penalty=self.frequency_penalty if pen else 0.0,
            repetition_penalty=self.repeat_penalty if pen else 1.0, **kw)


def generation_settings(srv: ServerState, b: LlamaBody, s: Sampling, seed: int) -> dict:
    """llama-server's generation_settings (task_params::to_json, in its order) with what this request runs:
    the fields codeforge ignores show their defaults, which is what it used. n_ctx (the context) comes first,
    as older llama-servers sent it; llama.vscode reads it."""
    n_predict = b.predict()
    return {
        "n_ctx": srv.block_size, "seed": seed, "temperature": s.temperature, "dynatemp_range": 0.0,
        "dynatemp_exponent": 1.0, "top_k": s.top_k, "top_p": s.top_p, "min_p": s.min_p, "top_n_sigma": -1.0,
        "xtc_probability": 0.0, "xtc_threshold": 0.1, "typical_p": 1.0, "repeat_last_n": 64,
        "repeat_penalty": s.repeat_penalty, "presence_penalty": s.presence_penalty,
        "frequency_penalty": s.frequency_penalty, "dry_multiplier": 0.0, "dry_base": 1.75,
        "dry_allowed_length": 2, "dry_penalty_last_n": 64, "dry_sequence_breakers": ["\n", ":", "\"", "*"],
        "mirostat": 0, "mirostat_tau": 5.0, "mirostat_eta": 0.1, "adaptive_target": -1.0,
        "adaptive_decay": 0.9, "stop": b.stops(), "max_tokens": n_predict, "n_predict": n_predict,
        "n_keep": 0, "n_discard": 0, "ignore_eos": False, "stream": bool(b.stream), "logit_bias": [],
        "n_probs": 0, "min_keep": 0, "grammar": "", "grammar_lazy": False, "grammar_triggers": [],
        "preserved_tokens": [],
        "chat_format": "Content-only", "reasoning_format": "none", "reasoning_in_content": False,
        "generation_prompt": "", "samplers": s.samplers, "speculative.types": "none",
        "timings_per_token": False, "post_sampling_probs": False, "backend_sampling": False, "lora": [],
    }


def project(obj: dict, fields: list[str] | None) -> dict:
    """response_fields: each "a/b" path that exists, as a flat key of its own (json_get_nested_values);
    none asked: the whole object. [""] names nothing, so it gives {}."""
    if not fields:
        return obj
    out = {}
    for path in fields:
        cur, ok = obj, True
        for k in path.split("/"):
            if ok and isinstance(cur, dict) and k in cur:
                cur = cur[k]
            else:
                ok = False
        if ok:
            out[path] = cur
    return out


def compact(obj) -> bytes:
    """llama-server's JSON: no spaces (llama.vim looks for `"content":"`), characters as they are."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def json_reply(obj, headers: dict | None = None) -> Response:
    return Response(compact(obj), media_type="application/json", headers=headers)


def ignored_header(b: LlamaBody) -> dict:
    """A Warning header (HTTP's 299, as the chat notice) naming the llama-server fields given that this
    server does not act on; none given: no header."""
    names = b.ignored()
    return {"Warning": f'299 codeforge "ignored: {", ".join(names)} (not implemented by codeforge; '
                       f'see the serving guide)"'} if names else {}


# -- the rows of one request ---------------------------------------------------------------------------------

@dataclasses.dataclass
class Task:
    """One prompt of a request: its ids, the text llama-server shows for it, whether it was cut to fit."""
    ids: list[int]
    text: str = ""
    cut: bool = False


def timings(ev: Event, n_prompt: int) -> dict:
    """llama-server's timings (server_slot_stats::to_json), from the loop's done event: prompt tokens computed
    (those the prompt cache did not hold: cache_n) and the ms to the first token; tokens sampled and the ms
    from the first to the last (the first is "free": per-token figures divide by n - 1)."""
    prompt_n, prompt_ms, predicted_ms = ev.prompt_n, ev.prompt_ms, ev.predicted_ms
    steps = max(0, ev.predicted_n - 1)
    # (a row that never reached the model, a warm-up with cache_prompt false, neither computed nor reused)
    return {"cache_n": max(0, n_prompt - prompt_n) if ev.tokens_cached else 0, "prompt_n": prompt_n,
            "prompt_ms": prompt_ms, "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
            "prompt_per_second": 1e3 / prompt_ms * prompt_n if prompt_ms > 0 else 0.0,
            "predicted_n": ev.predicted_n, "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / steps if steps else 0.0,
            "predicted_per_second": 1e3 / predicted_ms * steps if predicted_ms > 0 else 0.0}


class Answer:
    """Builds one request's replies: the final object of each row (and the stream's partial chunks)."""

    def __init__(self, srv: ServerState, b: LlamaBody, tasks: list[Task], n: int, sampling: Sampling,
                 slot: int | None):
        self.srv, self.b, self.tasks, self.n, self.s, self.slot = srv, b, tasks, n, sampling, slot
        self.stops = b.stops()

    def task(self, tag: int) -> Task:
        return self.tasks[tag // self.n]

    def id_slot(self, tag: int) -> int:
        """The prompt-cache entry the request's first row used when id_slot named one; else -1 (the server
        chose by shared prefix). llama-server's child tasks have no slot of their own either."""
        return self.srv.slot_shown(self.slot) if tag == 0 else -1

    def partial(self, tag: int, ev: Event) -> dict:
        return {"index": tag, "content": ev.text, "tokens": [r[0] for r in ev.logprobs or []], "stop": False,
                "id_slot": -1, "tokens_predicted": ev.completion_tokens,
                "tokens_evaluated": len(self.task(tag).ids)}

    def final(self, tag: int, ev: Event | None, stream: bool) -> dict:
        t = self.task(tag)
        if ev is None:  # an empty prompt: llama-server answers at once, nothing evaluated
            ev = Event("done", "", completion_tokens=0, stop_type="none")
        predicted, n_prompt = ev.completion_tokens, len(t.ids)
        stop_type = ev.stop_type or "none"
        context_full = stop_type == "limit" and n_prompt + predicted >= self.srv.block_size
        word = ""
        if stop_type == "word":  # the loop does not say which; one stop string is the one
            word = getattr(ev, "stopping_word", None) or (self.stops[0] if len(self.stops) == 1 else "")
        seed = self.s.seed if self.s.seed == RANDOM_SEED else (self.s.seed + tag % self.n) % 2**32
        obj = {"index": tag, "content": "" if stream else ev.text,
               "tokens": [r[0] for r in ev.logprobs or []] if self.b.return_tokens and not stream else [],
               "id_slot": self.id_slot(tag), "stop": True, "model": self.srv.opts.model_name,
               "tokens_predicted": predicted, "tokens_evaluated": n_prompt,
               "generation_settings": generation_settings(self.srv, self.b, self.s, seed), "prompt": t.text,
               "has_new_line": "\n" in ev.text, "truncated": t.cut or context_full, "stop_type": stop_type,
               "stopping_word": word, "tokens_cached": ev.tokens_cached, "timings": timings(ev, n_prompt)}
        return project(obj, self.b.response_fields)


def check_n(srv: ServerState, b: LlamaBody, prompts: int) -> int:
    n = b.completions()
    if n > srv.opts.max_batch:
        param = "n_cmpl" if b.n_cmpl is not None else "n"
        raise ApiError(400, f"{param} {n}: this server runs at most {srv.opts.max_batch} completions at once "
                            f"(its slots, --max-batch; llama-server's limit is its -np)", param=param,
                       code="invalid_value")
    srv.check_rows(prompts * n)
    return n


def budget(srv: ServerState, b: LlamaBody) -> int:
    """n_predict as llama-server takes it: -1 is as many as the context holds; more than --max-tokens-cap
    is that cap (never refused); the context cuts a row short (stop_type limit, truncated)."""
    want = b.predict()
    return srv.max_tokens_cap if want < 0 else min(want, srv.max_tokens_cap)


async def run(srv: ServerState, request: Request, b: LlamaBody, tasks: list[Task], n: int,
              stop_ids: frozenset[int]):
    """Queue a row per prompt and completion, and answer as llama-server does."""
    s = Sampling.of(b)
    slot = srv.slot(b.id_slot)
    max_new = budget(srv, b)
    specs = []
    for i, t in enumerate(tasks):
        if not t.ids:
            continue  # an empty prompt: answered without a row
        for j in range(n):
            tag = i * n + j
            # the first row holds the slot id_slot names; the others (llama-server's child tasks) any
            specs.append((tag, t.ids, s.params(
                max_new_tokens=max_new, seed=s.row_seed(j), stop=b.stops(), stop_ids=stop_ids,
                hide_special=True, n_indent=b.n_indent or 0,
                t_max_predict_ms=-1 if b.t_max_predict_ms is None else b.t_max_predict_ms,
                cache_slot=slot if tag == 0 else None,
                cache_prompt=True if b.cache_prompt is None else b.cache_prompt,
                logprobs=0 if b.return_tokens else None)))
    answer = Answer(srv, b, tasks, n, s, slot)
    tags = [i * n + j for i in range(len(tasks)) for j in range(n)]
    headers = ignored_header(b)
    gen = Generation(srv, specs) if specs else None

    if b.stream:
        async def events() -> AsyncIterator[bytes]:
            done = set()
            try:
                if gen is not None:
                    async with contextlib.aclosing(gen.events(request)) as evs:
                        async for got in evs:
                            for tag, ev in got:
                                if ev.kind == "error":
                                    yield error_event(ev)
                                    return
                                if ev.kind == "text":
                                    yield sse(answer.partial(tag, ev))
                                elif ev.kind == "done":
                                    done.add(tag)
                                    yield sse(answer.final(tag, ev, True))
                for tag in tags:  # the empty prompts
                    if tag not in done:
                        yield sse(answer.final(tag, None, True))
            except ClientGone:
                return
        return streaming(events(), headers)

    got: dict[int, Event] = await gen.collect(request) if gen is not None else {}
    out = [answer.final(tag, got.get(tag), stream=False) for tag in tags]
    return json_reply(out[0] if len(out) == 1 else out, headers)


# -- POST /infill --------------------------------------------------------------------------------------------

class _Pieces:
    """The tokenizer as fim.repo_infill sees it, taking llama-server's other forms of input_prefix and
    input_suffix too: token ids, or ids and text mixed (text read as plain text, as llama-server reads it)."""

    def __init__(self, tok):
        self.tok, self.special_ids = tok, tok.special_ids

    def encode(self, piece, allow_special: bool = False) -> list[int]:
        if isinstance(piece, str):
            return self.tok.encode(piece, allow_special=allow_special)
        out: list[int] = []
        for x in piece:
            out += [x] if isinstance(x, int) else self.tok.encode(x)
        return out


def clip(piece, chars: int, keep_end: bool):
    """At most `chars` characters of a piece (text, or text pieces in a mixed list: an id counts one), its
    end (a prefix) or its start (a suffix); (piece, whether anything was cut)."""
    if isinstance(piece, str):
        out = piece[-chars:] if keep_end else piece[:chars]
        return out, len(out) < len(piece)
    items = list(reversed(piece)) if keep_end else list(piece)
    kept, left = [], chars
    for x in items:
        if left <= 0:
            break
        if isinstance(x, str):
            x = x[-left:] if keep_end else x[:left]
        kept.append(x)
        left -= len(x) if isinstance(x, str) else 1
    cut = len(kept) < len(items) or any(isinstance(a, str) and a != b for a, b in zip(kept, items))
    return (kept[::-1] if keep_end else kept), cut


async def infill(srv: ServerState, request: Request):
    """llama.cpp's /infill: the middle between input_prefix (+ prompt) and input_suffix, with the files of
    input_extra before it in the repo-level layout llama-server builds (fim.repo_infill: the same tokens for
    the same request, given --infill-batch and --infill-predict as llama-server's -b and -n, and the model's
    context as its -c). A prompt still too long for the context (llama-server refuses it) loses extra context
    first, then the start of the prefix; "truncated" says when anything was cut. Special tokens are never part
    of the text returned (as in llama-server)."""
    b = parse_body(InfillRequest, await request.body())
    missing = [t for t in (FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE) if srv.tok.special_ids.get(t) is None]
    if missing:
        raise ApiError(400,
                       f"this model's tokenizer has no {', '.join(missing)} token, so it cannot fill in the "
                       "middle: /infill needs a codeforge tokenizer (every `codeforge tokenizer train` has "
                       "them) or an imported one with FIM tokens", code="infill_not_supported")
    n = check_n(srv, b, 1)
    max_new = budget(srv, b)
    # the reply keeps some room even where llama-server's rule would fill the context (its -n -1)
    reserve = min(max_new, max(srv.opts.infill_predict, 16))
    room = max(8, min(srv.max_prompt, srv.block_size - reserve))
    # more characters than the context holds: never encoded
    chars = (srv.block_size + 1) * srv.max_token_chars
    prefix, cut_p = clip(b.input_prefix, chars, keep_end=True)
    suffix, cut_s = clip(b.input_suffix, chars, keep_end=False)
    prompt = b.prompt[-chars:]
    extra = []
    for c in b.input_extra:  # a name is a path, not a file's worth of text
        extra.append((None if c.filename is None else c.filename[:4096], c.text))
    clipped = cut_p or cut_s or len(prompt) < len(b.prompt)

    def encode():
        # n_predict: the server's --infill-predict, as llama-server's rule reads its own -n, not the request's
        # what llama-server's own budget rule drops is not "truncated" (it says so only for a prompt cut
        # further to fit the context), so repo_infill's own cut is not reported
        ids, _ = repo_infill(_Pieces(srv.tok), prefix, suffix, _clip_extra(extra, chars), prompt,
                             n_ctx=srv.block_size, n_batch=srv.infill_batch,
                             n_predict=srv.opts.infill_predict)
        fitted = len(ids) > room
        if fitted:
            ids = fit_infill(ids, room, srv.tok.special_ids)
        return ids, fitted or clipped

    ids, cut = await srv.encode(encode)
    ids = srv.check_prompt(ids, "input_prefix")
    text = await srv.encode(lambda: srv.tok.decode(ids))
    return await run(srv, request, b, [Task(ids, text, cut)], n, infill_stop_ids(srv.tok))


def _clip_extra(chunks: list[tuple[str | None, str]], chars: int) -> list[tuple[str | None, str]]:
    """input_extra as (filename, text), the last `chars` characters of it in all (the prompt keeps the end of
    the extra context, so what is clipped here is never what llama.cpp's rule would keep)."""
    out: list[tuple[str | None, str]] = []
    for name, text in reversed(chunks):
        if chars <= 0:
            break
        out.append((name, text[-chars:]))
        chars -= len(text) + len(name or "") + 1
    return out[::-1]


# -- POST /completion ----------------------------------------------------------------------------------------

def prompt_forms(prompt) -> list:
    """llama-server's prompt forms (tokenize_input_prompts): text, token ids, ids and text mixed, an object
    {"prompt_string": ...}, or a list of those (several prompts). A list holding a number is one prompt."""
    if isinstance(prompt, list) and prompt and not any(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                      for x in prompt):
        return list(prompt)
    if isinstance(prompt, list) and not prompt:
        raise ApiError(400, "prompt must not be empty (give text, token ids, or a list of prompts)",
                       param="prompt", code="invalid_value")
    return [prompt]


def one_prompt(p, i: int):
    """A prompt as text, or as a list of ids and texts; anything else is a 422 that says what is taken."""
    where = "prompt" if i < 0 else f"prompt.{i}"
    if isinstance(p, dict):
        if "multimodal_data" in p:
            raise ApiError(400, f"{where}: multimodal_data: this model reads text only", param=where,
                           code="unsupported_content")
        if set(p) - {"prompt_string"} or "prompt_string" not in p:
            raise ApiError(422, f"{where}: an object prompt has one key, prompt_string", param=where,
                           code="invalid_value")
        p = p["prompt_string"]
    if isinstance(p, str):
        return p
    if isinstance(p, list) and all(isinstance(x, str) or (isinstance(x, int) and not isinstance(x, bool))
                                   for x in p):
        return p
    if isinstance(p, list) and all(isinstance(x, (int, float, str)) and not isinstance(x, bool) for x in p):
        bad = next(x for x in p if isinstance(x, float))
        raise ApiError(422, f"{where}: token ids are whole numbers (got {bad})", param=where,
                       code="invalid_value")
    raise ApiError(422, f"{where} must be a string, a list of token ids, a list of ids and strings mixed, or "
                        "an object with prompt_string", param=where, code="invalid_value")


async def completion(srv: ServerState, request: Request):
    """llama.cpp's /completion (and /completions): raw completion of text or token ids, llama-server's reply.
    The text of a prompt follows /v1/completions' rule (Engine._encode_prompt): a text that starts with a FIM
    token (what a client that renders a FIM template sends) is read with its special tokens, any other text
    is plain text, whatever it mentions; ids in a prompt are taken as they are (the way to place any
    special token)."""
    b = parse_body(LlamaCompletionRequest, await request.body())
    forms = prompt_forms(b.prompt)
    prompts = [one_prompt(p, i if len(forms) > 1 else -1) for i, p in enumerate(forms)]
    n = check_n(srv, b, len(prompts))
    for p in prompts:
        srv.check_chars(p if isinstance(p, str) else "".join(x for x in p if isinstance(x, str)))

    def encode() -> list[Task]:
        out = []
        for p in prompts:
            if isinstance(p, str):
                ids = srv.engine._encode_prompt(p) if p else []
            else:
                ids = [x for piece in p
                       for x in ([piece] if isinstance(piece, int) else srv.tok.encode(piece))]
            out.append(ids)
        return out

    encoded = await srv.encode(encode)
    tasks = []
    for ids in encoded:
        if ids:
            ids = srv.check_prompt(ids)
        tasks.append(Task(ids))
    texts = await srv.encode(lambda: [srv.tok.decode(t.ids) for t in tasks])
    for t, text in zip(tasks, texts):
        t.text = text
    return await run(srv, request, b, tasks, n, infill_stop_ids(srv.tok))
