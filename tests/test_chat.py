"""Chat format (codeforge/chat.py): loss mask, exact rendering, transformers template parity, parsing of
generated tool calls, and validation of chat JSONL."""

from __future__ import annotations

import json
import shutil

import pytest

from codeforge import CodeforgeError
from codeforge.chat import (CALL_CLOSE, CALL_OPEN, IM_END, IM_START, TOOLS_INTRO, TOOLS_OUTRO,
                            ChatFormatError, encode_conversation, parse_assistant, read_conversations,
                            render_text, validate)
from codeforge.corpus import CorpusStats
from codeforge.tokenizer import CodeTokenizer, write_hf_config


@pytest.fixture(scope="module")
def tok(tokenizer_dir) -> CodeTokenizer:
    return CodeTokenizer.load(tokenizer_dir)


@pytest.fixture(scope="module")
def hf_tok(tokenizer_dir, tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    d = tmp_path_factory.mktemp("hf") / "tok"
    shutil.copytree(tokenizer_dir, d)
    write_hf_config(d)
    return transformers.AutoTokenizer.from_pretrained(str(d))


READ_FILE_TOOL = {"type": "function", "function": {
    "name": "read_file", "description": "Read a file — returns its text ✓",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}


def call(name: str, arguments) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def loss_spans(tok: CodeTokenizer, ids: list[int], mask: list[int]) -> list[str]:
    """The decoded text of each maximal run of tokens with mask 1."""
    assert len(ids) == len(mask) and set(mask) <= {0, 1}
    spans, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            spans.append(tok.decode(cur))
            cur = []
    if cur:
        spans.append(tok.decode(cur))
    return spans


def check_mask(tok, messages, tools, expected_spans):
    ids, mask = encode_conversation(tok, messages, tools)
    assert tok.decode(ids) == render_text(messages, tools)  # the ids are the rendered text
    spans = loss_spans(tok, ids, mask)
    assert spans == expected_spans
    for s in spans:
        assert IM_START not in s
        assert "user" not in s and "system" not in s and "tool\n" not in s and "assistant" not in s
    # every special token an assistant does not write carries no loss
    for i, m in zip(ids, mask):
        if i in (tok.special_ids[IM_START], tok.special_ids["<tool_response>"],
                 tok.special_ids["</tool_response>"]):
            assert m == 0
    return ids, mask


# -- 1. loss mask ----------------------------------------------------------------------------------------

def test_mask_system_user_assistant(tok):
    msgs = [{"role": "system", "content": "You are a careful coder."},
            {"role": "user", "content": "What does len do?"},
            {"role": "assistant", "content": "It returns the number of items."}]
    ids, mask = check_mask(tok, msgs, None, ["It returns the number of items." + IM_END])
    assert tok.decode([ids[-1]]) == "\n" and mask[-1] == 0
    assert ids[-2] == tok.special_ids[IM_END] and mask[-2] == 1


def test_mask_multi_turn(tok):
    msgs = [{"role": "user", "content": "Name a sort."},
            {"role": "assistant", "content": "Merge sort."},
            {"role": "user", "content": "Its complexity?"},
            {"role": "assistant", "content": "O(n log n) in every case."}]
    ids, mask = check_mask(tok, msgs, None, ["Merge sort." + IM_END, "O(n log n) in every case." + IM_END])
    # exactly two <|im_end|> carry loss: the assistants'; the users' do not
    end = tok.special_ids[IM_END]
    assert [m for i, m in zip(ids, mask) if i == end] == [0, 1, 0, 1]


def test_mask_tools_tool_call_result_and_answer(tok):
    msgs = [{"role": "system", "content": "Use tools."},
            {"role": "user", "content": "What is in a.py?"},
            {"role": "assistant", "content": "", "tool_calls": [call("read_file", "{\"path\": \"a.py\"}")]},
            {"role": "tool", "content": "def f():\n    return 1\n"},
            {"role": "assistant", "content": "It defines f, which returns 1."}]
    ids, mask = check_mask(tok, msgs, [READ_FILE_TOOL], [
        CALL_OPEN + '{"name": "read_file", "arguments": {"path": "a.py"}}' + CALL_CLOSE + IM_END,
        "It defines f, which returns 1." + IM_END])
    # the call tags are the special ids and carry loss; the tool result text carries none
    assert mask[ids.index(tok.special_ids[CALL_OPEN])] == 1
    assert mask[ids.index(tok.special_ids[CALL_CLOSE])] == 1
    assert "return 1" not in "".join(loss_spans(tok, ids, mask))


def test_mask_content_then_two_calls_dict_arguments(tok):
    msgs = [{"role": "user", "content": "Read a.py and b.py"},
            {"role": "assistant", "content": "Reading both.",
             "tool_calls": [call("read_file", {"path": "a.py"}),
                            {"name": "read_file", "arguments": {"path": "b.py", "note": "café ✓"}}]}]
    check_mask(
        tok,
        msgs,
        None,
        [
            "Reading both.\n"
            + CALL_OPEN
            + '{"name": "read_file", "arguments": {"path": "a.py"}}'
            + CALL_CLOSE
            + "\n"
            + CALL_OPEN
            + '{"name": "read_file", "arguments": {"path": "b.py", "note": "café ✓"}}'
            + CALL_CLOSE
            + IM_END
        ],
    )


def test_mask_content_null(tok):
    msgs = [{"role": "system", "content": None},
            {"role": "user", "content": None},
            {"role": "assistant", "content": None, "tool_calls": [call("read_file", {"path": "a.py"})]},
            {"role": "tool", "content": None},
            {"role": "assistant", "content": None}]
    assert render_text(msgs) == (
        "<|im_start|>system\n<|im_end|>\n<|im_start|>user\n<|im_end|>\n<|im_start|>assistant\n"
        '<tool_call>{"name": "read_file", "arguments": {"path": "a.py"}}</tool_call><|im_end|>\n'
        "<|im_start|>tool\n<tool_response>\n\n</tool_response><|im_end|>\n<|im_start|>assistant\n<|im_end|>\n")
    check_mask(tok, msgs, None, [
        CALL_OPEN + '{"name": "read_file", "arguments": {"path": "a.py"}}' + CALL_CLOSE + IM_END, IM_END])


def test_generation_prompt_is_prefix_of_training_ids(tok):
    """What the model sees at inference (history + generation prompt) is what it saw in training."""
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello there."}]
    prompt, pmask = encode_conversation(tok, msgs[:1], add_generation_prompt=True)
    full, _ = encode_conversation(tok, msgs)
    assert full[:len(prompt)] == prompt and set(pmask) == {0}


@pytest.fixture(scope="module")
def code_tok(tmp_path_factory, code_corpus) -> CodeTokenizer:
    """A tokenizer with codeforge's code split, which keeps a newline and the
    indentation after it together."""
    from codeforge.corpus import CorpusOptions, iter_documents
    from codeforge.tokenizer import train_tokenizer
    texts = (d.text for d in iter_documents([str(code_corpus)], CorpusOptions(languages=["go", "python"]),
                                            CorpusStats()))
    return train_tokenizer(texts, 1024, tmp_path_factory.mktemp("codetok") / "tok", split="code")[0]


def test_generation_prompt_is_prefix_when_content_is_indented(tok):
    """The default split (llama3) keeps the header's newline apart from the content's indentation, so the
    generation prompt is a prefix of the training ids even when the answer starts indented."""
    msgs = [{"role": "user", "content": "body?"}, {"role": "assistant", "content": "    return 1"}]
    prompt, _ = encode_conversation(tok, msgs[:1], add_generation_prompt=True)
    full, _ = encode_conversation(tok, msgs)
    assert full[:len(prompt)] == prompt


@pytest.mark.xfail(strict=True,
                   reason="with the code split, assistant content that starts with whitespace merges "
                   "with the header's '\\n' into one BPE token ('\\n    '), so the training ids after "
                   "'assistant' differ from the generation prompt's separate '\\n' token (train/serve skew)")
def test_code_split_generation_prompt_is_prefix_when_content_is_indented(code_tok):
    msgs = [{"role": "user", "content": "body?"}, {"role": "assistant", "content": "    return 1"}]
    prompt, _ = encode_conversation(code_tok, msgs[:1], add_generation_prompt=True)
    full, _ = encode_conversation(code_tok, msgs)
    assert full[:len(prompt)] == prompt


def test_mask_indented_content_token_straddles_header(code_tok):
    """Documented rule: a token that overlaps assistant characters carries loss, so the header's "\n" merged
    with leading indentation ("\n    ", one token with the code split) is in the loss span."""
    tok = code_tok
    assert tok.tok.token_to_id("ĊĠĠĠĠ") is not None
    msgs = [{"role": "user", "content": "body?"}, {"role": "assistant", "content": "    return 1"}]
    ids, mask = encode_conversation(tok, msgs)
    assert loss_spans(tok, ids, mask) == ["\n    return 1" + IM_END]


# -- 2. exact rendering ----------------------------------------------------------------------------------

def test_render_text_exact():
    msgs = [{"role": "system", "content": "You are helpful."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"}]
    assert render_text(msgs) == ("<|im_start|>system\nYou are helpful.<|im_end|>\n"
                                 "<|im_start|>user\nHi<|im_end|>\n"
                                 "<|im_start|>assistant\nHello!<|im_end|>\n")
    assert render_text(msgs[1:2], add_generation_prompt=True) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_render_text_exact_with_tools():
    msgs = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": "ok", "tool_calls": [call("f", {"x": 1})]},
            {"role": "tool", "content": "r"}]
    assert TOOLS_INTRO == "\n\n# Tools\n\nYou can call these tools (JSON schemas, one per line):\n"
    assert TOOLS_OUTRO == ("\nTo call a tool, write a tool call block holding {\"name\": <tool name>, "
                           "\"arguments\": <JSON object>}; the result comes back in a tool turn.")
    assert "<tool_call>" not in TOOLS_OUTRO  # special-token text here would break id parity with transformers
    assert render_text(msgs, [{"name": "f"}], add_generation_prompt=True) == (
        "<|im_start|>system\n"
        "\n\n# Tools\n\nYou can call these tools (JSON schemas, one per line):\n"
        '{"name": "f"}\n'
        "\nTo call a tool, write a tool call block holding {\"name\": <tool name>, \"arguments\": <JSON "
        "object>}; the result comes back in a tool turn.<|im_end|>\n"
        "<|im_start|>user\nq<|im_end|>\n"
        '<|im_start|>assistant\nok\n<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call><|im_end|>\n'
        "<|im_start|>tool\n<tool_response>\nr\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")


# -- 3. transformers chat template parity ----------------------------------------------------------------

CODE = "def f(x):\n    if x:\n\treturn {'a': [1, 2]}\n    return None  # done\n"
UNICODE = "héllo ✓ 日本語 🚀 naïve — “quotes”"

CONVERSATIONS = {
    "plain": ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello."}], None),
    "system": ([{"role": "system", "content": "Be terse.\nAlways."}, {"role": "user", "content": UNICODE},
                {"role": "assistant", "content": UNICODE}], None),
    "multi_turn_code": ([{"role": "user", "content": "Write f.\n\n" + CODE},
                         {"role": "assistant", "content": "Here:\n" + CODE},
                         {"role": "user", "content": "Indent it."},
                         {"role": "assistant", "content": "    " + CODE.replace("\n", "\n    ")}], None),
    "calls_no_schema": ([{"role": "user", "content": "read a.py"},
                         {"role": "assistant", "content": "",
                          "tool_calls": [call("read_file", "{\"path\": \"a.py\"}")]},
                         {"role": "tool", "content": CODE},
                         {"role": "assistant", "content": None,
                          "tool_calls": [call("read_file", {"path": "b.py", "q": UNICODE}),
                                         {"name": "grep", "arguments": {"pattern": "def\\s+"}}]},
                         {"role": "tool", "content": "b"}, {"role": "tool", "content": UNICODE},
                         {"role": "assistant", "content": "Done: " + UNICODE}], None),
}
TOOL_CONVERSATION = (
    [{"role": "system", "content": "Use tools when needed."},
     {"role": "user", "content": "What is in a.py?"},
     {"role": "assistant", "content": "Let me look.",
      "tool_calls": [call("read_file", "{\"path\": \"a.py\"}")]},
     {"role": "tool", "content": CODE},
     {"role": "assistant", "content": "It defines f."}],
    [READ_FILE_TOOL, {"type": "function", "function": {"name": "grep", "parameters": {"type": "object"}}}])


def hf_ids(hf_tok, messages, tools, gen):
    text = hf_tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=gen)
    assert isinstance(text, str)
    out = hf_tok.apply_chat_template(messages, tools=tools, tokenize=True, add_generation_prompt=gen)
    # transformers 5 returns a BatchEncoding (dict) here, not a bare list of ids
    chat_ids = out["input_ids"] if hasattr(out, "keys") else out
    return text, hf_tok(text, add_special_tokens=False)["input_ids"], list(chat_ids)


@pytest.mark.parametrize("gen", [False, True])
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_hf_template_parity(hf_tok, tok, name, gen):
    messages, tools = CONVERSATIONS[name]
    text, ids_text, ids_chat = hf_ids(hf_tok, messages, tools, gen)
    assert text == render_text(messages, tools, add_generation_prompt=gen)
    ids, _ = encode_conversation(tok, messages, tools, add_generation_prompt=gen)
    assert ids_text == ids
    assert ids_chat == ids


@pytest.mark.parametrize("gen", [False, True])
def test_hf_template_parity_text_with_tools(hf_tok, gen):
    messages, tools = TOOL_CONVERSATION
    text = hf_tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=gen)
    assert text == render_text(messages, tools, add_generation_prompt=gen)


def test_hf_template_parity_ids_with_tools(hf_tok, tok):
    messages, tools = TOOL_CONVERSATION
    _, ids_text, ids_chat = hf_ids(hf_tok, messages, tools, False)
    ids, _ = encode_conversation(tok, messages, tools)
    assert ids_text == ids_chat == ids


# -- 4. parsing generated text ---------------------------------------------------------------------------

def test_parse_content_and_one_call():
    out = parse_assistant('Let me read it.\n<tool_call>{"name": "read_file", "arguments": {"path": "a.py"}}'
                          '</tool_call><|im_end|>')
    assert out == {"content": "Let me read it.",
                   "tool_calls": [{"name": "read_file", "arguments": {"path": "a.py"}}], "errors": []}


def test_parse_two_calls_no_content():
    out = parse_assistant('<tool_call>{"name": "a", "arguments": {}}</tool_call>\n'
                          '<tool_call>{"name": "b", "arguments": {"x": [1, "✓"]}}</tool_call>')
    assert out == {
        "content": "",
        "errors": [],
        "tool_calls": [{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": [1, "✓"]}}],
    }


def test_parse_roundtrips_rendered_assistant_turn():
    msgs = [{"role": "assistant", "content": "Two calls.",
             "tool_calls": [call("read_file", "{\"path\": \"a.py\"}"), call("grep", {"p": "x"})]}]
    generated = render_text(msgs).split("<|im_start|>assistant\n", 1)[1]
    assert parse_assistant(generated) == {"content": "Two calls.", "errors": [], "tool_calls": [
        {"name": "read_file", "arguments": {"path": "a.py"}}, {"name": "grep", "arguments": {"p": "x"}}]}


def test_parse_unterminated_complete_json_accepted():
    out = parse_assistant('Reading.\n<tool_call>{"name": "read_file", "arguments": {"path": "a.py"}}')
    assert out == {"content": "Reading.", "errors": [],
                   "tool_calls": [{"name": "read_file", "arguments": {"path": "a.py"}}]}
    assert parse_assistant('<tool_call>{"name": "f"}\n')["tool_calls"] == [{"name": "f", "arguments": {}}]


def test_parse_unterminated_cut_json_is_error_content_kept():
    out = parse_assistant('Reading.\n<tool_call>{"name": "read_file", "argu')
    assert out["content"] == "Reading." and out["tool_calls"] == []
    assert len(out["errors"]) == 1 and out["errors"][0].startswith("unterminated: ")


def test_parse_malformed_json():
    out = parse_assistant('ok <tool_call>{name: read_file}</tool_call> '
                          'then <tool_call>{"name": "g"}</tool_call>')
    assert out["content"] == "ok  then"
    assert out["tool_calls"] == [{"name": "g", "arguments": {}}]
    assert len(out["errors"]) == 1 and out["errors"][0].startswith("not JSON: '{name: read_file}'")


def test_parse_missing_or_bad_name():
    for body in ('{"arguments": {"a": 1}}', '{"name": 3}', '["read_file"]'):
        out = parse_assistant(f"<tool_call>{body}</tool_call>")
        assert out["tool_calls"] == [] and len(out["errors"]) == 1
        assert out["errors"][0].startswith("no tool name: ")


def test_parse_arguments_as_json_string_and_non_object():
    out = parse_assistant('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>')
    assert out["tool_calls"] == [{"name": "f", "arguments": {"a": 1}}] and out["errors"] == []
    for args in ('"not json"', "[1, 2]", '"[1]"'):
        out = parse_assistant(f'<tool_call>{{"name": "f", "arguments": {args}}}</tool_call>')
        assert out["tool_calls"] == [] and out["errors"] == ["arguments of 'f' are not a JSON object"]


def test_parse_drops_text_after_im_end():
    out = parse_assistant('Done.<|im_end|>\n<|im_start|>user\n<tool_call>{"name": "x"}</tool_call>')
    assert out == {"content": "Done.", "tool_calls": [], "errors": []}


# -- 5. validation and reading chat JSONL ----------------------------------------------------------------

VALID = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
BAD_LINES = [  # (line, reason)
    ("{not json", "bad_json"),
    (json.dumps({"conversation": []}), "no_messages"),
    (json.dumps({"messages": [{"role": "robot", "content": "beep"}, {"role": "assistant", "content": "x"}]}),
     "unknown_role"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}]}), "no_assistant"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "",
                                                                  "tool_calls": [call("f", "{not json")]}]}),
     "tool_call_not_json"),
    (json.dumps({**VALID, "tools": ["x"]}), "tool_schema_not_object"),
    (json.dumps({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                              {"role": "assistant", "content": "x"}]}), "content_not_string"),
]


