"""`codeforge eval`: everything a run is scored on, appended to RUN/eval.jsonl and TensorBoard."""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path

from .. import rundir
from ..checkpoint import load_model
from ..config import speaks_chat
from ..data.shards import ShardSet
from ..data.trained import data_identity, seen_in_training, trained_record
from ..device import choose_device, choose_precision
from ..engine import Engine
from ..tasks.code_tasks import TaskError, load_tasks
from ..syntax import guess_language
from ..tokenizer import token_byte_lengths
from .generation import infill_eval, syntax_validity
from .humaneval import humaneval_pass_at_k
from .hrm import run_hrm_eval
from .lm import EvalError, validation_loss
from .tasks import task_eval
from .tool_calls import tool_calling_eval


def run_eval(run: str, data: str | None = None, eval_tokens: int | None = None, syntax_samples: int = 16,
             language: str | None = None, humaneval: int = 0, ks: list[int] = (1, 10),
             samples_per_problem: int = 10,
             max_new_tokens: int = 256, timeout: float = 5.0, which: str = "auto", device: str = "auto",
             tool_cases: int = 100, unsafe_no_sandbox: bool = False, infill: int = 0, hrm_cases: int = 32,
             tasks: str | None = None, task_samples: int = 1, task_temperature: float = 0.0,
             task_limit: int = 0, constrained: bool = True, validation: dict | None = None) -> dict:
    """Everything `codeforge eval` reports, appended to RUN/eval.jsonl and to TensorBoard. eval_tokens:
    validation targets scored (default: the run's own train.eval_tokens, so the number equals the one
    training printed for the same checkpoint). tasks: a JSONL of tasks with hidden tests or a `codeforge
    make-tasks` directory (its held-out test split): pass rates of any GPT run (task_limit: the first N).
    constrained=False: tool calls decoded without the schema grammar (the bare model's tool scores).
    validation: numbers training already measured for this checkpoint ({val_loss, perplexity, bits_per_byte,
    eval_tokens, validation_step}), used instead of scoring it again when validation_step is its step."""

    dev, _ = choose_device(device)
    model, tok, ck, cfg = load_model(run, dev, which)
    # as training evaluated
    precision, _ = choose_precision(dev, cfg.get("train", {}).get("precision", "auto"))
    step = int(ck.name.split("_")[-1]) if ck.name.startswith("step_") else 0
    if cfg["model"].get("arch") == "hrm":
        r = {"run": str(run), "checkpoint": str(ck), "step": step, "data": str(data or cfg["train"]["data"])}
        r.update(run_hrm_eval(run, model, tok, ck, cfg, dev, precision, data, eval_tokens, hrm_cases,
                                step=_step))
        return _record_eval(run, ck, step, r)

    r: dict = {"run": str(run), "checkpoint": str(ck), "step": step}
    if tasks:
        try:
            todo = load_tasks(tasks, split="heldout") if Path(tasks).is_dir() else load_tasks(tasks)
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
                        f"--data DIR (from `codeforge prepare`) for loss and syntax metrics, or --tasks "
                        f"TASKS for pass rates")
    val = ShardSet(data, "val")
    if val.tokens == 0:
        print(f"warning: {data} has an empty validation split; evaluating on the training split (optimistic)",
              file=sys.stderr)
        val = ShardSet(data, "train")
    val.check_tokenizer(tok.hash, f"the checkpoint's tokenizer ({ck})")
    r.update({"data": str(data), "eval_split": val.split})
    r.update(_unseen_check(ck.parent.parent, data, val.split, cfg))
    T = cfg["model"]["block_size"]
    token_bytes = token_byte_lengths(tok, cfg["model"]["vocab_size"])
    if eval_tokens is None:
        eval_tokens = cfg["train"].get("eval_tokens", 262_144)
    if validation is not None and validation.get("validation_step") == step:
        # training scored this very checkpoint on the same tokens (the quickstart passes its numbers)
        r.update({k: v for k, v in validation.items() if k != "validation_step"})
    else:
        try:
            read = min(eval_tokens or val.tokens, val.tokens)
            with _step(f"validation loss on {read:,} tokens of the {val.split} split" if not val.chat else
                       f"validation loss on the {val.split} split's replies (up to {read:,} tokens read; in "
                       f"chat data only the assistant's tokens are scored)"):
                r.update(validation_loss(model, val, T, tok.special_ids, eval_tokens, dev, precision,
                                         token_bytes))
        except ValueError as e:
            raise EvalError(f"{e}; prepare more data (or a larger --val-fraction)") from e
    eng = Engine(model, tok, dev, precision)
    chat = val.chat or speaks_chat(cfg)
    r["chat"] = chat
    if chat and tool_cases:
        with _step(f"tool calling on {tool_cases} held-out cases"
                   + ("" if constrained else " (unconstrained)")):
            r.update(tool_calling_eval(eng, tool_cases, constrained=constrained))
    if syntax_samples and not val.chat:
        docs = [tok.decode(val.document(i).tolist()) for i in range(min(200, val.documents))]
        if language:
            docs = [d for d in docs if guess_language(d) == language]
        with _step(f"syntax of up to {syntax_samples} completions of functions in {len(docs)} "
                   "validation file(s)"):
            r.update(syntax_validity(eng, docs, syntax_samples, max_new_tokens=min(max_new_tokens, 128)))
    else:
        r["syntax_valid_rate"] = None
    if infill and not val.chat:
        docs = [tok.decode(val.document(i).tolist()) for i in range(min(400, val.documents))]
        with _step(f"fill-in-the-middle on {infill} masked lines and {infill} spans"):
            r.update(infill_eval(eng, docs, infill))
    if humaneval and not val.chat:
        with _step(f"HumanEval: {humaneval} problems x {samples_per_problem} samples, run in the sandbox"):
            r.update(humaneval_pass_at_k(eng, humaneval, samples_per_problem, list(ks), max_new_tokens,
                                         timeout, unsafe_no_sandbox=unsafe_no_sandbox))
    else:
        r.update({"pass_at_1": None, "pass_at_k": {}})
    return _record_eval(run, ck, step, r)


