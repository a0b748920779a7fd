"""Synthetic tool-calling data: determinism, disjoint splits, schema-valid calls, exact arithmetic, eval cuts
and a score computed by hand."""

from __future__ import annotations

import json
import random

import pytest

from codeforge import CodeforgeError
from codeforge.constrain import open_tools
from codeforge.tasks.tool_calls import (TOOL_BY_NAME, TOOLS, ToolDataError, eval_cases, evaluate_expression,
                                        example_kind, generate, make_example, score, write_tool_data)


@pytest.fixture(scope="module")
def train() -> list[dict]:
    return generate(400, seed=0)


def test_same_seed_same_examples(train):
    assert generate(400, seed=0) == train
    assert [make_example(random.Random(7)) for _ in range(3)] == [make_example(random.Random(7))
                                                                  for _ in range(3)]
    assert generate(50, seed=1) != train[:50]


def test_train_and_heldout_are_disjoint_and_without_duplicates(train):
    def key(e):
        return json.dumps(e, sort_keys=True)
    heldout = generate(60, seed=0, split="heldout") + generate(60, seed=3, split="heldout")
    assert len({key(e) for e in train}) == len(train)
    assert not {key(e) for e in train} & {key(e) for e in heldout}
    assert not {key(e) for e in generate(200, seed=3)} & {key(e) for e in heldout}


def test_tool_calls_match_the_offered_schemas(train):
    assert 4 <= len(TOOLS) <= 6
    for example in train:
        offered = {t["function"]["name"]: t for t in example["tools"]}
        assert 2 <= len(offered) == len(example["tools"])
        msgs = example["messages"]
        assert msgs[-1]["role"] == "assistant" and msgs[-1]["content"] and "tool_calls" not in msgs[-1]
        for i, m in enumerate(msgs):
            if not m.get("tool_calls"):
                continue
            assert m["content"] == "" and msgs[i - 1]["role"] == "user" and msgs[i + 1]["role"] == "tool"
            for call in m["tool_calls"]:
                fn = call["function"]
                assert call["type"] == "function" and fn["name"] in offered
                assert isinstance(fn["arguments"], str) and fn["arguments"] == json.dumps(
                    json.loads(fn["arguments"])
                )
                args, params = json.loads(fn["arguments"]), offered[fn["name"]]["function"]["parameters"]
                assert isinstance(args, dict) and set(params["required"]) <= set(args) <= set(
                    params["properties"]
                )
                for k, v in args.items():
                    assert isinstance(v, str) and v in msgs[i - 1]["content"]  # named literally by the user
                    assert v in params["properties"][k].get("enum", [v])


def test_expression_results_are_exact(train):
    assert evaluate_expression("17 * 23 + 4") == 395
    assert evaluate_expression("(96 - 6) // 7") == 12
    assert evaluate_expression("-7 // 2") == -4
    for bad in ["__import__('os')", "2 ** 10", "1 / 2", "3 // (2 - 2)", "1.5 + 1", "True + 1"]:
        with pytest.raises(ToolDataError):
            evaluate_expression(bad)
    checked = 0
    for example in train:
        msgs = example["messages"]
        for i, m in enumerate(msgs):
            for call in m.get("tool_calls", []):
                if call["function"]["name"] == "evaluate_expression":
                    expr = json.loads(call["function"]["arguments"])["expression"]
                    assert msgs[i + 1]["content"] == str(evaluate_expression(expr))
                    # `a op b`: an independent check that does not use the AST walker
                    if expr.count(" ") == 2:
                        a, op, b = expr.split()
                        want = {"+": int.__add__, "-": int.__sub__, "*": int.__mul__,
                                "//": int.__floordiv__}[op]
                        assert msgs[i + 1]["content"] == str(want(int(a), int(b)))
                    checked += 1
    assert checked > 30


def test_mix_of_kinds(train):
    kinds = [example_kind(e) for e in train]
    assert abs(kinds.count("no_tool") / len(kinds) - 0.25) < 0.06
    assert abs(kinds.count("multi_turn") / len(kinds) - 0.15) < 0.06
    names = {c["function"]["name"] for e in train for m in e["messages"] for c in m.get("tool_calls", [])}
    assert names == set(TOOL_BY_NAME)
    assert 0.3 < sum(e["messages"][0]["role"] == "system" for e in train) / len(train) < 0.9


def test_eval_cases_cut_before_each_answer_to_a_user(train):
    multi = next(e for e in train if example_kind(e) == "multi_turn" and e["messages"][0]["role"] == "user"
                 and e["messages"][2]["role"] == "tool")
    msgs = multi["messages"]  # user, call, tool, answer, user, call, tool, answer
    cases = eval_cases([multi])
    assert len(cases) == 2 and [len(c["messages"]) for c in cases] == [1, 5]
    assert cases[1]["messages"] == msgs[:5] and cases[1]["tools"] == multi["tools"]
    for case, call_msg in zip(cases, (msgs[1], msgs[5])):
        fn = call_msg["tool_calls"][0]["function"]
        assert case["expected"] == [{"name": fn["name"], "arguments": json.loads(fn["arguments"])}]
    chat = next(e for e in train if example_kind(e) == "no_tool")
    [case] = eval_cases([chat])
    assert case["expected"] == [] and case["messages"] == chat["messages"][:-1]
    assert len(eval_cases(train)) == sum(1 + (example_kind(e) == "multi_turn") for e in train)


