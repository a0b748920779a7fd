"""llama-server's own API on codeforge serve (serve/llama_api.py): /infill and /completion replayed with the
request shapes llama.vim, llama.vscode and Continue send (from their sources, tests name the file), and the
fields each of them reads asserted present with their types; response_fields, the prompt forms of
/completion, fields llama-server knows that codeforge ignores, unknown fields, n_cmpl, the prompt cache's
timings; and /v1/completions' fill in the middle fitted to the context (with `suffix`, and with a FIM
template rendered as text, as Continue's openai provider sends it)."""

from __future__ import annotations

import json
import re

import pytest

from codeforge.fim import infill_ids, infill_text
from codeforge.serve.state import fit_fim
from codeforge.serve.protocol import parse_samplers
from codeforge.tokenizer import CodeTokenizer
from test_export import make_run
from test_serve import assert_error, serving

BLOCK = 128
TIMINGS = ("prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second", "predicted_n",
           "predicted_ms", "predicted_per_token_ms", "predicted_per_second")
FINAL_KEYS = ["index", "content", "tokens", "id_slot", "stop", "model", "tokens_predicted",
              "tokens_evaluated", "generation_settings", "prompt", "has_new_line", "truncated", "stop_type",
              "stopping_word", "tokens_cached", "timings"]


@pytest.fixture(scope="module")
def live(tmp_path_factory, tokenizer_dir):
    """codeforge serve on a tiny random model (4 slots); `rows` collects every row the server queues."""
    run = make_run(tmp_path_factory.mktemp("llama-api") / "run", tokenizer_dir, seed=2, block_size=BLOCK)
    with serving(run, max_batch=4) as lv:
        lv.rows = []
        submit = lv.srv.sched.submit

        def recording(rows, *a, **k):
            lv.rows += rows
            return submit(rows, *a, **k)

        lv.srv.sched.submit = recording
        yield lv


def events(body: str) -> list[dict]:
    """The data: events of a llama-server stream (no [DONE] on these endpoints)."""
    parts = body.split("\n\n")
    assert parts[-1] == "", body[-200:]
    assert all(p.startswith("data: {") for p in parts[:-1]), parts
    return [json.loads(p[6:]) for p in parts[:-1]]


def check_timings(t: dict) -> None:
    assert list(t) == ["cache_n", *TIMINGS]
    assert all(isinstance(t[k], int) for k in ("cache_n", "prompt_n", "predicted_n"))
    assert all(isinstance(t[k], (int, float)) and t[k] >= 0 for k in TIMINGS)


def check_final(obj: dict, stream: bool = False) -> None:
    assert list(obj) == FINAL_KEYS
    assert isinstance(obj["content"], str) and (obj["content"] == "" or not stream)
    assert obj["stop"] is True and isinstance(obj["tokens"], list) and isinstance(obj["id_slot"], int)
    assert obj["model"] == "tiny" and isinstance(obj["prompt"], str)
    assert all(isinstance(obj[k], int) for k in ("tokens_predicted", "tokens_evaluated", "tokens_cached"))
    assert isinstance(obj["has_new_line"], bool) and isinstance(obj["truncated"], bool)
    assert obj["stop_type"] in ("none", "eos", "word", "limit") and isinstance(obj["stopping_word"], str)
    gs = obj["generation_settings"]
    assert isinstance(gs["n_ctx"], int) and gs["n_ctx"] == BLOCK
    for k in ("n_predict", "temperature", "top_k", "top_p", "min_p", "samplers", "stop", "seed"):
        assert k in gs, k
    check_timings(obj["timings"])


# -- llama.vim (autoload/llama.vim) --------------------------------------------------------------------------

VIM_FIELDS = ["content", "timings/prompt_n", "timings/prompt_ms", "timings/prompt_per_token_ms",
              "timings/prompt_per_second", "timings/predicted_n", "timings/predicted_ms",
              "timings/predicted_per_token_ms", "timings/predicted_per_second", "truncated", "tokens_cached"]
