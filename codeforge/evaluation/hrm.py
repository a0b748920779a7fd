"""The hierarchical planner/generator's scores: teacher-forced validation (evaluate_hrm, what training logs)
and decoded ones (plan and code accuracy, AST similarity, refinement iterations), and `codeforge eval` for
an hrm run."""

from __future__ import annotations

import contextlib

import math
from collections import Counter

import torch

from ..data.hrm_batches import HRMBatches, PlanData
from ..device import autocast
from ..mining.plans import parse_plan
from ..syntax import is_valid_syntax, parser
from ..tokenizer import token_byte_lengths
from .lm import EvalError

PARTS = ("plan", "code", "refine", "decision", "plan_accuracy", "code_accuracy", "decision_accuracy")


@torch.no_grad()
def evaluate_hrm(model, val: HRMBatches, eval_tokens: int, device, precision: str,
                 token_bytes: torch.Tensor) -> dict:
    """Validation records in order (drafts of epoch 0), until eval_tokens body targets are scored (0: all):
    val_loss is the body's loss given the gold plan (the generator's, what `best` is chosen by), bits per
    byte of the body, and the parts as extras (plan/refine/decision losses, token and decision accuracies),
    each a mean over batches weighted by its batch's rows."""
    model.eval()
    sums: dict[str, float] = {}
    rows, nats, nbytes, code_tokens = 0, 0.0, 0, 0
    for batch in val.eval_batches():
        with autocast(device, precision):
            out = model(batch)
        n = batch["plan_idx"].size(0)
        rows += n
        for k in PARTS:
            sums[k] = sums.get(k, 0.0) + float(out[k]) * n
        tgt = batch["code_tgt"]
        counted = tgt != -1
        nats += float(out["code"]) * int(counted.sum())
        nbytes += int(token_bytes[tgt.clamp(min=0)][counted].sum())
        code_tokens += int(counted.sum())
        if eval_tokens and code_tokens >= eval_tokens:
            break
    model.train()
    extra = {k: v / rows for k, v in sums.items()}
    loss = nats / max(code_tokens, 1)
    return {"val_loss": loss, "perplexity": math.exp(min(loss, 50)),
            "bits_per_byte": nats / math.log(2) / max(nbytes, 1), "eval_tokens": code_tokens, "extra": extra}


def ast_node_f1(a: str, b: str, language: str, base: str = "") -> float:
    """F1 of the multisets of named tree-sitter node types of two snippets (1.0: the same kinds of syntax in
    the same numbers; a soft "code accuracy" for bodies that are not exactly equal). Parsed as they are,
    error nodes included. `base`'s nodes (a prompt both start with) are taken out of both first, so a
    shared signature and docstring earn nothing."""
    p = parser(language)

    def kinds(text: str) -> Counter:
        out: Counter = Counter()
        stack = [p.parse(text.encode("utf-8")).root_node]
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
    n = len(pairs)
    if not n:
        return {}
    keys = ("plan_exact", "plan_word_accuracy", "code_exact", "code_ast_f1", "syntax_valid_rate",
            "plan_followed")
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
            out = model.generate(data.prompt_ids[i], max_plan_tokens=max_plan_tokens,
                                 max_code_tokens=max_code_tokens, seed=seed)
            body, draft = tok.decode(out["code"]), tok.decode(out["draft"])
            pairs.append({"language": rec["language"], "plan": rec["plan"], "body": rec["body"],
                          "prompt": rec["prompt"],
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


def run_hrm_eval(run: str, model, tok, ck, cfg: dict, dev, precision: str, data: str | None,
                 eval_tokens: int | None, cases: int, step=None) -> dict:
    """`codeforge eval` for an hrm run: the teacher-forced validation numbers training logs (val_loss and
    bits per byte of the body given the gold plan; plan_accuracy, code_accuracy, decision_accuracy as token
    and decision accuracies) and the decoded ones (hrm_generation_eval). step(what): a context manager around
    each part (evaluation/run.py's says when it starts and ends)."""
    step = step or (lambda what: contextlib.nullcontext())
    data = data or cfg["train"]["data"]
    val = PlanData(data, "val", tok)
    if not len(val):
        raise EvalError(f"{data}/val.jsonl holds no records; mine with a larger --val-fraction")
    m = cfg["model"]
    batches = HRMBatches(val, tok, min(cfg["train"].get("batch_size", 8), len(val)), m["plan_len"],
                         m["code_len"], seed=cfg["train"].get("seed", 0), shuffle=False, device=dev)
    if eval_tokens is None:
        eval_tokens = cfg["train"].get("eval_tokens", 262_144)
    token_bytes = token_byte_lengths(tok, m["vocab_size"]).to(dev)
    with step(f"validation of the bodies given their gold plans ({eval_tokens:,} tokens)" if eval_tokens else
              "validation of the bodies given their gold plans (the whole split)"):
        r = evaluate_hrm(model, batches, eval_tokens, dev, precision, token_bytes)
    extra = r.pop("extra")
    r["eval_split"] = "val"
    for k in ("plan_accuracy", "code_accuracy", "decision_accuracy"):
        if k in extra:
            r[k] = extra[k]
    r.update({f"val_{k}": v for k, v in extra.items() if k not in ("plan_accuracy", "code_accuracy",
                                                                 "decision_accuracy")})
    if cases:
        with step(f"{min(cases, len(val))} functions planned, written and refined"):
            r.update(hrm_generation_eval(model, tok, val, cases))
    return r
