"""Chat and tool-calling scores of a chat model: tool calls that parse, the right tool and arguments, and how
often a reply is closed with <|im_end|>."""

from __future__ import annotations

from ..engine import SamplingParams
from ..tasks.tool_calls import eval_cases, generate, score


def tool_calling_eval(engine, n_cases: int = 100, seed: int = 0, max_new_tokens: int = 96,
                      constrained: bool = True) -> dict:
    """Scores of a chat model on held-out synthetic tool-calling conversations (tasks/tool_calls.py; disjoint
    from any training split it generates): share of tool-call attempts that parse, right tool, arguments
    exactly right, and no call when none is needed. Greedy decoding, each reply cut at <|im_end|>.
    constrained (the default, as `codeforge chat` and the server decode): every call the model opens is held
    to the offered tools' schemas (constrain.py), so a call fails to parse only when the token budget cuts
    it; constrained=False measures the bare model. `tool_constrained` in the result says which."""
    cases = eval_cases(generate(max(1, n_cases), seed=seed, split="heldout"))[:n_cases]
    p = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    preds = [engine.chat(c["messages"], c["tools"], p, warn=lambda m: None, constrained=constrained)
             for c in cases]
    r = score(cases, preds)
    r["tool_im_end_rate"] = sum(pr["ended"] for pr in preds) / max(len(preds), 1)
    r["tool_constrained"] = constrained
    return r


def chat_end_rate(engine, conversations: list[dict], n: int = 20, max_new_tokens: int = 128) -> dict:
    """How often the model closes its reply with <|im_end|> within max_new_tokens (greedy), given each
    conversation up to its first assistant turn: the first thing chat SFT must teach a base model."""
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