EXTRA = [{"text": "def helper(x):\n    return x * 2\n", "time": 1764400000, "filename": "util.py"},
         {"text": "ROOT = '/srv'\n", "time": 1764400001, "filename": "config.py"}]


def test_llama_vim_warm_up_fim_and_instruct(live):
    h = live.http
    # s:ring_update: the extra context into the slot's cache; the reply ({}) is ignored
    # (llama.vim always sends model, "" unless model_fim is set, and an Authorization header, empty without
    # api_key: a check of len("g:llama_config.api_key"), a string that is never empty)
    vim = {"headers": {"Authorization": "Bearer"}}  # curl sends "Bearer " with the space trimmed
    warm = h.post("/infill", json={
        "id_slot": 0, "input_prefix": "", "input_suffix": "", "input_extra": EXTRA, "prompt": "",
        "n_predict": 0, "temperature": 0.0, "samplers": [], "stream": False, "cache_prompt": True,
        "t_max_prompt_ms": 1, "t_max_predict_ms": 1, "response_fields": [""], "model": ""}, **vim)
    assert warm.status_code == 200, warm.text
    assert warm.text == "{}" and "warning" not in warm.headers
    # llama#fim
    body = {"id_slot": 0, "input_prefix": "import os\n\ndef main():\n", "input_suffix": "\n    return path\n",
            "input_extra": EXTRA, "prompt": "    path = ", "n_predict": 16, "stop": [], "n_indent": 4,
            "top_k": 40, "top_p": 0.90, "samplers": ["top_k", "top_p", "infill"], "stream": False,
            "cache_prompt": True, "t_max_prompt_ms": 500, "t_max_predict_ms": 250,
            "response_fields": VIM_FIELDS, "model": ""}
    live.rows.clear()
    r = h.post("/infill", json=body, **vim)
    assert r.status_code == 200, r.text
    # what the generation loop was asked: llama-server's chain (no temperature in it: T=1), stops and slot
    (row,) = live.rows
    p = row.p
    assert p.samplers == ("top_k", "top_p", "infill") and (p.top_k, p.top_p, p.min_p) == (40, 0.90, 0.05)
    assert (p.n_indent, p.t_max_predict_ms, p.cache_slot, p.cache_prompt) == (4, 250, 0, True)
    assert p.max_new_tokens == 16 and p.hide_special and p.repetition_penalty == 1.0
    # s:fim_on_response: the raw reply must match these before it is decoded
    assert re.match(r"^\s*{", r.text) and re.search(r'"content"\s*:"', r.text)
    got = r.json()
    assert list(got) == VIM_FIELDS  # flat keys, in the order asked
    assert isinstance(got["content"], str) and isinstance(got["truncated"], bool)
    assert isinstance(got["tokens_cached"], int) and got["tokens_cached"] > 0
    assert all(isinstance(got[f], (int, float)) for f in VIM_FIELDS if f.startswith("timings/"))
    assert got["timings/prompt_n"] > 0
    # the instruct mode's warm-up and request, to the chat endpoint, with llama-server's extra fields
    msgs = [{"role": "user", "content": "Reverse a string."}]
    w = h.post("/v1/chat/completions", json={"id_slot": 1, "messages": msgs, "samplers": [], "n_predict": 0,
                                             "stream": False, "cache_prompt": True, "response_fields": [""],
                                             "model": ""}, **vim)
    assert w.status_code == 200, w.text
    live.rows.clear()
    with h.stream("POST", "/v1/chat/completions", json={
            "id_slot": 5, "messages": msgs, "min_p": 0.1, "temperature": 0.1,
            "samplers": ["min_p", "temperature"], "stream": True, "cache_prompt": True, "max_tokens": 8,
            "model": ""}, **vim) as s:
        assert s.status_code == 200
        text = s.read().decode()
    (row,) = live.rows
    assert (row.p.samplers, row.p.min_p, row.p.temperature, row.p.cache_slot) == (
        ("min_p", "temperature"), 0.1, 0.1, 5)  # the slot id wraps in the batcher, as in llama-server
    assert text.endswith("data: [DONE]\n\n")
    chunks = [json.loads(x[6:]) for x in text.split("\n\n") if x.startswith("data: {")]
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


