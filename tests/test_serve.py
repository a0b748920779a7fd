"""The HTTP server, run for real (uvicorn on a free 127.0.0.1 port, in a thread; `codeforge serve` in a
subprocess once) over tiny trained runs: the openai client for completions, chat, tools and streaming;
llama.cpp's /infill; limits and a fuzz pass over the error shapes; continuous batching shown by rows joining
a running batch and giving exactly what they give alone (temperature 0 and fixed seeds)."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from codeforge.chat import CALL_OPEN, encode_conversation
from codeforge.cli import main
from codeforge.engine import Engine, SamplingParams
from codeforge.fim import infill_text, repo_infill_ids
from codeforge.serve import ServeOptions, create_app
from codeforge.serve.app import PLAYGROUND, stream_chat
from codeforge.serve.batcher import Event, Row, RowParams, Scheduler
from codeforge.serve.protocol import chat_message, chat_response, usage
from codeforge.serve.server import bind

TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file.", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]
TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--max-iters", "2", "--device", "cpu",
        "--no-progress", "--eval-tokens", "128", "--batch-size", "2"]


@pytest.fixture(scope="module")
def base_run(tmp_path_factory, data_dir):
    out = tmp_path_factory.mktemp("serve") / "base"
    assert main(["train", "--data", str(data_dir), "--out", str(out), "--block-size", "64", *TINY]) == 0
    return out


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory, data_dir, tokenizer_dir):
    d = tmp_path_factory.mktemp("serve_chat")
    rows = [{"messages": [{"role": "user", "content": f"Write f{i}."},
                          {"role": "assistant", "content": f"def f{i}():\n    return {i}\n"}]}
            for i in range(30)]
    rows += [{"messages": [{"role": "user", "content": f"Read the file m{i}.py"},
                           {"role": "assistant", "content": None,
                            "tool_calls": [{"type": "function", "function": {
                               "name": "read_file", "arguments": json.dumps({"path": f"m{i}.py"})}}]},
                           {"role": "tool", "content": f"x = {i}"},
                           {"role": "assistant", "content": f"It sets x to {i}."}], "tools": TOOLS}
             for i in range(20)]
    (d / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["prepare", "--chat", "--input", str(d / "chat.jsonl"), "--tokenizer", str(tokenizer_dir),
                 "--out", str(d / "data"), "--val-fraction", "0.1"]) == 0
    assert main(["train", "--data", str(data_dir), "--out", str(d / "base"), "--block-size", "512",
                 *TINY]) == 0
    assert main(["train", "--stage", "tools", "--data", str(d / "data"), "--out", str(d / "tools"),
                 "--init-from",
                 str(d / "base"), "--max-iters", "1", "--device", "cpu", "--no-progress", "--eval-tokens",
                 "128", "--batch-size", "2"]) == 0
    return d / "tools"


class Live:
    """A running server: base URL, its state (scheduler, metrics) and clients."""

    def __init__(self, url: str, srv, engine: Engine):
        self.url, self.srv, self.engine = url, srv, engine
        self.http = httpx.Client(base_url=url, timeout=30)
        self.client = openai.OpenAI(base_url=url + "/v1", api_key=srv.opts.api_key or "none", max_retries=0,
                                    timeout=30)

    def metric(self, name: str) -> float:
        text = self.http.get("/metrics", headers=self.auth()).text
        m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
        assert m, f"{name} not in /metrics"
        return float(m.group(1))

    def auth(self) -> dict:
        return {"Authorization": f"Bearer {self.srv.opts.api_key}"} if self.srv.opts.api_key else {}


@contextlib.contextmanager
def serving(run, engine: Engine | None = None, **kw):
    engine = engine or Engine.from_run(str(run), "cpu")
    app = create_app(engine, ServeOptions(model_name="tiny", **kw))
    sock = bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    th = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    for _ in range(200):
        if server.started:
            break
        time.sleep(0.02)
    live = Live(f"http://127.0.0.1:{port}", app.state.srv, engine)
    try:
        yield live
    finally:
        live.http.close()
        server.should_exit = True
        th.join(10)


@pytest.fixture(scope="module")
def base(base_run):
    with serving(base_run, max_body_bytes=8192) as live:
        yield live


@pytest.fixture(scope="module")
def chat(chat_run):
    with serving(chat_run) as live:
        yield live


def wait_for(cond, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, **kw)


def assert_error(r: httpx.Response, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code:
        assert err["code"] == code, err
    return err


# -- the generation loop alone -------------------------------------------------------------------------------

def test_scheduler_rows_equal_engine_alone(base_run):
    """Rows of different lengths joining a running batch at different steps, more rows than slots (so rows
    leave and slots are reused), long enough for the cache to shift both ways: each row's text equals
    Engine.generate for that prompt alone, greedy and seeded sampling both."""
    eng = Engine.from_run(str(base_run), "cpu")
    tok = eng.tok
    prompts = ["def", "func Add(a, b int) int {\n\treturn",
               "import json\n\nclass Decoder:\n    def decode(self, s",
               "x = 1", "package main\n", "for i in range(10):\n    print(", "# comment\n", "return a +"]
    specs = [(p, dict(temperature=0.0) if i % 2 else dict(temperature=0.9, top_p=0.9, seed=i), 15 + 4 * i)
             for i, p in enumerate(prompts)]
    sched = Scheduler(eng, max_batch=3, max_queue=16)
    sched.step_delay = 0.01  # rows surely overlap, however loaded the machine
    sched.start()
    results: dict[int, list] = {}
    done = threading.Event()

    def emit(i):
        def f(ev):
            results.setdefault(i, []).append(ev)
            if ev.kind != "text" and len([k for k, v in results.items()
                                          if v[-1].kind != "text"]) == len(specs):
                done.set()
        return f

    rows = [Row(tok.encode(p), RowParams(max_new_tokens=n, stop_ids=frozenset({tok.eot_id}), **kw), emit(i))
            for i, (p, kw, n) in enumerate(specs)]
    try:
        with sched.hold():
            sched.submit(rows[:2])  # two arrive together (the second prefill shifts the first row's columns)
            wait_for(lambda: sched.queue_length() == 2)
        time.sleep(0.05)
        for r in rows[2:]:  # the rest join while others decode
            sched.submit([r])
            time.sleep(0.01)
        assert done.wait(60)
    finally:
        sched.stop()
    for i, (p, kw, n) in enumerate(specs):
        evs = results[i]
        assert evs[-1].kind == "done", evs[-1]
        alone = eng.generate([p], SamplingParams(max_new_tokens=n, **kw), warn=lambda m: None)[0]
        assert evs[-1].text == alone, (i, p)
        assert "".join(e.text for e in evs[:-1]) == alone  # the streamed pieces add up to the text
    st = sched.stats
    assert st["max_active"] == 3 and st["rows_finished"] == len(specs) and st["step_rows"] > st["steps"]


def test_scheduler_stop_sequences_and_deadline(base_run):
    eng = Engine.from_run(str(base_run), "cpu")
    alone = eng.generate(["def"], greedy(30))[0]
    stop = alone[5:8] if len(alone) > 8 else None
    sched = Scheduler(eng, max_batch=2, max_queue=4)
    sched.start()
    got: list[Event] = []
    try:
        if stop:
            evt = threading.Event()
            sched.submit([Row(eng.tok.encode("def"),
                              RowParams(max_new_tokens=30, temperature=0.0, stop=[stop],
                                                               stop_ids=frozenset({eng.tok.eot_id})),
                              lambda ev: (got.append(ev), ev.kind != "text" and evt.set()))])
            assert evt.wait(30)
            assert got[-1].text == alone[:alone.find(stop)] and got[-1].stop_type == "word"
            assert "".join(e.text for e in got[:-1]) == got[-1].text  # a partial stop was never streamed
        late: list[Event] = []
        evt2 = threading.Event()
        with sched.hold():
            sched.submit([Row(eng.tok.encode("x"), RowParams(max_new_tokens=5),
                              lambda ev: (late.append(ev), evt2.set()), deadline=time.monotonic() + 0.1)])
            assert evt2.wait(5)
        assert late[0].kind == "error" and late[0].status == 504
    finally:
        sched.stop()


# -- completions --------------------------------------------------------------------------------------------

def test_completions_openai_client(base):
    eng, c = base.engine, base.client
    r = c.completions.create(model="tiny", prompt="def add(a, b):", max_tokens=8, temperature=0)
    assert r.object == "text_completion" and r.model == "tiny" and len(r.choices) == 1
    assert r.choices[0].text == eng.generate(["def add(a, b):"], greedy(8))[0]
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens == len(eng.tok.encode("def add(a, b):"))
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    # seeded sampling is reproducible and equals the engine's with the same seed
    kw = dict(prompt="import ", max_tokens=10, temperature=0.9, top_p=0.95, seed=7)
    a, b = c.completions.create(model="tiny", **kw), c.completions.create(model="tiny", **kw)
    assert a.choices[0].text == b.choices[0].text
    assert a.choices[0].text == eng.generate(["import "], SamplingParams(10, 0.9, 0, 0.95, seed=7))[0]
    # several prompts x n: OpenAI's choice order, choice j seeded with seed + j
    r = c.completions.create(model="tiny", prompt=["a", "b"], n=2, max_tokens=4, temperature=0.9, seed=3)
    assert [x.index for x in r.choices] == [0, 1, 2, 3]
    assert r.choices[1].text == eng.generate(["a"], SamplingParams(4, 0.9, seed=4))[0]
    # echo, stop, token-id prompts
    r = c.completions.create(model="tiny", prompt="x = ", max_tokens=5, temperature=0, echo=True)
    assert r.choices[0].text.startswith("x = ")
    r = c.completions.create(model="tiny", prompt="def", max_tokens=30, temperature=0, stop=["\n", "("])
    assert "\n" not in r.choices[0].text and "(" not in r.choices[0].text
    ids = eng.tok.encode("return ")
    r = c.completions.create(model="tiny", prompt=ids, max_tokens=5, temperature=0)
    assert r.choices[0].text == eng.generate(["return "], greedy(5))[0] and r.usage.prompt_tokens == len(ids)
    # the context is the limit: a long max_tokens stops at block_size with finish_reason "length"
    r = c.completions.create(model="tiny", prompt="def", max_tokens=64, temperature=0,
                             extra_body={"top_k": 0})
    assert r.usage.prompt_tokens + r.usage.completion_tokens <= 64


def test_completions_fim(base):
    eng, c = base.engine, base.client
    r = c.completions.create(model="tiny", prompt="def f(x):\n    return ", suffix="\n\nprint(f(2))\n",
                             max_tokens=6, temperature=0)
    assert r.choices[0].text == eng.infill(["def f(x):\n    return "], ["\n\nprint(f(2))\n"], greedy(6))[0]
    # a raw FIM prompt (as editor plugins send it) reads the FIM markers as the special tokens
    raw = infill_text("def f(x):\n    return ", "\n\nprint(f(2))\n")
    r2 = c.completions.create(model="tiny", prompt=raw, max_tokens=6, temperature=0)
    assert r2.choices[0].text == r.choices[0].text and r2.usage.prompt_tokens == r.usage.prompt_tokens
    # text that only mentions a FIM marker (or another special token) is plain text
    mention = "# the <fim_prefix> token and <|endoftext|> in a comment\n"
    assert eng._encode_prompt(mention) == eng.tok.encode(mention)


def test_completions_streaming(base):
    c = base.client
    full = c.completions.create(model="tiny", prompt="class A:", max_tokens=12, temperature=0).choices[0]
    chunks = list(c.completions.create(model="tiny", prompt="class A:", max_tokens=12, temperature=0,
                                       stream=True, stream_options={"include_usage": True}))
    assert all(ch.object == "text_completion" for ch in chunks)
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == full.text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == full.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    # the wire format itself: data: lines, blank-line separated, closed by [DONE]
    with base.http.stream("POST", "/v1/completions",
                          json={"prompt": "x", "max_tokens": 3, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        body = r.read().decode()
    events = body.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: {") for e in events[:-2])
    assert json.loads(events[-3][6:])["choices"][0]["finish_reason"] in ("stop", "length")


def test_infill_llamacpp_shape(base):
    eng, h = base.engine, base.http
    r = h.post("/infill",
               json={"input_prefix": "def f(x):\n    return ", "input_suffix": "\n", "n_predict": 6,
                                "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    # the prompt is llama-server's repo-level one (fim.repo_infill_ids; -c 64 -b 32 for this 64-token model)
    ids = repo_infill_ids(eng.tok, "def f(x):\n    return ", "\n", n_ctx=64, n_batch=32, n_predict=-1)
    assert body["tokens_evaluated"] == len(ids) and ids[0] == eng.tok.special_ids["<|repo_name|>"]
    out = []
    for step in eng.generate_ids([ids], greedy(6)):
        if step[0] is None or step[0] == eng.tok.eot_id:
            break
        out.append(step[0])
    assert body["content"] == eng.tok.decode(out, skip_special=True) and body["stop"] is True
    extra = h.post("/infill",
                   json={"input_prefix": "x", "input_extra": [{"filename": "a.py", "text": "y = 2"}],
                                    "n_predict": 2}).json()
    assert extra["tokens_evaluated"] > body["tokens_evaluated"] - 8 and not extra["truncated"]
    big = h.post("/infill",
                 json={"input_prefix": "a = 1\n" * 100, "input_suffix": "b\n" * 100, "n_predict": 2})
    # trimmed by llama-server's own budget rule (the last 3/4 x -b of the prefix, the first -b/4 of the
    # suffix), which llama-server does not call truncated either
    assert big.status_code == 200 and big.json()["truncated"] is False
    assert big.json()["tokens_evaluated"] <= 64
    # llama-server's budget leaves room for the reply here: n_predict tokens come back
    # (unless the model ends first)
    big = h.post("/infill",
                 json={"input_prefix": "a = 1\n" * 100, "input_suffix": "b\n" * 100, "n_predict": 8,
                                  "temperature": 0}).json()
    assert big["tokens_evaluated"] + 8 <= 64 and (big["tokens_predicted"] == 8 or big["stop_type"] == "eos")
    # review fixes: a chunk without a file name is "tmp", as in llama-server; long
    # other files leave the reply room
    named = h.post("/infill",
                   json={"input_prefix": "x", "input_extra": [{"filename": "tmp", "text": "y = 2"}],
                                    "n_predict": 2}).json()
    unnamed = h.post("/infill",
                     json={"input_prefix": "x", "input_extra": [{"text": "y = 2"}], "n_predict": 2}).json()
    assert named["tokens_evaluated"] == unnamed["tokens_evaluated"]
    long = h.post("/infill",
                  json={"input_prefix": "a = 1\n" * 100, "input_suffix": "b\n" * 50, "n_predict": 12,
                                   "temperature": 0,
                                   "input_extra": [{"filename": "u.py", "text": "c = 3\n" * 80}]})
    assert long.status_code == 200 and long.json()["truncated"] is True
    # at least min(n_predict, 16) tokens of room for the reply
    assert long.json()["tokens_evaluated"] + 12 <= 64
    # a tokenizer without FIM tokens (an imported one): a 400 that says so, not a crash
    from codeforge.fim import FIM_MIDDLE
    saved = eng.tok.special_ids[FIM_MIDDLE]
    eng.tok.special_ids[FIM_MIDDLE] = None
    try:
        no = h.post("/infill", json={"input_prefix": "x", "n_predict": 2})
    finally:
        eng.tok.special_ids[FIM_MIDDLE] = saved
    assert no.status_code == 400 and no.json()["error"]["code"] == "infill_not_supported"
    assert "<fim_middle>" in no.json()["error"]["message"]
    with h.stream("POST", "/infill", json={"input_prefix": "def", "n_predict": 5, "stream": True}) as s:
        events = [json.loads(x[6:]) for x in s.read().decode().split("\n\n") if x]
    assert events[-1]["stop"] is True and all("content" in e for e in events)


# -- chat and tools -----------------------------------------------------------------------------------------

def test_chat_openai_client(chat):
    eng, c = chat.engine, chat.client
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Write a function."}]
    r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=12, temperature=0)
    m = r.choices[0].message
    assert r.object == "chat.completion" and m.role == "assistant" and isinstance(m.content, str)
    assert m.content == eng.chat(msgs, None, greedy(12))["text"]
    assert r.usage.prompt_tokens == len(encode_conversation(eng.tok, msgs, None,
                                                            add_generation_prompt=True)[0])
    # streaming adds up to the same reply; the usage chunk comes last
    chunks = list(c.chat.completions.create(model="tiny", messages=msgs, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == m.content
    assert chunks[-1].usage.total_tokens == r.usage.total_tokens
    r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=4, n=2, temperature=1.0, seed=1)
    assert [x.index for x in r.choices] == [0, 1]


def test_chat_tool_choice(chat):
    eng, c = chat.engine, chat.client
    msgs = [{"role": "user", "content": "Read the file a.py"}]
    with_tools = len(encode_conversation(eng.tok, msgs, TOOLS, add_generation_prompt=True)[0])
    without = len(encode_conversation(eng.tok, msgs, None, add_generation_prompt=True)[0])
    r = c.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS, max_tokens=8, temperature=0)
    assert r.usage.prompt_tokens == with_tools
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    r = c.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS, tool_choice="none", max_tokens=4,
                                  temperature=0)
    assert r.usage.prompt_tokens == without  # "none" hides the tools from the model
    # "required" and a named tool: the reply is a whole call, so a budget too small for the shortest one is
    # refused up front (400 max_tokens_too_small, naming the minimum), streamed or not, rather than cut short
    for choice in ("required", {"type": "function", "function": {"name": "read_file"}}):
        for stream in (False, True):
            resp = chat.http.post("/v1/chat/completions",
                                  json={"model": "tiny", "messages": msgs, "tools": TOOLS,
                                                                 "tool_choice": choice, "max_tokens": 1,
                                                                 "stream": stream})
            err = assert_error(resp, 400, "max_tokens_too_small")
            assert err["param"] == "max_tokens" and "at least" in err["message"], err
        least = int(re.search(r"at least (\d+)", err["message"]).group(1))
        # with room for it, the call is message.tool_calls, whole, even at temperature 0 on an untrained model
        for max_tokens in (least, least + 8):
            r = c.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS, tool_choice=choice,
                                          max_tokens=max_tokens, temperature=0)
            ch = r.choices[0]
            assert (
                ch.finish_reason == "tool_calls" and ch.message.tool_calls and ch.message.content is None
            ), ch
            assert ch.message.tool_calls[0].function.name == "read_file"  # the only tool
            assert r.usage.completion_tokens <= max_tokens
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        c.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS,
                                  tool_choice={"type": "function", "function": {
            "name": "nope"}})
    # a conversation with an earlier tool call and its result renders and is served
    hist = msgs + [{"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
                    "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}}]},
                   {"role": "tool", "tool_call_id": "call_1", "content": "x = 1"}]
    r = c.chat.completions.create(model="tiny", messages=hist, tools=TOOLS, max_tokens=4, temperature=0)
    assert r.choices[0].message.role == "assistant"


def test_chat_without_tools_never_calls(chat_run):
    """A request that offers no tools gets no tool call, even from a model that reaches for one on any
    request (biased to here): the call tokens are kept out, streamed or not; offered tools, it calls."""
    engine = Engine.from_run(str(chat_run), "cpu")
    bias = torch.zeros(engine.model.lm_head.out_features)
    bias[engine.tok.special_ids[CALL_OPEN]] = 30.0
    engine.model.lm_head.bias = torch.nn.Parameter(bias)
    msgs = [{"role": "user", "content": "Read the file a.py"}]
    with serving(chat_run, engine=engine) as live:
        c = live.client
        r = c.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS, max_tokens=64, temperature=0)
        ch = r.choices[0]
        assert ch.message.tool_calls and ch.finish_reason == "tool_calls", ch  # offered tools, it calls
        # a call is opened only with room to close it: in fewer tokens than the
        # shortest call, it answers in text
        r = c.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS, max_tokens=12, temperature=0)
        ch = r.choices[0]
        assert (
            not ch.message.tool_calls and CALL_OPEN not in ch.message.content and ch.finish_reason == "length"
        )
        for extra in ({}, {"tool_choice": "none", "tools": TOOLS}):
            r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=12, temperature=0, **extra)
            ch = r.choices[0]
            assert not ch.message.tool_calls and ch.message.content and CALL_OPEN not in ch.message.content, (
                ch
            )
            assert ch.finish_reason in ("stop", "length")
            chunks = [x for x in c.chat.completions.create(model="tiny", messages=msgs, max_tokens=12,
                                                           temperature=0, stream=True, **extra) if x.choices]
            assert "".join(x.choices[0].delta.content or "" for x in chunks) == ch.message.content
            assert not any(x.choices[0].delta.tool_calls for x in chunks)
    # a tokenizer without the call tokens (an imported one) cannot write a call: served without a grammar
    bare = copy.copy(engine.tok)
    bare.special_ids = {**bare.special_ids, CALL_OPEN: None, "</tool_call>": None}
    with serving(chat_run, engine=Engine(engine.model, bare, "cpu")) as live:
        r = live.client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0)
        assert r.choices[0].finish_reason == "length" and r.choices[0].message.content


def test_chat_message_content_required(chat):
    """OpenAI refuses a message without content (400), but for an assistant message carrying tool_calls."""
    h = chat.http
    for msgs, i in (([{"role": "user"}], 0), ([{"role": "user", "content": None}], 0),
                    ([{"role": "system"}, {"role": "user", "content": "x"}], 0),
                    ([{"role": "user", "content": "x"}, {"role": "assistant"},
                      {"role": "user", "content": "y"}], 1),
                    ([{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "c"}], 1)):
        err = assert_error(h.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 1}), 400,
                           "missing_required_parameter")
        assert err["param"] == f"messages.{i}.content" and "needs content" in err["message"], err
    with pytest.raises(openai.BadRequestError, match="messages.0.content"):
        chat.client.chat.completions.create(model="tiny", messages=[{"role": "user"}], max_tokens=1)
    calls = [{"id": "c1", "type": "function",
              "function": {"name": "read_file", "arguments": '{"path": "a"}'}}]
    ok = h.post("/v1/chat/completions", json={"max_tokens": 1, "messages": [
        {"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c1", "content": "y"}]})
    assert ok.status_code == 200, ok.text
    assert h.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": ""}],
                                                "max_tokens": 1}).status_code == 200


GENERATED = 'Let me look.\n<tool_call>{"name": "read_file", "arguments": {"path": "src/a.py"}}</tool_call>'


def test_tool_call_response_builder():
    msg, finish = chat_message(GENERATED, "stop", tools_active=True)
    assert finish == "tool_calls" and msg["content"] == "Let me look."
    (call,) = msg["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "read_file" and json.loads(call["function"]["arguments"]) == {
        "path": "src/a.py"
    }
    two = GENERATED + '\n<tool_call>{"name": "b", "arguments": {}}</tool_call><|im_end|>'
    msg, finish = chat_message(two, "stop", True)
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["read_file", "b"]
    assert chat_message(GENERATED, "stop", tools_active=False) == ({"role": "assistant",
                                                                    "content": GENERATED}, "stop")
    broken = '<tool_call>{"name": "read_file", "arguments": {"pa'
    assert chat_message(broken, "length", True) == ({"role": "assistant", "content": broken}, "length")
    # only declared tools become calls; parallel_tool_calls false keeps the first
    msg, finish = chat_message(two, "stop", True, names={"read_file"})
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["read_file"] and finish == "tool_calls"
    rogue = '<tool_call>{"name": "rm_rf", "arguments": {"path": "/"}}</tool_call>'
    assert chat_message(rogue, "stop", True, names={"read_file"}) == ({"role": "assistant", "content": rogue},
                                                                      "stop")
    msg, _ = chat_message(two, "stop", True, parallel=False)
    assert len(msg["tool_calls"]) == 1
    deep = '<tool_call>{"name": "b", "arguments": ' + "[" * 5000 + "]" * 5000 + "}</tool_call>"
    assert chat_message(deep, "stop", True)[1] == "stop"  # too deep to read: content, not a crash
    # the real openai client reads the built response
    body = chat_response("chatcmpl-1", "tiny",
                         [{"index": 0, "message": chat_message(GENERATED, "stop", True)[0],
                                                 "logprobs": None, "finish_reason": "tool_calls"}],
                         usage(5, 20))
    client = openai.OpenAI(base_url="http://test/v1", api_key="x", max_retries=0, http_client=httpx.Client(
        transport=httpx.MockTransport(lambda req: httpx.Response(200, json=body))))
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
    assert r.choices[0].message.tool_calls[0].function.name == "read_file"


def test_tool_call_streaming_builder():
    """The stream for a reply holding a tool call: content up to the block (never a piece of the tag), then
    the call as a tool_calls delta and finish_reason tool_calls; the openai client's stream accumulates it."""
    pieces = ["Let me ", "look.\n<tool", '_call>{"name": "read_file", ', '"arguments": {"path": "src/a.py"}}',
              "</tool_call>"]

    class FakeGen:
        async def events(self, request):
            for p in pieces:
                yield [(0, Event("text", p))]
            yield [(0, Event("done", "".join(pieces), "stop", completion_tokens=20))]

    async def run() -> bytes:
        return b"".join([x async
                         for x in stream_chat(FakeGen(), None, "chatcmpl-1", "tiny", 1, True, 5, True)])

    body = asyncio.run(run())
    chunks = [json.loads(x[6:]) for x in body.decode().split("\n\n") if x and x != "data: [DONE]"]
    content = "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks if ch["choices"])
    assert content == "Let me look.\n" and "<" not in content
    assert (
        chunks[-2]["choices"][0]["finish_reason"] == "tool_calls"
        and chunks[-1]["usage"]["total_tokens"] == 25
    )
    client = openai.OpenAI(base_url="http://test/v1", api_key="x", max_retries=0, http_client=httpx.Client(
        transport=httpx.MockTransport(lambda req: httpx.Response(
            200, content=body, headers={"content-type": "text/event-stream"}))))
    calls = [tc for ch in client.chat.completions.create(model="tiny",
                                                         messages=[{"role": "user", "content": "x"}],
                                                         stream=True) if ch.choices
             for tc in ch.choices[0].delta.tool_calls or []]
    assert len(calls) == 1 and calls[0].function.name == "read_file" and calls[0].index == 0
    assert json.loads(calls[0].function.arguments) == {"path": "src/a.py"}


