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
`<|endoftext|>`. Raw prompts holding the FIM tokens (what editor plugins send) work as well. An editor's other
files go before it as `repo_infill_ids` lays them out: the repo-level prompt llama.cpp's server builds, with
`<|repo_name|>` and `<|file_sep|>` (tokenizers made before those two existed have reserved tokens there).
"""

from __future__ import annotations

import numpy as np

FIM_PREFIX, FIM_MIDDLE, FIM_SUFFIX = "<fim_prefix>", "<fim_middle>", "<fim_suffix>"
FIM_REPO, FIM_FILE_SEP = "<|repo_name|>", "<|file_sep|>"
# llama.cpp's chunk separator for a vocabulary without a file separator
SNIPPET_SEPARATOR = "\n\n--- snippet ---\n\n"


def fim_ids(special_ids: dict[str, int]) -> tuple[int, int, int]:
    return special_ids[FIM_PREFIX], special_ids[FIM_MIDDLE], special_ids[FIM_SUFFIX]


def infill_ids(tok, prefix: str, suffix: str) -> list[int]:
    """The PSM prompt for filling the middle between `prefix` and `suffix`."""
    pre, mid, suf = fim_ids(tok.special_ids)
    return [pre] + tok.encode(prefix) + [suf] + tok.encode(suffix) + [mid]


def repo_infill_ids(tok, prefix: str, suffix: str, extra=(), prompt: str = "", **budget) -> list[int]:
    """repo_infill's prompt alone."""
    return repo_infill(tok, prefix, suffix, extra, prompt, **budget)[0]


def repo_infill(tok, prefix: str, suffix: str, extra: list[tuple[str | None, str]] = (), prompt: str = "", *,
                n_ctx: int, n_batch: int, n_predict: int, project: str = "myproject",
                filename: str = "filename") -> tuple[list[int], bool]:
    """The repo-level FIM prompt llama.cpp's `llama-server /infill` builds (tools/server:
    format_prompt_infill; Qwen2.5-Coder's report, arXiv 2409.12186), token for token given the same n_ctx,
    n_batch and n_predict:

        <|repo_name|>project\\n <|file_sep|>name\\n text ... <|file_sep|>filename\\n
        <fim_prefix> prefix prompt <fim_suffix> suffix <fim_middle>

    Each piece is tokenized on its own. At most 3/4 of n_batch of the prefix (its end),
    n_batch/4 - 2 - len(prompt) of the suffix (its start), and n_ctx - n_batch - 2 n_predict of the extra
    context (its end) are kept. Without <|repo_name|>/<|file_sep|> in the vocabulary (a tokenizer from before
    they were added) the chunks are joined with llama.cpp's snippet separator and no names. extra: (file name
    or None for "tmp", text). Returns (prompt ids, whether anything was cut)."""
    sp = tok.special_ids
    rep, sep = sp.get(FIM_REPO), sp.get(FIM_FILE_SEP)
    # the prompt field is read with its special tokens, as llama-server reads it; the rest as plain text
    pre_t, suf_t, prompt_t = tok.encode(prefix), tok.encode(suffix), tok.encode(prompt, allow_special=True)
    extra_t: list[int] = []
    if rep is not None:
        extra_t += [rep] + tok.encode(project + "\n")
    for name, text in extra:
        if sep is not None:
            extra_t += [sep] + tok.encode((name if name is not None else "tmp") + "\n")
        else:
            extra_t += tok.encode(SNIPPET_SEPARATOR)
        extra_t += tok.encode(text)
    if sep is not None:
        extra_t += [sep] + tok.encode(filename + "\n")
    n_pre = min(len(pre_t), 3 * (n_batch // 4))
    n_suf = min(len(suf_t), max(0, n_batch // 4 - (2 + len(prompt_t))))
    n_extra = min(max(0, n_ctx - n_batch - 2 * n_predict), len(extra_t))
    cut = n_pre < len(pre_t) or n_suf < len(suf_t) or (bool(extra) and n_extra < len(extra_t))
    pre_t = pre_t[len(pre_t) - n_pre:]
    suf_t = suf_t[:n_suf]
    head = extra_t[len(extra_t) - n_extra:] if n_extra else []
    ids = head + [sp[FIM_PREFIX]] + pre_t + prompt_t + [sp[FIM_SUFFIX]] + suf_t + [sp[FIM_MIDDLE]]
    return ids, cut


def fit_infill(ids: list[int], room: int, special_ids: dict[str, int]) -> list[int]:
    """A repo_infill prompt cut to `room` tokens: the other files first (they come first), then the start of
    the prefix, then the end of the suffix; the three FIM tokens always stay."""
    a, b = ids.index(special_ids[FIM_PREFIX]), ids.index(special_ids[FIM_SUFFIX])
    head, pre, suf = ids[:a], ids[a + 1:b], ids[b + 1:-1]
    over = len(ids) - room
    for part in ("head", "pre", "suf"):
        if over <= 0:
            break
        if part == "head":
            k = min(over, len(head))
            head = head[k:]
        elif part == "pre":
            k = min(over, len(pre))
            pre = pre[k:]
        else:
            k = min(over, len(suf))
            suf = suf[:len(suf) - k]
        over -= k
    return (
        head + [special_ids[FIM_PREFIX]] + pre + [special_ids[FIM_SUFFIX]] + suf + [special_ids[FIM_MIDDLE]]
    )


# where llama.cpp ends a fill too (its end-of-generation tokens): the end of the text, a next file or
# repository, the end of a chat turn
INFILL_STOPS = ("<|endoftext|>", FIM_FILE_SEP, FIM_REPO, "<|im_end|>", "</s>")


def infill_stop_ids(tok) -> frozenset[int]:
    """The ids of INFILL_STOPS this tokenizer has."""
    return frozenset(i for t in INFILL_STOPS if (i := tok.special_ids.get(t)) is not None) | {tok.eot_id}


def repo_fim_document(tok, repo: str, context: list[tuple[str, str]], path: str, text: str,
                      cut: tuple[int, int]) -> list[int]:
    """A repo-level FIM training document (Qwen2.5-Coder's format, the one llama-server's /infill builds at
    inference): <|repo_name|>repo, each context file as <|file_sep|>path + text, then the target file's
    <|file_sep|>path and the target in PSM order, cut at character positions `cut`, ending in end-of-text.
    Each piece is tokenized on its own, as llama-server does."""
    sp = tok.special_ids
    a, b = cut
    ids = [sp[FIM_REPO]] + tok.encode(repo + "\n")
    for p, ctx in context:
        ids += [sp[FIM_FILE_SEP]] + tok.encode(p + "\n") + tok.encode(ctx)
    ids += [sp[FIM_FILE_SEP]] + tok.encode(path + "\n")
    ids += (
        [sp[FIM_PREFIX]] + tok.encode(text[:a]) + [sp[FIM_SUFFIX]] + tok.encode(text[b:]) + [sp[FIM_MIDDLE]]
    )
    return ids + tok.encode(text[a:b]) + [tok.eot_id]


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
        # a piece holding a FIM token already (a repo-level FIM document, made at prepare time) stays as it is
        if len(piece) >= 2 and rng.random() < rate and not (piece == pre).any():
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