# -- llama.vscode (src/llama-server.ts) ----------------------------------------------------------------------

def test_llama_vscode_n_cmpl_array_and_warm_up(live):
    h = live.http
    warm = h.post("/infill", json={"id_slot": 0, "input_prefix": "", "input_suffix": "", "input_extra": EXTRA,
                                   "prompt": "", "n_predict": 0, "samplers": [], "cache_prompt": True,
                                   "t_max_prompt_ms": 500, "t_max_predict_ms": 1})
    assert warm.status_code == 200, warm.text
    w = warm.json()
    check_final(w)  # statusbar.ts reads generation_settings.n_ctx and the timings
    assert w["stop_type"] == "limit" and w["tokens_predicted"] <= 1
    assert w["generation_settings"]["n_predict"] == 0 and w["tokens_cached"] == w["tokens_evaluated"]
    body = {"id_slot": 0, "input_prefix": "def add(a, b):\n", "input_suffix": "\n\nprint(add(1, 2))\n",
            "input_extra": EXTRA, "prompt": "    return ", "n_predict": 12, "n_cmpl": 3, "top_k": 40,
            "top_p": 0.99, "stream": False, "samplers": ["top_k", "top_p", "infill"], "cache_prompt": True,
            "n_indent": 4, "t_max_prompt_ms": 500, "t_max_predict_ms": 500, "seed": 11}
    r = h.post("/infill", json=body)
    assert r.status_code == 200, r.text
    arr = r.json()
    assert isinstance(arr, list) and [x["index"] for x in arr] == [0, 1, 2]
    for x in arr:  # completion.ts getComplFromContent: the contents of an array
        check_final(x)
    assert len({x["generation_settings"]["seed"] for x in arr}) == 3  # seed, seed + 1, seed + 2
    again = h.post("/infill", json=body).json()
    assert [x["content"] for x in again] == [x["content"] for x in arr]  # seeded: the same three
    # more completions than slots: llama-server's hard limit, a 400 naming the field
    e = assert_error(h.post("/infill", json={**body, "n_cmpl": 5}), 400)
    assert e["param"] == "n_cmpl"
    assert assert_error(h.post("/completion", json={"prompt": "x", "n": 9}), 400)["param"] == "n"


# -- Continue (core/llm/llms/LlamaCpp.ts, OpenAI.ts) ---------------------------------------------------------

def test_continue_llama_cpp_provider_streams(live):
    tok = live.engine.tok
    prefix, suffix = "def f(x):\n    return ", "\n\nprint(f(2))\n"
    prompt = infill_text(prefix, suffix)  # the stableCode template it picks for a model named "tiny"
    body = {"model": "tiny", "prompt": prompt, "stream": True, "n_predict": 4096, "min_p": 0.0,
            "stop": ["<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<file_sep>", "<|endoftext|>",
                     "</fim_middle>", "</code>"], "top_k": 1, "top_p": 1.0, "temperature": 0.01}
    with live.http.stream("POST", "/completion", json=body,
                          headers={"Authorization": "Bearer undefined"}) as s:
        assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
        evs = events(s.read().decode())
    *parts, last = evs
    check_final(last, stream=True)
    assert all(p["stop"] is False and isinstance(p["content"], str) and p["id_slot"] == -1 for p in parts)
    # the template's FIM markers are the FIM tokens: the same prompt as infill_ids
    assert last["tokens_evaluated"] == len(infill_ids(tok, prefix, suffix))
    # streamSse yields value.content: the pieces add up to the whole reply
    whole = live.http.post("/completion", json={**body, "stream": False, "temperature": 0}).json()
    assert "".join(p["content"] for p in parts) == whole["content"]


