"""llama-server's generation behaviour in the batcher (issue 58): n_indent and t_max_predict_ms stops
(driven token by token through Scheduler._accept with a tokenizer whose pieces are chosen, and a fake clock),
llama.cpp's sampler chain and its infill sampler on hand-made logits (checked against a literal port of the
C++ loop), and the per-slot prompt cache on a tiny random GPT (a shared prefix is copied, not computed, and
changes nothing the model computes)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from codeforge.models.gpt import GPT, GPTConfig
from codeforge.serve import batcher
from codeforge.serve.batcher import Event, Row, RowParams, Scheduler
from codeforge.serve.prompt_cache import PromptCache
from codeforge.serve.sampling import PieceIndex, infill, merge_prefixes, piece_index, sample_chain

EOT = 0
WORDS = ["<|endoftext|>", "foo", "\n", "  bar", "a", "b", "\t", " ", "x", "    baz", "\n  bar", "y", "  baz",
         "END", "z"]


class FakeTok:
    """256 ids: the WORDS above, then one character each; id 0 is a special end-of-text token."""

    def __init__(self):
        self.pieces = WORDS + [chr(0x100 + i) for i in range(256 - len(WORDS))]
        self.vocab_size = len(self.pieces)
        self.eot_id = EOT
        self.special_ids = {"<|endoftext|>": EOT}

    def id(self, piece: str) -> int:
        return self.pieces.index(piece)

    def decode(self, ids, skip_special: bool = False) -> str:
        return "".join("" if (i == EOT and skip_special) else self.pieces[i] for i in ids)


def scheduler(model=None, tok=None, block_size: int = 64, **kw) -> Scheduler:
    eng = SimpleNamespace(model=model, tok=tok or FakeTok(), device=torch.device("cpu"),
                          block_size=block_size, cache_dtype=torch.float32, precision="fp32")
    return Scheduler(eng, **kw)


def scripted(sched: Scheduler, pieces: list[str], **params) -> tuple[Row, list[Event]]:
    """A row fed `pieces` (one token each) through _accept; stops early when the row finishes."""
    events: list[Event] = []
    r = Row([1], RowParams(max_new_tokens=params.pop("max_new_tokens", 100),
                           stop_ids=frozenset({EOT}), **params), events.append)
    for p in pieces:
        if r.done:
            break
        sched._accept(r, sched.tok.id(p))
    return r, events


def done(events: list[Event]) -> Event | None:
    return next((e for e in events if e.kind == "done"), None)


# -- n_indent ------------------------------------------------------------------------------------------------

def test_n_indent_cuts_the_short_line_keeping_its_newline_and_indentation():
    s = scheduler()
    r, evs = scripted(s, ["foo", "\n", "  bar", "\n"], n_indent=4)
    d = done(evs)
    assert d is not None and d.text == "foo\n  " and d.stop_type == "limit" and d.finish_reason == "length"
    assert d.completion_tokens == 4 and d.predicted_n == 4  # the cut tokens still count
    assert r.out == [s.tok.id(p) for p in ["foo", "\n", "  bar", "\n"]]  # the tokens are not trimmed


def test_n_indent_blank_line_stops():
    r, evs = scripted(scheduler(), ["a", "\n", "\n", "b", "c"], n_indent=1)
    d = done(evs)
    assert d.text == "a\n" and d.stop_type == "limit" and d.completion_tokens == 4


def test_n_indent_first_line_is_never_judged_and_deep_enough_lines_pass():
    # the first line has no indentation at all; the next ones have 4: nothing stops
    r, evs = scripted(scheduler(), ["x", "y", "\n", "    baz", "\n", "    baz", "\n", "    baz"], n_indent=4)
    assert not r.done and done(evs) is None
    # lines of exactly n_indent pass; the first shorter one is cut before its text
    r, evs = scripted(scheduler(), ["foo", "\n", "  bar", "\n", "  baz", "\n", "x", "y"], n_indent=2)
    d = done(evs)
    assert d.text == "foo\n  bar\n  baz\n" and d.completion_tokens == 7


def test_n_indent_lags_one_token_behind_the_newline():
    s = scheduler()
    # "\n  bar" brings line 2 with its newline: the next token indexes the line, the one after judges it
    r, evs = scripted(s, ["foo", "\n  bar", "x"], n_indent=4)
    assert not r.done
    s._accept(r, s.tok.id("y"))
    d = done(evs)
    assert d.text == "foo\n  " and d.completion_tokens == 4
    # a line of spaces only is not judged until a character follows them; a tab counts as one
    r, evs = scripted(s, ["foo", "\n", " ", " "], n_indent=4)
    assert not r.done
    s._accept(r, s.tok.id("x"))
    assert done(evs).text == "foo\n  "
    r, evs = scripted(s, ["foo", "\n", "\t", "x"], n_indent=2)
    assert done(evs).text == "foo\n\t"


def test_n_indent_on_an_end_token_cuts_but_reports_eos():
    r, evs = scripted(scheduler(), ["foo", "\n", "x", "<|endoftext|>"], n_indent=4)
    d = done(evs)
    assert d.text == "foo\n" and d.stop_type == "eos" and d.finish_reason == "stop"
    assert d.completion_tokens == 4


def test_n_indent_zero_changes_nothing():
    r, evs = scripted(scheduler(), ["foo", "\n", "x", "\n", "\n", "y"], max_new_tokens=6)
    d = done(evs)
    assert d.text == "foo\nx\n\ny" and d.stop_type == "limit" and d.completion_tokens == 6
    assert "".join(e.text for e in evs if e.kind == "text") == d.text


def test_streamed_text_is_not_taken_back_by_the_cut():
    r, evs = scripted(scheduler(), ["foo", "\n", "  bar", "\n"], n_indent=4)
    streamed = "".join(e.text for e in evs if e.kind == "text")
    assert streamed.startswith("foo\n  bar") and done(evs).text == "foo\n  "


# -- t_max_predict_ms ----------------------------------------------------------------------------------------

@pytest.fixture
def clock(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(batcher.time, "monotonic", lambda: now[0])
    return now


def feed(s: Scheduler, r: Row, clock, timed: list[tuple[float, str]]) -> None:
    for t, piece in timed:
        if r.done:
            return
        clock[0] = 1000.0 + t
        s._accept(r, s.tok.id(piece))


def test_t_max_predict_ms_stops_on_a_newline_after_the_limit(clock):
    s = scheduler()
    evs: list[Event] = []
    r = Row([1], RowParams(max_new_tokens=100, stop_ids=frozenset({EOT}), t_max_predict_ms=100), evs.append)
    feed(s, r, clock, [(0.0, "foo"), (0.05, "\n"), (0.5, "x"), (0.55, "y")])
    assert not r.done  # 50 ms at the newline; no newline since
    feed(s, r, clock, [(0.6, "\n"), (0.7, "z")])
    d = done(evs)
    assert d.text == "foo\nxy\n" and d.stop_type == "limit" and d.completion_tokens == 5  # newline kept
    assert d.predicted_ms == pytest.approx(600.0) and d.predicted_n == 5


def test_t_max_predict_ms_first_token_and_disabled(clock):
    s = scheduler()
    for limit in (0, -1):
        evs: list[Event] = []
        r = Row([1], RowParams(max_new_tokens=100, t_max_predict_ms=limit), evs.append)
        feed(s, r, clock, [(0.0, "\n"), (9.0, "\n"), (20.0, "x"), (30.0, "\n")])
        assert not r.done
    evs = []
    r = Row([1], RowParams(max_new_tokens=100, t_max_predict_ms=1), evs.append)
    clock[0] = 5000.0  # long after admission: the clock starts at the first token, which never stops
    s._accept(r, s.tok.id("\n"))
    assert not r.done
    clock[0] += 0.002
    s._accept(r, s.tok.id("\n"))
    assert done(evs).text == "\n\n"


def test_t_max_predict_ms_counts_a_newline_only_once_released(clock):
    s = scheduler()
    evs: list[Event] = []
    r = Row([1], RowParams(max_new_tokens=100, stop=["\nEND"], t_max_predict_ms=100), evs.append)
    feed(s, r, clock, [(0.0, "a"), (1.0, "\n")])
    assert not r.done  # the newline may start "\nEND": held back, not sent
    feed(s, r, clock, [(1.1, "b")])
    d = done(evs)
    assert d.text == "a\nb" and d.stop_type == "limit"


# -- the sampler chain ---------------------------------------------------------------------------------------

def chain(x, samplers, seed=0, **kw):
    args = dict(top_k=0, top_p=1.0, min_p=0.0, temperature=1.0, eog=frozenset({EOT}), eot=EOT)
    args.update(kw)
    g = torch.Generator().manual_seed(seed)
    return sample_chain(torch.as_tensor(x, dtype=torch.float32), tuple(samplers), gen=g, **args)


def test_chain_order_matters_and_temperature_only_in_the_chain():
    x = [2.0, 1.0, 0.0, -5.0]
    # min_p on the raw logits keeps 0 and 1; after temperature 0.5 only 0 passes it
    raw = {chain(x, ["min_p", "temperature"], s, min_p=0.3, temperature=0.5) for s in range(200)}
    scaled = {chain(x, ["temperature", "min_p"], s, min_p=0.3, temperature=0.5) for s in range(200)}
    assert raw == {0, 1} and scaled == {0}
    # without "temperature" in the chain the temperature field is not used (T=1)
    assert [chain(x, ["top_k"], s, top_k=3, temperature=0.01) for s in range(50)] == \
        [chain(x, ["top_k"], s, top_k=3, temperature=7.0) for s in range(50)]
    # greedy: temperature 0 in the chain, or top_k 1
    big = torch.randn(300, generator=torch.Generator().manual_seed(1))
    best = int(big.argmax())
    assert {chain(big, ["top_k", "temperature"], s, top_k=40, temperature=0.0) for s in range(20)} == {best}
    assert {chain(big, ["top_k", "top_p"], s, top_k=1, top_p=0.5) for s in range(20)} == {best}
    # [] draws from the whole softmax; a seed fixes the draw
    draws = [chain(big, [], s) for s in range(100)]
    assert len(set(draws)) > 20 and draws == [chain(big, [], s) for s in range(100)]


def test_top_p_and_min_p_keep_what_llama_cpp_keeps():
    x = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert {chain(x, ["top_p"], s, top_p=0.79) for s in range(200)} == {0, 1}  # 0.5 + 0.3 reaches 0.79
    assert {chain(x, ["top_p"], s, top_p=0.81) for s in range(200)} == {0, 1, 2}
    assert {chain(x, ["min_p"], s, min_p=0.29) for s in range(300)} == {0, 1, 2}  # 0.15 >= 0.29 * 0.5
    assert {chain(x, ["min_p"], s, min_p=0.31) for s in range(300)} == {0, 1}
    # a grammar's -inf logits are never candidates
    y = torch.tensor([float("-inf"), 1.0, float("-inf"), 1.0])
    assert {chain(y, [], s) for s in range(50)} == {1, 3}


def index_of(pieces: list[str]) -> PieceIndex:
    return PieceIndex([p.encode() for p in pieces])


def run_infill(probs: list[float], pieces: list[str], eog=(EOT,)):
    """infill over candidates with these probabilities (ids 0.., sorted as the chain keeps them): the
    surviving ids."""
    lg = torch.log(torch.tensor(probs, dtype=torch.float32))
    lg, order = torch.sort(lg, descending=True, stable=True)
    ids, _ = infill(order, lg, torch.tensor(list(eog)), EOT, index_of(pieces))
    return sorted(ids.tolist())


def test_infill_end_branch():
    # id 0 ends: 3 * 0.1 * 4 > 0.9, so only end tokens are left
    assert run_infill([0.1, 0.5, 0.3, 0.1], ["", "a", "b", "c"]) == [0]
    # 3 * 0.02 * 4 < 0.98: the text tokens go on
    assert run_infill([0.02, 0.6, 0.3, 0.08], ["", "a", "b", "c"]) == [0, 1]


def test_infill_prefix_merge_and_thresholds():
    # "a" (0.30) takes "ab" and "abc": 0.74 against "x" 0.26, under 1/3 in the second pass
    assert run_infill([0.0001, 0.30, 0.24, 0.20, 0.2599], ["", "a", "ab", "abc", "x"]) == [0, 1]
    # the longer piece more likely: "a" goes into "ab"
    assert run_infill([0.0001, 0.32, 0.40, 0.2799], ["", "a", "ab", "x"]) == [0, 2]
    # no merge: 0.19 fails 0.2; then 0.45 and 0.36 renormalised pass 1/3
    assert run_infill([0.0001, 0.45, 0.36, 0.1899], ["", "a", "b", "c"]) == [0, 1, 2]
    # the second pass: 0.237 and 0.226 of three fail 1/4
    assert run_infill([0.0001, 0.5, 0.22, 0.21, 0.0699], ["", "a", "b", "c", "d"]) == [0, 1]
    # an end token stays whatever its probability (it never merges: no text)
    assert EOT in run_infill([1e-6, 0.6, 0.4 - 1e-6], ["", "a", "b"])


def test_infill_forces_end_of_text_when_no_text_token_passes():
    probs = [0.001] + [0.999 / 6] * 6  # six text tokens under 0.2; the end token too unlikely to win
    ids, logits = infill(torch.arange(7), torch.log(torch.tensor(probs)), torch.tensor([EOT]), EOT,
                         index_of(["", "a", "b", "c", "d", "e", "f"]))
    assert ids.tolist() == [EOT]
    # through the chain, with another end token among the row's: end-of-text, whatever the seed
    x = torch.log(torch.tensor(probs + [1e-9] * 249))
    index = index_of(["", "a", "b", "c", "d", "e", "f"] + [chr(0x200 + i) for i in range(249)])
    assert {chain(x, ["infill"], s, eog=frozenset({EOT, 100}), index=index) for s in range(10)} == {EOT}


def literal_infill_merge(ids, p, logits, pieces):
    """llama_sampler_infill_apply's merge loop (src/llama-sampler.cpp:4137-4181), as written."""
    p, logits = list(p), list(logits)
    for i0 in range(len(ids)):
        for i1 in range(len(ids)):
            if logits[i0] == float("-inf"):
                break
            if i0 == i1 or logits[i1] == float("-inf"):
                continue
            a, b = pieces[ids[i0]], pieces[ids[i1]]
            if 0 < len(a) <= len(b) and b[:len(a)] == a:
                dst, src = (i1, i0) if p[i1] > p[i0] else (i0, i1)
                p[dst] += p[src]
                logits[src], p[src] = float("-inf"), 0.0
    return p, logits