def _unseen_check(run_dir: Path, data: str, split: str, cfg: dict) -> dict:
    """Whether the documents scored were kept out of the run's training, said loudly when they were not (or
    cannot be known): {"val_documents", "val_trained_on"} where both sides recorded their documents."""
    seen = seen_in_training(run_dir, data, split)
    if split == "train":  # the validation split is empty: said above; the count says what it means
        return {"val_documents": seen["documents"], "val_trained_on": seen["trained_on"]} if seen else {}
    if seen is not None:
        if seen["trained_on"]:
            print(f"WARNING: {seen['trained_on']} of the {seen['documents']} documents in {data}'s {split} "
                  "split were in this run's training data, so the scores below flatter the model (the data "
                  "was prepared again with another split or corpus, or --data names other data). Score a run "
                  "on the data it was trained with, or on documents it never saw.", file=sys.stderr,
                  flush=True)
        return {"val_documents": seen["documents"], "val_trained_on": seen["trained_on"],
                **({} if seen["complete"] else {"val_note": f"at least; not recorded: {seen['unknown']}"})}
    record = trained_record(run_dir)
    if not record.complete:  # a fine-tune of an imported model, a chat run: what else it saw has no key
        return {"val_trained_on": None,
                "val_note": f"not all the run trained on is recorded: {record.unknown}"}
    saved = cfg.get("data_identity")
    if saved and Path(data).resolve() == Path(cfg["train"].get("data", "")).resolve():
        try:
            changed = data_identity(data) != saved
        except (OSError, ValueError, KeyError):
            changed = True
        if changed:
            print(f"WARNING: {data} changed since this run trained on it (prepared again?), and neither "
                  f"records its documents, so whether the {split} split holds documents the run trained on "
                  "cannot be checked: the scores below may flatter the model", file=sys.stderr, flush=True)
            return {"val_trained_on": None, "val_note": "the data changed since training; overlap unknown"}
    return {}


@contextlib.contextmanager
def _step(what: str):
    """One line on stderr when a part of the evaluation starts and one when it ends, with its time: a
    CPU evaluation takes minutes, and silence reads as a hang."""
    print(f"eval: {what}...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    yield
    print(f"eval: {what}: done in {time.perf_counter() - t0:.0f}s", file=sys.stderr, flush=True)


def _is_prepared(data: str) -> bool:
    """Whether `data` is a `codeforge prepare` directory (the miners' directories hold a meta.json too)."""
    try:
        return (
            json.loads((Path(data) / "meta.json").read_text())
            .get("format", "")
            .startswith("codeforge-shards")
        )
    except (OSError, ValueError, AttributeError):
        return False


def record_eval(run: str, r: dict, ck: Path | None = None) -> Path:
    """Stamp a result and append it to RUN/eval.jsonl; returns RUN. run: a run directory, or one of its
    checkpoints (ck: the checkpoint it was scored at, when known)."""
    r["time"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    p = Path(run)
    run_dir = p if (p / rundir.CHECKPOINTS).exists() else (ck or p).parent.parent
    with open(run_dir / rundir.EVAL, "a") as f:
        f.write(json.dumps(r) + "\n")
    return run_dir


def _record_eval(run: str, ck, step: int, r: dict) -> dict:
    """Stamp the result, append it to RUN/eval.jsonl and TensorBoard, return it."""
    run_dir = record_eval(run, r, ck)
    try:
        from torch.utils.tensorboard import SummaryWriter
        with SummaryWriter(str(run_dir / rundir.TENSORBOARD)) as w:
            for k, v in r.items():
                if isinstance(v, (int, float)) and k != "step":
                    w.add_scalar(f"eval/{k}", v, step)
    except ImportError:
        pass
    return r
