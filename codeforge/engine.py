"""Generation: KV cache, batched prompts of different lengths, sampling, stop sequences, streaming.

The engine sees token ids and a model with the shared surface (forward with kv_cache and starts), so it
works for every preset. Prompts in a batch are left-padded; the engine tells the model where each row's real
tokens start, and the model hides the padding keys and counts the row's positions from there, so a padded row
computes what it would alone.
Prefill runs the whole prompt once; then each step feeds one token per row and reuses the cached keys and
values, so a step costs O(context) instead of re-running the prompt (O(context^2) per token).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from . import CodeforgeError
from .chat import IM_END, encode_conversation, parse_assistant
from .checkpoint import load_model
from .config import chat_notice
from .constrain import Constraint, ConstraintError, ToolGrammar, calls_kept_out, fit_tokens, mask_logits
from .device import autocast, choose_device, choose_precision
from .fim import FIM_PREFIX, FIM_SUFFIX, infill_ids
from .models.cpu_decode import stepper
from .models.cpu_linear import decode_threads
from .tokenizer import CodeTokenizer


class EngineError(CodeforgeError):
    """The engine cannot run this model (the message says what can)."""


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 0.8  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    repetition_penalty: float = 1.0  # 1: off (CTRL, Keskar et al. 2019)
    seed: int | None = None
    stop: list[str] = field(default_factory=list)  # stop sequences (not included in the output)
    stop_at_eot: bool = True
    # more token ids that end a row (e.g. <|im_end|>); yielded
    stop_ids: list[int] = field(default_factory=list)

    def validate(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens {self.max_new_tokens} must be at least 1")
        if self.temperature < 0:
            raise ValueError(f"temperature {self.temperature} must be >= 0 (0 is greedy)")
        if self.top_k < 0 or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_k {self.top_k} must be >= 0 and top_p {self.top_p} in (0, 1]")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty {self.repetition_penalty} must be > 0")


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Set to -inf every logit outside the top-k and outside the nucleus (the smallest set of tokens whose
    probabilities sum to at least top_p; Holtzman et al. 2019). logits: (B, vocab)."""
    if top_k > 0 and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, descending=True, dim=-1)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        remove = cum - sorted_logits.softmax(-1) >= top_p  # mass before this token already reaches top_p
        remove[:, 0] = False  # always keep the most likely token
        logits = logits.masked_fill(remove.scatter(1, idx, remove), float("-inf"))
    return logits


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """Divide positive logits (multiply negative ones) of tokens already in the row by `penalty`.
    seen: (B, vocab) bool."""
    if penalty == 1.0:
        return logits
    pen = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, pen, logits)