@pytest.mark.parametrize("small", [0, 128])  # the O(n log n) way, and llama.cpp's loop over prefix pairs
def test_prefix_merge_equals_the_literal_loop(small):
    rng = random.Random(0)
    for trial in range(300):
        V = rng.randint(2, 120)
        alphabet = b"ab" if trial % 2 else b"abc\xff"
        pieces = [b"" if rng.random() < 0.1 else bytes(rng.choice(alphabet) for _ in range(rng.randint(1, 4)))
                  for _ in range(V)]
        index = PieceIndex(pieces)
        n = rng.randint(1, V)
        ids = torch.tensor(rng.sample(range(V), n))
        lg = torch.randn(n, dtype=torch.float64) * rng.choice([0.5, 2.0, 5.0])
        if trial % 3 == 0:
            lg[torch.rand(n, generator=torch.Generator().manual_seed(trial)) < 0.2] = float("-inf")
        if not bool((lg > float("-inf")).any()):
            continue
        lg, order = torch.sort(lg, descending=True, stable=True)
        ids = ids[order]
        p = torch.softmax(lg, 0)
        mass, gone = merge_prefixes(ids, p, lg > float("-inf"), index, small=small)
        ref_p, ref_logits = literal_infill_merge(ids.tolist(), p.tolist(), lg.tolist(), pieces)
        assert torch.allclose(mass, torch.tensor(ref_p, dtype=mass.dtype), atol=1e-12), trial
        merged = [a == float("-inf") and b > float("-inf") for a, b in zip(ref_logits, lg.tolist())]
        assert gone.tolist() == merged, trial