def test_continue_openai_provider_fim_template(live):
    """Continue's openai provider: the FIM template as the prompt, max_tokens 4096 (its default) and no
    suffix; the reply fits the context instead of a 400."""
    c = live.client
    prompt = infill_text("def f(x):\n    return ", "\n")
    chunks = list(c.completions.create(model="tiny", prompt=prompt, max_tokens=4096, temperature=0.01,
                                       top_p=1, frequency_penalty=0, presence_penalty=0, stream=True,
                                       stop=["<fim_prefix>", "<|endoftext|>"]))
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert isinstance("".join(ch.choices[0].text for ch in chunks), str)


# -- fields --------------------------------------------------------------------------------------------------

def test_response_fields_projection(live):
    h = live.http
    fields = ["content", "timings/prompt_n", "generation_settings/n_predict", "nope/x",
              "generation_settings"]
    r = h.post("/completion", json={"prompt": "def", "n_predict": 3, "response_fields": fields})
    got = r.json()
    assert list(got) == [f for f in fields if f != "nope/x"]
    assert got["generation_settings/n_predict"] == 3 and got["generation_settings"]["n_ctx"] == BLOCK
    assert h.post("/completion", json={"prompt": "def", "n_predict": 1, "response_fields": [""]}).text == "{}"
    # a stream's last event is projected too; its pieces are not
    with h.stream("POST", "/completion", json={"prompt": "def", "n_predict": 3, "stream": True,
                                               "response_fields": ["stop", "tokens_predicted"]}) as s:
        evs = events(s.read().decode())
    assert list(evs[-1]) == ["stop", "tokens_predicted"] and evs[-1]["stop"] is True


def test_unknown_and_ignored_fields(live):
    h = live.http
    for path, body in (("/infill", {"input_prefix": "x"}), ("/completion", {"prompt": "x"})):
        e = assert_error(h.post(path, json={**body, "n_predict": 1, "frobnicate": 1}), 400,
                         "unsupported_parameter")
        assert e["param"] == "frobnicate" and "frobnicate" in e["message"] and "llama-server" in e["message"]
        ok = h.post(path, json={**body, "n_predict": 1, "mirostat": 2, "grammar": "root ::= \"a\"",
                                "t_max_prompt_ms": 5, "model": "any name", "typical_p": 0.5, "n_probs": 0})
        assert ok.status_code == 200, ok.text
        warning = ok.headers["warning"]
        assert "mirostat" in warning and "grammar" in warning and "typical_p" in warning
        assert "t_max_prompt_ms" not in warning and "model" not in warning
        # null is "not given"
        assert h.post(path, json={**body, "n_predict": None, "top_k": None, "stop": None,
                                  "response_fields": ["stop"]}).json() == {"stop": True}
    # llama-server's hard limits are enforced, its soft ones clamped
    assert_error(h.post("/infill", json={"n_indent": -1}), 422)
    assert_error(h.post("/infill", json={"t_max_predict_ms": -2}), 422)
    assert_error(h.post("/completion", json={"prompt": "x", "n_predict": -2}), 422)
    gs = h.post("/completion", json={"prompt": "x", "n_predict": 1, "top_k": -5, "top_p": 3, "min_p": -1,
                                     "temperature": -1}).json()["generation_settings"]
    assert (gs["top_k"], gs["top_p"], gs["min_p"], gs["temperature"]) == (0, 1.0, 0.0, 0.0)
    # an input_extra chunk needs its text; a key besides text and filename (llama.vim's time) is ignored
    assert_error(h.post("/infill", json={"input_extra": [{"filename": "a.py"}]}), 422)
    # the aliases: max_tokens, n
    r = h.post("/completion", json={"prompt": "x", "max_tokens": 2, "temperature": 0,
                                    "response_fields": ["generation_settings/n_predict"]})
    assert r.json() == {"generation_settings/n_predict": 2}


def test_samplers_read_as_llama_server_reads_them():
    assert parse_samplers(["Top-K", "nucleus", "temp", "minp", "typ", "bogus", "INFILL"]) == [
        "top_k", "top_p", "temperature", "min_p", "typ_p", "infill"]
    assert parse_samplers("top_k") == ["temperature", "top_p", "top_k"]  # letters: t, p, k (o, _ dropped)
    assert parse_samplers("kpmti") == ["top_k", "top_p", "min_p", "temperature", "infill"]
    assert parse_samplers([]) == [] and parse_samplers(3) is None and parse_samplers(None) is None


