"""models/cpu_decode.py: a decoding step in numpy gives GPT.forward's logits and
cache (to float32 rounding) for
every model option, batch rows at their own starts (positions and hidden padding), weights changed in place or
moved; it is used only where it applies; the engine's and the server's greedy tokens do not depend on it."""

from __future__ import annotations

import pytest
import torch

from codeforge.models import build_model, cpu_decode, cpu_linear
from codeforge.models.cpu_decode import Stepper, stepper, usable
from codeforge.models.gpt import GPT, GPTConfig
from codeforge.models.reward import RewardModel

pytestmark = pytest.mark.skipif(cpu_linear.backend() != "openblas", reason="numpy has no OpenBLAS here")

BASE = dict(vocab_size=96, block_size=64, n_layer=2, n_head=4, n_embd=32)
OPTIONS = {
    "gpt2": dict(),  # layernorm with bias, learned positions, gelu, tied
    "llama": dict(norm="rmsnorm", pos="rope", mlp="swiglu", bias=False, n_kv_head=2, tie_embeddings=False),
    "qwen-qknorm": dict(norm="rmsnorm", pos="rope", mlp="swiglu", bias=True, n_kv_head=1, qk_norm=True,
                        norm_eps=1e-6),
    "relu2-ln-nobias": dict(mlp="relu2", bias=False, qk_norm=True, pos="rope", n_kv_head=4),
}


def model_of(opts: dict, seed: int = 0):
    torch.manual_seed(seed)
    m = build_model(GPTConfig(**{**BASE, **opts})).eval()
    with torch.no_grad():  # norm gains and biases away from their initial 1 and 0, so that they count
        for n, p in m.named_parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn_like(p))
    return m


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape
    assert torch.allclose(a, b, atol=2e-5, rtol=1e-4), (a - b).abs().max().item()


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_steps_equal_gpt_forward_for_every_option(name):
    m = model_of(OPTIONS[name])
    st = Stepper(m)
    with torch.inference_mode():
        prompt = torch.randint(0, 96, (1, 9))
        ref, ours = m.new_kv_cache(1, 32, "cpu", torch.float32), m.new_kv_cache(1, 32, "cpu", torch.float32)
        m(prompt, kv_cache=ref), m(prompt, kv_cache=ours)
        tok = torch.tensor([5])
        for _ in range(12):
            want = m(tok.view(1, 1), kv_cache=ref, last_only=True)
            got = st.step(tok, ours)
            close(got, want)
            assert ours.len == ref.len
            tok = want[0, -1].argmax().view(1)
        for layer in range(m.cfg.n_layer):
            close(ours.k[layer][:, :, :ref.len], ref.k[layer][:, :, :ref.len])
            close(ours.v[layer][:, :, :ref.len], ref.v[layer][:, :, :ref.len])