# -- continuous batching over HTTP ---------------------------------------------------------------------------

def test_requests_join_a_running_batch(base):
    """A request arriving while another decodes joins its batch (it finishes while the first is still
    running, and steps decode both) and both give exactly what they give alone; four requests lined up at
    one step boundary decode as one batch."""
    c, sched = base.client, base.srv.sched
    prompts = ["def f", "import os", "class B", "x = ["]
    alone = [c.completions.create(model="tiny", prompt=p, max_tokens=20, temperature=0).choices[0].text
             for p in prompts]
    long_alone = c.completions.create(model="tiny", prompt="for", max_tokens=50,
                                      temperature=0).choices[0].text
    st = sched.stats
    steps, rows = st["steps"], st["step_rows"]
    sched.step_delay = 0.02  # slow steps, so the second request surely arrives mid-generation
    try:
        it = iter(c.completions.create(model="tiny", prompt="for", max_tokens=50, temperature=0, stream=True))
        first = next(it)  # the long request is decoding now
        joined = c.completions.create(model="tiny", prompt=prompts[0], max_tokens=20, temperature=0)
        assert sched.active_rows() == 1  # done while the long one still runs: it did not wait for it
        rest = "".join(ch.choices[0].text for ch in it if ch.choices)
    finally:
        sched.step_delay = 0.0
    assert first.choices[0].text + rest == long_alone and joined.choices[0].text == alone[0]
    assert st["step_rows"] - rows > st["steps"] - steps  # some steps decoded both rows
    steps, rows = st["steps"], st["step_rows"]
    with ThreadPoolExecutor(4) as pool:
        with sched.hold():
            futs = [pool.submit(c.completions.create, model="tiny", prompt=p, max_tokens=20, temperature=0)
                    for p in prompts]
            wait_for(lambda: sched.queue_length() == 4)
        assert [f.result().choices[0].text for f in futs] == alone
    assert (st["step_rows"] - rows) / (st["steps"] - steps) >= 2  # the mean batch of those steps
    assert base.metric("codeforge_active_rows_max") >= 4


