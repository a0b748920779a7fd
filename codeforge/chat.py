"""Chat format: ChatML turns, tools in the system turn, tool calls and results, the loss mask, the same
rendering as a Jinja chat template, and the parser that turns generated text back into tool calls.

A conversation is the OpenAI shape: {"messages": [{"role": "system"|"user"|"assistant"|"tool", "content":
...}], "tools": [JSON schema, ...]}. It renders as (special tokens in angle brackets):

  <|im_start|>system\\n{system text}{tools block}<|im_end|>\\n      (only if there is a system text or tools)
  <|im_start|>user\\n{content}<|im_end|>\\n
  <|im_start|>assistant\\n{content}<tool_call>{"name": ..., "arguments": {...}}</tool_call><|im_end|>\\n
  <|im_start|>tool\\n<tool_response>\\n{content}\\n</tool_response><|im_end|>\\n

the layout of Qwen2.5-style templates, so an OpenAI-compatible server can turn generated calls into
`tool_calls`. SFT is data, not a new loss: `encode_conversation` returns (ids, mask) where mask is 1 on
exactly the tokens an assistant writes (its content, its tool calls and its closing <|im_end|>); the loader
turns mask 0 into target -1, which every loss ignores.

Encoding text between special tokens as one piece gives the same ids as `transformers` rendering the
template and tokenizing the whole string (the tokenizer splits on special tokens first), which the tests
check. Unlike a template rendered to a string, special-token text inside a message stays text here.
"""

from __future__ import annotations

import json
import re
from typing import Any

from . import CodeforgeError
from .corpus import (MAX_LINE_CHARS, UnusableInput, bounded_lines, check_sources, leaves_tree,
                     long_line_detail, open_text, walk_tree)

ROLES = ("system", "user", "assistant", "tool")
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESP_OPEN, RESP_CLOSE = "<tool_response>", "</tool_response>"
SPECIAL = (IM_START, IM_END, CALL_OPEN, CALL_CLOSE, RESP_OPEN, RESP_CLOSE)
TOOLS_INTRO = ("\n\n# Tools\n\nYou can call these tools (JSON schemas, one per line):\n")
# No special-token text in here: it would be text to codeforge's encoder but a special token to a template
# rendered by transformers, and the ids would differ.
TOOLS_OUTRO = ("\nTo call a tool, write a tool call block holding {\"name\": <tool name>, \"arguments\": "
               "<JSON object>}; the result comes back in a tool turn.")


