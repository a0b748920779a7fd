"""Fill-in-the-middle (Bavarian et al. 2022, "Efficient Training of Language Models to Fill in the Middle").

Training: with probability `fim_rate`, a document is cut at two random positions into prefix, middle and
suffix, and reordered so that the middle comes last:
    PSM  <fim_prefix> prefix <fim_suffix> suffix <fim_middle> middle
    SPM  <fim_prefix> <fim_suffix> suffix <fim_middle> prefix middle      (StarCoder's SPM variant)
The cut points are token positions of the pre-tokenized shards (as Megatron-LM and StarCoder do), not
characters: re-tokenizing characters in the loader would cost the training loop its speed. The rest of the
document's `<|endoftext|>` stays in place, so the model learns to end the middle with it. Everything is a
function of (seed, epoch, chunk id), so a resumed run sees the same permutations.

Inference: `infill_ids(tok, prefix, suffix)` is the PSM prompt; the model writes the middle and ends it with
`<|endoftext|>`. Raw prompts holding the FIM tokens (what editor plugins send) work as well.
"""

from __future__ import annotations

import numpy as np

FIM_PREFIX, FIM_MIDDLE, FIM_SUFFIX = "<fim_prefix>", "<fim_middle>", "<fim_suffix>"


def fim_ids(special_ids: dict[str, int]) -> tuple[int, int, int]:
    return special_ids[FIM_PREFIX], special_ids[FIM_MIDDLE], special_ids[FIM_SUFFIX]


def infill_ids(tok, prefix: str, suffix: str) -> list[int]:
    """The PSM prompt for filling the middle between `prefix` and `suffix`."""
    pre, mid, suf = fim_ids(tok.special_ids)
    return [pre] + tok.encode(prefix) + [suf] + tok.encode(suffix) + [mid]


def infill_text(prefix: str, suffix: str) -> str:
    """The same prompt as text with the FIM tokens written out (for /v1/completions with raw prompts)."""
    return f"{FIM_PREFIX}{prefix}{FIM_SUFFIX}{suffix}{FIM_MIDDLE}"


def permute_window(window: np.ndarray, eot: int, fim: tuple[int, int, int], rate: float, spm_rate: float,
                   rng: np.random.Generator) -> np.ndarray:
    """Apply FIM to each document piece of a training window (pieces are separated by `eot`); returns a
    window of the same length (the permutation adds 3 tokens per transformed piece, so the end is cut)."""
    if rate <= 0:
        return window
    pre, mid, suf = fim
    n = len(window)
    cuts = np.flatnonzero(window == eot)
    out, start = [], 0
    for end in list(cuts) + [n]:
        piece = window[start:end]
        if len(piece) >= 2 and rng.random() < rate:
            a, b = sorted(rng.integers(0, len(piece) + 1, size=2))
            p, m, s = piece[:a], piece[a:b], piece[b:]
            if rng.random() < spm_rate:
                piece = np.concatenate([[pre, suf], s, [mid], p, m])
            else:
                piece = np.concatenate([[pre], p, [suf], s, [mid], m])
        out.append(piece)
        if end < n:
            out.append(window[end:end + 1])
        start = end + 1
    return np.concatenate(out)[:n].astype(window.dtype)
