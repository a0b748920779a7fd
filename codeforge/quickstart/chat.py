"""--chat's stages: its own base model (a context that holds a tool-calling conversation), then SFT on
instruction pairs mined from the corpus mixed with synthetic tool-calling conversations, a tools stage on
the tool conversations alone, and tool calling scored after each. Each stage's run directory holds its
tokenizer with the chat template; each stage says what changed and how long it took.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from .. import rundir
from ..config import resolve
from ..corpus import CorpusOptions
from ..data.shards import prepare
from ..engine import Engine, SamplingParams
from ..evaluation.tool_calls import chat_end_rate, tool_calling_eval
from ..mining.sft import write_sft
from ..stages import run as run_stage
from ..tasks.tool_calls import TOOLS as TOOL_SCHEMAS, TOOLS_FILE, write_tool_data, write_tools_file
from .pretrain import Plan
from .survey import Quickstart, read_record, record_of

# A context that holds a tool-calling conversation (up to ~600 tokens with five tool schemas; at 512, 347 of
# 1,500 were dropped), ~2,300 tokens per step, in one process (a batch of 3 does not split). SFT and tools
# then start from it at learning rates for a 5M model (the seeds' 5e-5 and 3e-6 are for 100M+ models). Fewer
# pretraining steps than the plain quickstart's 560 buy the tools stage 400 steps (200 first), at 3e-3 (1e-3
# reached a higher validation loss at equal steps), with evaluations of 32k tokens (the whole validation
# split, ~120k tokens, four times a stage, cost ~a minute);
# docs/LOG.md#2026-11-25-quickstart-chat-tool-calling.
CHAT_MODEL = {"block_size": 768}
CHAT_TRAIN = {"batch_size": 3, "local_ranks": 1}
CHAT_STEPS = 400
TOOL_EXAMPLES = 3000  # synthetic tool-calling conversations for training (and 100 held out)
TOOL_CASES = 50  # held-out cases the tool-calling scores are measured on
SFT = {"learning_rate": 1e-3, "warmup_steps": 10, "max_iters": 150, "eval_every": 75, "save_every": 75,
       "eval_tokens": 32_768, "batch_size": 3}
TOOLS = {"learning_rate": 3e-3, "warmup_steps": 10, "max_iters": 400, "eval_every": 200, "save_every": 200,
         "eval_tokens": 32_768, "batch_size": 3}


def chat_count(q: Quickstart) -> Plan:
    """--max-iters, else CHAT_STEPS: a fixed count (--chat takes no time budget), fewer steps than the plain
    quickstart's, which buy the chat stages theirs."""
    return Plan(q.opts.max_iters or CHAT_STEPS)


def reuse_plain(q: Quickstart) -> None:
    """Before a first run: say why --chat pretrains a base of its own, and copy in the plain quickstart's
    tokenizer and shards of the same corpus where they are there."""
    if not q.trained:
        from_plain(q.out_dir, q.plain_dir, q.src, q.langs)


def from_plain(out_dir: Path, base: Path | None, src: str, langs: list[str] | None) -> None:
    """--chat pretrains a base model of its own: its context (768 tokens) holds a tool-calling conversation,
    and the plain quickstart's model (256 tokens, learned positions) cannot be stretched to it. Said, and the
    plain quickstart's tokenizer and shards of the same corpus are copied in when they are there."""
    say = ("      --chat pretrains its own base model: tool conversations need a context of 768 tokens, and "
           "the plain quickstart's model has 256")
    same = (base is not None and base.resolve() != out_dir.resolve()
            and read_record(base) == record_of(src, langs))
    if not same or not (base / "tokenizer" / "tokenizer.json").exists():
        print(f"{say}.")
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    copied = []
    for part in ("tokenizer", "data"):
        if (base / part).is_dir() and not (out_dir / part).exists():
            shutil.copytree(base / part, out_dir / part, symlinks=True)
            copied.append(part)
    print(f"{say}; it reuses {base}'s {' and '.join(copied) or 'nothing (its own are there)'}.")


def make_chat_data(q: Quickstart, tool_examples: int) -> None:
    """Instruction pairs mined from the corpus (OUT/sft_pairs) and synthetic tool-calling conversations
    (OUT/tool_pairs), prepared for SFT (both, OUT/sft_data) and for the tools stage (the tool conversations
    alone, OUT/tool_data)."""
    t = time.perf_counter()
    pairs, tool_pairs = q.out_dir / "sft_pairs", q.out_dir / "tool_pairs"
    if not (pairs / "train.jsonl").exists():
        st = write_sft([q.src], pairs, languages=q.langs, max_examples=4000, heldout_fraction=0.05)
        print(f"{q.head} make-sft: {st['examples']} instruction pairs mined from {st['functions']} "
              f"documented functions -> {pairs}")
    if not (tool_pairs / "train.jsonl").exists():
        write_tool_data(tool_pairs, tool_examples, 100, seed=0)
        print(f"      make-tools: {tool_examples} synthetic tool-calling conversations -> {tool_pairs}")
    if not (tool_pairs / TOOLS_FILE).exists():  # tool data from before the schemas were written beside it
        write_tools_file(tool_pairs)
    opts = CorpusOptions(val_fraction=0.05)
    # SFT sees the tool conversations too, shuffled in with the mined pairs, so tool calling trains during the
    # SFT steps as well as the tools stage's (docs/LOG.md#2026-11-25-quickstart-chat-tool-calling)
    sft_data, tool_data = q.out_dir / "sft_data", q.out_dir / "tool_data"
    meta = prepare([str(pairs / "train.jsonl"), str(tool_pairs / "train.jsonl")], q.tok_dir, sft_data, opts,
                   overwrite=True, log=lambda m: None, chat=True)
    print(f"      prepare --chat: {meta['documents']} conversations (mined pairs and tool calls), "
          f"{meta['tokens']:,} tokens ({sum(meta['loss_tokens'].values()):,} with loss) -> {sft_data}")
    meta = prepare([str(tool_pairs / "train.jsonl")], q.tok_dir, tool_data, opts, overwrite=True,
                   log=lambda m: None, chat=True)
    print(f"      prepare --chat: {meta['documents']} tool conversations alone, {meta['tokens']:,} tokens -> "
          f"{tool_data} ({minutes(t)})")


