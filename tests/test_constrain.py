"""Grammar-constrained decoding (codeforge/constrain.py): an untrained model, sampled at temperature 1, writes
only tool calls that parse and match their tool's schema, in json.dumps' layout; required and named
tool_choice always call; a json_schema reply is JSON of the schema. The same model unconstrained does not,
which shows the checks can fail. Rows with different constraints share one batch."""

from __future__ import annotations

import copy
import json
import re

import pytest
import torch

from codeforge.chat import CALL_CLOSE, CALL_OPEN, IM_END, encode_conversation, parse_assistant
from codeforge.constrain import ConstraintError, ToolGrammar, closed_schema, mask_logits
from codeforge.engine import Engine, SamplingParams
from codeforge.models.gpt import GPT, GPTConfig
from codeforge.tasks.tool_calls import TOOLS
from codeforge.tokenizer import CodeTokenizer

SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
REPLY_SCHEMA = {  # bounded everywhere, so that a random model finishes the reply within the token budget
    "type": "object", "additionalProperties": False, "required": ["ok", "lang", "n", "tags"],
    "properties": {"ok": {"type": "boolean"}, "lang": {"enum": ["go", "python"]},
                   "n": {"type": "integer", "minimum": 0, "maximum": 99},
                   "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
                   "note": {"type": ["string", "null"], "maxLength": 6}}}
JSON_REPLY = {"type": "json_schema", "json_schema": {"name": "reply", "schema": REPLY_SCHEMA}}
SEEDS = (0, 1, 2)
PAD = 40  # the model's head is wider than the vocabulary (a padded vocab): those ids must never come out


@pytest.fixture(scope="module")
def tok(tokenizer_dir) -> CodeTokenizer:
    return CodeTokenizer.load(tokenizer_dir)


@pytest.fixture(scope="module")
def eng(tok) -> Engine:
    return biased_engine(tok)


def biased_engine(tok, block_size: int = 256, prefer: dict[str, float] | None = None) -> Engine:
    """A random 2-layer model, nudged (an output bias) to open tool calls, end replies and write quotes often,
    so that calls happen and strings end within the budget; what it writes is still noise. `prefer`: more
    bias on the tokens that hold each given text."""
    torch.manual_seed(0)
    V = tok.vocab_size
    model = GPT(GPTConfig(vocab_size=V + PAD, block_size=block_size, n_layer=2, n_head=2, n_embd=32)).eval()
    bias = torch.zeros(V + PAD)
    bias[[i for i in range(V) if '"' in tok.decode([i])]] = 3.0
    for text, extra in (prefer or {}).items():
        bias[[i for i in range(V) if text in tok.decode([i])]] += extra
    bias[tok.special_ids[CALL_OPEN]] = 4.0
    bias[tok.special_ids[IM_END]] = 2.0
    model.lm_head.bias = torch.nn.Parameter(bias)
    return Engine(model, tok)


def prompt(tok) -> list[int]:
    return encode_conversation(tok, [{"role": "user", "content": "Run the tests in tests/"}], None,
                               add_generation_prompt=True)[0]


def sample(eng, constraints: list, seed: int, max_new: int = 160) -> list[str]:
    """Each row's text (special tokens written as text) at temperature 1, rows ending at <|im_end|>."""
    outs: list[list[int]] = [[] for _ in constraints]
    p = SamplingParams(max_new_tokens=max_new, temperature=1.0, seed=seed,
                       stop_ids=[eng.tok.special_ids[IM_END]])
    for step in eng.generate_ids([prompt(eng.tok)] * len(constraints), p, constraints=constraints):
        for i, t in enumerate(step):
            if t is not None:
                assert t < eng.tok.vocab_size
                outs[i].append(t)
    return [eng.tok.decode(o) for o in outs]