class ChatFormatError(CodeforgeError):
    """A conversation that cannot be rendered; `reason` is the short name it is counted under."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


# -- validation ------------------------------------------------------------------------------------------

def _call_parts(call: Any) -> tuple[str, str]:
    """(name, arguments JSON text) of a tool call given as {"function": {"name", "arguments"}} (OpenAI) or
    {"name", "arguments"}; arguments may be an object or a JSON string of one."""
    f = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
        raise ChatFormatError("bad_tool_call", f"a tool call needs a function name, got {str(call)[:80]!r}")
    args = f.get("arguments", {})
    if isinstance(args, str):
        try:
            parsed = json.loads(args)
        except json.JSONDecodeError as e:
            raise ChatFormatError("tool_call_not_json",
                                  f"arguments of {f['name']!r} are not JSON ({e})") from None
        if not isinstance(parsed, dict):
            raise ChatFormatError("tool_call_not_json", f"arguments of {f['name']!r} are not a JSON object")
        return f["name"], args
    if not isinstance(args, dict):
        raise ChatFormatError("tool_call_not_json", f"arguments of {f['name']!r} are not a JSON object")
    return f["name"], json.dumps(args, ensure_ascii=False)


def validate(obj: Any) -> tuple[list[dict], list[dict]]:
    """(messages, tools) of one conversation, or ChatFormatError naming what is wrong."""
    if not isinstance(obj, dict) or not isinstance(obj.get("messages"), list) or not obj["messages"]:
        raise ChatFormatError("no_messages", "expected an object with a non-empty \"messages\" list")
    tools = obj.get("tools")
    tools = [] if tools is None else tools
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise ChatFormatError("tool_schema_not_object", "\"tools\" must be a list of JSON schema objects")
    has_assistant = False
    for i, m in enumerate(obj["messages"]):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            role = m.get("role") if isinstance(m, dict) else m
            raise ChatFormatError("unknown_role", f"message {i} has role {role!r}; expected one of {ROLES}")
        content = m.get("content")
        if content is not None and not isinstance(content, str):
            raise ChatFormatError("content_not_string",
                                  f"message {i} content is {type(content).__name__}, not text")
        if m["role"] == "assistant":
            has_assistant = True
            for c in m.get("tool_calls") or []:
                _call_parts(c)
        elif m.get("tool_calls"):
            raise ChatFormatError("bad_tool_call",
                                  f"message {i} ({m['role']}) has tool_calls; only assistants call")
    if not has_assistant:
        raise ChatFormatError("no_assistant", "no assistant turn: nothing to learn from")
    return obj["messages"], tools


# -- rendering -------------------------------------------------------------------------------------------

def render(messages: list[dict], tools: list[dict] | None = None,
           add_generation_prompt: bool = False) -> list[tuple[str, str]]:
    """The conversation as pieces (text, kind): kind "special" (a special token, no loss), "special_loss"
    (a special token an assistant writes), "text" (no loss) or "loss" (assistant-written text)."""
    out: list[tuple[str, str]] = []
    msgs = list(messages)
    system = msgs.pop(0)["content"] or "" if msgs and msgs[0]["role"] == "system" else None
    if tools or system is not None:
        text = system or ""
        if tools:
            text += TOOLS_INTRO + "".join(json.dumps(t, ensure_ascii=False) + "\n"
                                          for t in tools) + TOOLS_OUTRO
        out += [(IM_START, "special"), ("system\n" + text, "text"), (IM_END, "special"), ("\n", "text")]
    for m in msgs:
        role, content = m["role"], m.get("content") or ""
        out.append((IM_START, "special"))
        if role == "assistant":
            out += [("assistant\n", "text"), (content, "loss")]
            for j, c in enumerate(m.get("tool_calls") or []):
                name, args = _call_parts(c)
                if content or j:
                    out.append(("\n", "loss"))
                out += [(CALL_OPEN, "special_loss"), (f'{{"name": {json.dumps(name, ensure_ascii=False)}, '
                                                      f'"arguments": {args}}}', "loss"),
                        (CALL_CLOSE, "special_loss")]
            out += [(IM_END, "special_loss"), ("\n", "text")]
        elif role == "tool":
            out += [("tool\n", "text"), (RESP_OPEN, "special"), ("\n" + content + "\n", "text"),
                    (RESP_CLOSE, "special"), (IM_END, "special"), ("\n", "text")]
        else:
            out += [(f"{role}\n{content}", "text"), (IM_END, "special"), ("\n", "text")]
    if add_generation_prompt:
        out += [(IM_START, "special"), ("assistant\n", "text")]
    return [(t, k) for t, k in out if t]


def render_text(messages: list[dict], tools: list[dict] | None = None,
                add_generation_prompt: bool = False) -> str:
    return "".join(t for t, _ in render(messages, tools, add_generation_prompt))


def encode_conversation(tok, messages: list[dict], tools: list[dict] | None = None,
                        add_generation_prompt: bool = False) -> tuple[list[int], list[int]]:
    """(ids, mask): mask[i] = 1 where token i is written by an assistant (it carries loss as a target).
    Text between special tokens is encoded as one piece with character offsets; a token carries loss when
    it overlaps assistant-written characters."""
    ids: list[int] = []
    mask: list[int] = []
    run: list[tuple[str, str]] = []

    def flush() -> None:
        if not run:
            return
        text = "".join(t for t, _ in run)
        loss_chars = bytearray(len(text))
        at = 0
        for t, k in run:
            if k == "loss":
                loss_chars[at:at + len(t)] = b"\x01" * len(t)
            at += len(t)
        for i, (s, e) in zip(*tok.encode_with_offsets(text)):  # a tokenizer failure: TokenizerError
            ids.append(i)
            mask.append(1 if any(loss_chars[s:max(e, s + 1)]) else 0)
        run.clear()

    for text, kind in render(messages, tools, add_generation_prompt):
        if kind.startswith("special"):
            flush()
            ids.append(tok.special_ids[text])
            mask.append(1 if kind == "special_loss" else 0)
        else:
            run.append((text, kind))
    flush()
    return ids, mask


# The same rendering for `transformers`' apply_chat_template (tested for byte-identical text and ids), built
# from the same tag constants as render() and parse_assistant(), so the three cannot drift apart. No literal
# whitespace outside the tags, so Jinja's trim settings cannot change it.
CHAT_TEMPLATE = (
    "{%- set msgs = messages -%}"
    "{%- set ns = namespace(start=0) -%}"
    "{%- if msgs and msgs[0].role == 'system' -%}{%- set system = msgs[0].content or '' -%}{%- set ns.start "
    "= 1 -%}{%- else -%}{%- set system = none -%}{%- endif -%}"
    "{%- if tools or system is not none -%}"
    "{{- '" + IM_START + "system\\n' -}}{{- system or '' -}}"
    "{%- if tools -%}{{- " + json.dumps(TOOLS_INTRO) + " -}}"
    "{%- for t in tools -%}{{- t | tojson -}}{{- '\\n' -}}{%- endfor -%}"
    "{{- " + json.dumps(TOOLS_OUTRO) + " -}}{%- endif -%}"
    "{{- '" + IM_END + "\\n' -}}"
    "{%- endif -%}"
    "{%- for m in msgs[ns.start:] -%}"
    "{%- if m.role == 'assistant' -%}"
    "{{- '" + IM_START + "assistant\\n' -}}{{- m.content or '' -}}"
    "{%- for c in (m.tool_calls or []) -%}"
    "{%- set f = c.function if c.function is defined else c -%}"
    "{%- if m.content or not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '" + CALL_OPEN + "{\"name\": ' -}}{{- f.name | tojson -}}{{- ', \"arguments\": ' -}}"
    "{%- if f.arguments is string -%}{{- f.arguments -}}{%- else -%}{{- (f.arguments or {}) | tojson -}}{%- "
    "endif -%}{{- '}" + CALL_CLOSE + "' -}}"
    "{%- endfor -%}"
    "{{- '" + IM_END + "\\n' -}}"
    "{%- elif m.role == 'tool' -%}"
    "{{- '" + IM_START + "tool\\n" + RESP_OPEN + "\\n' -}}{{- m.content or '' -}}{{- '\\n" + RESP_CLOSE + ""
    + IM_END + "\\n' -}}" "{%- else -%}"
    "{{- '" + IM_START + "' + m.role + '\\n' -}}{{- m.content or '' -}}{{- '" + IM_END + "\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '" + IM_START + "assistant\\n' -}}{%- endif -%}"
)


# -- parsing generated text ------------------------------------------------------------------------------

_BLOCK = re.compile(re.escape(CALL_OPEN) + r"(.*?)(?:" + re.escape(CALL_CLOSE) + r"|$)", re.S)


def parse_assistant(text: str) -> dict:
    """An assistant's generated text -> {"content", "tool_calls": [{"name", "arguments": dict}], "errors"}.
    Tolerant of partial output: text after <|im_end|> is dropped, an unterminated last <tool_call> block is
    accepted when its JSON is complete, and a block that does not parse is reported in `errors` (never
    raised), with the content outside the blocks kept."""
    text = text.split(IM_END, 1)[0]
    calls, errors = [], []
    for m in _BLOCK.finditer(text):
        body = m.group(1).strip()
        closed = m.group(0).endswith(CALL_CLOSE)
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            errors.append(f"{'unterminated' if not closed else 'not JSON'}: {body[:60]!r} ({e.msg})")
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            errors.append(f"no tool name: {body[:60]!r}")
            continue
        args = obj.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        if not isinstance(args, dict):
            errors.append(f"arguments of {obj['name']!r} are not a JSON object")
            continue
        calls.append({"name": obj["name"], "arguments": args})
    content = _BLOCK.sub("", text).strip()
    return {"content": content, "tool_calls": calls, "errors": errors}


# -- reading chat JSONL ----------------------------------------------------------------------------------

def read_conversations(paths: list[str], stats, strict: bool = False, max_line_chars: int = MAX_LINE_CHARS):
    """Yield (messages, tools, where) from JSONL files (.jsonl, .gz, .zst; also a directory of them). A
    line that is not JSON or not a valid conversation is skipped and counted in `stats` under its reason
    (bad_json, no_messages, unknown_role, no_assistant, tool_call_not_json, tool_schema_not_object, ...)
    with file and line, or refused under strict. A line longer than `max_line_chars` is counted as
    oversized_record without being held whole (corpus.bounded_lines); in a directory, a symlink to a file
    outside it is counted as symlink_outside and never read."""
    import os

    check_sources(paths)
    files: list[tuple[str, str | None]] = []  # (path, real path of the directory walked to find it)
    for p in paths:
        if os.path.isdir(p):
            tree = os.path.realpath(p)
            for d, dirnames, names in walk_tree(p):  # any depth (os.walk recurses)
                dirnames.sort()
                files += [(os.path.join(d, n), tree) for n in sorted(names)
                          if n.endswith((".jsonl", ".jsonl.gz", ".jsonl.zst"))]
        else:
            files.append((p, None))
    for path, tree in files:
        if tree is not None and (real := leaves_tree(path, tree)):
            stats.skip("symlink_outside", path, False, f"a symlink to {real}, outside {tree}: not read; "
                       "name the target as an input to read it")
            continue
        try:
            with open_text(path) as f:
                for lineno, line in bounded_lines(f, max_line_chars):
                    where = f"{path}:{lineno}"
                    if line is None:
                        stats.skip("oversized_record", where, strict, long_line_detail(
                            max_line_chars,
                            "raise --max-file-bytes (the limit is 12 times it) to read longer ones"))
                        continue
                    if not line.strip():
                        continue
                    try:
                        obj = json.loads(line)
                    except json.JSONDecodeError as e:
                        stats.skip("bad_json", where, strict, str(e))
                        continue
                    try:
                        messages, tools = validate(obj)
                    except ChatFormatError as e:
                        stats.skip(e.reason, where, strict, str(e))
                        continue
                    yield messages, tools, where
        except UnicodeDecodeError:
            stats.skip("non_utf8", path, strict)
        except UnusableInput as e:  # a FIFO, a device, a damaged .gz: counted; lines read before damage kept
            stats.skip(e.reason, e.path, strict, e.detail)
