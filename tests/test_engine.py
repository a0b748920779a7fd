import pytest
import torch

from codeforge.engine import Engine, SamplingParams, apply_repetition_penalty, filter_logits
from codeforge.models.gpt import GPT, GPTConfig
from codeforge.tokenizer import CodeTokenizer

CONFIGS = {
    "gpt2": dict(),
    "llama": dict(norm="rmsnorm", pos="rope", mlp="swiglu", n_kv_head=1, bias=False, tie_embeddings=False),
    "qk_norm_relu2": dict(norm="rmsnorm", pos="rope", mlp="relu2", qk_norm=True),
}


def tiny_model(vocab, **kw):
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=vocab, block_size=64, n_layer=2, n_head=2, n_embd=32, **kw)
    m = GPT(cfg).eval()
    with torch.no_grad():  # larger weights than the init so greedy paths are not all the same token
        for p in m.parameters():
            if p.dim() >= 2:
                p.mul_(8)
    return m


def greedy_recompute(model, ids, n):
    ids = list(ids)
    out = []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids]))[0, -1]
            t = int(logits[:model.cfg.vocab_size].argmax())
            out.append(t)
            ids.append(t)
    return out


@pytest.fixture(scope="module")
def tok(tokenizer_dir):
    return CodeTokenizer.load(tokenizer_dir)


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_cache_equals_recompute_and_batching(tok, arch):
    model = tiny_model(tok.vocab_size, **CONFIGS[arch])
    eng = Engine(model, tok)
    prompts = [tok.encode("def add(a, b):\n    return"), tok.encode("package main\n\nfunc main() {"), [5]]
    p = SamplingParams(max_new_tokens=20, temperature=0, stop_at_eot=False)
    batched = [[] for _ in prompts]
    for step in eng.generate_ids(prompts, p):
        for i, t in enumerate(step):
            if t is not None:
                batched[i].append(t)
    for i, pr in enumerate(prompts):
        single = [s[0] for s in eng.generate_ids([pr], p)]
        ref = greedy_recompute(model, pr, 20)
        assert single == ref, arch
        assert batched[i] == ref, (arch, i)  # left-padded batch row == the prompt alone


def test_top_k_top_p_keep_exactly_the_right_tokens():
    probs = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]])
    logits = probs.log()
    def kept(lg):
        return torch.isfinite(lg)[0].tolist()
    assert kept(filter_logits(logits, top_k=2)) == [True, True, False, False, False]
    assert kept(filter_logits(logits, top_p=0.5)) == [True, False, False, False, False]
    assert kept(filter_logits(logits, top_p=0.6)) == [True, True, False, False, False]
    assert kept(filter_logits(logits, top_p=0.85)) == [True, True, True, False, False]
    assert kept(filter_logits(logits, top_p=0.86)) == [True, True, True, True, False]
    assert kept(filter_logits(logits, top_k=3, top_p=0.6)) == [True, True, False, False, False]
    shuffled = logits[:, [3, 0, 4, 2, 1]]  # order must not matter
    assert kept(filter_logits(shuffled, top_p=0.6)) == [False, True, False, False, True]
    # renormalised probabilities after top-p 0.85: 0.5/0.85, 0.2/0.85, 0.15/0.85
    p = filter_logits(logits, top_p=0.85).softmax(-1)[0]
    assert torch.allclose(p[:3], torch.tensor([0.5, 0.2, 0.15]) / 0.85)


