import pytest
import torch

from codeforge.config import resolve
from codeforge.models.gpt import GPT, GPTConfig
from codeforge.models.lm_loss import lm_loss
from codeforge.train.optim import build_optimizer, lr_at

# The README's table: true parameter counts at each preset's listed vocabulary.
COUNTS = {
    "gpt2-tiny": 51_500_032, "gpt2-small": 124_475_904, "gpt2-medium": 254_101_504,
    "fragment-lowend": 5_785_088, "fragment-midrange": 14_684_160, "fragment-highend": 93_522_432,
    "tiny": 11_340_032, "medium": 109_529_856, "large": 1_034_344_000, "xlarge": 2_078_967_808,
    "qwen-small": 128_404_224, "cpu-small": 3_401_856,
}


@pytest.mark.parametrize("name", list(COUNTS))
def test_presets_build_with_stated_counts(name):
    cfg = resolve([name]).model
    with torch.device("meta"):
        model = GPT(cfg)
    assert model.num_params() == COUNTS[name]


def test_gpt2_small_count_by_formula():
    V, T, C, L = 50304, 1024, 768, 12
    assert COUNTS["gpt2-small"] == V * C + T * C + L * (12 * C * C + 13 * C) + 2 * C


def small(**kw):
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=300, block_size=32, n_layer=2, n_head=4, n_embd=64, **kw))


@pytest.mark.parametrize("kw", [{}, dict(norm="rmsnorm", pos="rope", mlp="swiglu", n_kv_head=2, bias=False,
                                         tie_embeddings=False, qk_norm=True), dict(mlp="relu2")])
def test_forward_shapes_groups_and_init(kw):
    m = small(**kw)
    x = torch.randint(0, 300, (3, 16))
    assert m(x).shape == (3, 16, 300)
    loss = m(x, torch.randint(0, 300, (3, 16)))
    # ~uniform at init
    assert loss.ndim == 0 and abs(loss.item() - torch.log(torch.tensor(300.0)).item()) < 0.5
    groups = m.optim_groups(0.1)
    ids = [id(p) for g in groups for p in g["params"]]
    assert len(ids) == len(set(ids)) == len(list(m.parameters()))
    assert m.blocks[0].attn.c_proj.weight.std().item() < 0.02 / 1.5  # residual projections scaled by depth


def test_chunked_loss_equals_plain_fp32():
    torch.manual_seed(0)
    h = torch.randn(2, 40, 16, requires_grad=True)
    w = torch.randn(97, 16, requires_grad=True)
    y = torch.randint(0, 97, (2, 40))
    y[0, :5] = -1  # ignored targets
    ref = lm_loss(h, w, y)
    gh, gw = torch.autograd.grad(ref, [h, w])
    fast = lm_loss(h, w, y, chunk_rows=7)
    fh, fw = torch.autograd.grad(fast * 1.0, [h, w])
    assert torch.allclose(fast, ref, atol=1e-6)
    assert torch.allclose(fh, gh, atol=1e-6) and torch.allclose(fw, gw, atol=1e-6)


