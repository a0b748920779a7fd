"""Every loss in one place, one ignore convention: targets == IGNORE_INDEX (-1) carry no loss.

- lm_loss (models/lm_loss.py, where the model's forward calls it): next-token cross-entropy, plain or
  fused-chunked; training, evaluation and SFT share one path.
- sequence_logprobs / token_logprobs: log-probabilities of the counted targets, summed per row or per token.
- lm_loss_fn: the `loss_fn(model, batch) -> (loss, metrics)` the trainer is handed for LM-style stages.
- Preference and policy losses (stages/prefs.py, stages/rl.py), each tested against hand-computed values:
  bradley_terry_loss (reward model), dpo_loss (Rafailov et al. 2023), gae (Schulman et al. 2016),
  group_advantages (GRPO, Shao et al. 2024), clipped_policy_loss (PPO, Schulman et al. 2017), kl_k3 (the
  unbiased, non-negative KL estimator GRPO uses), clipped_value_loss, masked_mean.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..models.lm_loss import IGNORE_INDEX


def sequence_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(B,) sum over each row of log p(target) for the counted targets (!= -1): the log-likelihood of a
    response given its prompt when the prompt's targets are -1 (DPO, Rafailov et al. 2023, eq. 7)."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # (B, T, vocab)
    valid = targets != IGNORE_INDEX
    picked = logp.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)  # (B, T)
    return (picked * valid).sum(-1)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(B, T) log p(target) per position in float32, 0 where the target is -1."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    picked = logp.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return picked * (targets != IGNORE_INDEX)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of x where mask is true (0, not NaN, over an empty mask)."""
    m = mask.to(x.dtype)
    if dim is None:
        return (x * m).sum() / m.sum().clamp(min=1)
    return (x * m).sum(dim) / m.sum(dim).clamp(min=1)


def bradley_terry_loss(r_chosen: torch.Tensor, r_rejected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean -log sigmoid(r_chosen - r_rejected), accuracy): the negative log-likelihood of the preferences
    under the Bradley-Terry model (InstructGPT's reward-model loss); accuracy counts r_chosen > r_rejected."""
    d = r_chosen.float() - r_rejected.float()
    return -F.logsigmoid(d).mean(), (d > 0).float().mean()


def dpo_loss(pi_chosen: torch.Tensor, pi_rejected: torch.Tensor, ref_chosen: torch.Tensor,
             ref_rejected: torch.Tensor, beta: float) -> tuple[torch.Tensor, dict]:
    """DPO (Rafailov et al. 2023, eq. 7) from summed response log-probs (B,) under the policy and the frozen
    reference: -log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r))), averaged. Metrics: the implicit rewards
    beta * (pi - ref) of each side, their margin, and the shares of pairs ranked right and tied (a tie counts
    as not right: at the first step, where the policy is the reference, every pair ties)."""
    rc, rr = (
        beta * (pi_chosen.float() - ref_chosen.float()),
        beta * (pi_rejected.float() - ref_rejected.float()),
    )
    loss = -F.logsigmoid(rc - rr).mean()
    return loss, {"reward_chosen": rc.mean().detach(), "reward_rejected": rr.mean().detach(),
                  "margin": (rc - rr).mean().detach(), "pair_accuracy": (rc > rr).float().mean(),
                  "pair_ties": (rc == rr).float().mean()}


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
        lam: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016) over response tokens. rewards, values, mask:
    (B, T), mask 1 on the tokens the policy wrote (a contiguous run per row). delta_t = r_t + gamma V_{t+1} -
    V_t with V = 0 after the last token; A_t = delta_t + gamma lam A_{t+1}. Returns (advantages, returns =
    advantages + values), 0 off the mask."""
    B, T = rewards.shape
    m = mask.to(rewards.dtype)
    v = values.detach() * m
    adv = torch.zeros_like(rewards)
    last = torch.zeros(B, dtype=rewards.dtype, device=rewards.device)
    for t in range(T - 1, -1, -1):
        nv = v[:, t + 1] if t + 1 < T else torch.zeros_like(last)
        delta = rewards[:, t] + gamma * nv - v[:, t]
        last = (delta + gamma * lam * last) * m[:, t]
        adv[:, t] = last
    return adv, (adv + v) * m


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-4,
                     scale: bool = True) -> torch.Tensor:
    """GRPO's outcome advantages (Shao et al. 2024, section 4.1.2): each reward minus the mean of its group
    of `group_size` samples of one prompt, divided by the group's standard deviation (when `scale`). rewards:
    (N * group_size,), groups contiguous. A group whose samples all scored the same gets 0 (no signal)."""
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    g = rewards.float().view(-1, group_size)
    a = g - g.mean(1, keepdim=True)
    if scale:
        a = a / (g.std(1, keepdim=True, unbiased=True) + eps) if group_size > 1 else a
    return a.view(-1)


def clipped_policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                        mask: torch.Tensor, clip_eps: float = 0.2) -> tuple[torch.Tensor, dict]:
    """PPO's clipped surrogate (Schulman et al. 2017, eq. 7), negated to minimise, per token:
    -min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A) with ratio = exp(logp - old_logp). Token-level
    normalisation: the mean over every counted token of the batch (DAPO's choice), so long and short samples
    weigh by their tokens. advantages: (B, T) or (B,) (one per sample, broadcast over its tokens)."""
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1).expand_as(logp)
    ratio = torch.exp(logp - old_logp.detach())
    a = advantages.detach()
    per_token = -torch.min(ratio * a, ratio.clamp(1 - clip_eps, 1 + clip_eps) * a)
    loss = masked_mean(per_token, mask)
    with torch.no_grad():
        clipped = ((ratio - 1).abs() > clip_eps).float()
        metrics = {"clip_fraction": masked_mean(clipped, mask),
                   "approx_kl_old": masked_mean(old_logp.detach() - logp.detach(), mask)}
    return loss, metrics


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token KL(policy || reference) estimate exp(ref - logp) - (ref - logp) - 1: unbiased on samples from
    the policy and never negative (Schulman's k3; the GRPO paper's eq. 4)."""
    d = ref_logp.detach() - logp
    return torch.exp(d) - d - 1


def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                       mask: torch.Tensor, clip: float = 0.2) -> torch.Tensor:
    """PPO's value loss: 0.5 * max((V - R)^2, (V_clipped - R)^2), V_clipped = old V + clip(V - old V, +-clip),
    averaged over counted tokens."""
    old = old_values.detach()
    clipped = old + (values - old).clamp(-clip, clip)
    per = 0.5 * torch.max((values - returns) ** 2, (clipped - returns) ** 2)
    return masked_mean(per, mask)


def lm_loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, dict]:
    """The loss of pretraining and SFT alike: the model's own mean next-token loss over counted targets."""
    x, y = batch
    return model(x, y), {}