# -- limits, errors, fuzz -----------------------------------------------------------------------------------

def test_fuzz_statuses_and_error_shape(base):
    h = base.http
    post = lambda path, **kw: h.post(path, **kw)  # noqa: E731
    assert_error(post("/v1/completions", content=b"{not json"), 400, "invalid_json")
    assert_error(post("/v1/completions", content=b"[1, 2]"), 400)
    assert_error(post("/v1/completions", content=b"\xff\xfe garbage"), 400)
    assert_error(post("/v1/completions", content=b"[" * 4000), 400)
    for body, param in [({"prompt": "x", "temperature": "hot"}, "temperature"), ({"prompt": 5}, "prompt"),
                        ({"prompt": "x", "n": 0}, "n"), ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
                        ({"prompt": "x", "top_p": 0}, "top_p"), ({"prompt": "x", "stream": "yes"}, "stream"),
                        ({"prompt": "x", "stop": [1]}, "stop"),
                        ({"prompt": "x", "temperature": 5}, "temperature"),
                        ({"prompt": [1, "a"]}, "prompt"), ({"prompt": "x", "seed": 2**70}, "seed")]:
        assert assert_error(post("/v1/completions", json=body), 422)["param"] == param, body
    for body in [{"messages": "hi"}, {"messages": []}, {"messages": [{"role": "robot", "content": "x"}]},
                 {"messages": [{"role": "user", "content": 3}]},
                 {"messages": [{"role": "user"}], "tools": [{}]},
                 {"messages": [{"role": "user"}], "tool_choice": "sometimes"}]:
        assert_error(post("/v1/chat/completions", json=body), 422)
    assert_error(post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}), 400, "unsupported_content")
    assert_error(post("/v1/completions", json={"prompt": "x", "max_tokens": 10_000}), 400,
                 "max_tokens_exceeded")
    assert_error(post("/v1/completions", json={"prompt": "word " * 200}), 400, "context_length_exceeded")
    assert_error(post("/v1/completions", json={"prompt": [999_999]}), 400, "invalid_token")
    assert_error(post("/v1/completions", json={"prompt": "x", "logit_bias": {"5": 1.0}}), 400,
                 "unsupported_parameter")
    e = assert_error(post("/v1/completions", json={"prompt": "x", "best_of_n_beams": 2}), 400,
                     "unsupported_parameter")
    assert "best_of_n_beams" in e["message"] and e["param"] == "best_of_n_beams"
    assert_error(post("/v1/completions", json={"prompt": "x", "logit_bias": {"1": 5}}), 400)
    assert_error(post("/v1/completions", json={"prompt": ["x"] * 10, "n": 10}), 400, "too_many_choices")
    assert_error(post("/v1/completions", json={"model": "gpt-4", "prompt": "x"}), 404, "model_not_found")
    assert_error(h.get("/v1/models/gpt-4"), 404, "model_not_found")
    assert_error(h.get("/v2/nothing"), 404, "unknown_url")
    assert_error(h.get("/v1/completions"), 405)
    assert_error(post("/infill", json={"input_prefix": 3}), 422)
    assert_error(post("/infill", json={"n_predict": -5}), 422)
    # found by the hostile review: ids checked before echo decodes them; a history with arguments nested past
    # the JSON parser's recursion limit; a long prompt refused before it is tokenized; penalties near zero
    assert_error(post("/v1/completions", json={"prompt": [-1], "echo": True}), 400, "invalid_token")
    deep = "[" * 3000 + "]" * 3000
    hist = [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": deep}}]},
            {"role": "user", "content": "y"}]
    # (here the length check refuses it first; with a longer context the parser's RecursionError is caught)
    assert assert_error(post("/v1/chat/completions", json={"messages": hist, "max_tokens": 2}),
                        400)["param"] == "messages"
    engine, calls = base.srv.engine, []
    real = engine._encode_prompt
    engine._encode_prompt = lambda text: calls.append(len(text)) or real(text)
    try:
        assert_error(post("/v1/completions", json={"prompt": "def f(x): return x  # z\n" * 300}), 400,
                     "context_length_exceeded")
        assert calls == []  # refused on its length in characters, never tokenized
    finally:
        engine._encode_prompt = real
    assert_error(post("/v1/completions", json={"prompt": "x", "repetition_penalty": 1e-300}), 422)
    assert_error(post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                    "top_logprobs": 2}), 400)
    assert_error(post("/v1/completions", json={"prompt": "x", "stream_options": {"include_usage": True}}),
                 400)
    # bodies over --max-body-bytes: with a Content-Length, and chunked without one
    assert_error(post("/v1/completions", content=b'{"prompt": "' + b"x" * 100_000 + b'"}'), 413,
                 "body_too_large")
    assert_error(post("/v1/completions", content=iter([b'{"prompt": "'] + [b"x" * 1000] * 20 + [b'"}'])), 413)
    # a temperature that overflows x / temperature samples greedily, and never fails the rows beside it
    with ThreadPoolExecutor(2) as pool:
        victim = pool.submit(post, "/v1/completions",
                             json={"prompt": "def", "max_tokens": 20, "temperature": 0.7})
        tiny = post("/v1/completions", json={"prompt": "def", "max_tokens": 5, "temperature": 1e-50})
        assert tiny.status_code == 200 and victim.result().status_code == 200
    # still serving
    assert h.get("/health").json()["status"] == "ok"
    assert base.client.completions.create(model="tiny", prompt="ok", max_tokens=2).choices[0].text is not None
    text = h.get("/metrics").text
    assert 'codeforge_requests_total{endpoint="/v1/completions",status="422"}' in text
    assert 'codeforge_requests_total{endpoint="other",status="404"}' in text
    # every route of the app's one table is a label of its own (these three counted as "other" before)
    h.post("/tokenize", json={"prompt": "x"})
    h.post("/detokenize", json={"tokens": [1]})
    h.get("/tokenizer_info")
    h.get("/v1/models/tiny")
    text = h.get("/metrics").text
    for route in ("/tokenize", "/detokenize", "/tokenizer_info", "/v1/models"):
        assert f'codeforge_requests_total{{endpoint="{route}",status="200"}}' in text, route


