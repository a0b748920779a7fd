"""One chat format end to end: the server samples under the tools' grammar (constrain.py), parses the reply
(chat.parse_assistant through protocol.chat_message), and what it returns renders back (chat.render, the
training path, and the exported Jinja template through transformers) to exactly the text the model wrote,
with the loss mask covering exactly that text. Calls land in message.tool_calls, never in content,
streamed or not; the real openai client reads them.

The model is the tiny chat run of test_serve.py, trained for a step: it has learned nothing, so every call
that parses here parses because of the grammar (without it the same model writes no call that parses:
tests/test_constrain.py shows that)."""

from __future__ import annotations

import json
import re

import pytest

from codeforge.chat import CALL_OPEN, IM_END, encode_conversation, render_text
from test_constrain import schema_errors
from test_serve import chat_run, serving  # noqa: F401  (module fixtures, reused)

TOOLS = [
    {"type": "function", "function": {"name": "read_file", "description": "Read a file.", "parameters": {
        "type": "object", "properties": {"path": {"type": "string", "maxLength": 12}}, "required": ["path"],
        "additionalProperties": False}}},
    {"type": "function",
     "function": {"name": "set_level", "description": "Set the log level.", "parameters": {
        "type": "object", "properties": {"level": {"type": "integer", "minimum": 0, "maximum": 9},
                                         "mode": {"enum": ["fast", "slow"]}},
        "required": ["level", "mode"], "additionalProperties": False}}},
]
MSGS = [{"role": "user", "content": "Read the file a.py"}]


def valid(call) -> bool:
    """A call's name is one of TOOLS and its arguments match that tool's schema (the keys, types, ranges)."""
    args = json.loads(call.function.arguments)
    if call.function.name == "read_file":
        return set(args) == {"path"} and isinstance(args["path"], str) and len(args["path"]) <= 12
    if call.function.name == "set_level":
        return (set(args) == {"level", "mode"} and isinstance(args["level"], int) and 0 <= args["level"] <= 9
                and args["mode"] in ("fast", "slow"))
    return False


@pytest.fixture(scope="module")
def live(chat_run):  # noqa: F811
    with serving(chat_run) as s:
        yield s


def generated_text(choice) -> str:
    """What the model wrote, token by token, from the chat logprobs (special tokens by name)."""
    return b"".join(bytes(e.bytes) for e in choice.logprobs.content).decode(errors="replace")


def test_required_calls_always_parse_and_render_back(live):
    c, tok = live.client, live.engine.tok
    prompt_text = render_text(MSGS, TOOLS, add_generation_prompt=True)
    finished = 0
    for seed in range(3):
        r = c.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS, tool_choice="required", n=4,
                                      temperature=1.0, seed=seed, max_tokens=120, logprobs=True)
        for ch in r.choices:
            wrote = generated_text(ch)
            assert wrote.startswith(CALL_OPEN)
            finished += 1
            assert ch.finish_reason == "tool_calls" and ch.message.tool_calls, ch
            assert all(valid(call) for call in ch.message.tool_calls), ch.message.tool_calls
            assert ch.message.content is None  # calls never leak into content
            assert wrote.endswith(IM_END)
            # the reply renders back to exactly what was generated: the server's parse is the training
            # format's inverse, and the loss mask covers exactly the assistant's tokens
            reply = {"role": "assistant", "content": None,
                     "tool_calls": [c_.model_dump() for c_ in ch.message.tool_calls]}
            assert render_text(MSGS + [reply], TOOLS) == prompt_text + wrote + "\n"
            ids, mask = encode_conversation(tok, MSGS + [reply], TOOLS)
            assert tok.decode([i for i, m in zip(ids, mask) if m]) == wrote
    assert finished == 12  # the budget keeps the tokens that close a call in reserve: none is cut short


