"""Log-probs and the tokenizer endpoints of `codeforge serve`, read by the real `openai` client and checked
against the model's own log-softmax in process: legacy completions (echo gives the prompt's log-probs, the
first one null; max_tokens 0 scores without generating; generated tokens with their top N; batched and
token-id prompts in index order; streaming), chat's logprobs/top_logprobs, and vLLM's /tokenize, /detokenize
and /tokenizer_info (what lm-evaluation-harness probes; tests/test_lm_eval.py runs the harness itself)."""

from __future__ import annotations

import math

import pytest
import torch

from codeforge.engine import SamplingParams
from codeforge.serve.protocol import completion_logprobs
from test_serve import TOOLS, assert_error, base_run, chat_run, serving  # noqa: F401  (module fixtures, reused)


@pytest.fixture(scope="module")
def base(base_run):  # noqa: F811
    with serving(base_run) as live:
        yield live


def reference(engine, ids: list[int]) -> torch.Tensor:
    """(len(ids), vocab) log-softmax of the model's next-token logits after each prefix of ids, in process."""
    with torch.inference_mode():
        logits = engine.model(torch.tensor([ids]))[0].float()
    return torch.log_softmax(logits, -1)[:, :engine.tok.vocab_size]  # over every row of the head


def test_echo_scores_the_prompt_like_the_model(base):
    eng, c = base.engine, base.client
    text = "def add(a, b):\n    return a + b\n"
    ids = eng.tok.encode(text)
    ref = reference(eng, ids)
    for max_tokens in (0, 1):
        r = c.completions.create(model="tiny", prompt=text, echo=True, logprobs=3, max_tokens=max_tokens,
                                 temperature=0)
        ch = r.choices[0]
        lp = ch.logprobs
        assert len(lp.token_logprobs) == len(ids) + max_tokens and r.usage.completion_tokens == max_tokens
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        for i in range(1, len(ids)):
            assert math.isclose(lp.token_logprobs[i], float(ref[i - 1, ids[i]]), abs_tol=1e-4)
            top = lp.top_logprobs[i]
            best = float(ref[i - 1].max())
            assert math.isclose(max(top.values()), best, abs_tol=1e-4)  # the most likely token is listed
            assert lp.tokens[i] in top and 3 <= len(top) <= 4  # top 3 plus the chosen token
        assert "".join(lp.tokens[:len(ids)]) == text and ch.text.startswith(text)
        assert lp.text_offset[:len(ids)] == [len(eng.tok.decode(ids[:i])) for i in range(len(ids))]
    # max_tokens 0: a prompt that fills the whole context is scored (nothing is generated after it)
    full = (ids * 64)[:eng.block_size]
    r = base.http.post("/v1/completions", json={"prompt": full, "echo": True, "logprobs": 0, "max_tokens": 0})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"][0]["logprobs"]["token_logprobs"]) == eng.block_size
    # without echo, max_tokens 0 generates nothing; a full-context prompt that must generate is refused
    r = c.completions.create(model="tiny", prompt="x", max_tokens=0)
    assert r.choices[0].text == "" and r.usage.completion_tokens == 0
    assert_error(base.http.post("/v1/completions", json={"prompt": full, "max_tokens": 1}), 400,
                 "context_length_exceeded")