def test_dropped_connections_free_their_rows(base):
    sched = base.srv.sched
    port = int(base.url.rsplit(":", 1)[1])
    cancelled = base.metric('codeforge_rows_total{outcome="cancelled"}')

    def raw_request(body: dict) -> socket.socket:
        data = json.dumps(body).encode()
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:" + str(port).encode() + b"\r\n"
                  b"Content-Type: application/json\r\n"
                  b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
        return s

    sched.step_delay = 0.05
    try:
        s = raw_request({"prompt": "def", "max_tokens": 60, "temperature": 0, "stream": True})
        got = b""
        while b"data: " not in got:  # streaming has begun
            chunk = s.recv(4096)
            assert chunk, got  # closed before streaming
            got += chunk
        s.close()  # the client goes away mid-stream
        s2 = raw_request({"prompt": "def", "max_tokens": 60, "temperature": 0})
        time.sleep(0.3)
        s2.close()  # and one that waits for a whole (non-streamed) answer
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (sched.active_rows() or sched.queue_length()):
            time.sleep(0.05)
        assert sched.active_rows() == 0 and sched.queue_length() == 0  # long before 60 slow steps
        assert base.metric('codeforge_rows_total{outcome="cancelled"}') == cancelled + 2
    finally:
        sched.step_delay = 0.0
    assert base.client.completions.create(model="tiny", prompt="x", max_tokens=3).choices