def test_samplers_echoed(live):
    gs = live.http.post("/infill", json={"input_prefix": "x", "n_predict": 1, "samplers": [
        "top-k", "bogus", "infill"]}).json()["generation_settings"]
    assert gs["samplers"] == ["top_k", "infill"]
    gs = live.http.post("/completion", json={"prompt": "x", "n_predict": 1}).json()["generation_settings"]
    assert gs["samplers"] == ["penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc",
                              "temperature"]
    assert (gs["temperature"], gs["top_k"], gs["top_p"], gs["min_p"]) == (0.8, 40, 0.95, 0.05)


# -- /completion's prompt forms ------------------------------------------------------------------------------

def test_completion_prompt_forms(live):
    h, tok = live.http, live.engine.tok
    g = {"n_predict": 4, "temperature": 0, "samplers": ["temperature"]}
    text = h.post("/completion", json={"prompt": "def add(a, b):", **g}).json()
    ids = tok.encode("def add(a, b):")
    assert text["tokens_evaluated"] == len(ids)
    by_ids = h.post("/completion", json={"prompt": ids, **g}).json()
    assert by_ids["content"] == text["content"] and by_ids["tokens_evaluated"] == len(ids)
    mixed = h.post("/completion", json={"prompt": [ids[0], tok.decode(ids[1:])], **g}).json()
    assert mixed["tokens_evaluated"] == len([ids[0]] + tok.encode(tok.decode(ids[1:])))
    obj = h.post("/completion", json={"prompt": {"prompt_string": "def add(a, b):"}, **g}).json()
    assert obj["content"] == text["content"]
    several = h.post("/completion", json={"prompt": ["def add(a, b):", ids], **g}).json()
    assert isinstance(several, list) and [x["index"] for x in several] == [0, 1]
    assert several[0]["content"] == several[1]["content"] == text["content"]
    # llama-server answers an empty prompt at once
    empty = h.post("/completion", json={"prompt": "", **g}).json()
    assert empty["content"] == "" and empty["tokens_evaluated"] == 0 and empty["stop_type"] == "none"
    assert_error(h.post("/completion", json={"prompt": [], **g}), 400)
    assert_error(h.post("/completion", json={"n_predict": 1}), 422)  # prompt is required
    assert_error(h.post("/completion", json={"prompt": {"prompt_string": "x", "multimodal_data": ["AA=="]}}),
                 400, "unsupported_content")
    assert_error(h.post("/completion", json={"prompt": [1.5, 2]}), 422)
    assert_error(h.post("/completion", json={"prompt": [10**9]}), 400, "invalid_token")
    # text that mentions a special token is plain text; one that starts with a FIM token is a FIM prompt
    mention = "x = '<|endoftext|>'"
    assert h.post("/completion", json={"prompt": mention, **g}).json()["tokens_evaluated"] == len(
        tok.encode(mention))
    eot = tok.eot_id
    r = h.post("/completion", json={"prompt": [eot, "x = 1"], **g}).json()  # ids place special tokens
    assert r["tokens_evaluated"] == 1 + len(tok.encode("x = 1"))
    assert r["prompt"].startswith("<|endoftext|>")
    # the /completions alias
    assert h.post("/completions", json={"prompt": ids, **g}).json()["content"] == text["content"]
    # stop as a string; stopping_word says which
    greedy = {"prompt": "def", "n_predict": 20, "temperature": 0}
    full = h.post("/completion", json=greedy).json()["content"]
    if len(full) > 6:
        word = full[3:6]
        r = h.post("/completion", json={**greedy, "stop": word}).json()
        assert r["stop_type"] == "word" and r["stopping_word"] == word
        assert r["content"] == full[:full.find(word)]