def test_generated_logprobs_batched_and_streamed(base):
    eng, c = base.engine, base.client
    prompts = [eng.tok.encode("import os\n"), eng.tok.encode("class A:\n    def ")]
    r = c.completions.create(model="tiny", prompt=prompts, logprobs=2, max_tokens=6, temperature=0)
    assert [x.index for x in r.choices] == [0, 1]
    for ids, ch in zip(prompts, r.choices):
        lp = ch.logprobs
        assert lp.tokens and len(lp.tokens) == len(lp.token_logprobs)
        gen = [step[0] for step in eng.generate_ids([ids], SamplingParams(max_new_tokens=6, temperature=0.0))]
        # greedy: each generated token is the most likely one, and its log-prob is the model's
        seq = ids + gen[:len(lp.tokens)]
        ref = reference(eng, seq)
        for k, (tok, v) in enumerate(zip(lp.tokens, lp.token_logprobs)):
            assert math.isclose(v, max(lp.top_logprobs[k].values()), abs_tol=1e-6)
            assert math.isclose(v, float(ref[len(ids) + k - 1].max()), abs_tol=1e-4)
        if ch.finish_reason == "length":
            assert "".join(lp.tokens) == ch.text
    # streaming: the chunks' records join into the same records as one response
    one = c.completions.create(model="tiny", prompt="def f(", logprobs=1, max_tokens=8, temperature=0,
                               echo=True)
    chunks = list(c.completions.create(model="tiny", prompt="def f(", logprobs=1, max_tokens=8, temperature=0,
                                       echo=True, stream=True))
    toks = [t for x in chunks for t in (x.choices[0].logprobs.tokens if x.choices[0].logprobs else [])]
    lps = [t for x in chunks for t in (x.choices[0].logprobs.token_logprobs if x.choices[0].logprobs else [])]
    offs = [t for x in chunks for t in (x.choices[0].logprobs.text_offset if x.choices[0].logprobs else [])]
    assert toks == one.choices[0].logprobs.tokens and offs == one.choices[0].logprobs.text_offset
    assert lps[0] is None and all(math.isclose(a, b, abs_tol=1e-6) for a, b in zip(lps[1:],
                                                                                   one.choices[0].logprobs.token_logprobs[1:]))
    assert "".join(x.choices[0].text for x in chunks) == one.choices[0].text


def test_partial_characters_are_shown_as_bytes(base):
    tok = base.engine.tok
    ids = tok.encode("naïve ☃ string")
    lp = completion_logprobs(tok, [(i, -1.0, [(i, -1.0)]) for i in ids])
    joined = b"".join(bytes.fromhex(t[6:].replace("\\x", "")) if t.startswith("bytes:") else t.encode()
                      for t in lp["tokens"])
    assert joined == "naïve ☃ string".encode()


def test_chat_logprobs(chat_run):  # noqa: F811
    with serving(chat_run) as live:
        c, eng = live.client, live.engine
        msgs = [{"role": "user", "content": "Write f3."}]
        r = c.chat.completions.create(model="tiny", messages=msgs, logprobs=True, top_logprobs=2,
                                      max_tokens=6, temperature=0)
        ch = r.choices[0]
        content = ch.logprobs.content
        assert len(content) == r.usage.completion_tokens
        for e in content:
            assert len(e.top_logprobs) == 2 and math.isclose(e.logprob, e.top_logprobs[0].logprob,
                                                             abs_tol=1e-6)
            assert bytes(e.bytes).decode(errors="replace") and e.token
        text = b"".join(bytes(e.bytes) for e in content).decode(errors="replace")
        assert text.startswith(ch.message.content or "")
        r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=3, temperature=0)
        assert r.choices[0].logprobs is None
        chunks = [x for x in c.chat.completions.create(model="tiny", messages=msgs, logprobs=True,
                                                       top_logprobs=1,
                                                       max_tokens=6, temperature=0, stream=True) if x.choices]
        streamed = [e.token for x in chunks if x.choices[0].logprobs for e in x.choices[0].logprobs.content]
        assert streamed == [e.token for e in content]
        del eng


def test_tokenizer_endpoints(base):
    h, tok = base.http, base.engine.tok
    r = h.post("/tokenize", json={"prompt": "def f(): pass", "add_special_tokens": False}).json()
    assert r["tokens"] == tok.encode("def f(): pass") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == base.engine.block_size and r["token_strs"] is None
    info = h.get("/tokenizer_info").json()
    assert h.post("/tokenize", json={"prompt": info["eos_token"]}).json()["tokens"] == [tok.eot_id]
    assert "chat_template" in info and info["model_max_length"] == base.engine.block_size
    r = h.post("/tokenize", json={"prompt": "héllo", "return_token_strs": True}).json()
    assert len(r["token_strs"]) == r["count"]
    assert h.post("/detokenize", json={"tokens": tok.encode("x = 1\n")}).json() == {"prompt": "x = 1\n"}
    conv = h.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert conv["tokens"][-1] != tok.eot_id and conv["count"] > 3
    assert_error(h.post("/detokenize", json={"tokens": [10 ** 9]}), 400, "invalid_token")
    assert_error(h.post("/tokenize", json={}), 400)
    assert_error(h.post("/tokenize", json={"prompt": "x", "truncate_prompt_tokens": 3}), 400,
                 "unsupported_parameter")