def schema_errors(value, schema: dict, at: str = "$") -> list[str]:
    """The JSON-schema keywords these tests use (type, enum, properties, required, additionalProperties,
    items, maxItems, maxLength, minimum, maximum): what `value` breaks."""
    errs = []
    kinds = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}
    types = schema.get("type")
    if types is not None:
        types = [types] if isinstance(types, str) else types
        ok = any(isinstance(value, int) and not isinstance(value, bool) if t == "integer"
                 else isinstance(value, (int, float)) and not isinstance(value, bool) if t == "number"
                 else isinstance(value, kinds[t]) for t in types)
        if not ok:
            return [f"{at}: {value!r} is not {types}"]
    if "enum" in schema and value not in schema["enum"]:
        errs.append(f"{at}: {value!r} not in {schema['enum']}")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        errs += [f"{at}: missing {k!r}" for k in schema.get("required", []) if k not in value]
        if schema.get("additionalProperties") is False:
            errs += [f"{at}: extra key {k!r}" for k in value if k not in props]
        for k, v in value.items():
            if k in props:
                errs += schema_errors(v, props[k], f"{at}.{k}")
    if isinstance(value, list):
        if len(value) > schema.get("maxItems", len(value)):
            errs.append(f"{at}: {len(value)} items")
        errs += [e for i, v in enumerate(value)
                 for e in schema_errors(v, schema.get("items", {}), f"{at}[{i}]")]
    if isinstance(value, str) and len(value) > schema.get("maxLength", len(value)):
        errs.append(f"{at}: longer than {schema['maxLength']}")
    if isinstance(value, int) and not schema.get("minimum", value) <= value <= schema.get("maximum", value):
        errs.append(f"{at}: {value} out of range")
    return errs


def closed_blocks(text: str) -> list[str]:
    """The bodies of the <tool_call> blocks that were closed (a budget may cut the last one short)."""
    text = text.split(IM_END, 1)[0]
    return [b.split(CALL_CLOSE, 1)[0] for b in text.split(CALL_OPEN)[1:] if CALL_CLOSE in b]


def check_calls(text: str, names: list[str]) -> list[dict]:
    """Every closed block parses into a call of one of `names` whose arguments match the schema, written as
    chat.render writes calls (json.dumps' layout); returns the calls."""
    blocks = closed_blocks(text)
    text = text.split(IM_END, 1)[0]
    last = text.rfind(CALL_OPEN)
    if last >= 0 and CALL_CLOSE not in text[last:]:  # cut short by the token budget
        text = text[:last]
    calls = parse_assistant(text)
    assert not calls["errors"], (calls["errors"], text)
    assert len(calls["tool_calls"]) == len(blocks), text
    for body, call in zip(blocks, calls["tool_calls"]):
        assert call["name"] in names, text
        assert not schema_errors(call["arguments"], SCHEMAS[call["name"]]), (call, text)
        # (a schema that allows extra keys allows one twice: the pairs are compared as written)
        assert numbers_as_0(body) == numbers_as_0(json.dumps(json.loads(body, object_pairs_hook=Pairs),
                                                             ensure_ascii=False))
    return calls["tool_calls"]


class Pairs(dict):
    """A JSON object as its pairs, a key written twice included (json.dumps writes them back as they were)."""

    def __init__(self, pairs: list[tuple]):
        super().__init__(pairs)
        self.pairs = pairs

    def items(self):
        return self.pairs


def numbers_as_0(text: str) -> str:
    """JSON text with every number written as 0: the layout (separators, spacing, escapes) is what is
    compared; a number need not read back as written (json reads -7E7599 as -Infinity, 1E2 as 100.0)."""
    return re.sub(r"-?Infinity|NaN|-?[0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?", "0", text)


ROWS = ("auto", "auto", "required", "required", "search_code", "json", "json", None)


@pytest.fixture(scope="module")
def batched(eng, tok) -> list[list[tuple[str | None, str, bool]]]:
    """Per seed, one generate_ids call with rows of every kind: [(kind, text, finished)]."""
    grammars = {"auto": ToolGrammar(tok, TOOLS, "auto"), "required": ToolGrammar(tok, TOOLS, "required"),
                "search_code": ToolGrammar(tok, TOOLS, "search_code"),
                "json": ToolGrammar(tok, None, "auto", JSON_REPLY)}
    runs = []
    for seed in SEEDS:
        cs = [grammars[k].new() if k else None for k in ROWS]
        texts = sample(eng, cs, seed)
        runs.append([(k, text, c is not None and c.finished) for k, text, c in zip(ROWS, texts, cs)])
    return runs


def test_auto_calls_parse_and_match_their_schema(batched):
    calls = [c for run in batched for k, text, _ in run if k == "auto"
             for c in check_calls(text, list(SCHEMAS))]
    assert len(calls) >= 5  # enough calls for the check to mean something
    assert len({c["name"] for c in calls}) >= 2


def test_required_and_named_always_call(batched):
    finished = 0
    for run in batched:
        for kind, text, done in run:
            if kind not in ("required", "search_code"):
                continue
            assert text.startswith(CALL_OPEN), text
            names = list(SCHEMAS) if kind == "required" else ["search_code"]
            calls = check_calls(text, names)
            if done:  # the reply is calls only, joined by "\n", then <|im_end|>
                finished += 1
                assert calls and text.endswith(CALL_CLOSE + IM_END)
                assert parse_assistant(text)["content"] == ""
    assert finished >= 3


