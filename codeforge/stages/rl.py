"""Reinforcement-learning stages on programming tasks with hidden tests, from a trained (SFT) run:

- `ppo` (seed 003, InstructGPT-style; Ouyang et al. 2022): a value head on the policy's hidden states, a
  frozen reference with a per-token KL penalty in the reward, the sample's score (the reward model's,
  execution's, or both) at its last token, GAE, the clipped objective, several epochs per rollout.
- `grpo` (Shao et al. 2024): group_size samples per task, advantages normalised within each group (no
  value model), the clipped ratio with token-level normalisation, an optional KL to the reference (off by
  default), execution rewards.

Execution rewards run each sample once, all in parallel, in the sandbox (sandbox.py), with partial credit
(tasks/code_tasks.py: does not parse < runtime error < fails tests < passes). A program that exits before
its values came back earns nothing and is counted (`early_exit`); so does one that returns an object
instead of data (`not_data`, an always-equal object). The verdict is judged outside the box from the
values the program returns (tasks whose tests do not split that way are left out), so a pass cannot be
forged; completions the name screen flags (frames, report pipes, their own file) are counted and get no
partial credit.

The trainer sees an ordinary batch source: `Rollouts.__next__` samples a rollout with the current policy
when the previous one is used up, then hands out its micro-batches, ppo_epochs passes in a seeded order.
The rollout in progress is part of the batch source's state, so --resume continues exactly. Every rollout's
statistics are appended to RUN/rollouts.jsonl.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from .. import checkpoint as ckpt_io
from .. import rundir
from ..config import RL_STAGES, ConfigError, RunConfig, speaks_chat
from ..device import autocast
from ..evaluation.tasks import sample_tasks, task_eval
from ..tasks.code_tasks import (HELDOUT_NAMES, TaskError, end_id, execution_rewards, load_tasks, split_tests,
                                task_prompt_ids, validate_tasks)
from ..train import losses
from ..train.resume import jsonl_identity
from .common import (Run, begin, budget, built, frozen_copy, init_from, launch, record_documents, start_point,
                     train)


MISSING_END_PENALTY = 1.0  # the reward-model score of a sample that never wrote its end token


def load_task_splits(path: str, say) -> tuple[list[dict], list[dict]]:
    """(training tasks, held-out tasks): a make-tasks directory's train.jsonl and heldout.jsonl, or one JSONL
    file (then every 10th task is held out). Tasks whose tests do not parse, or fail on the task's own
    reference solution, are reported and skipped; so are tasks whose tests do not split into calls and
    expected values (their verdict would come from inside the box, where a program can forge it)."""
    p = Path(path)
    try:
        if p.is_dir():
            train, held = load_tasks(p, split="train"), load_tasks(p, split="heldout")
        else:
            rows = load_tasks(p)
            train = [t for i, t in enumerate(rows) if i % 10 != 9]
            held = [t for i, t in enumerate(rows) if i % 10 == 9]
    except TaskError as e:
        raise ConfigError(str(e)) from e
    out = []
    for name, tasks in (("training", train), ("held-out", held)):
        unsplit = [(t, why) for t in tasks
                   if isinstance(why := split_tests(t["tests"], t.get("entry_point")), str)]
        if unsplit:  # rewards must come from a verdict the program cannot forge
            t, why = unsplit[0]
            say(f"left out {len(unsplit)} {name} task(s) whose tests do not split into calls and expected "
                f"values (first: {t['id']}: {why}); RL rewards use only verdicts judged outside the sandbox")
            bad = {id(t) for t, _ in unsplit}
            tasks = [t for t in tasks if id(t) not in bad]
        kept, skipped = validate_tasks(tasks)
        for s in skipped[:5]:
            say(f"skipped {name} task {s['id']}: {s['reason']}")
        if len(skipped) > 5:
            say(f"... and {len(skipped) - 5} more {name} task(s) skipped")
        out.append(kept)
    say(f"{path}: {len(out[0])} training task(s), {len(out[1])} held out")
    if not out[0]:
        raise ConfigError(f"{path}: no usable training tasks (each needs a prompt and tests that run)")
    return out[0], out[1]


class ValueHead(torch.nn.Module):
    """PPO's critic: a linear probe on the policy's final hidden states (detached, so the value loss never
    pulls on the policy's features), one value per position."""

    def __init__(self, n_embd: int):
        super().__init__()
        self.v = torch.nn.Linear(n_embd, 1)
        torch.nn.init.zeros_(self.v.weight)
        torch.nn.init.zeros_(self.v.bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.v(h.detach().float()).squeeze(-1)


class Rollouts:
    """The batch source of the RL stages (see the module docstring)."""

    def __init__(self, variant: "PolicyVariant", policy, tok, tasks: list[dict], t, device, precision: str,
                 chat: bool, ref=None, reward_model=None, value_head=None, run_dir: Path | None = None,
                 rank: int = 0, world: int = 1):
        self.variant, self.policy, self.tok, self.tasks, self.t = variant, policy, tok, tasks, t
        self.device, self.precision, self.chat = device, precision, chat
        self.ref, self.rm, self.value = ref, reward_model, value_head
        self.log_file = run_dir / rundir.ROLLOUTS if run_dir is not None and rank == 0 else None
        self.rank, self.world = rank, world
        self.per_round = min(max(1, t.rollout_tasks // world), len(tasks) // world)
        if self.per_round < 1:
            raise ConfigError(
                f"{len(tasks)} training task(s) for {world} rank(s): every rank needs at least one")
        self.rows = self.per_round * t.group_size
        self.chunks = t.ppo_epochs * math.ceil(self.rows / t.batch_size)
        self.rounds_per_epoch = max(1, len(tasks) // (self.per_round * world))
        self.round, self.cursor, self.buf = 0, 0, None
        self.use_exec = t.rewards in ("execution", "both") or (t.rewards == "auto" and reward_model is None)
        self.use_rm = reward_model is not None and t.rewards in ("model", "both", "auto")
        self.pad = tok.special_ids.get("<pad>", 0)

    def __iter__(self):
        return self

    # -- one rollout -----------------------------------------------------------------------------------------
    def _tasks_of_round(self, r: int) -> list[dict]:
        epoch, k = divmod(r, self.rounds_per_epoch)
        order = list(range(len(self.tasks)))
        random.Random(f"{self.t.seed}:tasks:{epoch}").shuffle(order)
        span = self.per_round * self.world
        chunk = order[k * span:(k + 1) * span][self.rank::self.world]
        return [self.tasks[i] for i in chunk]

    @torch.no_grad()
    def _rollout(self) -> dict:
        t, G = self.t, self.t.group_size
        tasks = self._tasks_of_round(self.round)
        was_training = self.policy.training
        samples = sample_tasks(self.policy, self.tok, self.device, self.precision, tasks, self.chat, G,
                               t.rollout_tokens, t.rollout_temperature,
                               seed=(t.seed * 1_000_003 + self.round * 7919 + self.rank) % 2**63)
        self.policy.train(was_training)
        # sequences: prompt + response, right-padded; targets only on the response
        seqs = [pr + resp for pr, resp, _ in samples]
        T = max(len(s) for s in seqs) - 1
        ids = torch.full((len(seqs), T + 1), self.pad, dtype=torch.long)
        tg = torch.full((len(seqs), T), -1, dtype=torch.long)
        for i, (pr, resp, _) in enumerate(samples):
            s = pr + resp
            ids[i, :len(s)] = torch.tensor(s)
            if resp:
                tg[i, len(pr) - 1:len(s) - 1] = torch.tensor(resp)
        ids, tg = ids.to(self.device), tg.to(self.device)
        x, mask = ids[:, :-1], tg >= 0
        lengths = mask.sum(1)
        exec_res = execution_rewards([tk for tk in tasks for _ in range(G)], [s[2] for s in samples],
                                     trusted_only=True) \
            if self.use_exec else None
        score = torch.zeros(len(seqs), device=self.device)
        if exec_res is not None:
            score += torch.tensor([r["reward"] for r in exec_res], device=self.device)
        rm_scores = None
        if self.use_rm:
            last = torch.tensor([len(pr) + len(resp) - 1 for pr, resp, _ in samples], device=self.device)
            rm_scores = self.rm.scores(ids, last)
            # A sample cut at the token budget never reached the end token the reward model was trained to
            # read at: its score there is out of distribution and the policy learns to ramble for it (seen in
            # the tests). Such samples get the penalty instead (TRL's missing-EOS penalty, the same idea).
            end = end_id(self.tok, self.chat)
            ended = torch.tensor([bool(resp) and resp[-1] == end for _, resp, _ in samples],
                                 device=self.device)
            rm_scores = torch.where(ended, rm_scores, torch.full_like(rm_scores, -MISSING_END_PENALTY))
            score += rm_scores
        with autocast(self.device, self.precision):  # as in training, so the first ratio is 1
            h = self.policy(x, return_hidden=True)
            old_logp = losses.token_logprobs(F.linear(h, self.policy.lm_head.weight), tg)
            ref_logp = losses.token_logprobs(self.ref(x), tg) if self.ref is not None else None
        buf = {"x": x, "targets": tg, "old_logp": old_logp}
        if ref_logp is not None:
            buf["ref_logp"] = ref_logp
        buf.update(self.variant.advantages(self, h, score, mask, lengths, old_logp, ref_logp))
        outcomes: dict[str, int] = {}
        for r in exec_res or []:
            outcomes[r["outcome"]] = outcomes.get(r["outcome"], 0) + 1
        stats = {"reward": score.mean().item(), "response_tokens": lengths.float().mean().item()}
        if exec_res is not None:
            stats.update(pass_rate=outcomes.get("passed", 0) / len(exec_res),
                         syntax_valid=1 - outcomes.get("no_parse", 0) / len(exec_res),
                         early_exit=outcomes.get("early_exit", 0) / len(exec_res),
                         tampering=outcomes.get("tampering", 0) / len(exec_res))
        if rm_scores is not None:
            stats["rm_score"] = rm_scores.mean().item()
        if ref_logp is not None:
            stats["kl"] = losses.masked_mean(old_logp - ref_logp, mask).item()
        if self.log_file is not None:
            with open(self.log_file, "a") as f:
                f.write(json.dumps({"round": self.round, "tasks": [tk["id"] for tk in tasks], **stats,
                                    "outcomes": outcomes}) + "\n")
        buf["stats"] = stats
        return buf

    # -- the batch source ------------------------------------------------------------------------------------
    def __next__(self) -> dict:
        if self.buf is None or self.cursor >= self.chunks:
            if self.buf is not None:
                self.round += 1
            self.buf, self.cursor = self._rollout(), 0
        per_epoch = math.ceil(self.rows / self.t.batch_size)
        epoch, k = divmod(self.cursor, per_epoch)
        order = list(range(self.rows))
        random.Random(f"{self.t.seed}:mb:{self.round}:{epoch}").shuffle(order)
        idx = torch.tensor(order[k * self.t.batch_size:(k + 1) * self.t.batch_size], device=self.device)
        self.cursor += 1
        mb = {k: v[idx] for k, v in self.buf.items() if torch.is_tensor(v)}
        mb["stats"] = self.buf["stats"]
        return mb

    def state_dict(self) -> dict:
        buf = None if self.buf is None else {k: (v.cpu() if torch.is_tensor(v) else v)
                                             for k, v in self.buf.items()}
        return {"round": self.round, "cursor": self.cursor, "buffer": buf, "tasks": len(self.tasks)}

    def load_state_dict(self, s: dict) -> None:
        if s.get("tasks") != len(self.tasks):
            raise ValueError(f"the checkpoint counted {s.get('tasks')} training tasks, the data now holds "
                             f"{len(self.tasks)}")
        self.round, self.cursor = s["round"], s["cursor"]
        b = s.get("buffer")
        self.buf = None if b is None else {k: (v.to(self.device) if torch.is_tensor(v) else v)
                                           for k, v in b.items()}


def last_positions(mask: torch.Tensor) -> torch.Tensor:
    """Each row's last response position (0 for an empty response, which is masked anyway)."""
    idx = torch.arange(mask.size(1), device=mask.device).expand_as(mask)
    return torch.where(mask, idx, torch.zeros_like(idx)).max(1).values


# -- what differs between the RL stages: advantages and the loss's extra term --------------------------------

def group_advantages(ro: Rollouts, h, score, mask, lengths, old_logp, ref_logp) -> dict:
    """GRPO: each sample's score against its group's (no value model)."""
    return {"advantages": losses.group_advantages(score, ro.t.group_size)}


def gae_advantages(ro: Rollouts, h, score, mask, lengths, old_logp, ref_logp) -> dict:
    """PPO: a KL penalty per token, the score at the last response token, GAE over the value head, the
    advantages whitened over the rollout's tokens."""
    t = ro.t
    values = ro.value(h) * mask
    rewards = torch.zeros_like(old_logp)
    if ref_logp is not None and t.kl_coef:
        rewards -= t.kl_coef * (old_logp - ref_logp) * mask
    has = lengths > 0
    rows = torch.arange(len(score), device=score.device)[has]
    rewards[rows, last_positions(mask)[has]] += score[has]
    adv, ret = losses.gae(rewards, values, mask, t.gae_gamma, t.gae_lambda)
    n = mask.sum().clamp(min=1)
    mean = (adv * mask).sum() / n
    std = (((adv - mean) ** 2 * mask).sum() / n).sqrt()
    return {"advantages": (adv - mean) / (std + 1e-6) * mask, "returns": ret, "old_values": values}


def value_term(t, value_head, h, logp, mask, b: dict) -> tuple[torch.Tensor | None, dict]:
    """PPO: the value head's clipped loss, weighted by vf_coef."""
    vl = losses.clipped_value_loss(value_head(h), b["old_values"], b["returns"], mask, t.clip_eps)
    return t.vf_coef * vl, {"value_loss": vl.detach()}


def kl_term(t, value_head, h, logp, mask, b: dict) -> tuple[torch.Tensor | None, dict]:
    """GRPO: the k3 KL to the reference, when kl_coef > 0 (the reward holds no KL here)."""
    if not (t.kl_coef and "ref_logp" in b):
        return None, {}
    kl = losses.masked_mean(losses.kl_k3(logp, b["ref_logp"]), mask)
    return t.kl_coef * kl, {"kl_k3": kl.detach()}


@dataclass(frozen=True)
class PolicyVariant:
    """What an RL stage is beside the rollouts, the clipped objective and the evaluation every one shares."""
    value_head: bool  # a critic trained beside the policy (the Trainer's aux module)
    # (rollouts, hidden, score, mask, lengths, old_logp, ref_logp) -> the buffer's entries
    advantages: Callable
    extra: Callable  # (train settings, value head, hidden, logp, mask, batch) -> (term or None, metrics)
    min_group: int  # the smallest --group-size it can learn from


VARIANTS = {
    "ppo": PolicyVariant(value_head=True, advantages=gae_advantages, extra=value_term, min_group=1),
    "grpo": PolicyVariant(value_head=False, advantages=group_advantages, extra=kl_term, min_group=2),
}
if set(VARIANTS) != set(RL_STAGES):  # a stage of kind "rl" without its row here would train nothing known
    raise ImportError(f"stages/rl.py has rows for {sorted(VARIANTS)}, config.py's rl stages are "
                      f"{sorted(RL_STAGES)}")


def policy_loss(
    variant: PolicyVariant, t, value_head, fwd, lm_weight_of, b: dict
) -> tuple[torch.Tensor, dict]:
    """The clipped surrogate on a micro-batch of a rollout, plus the variant's extra term (ppo: the value
    head's loss; grpo: the k3 KL to the reference when kl_coef > 0). Metrics: the rollout's statistics and
    the loss's own."""
    h = fwd(b["x"], return_hidden=True)
    logp = losses.token_logprobs(F.linear(h, lm_weight_of()), b["targets"])
    mask = b["targets"] >= 0
    loss, m = losses.clipped_policy_loss(logp, b["old_logp"], b["advantages"], mask, t.clip_eps)
    term, more = variant.extra(t, value_head, h, logp, mask, b)
    if term is not None:
        loss = loss + term
    return loss, {**b["stats"], **m, **more}


def run(cfg: RunConfig, resume: bool = False, log=print) -> dict:
    t = cfg.train
    if not t.data or not t.out:
        raise ConfigError(f"--stage {t.stage} needs --data TASKS (a JSONL file of prompt/tests, or a "
                          f"`codeforge make-tasks` directory) and --out RUN")
    if not Path(t.data).exists():
        raise ConfigError(f"--data {t.data} does not exist; make tasks with `codeforge make-tasks --out "
                          f"{t.data}` or pass your own JSONL (prompt, tests)")
    if t.rewards in ("model", "both") and not t.reward_model:
        raise ConfigError(f"--rewards {t.rewards} needs --reward-model RUN (from --stage reward)")
    if t.group_size < VARIANTS[t.stage].min_group:
        raise ConfigError(f"--stage {t.stage} compares samples within a group: --group-size must be at least "
                          f"{VARIANTS[t.stage].min_group}")
    with launch(cfg, log) as run:
        return _train(run, resume)


def _train(run: Run, resume: bool) -> dict:
    say, device, precision, rank, world = run.say, run.device, run.precision, run.rank, run.world
    t = run.cfg.train
    variant = VARIANTS[t.stage]
    # -- the starting point and the tasks -------------------------------------------------------------------
    tok, init_ck, saved = start_point(run.cfg, say)
    m = run.cfg.validate().model
    chat = speaks_chat(saved)
    train_tasks, held_tasks = load_task_splits(t.data, say)
    if t.eval_tasks:
        held_tasks = held_tasks[:t.eval_tasks]
    room = m.block_size - min(t.rollout_tokens, m.block_size // 2)
    fits = [[tk for tk in ts if len(task_prompt_ids(tok, tk, chat)) <= room]
            for ts in (train_tasks, held_tasks)]
    if sum(map(len, fits)) < len(train_tasks) + len(held_tasks):
        say(f"skipped {len(train_tasks) - len(fits[0])} training and {len(held_tasks) - len(fits[1])} "
            f"held-out task(s) whose prompt leaves no room for an answer in the context of {m.block_size}")
    train_tasks, held_tasks = fits
    if not train_tasks:
        raise ConfigError(f"no training task fits the context of {m.block_size} tokens "
                          "with room for an answer")

    # -- the start: lock, recorded config, resume point ------------------------------------------------------
    began = begin(run, run.cfg, resume, tok,
                  jsonl_identity(t.data, tok.hash, ("train.jsonl", *HELDOUT_NAMES)), chat=chat)
    cfg, t = began.cfg, began.cfg.train

    # The policy's targets are its own samples (a task's prompt carries no loss): it trains on no new text, so
    # the record is the starting run's, with the reward model's when one scores the samples (the policy is
    # pulled toward what that model learned from)
    use_rm = t.reward_model and t.rewards in ("auto", "model", "both")
    record_documents(run, began, started_from=t.init_from, also_from=(t.reward_model,) if use_rm else ())

    # -- models: the policy, its reference, the reward model, the value head --------------------------------
    model = built(cfg).to(device)
    if began.start is None:
        init_from(run, model, tok, ck=init_ck, why=f" ({'chat template' if chat else 'plain-text prompts'})")
    ref = frozen_copy(m, init_ck, device) if t.kl_coef > 0 else None
    rm = None
    if use_rm:
        rm, rm_tok, rm_ck, _ = ckpt_io.load_model(t.reward_model, device, log=say)
        if getattr(rm.cfg, "arch", "") != "reward":
            raise ConfigError(f"--reward-model {rm_ck} is not a reward model (arch {rm.cfg.arch}); train one "
                              f"with --stage reward")
        if rm_tok.hash != tok.hash:
            raise ConfigError(f"--reward-model {rm_ck} uses tokenizer {rm_tok.hash}, the policy {tok.hash}; "
                              f"it must score the policy's tokens")
        for p in rm.parameters():
            p.requires_grad_(False)
    value = ValueHead(m.n_embd).to(device) if variant.value_head else None
    rollouts = Rollouts(variant, model, tok, train_tasks, t, device, precision, chat, ref, rm, value, run.dir,
                        rank, world)
    src = ("reward model + execution" if rollouts.use_exec and rollouts.use_rm else
           "reward model" if rollouts.use_rm else "execution in the sandbox")
    steps_per_round = math.ceil(rollouts.chunks / t.grad_accum_steps)
    tokens_per_step = t.batch_size * t.rollout_tokens * t.grad_accum_steps * world
    total = budget(cfg, tokens_per_step,
                   max(1, round((t.epochs or 1.0) * rollouts.rounds_per_epoch * steps_per_round)))
    say(f"{t.stage}: rewards from {src}; {rollouts.per_round * world} task(s) x {t.group_size} sample(s) a "
        f"rollout, {t.ppo_epochs} epoch(s) of {rollouts.chunks // t.ppo_epochs} micro-batch(es) each "
        f"({steps_per_round} step(s) a rollout); {total} steps; KL to the reference "
        f"{t.kl_coef if ref is not None else 'off'}")
    if t.grad_accum_steps > rollouts.chunks:
        raise ConfigError(f"--grad-accum-steps {t.grad_accum_steps} is more than the {rollouts.chunks} "
                          f"micro-batches of a rollout")

    def loss_fn(fwd, b):
        return policy_loss(variant, t, value, fwd, lambda: model.lm_head.weight, b)

    def evaluate(mdl):
        if not held_tasks:
            return None
        r = task_eval(mdl, tok, device, precision, held_tasks, chat, max_new_tokens=t.rollout_tokens)
        extra = {k: v for k, v in r.items() if k != "task_outcomes"}
        return {"objective": -r["task_mean_reward"], "extra": extra,
                "message": f"held-out tasks: pass@1 {r['task_pass_at_1']:.1%} "
                           f"({r['task_solved']}/{r['tasks']}), syntax-valid {r['task_syntax_valid']:.1%}, "
                           f"mean reward {r['task_mean_reward']:.3f}, outcomes {r['task_outcomes']}"}

    # -- train ----------------------------------------------------------------------------------------------
    return train(run, began, model, rollouts, loss_fn, total_steps=total, tokens_per_step=tokens_per_step,
                 tok=tok, evaluate=evaluate, aux=value)
