"""The loss a model computes in its forward: next-token cross-entropy of hidden states under the output
matrix, plain or fused-chunked, with the one ignore convention every loss in codeforge shares: targets ==
IGNORE_INDEX (-1) carry no loss. Training, evaluation and SFT share this path (SFT is data: its targets are
-1 outside assistant turns, nanochat's `render_conversation` idea). The trainer's other losses (preference,
policy) live in train/losses.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -1


def lm_loss(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_rows: int = 0,
            reduction: str = "mean") -> torch.Tensor:
    """Next-token cross-entropy of hidden states h (B, T, C) under the output matrix (vocab, C), ignoring
    targets == -1, with a float32 softmax.

    reduction "mean": the mean over counted targets (0, not NaN, when none is counted); "none": (B, T) per
    token losses, 0 at ignored positions. With chunk_rows > 0, gradients on and the mean, the fused path runs:
    the (B*T, vocab) logits never exist at once (see ChunkedLinearCrossEntropy)."""
    if reduction not in ("mean", "none"):
        raise ValueError(f"reduction {reduction!r} is not 'mean' or 'none'")
    if (
        reduction == "mean"
        and chunk_rows > 0
        and torch.is_grad_enabled()
        and (h.requires_grad or weight.requires_grad)
    ):
        return ChunkedLinearCrossEntropy.apply(h.reshape(-1, h.size(-1)), weight, targets.reshape(-1),
                                               chunk_rows)
    logits = F.linear(h, weight)  # (B, T, vocab)
    flat = logits.view(-1, logits.size(-1)).float()
    if reduction == "none":  # (B, T), 0 where ignored
        return F.cross_entropy(flat, targets.reshape(-1), ignore_index=IGNORE_INDEX,
                               reduction="none").view(targets.shape)
    total = F.cross_entropy(flat, targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")
    return total / (targets != IGNORE_INDEX).sum().clamp(min=1)  # 0, not NaN, when every target is ignored


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Linear layer + mean cross-entropy whose gradients are computed during the forward pass, chunk by
    chunk of rows, so only one (chunk_rows, vocab) block of logits is alive at a time.

    For a row with logits z = h W^T and target t: loss = logsumexp(z) - z_t,
    dloss/dz = softmax(z) - onehot(t).
    Then dL/dh = (dloss/dz) W and dL/dW = sum over rows of (dloss/dz)^T h, both divided by the number of
    counted rows. The same FLOPs as the plain path (one forward and two backward matmuls), far less memory
    and memory traffic; backward only scales the stored gradients by the incoming scalar.

    Each chunk makes one pass for the row maxima and one softmax; the log-sum-exp is read back from the
    softmax at each row's largest logit m (p_max = exp(m - lse), at least 1/vocab, so never underflows):
    lse = m - log(p_max). That made the chunked path 5-26% faster than the logsumexp version on an H200 and
    ~5% on the CPU, where it is still no faster than the plain path
    (docs/LOG.md#2026-11-27-eighth-session)."""

    @staticmethod
    def forward(ctx, h, weight, targets, chunk_rows):
        n_valid = (targets != IGNORE_INDEX).sum().clamp(min=1)
        grad_h = torch.empty_like(h)
        grad_w = None
        loss = torch.zeros((), dtype=torch.float32, device=h.device)
        w = weight.to(h.dtype)  # once: under autocast h is bf16/fp16 and the matmuls run in that dtype
        for i in range(0, h.size(0), chunk_rows):
            hc, tc = h[i:i + chunk_rows], targets[i:i + chunk_rows]
            z = F.linear(hc, w).float()  # (rows, vocab)
            valid = tc != IGNORE_INDEX
            tsafe = tc.clamp(min=0).unsqueeze(1)
            top, at = z.max(dim=-1, keepdim=True)
            z_t = z.gather(1, tsafe)
            g = torch.softmax(z, dim=-1)
            del z
            row_loss = (top - z_t - g.gather(1, at).log()).squeeze(1)  # logsumexp(z) - z_t
            loss += (row_loss * valid).sum()
            g.scatter_add_(1, tsafe, -torch.ones_like(tsafe, dtype=g.dtype))
            # ignored rows contribute nothing (no sync on GPU)
            if h.device.type != "cpu" or not bool(valid.all()):
                g *= valid.unsqueeze(1)
            g = g.to(h.dtype)
            grad_h[i:i + chunk_rows] = g @ w  # not mm(out=): autocast leaves out= products in float32
            part = g.t() @ hc
            grad_w = part.float() if grad_w is None else grad_w.add_(part)  # summed in float32 across chunks
        if grad_w is None:  # no rows at all
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        ctx.save_for_backward(grad_h, grad_w, n_valid)
        ctx.w_dtype = weight.dtype
        return loss / n_valid

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w, n_valid = ctx.saved_tensors
        scale = grad_out / n_valid
        return grad_h * scale.to(grad_h.dtype), (grad_w * scale).to(ctx.w_dtype), None, None