def test_json_schema_reply_is_json_of_the_schema(batched):
    for run in batched:
        for kind, text, done in run:
            if kind != "json":
                continue
            assert done and text.endswith(IM_END), text  # the schema is bounded: the reply always ends
            body = text[:-len(IM_END)]
            value = json.loads(body)
            assert not schema_errors(value, REPLY_SCHEMA), (value, text)
            assert body == json.dumps(value, ensure_ascii=False)  # the layout training data has


OPEN_REPLY = {  # unbounded strings, arrays and numbers: left to itself, a random model never ends this reply
    "type": "object", "required": ["title", "tags", "n"], "additionalProperties": False,
    "properties": {"title": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}},
                   "n": {"type": "integer"}, "sub": {"type": "object"}}}


@pytest.mark.parametrize("extra", [0, 1, 3, 12, 40])
def test_every_reply_ends_within_its_budget(eng, tok, extra):
    """The budget holds the way to the end: with max_new_tokens from the shortest complete reply up, every
    required, named and json_schema row of a batch (temperature 1, several seeds) ends complete: calls that
    parse and match their schema, JSON of the schema; an auto row closes every call it opens."""
    json_open = {"type": "json_schema", "json_schema": {"name": "open", "schema": OPEN_REPLY}}
    grammars = {"required": ToolGrammar(tok, TOOLS, "required"),
                "search_code": ToolGrammar(tok, TOOLS, "search_code"),
                "json": ToolGrammar(tok, None, "auto", json_open), "auto": ToolGrammar(tok, TOOLS, "auto")}
    least = max(g.min_tokens for g in grammars.values() if g.min_tokens is not None)
    assert grammars["auto"].min_tokens is None and grammars["auto"].min_call > 10  # any text will do in auto
    kinds = ("required", "search_code", "json", "auto") * 2
    for seed in SEEDS:
        cs = [grammars[k].new() for k in kinds]
        texts = sample(eng, cs, seed, max_new=least + extra)
        for kind, text, c in zip(kinds, texts, cs):
            if kind == "auto":
                assert text.count(CALL_OPEN) == text.count(CALL_CLOSE), text  # no call left open
                check_calls(text, list(SCHEMAS))
                continue
            assert c.finished and text.endswith(IM_END), (kind, text)
            if kind == "json":
                assert not schema_errors(json.loads(text[:-len(IM_END)]), OPEN_REPLY), text
            else:
                assert check_calls(text, list(SCHEMAS) if kind == "required" else [kind]), text


def strings(n: int) -> dict:
    """An object of n required strings (the way to its end takes ~4 tokens a string)."""
    return {"type": "object", "properties": {f"r{i}": {"type": "string"} for i in range(n)},
            "required": [f"r{i}" for i in range(n)], "additionalProperties": False}