def test_queue_full_timeout_and_api_key(base_run):
    with serving(base_run, max_batch=1, max_queue=1, request_timeout=1.0, api_key="sekrit") as live:
        h, sched = live.http, live.srv.sched
        assert h.get("/health").status_code == 200  # open without the key
        assert h.get("/").status_code == 200
        err = assert_error(h.get("/v1/models"), 401, "invalid_api_key")
        assert err["type"] == "authentication_error"
        assert_error(h.get("/metrics", headers={"Authorization": "Bearer wrong"}), 401)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=live.url + "/v1", api_key="wrong", max_retries=0).models.list()
        assert live.client.models.list().data[0].id == "tiny"
        with sched.hold(), ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(h.post, "/v1/completions", json={"prompt": "x", "max_tokens": 2},
                                  headers=live.auth())
            wait_for(lambda: sched.queue_length() == 1)
            full = h.post("/v1/completions", json={"prompt": "y", "max_tokens": 2}, headers=live.auth())
            assert_error(full, 429, "queue_full")
            assert int(full.headers["retry-after"]) >= 1
            with pytest.raises(openai.RateLimitError):
                live.client.completions.create(model="tiny", prompt="z", max_tokens=2)
            assert_error(waiting.result(), 504, "timeout")  # held past --request-timeout in the queue
        assert live.client.completions.create(model="tiny", prompt="x", max_tokens=2).choices  # serving again