class Engine:
    def __init__(self, model: torch.nn.Module, tokenizer: CodeTokenizer, device: torch.device | str = "cpu",
                 precision: str = "fp32"):
        arch = getattr(getattr(model, "cfg", None), "arch", "gpt")
        if arch != "gpt":
            raise EngineError(f"this is an {arch} model; the engine (chat, serve, export) runs GPT models. "
                              f"`codeforge generate` and `codeforge eval` take {arch} runs")
        self.model = model.eval()
        self.tok = tokenizer
        self.device = torch.device(device)
        self.precision = precision
        self.cache_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(
            precision, next(model.parameters()).dtype)
        self.block_size = model.context_length
        self.pad_id = tokenizer.special_ids.get("<pad>", 0)
        self.checkpoint = None  # from_run: the checkpoint directory it loaded
        self.chat_note: str | None = None  # from_run: a notice when no chat stage trained it
        # from_run: the tools stage trained it (it reaches for tools when offered none)
        self.tool_trained = False

    @classmethod
    def from_run(cls, run: str, device: str = "auto", which: str = "auto") -> "Engine":
        """An engine over a run's (or checkpoint's) weights, on the chosen device and its precision."""
        dev, _ = choose_device(device)
        precision, _ = choose_precision(dev, "auto")
        model, tok, ck, saved = load_model(run, dev, which)
        eng = cls(model, tok, dev, precision)
        eng.checkpoint, eng.chat_note = ck, chat_notice(saved)
        eng.tool_trained = saved.get("train", {}).get("stage") == "tools"
        return eng

    def _fit_prompt(self, ids: list[int], max_new: int, warn) -> tuple[list[int], int]:
        if not ids:
            ids = [self.tok.eot_id]  # an empty prompt starts a new document
        room = self.block_size - 1
        if len(ids) > room:
            warn(f"prompt of {len(ids)} tokens exceeds the context ({self.block_size}); "
                 f"keeping the last {room}")
            ids = ids[-room:]
        return ids, min(max_new, self.block_size - len(ids))

    @torch.inference_mode()
    def generate_ids(self, prompts: list[list[int]], p: SamplingParams, warn=None,
                     constraints: list[Constraint | None] | None = None) -> Iterator[list[int | None]]:
        """Yield, per step, one new token id per row (None for rows that have finished). constraints: one per
        row (None: free), from constrain.ToolGrammar.new(): each step's logits are masked to what the row's
        grammar allows before sampling (greedy or not), the sampled token is fed to it, and a row whose
        grammar is finished (it wrote <|im_end|> where the grammar ends) finishes."""
        p.validate()
        if constraints is not None and len(constraints) != len(prompts):
            raise EngineError(f"{len(constraints)} constraints for {len(prompts)} prompts: give one per "
                              f"prompt (None for a free row)")
        constrained = constraints is not None and any(c is not None for c in constraints)
        warn = warn or (lambda m: print(f"warning: {m}", file=sys.stderr))
        fitted = [self._fit_prompt(ids, p.max_new_tokens, warn) for ids in prompts]
        prompts = [f[0] for f in fitted]
        budgets = [f[1] for f in fitted]
        B, L = len(prompts), max(map(len, prompts))
        # The cache is shared: every row has the padded length L, so no row may run past block_size - L.
        budgets = [min(b, self.block_size - L) for b in budgets]
        # each grammar keeps the tokens that end its reply in reserve (constrain.py, "Budget")
        if constrained:
            for c, b in zip(constraints, budgets):
                if c is not None:
                    c.set_budget(b)
        steps = max(budgets)
        # each row's first real column: the model masks what is before it
        pads = [L - len(x) for x in prompts]
        idx = torch.tensor([[self.pad_id] * pd + x for pd, x in zip(pads, prompts)], device=self.device)
        real = torch.arange(L, device=self.device).unsqueeze(0) >= torch.tensor(
            pads, device=self.device
        ).unsqueeze(1)
        total = L + steps
        cache = self.model.new_kv_cache(B, total, self.device, self.cache_dtype)
        gen = torch.Generator(device=self.device)
        # Unseeded: fresh entropy from the OS, never by reseeding torch's global generator (training's RNG).
        gen.manual_seed(p.seed if p.seed is not None else int.from_bytes(os.urandom(8), "little") % 2**63)
        done = torch.zeros(B, dtype=torch.bool, device=self.device)
        budget = torch.tensor(budgets, device=self.device)
        vocab = self.tok.vocab_size
        ends = list(p.stop_ids) + ([self.tok.eot_id] if p.stop_at_eot else [])
        end_t = torch.tensor(ends, device=self.device, dtype=torch.long)
        logits = self._forward(idx, cache, pads)[:, -1, :]
        seen = torch.zeros(B, logits.size(-1), dtype=torch.bool, device=self.device)  # (B, model vocab)
        seen.scatter_(1, idx, real)
        for t in range(steps):
            logits = logits.float()[:, :vocab]  # padded vocab rows are never sampled
            logits = apply_repetition_penalty(logits, seen[:, :vocab], p.repetition_penalty)
            if constrained:
                logits = mask_logits(constraints, logits)
            if p.temperature == 0:
                nxt = logits.argmax(-1)
            else:
                probs = filter_logits(logits / p.temperature, p.top_k, p.top_p).softmax(-1)
                nxt = torch.multinomial(probs, 1, generator=gen).squeeze(1)
            finished_now = done | (budget <= t)
            ids, fin = nxt.tolist(), finished_now.tolist()  # one host transfer per step
            if constrained:  # a drawn token that leaves its row no room to end is replaced (constrain.py)
                fitted = fit_tokens(constraints, logits, [None if f else i for i, f in zip(ids, fin)])
                if any(u is not None and u != i for u, i in zip(fitted, ids)):
                    ids = [i if u is None else u for u, i in zip(fitted, ids)]
                    nxt = torch.tensor(ids, device=self.device)
                # fed before the token is yielded: a token the grammar refuses is never seen
                for c, i, f in zip(constraints, ids, fin):
                    if c is not None and not f:
                        c.advance(i)
            yield [None if f else i for i, f in zip(ids, fin)]
            done = finished_now | torch.isin(nxt, end_t)
            if constrained:
                over = [c is not None and c.finished for c in constraints]
                done = done | torch.tensor(over, device=self.device)
                fin = [f or o for f, o in zip(fin, over)]
            if t == steps - 1 or all(f or i in ends for i, f in zip(ids, fin)):
                return
            if p.repetition_penalty != 1.0:
                seen[torch.arange(B), nxt] = True
            with decode_threads(self.model, B):
                fast = stepper(self.model, self.device, self.precision, B)
                if fast is not None:  # numpy on the CPU (models/cpu_decode.py), the same logits
                    logits = fast.step(nxt, cache, pads)[:, -1, :]
                else:
                    logits = self._forward(nxt.unsqueeze(1), cache, pads)[:, -1, :]

    def _forward(self, idx, cache, starts):
        with autocast(self.device, self.precision):
            return self.model(idx, kv_cache=cache, starts=starts, last_only=True)

    def generate(self, prompts: list[str], p: SamplingParams, warn=None) -> list[str]:
        """Completions (text after each prompt), cut at end-of-text and at the first stop sequence. FIM
        tokens written in a prompt (`<fim_prefix>...`) are read as the tokens, as editor plugins send them."""
        return self.complete_ids([self._encode_prompt(x) for x in prompts], p, warn)

    def infill(self, prefixes: list[str], suffixes: list[str], p: SamplingParams, warn=None) -> list[str]:
        """The middle between each prefix and suffix (fill-in-the-middle, fim.py's PSM prompt); a model
        trained without FIM writes something, but rarely what fits."""
        return self.complete_ids([infill_ids(self.tok, a, b) for a, b in zip(prefixes, suffixes)], p, warn)

    def _encode_prompt(self, text: str) -> list[int]:
        """A prompt that starts with a FIM token (PSM or SPM, as editor plugins send them) is read with its
        special tokens; any other text is plain text, whatever it mentions."""
        fim = tuple(t for t in {FIM_PREFIX, FIM_SUFFIX, self.tok.special_text(FIM_PREFIX),
                                # and an imported tokenizer's spelling
                                self.tok.special_text(FIM_SUFFIX)} if t)
        return self.tok.encode(text, allow_special=text.lstrip().startswith(fim))

    def complete_ids(self, ids: list[list[int]], p: SamplingParams, warn=None) -> list[str]:
        """generate() over token-id prompts."""
        outs: list[list[int]] = [[] for _ in ids]
        stopped = [False] * len(ids)
        stop_tokens = max((len(x) for x in p.stop), default=0) + 4
        for step in self.generate_ids(ids, p, warn):
            for i, t in enumerate(step):
                if t is None or stopped[i]:
                    continue
                if t == self.tok.eot_id and p.stop_at_eot:
                    stopped[i] = True
                    continue
                outs[i].append(t)
                # Only the tail can hold a new stop: a token decodes to at least one character, bar a split
                # multi-byte one, so the last len(stop) + 4 tokens cover it without re-decoding everything.
                if p.stop and _first_stop(self.tok.decode(outs[i][-stop_tokens:]), p.stop) is not None:
                    stopped[i] = True
            if all(stopped):
                break
        return [_cut(self.tok.decode(o), p.stop) for o in outs]

    def stream(self, prompt: str, p: SamplingParams, warn=None, suffix: str | None = None) -> Iterator[str]:
        """New text as it is generated (one prompt). Holds back an incomplete UTF-8 character or a
        possible start of a stop sequence until it is settled. With `suffix`, the middle between the prompt
        and the suffix (fill-in-the-middle)."""
        out: list[int] = []
        sent = 0
        hold = max((len(s) for s in p.stop), default=1) - 1
        if suffix is not None:
            ids = infill_ids(self.tok, prompt, suffix)
        else:
            ids = self._encode_prompt(prompt)
        for step in self.generate_ids([ids], p, warn):
            t = step[0]
            if t is None or (t == self.tok.eot_id and p.stop_at_eot):
                break
            out.append(t)
            text = self.tok.decode(out)
            cut = _first_stop(text, p.stop)
            if cut is not None:
                if cut > sent:
                    yield text[sent:cut]
                return
            safe = len(text) - hold
            if text.endswith("\ufffd"):
                safe = min(safe, len(text) - 1)
            if safe > sent:
                yield text[sent:safe]
                sent = safe
        text = _cut(self.tok.decode(out), p.stop)
        if len(text) > sent:
            yield text[sent:]

    def chat(self, messages: list[dict], tools: list[dict] | None, p: SamplingParams, warn=None,
             on_text=None, constrained: bool = True, tool_choice: str | dict = "auto",
             response_format: dict | None = None) -> dict:
        """The assistant's next turn for a conversation (chat.py's rendering plus the generation prompt):
        {"content", "tool_calls", "errors", "text", "ended"}; generation stops at <|im_end|> (ended=True) or
        at the token budget. on_text(piece) streams the raw text as it comes.

        constrained (the default): with tools, every tool call the model opens is held to `{"name": <a
        tool>, "arguments": <its schema>}` (constrain.py); without tools there is no call to make, so the call
        tokens are kept out (as OpenAI's API does); tool_choice "required" / a tool's name forces calls,
        "none" forbids them; response_format {"type": "json_object" | "json_schema", ...} makes the
        reply one JSON value. constrained=False measures the bare model (tool_choice and response_format
        are then ignored)."""
        ids, _ = encode_conversation(self.tok, messages, tools, add_generation_prompt=True)
        end_id = self.tok.special_ids[IM_END]
        constraints = None
        if constrained and tool_choice == "auto" and calls_kept_out(self.tok, tools, response_format):
            tool_choice = "none"
        if constrained and (tools or response_format is not None or tool_choice != "auto"):
            constraints = [ToolGrammar(self.tok, tools, tool_choice, response_format).new()]
            g, room = constraints[0].grammar, min(p.max_new_tokens,
                                                  self.block_size - min(len(ids), self.block_size - 1))
            # no complete reply fits: refused, as the server does
            if g.min_tokens is not None and room < g.min_tokens:
                raise ConstraintError(f"{room} new tokens (max_new_tokens {p.max_new_tokens}, context "
                                      f"{self.block_size}) are too few for {g.describe()}: the shortest one "
                                      f"takes {g.min_tokens}; allow at least {g.min_tokens}")
        out: list[int] = []
        sent, ended = 0, False
        for step in self.generate_ids([ids], p, warn, constraints):
            t = step[0]
            if t is None or t == end_id or (t == self.tok.eot_id and p.stop_at_eot):
                ended = t == end_id
                break
            out.append(t)
            if on_text is not None:
                text = self.tok.decode(out)
                if not text.endswith("\ufffd") and len(text) > sent:
                    on_text(text[sent:])
                    sent = len(text)
        text = self.tok.decode(out)
        if on_text is not None and len(text) > sent:
            on_text(text[sent:])
        return {**parse_assistant(text), "text": text, "ended": ended}


def _first_stop(text: str, stops: list[str]) -> int | None:
    hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return min(hits) if hits else None


def _cut(text: str, stops: list[str]) -> str:
    i = _first_stop(text, stops)
    return text if i is None else text[:i]