def test_named_and_auto_calls_and_streaming(live):
    c = live.client
    named = {"type": "function", "function": {"name": "set_level"}}
    r = c.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS, tool_choice=named, n=4,
                                  temperature=1.0, seed=1, max_tokens=60)
    for ch in r.choices:
        # an untrained model may call again and again, but every call closes within the budget
        assert ch.finish_reason == "tool_calls" and ch.message.tool_calls, ch
        assert [x.function.name for x in ch.message.tool_calls] == ["set_level"] * len(ch.message.tool_calls)
        assert all(valid(x) for x in ch.message.tool_calls)
    # parallel_tool_calls false: exactly one call, then the reply ends
    r = c.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS, tool_choice=named, n=4,
                                  temperature=1.0, seed=2, max_tokens=60, parallel_tool_calls=False)
    for ch in r.choices:
        assert (
            ch.finish_reason == "tool_calls"
            and len(ch.message.tool_calls) == 1
            and valid(ch.message.tool_calls[0])
        )
    # streaming: content deltas never hold call text; the call arrives whole as a tool_calls delta
    for seed in range(3):
        chunks = [x for x in c.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS,
                                                       tool_choice=named,
                                                       temperature=1.0, seed=seed, max_tokens=60, stream=True)
                  if x.choices]
        content = "".join(x.choices[0].delta.content or "" for x in chunks)
        calls = [t for x in chunks for t in (x.choices[0].delta.tool_calls or [])]
        assert calls and all(valid(t) for t in calls)
        assert chunks[-1].choices[0].finish_reason == "tool_calls" and CALL_OPEN not in content
    # auto mode (a call only once the model opens one) is tested on the Constraint itself, where the call
    # token can be made likely: tests/test_constrain.py


def test_response_format_json(live):
    c = live.client
    schema = {"type": "object",
              "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                                "maximum": 99}},
              "required": ["ok", "n"], "additionalProperties": False}
    r = c.chat.completions.create(model="tiny", messages=MSGS, n=4, temperature=1.0, seed=0, max_tokens=40,
                                  response_format={"type": "json_schema",
                                                   "json_schema": {"name": "s", "schema": schema}})
    for ch in r.choices:
        obj = json.loads(ch.message.content)
        assert set(obj) == {"ok", "n"} and isinstance(obj["ok"], bool) and 0 <= obj["n"] <= 99
    for budget in (12, 40, 200):  # a JSON object reply is whole at any budget that fits the shortest one
        r = c.chat.completions.create(model="tiny", messages=MSGS, temperature=1.0, seed=0, max_tokens=budget,
                                      n=4, response_format={"type": "json_object"})
        for ch in r.choices:
            assert ch.finish_reason == "stop" and isinstance(json.loads(ch.message.content),
                                                             dict), (budget, ch)
    # a schema the grammar cannot take is refused, naming where
    import openai
    with pytest.raises(openai.BadRequestError, match="set_level|parameters"):
        bad = [{**TOOLS[1],
                "function": {**TOOLS[1]["function"], "parameters": {"type": "object", "properties": {
            "x": {"$ref": "#/nowhere"}}}}}]
        c.chat.completions.create(model="tiny", messages=MSGS, tools=bad, tool_choice="required")


# -- the token budget: a call (or a JSON reply) always closes within max_tokens ------------------------------

# unbounded strings and arrays: an untrained model, left to itself, writes one until the budget ends
OPEN_TOOLS = [
    {"type": "function", "function": {"name": "read_file", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}},
    {"type": "function", "function": {"name": "grep", "parameters": {
        "type": "object", "properties": {"pattern": {"type": "string"}, "paths": {"type": "array", "items": {
            "type": "string"}}, "ignore_case": {"type": "boolean"}},
        "required": ["pattern", "paths"], "additionalProperties": False}}},
]
OPEN_SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in OPEN_TOOLS}