def test_chunked_loss_exact_where_the_target_probability_underflows():
    """The fused loss reads log-sum-exp back from each row's largest probability, which never underflows: a
    target ~200 nats below the top logit (its softmax probability is 0 in float32) still gets the plain
    path's loss and gradients; a batch with every target ignored gives 0 and zero gradients."""
    torch.manual_seed(0)
    h = (torch.randn(3, 8, 16) * 20).requires_grad_()
    w = torch.randn(50, 16, requires_grad=True)
    y = torch.randint(0, 50, (3, 8))
    logits = torch.nn.functional.linear(h, w).detach()
    y[0] = logits[0].argmin(-1)  # the least likely token: far below the top
    assert (logits[0].max(-1).values - logits[0].min(-1).values).min() > 150
    ref = lm_loss(h, w, y)
    gh, gw = torch.autograd.grad(ref, [h, w])
    fast = lm_loss(h, w, y, chunk_rows=5)
    fh, fw = torch.autograd.grad(fast, [h, w])
    assert torch.isfinite(fast) and torch.allclose(fast, ref, rtol=1e-5)
    assert torch.allclose(fh, gh, rtol=1e-4, atol=1e-5) and torch.allclose(fw, gw, rtol=1e-4, atol=1e-5)
    none = torch.full_like(y, -1)
    zero = lm_loss(h, w, none, chunk_rows=5)
    zh, zw = torch.autograd.grad(zero, [h, w])
    assert zero.item() == 0.0 and not zh.any() and not zw.any()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_fast_path_loss_curve_matches_plain(precision):
    """Training with the fused chunked loss follows the plain path's losses (bf16: within bf16 tolerance)."""
    from codeforge.device import autocast
    curves = {}
    for rows in (0, 24):
        m = small()
        m.loss_chunk_rows = rows
        opt = build_optimizer(m, "adamw", 3e-3, 0.1, (0.9, 0.95), torch.device("cpu"))
        g = torch.Generator().manual_seed(1)
        data = torch.randint(0, 300, (8, 4, 33), generator=g)
        out = []
        for step in range(8):
            x, y = data[step, :, :-1], data[step, :, 1:]
            with autocast(torch.device("cpu"), precision):
                loss = m(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            out.append(loss.item())
        curves[rows] = out
    tol = 1e-5 if precision == "fp32" else 3e-2
    assert all(abs(a - b) < tol for a, b in zip(curves[0], curves[24])), curves


def test_gradient_checkpointing_same_grads():
    grads = []
    for ckpt in (False, True):
        m = small()
        m.grad_checkpointing = ckpt
        x = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(3))
        m(x, x).backward()
        grads.append(torch.cat([p.grad.flatten() for p in m.parameters()]))
    assert torch.allclose(grads[0], grads[1], atol=1e-6)


def test_context_overflow_refused():
    with pytest.raises(ValueError, match="exceeds the model's context of 32"):
        small()(torch.zeros(1, 33, dtype=torch.long))


def test_schedules():
    kw = dict(base_lr=1.0, warmup=10, total=110, min_ratio=0.1)
    assert lr_at(0, **kw) == pytest.approx(0.1) and lr_at(9, **kw) == pytest.approx(1.0)
    assert lr_at(110, **kw) == pytest.approx(0.1) and lr_at(60, **kw) == pytest.approx(0.55)
    assert lr_at(60, schedule="linear", **kw) == pytest.approx(0.55)
    assert lr_at(100, schedule="constant", **kw) == 1.0
    assert lr_at(50, schedule="wsd", **kw) == 1.0 and lr_at(110, schedule="wsd", **kw) == pytest.approx(0.1)
    assert lr_at(100, schedule="wsd", **kw) == pytest.approx(1.0 - 0.9 * 0.5)


def test_adamw8bit_refused_on_cpu():
    with pytest.raises(ValueError, match="adamw8bit needs a CUDA device"):
        build_optimizer(small(), "adamw8bit", 1e-3, 0.1, (0.9, 0.95), torch.device("cpu"))