def test_names_and_notices_a_user_sees(base_run, chat_run, tmp_path, capsys, monkeypatch):  # noqa: F811
    """The served name says which run it is (not the quickstart's generic `run`), and a chat with a model no
    chat stage trained says so: on the terminal (`codeforge chat`), and in a Warning header of the server's
    chat answers."""
    import io

    from codeforge.checkpoint import find_checkpoint, read_config
    from codeforge.cli import main
    from codeforge.config import chat_notice
    from codeforge.rundir import model_name as run_name
    assert run_name("runs/quickstart/run") == "quickstart"
    assert run_name("runs/quickstart-chat/tools") == "quickstart-chat-tools"
    assert run_name("runs/go-coder") == "go-coder"
    assert run_name("runs/go-coder/checkpoints/step_000100") == "go-coder"
    base_cfg = read_config(find_checkpoint(base_run, "latest"))
    note = chat_notice(base_cfg)
    assert note and "--stage sft" in note
    assert chat_notice(read_config(find_checkpoint(chat_run, "latest"))) is None
    with serving(base_run, chat_note=note) as live:
        r = live.http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                         "max_tokens": 2})
        assert r.status_code == 200 and "never taught to chat" in r.headers["warning"]
        assert live.http.get("/v1/models").json()["data"][0]["chat"] is False
    monkeypatch.setattr("sys.stdin", io.StringIO("hello"))
    assert main(["chat", "--run", str(base_run), "--max-new-tokens", "2", "--device", "cpu"]) == 0
    assert "never taught to chat" in capsys.readouterr().err
    monkeypatch.setattr("sys.stdin", io.StringIO("hello"))
    assert main(["chat", "--run", str(chat_run), "--max-new-tokens", "2", "--device", "cpu"]) == 0
    assert "never taught to chat" not in capsys.readouterr().err
    assert main(["generate", "--run", str(base_run), "--prompt", "x", "--max-new-tokens", "2", "--device",
                 "cpu"]) == 0
    err = capsys.readouterr().err
    assert "checkpoint: " in err and "auto: the run's best" in err


def test_what_a_hostile_or_careless_client_gets(base, chat_run, monkeypatch):  # noqa: F811
    """Found in review: each of these was a stall, a 500 or wrong offsets."""
    import codeforge.serve.state as app
    h, tok = base.http, base.engine.tok
    # log-prob answers are bounded (tokens x (logprobs + 1) x n), refused by name past it (the bound is
    # lowered here: this model's context of 64 cannot reach the real one)
    monkeypatch.setattr(app, "MAX_LOGPROB_RECORDS", 10_000)
    ids = (tok.encode("def f(x): return x\n") * 64)[:base.engine.block_size]
    assert_error(h.post("/v1/completions",
                        json={"prompt": [ids] * 4, "echo": True, "logprobs": 20, "max_tokens": 0,
                                                 "n": 16}), 400, "too_many_logprobs")
    # echo with suffix would echo text the model never saw (the fill-in-the-middle prompt)
    assert_error(h.post("/v1/completions", json={"prompt": "a", "suffix": "b", "echo": True}), 400)
    # /tokenize: an empty conversation, and arguments nested past the parser's limit, are 400s, not 500s
    assert_error(h.post("/tokenize", json={"messages": []}), 400)
    deep = "[" * 100_000 + "]" * 100_000
    r = h.post("/tokenize", json={"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": deep}}]}]})
    assert r.status_code == 400, r.text
    # streamed log-prob offsets never go back, also when a stop sequence holds text back
    for seed in range(3):
        chunks = list(base.client.completions.create(model="tiny", prompt="x", max_tokens=24, temperature=1.0,
                                                     seed=seed,
                                                     logprobs=0, stop=["e", "a", " "], stream=True))
        offs = [o for c in chunks if c.choices and c.choices[0].logprobs
                for o in c.choices[0].logprobs.text_offset]
        assert offs == sorted(offs), offs
    with serving(chat_run) as live:
        msgs = [{"role": "user", "content": "hi"}]
        big = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(3000)}}
        r = live.http.post("/v1/chat/completions", json={"messages": msgs, "response_format": {
            "type": "json_schema", "json_schema": {"name": "big", "schema": big}}})
        assert_error(r, 400, "invalid_schema")
        loop = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}
        r = live.http.post("/v1/chat/completions",
                           json={"messages": msgs, "max_tokens": 4, "response_format": {
            "type": "json_schema", "json_schema": {"name": "loop", "schema": loop}}})
        assert r.status_code == 400 and "schema" in r.json()["error"]["message"], r.text
        assert len(r.text) < 1000  # the engine's parser state stays inside
        # metadata-only OpenAI fields are accepted
        r = live.http.post("/v1/chat/completions",
                           json={"messages": msgs, "max_tokens": 2, "service_tier": "auto",
                                                         "prompt_cache_key": "k", "safety_identifier": "u1"})
        assert r.status_code == 200, r.text