@pytest.mark.parametrize("name,B", [("gpt2", 3), ("llama", 3), ("llama", 16)])
def test_rows_at_their_own_positions_behind_their_starts(name, B):
    """Rows left-padded to one length, as the engine's batch: given each row's start, GPT.forward and the
    numpy step count the row's positions from its first real token and hide the padding keys, so every row's
    logits are the ones it gets alone, unpadded."""
    m = model_of(OPTIONS[name], seed=1)
    st = Stepper(m)
    pads = [0, 3, 5] * (B // 3) + [7] * (B % 3)
    L = 8
    with torch.inference_mode():
        idx = torch.randint(0, 96, (B, L))
        ref, ours = (
            m.new_kv_cache(B, L + 6, "cpu", torch.float32),
            m.new_kv_cache(B, L + 6, "cpu", torch.float32),
        )
        first = m(idx, kv_cache=ref, starts=pads)
        m(idx, kv_cache=ours, starts=pads)
        alone = [m.new_kv_cache(1, L + 6, "cpu", torch.float32) for _ in range(B)]
        for b in range(B):
            close(m(idx[b:b + 1, pads[b]:], kv_cache=alone[b])[:, -1], first[b:b + 1, -1])
        nxt = torch.arange(7, 7 + B)
        for _ in range(6):
            want = m(nxt.unsqueeze(1), kv_cache=ref, starts=pads, last_only=True)
            close(st.step(nxt, ours, pads), want)
            for b in range(B):
                close(m(nxt[b].view(1, 1), kv_cache=alone[b], last_only=True), want[b:b + 1])
            nxt = want[:, -1].argmax(-1)


def test_the_models_masks_are_the_ones_the_engine_built_before():
    """gpt.attention_mask and gpt.positions give, for a left-padded prefill and each decode step after it,
    exactly the mask and positions the engine used to build itself (causal, no padding key, a padding query
    sees itself), so generation's arithmetic did not change when the model took them over."""
    from codeforge.models.gpt import attention_mask, positions
    pads, L = [0, 3, 5], 8
    p = torch.tensor(pads)
    keymask = torch.zeros(3, L + 4, dtype=torch.bool)
    keymask[:, :L] = torch.arange(L)[None] >= p[:, None]
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    built = ((causal & keymask[:, None, :L]) | torch.eye(L, dtype=torch.bool)).unsqueeze(1)
    assert torch.equal(attention_mask(L, 0, pads, "cpu"), built)
    assert torch.equal(positions(L, 0, pads, "cpu"), (torch.arange(L)[None] - p[:, None]).clamp(min=0))
    for t in range(4):
        keymask[:, L + t] = True
        assert torch.equal(attention_mask(1, L + t, pads, "cpu"), keymask[:, None, None, :L + t + 1])
        assert torch.equal(positions(1, L + t, pads, "cpu"), (L + t - p)[:, None])
    assert attention_mask(L, 0, None, "cpu") is None and attention_mask(1, 5, [0, 0], "cpu") is None
    chunk = attention_mask(3, 4, None, "cpu")  # three queries after four cached keys
    assert chunk.tolist() == [[True] * 5 + [False] * 2, [True] * 6 + [False], [True] * 7]


def test_an_option_the_step_does_not_know_leaves_the_step_to_pytorch():
    """A model option the numpy step does not implement (here a made-up sliding window on a config of its own)
    refuses the step when set, rather than being silently ignored; left at its default it changes nothing."""
    from dataclasses import dataclass, field

    @dataclass
    class WindowConfig(GPTConfig):
        window: int = field(default=0)

    cpu = torch.device("cpu")
    m = model_of(OPTIONS["llama"])
    with torch.inference_mode():
        m.cfg = WindowConfig(**m.cfg.to_dict())
        assert usable(m, cpu, "fp32") and stepper(m, cpu, "fp32") is not None
        m.cfg = WindowConfig(**{**m.cfg.to_dict(), "window": 16})
        assert not usable(m, cpu, "fp32") and stepper(m, cpu, "fp32") is None
        m.cfg = GPTConfig(**{**BASE, **OPTIONS["llama"]})
        m.cfg.mlp = "geglu"  # a value of a known option that the step does not implement
        assert not usable(m, cpu, "fp32")


def forward_and_step(m):
    """(GPT.forward's logits, the chosen Stepper's, or None where stepper() leaves the step to PyTorch) for
    one token after the same 4-token prompt."""
    with torch.inference_mode():
        prompt = torch.randint(0, 96, (1, 4), generator=torch.Generator().manual_seed(3))
        a, b = m.new_kv_cache(1, 8, "cpu", torch.float32), m.new_kv_cache(1, 8, "cpu", torch.float32)
        m(prompt, kv_cache=a), m(prompt, kv_cache=b)
        st = stepper(m, torch.device("cpu"), "fp32")
        want = m(torch.tensor([[1]]), kv_cache=a, last_only=True)
        return want, (st.step(torch.tensor([1]), b) if st is not None else None)


def test_weights_changed_in_place_or_moved_are_seen():
    m = model_of(OPTIONS["llama"])

    def both():
        return forward_and_step(m)

    before = both()[1]
    with torch.no_grad():
        m.blocks[0].mlp.c_fc.weight.mul_(1.5)  # an optimizer step: in place
    want, got = both()
    close(got, want)
    assert not torch.allclose(got, before)
    with torch.no_grad():
        m.blocks[1].attn.c_attn.weight = torch.nn.Parameter(m.blocks[1].attn.c_attn.weight * -1.0)  # moved
    want, got = both()
    close(got, want)


def test_a_replaced_module_or_a_hook_is_never_skipped():
    """A layer swapped for another module is read again; a module of a class of its own (an adapter) or a
    forward hook leaves the step to PyTorch, which runs them."""
    m = model_of(OPTIONS["llama"])

    def both():
        return forward_and_step(m)

    old = m.blocks[0].mlp.c_fc
    new = cpu_linear.Linear(old.in_features, old.out_features, bias=False)
    with torch.no_grad():
        new.weight.copy_(old.weight * 2)
    m.blocks[0].mlp.c_fc = new
    want, got = both()
    close(got, want)

    class Adapter(cpu_linear.Linear):
        def forward(self, x):
            return super().forward(x) + 1.0
    adapted = Adapter(old.in_features, old.out_features, bias=False)
    m.blocks[0].mlp.c_fc = adapted
    assert both()[1] is None
    m.blocks[0].mlp.c_fc = new
    hook = m.ln_f.register_forward_hook(lambda mod, args, out: out * 0.5)
    assert both()[1] is None
    hook.remove()
    want, got = both()
    close(got, want)


def test_a_one_thread_pool_keeps_openblas_to_one_thread(monkeypatch):
    """With PyTorch's pool at one thread the numpy step's products run on one thread too (OpenBLAS's default
    is every core: two pools wanting every core is what docs/LOG.md#2026-11-25-openblas-decode-products
    measured as a collapse)."""
    from threadpoolctl import threadpool_info
    m = model_of(OPTIONS["llama"])
    seen = []
    real = Stepper.step
    monkeypatch.setattr(Stepper, "step", lambda self, *a: seen.append(
        [i["num_threads"] for i in threadpool_info() if i.get("internal_api") == "openblas"
         and "numpy" in i["filepath"]]) or real(self, *a))  # numpy's own (scipy may have loaded another)
    before = torch.get_num_threads()
    cpu_linear._set_blas_threads(cpu_linear._openblas()[1], 2)
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            cache = m.new_kv_cache(1, 8, "cpu", torch.float32)
            m(torch.tensor([[1, 2]]), kv_cache=cache)
            with cpu_linear.decode_threads(m, 1):
                stepper(m, torch.device("cpu"), "fp32").step(torch.tensor([3]), cache)
    finally:
        torch.set_num_threads(before)
    assert seen and all(n == [1] for n in seen), seen


def test_nothing_is_kept_past_the_model_or_its_float32_weights():
    """No views outlive a conversion (bf16 weights: the step is not used, and the float32 storage can go),
    and the model is freed as soon as its last reference goes (no cycle through the step)."""
    import weakref
    cpu = torch.device("cpu")
    m = model_of(OPTIONS["llama"])
    with torch.inference_mode():
        assert stepper(m, cpu, "fp32") is not None and m in cpu_decode._STEPPERS
        m.to(torch.bfloat16)
        assert stepper(m, cpu, "fp32") is None and m not in cpu_decode._STEPPERS
        m.float()
        assert stepper(m, cpu, "fp32") is not None
    gone = weakref.ref(m)
    del m
    assert gone() is None


def test_past_the_context_is_refused_as_gpt_forward_does():
    m = model_of(OPTIONS["gpt2"])
    with torch.inference_mode():
        cache = m.new_kv_cache(1, 64, "cpu", torch.float32)
        m(torch.zeros(1, 64, dtype=torch.long), kv_cache=cache)
        with pytest.raises(ValueError, match="exceeds the model's context of 64"):
            Stepper(m).step(torch.tensor([1]), cache)


def test_used_only_where_it_applies(monkeypatch):
    m = model_of(OPTIONS["llama"])
    cpu = torch.device("cpu")
    with torch.inference_mode():
        assert usable(m, cpu, "fp32")
        assert stepper(m, cpu, "fp32") is stepper(m, cpu, "fp32")  # made once
        assert not usable(m, cpu, "bf16") and not usable(m, torch.device("meta"), "fp32")
        assert stepper(m, cpu, "bf16") is None
        # a small model's batch: PyTorch's threads multiply faster
        assert stepper(m, cpu, "fp32", rows=8) is None
        monkeypatch.setattr(cpu_linear, "MIN_WEIGHTS", 0)
        assert stepper(model_of(OPTIONS["llama"]), cpu, "fp32", rows=8) is not None  # mostly large matrices
        assert usable(RewardModel(m.cfg), cpu, "fp32")  # GPT's forward: its logits are the language model's

        class Other(GPT):
            def forward(self, *a, **k):
                return super().forward(*a, **k) * 2
        assert not usable(Other(m.cfg), cpu, "fp32")  # a forward of its own
    assert not usable(m, cpu, "fp32")  # gradients recorded: training
    with torch.inference_mode():
        m.train()  # training mode: the same arithmetic while there is no dropout
        assert usable(m, cpu, "fp32")
        assert not usable(model_of(dict(OPTIONS["llama"], resid_dropout=0.1)).train(), cpu, "fp32")
        m.eval()
    monkeypatch.setitem(cpu_linear._state, "blas", None)  # $CODEFORGE_CPU_MATMUL=torch, or no OpenBLAS
    with torch.inference_mode():
        assert not usable(m, cpu, "fp32")


def server_texts(eng, prompts: list[list[int]], n: int) -> list[str]:
    """Greedy texts of rows that join the server's scheduler together (one prefill shifts the other's columns,
    so the steps run with per-row positions and a mask)."""
    import threading

    from codeforge.serve.batcher import Row, RowParams, Scheduler
    sched = Scheduler(eng, max_batch=len(prompts), max_queue=8)
    sched.start()
    out: dict[int, str] = {}
    done = threading.Event()

    def emit(i):
        def f(ev):
            if ev.kind == "done":
                out[i] = ev.text
                if len(out) == len(prompts):
                    done.set()
            elif ev.kind == "error":
                raise AssertionError(ev.text)
        return f
    try:
        with sched.hold():
            sched.submit([Row(ids, RowParams(max_new_tokens=n, temperature=0.0), emit(i))
                          for i, ids in enumerate(prompts)])
        assert done.wait(60)
    finally:
        sched.stop()
    return [out[i] for i in range(len(prompts))]


def test_engine_and_server_tokens_do_not_depend_on_it(monkeypatch, tmp_path):
    """Greedy tokens of a padded batch through the engine, and greedy texts of rows through the server's
    scheduler, with the numpy step and with PyTorch's (usable forced off); the numpy step is really taken."""
    from codeforge.engine import Engine, SamplingParams
    from codeforge.tokenizer import train_tokenizer
    # the test's matrices count as large: batches take it too
    monkeypatch.setattr(cpu_linear, "MIN_WEIGHTS", 0)
    tok, _ = train_tokenizer(iter(["def add(a, b):\n    return a + b\n" * 20] * 4), 300, tmp_path / "tok")
    m = model_of(dict(OPTIONS["llama"], vocab_size=320))
    eng = Engine(m, tok, "cpu", "fp32")
    prompts = [tok.encode("def add(a"), tok.encode("def"), tok.encode("return a + b\n")]
    p = SamplingParams(max_new_tokens=12, temperature=0, stop_at_eot=False)
    calls = []
    real = Stepper.step
    monkeypatch.setattr(Stepper, "step", lambda self, *a: calls.append(a[2] is not None) or real(self, *a))
    fast = list(eng.generate_ids(prompts, p))
    assert len(calls) == 11 and all(calls)  # every step after the prefill, rows at their starts
    served = server_texts(eng, prompts, 10)
    assert len(calls) > 11 and any(calls[11:])  # the server's steps, some with rows at different columns
    monkeypatch.setattr(cpu_decode, "usable", lambda *a: False)
    n = len(calls)
    assert list(eng.generate_ids(prompts, p)) == fast
    assert server_texts(eng, prompts, 10) == served
    assert len(calls) == n
