"""The preference and policy losses against values computed by hand (train/losses.py)."""

from __future__ import annotations

import math

import pytest
import torch

from codeforge.train import losses as L


def close(a, b, tol=1e-5):
    return abs(float(a) - b) <= tol


def test_bradley_terry_by_hand():
    loss, acc = L.bradley_terry_loss(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 0.0]))
    # -log sigmoid(1) = log(1 + e^-1) = 0.313262; -log sigmoid(0) = log 2 = 0.693147
    assert close(loss, (math.log(1 + math.exp(-1)) + math.log(2)) / 2) and close(loss, 0.503204)
    assert close(acc, 0.5)  # a tie is not a win


def test_dpo_by_hand():
    loss, m = L.dpo_loss(torch.tensor([-1.0]), torch.tensor([-2.0]), torch.tensor([-1.5]),
                         torch.tensor([-1.5]), 0.5)
    # implicit rewards 0.5 * (-1 + 1.5) = 0.25 and 0.5 * (-2 + 1.5) = -0.25; loss = -log sigmoid(0.5)
    assert close(m["reward_chosen"], 0.25) and close(m["reward_rejected"], -0.25) and close(m["margin"], 0.5)
    assert close(loss, math.log(1 + math.exp(-0.5))) and close(loss, 0.474077)
    assert close(m["pair_accuracy"], 1.0)
    # the reference cancels: equal policy and reference give log 2 whatever the log-probs are
    same, m0 = L.dpo_loss(torch.tensor([-3.0]), torch.tensor([-7.0]), torch.tensor([-3.0]),
                          torch.tensor([-7.0]), 0.1)
    assert close(same, math.log(2))
    assert close(m0["pair_accuracy"], 0.0) and close(m0["pair_ties"], 1.0)  # a tie: counted, and told apart
    assert close(m["pair_ties"], 0.0)


def test_dpo_gradient_raises_chosen_lowers_rejected():
    pc, pr = torch.tensor([-2.0], requires_grad=True), torch.tensor([-2.0], requires_grad=True)
    loss, _ = L.dpo_loss(pc, pr, torch.tensor([-2.0]), torch.tensor([-2.0]), beta=0.1)
    loss.backward()
    assert close(pc.grad, -0.05) and close(pr.grad, 0.05)  # -beta * sigmoid(0) and +beta * sigmoid(0)


def test_gae_by_hand():
    r = torch.tensor([[0.0, 0.0, 1.0]])
    v = torch.tensor([[0.5, 0.5, 0.5]])
    adv, ret = L.gae(r, v, torch.ones(1, 3), gamma=1.0, lam=0.5)
    # delta = (0, 0, 0.5); A2 = 0.5, A1 = 0 + 0.5 * 0.5 = 0.25, A0 = 0.125; returns = A + V
    assert torch.allclose(adv, torch.tensor([[0.125, 0.25, 0.5]]))
    assert torch.allclose(ret, torch.tensor([[0.625, 0.75, 1.0]]))
    # a padded position after the response: its value (9) never leaks in, its advantage is 0
    adv, ret = L.gae(torch.tensor([[0.0, 1.0, 0.0]]), torch.tensor([[0.5, 0.5, 9.0]]),
                     torch.tensor([[1.0, 1.0, 0.0]]), gamma=0.9, lam=0.5)
    # delta1 = 1 - 0.5 = 0.5; delta0 = 0 + 0.9 * 0.5 - 0.5 = -0.05; A0 = -0.05 + 0.45 * 0.5 = 0.175
    assert torch.allclose(adv, torch.tensor([[0.175, 0.5, 0.0]]))
    assert torch.allclose(ret, torch.tensor([[0.675, 1.0, 0.0]]))


def test_group_advantages_by_hand():
    a = L.group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0]), 4)
    s = math.sqrt(1 / 3)  # the unbiased std of (1, 0, 0, 1)
    want = [0.5 / (s + 1e-4), -0.5 / (s + 1e-4)] * 1
    assert torch.allclose(a[:4], torch.tensor([want[0], want[1], want[1], want[0]]), atol=1e-5)
    assert torch.equal(a[4:], torch.zeros(4))  # all the same: no signal
    assert torch.allclose(L.group_advantages(torch.tensor([3.0, 1.0]), 2, scale=False),
                          torch.tensor([1.0, -1.0]))
    with pytest.raises(ValueError, match="groups of 3"):
        L.group_advantages(torch.ones(4), 3)


def test_clipped_policy_loss_by_hand():
    old = torch.zeros(1, 3)
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.1]]))
    adv = torch.tensor([[1.0, -1.0, 2.0]])
    loss, m = L.clipped_policy_loss(logp, old, adv, torch.ones(1, 3), clip_eps=0.2)
    # min(1.5*1, 1.2*1) = 1.2; min(0.5*-1, 0.8*-1) = -0.8; min(1.1*2, 1.1*2) = 2.2; loss = -mean
    assert close(loss, -(1.2 - 0.8 + 2.2) / 3)
    assert close(m["clip_fraction"], 2 / 3)
    # token-level normalisation: a masked token counts for nothing, a (B,) advantage broadcasts
    loss2, _ = L.clipped_policy_loss(logp, old, torch.tensor([1.0]), torch.tensor([[1.0, 1.0, 0.0]]))
    assert close(loss2, -(1.2 + 0.5) / 2)


def test_kl_k3_and_value_loss_by_hand():
    k = L.kl_k3(torch.log(torch.tensor([0.5])), torch.log(torch.tensor([0.25])))
    assert close(k, 0.5 + math.log(2) - 1)  # exp(d) - d - 1 with d = log 0.5
    assert close(L.kl_k3(torch.tensor([-1.0]), torch.tensor([-1.0])), 0.0)
    v = L.clipped_value_loss(torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 0.0]]),
                             torch.tensor([[0.5, 1.0]]), torch.ones(1, 2), clip=0.2)
    # token 0: max((1-.5)^2, (0.2-.5)^2) = 0.25; token 1: max(1, 1) = 1; 0.5 * mean = 0.3125
    assert close(v, 0.3125)


def test_token_and_sequence_logprobs_agree():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 4, 7, generator=g)
    y = torch.tensor([[1, 2, -1, -1], [0, 6, 5, 3]])
    per = L.token_logprobs(logits, y)
    assert torch.allclose(per.sum(-1), L.sequence_logprobs(logits, y))
    assert per[0, 2] == 0 and per[0, 3] == 0
    assert close(per[1, 1], torch.log_softmax(logits[1, 1], -1)[6])