def write_jsonl(path):
    path.write_text("\n".join([json.dumps(VALID)] + [line for line, _ in BAD_LINES]) + "\n\n")


def test_read_conversations_skips_bad_lines(tmp_path):
    p = tmp_path / "chat.jsonl"
    write_jsonl(p)
    stats = CorpusStats()
    got = list(read_conversations([str(p)], stats))
    assert got == [(VALID["messages"], [], f"{p}:1")]
    assert dict(stats.skipped) == {reason: 1 for _, reason in BAD_LINES}
    assert stats.examples == {reason: f"{p}:{n}" for n, (_, reason) in enumerate(BAD_LINES, 2)}


def test_read_conversations_directory(tmp_path):
    write_jsonl(tmp_path / "a.jsonl")
    (tmp_path / "notes.txt").write_text("{not json\n")
    stats = CorpusStats()
    assert [w for _, _, w in read_conversations([str(tmp_path)], stats)] == [f"{tmp_path / 'a.jsonl'}:1"]
    assert sum(stats.skipped.values()) == len(BAD_LINES)


def test_read_conversations_strict_raises_with_location(tmp_path):
    p = tmp_path / "chat.jsonl"
    write_jsonl(p)
    with pytest.raises(CodeforgeError, match=r"bad_json") as e:
        list(read_conversations([str(p)], CorpusStats(), strict=True))
    assert f"{p}:2" in str(e.value)


