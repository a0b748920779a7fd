"""Synthetic tool-calling conversations for the "tools" fine-tuning stage, and the scorer for its eval.

Every example is an OpenAI-style chat (`{"messages": [...], "tools": [...]}`) built offline from small
pools written here, deterministic from a `random.Random`. The mix, per example:

- 60% one tool call: user request that names the argument values literally -> assistant `tool_calls`
  (arguments a JSON *string*, as in the OpenAI API) -> tool result -> final answer that uses the result;
- 25% no tool: a Python/Go concept question or small talk answered directly, while tools are offered;
- 15% two user requests, the second of which calls a tool again (the first calls one in 80% of them).

The tool results are plausible, not real (test runs, file snippets, search hits, directory listings), except
`evaluate_expression`, whose result is computed exactly by `evaluate_expression()` (an AST walker over
int + - * // and parentheses, never `eval`). The offered `tools` are a shuffled subset (2..all) that always
contains the tools the conversation calls, so the model must read the schemas rather than memorise a list.

Splits: an example is "heldout" when the blake2b hash of its canonical JSON falls in the first
`heldout_fraction` of the hash space, so train and heldout are disjoint whatever seeds made them, and
duplicates (same hash) are dropped.

`eval_cases` cuts each conversation before every assistant turn that answers a user; `score` compares a
parser's reading of the model's outputs with the expected calls (parse rate, names, exact arguments, and
restraint when no call is due).
"""

from __future__ import annotations

import ast
import copy
import hashlib
import json
import random
from collections import Counter
from pathlib import Path

from .. import CodeforgeError
from ..atomic import publish, staging_dir

SPLITS = ("train", "heldout")
P_NO_TOOL, P_MULTI_TURN = 0.25, 0.15
P_SYSTEM = 0.6  # share of examples with a system message, so the model works with and without one
MAX_DUPLICATE_RUN = 10_000  # this many duplicate candidates in a row means the pools are exhausted


class ToolDataError(CodeforgeError):
    """Bad request for tool-calling data; the message names the value and the fix."""


def _tool(name: str, description: str, properties: dict, required: list[str]) -> dict:
    """A tool whose arguments are exactly the listed ones ("additionalProperties": false), so the grammar
    that constrains a call (constrain.py) lets no other key in."""
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required, "additionalProperties": False}}}


# Compact schemas: one short description per tool and none per parameter. The system turn holds every offered
# schema, and with the longer descriptions this data first had (one per parameter too) five tools took 528
# tokens of the quickstart's tokenizer, ~90% of a conversation's tokens and none of them carrying loss; these
# take 360 (docs/LOG.md#2026-11-25-quickstart-chat-tool-calling).
TOOLS: list[dict] = [
    _tool("run_tests", "Run the tests at a path.", {
        "path": {"type": "string"}, "pattern": {"type": "string"}}, ["path"]),
    _tool("read_file", "Read a file.", {"path": {"type": "string"}}, ["path"]),
    _tool("search_code", "Search the code for text.", {
        "query": {"type": "string"}, "language": {"type": "string", "enum": ["go", "python"]}}, ["query"]),
    _tool("evaluate_expression", "Evaluate integer arithmetic.", {"expression": {"type": "string"}},
          ["expression"]),
    _tool("list_directory", "List a directory.", {"path": {"type": "string"}}, ["path"]),
]
TOOL_BY_NAME = {t["function"]["name"]: t for t in TOOLS}

# ---- safe arithmetic -------------------------------------------------------------------------------------

_BINOPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
           ast.FloorDiv: lambda a, b: a // b}