def test_muon_takes_the_hidden_matrices_and_trains():
    """optimizer muon: the blocks' 2-D weights go to torch.optim.Muon at muon_lr, embeddings and gains stay
    with AdamW at the base rate; both follow the schedule, and the loss falls."""
    from codeforge.train.optim import set_lr
    m = small()
    opt = build_optimizer(m, "muon", 1e-3, 0.1, (0.9, 0.95), torch.device("cpu"), muon_lr=0.02)
    hidden = {id(p) for p in m.blocks.parameters() if p.dim() == 2}
    muon_ids = {id(p) for g in opt.muon.param_groups for p in g["params"]}
    adam_ids = {id(p) for g in opt.adamw.param_groups for p in g["params"]}
    assert muon_ids == hidden and id(m.wte.weight) in adam_ids and not muon_ids & adam_ids
    assert len(muon_ids) + len(adam_ids) == len(list(m.parameters()))
    set_lr(opt, 5e-4)
    assert [g["lr"] for g in opt.muon.param_groups] == [pytest.approx(0.01)]
    assert opt.param_groups[0]["lr"] == 5e-4
    x = torch.randint(0, 300, (4, 33), generator=torch.Generator().manual_seed(0))
    first = None
    for _ in range(25):
        set_lr(opt, 1e-3)
        loss = m(x[:, :-1], x[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        first = first or loss.item()
    assert loss.item() < first - 1.0


def _muon_steps(
    kind, seed: int = 0, steps: int = 4, adjust_lr_fn: str = "original"
) -> tuple[list[torch.Tensor], dict]:
    """Weights after `steps` updates of a few matrices (square, tall, wide) by
    Muon `kind` on fixed gradients."""
    g = torch.Generator().manual_seed(seed)
    ws = [torch.nn.Parameter(torch.randn(*shape, generator=g)) for shape in ((16, 16), (48, 16), (16, 40))]
    opt = kind([{"params": ws, "weight_decay": 0.01}], lr=0.02, momentum=0.95, nesterov=True,
               adjust_lr_fn=adjust_lr_fn)
    for _ in range(steps):
        for w in ws:
            w.grad = torch.randn(w.shape, generator=g)
        opt.step()
    return [w.detach().clone() for w in ws], opt.state_dict()


def test_cpu_muon_is_torch_muon_in_float32(monkeypatch):
    """CpuMuon is torch.optim.Muon's update with the Newton-Schulz products in float32: run in bfloat16 it
    gives torch's weights bit for bit (so the rule is the same), in float32 it stays within bfloat16's
    rounding of them; its state loads into torch's Muon. build_optimizer takes it on a CPU without native
    bfloat16 (forced both ways)."""
    from codeforge.train.optim import CpuMuon

    class Bf16(CpuMuon):
        ns_dtype = torch.bfloat16
    ref, ref_state = _muon_steps(torch.optim.Muon)
    same, _ = _muon_steps(Bf16)
    assert all(torch.equal(a, b) for a, b in zip(ref, same))
    f32, state = _muon_steps(CpuMuon)
    start, _ = _muon_steps(CpuMuon, steps=0)
    for a, b, w0 in zip(ref, f32, start):
        moved = (a - w0).abs().max()
        assert not torch.equal(a, b) and (a - b).abs().max() < 0.05 * moved
    torch.optim.Muon([torch.nn.Parameter(w) for w in f32], lr=0.02).load_state_dict(state)
    with pytest.raises(ValueError, match="adjust_lr_fn 'match_rms_adamw'"):  # a rate rule it does not have
        _muon_steps(CpuMuon, steps=1, adjust_lr_fn="match_rms_adamw")
    for native, kind in (("1", torch.optim.Muon), ("0", CpuMuon)):
        monkeypatch.setenv("CODEFORGE_CPU_BF16", native)
        opt = build_optimizer(small(), "muon", 1e-3, 0.1, (0.9, 0.95), torch.device("cpu"), muon_lr=0.02)
        assert type(opt.muon) is kind


def test_muon_refused_for_models_with_their_own_groups():
    from codeforge.models.hrm import HRM, HRMConfig
    with pytest.raises(ValueError, match="optimizer muon is for GPT models"):
        build_optimizer(HRM(HRMConfig(vocab_size=300, n_embd=32, n_head=2)), "muon", 1e-3, 0.1,
                        (0.9, 0.95), torch.device("cpu"))


def test_saved_configs_keep_their_key_order_and_hrm_stacks_their_vocabulary():
    """Where a field is declared (BlockConfig, a TrainConfig section) does not change saved files: the model
    and train sections list their keys in the order they always had, every field once; and HRM's stacks keep
    the model's vocabulary (the GPT baseline of benchmarks/hrm_compare.py is built from one)."""
    from dataclasses import fields

    from codeforge.config import RunConfig, TrainConfig
    from codeforge.models.hrm import HRMConfig
    d = RunConfig().to_dict()
    assert list(d["model"])[:4] == ["arch", "vocab_size", "block_size", "n_layer"]
    assert list(d["train"]) == list(TrainConfig.SAVED_ORDER) + [
        f.name for f in fields(TrainConfig) if f.name not in TrainConfig.SAVED_ORDER]
    assert sorted(d["train"]) == sorted(f.name for f in fields(TrainConfig))
    h = HRMConfig(vocab_size=1088)
    assert list(h.to_dict())[:3] == ["arch", "vocab_size", "n_embd"] and len(h.to_dict()) == len(fields(h))
    assert h.stack_config(4, 512).vocab_size == 1088