def test_read_conversations_missing_file(tmp_path):
    with pytest.raises(CodeforgeError, match="does not exist"):
        list(read_conversations([str(tmp_path / "nope.jsonl")], CorpusStats()))


@pytest.mark.parametrize("obj,reason", [
    ([1, 2], "no_messages"),
    ({"messages": []}, "no_messages"),
    ({"messages": ["hi", {"role": "assistant", "content": "x"}]}, "unknown_role"),
    ({"messages": [{"role": "user", "content": "a", "tool_calls": [call("f", {})]},
                   {"role": "assistant", "content": "x"}]}, "bad_tool_call"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments": {}}}]}]},
     "bad_tool_call"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": [call("f", "[1]")]}]},
     "tool_call_not_json"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": [call("f", [1])]}]},
     "tool_call_not_json"),
    ({**VALID, "tools": "read_file"}, "tool_schema_not_object"),
])
def test_validate_reasons(obj, reason):
    with pytest.raises(ChatFormatError) as e:
        validate(obj)
    assert e.value.reason == reason and str(e.value).startswith(reason + ": ")
    assert isinstance(e.value, CodeforgeError)


def test_validate_ok_returns_messages_and_tools():
    obj = {**VALID, "tools": [READ_FILE_TOOL]}
    assert validate(obj) == (VALID["messages"], [READ_FILE_TOOL])
    assert validate(VALID) == (VALID["messages"], [])