def test_models_health_metrics_page(base):
    h = base.http
    models = base.client.models.list()
    assert [m.id for m in models.data] == ["tiny"] and models.data[0].owned_by == "codeforge"
    assert h.get("/v1/models/tiny").json()["max_model_len"] == 64
    health = h.get("/health").json()
    assert health["status"] == "ok" and health["model"] == "tiny"
    base.client.completions.create(model="tiny", prompt="x", max_tokens=2)
    text = h.get("/metrics").text
    assert h.get("/metrics").headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(text)}  # Prometheus' own parser reads it
    assert families["codeforge_generated_tokens"].type == "counter"
    assert families["codeforge_request_duration_seconds"].type == "histogram"
    for name in ("codeforge_queue_length", "codeforge_active_rows", "codeforge_time_to_first_token_seconds",
                 "codeforge_requests", "codeforge_rows", "process_resident_memory_bytes"):
        assert name in families, name
    assert families["process_resident_memory_bytes"].samples[0].value > 10e6
    assert base.metric("codeforge_generated_tokens_total") > 0
    page = h.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    if PLAYGROUND.is_file():
        assert page.content == PLAYGROUND.read_bytes()
    else:
        assert "playground not built" in page.text
    # the page's policy: its own inline script (by hash) and connections to this origin alone (issue 42: the
    # stored API key went to any server named in ?base=); tests/test_playground.py checks it in a browser
    import base64
    import hashlib
    import re
    csp = dict(x.strip().split(" ", 1) for x in page.headers["content-security-policy"].split(";"))
    assert (
        csp["connect-src"] == "'self'"
        and csp["default-src"] == "'none'"
        and csp["frame-ancestors"] == "'none'"
    )
    scripts = re.findall(rb"<script>(.*?)</script>", page.content, re.S)
    assert csp["script-src"].split() == [f"'sha256-{base64.b64encode(hashlib.sha256(x).digest()).decode()}'"
                                         for x in scripts]
    assert "unsafe" not in page.headers["content-security-policy"]


