"""Pass rates on programming tasks with hidden tests (tasks/code_tasks.py): samples per task, each run once
in the sandbox, and the unbiased pass@1. The RL stages sample their rollouts with the same function."""

from __future__ import annotations

from collections import Counter

import torch

from ..engine import Engine, SamplingParams
from ..tasks.code_tasks import end_id, execution_rewards, task_prompt_ids
from ..tokenizer import CodeTokenizer
from .generation import pass_at_k
from .lm import EvalError


@torch.no_grad()
def sample_tasks(model, tok: CodeTokenizer, device, precision: str, tasks: list[dict], chat: bool, n: int,
                 max_new_tokens: int, temperature: float,
                 seed: int) -> list[tuple[list[int], list[int], str]]:
    """n samples for each task (task-major: the n of task 0 first): (prompt ids, response ids including the
    end token when one was written, response text without it). One batched generation; the model is left
    in eval mode."""
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
    early_exit: a program that exited before its values came back; not_data ...) and how many samples the
    name screen flagged (task_suspect). task_pass_at_1, task_solved and the mean reward count only tasks
    judged outside the box (task_judged_outside of them; None when there is none); task_judged says how many
    samples were judged each way, task_in_box_passed how many in-box checks ran to their end (reported
    apart: a program can forge that)."""
    if not tasks:
        raise EvalError("no tasks to evaluate")
    n = samples if temperature > 0 else 1
    out = sample_tasks(model, tok, device, precision, tasks, chat, n, max_new_tokens, temperature, seed)
    res = execution_rewards([t for t in tasks for _ in range(n)], [o[2] for o in out], timeout=timeout,
                            unsafe_no_sandbox=unsafe_no_sandbox)
    outcomes: dict[str, int] = dict(Counter(r["outcome"] for r in res))
    suspect = sum(r["suspect"] is not None for r in res)
    outside = [i for i in range(len(tasks)) if res[i * n]["verdict"] == "outside"]  # one verdict per task
    per_task = [sum(r["outcome"] == "passed" for r in res[i * n:(i + 1) * n]) for i in outside]
    judged = [r for r in res if r["verdict"] == "outside"]
    return {"task_pass_at_1": sum(pass_at_k(n, c, 1) for c in per_task) / len(per_task) if per_task else None,
            "task_solved": sum(c > 0 for c in per_task), "tasks": len(tasks), "task_samples": n,
            "task_syntax_valid": 1 - outcomes.get("no_parse", 0) / len(res),
            "task_mean_reward": sum(r["reward"] for r in judged) / len(judged) if judged else None,
            "task_mean_tokens": sum(len(o[1]) for o in out) / len(out), "task_outcomes": outcomes,
            "task_judged": {"outside": len(judged), "in_box": len(res) - len(judged)},
            "task_judged_outside": len(outside), "task_in_box_passed": outcomes.get("passed_in_box", 0),
            "task_suspect": suspect}


def score_completions(tasks: list[dict], rows: list[dict], ks: list[int] = (1,), timeout: float = 5.0,
                      unsafe_no_sandbox: bool = False) -> tuple[dict, list[dict]]:
    """(summary, per-sample results) of given completions, no model: rows are {"task_id", "completion"}
    (task_id: a task's "id"; several rows per task are several samples). pass@k over the tasks judged
    outside the box that have rows (k up to the fewest samples of such a task; None when there is none),
    counting only passes judged outside; the mean execution reward of those samples; the outcomes; `judged`:
    samples judged outside and in the box; `tasks_in_box` and `in_box_passed` (in-box checks that ran to
    their end, reported apart: a program can forge that). Each result is its row plus execution_rewards'
    "reward", "outcome", "detail", "verdict", "suspect" and "passed" (judged outside and passed)."""
    by_id = {t["id"]: t for t in tasks}
    for i, r in enumerate(rows):
        if r["task_id"] not in by_id:
            raise EvalError(f"completion {i + 1}: task_id {r['task_id']!r} is not one of the {len(tasks)} "
                            f"tasks (e.g. {next(iter(by_id))!r})")
    res = execution_rewards([by_id[r["task_id"]] for r in rows], [r["completion"] for r in rows],
                            timeout=timeout, unsafe_no_sandbox=unsafe_no_sandbox)
    out = [r | x | {"passed": x["outcome"] == "passed" and x["verdict"] == "outside"}
           for r, x in zip(rows, res)]
    per_task: dict[str, list[bool]] = {}
    for r in out:
        if r["verdict"] == "outside":
            per_task.setdefault(r["task_id"], []).append(r["passed"])
    n_min = min((len(v) for v in per_task.values()), default=0)
    summary: dict = {f"pass@{k}": (sum(pass_at_k(len(v), sum(v), k)
                                       for v in per_task.values()) / len(per_task)
                                   if per_task else None) for k in ks if k <= n_min or not per_task}
    judged = [r for r in out if r["verdict"] == "outside"]
    used = dict.fromkeys(r["task_id"] for r in out)
    summary.update({"tasks": len(used), "samples": len(out),
                    "mean_reward": sum(r["reward"] for r in judged) / len(judged) if judged else None,
                    "outcomes": dict(Counter(r["outcome"] for r in out)),
                    "judged": {"outside": len(judged), "in_box": len(out) - len(judged)},
                    "judged_outside": len(judged),
                    "tasks_judged_outside": len(per_task),
                    "tasks_in_box": [t for t in used if t not in per_task],
                    "in_box_passed": sum(r["outcome"] == "passed_in_box" for r in out),
                    "suspect": sum(r["suspect"] is not None for r in out)})
    return summary, out