def test_return_tokens_and_streamed_pieces(live):
    h, tok = live.http, live.engine.tok
    body = {"prompt": "class A:", "n_predict": 8, "temperature": 0, "return_tokens": True}
    r = h.post("/completion", json=body).json()
    assert len(r["tokens"]) == r["tokens_predicted"] and all(isinstance(t, int) for t in r["tokens"])
    assert tok.decode(r["tokens"], skip_special=True).startswith(r["content"])
    with h.stream("POST", "/completion", json={**body, "stream": True}) as s:
        evs = events(s.read().decode())
    streamed = [t for e in evs[:-1] for t in e["tokens"]]  # the pieces' ids (an end token comes with none)
    assert streamed and streamed == r["tokens"][:len(streamed)]
    assert evs[-1]["tokens"] == [] and "".join(e["content"] for e in evs[:-1]) == r["content"]
    # without return_tokens: [] (llama-server fills the pieces' ids always, the final reply's never)
    assert h.post("/completion", json={**body, "return_tokens": False}).json()["tokens"] == []


# -- the prompt cache ----------------------------------------------------------------------------------------

def test_shared_prefix_is_cached(live):
    h = live.http
    base = {"input_prefix": "import os\nimport sys\n\ndef main(argv):\n", "input_suffix": "\n",
            "input_extra": EXTRA, "n_predict": 2, "temperature": 0, "id_slot": 2, "cache_prompt": True,
            "response_fields": ["tokens_cached", "tokens_evaluated", "timings/prompt_n", "timings/cache_n"]}
    first = h.post("/infill", json={**base, "prompt": "    x = 1"}).json()
    second = h.post("/infill", json={**base, "prompt": "    x = 2"}).json()
    assert second["timings/prompt_n"] < first["timings/prompt_n"] and second["timings/cache_n"] > 0
    assert second["timings/prompt_n"] + second["timings/cache_n"] == second["tokens_evaluated"]
    cold = h.post("/infill", json={**base, "prompt": "    x = 3", "cache_prompt": False}).json()
    assert cold["timings/prompt_n"] == cold["tokens_evaluated"]
    # a warm-up fills a slot: the request after it computes only what the warm-up had not seen
    warm = {**base, "id_slot": 3, "prompt": "", "n_predict": 0}
    assert h.post("/infill", json={**warm, "response_fields": [""]}).json() == {}
    after = h.post("/infill", json={**base, "id_slot": 3, "prompt": "    y = 1"}).json()
    assert after["timings/cache_n"] > 0 and after["timings/prompt_n"] < after["tokens_evaluated"]


# -- /v1/completions with suffix -----------------------------------------------------------------------------