def minimum_budget(c, **kw) -> int:
    """The shortest budget the server takes for this request: it refuses max_tokens
    1 with a 400 that names it."""
    import openai
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny", messages=MSGS, max_tokens=1, **kw)
    err = e.value.body
    assert err["code"] == "max_tokens_too_small" and err["param"] == "max_tokens", err
    return int(re.search(r"at least (\d+)", err["message"]).group(1))


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "grep"}}])
def test_a_forced_call_always_closes_within_the_budget(live, choice):
    """tool_choice required or named, temperature 1, an untrained model and a budget just above the
    shortest call (and a roomier one): every reply is one complete call of an offered tool whose arguments
    match its schema, never a call cut short and returned as text."""
    c = live.client
    least = minimum_budget(c, tools=OPEN_TOOLS, tool_choice=choice)
    shortest = {"name": "read_file", "arguments": {"path": ""}} if choice == "required" else \
        {"name": "grep", "arguments": {"pattern": "", "paths": []}}
    # + <tool_call> </tool_call> <|im_end|>
    assert 10 < least <= len(live.engine.tok.encode(json.dumps(shortest))) + 3
    names = list(OPEN_SCHEMAS) if choice == "required" else ["grep"]
    for max_tokens in (least, least + 3, 96):
        complete = 0
        for seed in range(2):
            r = c.chat.completions.create(model="tiny", messages=MSGS, tools=OPEN_TOOLS, tool_choice=choice,
                                          n=5, temperature=1.0, seed=seed, max_tokens=max_tokens)
            for ch in r.choices:
                calls = ch.message.tool_calls or []
                if ch.finish_reason == "tool_calls" and calls and ch.message.content is None and all(
                        x.function.name in names and not schema_errors(json.loads(x.function.arguments),
                                                                       OPEN_SCHEMAS[x.function.name])
                        for x in calls):
                    complete += 1
            assert r.usage.completion_tokens <= 5 * max_tokens
        assert complete == 10, f"max_tokens {max_tokens}: {complete} of 10 replies are complete calls"
    # streamed, the same: the call arrives whole
    chunks = [x for x in c.chat.completions.create(model="tiny", messages=MSGS, tools=OPEN_TOOLS,
                                                   tool_choice=choice,
                                                   temperature=1.0, seed=5, max_tokens=least, stream=True)
              if x.choices]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert [t for x in chunks for t in (x.choices[0].delta.tool_calls or [])]
    assert CALL_OPEN not in "".join(x.choices[0].delta.content or "" for x in chunks)


def test_too_small_a_budget_is_refused(live):
    import openai
    c = live.client
    for kw in ({"tools": OPEN_TOOLS, "tool_choice": "required"},
               {"response_format": {"type": "json_schema",
                                    "json_schema": {"name": "s", "schema": OPEN_SCHEMAS["grep"]}}}):
        least = minimum_budget(c, **kw)
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="tiny", messages=MSGS, max_completion_tokens=least - 1, **kw)
        assert (
            e.value.body["code"] == "max_tokens_too_small"
            and e.value.body["param"] == "max_completion_tokens"
        )
        assert str(least) in e.value.body["message"]
    # auto: any reply fits (text), so a small budget is taken; a call just cannot be opened in it
    r = c.chat.completions.create(model="tiny", messages=MSGS, tools=OPEN_TOOLS, max_tokens=2,
                                  temperature=1.0, seed=0)
    assert r.choices[0].finish_reason in ("stop", "length") and not r.choices[0].message.tool_calls


def test_a_json_reply_is_complete_within_the_budget(live):
    c = live.client
    rf = {"type": "json_schema", "json_schema": {"name": "grep", "schema": OPEN_SCHEMAS["grep"]}}
    least = minimum_budget(c, response_format=rf)
    for max_tokens in (least, least + 3, 64):
        r = c.chat.completions.create(model="tiny", messages=MSGS, n=10, temperature=1.0, seed=3,
                                      max_tokens=max_tokens, response_format=rf)
        done = [ch for ch in r.choices if ch.finish_reason == "stop"
                and not schema_errors(json.loads(ch.message.content), OPEN_SCHEMAS["grep"])]
        assert len(done) == 10, f"max_tokens {max_tokens}: {len(done)} of 10 replies are complete JSON"