def test_repetition_penalty_and_temperature_and_seed(tok):
    logits = torch.tensor([[2.0, -2.0, 1.0]])
    seen = torch.tensor([[True, True, False]])
    assert apply_repetition_penalty(logits, seen, 2.0).tolist() == [[1.0, -4.0, 1.0]]
    model = tiny_model(tok.vocab_size)
    eng = Engine(model, tok)
    pr = [tok.encode("x = ")]
    a = [s[0] for s in eng.generate_ids(pr, SamplingParams(max_new_tokens=15, temperature=1.0, seed=7,
                                                           stop_at_eot=False))]
    b = [s[0] for s in eng.generate_ids(pr, SamplingParams(max_new_tokens=15, temperature=1.0, seed=7,
                                                           stop_at_eot=False))]
    c = [s[0] for s in eng.generate_ids(pr, SamplingParams(max_new_tokens=15, temperature=1.0, seed=8,
                                                           stop_at_eot=False))]
    assert a == b and a != c
    # top_k=1 sampling is greedy whatever the temperature
    g = [s[0]
         for s in eng.generate_ids(pr, SamplingParams(max_new_tokens=15, temperature=0, stop_at_eot=False))]
    k1 = [s[0]
          for s in eng.generate_ids(pr, SamplingParams(max_new_tokens=15, temperature=5.0, top_k=1, seed=1,
                                                            stop_at_eot=False))]
    assert g == k1
    # a strong penalty stops greedy decoding from repeating any token
    r = [s[0] for s in eng.generate_ids(pr, SamplingParams(max_new_tokens=15, temperature=0,
                                                           repetition_penalty=1e6, stop_at_eot=False))]
    assert len(set(r)) == len(r) and not set(r) & set(pr[0])


def test_stop_sequences_stream_and_eot(tok):
    model = tiny_model(tok.vocab_size)
    eng = Engine(model, tok)
    p = SamplingParams(max_new_tokens=30, temperature=0, stop_at_eot=False)
    full = eng.generate(["def f():"], p)[0]
    assert len(full) > 10
    stop = full[8:11]
    cut = full[:full.find(stop)]
    p_stop = SamplingParams(max_new_tokens=30, temperature=0, stop=[stop], stop_at_eot=False)
    assert eng.generate(["def f():"], p_stop)[0] == cut
    assert "".join(eng.stream("def f():", p_stop)) == cut
    assert "".join(eng.stream("def f():", p)) == full
    # end-of-text: make it the only possible token, then nothing is emitted after it
    with torch.no_grad():
        model.lm_head.weight.zero_()
        model.lm_head.weight[tok.eot_id] = 1.0
        model.ln_f.weight.fill_(1.0)
        model.ln_f.bias.fill_(1.0)
    assert eng.generate(["x"], SamplingParams(max_new_tokens=10, temperature=0)) == [""]


def test_long_and_empty_prompts(tok):
    model = tiny_model(tok.vocab_size)
    eng = Engine(model, tok)
    warnings = []
    long = "a = 1\n" * 200
    out = eng.generate([long], SamplingParams(max_new_tokens=5, temperature=0, stop_at_eot=False),
                       warn=warnings.append)
    assert warnings and "keeping the last 63" in warnings[0]
    assert isinstance(out[0], str)
    steps = list(eng.generate_ids([[]], SamplingParams(max_new_tokens=5, temperature=0, stop_at_eot=False)))
    assert len(steps) == 5
    # context respected: a 60-token prompt leaves room for 4 new tokens only
    steps = list(eng.generate_ids([[7] * 60],
                                  SamplingParams(max_new_tokens=50, temperature=0, stop_at_eot=False)))
    assert len(steps) == 4
    with pytest.raises(ValueError, match="top_p"):
        list(eng.generate_ids([[1]], SamplingParams(top_p=0)))


def test_unseeded_sampling_leaves_global_rng_alone(tok):
    """Sampling during training must not disturb the RNG stream that dropout and exact resume rely on."""
    eng = Engine(tiny_model(tok.vocab_size), tok)
    state = torch.get_rng_state()
    eng.generate(["x"], SamplingParams(max_new_tokens=3, temperature=1.0, stop_at_eot=False))
    assert torch.equal(state, torch.get_rng_state())


def test_batch_of_short_and_long_prompts_stays_within_context(tok):
    """Rows share one cache padded to the longest prompt, so no row may run past the context."""
    model = tiny_model(tok.vocab_size)  # block_size 64
    eng = Engine(model, tok)
    steps = list(eng.generate_ids([[5] * 3, [6] * 50], SamplingParams(max_new_tokens=40, temperature=0,
                                                                      stop_at_eot=False)))
    assert len(steps) == 64 - 50