def test_score_by_hand():
    def call(name, **args):
        return {"name": name, "arguments": args}
    cases = [{"messages": [], "tools": [], "expected": e} for e in [
        [call("run_tests", path="tests/")],
        [call("evaluate_expression", expression="2 + 3")],
        [call("read_file", path="src/cli.py")],
        [],
        [],
        [call("list_directory", path="src")],
    ]]
    preds = [
        {"content": "", "tool_calls": [call("run_tests", path="tests/")], "errors": []},  # right
        # wrong arg
        {"content": "", "tool_calls": [call("evaluate_expression", expression="2+3")], "errors": []},
        # malformed
        {"content": "", "tool_calls": [], "errors": ["malformed JSON: {\"name\": \"read_file\""]},
        {"content": "Hello!", "tool_calls": [], "errors": []},  # right: no call
        # called when it should not
        {"content": "", "tool_calls": [call("read_file", path="x.py")], "errors": []},
        {"content": "The directory has 3 files.", "tool_calls": [], "errors": []},  # did not call
    ]
    assert score(cases, preds) == {"tool_cases": 6, "tool_call_cases": 4, "no_call_cases": 2,
                                   "tool_parse_rate": 3 / 4, "tool_name_accuracy": 2 / 4,
                                   "tool_args_exact": 1 / 4,
                                   "no_call_accuracy": 1 / 2, "tool_cut_by_budget": 0,
                                   "tool_unknown_names": 0}
    # a call still being written when the token budget ran out is counted apart, not as malformed; a call
    # naming a tool the case did not offer is counted
    offered = [{"type": "function", "function": {"name": "read_file"}}]
    cut = {"content": "", "tool_calls": [], "errors": ['unterminated: \'{"name": "read_file", "argu\''],
           "ended": False}
    r = score([{**cases[2], "tools": offered}] * 2, [cut, {**preds[4], "tool_calls": [call("rm", path="/")]}])
    assert r["tool_cut_by_budget"] == 1 and r["tool_parse_rate"] == 1.0 and r["tool_unknown_names"] == 1
    nothing = score(cases[3:5], [preds[3]] * 2)
    assert nothing["tool_parse_rate"] is None and nothing["tool_name_accuracy"] is None
    assert nothing["no_call_accuracy"] == 1.0
    with pytest.raises(ToolDataError, match="2 predictions for 6 cases"):
        score(cases, preds[:2])


def test_write_tool_data(tmp_path):
    out = tmp_path / "tools"
    meta = write_tool_data(out, n_train=30, n_heldout=5, seed=2)
    assert sorted(p.name for p in out.iterdir()) == ["heldout.jsonl", "meta.json", "tools.json",
                                                     "train.jsonl"]
    assert json.loads((out / "tools.json").read_text()) == TOOLS  # the schemas, as `chat --tools` takes them
    # strict: a constrained call can carry no argument key the tool does not list
    assert all(t["function"]["parameters"]["additionalProperties"] is False for t in TOOLS)
    assert open_tools(TOOLS) == []
    # an object that lists its keys takes no others unless it says so (llama.cpp's rule)
    unsaid = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "string"}}}}}]
    assert open_tools(unsaid) == []
    loose = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "string"}}, "additionalProperties": True}}}]
    assert open_tools(loose) == ["f"]
    rows = {s: [json.loads(line) for line in (out / f"{s}.jsonl").read_text().splitlines()]
            for s in ("train", "heldout")}
    assert rows["train"] == generate(30, seed=2) and rows["heldout"] == generate(5, seed=2, split="heldout")
    assert json.loads((out / "meta.json").read_text()) == meta and meta["n_train"] == 30
    assert sum(meta["kinds"]["train"].values()) == 30
    with pytest.raises(ToolDataError, match="overwrite") as e:
        write_tool_data(out, 3, 1)
    assert isinstance(e.value, CodeforgeError)
    write_tool_data(out, 3, 1, overwrite=True)
    assert len((out / "train.jsonl").read_text().splitlines()) == 3
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging dir left behind


def test_schemas_are_compact():
    """Every offered schema sits in the system turn, before the first token that carries loss: one short
    description per tool and none per parameter keep five of them at ~360 tokens (528 with the descriptions
    this data first had; docs/LOG.md#2026-11-25-quickstart-chat-tool-calling), ~400 with
    "additionalProperties": false in each."""
    assert sum(len(json.dumps(t)) for t in TOOLS) <= 1300
    for t in TOOLS:
        fn = t["function"]
        assert 0 < len(fn["description"]) <= 40
        assert all(set(p) <= {"type", "enum"} for p in fn["parameters"]["properties"].values())