# -- 6. special-token text inside a message stays text ---------------------------------------------------

def test_literal_im_end_in_user_message_stays_text(tok):
    msgs = [{"role": "user", "content": "Why does <|im_end|> end a turn? Also <tool_call>?"},
            {"role": "assistant", "content": "It is a special token: <|im_end|>."}]
    ids, mask = encode_conversation(tok, msgs)
    end = tok.special_ids[IM_END]
    assert ids.count(end) == 2 and ids[-2] == end  # the user's and the assistant's real turn ends only
    assert ids.count(tok.special_ids[CALL_OPEN]) == 0
    assert tok.decode(ids) == render_text(msgs)
    # the typed text is still there, as ordinary tokens, and the assistant's typed copy carries loss
    assert loss_spans(tok, ids, mask) == ["It is a special token: <|im_end|>." + IM_END]
    assert tok.decode(ids[:ids.index(end)]) == ("<|im_start|>user\nWhy does <|im_end|> "
                                                "end a turn? Also <tool_call>?")


@pytest.mark.parametrize("text, words", [
    ('[{"type": "function", "function": {"name": "f"}', "not JSON"),
    ('{"name": "f"}', "expected a JSON list of tool objects"),
    ('[{"type": "function", "function": {"parameters": {}}}]', "has no function name"),
])
def test_chat_tools_file_errors_name_the_file_and_show_the_shape(tmp_path, capsys, text, words):
    """A bad --tools file is refused before any model loads, naming the file, what is wrong and an example."""
    from codeforge.cli import main
    bad = tmp_path / "my_tools.json"
    bad.write_text(text)
    assert main(["chat", "--run", str(tmp_path / "no-run"), "--tools", str(bad)]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and words in err and '"get_weather"' in err


def test_chat_commands_are_answered_and_never_sent_to_the_model(monkeypatch, capsys):
    """At the terminal: /help, /reset, /system and an unknown /word are answered on stderr and reach no model
    turn; // sends a line that starts with /; /quit leaves."""
    from codeforge.cli.run import _chat_repl
    seen: list[list[dict]] = []

    class Eng:
        tool_trained = False

        def chat(self, messages, tools, params, on_text=None, constrained=True):
            seen.append([dict(m) for m in messages])
            return {"content": "ok", "tool_calls": [], "errors": []}
    lines = iter(["/help", "hello", "/system be brief", "/reset", "/frobnicate", "//usr is a path", "",
                  "/system", "again", "/quit", "never read"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    assert _chat_repl(Eng(), None, [], None) == 0
    err = capsys.readouterr().err
    assert err.count("/reset clears the history") == 2  # the banner and /help
    assert "(system message set)" in err and "(system message removed)" in err
    assert "(history cleared: 2 message(s) dropped; the system message is kept)" in err
    assert "unknown command /frobnicate" in err
    users = [[m["content"] for m in s if m["role"] == "user"] for s in seen]
    assert users == [["hello"], ["/usr is a path"], ["/usr is a path", "again"]]
    assert seen[1][0] == {"role": "system", "content": "be brief"}  # set, kept through /reset
    assert all(m["role"] != "system" for m in seen[2])  # removed
    assert next(lines) == "never read"
