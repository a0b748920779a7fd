"""llama.cpp's sampler chain, for rows that name one (llama-server's `samplers` field): the named samplers in
the order given, over the row's logits, then a draw from the softmax of what survives.

The samplers are those of llama.cpp's src/llama-sampler.cpp at the version llama-cpp-python 0.3.36 vendors,
each over the *current* candidate set (in logit order, highest first, where the order matters; equal logits
by token id, or as torch.topk leaves them after a first top_k):
  top_k        k <= 0: nothing; else the k highest logits
  top_p        p >= 1: nothing; else the smallest most-likely prefix whose softmax mass reaches p
  min_p        p <= 0: nothing; else the logits >= max logit + ln p (p_i >= p * p_max)
  temperature  t <= 0 (below SAMPLING_EPS): every logit but the highest becomes -inf (the tokens stay
               candidates, as in llama.cpp); else logits / t
  infill       llama_sampler_infill_apply (below)
The final draw (llama.cpp's `dist`) recomputes the softmax from the survivors' logits, so the probabilities
infill merges decide which tokens survive, not their odds. A chain without "temperature" samples at T=1;
`[]` samples the full softmax.

infill (llama-sampler.cpp:4081-4262), on the candidates' softmax p:
  1. p_eog = sum of p over end tokens (the row's stop ids), p_txt over the rest; if 3 * p_eog * n > p_txt
     (n: the candidate count) only the end tokens are kept.
  2. Tokens whose text is a prefix of another candidate's text are merged: for every ordered pair (i0, i1) in
     order of p, piece(i0) non-empty and a prefix of piece(i1), the one with the lower p gives its p to the
     other and leaves (its logit -inf). Special tokens have no text here and never merge.
  3. Non-end tokens with p < 0.2 leave (end tokens all stay); if none is left, end of text is the only
     candidate.
  4. Renormalised, non-end tokens with p < 1/(n_non_end + 1) leave.

The pairwise merge of step 2 is O(n^2) as llama.cpp writes it, and n is the whole vocabulary when no top_k
or top_p runs first. Up to SMALL_MERGE candidates (llama.vim and llama.vscode send top_k 40) the loop runs as
written, over the prefix pairs only. Past that, `merge_prefixes` computes its outcome in O(n log n) from the
vocabulary's pieces sorted once per tokenizer (PieceIndex): in that order the tokens whose text extends a
piece form one run, and the runs nest like a trie. Walking llama.cpp's loop in order of p shows (given no
two tokens of one run have exactly equal p) that a token keeps its place iff it is the most likely token of
its own run and no shorter prefix of it is: such a token ("claimer") takes every token of its run, and any
other token goes to the claimer over the most likely token of its run. tests/test_batcher_llama.py checks
both ways against a literal port of the C++ loop on random vocabularies. Exactly equal logits of
prefix-related tokens among more than SMALL_MERGE candidates are the one case where the fast way can differ:
it gives llama.cpp's outcome for the order of the candidates taken as strict (the earlier of two equal ones
as the more likely), where the C++ loop lets the later absorb the earlier (its `>` is strict) and its own
order among equal logits is std::sort's, unspecified. With top_k first, the loop as written runs.
"""

from __future__ import annotations

import bisect
import math
import threading
import weakref

import torch

SAMPLING_EPS = 1e-5  # the batcher's: temperatures below it are greedy
CHAIN_SAMPLERS = ("top_k", "top_p", "min_p", "temperature", "infill")
INFILL_THOLD = 0.2  # llama.cpp's first-pass threshold
SMALL_MERGE = 128  # candidates up to which the infill merge runs llama.cpp's loop as written


class PieceIndex:
    """Each token's text (bytes; b"" for special tokens) and the vocabulary's prefix structure: `lex`, each
    token's place in the pieces sorted bytewise (ties by id), and [lo, hi), the places of the tokens whose
    piece starts with this one's (itself, any token of the same text, and the longer ones). A token without
    text is alone in its run."""

    def __init__(self, pieces: list[bytes]):
        n = len(pieces)
        self.pieces = pieces
        order = sorted(range(n), key=lambda i: (pieces[i], i))
        srt = [pieces[i] for i in order]
        lex, lo, hi = [0] * n, [0] * n, [0] * n
        for pos, i in enumerate(order):
            lex[i] = pos
            p = pieces[i]
            if not p:
                lo[i], hi[i] = pos, pos + 1
                continue
            lo[i] = bisect.bisect_left(srt, p)
            nxt = _successor(p)
            hi[i] = n if nxt is None else bisect.bisect_left(srt, nxt)
        self.lex = torch.tensor(lex, dtype=torch.long)
        self.lo = torch.tensor(lo, dtype=torch.long)
        self.hi = torch.tensor(hi, dtype=torch.long)


def _successor(p: bytes) -> bytes | None:
    """The smallest byte string greater than every string that starts with p (None: there is none)."""
    p = p.rstrip(b"\xff")
    return None if not p else p[:-1] + bytes([p[-1] + 1])


