"""Grammar-constrained decoding: tool calls that always parse and match their tool's schema, and JSON replies.

The grammar engine is llguidance (an Earley parser over a lexer that works on token bytes, the engine behind
OpenAI's and llama.cpp's structured outputs): it turns a grammar plus the tokenizer into, at each step, the
set of token ids that keep the text a prefix of something the grammar accepts. This module only writes the
grammars, in llguidance's Lark dialect, and keeps one matcher per generated row.

What a row may write, by mode (chat.py's format; <x> are special tokens, written as `<[id]>` in the grammar):

  auto      free text; once the row samples <tool_call>, exactly
            `{"name": <one of the tools>, "arguments": <that tool's parameters>}` then </tool_call>; free
            again after it (free steps are not masked at all: `allowed()` is None and they cost nothing).
  required  `<tool_call>BODY</tool_call>` ("\\n<tool_call>BODY</tool_call>")* then <|im_end|>;
  NAME      the same with only the tool NAME (OpenAI's named tool_choice);
  none      free text with neither <tool_call> nor </tool_call> (auto without tools: free text, no mask);
  response_format json_object / json_schema: the whole reply is one JSON value of the schema, then <|im_end|>
            (with tools in auto mode: that, or tool calls as in required mode).

The JSON is laid out as `json.dumps` writes it by default, as the training data is (chat.py renders arguments
with json.dumps(..., ensure_ascii=False)): separators ", " and ": ", no other whitespace, strings escape only
`"`, `\\` and \\b \\f \\n \\r \\t (no \\u, no \\/; non-ASCII text is written as itself). The wrapper
`{"name": ..., "arguments": ` is a literal of the grammar rather than part of a JSON schema, so a tool's
parameters schema stays the root of its own `%json` block and its `$ref`s resolve as written. Property order
follows the schema's "properties" order (json.dumps keeps the order the data was written in).

Extra keys: an object that lists "properties" takes only those keys (and those it requires) unless its
"additionalProperties" says otherwise, in tool arguments and JSON replies alike, at every depth, as
llama.cpp's JSON-schema converter reads a schema (json_schema.py closes each schema before it is compiled).
An object without "properties" (`{"type": "object"}`, json_object) is any object.

Cost: the tokenizer bridge (llguidance's token trie, ~50 ms for 8k tokens) is built once per tokenizer; a
ToolGrammar compiles its grammar once (~10 ms for five tools; the last few are cached by grammar text), and
each Constraint is a copy of the compiled matcher (microseconds). Per constrained step, the masks of all rows
are computed in one call on llguidance's thread pool and applied to the logits in one masked_fill
(benchmarks/constrain_cost.py; docs/LOG.md#2026-11-25-constrain-cost).

Budget: a reply the grammar must complete (required or named tool_choice, a JSON response_format) has to end
within the row's token budget (max_tokens; `Constraint.set_budget`, which the engine and the server call), and
so does every call auto mode opens. Each grammar keeps a way to its end: a token sequence from the matcher's
state that ends the reply (Ways.way: a greedy walk on a copy of the matcher, forced tokens first, then the
tokens that close the current string, number, array or object soonest; inside a string that no allowed token
ends, a key, an enum value or a tool's name to spell, the fewest tokens that end it by a small breadth-first
search, and for the way from the start the end whose whole way is shortest; ~1-3 ms for a tool call). The way
from the start gives `min_tokens`, the fewest tokens a reply takes (the server refuses a smaller max_tokens
with a 400, max_tokens_too_small; auto mode opens no call with fewer than `min_call` tokens left).

The way is kept exact after every token, so the spare (the budget left beyond it) is always that of a real way
to the end, however deep the text has nested: a token on the way shortens it; after any other token the old
way is checked to still hold (a character of a free string), or its rest past a few tokens (a value other than
the way's), or the token's split realigned, else a few greedy steps rejoin it (a bracket opened: its closer,
then the old way), else it is searched again (Ways.after; validate_tokens, and a mask per greedy step). The
spare decides the mask: more than WATCH, the grammar's mask alone; up to WATCH, inside a string (where one
character may pick a longer key, enum value or tool name) and within NEAR spare everywhere, only checked
tokens (the row's TOP likeliest that keep a way that fits what will be left, at most SEARCHES of them found
by a search) and the way's next token; outside a string, only the tokens that may lengthen the way by more
than one (they start a key, an item, a value or a call) need the check; none spare, the way's next token
alone. Beyond WATCH spare one token may still lengthen the way past the spare at once (an optional key whose
value is a large required object): so the samplers (Engine.generate_ids, the server's batcher) check the token
they drew (`fit_tokens`: the check advance needs anyway) and replace one that does not fit by the likeliest
that does. So such a reply always ends complete, `<|im_end|>` included. Cost: a validate_tokens for most
tokens off the way, a few masks for a bracket or a new item, now and then a search: the mask, advance and
fit_tokens together ~0.1-0.3 ms per constrained token with a 96- or 200-token budget on
benchmarks/constrain_cost.py's model (8192 tokens). A caller that masks with mask_logits but samples without
fit_tokens keeps the guarantee within WATCH spare only. Stop sequences do not apply inside a grammar's reply
(the server's batcher: serve/batcher.py, _stops_of).

Known gap: the grammar cannot keep a JSON string from holding the *text* "</tool_call>" written as ordinary
tokens (the special token is never allowed there); chat.parse_assistant, which reads decoded text, would then
cut the call short. A trained model has no reason to write it.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict
from typing import TYPE_CHECKING

import llguidance
import torch

from .chat import CALL_CLOSE, CALL_OPEN, IM_END
from .grammar_ways import LEX_OUT, Ways
from .json_schema import ConstraintError, closed_schema

if TYPE_CHECKING:
    from .tokenizer import CodeTokenizer

MODES = ("auto", "required", "none")
# json.dumps' default layout (see the module docstring); applied over any "x-guidance" a schema carries.
JSON_LAYOUT = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False,
               "json_allowed_escapes": "\"\\bfnrt"}
# compiled grammars kept per tokenizer (tool_calling_eval offers ~30 distinct tool subsets)
GRAMMAR_CACHE = 32
# The token budget (see "Budget" in the module docstring).
WATCH = 64  # spare tokens (budget left beyond the way to the end) below which a row is watched
NEAR = 8  # spare tokens below which a row writes only checked tokens
TOP = 8  # the likeliest tokens checked per watched row and step
SEARCHES = 2  # ... of which at most this many by a search for a new way (the others must keep the way)


# ConstraintError lives in json_schema.py (below this module), which raises it too


# -- the tokenizer bridge (one per tokenizer) ------------------------------------------------------------

class _Bridge:
    """llguidance's view of one CodeTokenizer (its token trie, with <|im_end|> as the end token, so that a
    grammar that is complete allows <|im_end|> and nothing after it), plus compiled grammars by text."""

    def __init__(self, tok: "CodeTokenizer"):
        self.ll = llguidance.LLTokenizer(tok.tok.to_str(), n_vocab=tok.vocab_size,
                                         eos_token=tok.special_ids[IM_END])
        self.vocab = tok.vocab_size
        self.words = (tok.vocab_size + 31) // 32  # int32 words of one row's bitmask
        self.matchers: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self.lock = threading.Lock()  # the server makes grammars from several threads
        # The two fixed masks: any token but <tool_call> and </tool_call> (tool_choice "none"), and only
        # <|im_end|> (a row whose reply is finished, should it be asked for another token).
        no_calls = torch.zeros(self.words * 32, dtype=torch.bool)
        no_calls[:self.vocab] = True
        # (an imported tokenizer may lack them: indexing with None would mask every token)
        self.call_ids = [i for i in (tok.special_ids.get(CALL_OPEN), tok.special_ids.get(CALL_CLOSE))
                         if i is not None]
        no_calls[self.call_ids] = False
        self.no_call_bits = _pack(no_calls)
        self.end_bits = _pack(torch.arange(self.words * 32) == tok.special_ids[IM_END])
        self.tok = tok
        self._ways: Ways | None = None  # made on the first grammar that needs a way to its end
        # a grammar's way from its start to its end
        self.starts: OrderedDict[str, list[int] | None] = OrderedDict()

    def ways(self) -> "Ways":
        with self.lock:
            if self._ways is None:
                self._ways = Ways(self.tok, self.vocab)
            return self._ways

    def start_way(self, lark: str, m: llguidance.LLMatcher, end: bool) -> list[int] | None:
        """A short way from a fresh matcher of this grammar to its end (computed once per grammar text)."""
        with self.lock:
            if lark in self.starts:
                return self.starts[lark]
        way = self.ways().way(m, LEX_OUT, end, best=True)
        with self.lock:
            self.starts[lark] = way
            if len(self.starts) > GRAMMAR_CACHE:
                self.starts.popitem(last=False)
        return way

    def matcher(self, lark: str, what: str) -> llguidance.LLMatcher:
        """A fresh matcher for this grammar text (compiled on first use, then copied)."""
        with self.lock:
            m = self.matchers.get(lark)
            if m is not None:
                self.matchers.move_to_end(lark)
                return m.deep_copy()
        grammar = llguidance.LLMatcher.grammar_from_lark(lark)
        is_error, msgs = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.ll)
        if is_error:
            raise ConstraintError(f"{what}: the grammar does not compile ({msgs[0]})")
        m = llguidance.LLMatcher(self.ll, grammar, log_level=0)
        if m.is_error():
            raise ConstraintError(f"{what}: the grammar does not compile ({m.get_error()})")
        probe = m.deep_copy()  # some limits (item counts, recursive $refs) show only when a mask is computed
        probe.compute_bitmask()
        if probe.is_error():
            raise ConstraintError(f"{what}: the grammar engine cannot decode with this schema "
                                  f"({_first_line(probe.get_error())})")
        with self.lock:
            self.matchers[lark] = m
            if len(self.matchers) > GRAMMAR_CACHE:
                self.matchers.popitem(last=False)
        return m.deep_copy()


def _first_line(msg: str | None, limit: int = 200) -> str:
    """An engine message cut to its first line (its full parser state is internal, and long)."""
    line = (msg or "rejected").strip().splitlines()[0] if (msg or "").strip() else "rejected"
    return line if len(line) <= limit else line[:limit] + "..."


_BRIDGES: "weakref.WeakKeyDictionary[CodeTokenizer, _Bridge]" = weakref.WeakKeyDictionary()
_EXECUTOR: list[llguidance.LLExecutor] = []
_LOCK = threading.Lock()


def _bridge(tok: "CodeTokenizer") -> _Bridge:
    with _LOCK:
        b = _BRIDGES.get(tok)
        if b is None:
            b = _BRIDGES[tok] = _Bridge(tok)
        return b


def _executor() -> llguidance.LLExecutor:
    """llguidance's thread pool that computes many rows' masks at once (made on first use)."""
    with _LOCK:
        if not _EXECUTOR:
            _EXECUTOR.append(llguidance.LLExecutor())
        return _EXECUTOR[0]


# -- grammars ----------------------------------------------------------------------------------------------

def _schema_block(schema: dict, what: str, bridge: _Bridge) -> str:
    """`%json {...}` for a schema with the json.dumps layout, its objects closed (closed_schema); a schema
    llguidance refuses -> ConstraintError naming `what`."""
    if not isinstance(schema, dict):
        raise ConstraintError(f"{what} must be a JSON schema object, got {type(schema).__name__}")
    try:
        schema = closed_schema(schema)
    except RecursionError:
        raise ConstraintError(f"{what} is nested too deeply to be read; fix the schema") from None
    except ConstraintError as e:
        raise ConstraintError(f"{what}: {e}") from None
    own = schema.get("x-guidance")
    schema = {**schema, "x-guidance": {**(own if isinstance(own, dict) else {}), **JSON_LAYOUT}}
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
    except (ValueError, TypeError) as e:
        raise ConstraintError(f"{what} is not a usable JSON schema ({e}); fix the schema") from None
    is_error, msgs = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, bridge.ll)
    if is_error:
        raise ConstraintError(f"{what} cannot be compiled for constrained decoding ({msgs[0]}); fix the "
                              f"schema, or turn constraints off (constrained=False, --no-constrain)")
    return "%json " + json.dumps(schema, ensure_ascii=False)


def open_tools(tools: list[dict] | None) -> list[str]:
    """Names of the tools whose parameters say they take argument keys they do not list (an object schema
    with "properties" and "additionalProperties" true or a schema, at the top): for these the grammar lets a
    model write extra keys. A schema that says nothing of them takes none (closed_schema)."""
    return [name for name, schema in tool_specs(tools)
            if "properties" in schema and schema.get("additionalProperties", False) is not False]


def tool_specs(tools: list[dict] | None) -> list[tuple[str, dict]]:
    """(name, parameters schema) of OpenAI tool specs ({"type": "function", "function": {...}}, or the inner
    object alone); a missing schema allows any object."""
    out: list[tuple[str, dict]] = []
    if tools is None:
        return out
    if not isinstance(tools, list):
        raise ConstraintError(f"tools must be a list of tool specs, got {type(tools).__name__}")
    for i, t in enumerate(tools):
        f = t.get("function", t) if isinstance(t, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
            raise ConstraintError(f"tools[{i}] has no function name: expected {{\"type\": \"function\", "
                                  f"\"function\": {{\"name\": ..., \"parameters\": {{...}}}}}}")
        params = f.get("parameters")
        if params is None:
            params = {"type": "object"}
        if not isinstance(params, dict):
            raise ConstraintError(f"tool {f['name']!r}: parameters must be a JSON schema object, got "
                                  f"{type(params).__name__}")
        if any(n == f["name"] for n, _ in out):
            raise ConstraintError(f"tool {f['name']!r} is given twice: tool names must be unique")
        out.append((f["name"], params))
    return out


def _lark_str(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


def calls_kept_out(tok: "CodeTokenizer", tools: list[dict] | None, response_format: dict | None) -> bool:
    """Whether a free-text reply offered no tools must have the call tokens kept out (tool_choice "none"'s
    mask): no tools means no tool call (OpenAI's behaviour), though a tools-trained model would open one. Not
    for a JSON reply (its grammar has no call in it) or a tokenizer without the call tokens (an imported one
    cannot write a call)."""
    return not tools and response_format is None and tok.special_ids.get(CALL_OPEN) is not None


class ToolGrammar:
    """The grammar of one request's replies (its tools, tool_choice and response_format), compiled once;
    `new()` makes a Constraint per generated row. The tokenizer bridge is cached per tokenizer.

    mode: "auto", "required", "none", or a tool's name (OpenAI's {"type": "function", "function": {"name":
    ...}} is taken too). response_format: None, {"type": "text"}, {"type": "json_object"} or {"type":
    "json_schema", "json_schema": {"schema": {...}, ...}}."""

    def __init__(self, tok: "CodeTokenizer", tools: list[dict] | None = None, mode: str = "auto",
                 response_format: dict | None = None, parallel: bool = True):
        self.tok = tok
        self.parallel = parallel  # False (OpenAI's parallel_tool_calls false): at most one call per reply
        self.bridge = _bridge(tok)
        ids = tok.special_ids
        self.open_id, self.close_id, self.end_id = ids[CALL_OPEN], ids[CALL_CLOSE], ids[IM_END]
        if isinstance(mode, dict):  # OpenAI's named tool_choice object
            mode = (
                (mode.get("function") or {}).get("name") if isinstance(mode.get("function"), dict) else None
            )
            if not isinstance(mode, str):
                raise ConstraintError(
                    'tool_choice object must be {"type": "function", "function": {"name": ...}}')
        if not isinstance(mode, str) or not mode:
            raise ConstraintError(f'tool_choice {mode!r} must be "auto", "required", "none" or a tool name')
        specs = tool_specs(tools)
        if mode not in MODES:
            specs = [s for s in specs if s[0] == mode]
            if not specs:
                names = [n for n, _ in tool_specs(tools)]
                raise ConstraintError(f"tool_choice names tool {mode!r}, which is not among the tools "
                                      f"{names}: offer it in tools or choose \"auto\"")
        elif mode == "required" and not specs:
            raise ConstraintError("tool_choice \"required\" needs at least one tool in tools")
        self.mode = mode
        self.tools = [n for n, _ in specs]
        reply = self._reply_block(response_format)
        if mode == "none" or not specs:
            specs = []
        lines = []
        for i, (n, p) in enumerate(specs):  # chat.render's layout: {"name": NAME, "arguments": ARGS}
            head = _lark_str('{"name": ' + _lark_str(n) + ', "arguments": ')
            lines.append(f'call_{i}: {head} args_{i} "}}"\nargs_{i}: '
                         f'{_schema_block(p, f"tool {n!r}: parameters", self.bridge)}')
        body = "body: " + " | ".join(f"call_{i}" for i in range(len(specs))) + "\n" + "\n".join(lines) + "\n"
        calls = ('calls: call ("\\n" call)*\n' if parallel else "calls: call\n") + \
            f'call: <[{self.open_id}]> body <[{self.close_id}]>\n' + body
        # kind: "whole" (a matcher over the whole reply, which ends with <|im_end|>, the bridge's end token),
        # "text" (free text; a matcher for each call's body), "static" (free text without the call tokens: one
        # fixed mask), "free" (nothing to hold the row to).
        if reply is not None and mode == "auto" and specs:
            self.kind, lark = "whole", f"start: calls | reply\nreply: {reply}\n{calls}"
        elif reply is not None and mode in ("auto", "none"):
            self.kind, lark = "whole", f"start: reply\nreply: {reply}\n"
        # required or named: the reply is calls (a response_format is moot)
        elif mode not in ("auto", "none"):
            self.kind, lark = "whole", "start: calls\n" + calls
        elif specs:  # auto
            self.kind, lark = "text", f"start: body <[{self.close_id}]>\n" + body
        elif mode == "none":  # anything but a call
            self.kind, lark = "static", None
        else:  # auto without tools or a JSON reply: nothing to hold the model to
            self.kind, lark = "free", None
        what = f"tool_choice {mode!r}" + (f" with response_format {response_format.get('type')!r}" if reply
                                          else "")
        self._template = self.bridge.matcher(lark, what) if lark is not None else None
        self.lark = lark
        # The budget: a way from the start to the end ("whole": the reply, <|im_end|> included; "text": one
        # call's body and </tool_call>); None where the search finds none (no reserve is kept then).
        self.start_way = self.bridge.start_way(lark, self._template, self.kind == "whole") \
            if lark is not None else None
        # min_tokens: the fewest tokens a reply can have (a budget below it cannot end the reply: the server
        # refuses it); min_call: the fewest tokens a call takes, <tool_call> included (auto mode: below it no
        # call is opened).
        self.min_tokens = len(self.start_way) if self.kind == "whole" and self.start_way is not None else None
        self.min_call = (
            1 + len(self.start_way) if self.kind == "text" and self.start_way is not None else None
        )

    def describe(self) -> str:
        """What a complete reply of this grammar is, for messages."""
        if self.mode == "required":
            return 'tool_choice "required" (a complete tool call)'
        if self.mode not in MODES:
            return f"tool_choice {self.mode!r} (a complete call of that tool)"
        if self.mode == "auto" and self.tools:
            return ("response_format with tools (one complete JSON value of the schema, "
                    "or a complete tool call)")
        return "response_format (one complete JSON value of the schema)"

    def _reply_block(self, rf: dict | None) -> str | None:
        if rf is None:
            return None
        if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
            raise ConstraintError(f"response_format {rf!r} must be {{\"type\": \"text\" | \"json_object\" | "
                                  f"\"json_schema\", ...}}")
        if rf["type"] == "text":
            return None
        if rf["type"] == "json_object":
            return _schema_block({"type": "object"}, "response_format", self.bridge)
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise ConstraintError('response_format json_schema needs '
                                  '"json_schema": {"name": ..., "schema": {...}}')
        schema = js.get("schema", {"type": "object"})
        name = f" {js['name']!r}" if js.get("name") else ""
        return _schema_block(schema, f"response_format json_schema{name}", self.bridge)

    def new(self) -> "Constraint":
        return Constraint(self)


class Constraint:
    """Per-row decoding constraint (see the module docstring for the modes). `allowed()` is the set of
    tokens the row may write next (None when this step is free), `advance(token)` feeds the token it wrote,
    `finished` says the reply is complete (<|im_end|> was written where the grammar allows it).

    With a budget (`set_budget(n)`: the row writes at most n tokens, <|im_end|> included; the engine and the
    server set it), the row keeps a way to the end in reserve: see "Budget" in the module docstring."""

    def __init__(self, grammar: ToolGrammar):
        self.grammar = grammar
        self.matcher = grammar._template.deep_copy() if grammar._template is not None else None
        self.in_call = False  # "text" kind: inside a <tool_call> block
        self.calls = 0  # "text" kind: calls closed so far
        self._finished = False
        self.budget: int | None = None  # tokens this row may write in all; None: no reserve is kept
        self.written = 0  # tokens fed so far
        # A way to the end from the matcher's state, _way[_at:] (always one that holds); None: none known
        self._way = list(grammar.start_way) if grammar.start_way is not None else None
        self._at = 0
        self._dropped = False  # the way was let go while there was no budget (set_budget finds a new one)
        # this step: token -> the way after it (None: none found)
        self._checked: dict[int, list[int] | None] = {}
        self._lex = LEX_OUT  # the JSON lexical state of the matcher's text (for finding ways)

    @property
    def finished(self) -> bool:
        return self._finished

    def set_budget(self, n: int | None) -> None:
        """The row writes at most n more tokens in all (<|im_end|> included); None keeps no reserve."""
        self.budget = None if n is None else self.written + n
        g = self.grammar
        if n is not None and self._dropped and (g.kind == "whole" or self.in_call) and not self._finished:
            self._dropped = False
            self._way, self._at = g.bridge.ways().way(self.matcher, self._lex, g.kind == "whole"), 0

    def _step(self) -> str | None:
        """What constrains the next token: None (free), "matcher", "static" (no call tokens) or "end"."""
        if self._finished:
            return "end"
        kind = self.grammar.kind
        if kind == "static":
            return "static"
        if kind == "text" and not self.in_call:
            if self.calls and not self.grammar.parallel:
                return "static"  # one call made, and only one allowed: no more call tokens
            if self.budget is not None and self.grammar.min_call is not None and \
                    self.budget - self.written < self.grammar.min_call:
                return "static"  # no room left to finish a call: none is opened
        if kind == "free" or (kind == "text" and not self.in_call):
            return None
        if self.matcher.is_error():
            raise ConstraintError("the constraint is broken by an earlier token "
                                  f"({self.matcher.get_error()})")
        return "matcher"

    def _reserve(self) -> tuple[int, list[int]] | None:
        """For a matcher step under a budget: (spare, way) when the row is watched (spare budget, beyond the
        way to the end, at most WATCH); None when the step is the grammar's alone (no budget, plenty left,
        or no way known)."""
        if self.budget is None or self._way is None:
            return None
        left = self.budget - self.written
        spare = left - (len(self._way) - self._at)
        return (spare, self._way[self._at:]) if left > 0 and spare <= WATCH else None

    def _after(self, token: int, search: bool) -> list[int] | None:
        """The way to the end after writing `token` next (off the way): see Ways.after. Remembered for this
        step (advance uses it); a cheap check that finds none is not (a search may still find one)."""
        if token in self._checked:
            return self._checked[token]
        g = self.grammar
        m = self.matcher.deep_copy()
        new = None
        if m.consume_token(token):
            ways = g.bridge.ways()
            new = ways.after(m, ways.scan(self._lex, token), token, self._way[self._at:], g.kind == "whole",
                             search)
        if new is not None or search:
            self._checked[token] = new
        return new

    def _check(self, token: int, search: bool) -> bool:
        """Whether the row may write `token` and still end within its budget: a way from after it (the way
        kept, or with `search` a new one) fits what will be left."""
        if self._at < len(self._way) and self._way[self._at] == token:
            return True
        new = self._after(token, search)
        return new is not None and len(new) <= self.budget - self.written - 1

    def fits(self, token: int) -> bool:
        """Whether the row may write `token` (which its grammar allows) and still end within its budget;
        True where no reserve is kept (no budget, a free step, no way known). The samplers ask it of the token
        they drew (`fit_tokens`): beyond WATCH spare the mask checks nothing, and one token may lengthen the
        way a lot (an optional key whose value is a large required structure)."""
        if self.budget is None or self._way is None or self.budget - self.written <= 0 or \
                self._step() != "matcher":
            return True
        return self._check(token, search=True)

    def allowed(self) -> torch.Tensor | None:
        """(vocab_size,) bool on the CPU: True where a token may come next; None when this step is free."""
        step = self._step()
        if step is None:
            return None
        bits = torch.empty(1, self.grammar.bridge.words, dtype=torch.int32)
        near = _fill([self], [step], bits)
        out = _unpack(bits)[0, :self.grammar.bridge.vocab]
        # the checks of _narrow, over every allowed token (no search: no logits)
        for _, c, way, spare in near:
            ways = c.grammar.bridge.ways()
            strict = spare <= NEAR or c._lex != LEX_OUT
            check = out.clone() if strict else out & torch.from_numpy(ways.structural[:out.size(0)])
            out = out & ~check
            out[way[0]] = True
            for t in check.nonzero().flatten().tolist():
                out[t] = c._check(t, search=False)
            c._checked = {}
        return out

    def _shown(self, token: int) -> str:
        in_vocab = 0 <= token < self.grammar.bridge.vocab
        return repr(self.grammar.tok.decode([token])) if in_vocab else "beyond the vocabulary"

    def advance(self, token: int) -> None:
        """Feed the token the row wrote; ConstraintError if the grammar did not allow it."""
        g = self.grammar
        step = self._step()
        if step == "end":
            raise ConstraintError(f"token {token} after the reply ended with {IM_END}")
        if step is None:  # free text in auto mode
            self.written += 1
            if token == g.open_id and g.kind == "text":
                self.in_call = True
                self.matcher.reset()
                self._way = list(g.start_way) if g.start_way is not None else None
                self._at, self._lex, self._dropped = 0, LEX_OUT, False
            elif token == g.end_id:
                self._finished = True
            return
        if step == "static":
            if token in (g.open_id, g.close_id) or not 0 <= token < g.bridge.vocab:
                why = "allows no tool call" if g.kind == "static" or (self.calls and not g.parallel) else \
                    "leaves no room for a whole call in the token budget"
                raise ConstraintError(f"token {token} ({self._shown(token)}) is not allowed: tool_choice "
                                      f"{g.mode!r} {why}")
            self.written += 1
            self._finished = token == g.end_id
            return
        if not 0 <= token < g.bridge.vocab or not self.matcher.consume_token(token):
            raise ConstraintError(f"token {token} ({self._shown(token)}) is not allowed by the grammar here "
                                  f"({self.matcher.get_error() or 'rejected'}); "
                                  "mask the logits with mask_logits")
        self.written += 1
        checked, self._checked = self._checked, {}
        ways = g.bridge.ways()
        self._lex = ways.scan(self._lex, token)
        if self._way is not None:
            if self._at < len(self._way) and self._way[self._at] == token:
                self._at += 1  # on the way: it still holds
            elif token in checked:
                self._way, self._at = checked[token], 0
            elif self.budget is None:  # no reserve to keep: the way is found again if a budget comes
                self._way, self._dropped = None, True
            else:  # kept exact after every token: a stale way would hide how far the text has gone
                self._way = ways.after(self.matcher, self._lex, token, self._way[self._at:],
                                       g.kind == "whole", True)
                self._at = 0
        if g.kind == "text":
            self.in_call = token != g.close_id
            self.calls += not self.in_call
        elif token == g.end_id:
            self._finished = True


# -- masks -------------------------------------------------------------------------------------------------

_SHIFTS: dict[torch.device, torch.Tensor] = {}


def _pack(allowed: torch.Tensor) -> torch.Tensor:
    """(32 * W,) bool -> (W,) int32 bitmask, bit j of word w is token 32 * w + j (llguidance's layout)."""
    words = (allowed.view(-1, 32).to(torch.int64) << torch.arange(32)).sum(-1)  # 0 .. 2**32 - 1
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # the same bits, as int32


def _unpack(bits: torch.Tensor) -> torch.Tensor:
    """(n, W) int32 bitmask -> (n, 32 * W) bool, on the bitmask's device."""
    shifts = _SHIFTS.get(bits.device)
    if shifts is None:
        shifts = _SHIFTS[bits.device] = torch.arange(32, dtype=torch.int32, device=bits.device)
    return ((bits.unsqueeze(-1) >> shifts) & 1).bool().view(bits.size(0), -1)  # (n, W, 32) -> (n, 32 W)


def _fill(constraints: list[Constraint], steps: list[str], bits: torch.Tensor) -> list[tuple]:
    """Write row j of `bits` (CPU, int32, contiguous) for constraints[j]: matcher rows in one parallel call.
    A row with no spare budget gets its way's next token alone; returns the watched rows, (j, constraint,
    way, spare), whose masks are the grammar's and still to be narrowed (`_narrow`)."""
    work, near = [], []
    for j, (c, step) in enumerate(zip(constraints, steps)):
        if step == "matcher":
            reserve = c._reserve()
            if reserve is not None and reserve[0] <= 0:  # the budget left is the way to the end: take it
                bits[j] = 0
                t = reserve[1][0]
                bits[j, t // 32] = (1 << (t % 32)) - (1 << 32 if t % 32 == 31 else 0)
                continue
            if reserve is not None:
                near.append((j, c, reserve[1], reserve[0]))
            work.append((c.matcher, j))
        else:
            bits[j] = c.grammar.bridge.no_call_bits if step == "static" else c.grammar.bridge.end_bits
    if work:
        words = bits.size(1)
        if any(c.grammar.bridge.words != words for c in constraints):
            raise ConstraintError("constraints of one batch must share one tokenizer")
        _executor().unsafe_compute_mask_ptr(work, bits.data_ptr(), words * 4, bits.size(0))
    return near


def _narrow(out: torch.Tensor, rows: list[int], near: list[tuple]) -> torch.Tensor:
    """The watched rows of the masked logits `out` (in place; `out` is a fresh tensor): inside a string, or
    within NEAR spare tokens, a row keeps only the tokens it was checked to be able to write and still end in
    its budget (its TOP likeliest that pass, and the way's next token); outside a string with more spare,
    only the tokens that may lengthen the way by more than one (structural ones) need the check. Row by row,
    with plain views: they are few."""
    k = min(TOP, out.size(1))
    for j, c, way, spare in near:
        row = out[rows[j]]
        top = row.topk(k)
        ways = c.grammar.bridge.ways()
        strict = spare <= NEAR or c._lex != LEX_OUT
        marks = ways.structural
        searches = SEARCHES
        ok = [way[0]]
        for t, v in zip(top.indices.tolist(), top.values.tolist()):
            if v == float("-inf") or t == way[0] or (not strict and not (t < marks.size and marks[t])):
                continue
            fits = c._check(t, search=False)
            if not fits and searches > 0:
                searches -= 1
                fits = c._check(t, search=True)
            if fits:
                ok.append(t)
        at = torch.tensor(ok, device=out.device)
        kept = row[at]
        if strict:
            row.fill_(float("-inf"))
        else:
            structural = ways.structural_on(out.device)
            n = min(row.size(0), structural.size(0))
            row[:n].masked_fill_(structural[:n], float("-inf"))
        row[at] = kept
    return out


def fit_tokens(constraints: list[Constraint | None], logits: torch.Tensor,
               tokens: list[int | None]) -> list[int | None]:
    """The tokens sampled from the masked `logits` (one per row; None: a row that wrote none), each checked
    with its constraint's `fits`: one that would leave its row too little budget to end (it lengthens the
    way to the end past the spare at once) is replaced by the likeliest of the row's TOP tokens that fits,
    or else by the way's next token. Call it between sampling and `advance` (Engine.generate_ids and the
    server's batcher do); the checks it makes are the ones advance needs, so it costs little more."""
    out = list(tokens)
    for i, (c, t) in enumerate(zip(constraints, tokens)):
        if c is None or t is None or c.fits(t):
            continue
        row = logits[i]
        top = row.topk(min(TOP, row.size(0)))
        out[i] = next((u for u, v in zip(top.indices.tolist(), top.values.tolist())
                       if v != float("-inf") and u != t and c.fits(u)), c._way[c._at])
    return out


def mask_logits(constraints: list[Constraint | None], logits: torch.Tensor) -> torch.Tensor:
    """logits (n, V) with V >= the tokenizer's vocab_size (a padded head is fine) -> logits with -inf where a
    row's constraint forbids the token (ids >= vocab_size included); rows whose constraint is None or free
    this step are untouched. All grammar rows' masks are computed in one call and applied in one masked_fill;
    rows that only may not call (tool_choice "none", no tools) get their two call columns set instead of a
    mask over the whole vocabulary. The input is not modified."""
    if len(constraints) != logits.size(0):
        raise ConstraintError(f"{len(constraints)} constraints for {logits.size(0)} rows of logits")
    rows, live, steps = [], [], []
    # "static" rows (no call tokens), by tokenizer: two columns, not a mask
    fixed: dict[_Bridge, list[int]] = {}
    for i, c in enumerate(constraints):
        step = c._step() if c is not None else None
        if step == "static":
            fixed.setdefault(c.grammar.bridge, []).append(i)
        elif step is not None:
            rows.append(i)
            live.append(c)
            steps.append(step)
    out = _masked(logits, rows, live, steps) if rows else logits
    if fixed:
        out = out.clone() if out is logits else out
        for bridge, idx in fixed.items():
            at = slice(None) if len(idx) == out.size(0) else torch.tensor(idx, device=out.device).unsqueeze(1)
            if bridge.call_ids:
                out[at, bridge.call_ids] = float("-inf")
            if out.size(1) > bridge.vocab:
                out[at, bridge.vocab:] = float("-inf")  # a padded head's ids past the vocabulary
    return out


def _masked(logits: torch.Tensor, rows: list[int], live: list[Constraint], steps: list[str]) -> torch.Tensor:
    """logits with -inf where the bitmasks of `rows` (their constraints at `steps`) forbid a token."""
    words = live[0].grammar.bridge.words
    bits = torch.empty(len(rows), words, dtype=torch.int32)
    near = _fill(live, steps, bits)
    V = logits.size(1)
    allowed = _unpack(bits.to(logits.device, non_blocking=True))[:, :V]  # (k, min(V, 32 W))
    if allowed.size(1) < V:  # columns past the bitmask: padded vocab, never allowed
        allowed = torch.cat([allowed, allowed.new_zeros(len(rows), V - allowed.size(1))], 1)
    if len(rows) < logits.size(0):  # free rows allow everything
        full = torch.ones(logits.shape, dtype=torch.bool, device=logits.device)
        full[torch.tensor(rows, device=logits.device)] = allowed
        allowed = full
    out = logits.masked_fill(~allowed, float("-inf"))
    return _narrow(out, rows, near) if near else out