def evaluate_expression(expression: str) -> int:
    """Value of an int expression over + - * // and parentheses (Python semantics: // floors).

    Walks the parsed AST and accepts only int literals, unary minus and those four operators, so nothing
    else can run. Raises ToolDataError on anything outside that grammar, or on division by zero."""
    if len(expression) > 200:
        raise ToolDataError(f"expression of {len(expression)} characters is too long (at most 200)")
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError as e:
        raise ToolDataError(f"expression {expression!r} does not parse: {e.msg}") from None

    def walk(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -walk(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.FloorDiv) and right == 0:
                raise ToolDataError(f"expression {expression!r} divides by zero")
            return _BINOPS[type(node.op)](left, right)
        raise ToolDataError(f"expression {expression!r} uses {ast.dump(node)[:60]}; only int literals, "
                            "+ - * // and parentheses are allowed")

    return walk(tree.body)


def _expression(rng: random.Random) -> str:
    """A small expression in one of four shapes, e.g. `17 * 23 + 4` or `(96 - 6) // 7`; never divides by 0."""
    while True:
        ops = [rng.choice(["+", "-", "*", "//"]) for _ in range(2)]
        a = rng.randint(2, 99)
        # small factors
        b, c = (rng.randint(2, 12) if op in ("*", "//") else rng.randint(2, 99) for op in ops)
        shape = rng.choice(["{a} {o} {b}", "{a} {o} {b} {p} {c}", "({a} {o} {b}) {p} {c}",
                            "{a} {o} ({b} {p} {c})"])
        expr = shape.format(a=a, b=b, c=c, o=ops[0], p=ops[1])
        try:
            evaluate_expression(expr)
        except ToolDataError:
            continue
        return expr


# ---- pools -----------------------------------------------------------------------------------------------

SYSTEM_PROMPTS = [
    "You are a helpful coding assistant.",
    "You are a coding assistant with access to tools. Call a tool when you need information you do not have.",
    "You help developers with Go and Python code. Use the tools when they help, and answer briefly.",
    "You are CodeForge, a concise programming assistant.",
]
VERBS = {"parse": "parses", "read": "reads", "load": "loads", "encode": "encodes", "decode": "decodes",
         "validate": "validates", "flush": "flushes", "render": "renders", "merge": "merges",
         "split": "splits", "retry": "retries", "build": "builds", "close": "closes", "resolve": "resolves"}
NOUNS = ["header", "config", "token", "request", "cache", "user", "path", "record", "buffer", "query",
         "entry", "session", "batch", "schema"]
GO_DIRS = ["pkg/util", "internal/cache", "cmd/server", "pkg/parser", "internal/auth", "pkg/stats",
           "api/handlers", "pkg/queue", "internal/store", "pkg/codec"]
GO_FILES = ["strings.go", "lru.go", "main.go", "lexer.go", "token.go", "stats.go", "router.go", "queue.go",
            "config.go", "errors.go", "client.go", "encode.go"]
PY_DIRS = ["src", "app", "lib", "tools", "src/codec", "app/api", "scripts", "src/storage"]
PY_FILES = ["parser.py", "models.py", "cache.py", "cli.py", "tokenize.py", "views.py", "config.py",
            "retry.py", "schema.py", "session.py", "io.py", "report.py"]
QA_PAIRS: list[tuple[list[str], str]] = [
    (["What is a list comprehension in Python?", "Explain Python list comprehensions."],
     ("A list comprehension builds a list in one expression, e.g. `[x * x for x in nums if x > 0]`: an "
      "expression, a `for` clause and optional `if` filters.")),
    (["What does `yield` do in Python?", "How do generators work in Python?"],
     ("`yield` turns a function into a generator: each call to `next()` runs it up to the next `yield`, "
      "returns that value and pauses, keeping its local state.")),
    (["What is the difference between a list and a tuple in Python?"],
     ("A list is mutable and a tuple is not. Tuples are hashable when their items are, so they can be dict "
      "keys; use a list for a collection that changes.")),
    (["What does `if __name__ == \"__main__\":` mean?", "Why do Python scripts check `__name__`?"],
     ("`__name__` is `\"__main__\"` only when the file is run directly, so the block under that check runs "
      "as a script but not when the module is imported.")),
    (["What is a decorator in Python?"],
     ("A decorator is a function that takes a function and returns a replacement; `@d` above `def f` means "
      "`f = d(f)`. It is used for logging, caching, registration and the like.")),
    (["What does `//` do in Python?", "Is `//` integer division in Python?"],
     "`//` is floor division: it rounds the quotient down, so `7 // 2` is `3` and `-7 // 2` is `-4`."),
    (["What is a goroutine?", "Explain goroutines in Go."],
     ("A goroutine is a function running concurrently, started with `go f()`. Goroutines are cheap and are "
      "multiplexed by the Go runtime onto OS threads.")),
    (["What does `defer` do in Go?"],
     ("`defer` schedules a call to run when the surrounding function returns, in last-in first-out order; it "
      "is used to close files and unlock mutexes.")),
    (["What is the difference between a slice and an array in Go?"],
     ("An array has a fixed length that is part of its type, like `[4]int`. A slice is a view of an array "
      "with a length and a capacity, and `append` can grow it.")),
    (["How are errors handled in Go?", "Does Go have exceptions?"],
     ("Go has no exceptions for ordinary errors: functions return an `error` as their last result and the "
      "caller checks `if err != nil`. `panic` is for bugs.")),
    (["What is an interface in Go?"],
     ("An interface is a set of method signatures. A type satisfies it implicitly by having those methods; "
      "there is no `implements` keyword.")),
    (["What does `go mod tidy` do?"],
     ("`go mod tidy` adds the modules your code imports to `go.mod` and removes the ones it no longer "
      "needs, updating `go.sum` to match.")),
    (["What is a channel in Go?"],
     ("A channel is a typed pipe between goroutines: `ch <- v` sends and `v := <-ch` receives. An unbuffered "
      "channel makes sender and receiver wait for each other.")),
    (["Hi!", "Hello there.", "Hey, are you there?"],
     "Hello! What can I help you with in your code today?"),
    (["Thanks, that's all for now.", "Thank you!"],
     "You're welcome! Ask any time you need a hand with your code."),
    (["Who are you?", "What can you do?"],
     ("I'm a coding assistant. I can answer questions about Go and Python, and use the tools I'm given to "
      "run tests, read files or search code.")),
]
TURN_PREFIXES = ["", "Thanks. ", "Great. ", "OK, one more thing. ", "Next question. "]


def _ident(rng: random.Random, lang: str) -> tuple[str, str]:
    """(identifier, what it does): `ParseHeader` / `parse_header`, "parses the header"."""
    verb, noun = rng.choice(list(VERBS)), rng.choice(NOUNS)
    name = verb.capitalize() + noun.capitalize() if lang == "go" else f"{verb}_{noun}"
    return name, f"{VERBS[verb]} the {noun}"


def _file(rng: random.Random, lang: str) -> str:
    if lang == "go":
        return f"{rng.choice(GO_DIRS)}/{rng.choice(GO_FILES)}"
    return f"{rng.choice(PY_DIRS)}/{rng.choice(PY_FILES)}"


def _fill(rng: random.Random, templates: list[str], **values: str) -> str:
    return rng.choice(templates).format(**values)


def _names(items: list[str]) -> str:
    """`a`, `a` and `b`, `a`, `b` and `c`."""
    quoted = [f"`{x}`" for x in items]
    return quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " and " + quoted[-1]


# ---- one tool call each: (arguments, user request, tool result, final answer) ------------------------------

def _run_tests(rng: random.Random) -> tuple[dict, str, str, str]:
    lang = rng.choice(["go", "python"])
    secs = f"{rng.randint(1, 900) / 1000:.3f}"
    if lang == "go":
        pkg = rng.choice(GO_DIRS)
        args = {"path": f"./{pkg}" + rng.choice(["", "/..."])}
        test = "Test" + _ident(rng, "go")[0]
    else:
        args = {"path": rng.choice(["tests/", f"tests/test_{rng.choice(PY_FILES)}"])}
        test = "test_" + _ident(rng, "python")[0]
    got, want = rng.sample(range(100), 2)
    if rng.random() < 0.4:
        args["pattern"] = test
        request = _fill(rng, ["Run the tests matching {pattern} in {path}.",
                              "Can you run only {pattern} under {path}?",
                              "Please run {path} with the pattern {pattern}.",
                              "Does {pattern} in {path} pass?"],
                        **args)
    else:
        request = _fill(rng, ["Run the tests in {path}.", "Can you run the test suite at {path}?",
                              "Please run {path} and tell me whether the tests pass.",
                              "Do the tests in {path} pass?", "run tests {path}"], **args)
    passed = rng.random() < 0.55
    if lang == "go":
        if passed:
            result = f"PASS\nok  \t{pkg}\t{secs}s"
            answer = _fill(rng, ["All tests in {path} passed ({secs}s).",
                                 "The tests pass: `{pkg}` is ok in {secs}s."],
                           path=args["path"], pkg=pkg, secs=secs)
        else:
            line = rng.randint(12, 240)
            stem = rng.choice(GO_FILES)[:-3]
            result = (f"--- FAIL: {test} (0.00s)\n    {stem}_test.go:{line}: got {got}, want {want}\nFAIL\n"
                      f"FAIL\t{pkg}\t{secs}s")
            answer = _fill(rng, ["`{test}` failed: at {stem}_test.go:{line} it got {got} but wanted {want}.",
                                 "One failure in `{pkg}`: `{test}` expected {want}, got {got} "
                                 "({stem}_test.go:{line})."],
                           test=test, stem=stem, line=str(line), got=str(got),
                           want=str(want), pkg=pkg)
    else:
        # >= 2: a failure leaves one passing
        n = rng.randint(2, 3) if "pattern" in args else rng.randint(3, 40)
        file = args["path"] if args["path"].endswith(".py") else "tests/test_" + rng.choice(PY_FILES)
        deselected = f", {rng.randint(2, 30)} deselected" if "pattern" in args else ""
        if passed:
            result = f"{n} passed{deselected} in {secs}s"
            answer = _fill(rng, ["All {n} tests passed.", "Everything passes: {n} passed in {secs}s."],
                           n=str(n), secs=secs)
        else:
            result = (f"FAILED {file}::{test} - AssertionError: assert {got} == {want}\n"
                      f"1 failed, {n - 1} passed{deselected} in {secs}s")
            answer = _fill(rng, ["1 test failed and {ok} passed: "
                                 "`{test}` in {file} fails `assert {got} == {want}`.",
                                 "`{test}` fails ({file}): it asserts {got} == {want}. "
                                 "The other {ok} passed."],
                           ok=str(n - 1), test=test, file=file, got=str(got), want=str(want))
    return args, request, result, answer


def _read_file(rng: random.Random) -> tuple[dict, str, str, str]:
    lang = rng.choice(["go", "python"])
    path = _file(rng, lang)
    funcs = [_ident(rng, lang) for _ in range(rng.randint(1, 2))]
    if funcs[-1][0] == funcs[0][0]:
        funcs = funcs[:1]
    if lang == "go":
        pkg = "main" if path.startswith("cmd/") else path.split("/")[-2]
        body = "\n\n".join(f"// {name} {what}.\nfunc {name}(s string) (string, error) {{\n\treturn s, nil\n}}"
                           for name, what in funcs)
        result = f"package {pkg}\n\n{body}\n"
    else:
        body = "\n\n\n".join(f'def {name}(data):\n    """{what.capitalize()}."""\n    return data'
                             for name, what in funcs)
        result = f"{body}\n"
    request = _fill(rng, ["Show me {path}.", "What's in {path}?", "Open {path} and tell me what it defines.",
                          "Read {path} for me.", "Can you read the file {path}?",
                          "What functions does {path} define?"],
                    path=path)
    described = ", and ".join(f"`{name}`, which {what}" for name, what in funcs)
    answer = _fill(rng, ["{path} defines {described}.", "The file has {n} function(s): {names}."],
                   path=path, described=described, n=str(len(funcs)), names=_names([f for f, _ in funcs]))
    return {"path": path}, request, result, answer


def _search_code(rng: random.Random) -> tuple[dict, str, str, str]:
    lang = rng.choice(["go", "python"])
    query = _ident(rng, lang)[0]
    args = {"query": query}
    if rng.random() < 0.4:
        args["language"] = lang
        request = _fill(rng,
                        ["Search the {language} files for {query}.", "Find {query} in the {language} code.",
                              "Where is {query} used? Only look at {language} files."], **args)
    else:
        request = _fill(rng, ["Search the code for {query}.", "Where is {query} used?",
                              "Find all references to {query}.",
                              "grep for {query}", "Which files mention {query}?"], query=query)
    hits = []
    for i in range(rng.choice([0, 1, 2, 2, 3])):
        path, line = _file(rng, lang), rng.randint(3, 400)
        if lang == "go":
            code = f"func {query}(s string) (string, error) {{" if i == 0 else f"\tv, err := {query}(s)"
        else:
            code = f"def {query}(data):" if i == 0 else f"    result = {query}(data)"
        hits.append((path, line, code))
    if not hits:
        result = "No matches found."
        answer = _fill(rng, ["I found no matches for `{query}`.",
                             "`{query}` does not appear anywhere in the code."],
                       query=query)
    else:
        result = "\n".join(f"{p}:{n}: {c}" for p, n, c in hits)
        where = ", ".join(f"{p}:{n}" for p, n, _ in hits)
        answer = _fill(rng, ["`{query}` appears in {n} place(s): {where}. It is defined at {first}.",
                             "It is defined at {first}; {n} match(es) in all: {where}."],
                       query=query, n=str(len(hits)), where=where, first=f"{hits[0][0]}:{hits[0][1]}")
    return args, request, result, answer


def _evaluate(rng: random.Random) -> tuple[dict, str, str, str]:
    expression = _expression(rng)
    value = str(evaluate_expression(expression))
    request = _fill(rng, ["What is {e}?", "Compute {e}.", "Evaluate {e} for me.", "Can you calculate {e}?",
                          "{e} = ?"],
                    e=expression)
    answer = _fill(rng, ["{e} = {v}.", "The result is {v}.", "It comes to {v}."], e=expression, v=value)
    return {"expression": expression}, request, value, answer


def _list_directory(rng: random.Random) -> tuple[dict, str, str, str]:
    lang = rng.choice(["go", "python"])
    path = rng.choice(GO_DIRS if lang == "go" else PY_DIRS + ["tests"])
    files = rng.sample(GO_FILES if lang == "go" else PY_FILES, rng.randint(1, 4))
    if lang == "go":
        files += [f[:-3] + "_test.go" for f in files if rng.random() < 0.5]
    elif rng.random() < 0.5:
        files.append("__init__.py")
    if rng.random() < 0.3:
        files.append("testdata/" if lang == "go" else "fixtures/")
    entries = sorted(set(files))
    request = _fill(rng,
                    ["List the files in {path}.", "What's inside {path}?", "Show me the contents of {path}.",
                          "ls {path}", "Which files are in {path}?"], path=path)
    answer = _fill(rng, ["{path} has {n} entries: {names}.", "In {path} there are {n} entries: {names}."],
                   path=path, n=str(len(entries)), names=_names(entries))
    return {"path": path}, request, "\n".join(entries), answer


CALL_MAKERS = {"run_tests": _run_tests, "read_file": _read_file, "search_code": _search_code,
               "evaluate_expression": _evaluate, "list_directory": _list_directory}
assert set(CALL_MAKERS) == set(TOOL_BY_NAME)


def _tool_turn(rng: random.Random, prefix: str = "") -> tuple[str, list[dict]]:
    """(tool name, [user, assistant call, tool result, assistant answer])."""
    name = rng.choice(list(CALL_MAKERS))
    args, request, result, answer = CALL_MAKERS[name](rng)
    call = {"type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
    return name, [{"role": "user", "content": prefix + request},
                  {"role": "assistant", "content": "", "tool_calls": [call]},
                  {"role": "tool", "content": result},
                  {"role": "assistant", "content": answer}]


def _chat_turn(rng: random.Random) -> list[dict]:
    questions, answer = rng.choice(QA_PAIRS)
    return [{"role": "user", "content": rng.choice(questions)}, {"role": "assistant", "content": answer}]


def make_example(rng: random.Random) -> dict:
    """One conversation: 25% answered without a tool, 15% two requests (the second calls a tool), else one
    tool call. `tools` is a shuffled subset of TOOLS, 2..all of them, holding every tool the example calls."""
    messages = [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}] if rng.random() < P_SYSTEM else []
    used: list[str] = []
    r = rng.random()
    if r < P_NO_TOOL:
        messages += _chat_turn(rng)
    elif r < P_NO_TOOL + P_MULTI_TURN:
        if rng.random() < 0.8:
            name, turn = _tool_turn(rng)
            used.append(name)
            messages += turn
        else:
            messages += _chat_turn(rng)
        name, turn = _tool_turn(rng, prefix=rng.choice(TURN_PREFIXES))
        used.append(name)
        messages += turn
    else:
        name, turn = _tool_turn(rng)
        used.append(name)
        messages += turn
    needed = sorted(set(used))
    others = [n for n in TOOL_BY_NAME if n not in needed]
    k = rng.randint(max(2, len(needed)), len(TOOLS))
    offered = needed + rng.sample(others, k - len(needed))
    rng.shuffle(offered)
    return {"messages": messages, "tools": [copy.deepcopy(TOOL_BY_NAME[n]) for n in offered]}


def example_kind(example: dict) -> str:
    """"no_tool", "multi_turn" (more than one user request) or "single_call"."""
    if not any(m.get("tool_calls") for m in example["messages"]):
        return "no_tool"
    return "multi_turn" if sum(m["role"] == "user" for m in example["messages"]) > 1 else "single_call"


# ---- splits and files ------------------------------------------------------------------------------------

def _hash(example: dict) -> bytes:
    return hashlib.blake2b(json.dumps(example, sort_keys=True).encode(), digest_size=8).digest()


def _split_of(digest: bytes, heldout_fraction: float) -> str:
    return "heldout" if int.from_bytes(digest, "big") / 2 ** 64 < heldout_fraction else "train"


def _generate_splits(counts: dict[str, int], seed: int, heldout_fraction: float) -> dict[str, list[dict]]:
    """One pass over the candidate stream of `random.Random(seed)`, keeping the first counts[split] new
    examples of each split; so asking for both at once gives the same lists as asking for each alone."""
    for split, n in counts.items():
        if split not in SPLITS:
            raise ToolDataError(f"split {split!r} is not one of {SPLITS}")
        if n < 0:
            raise ToolDataError(f"cannot generate {n} {split} examples; pass n >= 0")
    if not 0.0 < heldout_fraction < 1.0:
        raise ToolDataError(f"heldout_fraction {heldout_fraction} must be strictly between 0 and 1")
    rng = random.Random(seed)
    kept: dict[str, list[dict]] = {s: [] for s in counts}
    seen: set[bytes] = set()
    duplicate_run = 0
    while any(len(kept[s]) < n for s, n in counts.items()):
        example = make_example(rng)
        digest = _hash(example)
        if digest in seen:
            duplicate_run += 1
            if duplicate_run >= MAX_DUPLICATE_RUN:
                have = {s: len(v) for s, v in kept.items()}
                raise ToolDataError(f"only {have} distinct examples after {MAX_DUPLICATE_RUN} duplicates in "
                                    f"a row (asked for {counts}); ask for fewer examples")
            continue
        seen.add(digest)
        duplicate_run = 0
        split = _split_of(digest, heldout_fraction)
        if split in kept and len(kept[split]) < counts[split]:
            kept[split].append(example)
    return kept


def generate(n: int, seed: int = 0, split: str = "train", heldout_fraction: float = 0.1) -> list[dict]:
    """The first `n` distinct examples of `split` in the stream of make_example(random.Random(seed)).

    The split of an example is a function of its content (blake2b of its sorted-key JSON), so train and
    heldout lists never share an example, whatever seeds produced them."""
    return _generate_splits({split: n}, seed, heldout_fraction)[split]


TOOLS_FILE = "tools.json"  # the schemas of the tools the conversations use, beside them


def write_tools_file(out_dir: str | Path) -> Path:
    """tools.json in out_dir: the tools' schemas, a JSON list as `codeforge chat --tools` takes it."""
    path = Path(out_dir) / TOOLS_FILE
    path.write_text(json.dumps(TOOLS, indent=2) + "\n")
    return path


def write_tool_data(out_dir: str | Path, n_train: int, n_heldout: int, seed: int = 0,
                    overwrite: bool = False) -> dict:
    """Write train.jsonl, heldout.jsonl, meta.json and tools.json (the tools' schemas, a JSON list to give
    `codeforge chat --tools`) to out_dir (staged aside, then renamed into place) and return the meta dict.
    Refuses a non-empty out_dir unless overwrite."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ToolDataError(f"{out} exists and is not a directory; choose another output directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ToolDataError(f"{out} is not empty; pass overwrite=True (--overwrite) to replace it, "
                            "or choose another output directory")
    heldout_fraction = 0.1
    data = _generate_splits({"train": n_train, "heldout": n_heldout}, seed, heldout_fraction)
    # "generator" keeps the module name this format shipped with
    # (tasks/tool_data.py), so meta.json is unchanged
    meta = {"format": "openai-chat-tools", "generator": "codeforge.tasks.tool_data", "seed": seed,
            "heldout_fraction": heldout_fraction, "n_train": n_train, "n_heldout": n_heldout,
            "tools": list(TOOL_BY_NAME),
            "kinds": {s: dict(sorted(Counter(example_kind(e) for e in data[s]).items())) for s in SPLITS}}
    tmp = staging_dir(out)
    for split in SPLITS:
        with open(tmp / f"{split}.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps(example) + "\n" for example in data[split])
    (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    write_tools_file(tmp)
    publish(tmp, out)
    return meta


# ---- evaluation ------------------------------------------------------------------------------------------

def eval_cases(examples: list[dict]) -> list[dict]:
    """One case per assistant turn that directly follows a user turn: the messages before it, the offered
    tools, and the calls expected there as [{"name", "arguments": dict}] (empty: answer without a tool)."""
    cases = []
    for example in examples:
        messages = example["messages"]
        for i, m in enumerate(messages):
            if m["role"] != "assistant" or i == 0 or messages[i - 1]["role"] != "user":
                continue
            expected = [{"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}
                        for c in m.get("tool_calls") or []]
            cases.append({"messages": copy.deepcopy(messages[:i]), "tools": example["tools"],
                          "expected": expected})
    return cases


def _rate(hits: int, total: int) -> float | None:
    return hits / total if total else None


def score(cases: list[dict], predictions: list[dict]) -> dict:
    """Compare parsed model outputs with the expected calls.

    predictions[i] = {"content": str, "tool_calls": [{"name", "arguments": dict}], "errors": [str], "ended":
    bool}, where errors lists tool-call blocks that did not parse and ended says the reply closed with
    <|im_end|> (missing: taken as closed). Rates (None when their denominator is 0):
    - tool_parse_rate: among outputs with a tool-call attempt (a parsed call or an error) that were not cut
      short by the token budget inside a call, share with no error (tool_cut_by_budget counts the others:
      a call still being written when the budget ran out is the budget's outcome, not a malformed call);
    - tool_name_accuracy: among cases expecting calls, share whose called names equal the expected, in order;
    - tool_args_exact: among cases expecting calls, share whose calls equal the expected (names and args);
    - no_call_accuracy: among cases expecting no call, share with neither a call nor an error;
    - tool_unknown_names: calls naming a tool the case did not offer (a count)."""
    if len(cases) != len(predictions):
        raise ToolDataError(f"{len(predictions)} predictions for {len(cases)} cases; pass one per case")
    attempted = clean = call_cases = names_ok = args_ok = no_call_ok = cut = unknown = 0
    for case, pred in zip(cases, predictions):
        calls, errors = pred.get("tool_calls") or [], pred.get("errors") or []
        offered = {t["function"]["name"] for t in case.get("tools") or []}
        unknown += sum(1 for c in calls if offered and c.get("name") not in offered)
        if calls or errors:
            if not pred.get("ended", True) and errors and all(e.startswith("unterminated") for e in errors):
                cut += 1
            else:
                attempted += 1
                clean += not errors
        expected = case["expected"]
        if expected:
            call_cases += 1
            names_ok += [c.get("name") for c in calls] == [e["name"] for e in expected]
            args_ok += [(c.get("name"), c.get("arguments")) for c in calls] == \
                [(e["name"], e["arguments"]) for e in expected]
        else:
            no_call_ok += not calls and not errors
    n = len(cases)
    return {"tool_cases": n, "tool_call_cases": call_cases, "no_call_cases": n - call_cases,
            "tool_parse_rate": _rate(clean, attempted), "tool_cut_by_budget": cut,
            "tool_unknown_names": unknown, "tool_name_accuracy": _rate(names_ok, call_cases),
            "tool_args_exact": _rate(args_ok, call_cases),
            "no_call_accuracy": _rate(no_call_ok, n - call_cases)}