def token_pieces(tok) -> list[bytes]:
    """Each id's text alone, as llama.cpp's token_to_piece(special=false): the tokenizer's decoding of that
    one id with special tokens skipped (so they are b""), or, where that is part of a UTF-8 character
    (decoded as U+FFFD), the token's own bytes."""
    out = []
    for i in range(tok.vocab_size):
        s = tok.decode([i], skip_special=True)
        if "\ufffd" in s and hasattr(tok, "token_bytes"):
            out.append(tok.token_bytes(i))
        else:
            out.append(s.encode("utf-8", "surrogatepass"))
    return out


_INDEXES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_INDEX_LOCK = threading.Lock()


def piece_index(tok) -> PieceIndex:
    """The PieceIndex of a tokenizer, built on first use (a decode per id) and kept while it lives."""
    with _INDEX_LOCK:
        idx = _INDEXES.get(tok)
        if idx is None:
            idx = _INDEXES[tok] = PieceIndex(token_pieces(tok))
        return idx


def _range_min(vals: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """min(vals[a_i:b_i]) for every i (b_i > a_i), by a sparse table: O(n log n)."""
    n = vals.numel()
    big = torch.iinfo(vals.dtype).max
    levels = [vals]
    w = 1
    while 2 * w <= n:
        prev = levels[-1]
        levels.append(torch.minimum(prev[:-w], prev[w:]))
        w *= 2
    table = torch.full((len(levels), n), big, dtype=vals.dtype)
    for j, lv in enumerate(levels):
        table[j, :lv.numel()] = lv
    length = b - a
    k = torch.frexp(length.double()).exponent.long() - 1  # floor(log2(length)), exact
    return torch.minimum(table[k, a], table[k, b - (1 << k)])


def merge_prefixes(ids: torch.Tensor, p: torch.Tensor, live: torch.Tensor, index: PieceIndex,
                   small: int = SMALL_MERGE) -> tuple[torch.Tensor, torch.Tensor]:
    """The outcome of llama.cpp infill's prefix merge: (each candidate's p after it, 0 for those merged away;
    which were merged away). ids (n,) in the order of p (highest first, as the candidates are kept), p (n,),
    live (n,) bool: the candidates whose logit is not -inf (only they merge). Up to `small` of them (what
    top_k leaves) llama.cpp's loop runs as written, over the pairs whose pieces are prefixes only, so equal
    probabilities compare as there; more take the O(n log n) way (the module's docstring)."""
    mass = p.clone()
    gone = torch.zeros(p.numel(), dtype=torch.bool)
    sub = torch.nonzero(live).squeeze(1)  # positions in p's order: the rank of each merging candidate
    m = sub.numel()
    if m < 2:
        return mass, gone
    tid = ids[sub]
    q = index.lex[tid]
    # before[j]: how many candidates come before place j of the vocabulary's order
    before = torch.zeros(index.lex.numel() + 1, dtype=torch.long)
    before[q + 1] = 1
    before = torch.cumsum(before, 0)
    inv = before[q]  # each candidate's place among the candidates in the pieces' order
    a = before[index.lo[tid]]  # and its run among them, [a, b)
    b = before[index.hi[tid]]
    ranks = torch.arange(m)
    lexorder = torch.empty_like(ranks)
    lexorder[inv] = ranks  # the candidates (their ranks) in the pieces' order
    if m <= small:
        merged, dead = _merge_loop(p[sub].tolist(), inv.tolist(), a.tolist(), b.tolist(), lexorder.tolist())
        mass[sub] = torch.tensor(merged, dtype=p.dtype)
        gone[sub] = torch.tensor(dead)
        return mass, gone
    best = _range_min(lexorder, a, b)  # the most likely candidate of each run (its rank)
    top = best == ranks  # the most likely of its own run
    # claimers: those with no shorter prefix among `top` (a run holding a's start is a prefix's run)
    cover = torch.zeros(m + 1, dtype=torch.long)
    cover.index_add_(0, a[top], torch.ones_like(a[top]))
    cover.index_add_(0, b[top], -torch.ones_like(b[top]))
    claim = top & (torch.cumsum(cover, 0)[:m][a] == 1)
    c = torch.nonzero(claim).squeeze(1)
    owner = torch.zeros(m + 1, dtype=torch.long)  # the claimer over each place (claimers' runs are disjoint)
    owner.index_add_(0, a[c], c + 1)
    owner.index_add_(0, b[c], -(c + 1))
    owner = torch.cumsum(owner, 0)[:m] - 1
    dest = owner[inv[best]]  # where each candidate's p goes
    merged = torch.zeros(m, dtype=p.dtype).index_add_(0, dest, p[sub])
    mass[sub] = merged
    gone[sub] = ~claim
    return mass, gone


def _merge_loop(p: list[float], inv: list[int], a: list[int], b: list[int],
                lexorder: list[int]) -> tuple[list[float], list[bool]]:
    """llama_sampler_infill_apply's merge loop (src/llama-sampler.cpp:4137-4181) over candidates 0..m-1 in
    order of p: i1 is visited for i0 when i0's piece is a prefix of i1's, i.e. i1's place inv[i1] (in the
    pieces' order) is in i0's run [a[i0], b[i0]); in increasing i1, as the C++ loop visits them."""
    dead = [False] * len(p)
    for i0 in range(len(p)):
        if dead[i0]:
            continue
        for i1 in sorted(lexorder[a[i0]:b[i0]]):
            if i1 == i0 or dead[i1]:
                continue
            dst, src = (i1, i0) if p[i1] > p[i0] else (i0, i1)
            p[dst] += p[src]
            p[src], dead[src] = 0.0, True
            if src == i0:
                break
    return p, dead


def infill(ids: torch.Tensor, logits: torch.Tensor, eog: torch.Tensor, eot: int,
           index: PieceIndex) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's infill sampler over sorted candidates (ids, logits, on the CPU): the survivors, in order.
    eog: the end-token ids; eot: the token left alone when no text candidate passes."""
    n = ids.numel()
    p = torch.softmax(logits.float(), 0)
    is_eog = torch.isin(ids, eog)
    p_eog = float(p[is_eog].sum())
    p_txt = float(p[~is_eog].sum())
    if 3 * p_eog * n > p_txt:
        return ids[is_eog], logits[is_eog]
    mass, gone = merge_prefixes(ids, p, logits > float("-inf"), index)
    logits = logits.masked_fill(gone, float("-inf"))  # as llama.cpp marks a merged token
    keep = (mass >= INFILL_THOLD) | is_eog
    n_txt = int((keep & ~is_eog).sum())
    if n_txt == 0:
        return torch.tensor([eot], dtype=ids.dtype), torch.tensor([1.0], dtype=logits.dtype)
    q = mass / mass[keep].sum()
    keep &= (q >= 1.0 / (n_txt + 1)) | is_eog
    return ids[keep], logits[keep]


def sample_chain(x: torch.Tensor, samplers: tuple[str, ...], *, top_k: int, top_p: float, min_p: float,
                 temperature: float, gen: torch.Generator | None, eog: frozenset[int] = frozenset(),
                 eot: int = 0, index=None) -> int:
    """One token from logits x (vocab,) through the chain `samplers` (names in CHAIN_SAMPLERS) and a final
    draw with `gen`. index: the tokenizer's PieceIndex, or a function that returns it (called only when the
    chain has "infill"). Candidates whose logit is already -inf (a grammar's mask) are not candidates.
    The candidates are sorted only where a sampler needs the order (top_k takes the k highest, top_p and
    infill sort): the draw does not, so a chain of min_p and temperature never sorts the vocabulary."""
    logits = x.float()
    ids = torch.arange(logits.numel(), device=logits.device)
    finite = logits > float("-inf")
    if not bool(finite.all()) and bool(finite.any()):
        logits, ids = logits[finite], ids[finite]
    ordered = False

    def order(logits, ids):
        logits, o = torch.sort(logits, descending=True, stable=True)
        return logits, ids[o]

    for name in samplers:
        if name == "top_k":
            if top_k > 0:
                if ordered:
                    logits, ids = logits[:top_k], ids[:top_k]
                else:
                    logits, o = torch.topk(logits, min(top_k, logits.numel()))
                    ids, ordered = ids[o], True
        elif name == "top_p":
            if top_p < 1.0:
                if not ordered:
                    (logits, ids), ordered = order(logits, ids), True
                cum = torch.cumsum(torch.softmax(logits, 0), 0)
                reached = torch.nonzero(cum >= top_p)
                if reached.numel():
                    k = int(reached[0]) + 1
                    logits, ids = logits[:k], ids[:k]
        elif name == "min_p":
            if min_p > 0.0:
                keep = logits >= logits.max() + math.log(min_p)
                logits, ids = logits[keep], ids[keep]
        elif name == "temperature":
            if temperature < SAMPLING_EPS:  # the highest logit (the first of equal ones) alone
                best = int(torch.argmax(logits))
                logits = torch.full_like(logits, float("-inf")).index_fill_(
                    0, torch.tensor([best], device=logits.device), float(logits[best]))
            else:
                logits = logits / temperature
        elif name == "infill":
            if not ordered:
                (logits, ids), ordered = order(logits, ids), True
            dev = ids.device
            pidx = index() if callable(index) else index
            eog_t = torch.tensor(sorted(eog), dtype=torch.long)
            ids, logits = infill(ids.cpu(), logits.cpu(), eog_t, eot, pidx)
            ids, logits = ids.to(dev), logits.to(dev)
        else:
            raise ValueError(f"unknown sampler {name!r}; the chain takes {', '.join(CHAIN_SAMPLERS)}")
    if ids.numel() == 1 or not bool((logits > float("-inf")).any()):
        return int(ids[int(torch.argmax(logits))]) if ids.numel() else eot
    probs = torch.softmax(logits, 0)
    if gen is not None and gen.device != probs.device:
        probs = probs.to(gen.device)
    return int(ids[int(torch.multinomial(probs, 1, generator=gen))])
