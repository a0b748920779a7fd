"""Evaluation: validation loss, perplexity and bits per byte (comparable across tokenizers)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .device import autocast
from .loader import BatchLoader
from .shards import ShardSet
from .tokenizer import CodeTokenizer


def _byte_decoder() -> dict[str, int]:
    """Inverse of the byte-level alphabet: printable bytes map to themselves, the other 68 byte values to
    the code points 256, 257, ... in order (the GPT-2 byte-level convention that HF tokenizers uses)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def token_byte_lengths(tok: CodeTokenizer, size: int | None = None) -> torch.Tensor:
    """(size,) int64: how many bytes of text each token id stands for; 0 for special and unused ids."""
    dec = _byte_decoder()
    lengths = torch.zeros(size or tok.vocab_size, dtype=torch.int64)
    special = set(tok.special_ids.values())
    for piece, i in tok.tok.get_vocab().items():
        if i not in special and i < len(lengths):
            lengths[i] = sum(1 for ch in piece if ch in dec)
    return lengths


@torch.no_grad()
def evaluate_loss(model: torch.nn.Module, shards: ShardSet, batch_size: int, block_size: int, iters: int,
                  device: torch.device, precision: str, token_bytes: torch.Tensor) -> dict:
    """Mean loss over `iters` batches read in order from the start of the split (the same tokens every
    time, so evaluations are comparable), perplexity = exp(loss), and bits per byte = the summed loss (in
    bits) of targets that stand for text, over the bytes those targets stand for."""
    was_training = model.training
    model.eval()
    loader = BatchLoader(shards, batch_size, block_size, shuffle=False, device=device)
    iters = min(iters, loader.per_epoch)
    tb = token_bytes.to(device)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    bits_loss = torch.zeros((), dtype=torch.float64, device=device)
    n_tok = 0
    n_bytes = torch.zeros((), dtype=torch.int64, device=device)
    for _ in range(iters):
        x, y = loader.next_batch()
        for r in range(x.size(0)):  # one row at a time bounds the (T, vocab) logits in memory
            with autocast(device, precision):
                logits = model(x[r:r + 1])
            nll = F.cross_entropy(logits[0].float(), y[r], reduction="none")  # (T,)
            loss_sum += nll.sum()
            nb = tb[y[r]]
            bits_loss += (nll * (nb > 0)).sum()
            n_bytes += nb.sum()
            n_tok += y.size(1)
    if was_training:
        model.train()
    val_loss = (loss_sum / max(n_tok, 1)).item()
    nbytes = int(n_bytes.item())
    return {"val_loss": val_loss, "perplexity": math.exp(min(val_loss, 700.0)),
            "bits_per_byte": bits_loss.item() / math.log(2) / max(nbytes, 1), "eval_tokens": n_tok}