def test_prefix_merge_with_equal_logits_as_llama_cpp_up_to_top_k_sizes():
    """Equal probabilities: the C++ loop lets the later of two equal tokens absorb the earlier (`>` is
    strict); the loop as written keeps that, for the candidate counts top_k leaves."""
    rng = random.Random(1)
    for trial in range(500):
        V = rng.randint(2, 60)
        pieces = [bytes(rng.choice(b"ab") for _ in range(rng.randint(1, 3))) for _ in range(V)]
        n = rng.randint(1, min(V, 40))
        ids = torch.tensor(rng.sample(range(V), n))
        lg = torch.tensor([float(rng.randint(0, 3)) for _ in range(n)])  # many ties
        lg, order = torch.sort(lg, descending=True, stable=True)
        ids = ids[order]
        p = torch.softmax(lg, 0)
        mass, gone = merge_prefixes(ids, p, lg > float("-inf"), PieceIndex(pieces))
        ref_p, ref_logits = literal_infill_merge(ids.tolist(), p.tolist(), lg.tolist(), pieces)
        assert torch.allclose(mass, torch.tensor(ref_p), atol=1e-6), trial
        assert gone.tolist() == [x == float("-inf") for x in ref_logits], trial


def test_token_pieces_of_a_real_tokenizer(tokenizer_dir):
    from codeforge.tokenizer import CodeTokenizer
    tok = CodeTokenizer.load(tokenizer_dir)
    index = piece_index(tok)
    assert piece_index(tok) is index  # once per tokenizer
    assert index.pieces[tok.eot_id] == b""
    text = "def café(x):\n    return x  # ünïcode\n"
    assert b"".join(index.pieces[i] for i in tok.encode(text)) == text.encode()


