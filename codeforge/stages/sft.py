"""Chat stages (sft: instruction pairs; tools: tool calling): the language-model wiring of pretrain.py over
chat shards, whose loader packs whole conversations and masks every target an assistant did not write, so
the loss is the same LM loss (SFT is data). Defaults per stage come from presets/stages.toml."""

from __future__ import annotations

from ..config import RunConfig
from . import pretrain

SAMPLE_PROMPT = [{"role": "user", "content": "Write a Python function that returns the reverse of a string."}]


def chat_sample(model, tok, device, precision, step: int, max_new_tokens: int = 96) -> str:
    """The model's reply to a fixed request, greedy, so samples across steps are comparable."""
    from ..engine import Engine, SamplingParams
    r = Engine(model, tok, device, precision).chat(SAMPLE_PROMPT, None,
                                                   SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0))
    return r["text"] + ("<|im_end|>" if r["ended"] else " [no <|im_end|>]")


def run(cfg: RunConfig, resume: bool = False, log=print) -> dict:
    return pretrain.run(cfg, resume, log, sampler=chat_sample)