def test_chat_logprobs_share_the_cap_and_are_built_off_the_event_loop(chat_run, monkeypatch):  # noqa: F811
    """Found in the second hostile review: chat's log-probs had no cap (top_logprobs 20, n 64, max_tokens 1024
    answered 55 MB and blocked /health for 6 s) and were built on the event loop. Now the one limit of
    /v1/completions refuses them by name, and an allowed answer is built in a worker thread."""
    import asyncio

    import codeforge.serve.app as app
    import codeforge.serve.state as state
    # this model's context of 64 cannot reach the real one
    monkeypatch.setattr(state, "MAX_LOGPROB_RECORDS", 2_000)
    built_on = []
    real = app.chat_logprobs

    def spy(*a, **k):
        built_on.append(asyncio._get_running_loop() is not None)  # True: on the event loop's thread
        return real(*a, **k)
    monkeypatch.setattr(app, "chat_logprobs", spy)
    with serving(chat_run) as live:
        msgs = [{"role": "user", "content": "Write f3."}]
        body = {"messages": msgs, "logprobs": True, "top_logprobs": 20, "n": 16, "max_tokens": 16}
        err = assert_error(live.http.post("/v1/chat/completions", json=body), 400, "too_many_logprobs")
        assert err["param"] == "top_logprobs" and "5,376" in err["message"]  # 16 x 21 x 16
        assert not built_on
        ok = live.http.post("/v1/chat/completions", json={**body, "n": 2, "top_logprobs": 3})
        assert ok.status_code == 200, ok.text
        assert len(ok.json()["choices"]) == 2 and ok.json()["choices"][0]["logprobs"]["content"]
        assert built_on and not any(built_on), built_on  # every entry written off the event loop
        assert live.http.get("/health").status_code == 200


def test_logprobs_equal_transformers_on_a_padded_vocabulary(tmp_path, data_dir, tokenizer_dir):
    """A model whose head has more rows than the tokenizer has tokens (vocabulary
    padded to a multiple of 64, as
    GPU runs do): the server's echo log-probs equal transformers' on the same run's Hugging Face export, token
    for token. Found in the second hostile review: the server normalised over the real tokens only, and every
    log-prob was ~0.0155 nats above transformers'. Both now take the model's own distribution over every row
    (what training's loss and validation take); padding rows are never sampled or listed."""
    from transformers import AutoModelForCausalLM

    from codeforge.cli import main
    from codeforge.export.hf import export_hf
    from codeforge.tokenizer import CodeTokenizer
    n_tok = CodeTokenizer.load(tokenizer_dir).vocab_size
    padded = (n_tok // 64 + 2) * 64
    run = tmp_path / "padded"
    assert main(["train", "--data", str(data_dir), "--out", str(run), "--block-size", "64", "--n-layer", "1",
                 "--n-head", "2", "--n-embd", "32", "--max-iters", "3", "--device", "cpu", "--no-progress",
                 "--vocab-size", str(padded)]) == 0
    export_hf(run, tmp_path / "hf", verify=False, log=lambda *_: None)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert hf.config.vocab_size == padded > n_tok
    text = "def add(a, b):\n    return a + b\n"
    with serving(run) as live:
        ids = live.engine.tok.encode(text)
        r = live.http.post("/v1/completions",
                           json={"prompt": ids, "echo": True, "logprobs": 2, "max_tokens": 4,
                                                    "temperature": 0})
        assert r.status_code == 200, r.text
        lp = r.json()["choices"][0]["logprobs"]
        got = lp["token_logprobs"][1:len(ids)]
    with torch.inference_mode():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
    want = [float(ref[i - 1, ids[i]]) for i in range(1, len(ids))]
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4, (got[:4], want[:4])
    # the generated tokens' own log-probs too, and no alternative is a padding row
    gen = lp["token_logprobs"][len(ids):]
    assert len(gen) == 4 and all(v <= 0 for v in gen)
    assert all(len(t) <= 3 for t in lp["top_logprobs"][len(ids):])