# -- the prompt cache ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=2, n_embd=32)).eval()
    return model


def generate(sched: Scheduler, prompt: list[int], **params) -> Event:
    """One row through the loop's step function, in this thread: its done event."""
    events: list[Event] = []
    p = RowParams(max_new_tokens=params.pop("max_new_tokens", 8), temperature=params.pop("temperature", 0.0),
                  **params)
    r = Row(prompt, p, events.append)
    with torch.inference_mode():
        sched._step([r])
        while sched.active:
            sched._step([])
    assert events[-1].kind == "done", events[-1]
    return events[-1]


def prompt_of(seed: int, n: int, other: bool = False) -> list[int]:
    """n random token ids, from 1..127 (other: from 128..255, so nothing is shared with the first kind)."""
    lo = 128 if other else 1
    return torch.randint(lo, lo + 127, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_shared_prefix_computes_only_the_new_tokens(tiny):
    s, fresh = scheduler(tiny), scheduler(tiny, prompt_cache_entries=0)
    a = prompt_of(1, 30)
    b = a[:24] + prompt_of(2, 10, other=True)
    first = generate(s, a)
    assert first.prompt_n == 30 and first.tokens_cached == 30 + 8 - 1 and first.n_ctx == 64
    assert first.predicted_n == first.completion_tokens == 8 and first.predicted_ms >= 0.001
    second = generate(s, b)
    assert second.prompt_n == 10  # 24 tokens from the cache
    assert second.text == generate(fresh, b).text and generate(fresh, b).prompt_n == 34
    assert s.stats["prompt_tokens_cached"] == 24 and s.stats["prompt_tokens"] == 40
    # the same prompt again: one token is computed (its logits start the reply)
    again = generate(s, b)
    assert again.prompt_n == 1 and again.text == second.text
    # sampled rows too: a seed gives what it gives uncached
    kw = dict(temperature=0.9, seed=7, max_new_tokens=12)
    assert generate(s, b + [5, 6], **kw).text == generate(fresh, b + [5, 6], **kw).text


def test_cached_prefill_logits_equal_a_full_prefill(tiny):
    s = scheduler(tiny)
    a = prompt_of(3, 40)
    generate(s, a[:25], max_new_tokens=1)
    r = Row(a, RowParams(max_new_tokens=4, temperature=0.0), lambda ev: None)
    with torch.inference_mode():
        s._admit(r)
        full = tiny(torch.tensor([a]))[0, -1]
    assert r.prompt_n == 15
    assert torch.allclose(s.logits[-1].float(), full.float(), atol=1e-4)
    # and every cached position's keys and values are a full prefill's
    entry = s.prompt_cache.entries[s.prompt_cache.choose(a)]
    ref = tiny.new_kv_cache(1, 40, "cpu", torch.float32)
    with torch.inference_mode():
        tiny(torch.tensor([a]), kv_cache=ref)
    for got, want in zip(entry.k + entry.v, ref.k + ref.v):
        assert torch.allclose(got, want[0], atol=1e-5)


def test_cache_prompt_false_computes_everything_and_leaves_the_cache(tiny):
    s = scheduler(tiny)
    a = prompt_of(4, 20)
    generate(s, a)
    held = [e.tokens.tolist() if e else None for e in s.prompt_cache.entries]
    ev = generate(s, a + [9], cache_prompt=False)
    assert ev.prompt_n == 21
    assert [e.tokens.tolist() if e else None for e in s.prompt_cache.entries] == held


def test_cache_slot_names_the_entry(tiny):
    s = scheduler(tiny, max_batch=2)
    assert len(s.prompt_cache) == 4  # at least llama-server's 4 slots
    a, b = prompt_of(5, 20), prompt_of(6, 20, other=True)
    generate(s, a, cache_slot=0)
    generate(s, b, cache_slot=1)
    assert generate(s, a + [7, 8], cache_slot=1).prompt_n == 22  # slot 1 holds b: nothing shared
    assert generate(s, a + [7, 8], cache_slot=4).prompt_n == 2  # 4 wraps to slot 0, which holds a
    # no slot: the entry with the longest shared prefix (slot 1 now holds a + [7, 8])
    assert generate(s, a + [7, 8, 9]).prompt_n == 1
    # a prompt sharing 10% or less goes to the least recently used entry (an empty one first)
    c = a[:2] + prompt_of(7, 18, other=True)
    assert generate(s, c).prompt_n == 20
    assert sum(e is not None for e in s.prompt_cache.entries) == 3


def test_warm_up_fills_the_cache(tiny):
    s = scheduler(tiny)
    a = prompt_of(8, 40)
    warm = generate(s, a, max_new_tokens=0, cache_slot=0)
    assert (warm.text, warm.completion_tokens, warm.stop_type) == ("", 0, "limit")
    assert warm.prompt_n == 40 and warm.tokens_cached == 40 and warm.predicted_n == 0 and warm.prompt_ms >= 0
    assert generate(s, a + [3, 4, 5], cache_slot=0).prompt_n == 3
    # without the cache a warm-up computes nothing (as before: nothing to keep)
    cold = generate(s, a, max_new_tokens=0, cache_prompt=False)
    assert cold.prompt_n == 0 and cold.completion_tokens == 0 and cold.text == ""


def test_echo_bypasses_the_cache(tiny):
    s = scheduler(tiny)
    a = prompt_of(9, 20)
    generate(s, a)
    ev = generate(s, a, max_new_tokens=0, prompt_logprobs=1)
    assert ev.prompt_n == 20 and len(ev.prompt_logprobs) == 20


def test_rows_admitted_together_share_an_entry(tiny):
    s, fresh = scheduler(tiny), scheduler(tiny, prompt_cache_entries=0)
    a = prompt_of(10, 30)
    generate(s, a, max_new_tokens=0)
    outs: dict[int, list[Event]] = {0: [], 1: []}
    rows = [Row(a + [i + 1] * 3, RowParams(max_new_tokens=6, temperature=0.0), outs[i].append)
            for i in (0, 1)]
    with torch.inference_mode():
        s._step(rows)
        while s.active:
            s._step([])
    for i, r in enumerate(rows):
        d = outs[i][-1]
        assert d.kind == "done" and d.prompt_n == 3  # the second reads the entry the first just stored
        assert d.text == generate(fresh, r.prompt, max_new_tokens=6).text


def test_chain_rows_through_the_loop(tiny):
    s = scheduler(tiny)
    a = prompt_of(11, 20)
    greedy = generate(s, a, max_new_tokens=10)
    assert generate(s, a, max_new_tokens=10, samplers=("top_k", "temperature"), top_k=40,
                    temperature=0.0).text == greedy.text
    kw = dict(max_new_tokens=10, samplers=("top_k", "top_p", "min_p", "temperature"), top_k=20, top_p=0.9,
              temperature=0.8, seed=3)
    assert generate(s, a, **kw).text == generate(s, a, **kw).text


def test_prompt_cache_choice_unit():
    c = PromptCache(3)
    z = [torch.zeros(1, 1, 1)]
    assert c.choose([1, 2, 3]) == 0  # all empty: the first
    c.store(0, [1, 2, 3, 4], z, z)
    c.store(1, [5, 6, 7], z, z)
    assert c.choose([1, 2, 3, 9]) == 0 and c.reuse(0, [1, 2, 3, 9])[0] == 3
    assert c.reuse(0, [1, 2, 3, 4])[0] == 3  # at most the prompt less one
    assert c.choose([8, 8, 8]) == 2  # nothing shared: the empty entry
    c.store(2, [8], z, z)
    assert c.choose([9]) == 0  # the least recently used
    assert c.choose([5, 6], slot=7) == 1