def test_a_key_that_picks_a_longer_branch_still_ends_within_the_budget(live):
    """An optional key whose value is a large required object (`ky`, ~100 tokens of it with the test
    tokenizer) against a short one (`kx`, a number): the character that picks the branch is written only
    where its way fits the budget left, checked in the mask near the end and as the sampled token beyond it
    (the server's batcher calls constrain.fit_tokens), so every reply is whole JSON at every budget."""
    c = live.client
    big = {"type": "object", "properties": {f"r{i}": {"type": "string"} for i in range(12)},
           "required": [f"r{i}" for i in range(12)], "additionalProperties": False}
    schema = {"type": "object", "properties": {"kx": {"type": "integer"}, "ky": big},
              "additionalProperties": False}
    rf = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    whole = 0
    for max_tokens in (30, 60, 90, 120):
        r = c.chat.completions.create(model="tiny", messages=MSGS, n=8, temperature=1.0, seed=max_tokens,
                                      max_tokens=max_tokens, response_format=rf)
        for ch in r.choices:
            assert ch.finish_reason == "stop", (max_tokens, ch.message.content)
            assert not schema_errors(json.loads(ch.message.content), schema), ch.message.content
            whole += '"ky"' in ch.message.content
    assert whole  # the long branch, where it fits


def test_stop_sequences_never_cut_a_grammar(live):
    """A stop sequence would cut what a grammar keeps whole (`"` right after `{`, `<tool_call>` before the
    call): where a grammar holds the whole reply (a JSON response_format, tool_choice required or named),
    stop sequences are ignored and the reply is complete; free text still stops at them."""
    c = live.client
    rf = {"type": "json_schema", "json_schema": {"name": "grep", "schema": OPEN_SCHEMAS["grep"]}}
    for stop in (['"'], ["<tool_call>"], ["}", ", "]):
        r = c.chat.completions.create(model="tiny", messages=MSGS, n=3, temperature=1.0, seed=1,
                                      max_tokens=48, stop=stop, response_format=rf)
        for ch in r.choices:
            assert ch.finish_reason == "stop", (stop, ch.message.content)
            assert not schema_errors(json.loads(ch.message.content), OPEN_SCHEMAS["grep"])
        for choice in ("required", {"type": "function", "function": {"name": "grep"}}):
            r = c.chat.completions.create(model="tiny", messages=MSGS, tools=OPEN_TOOLS, tool_choice=choice,
                                          n=3, temperature=1.0, seed=1, max_tokens=48, stop=stop)
            for ch in r.choices:
                assert ch.finish_reason == "tool_calls" and ch.message.tool_calls, (stop, ch)
                assert ch.message.content is None
    r = c.chat.completions.create(model="tiny", messages=MSGS, n=3, temperature=1.0, seed=1, max_tokens=48,
                                  stop=["e"])
    assert all(ch.finish_reason == "stop" and "e" not in ch.message.content for ch in r.choices)


def test_in_auto_mode_a_stop_is_looked_for_outside_calls():
    """Auto mode with tools (free text, calls the model opens): a stop sequence ends the reply where it
    appears in the text, never inside a call (from <tool_call> to </tool_call>, or to the end while open)."""
    from codeforge.serve.batcher import _first_stop
    text = 'say "hi" <tool_call>{"name": "x"}</tool_call> and "bye"'
    assert _first_stop(text, ['"'], 0, calls=True) == 4
    # the quotes of the call are passed
    assert _first_stop(text, ['"'], 8, calls=True) == text.rindex('and "') + 4
    assert _first_stop(text, ["<tool_call>", "x"], 0, calls=True) is None
    assert _first_stop(text, ['"'], 8) == text.index('{"') + 1  # (a row without a grammar: anywhere)
    assert _first_stop('<tool_call>{"name": "x', ['"', "}"], 0, calls=True) is None  # a call still open
    assert _first_stop('a "<tool_call>{}</tool_call>', ['"<tool'], 0, calls=True) is None  # overlaps the call
