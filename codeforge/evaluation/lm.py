"""Language-model numbers of a run: validation loss, perplexity and bits per byte (comparable across
tokenizers), the same wherever they are asked for (training, the quickstart, `codeforge eval`)."""

from __future__ import annotations

import math

import torch

from .. import CodeforgeError
from ..data.shards import ShardSet
from ..data.loader import batch_source
from ..device import autocast
from ..models.lm_loss import IGNORE_INDEX


class EvalError(CodeforgeError):
    """Evaluation cannot run on what it was given; the message says why."""


@torch.no_grad()
def evaluate_loss(model: torch.nn.Module, batches, iters: int, device: torch.device, precision: str,
                  token_bytes: torch.Tensor) -> dict:
    """Mean loss over the counted targets (!= -1) of `iters` batches from `batches` (a loader reading the
    split in order, so every evaluation sees the same tokens), perplexity = exp(loss), and bits per byte =
    the summed loss (in bits) of counted targets that stand for text, over the bytes they stand for.
    The loss is the model's own (forward with targets, loss_reduction="none"), the one training uses."""
    was_training = model.training
    model.eval()
    tb = token_bytes.to(device)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    bits_loss = torch.zeros((), dtype=torch.float64, device=device)
    n_tok = torch.zeros((), dtype=torch.int64, device=device)
    n_bytes = torch.zeros((), dtype=torch.int64, device=device)
    for _ in range(min(iters, batches.per_epoch)):
        x, y = batches.next_batch()
        for r in range(x.size(0)):  # one row at a time bounds the (T, vocab) logits in memory
            with autocast(device, precision):
                # (T,), 0 where ignored
                nll = model(x[r:r + 1], y[r:r + 1], loss_reduction="none")[0].double()
            counted = y[r] != IGNORE_INDEX
            nb = tb[y[r].clamp(min=0)] * counted
            loss_sum += nll.sum()
            bits_loss += (nll * (nb > 0)).sum()
            n_bytes += nb.sum()
            n_tok += counted.sum()
    if was_training:
        model.train()
    n = int(n_tok.item())
    val_loss = (loss_sum / max(n, 1)).item()
    nbytes = int(n_bytes.item())
    return {"val_loss": val_loss, "perplexity": math.exp(min(val_loss, 700.0)),
            "bits_per_byte": bits_loss.item() / math.log(2) / max(nbytes, 1), "eval_tokens": n}


EVAL_FLOOR = 16_384  # validation tokens a run's evaluation never goes below when sized to the run


def sized_eval_tokens(eval_tokens: int, train_tokens: int, evaluations: int) -> int:
    """The validation tokens each evaluation of a run scores: `eval_tokens` (train.eval_tokens, 0: the whole
    split) unless the run is too short to pay for it. A forward pass costs about a third of a training step's
    work per token, so scoring an eighth of the run's training tokens, spread over its evaluations, costs
    about 4% of the run; never fewer than EVAL_FLOOR tokens, never more than asked. Every evaluation of the
    run scores the same windows, so its numbers stay comparable."""
    if not eval_tokens:
        return 0
    fit = max(EVAL_FLOOR, train_tokens // (8 * max(1, evaluations)))
    return min(eval_tokens, fit)


def validation_loss(model: torch.nn.Module, val: ShardSet, block_size: int, special_ids: dict[str, int],
                    eval_tokens: int, device: torch.device, precision: str,
                    token_bytes: torch.Tensor) -> dict:
    """The validation numbers of a run, the same wherever they are asked for (training, the quickstart,
    `codeforge eval`): the split read in order in windows of the model's context, one window per row, as
    many windows as cover `eval_tokens` targets (0: the whole split). The batch size plays no part.
    `eval_tokens` in the result says how many targets were scored."""
    if eval_tokens < 0:
        raise ValueError(f"eval_tokens = {eval_tokens} must be 0 (the whole split) or positive")
    try:
        windows = batch_source(val, 1, block_size, special_ids, shuffle=False, device=device)
    except ValueError as e:  # a split shorter than one context: score what there is
        if val.chat:
            raise ValueError(f"no conversation of the {val.split} split of {val.dir} fits a context of "
                             f"{block_size} tokens ({e})") from None
        if val.tokens < 2:
            raise ValueError(f"the {val.split} split of {val.dir} holds {val.tokens} token(s); nothing to "
                             f"evaluate") from None
        windows = batch_source(val, 1, val.tokens - 1, special_ids, shuffle=False, device=device)
    n = windows.per_epoch if not eval_tokens else min(windows.per_epoch, math.ceil(eval_tokens / block_size))
    r = evaluate_loss(model, windows, n, device, precision, token_bytes)
    if r["eval_tokens"] == 0:
        raise ValueError(f"the first {n} validation window(s) hold no scored targets (chat rows with no "
                         f"assistant text?); raise --eval-tokens")
    return r