def json_reply(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


def ends_complete(eng, grammar: ToolGrammar, budgets, rows: int = 4) -> list[str]:
    """Every row of every budget and seed (temperature 1) ends complete; the texts."""
    texts = []
    for budget in budgets:
        for seed in SEEDS:
            cs = [grammar.new() for _ in range(rows)]
            for c, text in zip(cs, sample(eng, cs, seed, max_new=budget)):
                assert c.finished and text.endswith(IM_END), (budget, seed, text)
                texts.append(text[:-len(IM_END)])
    return texts


def test_a_character_that_picks_a_longer_branch_is_checked(tok):
    """Inside a key or a tool's name, a character may pick a branch whose way to the end is much longer
    (`"ky"` with 8 or 12 required strings after it, ~70 or ~100 tokens with the test tokenizer, where `"kx"`
    has a number; `grep_all` where the way took `read`): such a character is written only where that way
    fits the budget left, whatever the spare (up to WATCH the mask checks it, beyond it the sampled token is
    checked: fit_tokens). A model that prefers `y` and `g`, temperature 1, budgets on both sides of the
    one where the long branch fits."""
    eng = biased_engine(tok, prefer={"y": 4.0, "g": 4.0})
    for n, budgets in ((8, range(30, 100, 10)), (12, range(70, 150, 20))):
        schema = {"type": "object", "properties": {"kx": {"type": "integer"}, "ky": strings(n)},
                  "additionalProperties": False}
        texts = ends_complete(eng, ToolGrammar(tok, None, "auto", json_reply(schema)), budgets)
        assert all(not schema_errors(json.loads(t), schema) for t in texts)
        assert sum('"ky"' in t for t in texts) >= 4  # the long branch is taken where it fits
    tools = [{"type": "function", "function": {"name": "read", "parameters": strings(1)}},
             {"type": "function", "function": {"name": "grep_all", "parameters": strings(8)}}]
    g = ToolGrammar(tok, tools, "required")
    texts = ends_complete(eng, g, range(g.min_tokens, g.min_tokens + 80, 10))
    assert sum("grep_all" in t for t in texts) >= 4
    for t in texts:
        for call in parse_assistant(t)["tool_calls"]:
            assert not schema_errors(call["arguments"], strings(1 if call["name"] == "read" else 8)), t


def test_nesting_is_counted_as_it_grows(tok):
    """Each bracket opened lengthens the way to the end by its closer: the way is kept exact after every
    token, so a model that prefers `[` (a recursive $ref of arrays, any JSON value) still ends within the
    budget, however deep it has gone."""
    eng = biased_engine(tok, prefer={"[": 6.0})
    nest = {"type": "object", "properties": {"x": {"$ref": "#/$defs/n"}}, "required": ["x"],
            "$defs": {"n": {"type": "array", "items": {"$ref": "#/$defs/n"}}}}
    anything = {"type": "object", "properties": {"x": {}}, "required": ["x"]}
    grammars = [ToolGrammar(tok, [{"type": "function", "function": {"name": "f", "parameters": nest}}],
                            "required"),
                ToolGrammar(tok, None, "auto", json_reply(anything))]
    for g in grammars:
        texts = ends_complete(eng, g, (120, 200), rows=2)
        assert max(t.count("[") for t in texts) > 40  # deep: more than WATCH tokens of closers in all
        for t in texts:
            value = (
                parse_assistant(t)["tool_calls"][0]["arguments"] if g.mode == "required" else json.loads(t)
            )
            assert "x" in value


@pytest.mark.parametrize("schema, shortest", [
    ({"enum": ["alpha_beta_gamma_delta_epsilon_zeta_eta_theta", "b"]}, "b"),
    ({"enum": ["b", "alpha_beta_gamma_delta_epsilon_zeta_eta_theta"]}, "b"),
    ({"type": "string", "pattern": "^(aaaaaaaaaaaaaaaaaaaaaaaa|b)$"}, "b"),
    ({"const": "only_this_one_value"}, "only_this_one_value")])
def test_min_tokens_is_the_shortest_value(tok, eng, schema, shortest):
    """min_tokens takes the value that ends the string soonest (a search over the few tokens allowed
    inside it), not the longest token: a budget that fits `{"e": "b"}` is taken and the reply ends in it."""
    g = ToolGrammar(tok, None, "auto",
                    json_reply({"type": "object", "properties": {"e": schema}, "required": ["e"]}))
    assert g.min_tokens <= len(tok.encode(json.dumps({"e": shortest}))) + 1
    assert ends_complete(eng, g, [g.min_tokens]) == [json.dumps({"e": shortest})] * 4 * len(SEEDS)


def test_min_tokens_takes_the_tool_whose_call_is_shortest(tok):
    """Between tools, the one whose whole call is shortest (not the name that ends soonest)."""
    tools = [{"type": "function", "function": {"name": "go", "parameters": strings(6)}},
             {"type": "function", "function": {"name": "read_the_file", "parameters": strings(1)}}]
    g = ToolGrammar(tok, tools, "required")
    short = json.dumps({"name": "read_the_file", "arguments": {"r0": ""}})
    assert g.min_tokens <= len(tok.encode(short)) + 3


def test_the_budget_left_forces_the_way_to_the_end(tok):
    """At the shortest budget the whole reply is forced; a budget too small for any call keeps auto mode from
    opening one; the fewest tokens a reply takes is the length of the way found (and no longer than the
    canonical tokenization of the shortest call)."""
    g = ToolGrammar(tok, TOOLS, "search_code")
    shortest = json.dumps({"name": "search_code", "arguments": {"query": ""}})
    assert g.min_tokens <= len(tok.encode(shortest)) + 3
    c = g.new()
    c.set_budget(g.min_tokens)
    wrote = []
    while not c.finished:
        allowed = c.allowed().nonzero().flatten().tolist()
        assert len(allowed) == 1, len(allowed)  # no spare token: only the way's next one
        c.advance(allowed[0])
        wrote += allowed
    assert tok.decode(wrote) == CALL_OPEN + shortest + CALL_CLOSE + IM_END
    auto = ToolGrammar(tok, TOOLS, "auto").new()
    auto.set_budget(auto.grammar.min_call - 1)
    logits = torch.zeros(1, tok.vocab_size)
    assert torch.isinf(mask_logits([auto], logits)[0, tok.special_ids[CALL_OPEN]])
    auto.set_budget(auto.grammar.min_call)
    assert torch.isfinite(mask_logits([auto], logits)[0, tok.special_ids[CALL_OPEN]])
    # without a budget (a caller that sets none) nothing is reserved: the grammar's mask alone
    free = g.new()
    assert free.allowed().sum() == 1 and free.budget is None


def test_free_row_in_the_batch_is_untouched(eng, batched):
    """The unconstrained row of the mixed batch writes the same tokens as in a batch of free rows (same
    seed, same shapes: the same random draws)."""
    for seed, run in zip(SEEDS, batched):
        assert sample(eng, [None] * len(ROWS), seed)[-1] == run[-1][1]


def test_without_constraint_the_same_model_fails(eng):
    """The checks above can fail: unconstrained, the same model opens calls that do not parse or match."""
    attempts = valid = 0
    for seed in SEEDS:
        for text in sample(eng, [None] * 8, seed):
            r = parse_assistant(text)
            attempts += len(r["errors"]) + len(r["tool_calls"])
            valid += sum(c["name"] in SCHEMAS and not schema_errors(c["arguments"], SCHEMAS[c["name"]])
                         for c in r["tool_calls"])
    assert attempts >= 5 and valid == 0


def test_no_constraints_change_nothing(eng, tok):
    p = SamplingParams(max_new_tokens=30, temperature=1.0, seed=3, stop_at_eot=False)
    prompts = [prompt(tok), tok.encode("def f(x):")]
    plain = list(eng.generate_ids(prompts, p))
    assert list(eng.generate_ids(prompts, p, constraints=[None, None])) == plain
    greedy = SamplingParams(max_new_tokens=30, temperature=0, stop_at_eot=False)
    assert list(eng.generate_ids(prompts, greedy, constraints=[None, None])) == list(
        eng.generate_ids(prompts, greedy)
    )


def test_chat_applies_tool_choice_and_response_format(eng, tok):
    msgs = [{"role": "user", "content": "Search for parse_header"}]
    p = SamplingParams(max_new_tokens=200, temperature=1.0, seed=1)
    roomy = biased_engine(tok, block_size=1024)  # the five tools' prompt alone is longer than eng's context
    for seed in SEEDS:
        q = SamplingParams(max_new_tokens=60, temperature=1.0, seed=seed)
        r = roomy.chat(msgs, TOOLS, q, tool_choice={"type": "function", "function": {"name": "read_file"}})
        assert r["text"].startswith(CALL_OPEN) and r["ended"], r  # the budget always holds the whole call
        assert [c["name"] for c in r["tool_calls"]] and all(c["name"] == "read_file"
                                                            for c in r["tool_calls"]), r
        assert not r["errors"] and not schema_errors(r["tool_calls"][0]["arguments"], SCHEMAS["read_file"]), r
    # too few tokens for any call (or a prompt that leaves too few of the context): refused, not cut short
    with pytest.raises(ConstraintError, match="at least"):
        roomy.chat(msgs, TOOLS, SamplingParams(max_new_tokens=5), tool_choice="required")
    with pytest.raises(ConstraintError, match="context 256"):
        eng.chat(msgs, TOOLS, p, tool_choice="required")
    r = eng.chat(msgs, None, p, response_format=JSON_REPLY)
    assert r["ended"] and not schema_errors(json.loads(r["text"]), REPLY_SCHEMA)
    # constrained=False is the bare model: tool_choice is ignored
    assert eng.chat(msgs, TOOLS, p, constrained=False, tool_choice="required") == eng.chat(msgs, TOOLS, p,
                                                                                          constrained=False)


def test_chat_without_tools_never_opens_a_call(eng, tok):
    """Offered no tools, a model that reaches for a call answers in text: the call tokens are kept out of the
    reply, as OpenAI's API does. Unconstrained, the same model opens a call at once."""
    model = copy.deepcopy(eng.model)
    with torch.no_grad():
        # a model that calls a tool whatever it is asked
        model.lm_head.bias[tok.special_ids[CALL_OPEN]] = 30.0
    keen = Engine(model, tok)
    msgs = [{"role": "user", "content": "Read the file src/parser.py"}]
    for seed in SEEDS:
        p = SamplingParams(max_new_tokens=40, temperature=1.0, seed=seed)
        assert keen.chat(msgs, None, p, constrained=False)["text"].startswith(CALL_OPEN)
        r = keen.chat(msgs, None, p)
        assert CALL_OPEN not in r["text"] and CALL_CLOSE not in r["text"], r
        assert not r["tool_calls"] and not r["errors"] and r["content"], r


def test_chat_with_a_tokenizer_without_call_tokens_is_left_free(eng, tok):
    """An imported tokenizer may lack <tool_call>: such a model cannot write a call, so a chat without tools
    is not constrained at all (no grammar is built for tokens it does not have)."""
    bare = copy.copy(tok)
    bare.special_ids = {**tok.special_ids, CALL_OPEN: None, CALL_CLOSE: None}
    msgs = [{"role": "user", "content": "Read the file src/parser.py"}]
    p = SamplingParams(max_new_tokens=20, temperature=1.0, seed=0)
    assert Engine(eng.model, bare).chat(msgs, None, p) == eng.chat(msgs, None, p, constrained=False)
    # and tool_choice "none" forbids only what exists (it masked every token: an empty reply)
    assert Engine(eng.model, bare).chat(msgs, None, p, tool_choice="none")["text"]


def test_mask_logits_padded_vocab_and_allowed(tok):
    V = tok.vocab_size
    req, none = ToolGrammar(tok, TOOLS, "required").new(), ToolGrammar(tok, TOOLS, "none").new()
    auto = ToolGrammar(tok, TOOLS, "auto").new()
    logits = torch.randn(4, V + PAD)
    out = mask_logits([req, None, none, auto], logits)
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [tok.special_ids[CALL_OPEN]]  # forced
    assert torch.equal(out[1], logits[1]) and torch.equal(out[3], logits[3])  # free rows untouched
    banned = {tok.special_ids[CALL_OPEN], tok.special_ids[CALL_CLOSE]} | set(range(V, V + PAD))
    assert set(torch.isinf(out[2]).nonzero().flatten().tolist()) == banned
    assert auto.allowed() is None and req.allowed().nonzero().flatten().tolist() == [
        tok.special_ids[CALL_OPEN]
    ]
    assert not torch.isinf(logits).any()  # the input is not modified


def test_advance_refuses_a_token_the_grammar_forbids(tok):
    c = ToolGrammar(tok, TOOLS, "required").new()
    with pytest.raises(ConstraintError, match="not allowed"):
        c.advance(tok.encode("hello")[0])
    c = ToolGrammar(tok, TOOLS, "none").new()
    with pytest.raises(ConstraintError, match="none"):
        c.advance(tok.special_ids[CALL_OPEN])
    c = ToolGrammar(tok, TOOLS, "auto").new()
    c.advance(tok.special_ids[CALL_OPEN])  # now inside a call: only the body may follow
    with pytest.raises(ConstraintError):
        c.advance(tok.special_ids[IM_END])


def tool(name: str, parameters) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


@pytest.mark.parametrize("tools, mode, rf, match", [
    ([tool("broken", {"type": "nonsense"})], "auto", None, "tool 'broken'"),
    ([tool("regex", {"type": "object", "properties": {"a": {"type": "string", "pattern": "(("}}})],
     "required", None, "tool 'regex'"),
    ([tool("dangling", {"$ref": "#/$defs/missing"})], "auto", None, "tool 'dangling'"),
    ([tool("x", "not a schema")], "auto", None, "tool 'x'"),
    (TOOLS, "delete_everything", None, "not among the tools"),
    (None, "required", None, "needs at least one tool"),
    (TOOLS + TOOLS[:1], "auto", None, "given twice"),
    (None, "auto", {"type": "yaml"}, "response_format"),
    (None, "auto", {"type": "json_schema", "json_schema": {"name": "r", "schema": {"type": 3}}}, "'r'"),
])
def test_bad_schema_or_choice_is_refused_by_name(tok, tools, mode, rf, match):
    with pytest.raises(ConstraintError, match=match):
        ToolGrammar(tok, tools, mode, rf)


def test_missing_parameters_allow_any_object_and_odd_names_are_escaped(tok):
    name = 'we"ird\\näme'
    g = ToolGrammar(tok, [{"type": "function", "function": {"name": name}}], "required")
    c = g.new()
    text = json.dumps({"name": name, "arguments": {"k": [1, {"z": None}]}}, ensure_ascii=False)
    for t in [tok.special_ids[CALL_OPEN]] + tok.encode(text) + [tok.special_ids[CALL_CLOSE],
                                                                tok.special_ids[IM_END]]:
        c.advance(t)
    assert c.finished
    c = g.new()  # the compact layout is not the training layout: refused
    with pytest.raises(ConstraintError):
        for t in [tok.special_ids[CALL_OPEN]] + tok.encode(json.dumps({"name": name, "arguments": {}},
                                                                      separators=(",", ":"))):
            c.advance(t)


def writes(grammar: ToolGrammar, text: str) -> bool:
    """Whether a row of `grammar` may write `text` (a whole reply, <|im_end|> after it) and end there."""
    tok, c = grammar.tok, grammar.new()
    ids = []
    for part in re.split(f"({re.escape(CALL_OPEN)}|{re.escape(CALL_CLOSE)})", text):
        if part:
            ids += [tok.special_ids[part]] if part in (CALL_OPEN, CALL_CLOSE) else tok.encode(part)
    try:
        for t in ids + [tok.special_ids[IM_END]]:
            c.advance(t)
    except ConstraintError:
        return False
    return c.finished


def call_text(name: str, arguments: dict) -> str:
    return CALL_OPEN + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + CALL_CLOSE


def test_an_object_that_lists_its_keys_takes_no_others_unless_it_says_so(tok):
    """Tool arguments and JSON replies name only declared keys (issue 55, item 6): a barely trained model
    wrote `{"path": "...", ":,": true}` under a schema that lists `properties` without saying
    `additionalProperties`. As llama.cpp's converter reads such a schema, extra keys come only where
    `additionalProperties` allows them (true, or a schema for their values); nested objects alike. The
    caller's schema is not changed."""
    opts = {"type": "object", "properties": {"n": {"type": "integer"}}}
    params = {"type": "object", "properties": {"path": {"type": "string"}, "opts": opts},
              "required": ["path"]}
    given = copy.deepcopy(params)
    g = ToolGrammar(tok, [tool("read", params)], "required")
    assert params == given
    assert writes(g, call_text("read", {"path": "a.py"}))
    assert writes(g, call_text("read", {"path": "a.py", "opts": {"n": 3}}))
    assert not writes(g, call_text("read", {"path": "a.py", ":,": True}))
    assert not writes(g, call_text("read", {"path": "a.py", "opts": {"n": 3, "m": 1}}))
    # a tool with no arguments: `{"type": "object", "properties": {}}` is `{}` alone
    g = ToolGrammar(tok, [tool("now", {"type": "object", "properties": {}})], "required")
    assert writes(g, call_text("now", {})) and not writes(g, call_text("now", {"x": 1}))
    # said: extras of any kind, or of a schema
    g = ToolGrammar(tok, [tool("read", {**params, "additionalProperties": True})], "required")
    assert writes(g, call_text("read", {"path": "a.py", "extra": [1]}))
    g = ToolGrammar(tok, [tool("read", {**params, "additionalProperties": {"type": "integer"}})], "required")
    assert writes(g, call_text("read", {"path": "a.py", "k": 1}))
    assert not writes(g, call_text("read", {"path": "a.py", "k": "s"}))
    # no properties listed: any object (json_object, a tool without parameters)
    assert writes(ToolGrammar(tok, None, "auto", {"type": "json_object"}), json.dumps({"k": 1}))
    # a JSON reply the same way
    reply = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    g = ToolGrammar(tok, None, "auto", json_reply(reply))
    assert writes(g, json.dumps({"ok": True})) and not writes(g, json.dumps({"ok": True, "x": 1}))
    g = ToolGrammar(tok, None, "auto", json_reply({**reply, "additionalProperties": True}))
    assert writes(g, json.dumps({"ok": True, "x": 1}))


def test_objects_made_of_parts_take_the_keys_of_all_their_parts(tok):
    """An object made of allOf parts (or a $ref beside properties) takes the keys its parts list together:
    closing each part alone would let no object hold the keys of two parts. A part used elsewhere alone
    is closed there."""
    defs = {"base": {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}}
    named = {"properties": {"name": {"type": "string"}}, "required": ["name"]}
    both = {"$defs": defs, "type": "object", "properties": {
        "item": {"allOf": [{"$ref": "#/$defs/base"}, named]},
        "ref": {"$ref": "#/$defs/base", "properties": {"tag": {"type": "string"}}},
        "plain": {"$ref": "#/$defs/base"}}}
    g = ToolGrammar(tok, None, "auto", json_reply(both))
    assert writes(g, json.dumps({"item": {"id": 1, "name": "x"}}))
    assert not writes(g, json.dumps({"item": {"id": 1, "name": "x", "junk": 2}}))
    assert not writes(g, json.dumps({"item": {"id": "1", "name": "x"}}))  # the parts' own schemas hold
    assert writes(g, json.dumps({"ref": {"tag": "t", "id": 1}}))  # its own keys first, then its parts' keys
    assert not writes(g, json.dumps({"ref": {"id": 1, "junk": "t"}}))
    assert writes(g, json.dumps({"plain": {"id": 1}})) and not writes(g, json.dumps({"plain": {"id": 1,
                                                                                               "tag": "t"}}))
    # alternatives stand alone: each closed on its own
    either = {"type": "object", "properties": {"v": {"anyOf": [
        {"type": "object", "properties": {"a": {"type": "integer"}}}, {"type": "string"}]}}}
    g = ToolGrammar(tok, None, "auto", json_reply(either))
    assert writes(g, json.dumps({"v": {"a": 1}})) and writes(g, json.dumps({"v": "s"}))
    assert not writes(g, json.dumps({"v": {"a": 1, "b": 2}}))


def shared_definition(objects: int, keys: int) -> dict:
    """`objects` objects that each add (no) keys beside a $ref to one definition of `keys` properties."""
    d = {"type": "object", "properties": {f"k{i}": {"type": "integer"} for i in range(keys)}}
    return {"$defs": {"D": d}, "type": "object",
            "properties": {f"p{j}": {"$ref": "#/$defs/D", "properties": {}} for j in range(objects)}}


def test_closing_a_schema_takes_work_bounded_by_its_size(tok):
    """Each object made of parts takes a copy of its parts' keys: 1000 objects beside a $ref to a definition
    of 2000 properties (a 108 KB schema) would take 2 million keys (4.8 s and ~1 GB; twice that aborted the
    server in llguidance). Past ~4 times the schema's size plus 500 KB the schema is refused, by name, at
    once."""
    big = shared_definition(1000, 2000)
    with pytest.raises(ConstraintError, match="too large once its objects are closed"):
        closed_schema(big)
    with pytest.raises(ConstraintError, match="response_format json_schema.*too large"):
        ToolGrammar(tok, None, "auto", json_reply(big))
    # a long $ref read around a cycle of parts (256 times) by every object that uses it
    long = "d" * 100_000
    cycle = {"$defs": {long: {"allOf": [{"$ref": "#/$defs/" + long}]}, "B": {"$ref": "#/$defs/" + long}},
             "type": "object",
             "properties": {f"p{j}": {"properties": {"a": {}}, "allOf": [{"$ref": "#/$defs/B"}]}
                            for j in range(200)}}
    with pytest.raises(ConstraintError, match="too large"):
        closed_schema(cycle)
    # the same shape at the size of a real schema is closed: every object takes its definition's keys
    small = shared_definition(60, 50)
    g = ToolGrammar(tok, None, "auto", json_reply(small))
    assert writes(g, json.dumps({"p3": {"k0": 1, "k29": 2}}))
    assert not writes(g, json.dumps({"p3": {"k0": 1, "x": 2}}))


def test_a_required_key_not_listed_takes_any_value(tok):
    """A key the object requires but does not list in "properties" is allowed, with any value (closed, the
    object would otherwise require a key it cannot take: unsatisfiable); other keys are not."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["b"]}
    g = ToolGrammar(tok, None, "auto", json_reply(schema))
    assert writes(g, json.dumps({"a": 1, "b": "x"})) and writes(g, json.dumps({"a": 1, "b": [2]}))
    assert not writes(g, json.dumps({"a": 1, "b": 2, "z": 3}))
    assert not writes(g, json.dumps({"a": 1}))
    # required by a part of an object made of parts alike
    parts = {"allOf": [{"properties": {"a": {"type": "integer"}}}, {"required": ["b"]}]}
    g = ToolGrammar(tok, None, "auto", json_reply(parts))
    assert writes(g, json.dumps({"a": 1, "b": "x"}))
    assert not writes(g, json.dumps({"a": 1, "b": 2, "z": 3}))


def test_a_part_true_adds_no_keys(tok):
    """`true` as a part (any value) lists no keys: the object is closed on the other parts' keys."""
    schema = {"allOf": [True, {"properties": {"a": {"type": "integer"}}}]}
    g = ToolGrammar(tok, None, "auto", json_reply(schema))
    assert writes(g, json.dumps({"a": 1}))
    assert not writes(g, json.dumps({"a": 1, "z": 1}))
