"""Scores of what a model writes: syntax validity of function bodies completed from held-out files, the
unbiased pass@k estimator (HumanEval itself: humaneval.py), and fill-in-the-middle on held-out files."""

from __future__ import annotations

import math
import random

import torch

from ..engine import SamplingParams
from ..fim import infill_ids
from ..syntax import guess_language, is_valid_syntax, parser

STOPS = {"python": ["\ndef ", "\nclass ", "\nif __name__", "\n@"], "go": ["\n}\n", "\n}"]}


def function_prompts(text: str, language: str, limit: int) -> list[str]:
    """Prompts cut from a source file: each top-level function's doc comment and signature, up to where
    its body starts. The model writes the body; the result is parsed."""
    tree = parser(language).parse(text.encode("utf-8"))
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
            # the doc block
            while prev is not None and prev.type == "comment" and prev.end_point[0] >= row - 1:
                start, row, prev = prev.start_byte, prev.start_point[0], prev.prev_sibling
            out.append(src[start:body.start_byte + 1].decode("utf-8", "replace") + "\n\t")
        if len(out) >= limit:
            break
    return out


def syntax_validity(engine, documents: list[str], n_samples: int, max_new_tokens: int = 128,
                    seed: int = 0) -> dict:
    """Share of completions (greedy at temperature 0.2 with top-k 20) that parse, over prompts cut from
    held-out documents, per language."""
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
        p = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.2, top_k=20, seed=seed + i,
                           stop=STOPS[lang])
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


def infill_cases(documents: list[str], n: int, seed: int = 0, max_doc_chars: int = 6000) -> list[dict]:
    """Infilling cases cut from held-out files: n masked lines ("line") and n masked spans of 2-4 lines
    ("span"), chosen by a seeded generator among lines with code on them, never the first or last line.
    Files that parse are visited in turn, several times when there are fewer than n, each time at another
    line. Each case: {"kind", "prefix", "middle", "suffix", "language"}."""
    rng = random.Random(seed)
    usable = []
    for doc in documents:
        lang = guess_language(doc)
        if len(doc) > max_doc_chars or not is_valid_syntax(doc, lang):
            continue
        lines = doc.splitlines(keepends=True)
        code = [i for i in range(1, len(lines) - 1) if lines[i].strip()
                and not lines[i].lstrip().startswith(("#", "//"))]
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
        # too long: cut the suffix's far end, the prefix's start
        if len(fim_ctx) + len(middle) > engine.block_size:
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