def test_v1_suffix_fitted_and_max_tokens_clamped(live):
    h, tok = live.http, live.engine.tok
    prefix, suffix = "a = 1\n" * 200, "b = 2\n" * 200
    r = h.post("/v1/completions", json={"prompt": prefix, "suffix": suffix, "max_tokens": 10_000,
                                        "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    use = body["usage"]
    assert use["prompt_tokens"] + use["completion_tokens"] <= BLOCK
    assert body["choices"][0]["finish_reason"] in ("stop", "length")
    assert "cut" in r.headers["warning"] and "max_tokens" in r.headers["warning"]
    # the far ends went: the prompt is the end of the prefix and the start of the suffix, the prefix's the
    # larger share
    short = h.post("/v1/completions", json={"prompt": "def f(x):\n", "suffix": "\n", "max_tokens": 4,
                                            "temperature": 0})
    assert "warning" not in short.headers
    assert short.json()["usage"]["prompt_tokens"] == len(infill_ids(tok, "def f(x):\n", "\n"))
    # a plain prompt still gets OpenAI's refusal of a max_tokens over the cap
    assert_error(h.post("/v1/completions", json={"prompt": "x", "max_tokens": 10_000}), 400,
                 "max_tokens_exceeded")


def test_fit_fim_cuts_the_far_ends_three_to_one(tokenizer_dir):
    tok = CodeTokenizer.load(tokenizer_dir)
    sp = tok.special_ids
    pre, suf = "".join(f"p{i} = {i}\n" for i in range(60)), "".join(f"s{i} = {i}\n" for i in range(60))
    whole = infill_ids(tok, pre, suf)
    assert fit_fim(tok, pre, suf, len(whole)) == (whole, False)
    ids, cut = fit_fim(tok, pre, suf, 103)
    assert cut and len(ids) == 103
    a, b = ids.index(sp["<fim_suffix>"]), len(ids) - 1
    p_ids, s_ids = ids[1:a], ids[a + 1:b]
    assert len(s_ids) == 100 // 4 and len(p_ids) == 100 - 25
    assert whole[1:whole.index(sp["<fim_suffix>"])][-len(p_ids):] == p_ids  # the end of the prefix
    assert whole[whole.index(sp["<fim_suffix>"]) + 1:][:len(s_ids)] == s_ids  # the start of the suffix
    # a short suffix leaves the prefix the rest
    ids, cut = fit_fim(tok, pre, "x\n", 103)
    assert cut and len(ids) == 103 and tok.decode(ids).endswith("<fim_suffix>x\n<fim_middle>")


def test_v1_rows_keep_openai_sampling_unless_llama_fields_are_given(live):
    live.rows.clear()
    live.client.completions.create(model="tiny", prompt="def", max_tokens=2)
    live.client.completions.create(model="tiny", prompt="def", max_tokens=2, n=2,
                                   extra_body={"min_p": 0.2, "id_slot": 1, "cache_prompt": False})
    plain, first, second = (r.p for r in live.rows)
    assert plain.samplers is None and plain.cache_slot is None and plain.temperature == 1.0
    assert first.samplers == ("temperature", "top_k", "top_p", "min_p") and first.min_p == 0.2
    assert (first.cache_slot, second.cache_slot, first.cache_prompt) == (1, None, False)
    r = live.http.post("/v1/completions", json={"prompt": "def", "n_predict": -1, "samplers": ["top_k"]})
    row = live.rows[-1]  # -1: what the context holds (the loop cut the cap to what the prompt leaves)
    assert r.status_code == 200 and row.p.max_new_tokens == BLOCK - len(row.prompt)
    assert live.rows[-1].p.samplers == ("top_k",) and live.rows[-1].p.presence_penalty == 0.0
    assert_error(live.http.post("/v1/completions", json={"prompt": "x", "samplers": [1]}), 422)


def test_what_the_hostile_review_found(live):
    """A samplers chain of a million letters (a body under the size limit) ran a million top_k steps for every
    token in the shared loop and stalled every request: refused past 64 entries. An infinite temperature
    (JSON 1e999 reads as inf) was answered with `Infinity` in generation_settings, which strict JSON parsers
    (llama.vscode's) refuse: non-finite numbers are refused. /infill said truncated where llama-server's own
    budget rule trimmed the prompt (llama-server says truncated only for a prompt cut further to fit)."""
    h = live.http
    for samplers in ("k" * 65, ["top_k"] * 65):
        body = {"prompt": "def f", "n_predict": 2, "samplers": samplers}
        err = assert_error(h.post("/completion", json=body), 422, "invalid_value")
        assert "samplers" in err["message"] and "at most 64" in err["message"]
    ok = h.post("/completion", json={"prompt": "def f", "n_predict": 2, "samplers": "k" * 64})
    assert ok.status_code == 200, ok.text
    for field in ("temperature", "top_p", "min_p"):
        raw = '{"prompt": "def f", "n_predict": 2, "%s": 1e999}' % field
        r = h.post("/completion", content=raw, headers={"Content-Type": "application/json"})
        assert r.status_code == 422, (field, r.status_code, r.text[:200])
    # a prefix longer than llama-server's budget keeps (3/4 of --infill-batch): trimmed by its rule, not
    # truncated
    long_prefix = "".join(f"x{i} = {i}\n" for i in range(200))
    got = h.post("/infill", json={"input_prefix": long_prefix, "input_suffix": "y = 1\n", "n_predict": 2})
    assert got.status_code == 200, got.text
    assert got.json()["truncated"] is False and got.json()["tokens_evaluated"] < BLOCK