def finetune(name: str, data: Path, out: Path, init_from: Path, device: str, training: dict) -> dict:
    """One chat stage's training run (sft or tools) from init_from's weights, with `training` over the stage's
    defaults, resumed where it is there."""
    cfg = resolve([], None, [], {"train.stage": name, "train.data": str(data), "train.out": str(out),
                                 "train.init_from": str(init_from), "train.device": device,
                                 **{f"train.{k}": v for k, v in training.items()}}, vocab_from_data=True)
    return run_stage(cfg, resume=(out / rundir.CHECKPOINTS).exists())


def sft(q: Quickstart, training: dict) -> dict | None:
    """SFT from the pretrained run, then how many replies to held-out requests end with <|im_end|>, before
    and after (a model that never learned to stop rambles on to the token limit)."""
    t = time.perf_counter()
    sft_run = q.out_dir / "sft"
    print(f"{q.head} SFT from {q.run_dir} -> {sft_run}")
    r = finetune("sft", q.out_dir / "sft_data", sft_run, q.run_dir, q.opts.device, training)
    if r["interrupted"]:
        return r
    heldout = [json.loads(x) for x in (q.out_dir / "sft_pairs" / "heldout.jsonl").read_text().splitlines()]
    before = chat_end_rate(Engine.from_run(str(q.run_dir), q.opts.device), heldout, n=20)
    after = chat_end_rate(Engine.from_run(str(sft_run), q.opts.device), heldout, n=20)
    print(f"      replies ending with <|im_end|> on held-out requests: {before['im_end_rate']:.0%} before "
          f"SFT, {after['im_end_rate']:.0%} after ({after['im_end_cases']} requests) ({minutes(t)})")
    q.chat_results.update(sft=r, im_end_before=before, im_end_after=after)
    return None


def train_tools(q: Quickstart, training: dict) -> dict | None:
    t = time.perf_counter()
    tools_run = q.out_dir / "tools"
    print(f"{q.head} tools from {q.out_dir / 'sft'} -> {tools_run}")
    r = finetune("tools", q.out_dir / "tool_data", tools_run, q.out_dir / "sft", q.opts.device, training)
    if r["interrupted"]:
        return r
    print(f"      ({minutes(t)})")
    q.chat_results["tools"] = r
    return None


def tool_calling(q: Quickstart, cases: int) -> dict:
    """Tool calling on held-out cases, greedy: after SFT, after the tools stage, and after it constrained by
    the tool-call grammar; then one request, answered. The chat stages' results are returned here, at the
    end, so that a stage stopped half way returns the pretraining's result and its own alone."""
    t = time.perf_counter()
    sft_run, tools_run = q.out_dir / "sft", q.out_dir / "tools"
    before = tool_calling_eval(Engine.from_run(str(sft_run), q.opts.device), cases, constrained=False)
    eng = Engine.from_run(str(tools_run), q.opts.device)
    after = tool_calling_eval(eng, cases, constrained=False)
    grammar = tool_calling_eval(eng, cases, constrained=True)
    print(f"{q.head} tool calling on {after['tool_cases']} held-out cases, greedy ({minutes(t)}):\n"
          f"      the model alone, after SFT (tool calls mixed in): {tool_scores(before)}\n"
          f"      the model alone, after the tools stage:           {tool_scores(after)}\n"
          f"      constrained (grammar), after the tools stage:     {tool_scores(grammar)}")
    ask = [{"role": "user", "content": "Please read the file src/parser.py"}]
    reply = eng.chat(ask, TOOL_SCHEMAS, SamplingParams(max_new_tokens=96, temperature=0.0))
    print(f"\nchat> {ask[0]['content']}\n{reply['text']}")
    print(f"\nfinished in {(time.perf_counter() - q.started) / 60:.1f} min. Next: codeforge chat --run "
          f"{tools_run} --tools {q.out_dir / 'tool_pairs' / TOOLS_FILE}   |   codeforge eval --run "
          f"{tools_run} --json")
    return {**q.chat_results, "tools_before": before, "tools_after": after,
            "tools_after_constrained": grammar}


def tool_scores(r: dict) -> str:
    def pct(v):
        return "n/a" if v is None else f"{v:.0%}"
    cut = f", {r['tool_cut_by_budget']} cut by the token budget" if r.get("tool_cut_by_budget") else ""
    bad = f", {r['tool_unknown_names']} naming no offered tool" if r.get("tool_unknown_names") else ""
    return (f"parse {pct(r['tool_parse_rate'])}{cut}, right tool {pct(r['tool_name_accuracy'])}, "
            f"exact arguments {pct(r['tool_args_exact'])}, "
            f"no call when none needed {pct(r['no_call_accuracy'])}{bad}")


def minutes(t0: float) -> str:
    return f"{(time.perf_counter() - t0) / 60:.1f} min"