def test_cli_serve_subprocess(base_run, tmp_path):
    """`codeforge serve` itself: bad options refused with `error:`, then a real start on a free port, a
    request, and a clean stop on SIGTERM."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    bad = subprocess.run([sys.executable, "-m", "codeforge", "serve", "--run", str(base_run), "--max-batch",
                          "0"],
                         capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and "error: serve --max-batch = 0 is out of range [1, 256]" in bad.stderr
    fp16 = subprocess.run([sys.executable, "-m", "codeforge", "serve", "--run", str(base_run), "--device",
                           "cpu", "--precision", "fp16"], capture_output=True, text=True, env=env)
    assert fp16.returncode != 0 and "--precision fp16 needs a GPU" in fp16.stderr, fp16.stderr[-500:]
    p = subprocess.Popen([sys.executable, "-m", "codeforge", "serve", "--run", str(base_run), "--port", "0",
                          "--device", "cpu", "--api-key", "k", "--precision", "bf16"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env)
    try:
        url, said = None, []
        for line in p.stdout:
            said.append(line)
            m = re.search(r"listening on (http://127\.0\.0\.1:\d+)/", line)
            if m:
                url = m.group(1)
                break
        assert url, p.stderr.read()
        # --precision, said on the device line
        assert any("precision bf16 (requested)" in x for x in said), said
        c = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0)
        name = f"{base_run.parent.name}-base"  # a stage-only directory name takes its parent's in front
        assert c.models.list().data[0].id == name
        assert c.completions.create(model=name, prompt="def", max_tokens=3).usage.completion_tokens >= 1
    finally:
        p.terminate()  # uvicorn shuts down gracefully, then ends by the signal it caught
        assert p.wait(20) in (0, -15)
        assert "server stopped after" in p.stderr.read()


def test_a_tokenizer_failure_is_the_apis_400(base_run):
    """Found in the second hostile review: a tokenizer whose split rule backtracks (loading now refuses one;
    tests/test_tokenizer.py) panicked on a 35-character prompt, and four endpoints answered a plain-text 500.
    Here the live tokenizer is given such a rule after loading: every endpoint that encodes answers the API's
    400 error shape, and the server goes on serving."""
    from tokenizers import Regex, pre_tokenizers
    with serving(base_run) as live:
        h, inner = live.http, live.engine.tok.tok
        before = inner.pre_tokenizer
        inner.pre_tokenizer = pre_tokenizers.Split(Regex("(a+)+$"), "isolated")
        bad = "a" * 34 + "!"
        try:
            for path, body in (("/v1/completions", {"prompt": bad, "max_tokens": 2}),
                               ("/v1/chat/completions", {"messages": [{"role": "user", "content": bad}],
                                                         "max_tokens": 2}),
                               ("/infill", {"input_prefix": bad, "input_suffix": "", "n_predict": 2}),
                               ("/tokenize", {"prompt": bad})):
                r = h.post(path, json=body)
                err = assert_error(r, 400, "tokenizer_failed")
                assert "cannot encode" in err["message"], (path, err)
        finally:
            inner.pre_tokenizer = before
        assert h.get("/health").json()["status"] == "ok"
        assert h.post("/v1/completions", json={"prompt": "def", "max_tokens": 2}).status_code == 200
