"""The GPU speed levers (issue: the step's host syncs, the batch prefetch, the static whole-graph compile, the
compile default), each switchable, each checked here on the CPU against the path without it: the same
losses, gradient norms, skip counts and weights, bit for bit where the arithmetic is the same, within a
stated bound where it is not (a compiled graph fuses and reorders sums)."""

import json
import math

import pytest
import torch

from codeforge.cli.main import main
from codeforge.config import resolve
from codeforge.data.loader import batch_source
from codeforge.data.shards import ShardSet
from codeforge.models.gpt import GPT, GPTConfig
from codeforge.tokenizer import CodeTokenizer
from codeforge.train import parallel
from codeforge.train.step import Prefetcher, Readback, skips_on_device, train_step

CPU = torch.device("cpu")
TINY = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "32", "--batch-size", "4",
        "--log-every", "1", "--eval-every", "0", "--sample-every", "0", "--device", "cpu",
        "--precision", "fp32", "--threads", "1", "--no-progress", "--warmup-steps", "2"]


def metrics(run) -> list[dict]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r]


def weights(run):
    from safetensors.torch import load_file

    from codeforge.checkpoint import find_checkpoint
    return load_file(str(find_checkpoint(run) / "model.safetensors"))


def train(data_dir, out, *extra, steps=6):
    assert main(["train", "--data", str(data_dir), "--out", str(out), *TINY, "--max-iters", str(steps),
                 *extra]) in (0, None)
    return out


def same_run(a, b):
    ma, mb = metrics(a), metrics(b)
    assert [r["step"] for r in ma] == [r["step"] for r in mb] and ma
    for x, y in zip(ma, mb):
        assert (x["loss"], x["grad_norm"], x["lr"], x["tokens"]) == (y["loss"], y["grad_norm"], y["lr"],
                                                                    y["tokens"])
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


# -- host sync: numbers read once per log line, non-finite steps skipped on the device --------------------

def tiny_model(seed=0):
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=16))


def run_steps(defer: bool, poison: set[int], n=6):
    """n steps of train_step on fixed batches; the loss is NaN at the steps in `poison`."""
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    g = torch.Generator().manual_seed(3)
    batches = iter([(torch.randint(0, 64, (2, 8), generator=g),) * 2 for _ in range(n)])
    out, step = [], [0]

    def loss_fn(m, b):
        loss = m(*b)
        return (loss * math.nan if step[0] in poison else loss), {}

    back = Readback()
    for i in range(n):
        step[0] = i
        r = train_step(model, model, opt, scaler, batches, loss_fn, 1, 1.0, CPU, "fp32", defer=defer)
        if defer:
            back.add(i, *r)
        else:
            out.append((i, *r))
    if defer:
        out = back.read()
    return out, model, opt


def test_a_deferred_step_skips_a_nonfinite_update_on_the_device_as_the_host_would():
    for poison in (set(), {0}, {2, 3}):
        ref, m_ref, o_ref = run_steps(False, poison)
        got, m_got, o_got = run_steps(True, poison)
        assert [r[3] for r in got] == [i not in poison for i in range(6)]
        for a, b in zip(ref, got):
            assert a[0] == b[0] and a[3] == b[3]
            assert (a[1] == b[1] or math.isnan(a[1]) and math.isnan(b[1]))
            assert (a[2] == b[2] or math.isnan(a[2]) and math.isnan(b[2]))
        for p, q in zip(m_ref.parameters(), m_got.parameters()):
            assert torch.equal(p, q)
        # Adam's step counters count the applied steps only, as the host's skip does
        steps = {float(s["step"]) for s in o_got.state.values()}
        assert steps == {6.0 - len(poison)}, steps
        assert {float(s["step"]) for s in o_ref.state.values()} == steps or poison == {0}


def test_only_fused_adam_outside_fp16_and_fsdp_defers():
    model = tiny_model()
    fused = torch.optim.AdamW(model.parameters(), fused=True)
    plain = torch.optim.AdamW(model.parameters(), foreach=False)
    assert skips_on_device(fused, "bf16", "none") and skips_on_device(fused, "fp32", "ddp")
    assert not skips_on_device(fused, "fp16", "none") and not skips_on_device(fused, "bf16", "fsdp")
    assert not skips_on_device(plain, "fp32", "none")
    with pytest.raises(ValueError, match="skips_on_device"):
        train_step(model, model, plain, torch.amp.GradScaler("cpu", enabled=False),
                   iter([(torch.zeros(1, 8, dtype=torch.long),) * 2]), lambda m, b: (m(*b), {}), 1, 1.0, CPU,
                   "fp32", defer=True)


def test_readback_reads_up_to_a_step_and_keeps_the_rest():
    back = Readback()
    for i in range(1, 5):
        back.add(i, torch.tensor(float(i)), torch.tensor(2.0 * i), torch.tensor(i != 3))
    assert back.read(upto=2) == [(1, 1.0, 2.0, True), (2, 2.0, 4.0, True)]
    assert len(back) == 2
    assert back.read() == [(3, 3.0, 6.0, False), (4, 4.0, 8.0, True)]
    assert back.read() == []


@pytest.mark.parametrize("log_every", ["1", "4"])
def test_host_sync_log_trains_and_logs_exactly_as_every_step(data_dir, tmp_path, log_every):
    a = train(data_dir, tmp_path / "step", "--host-sync", "step", "--log-every", log_every, steps=7)
    b = train(data_dir, tmp_path / "log", "--host-sync", "log", "--log-every", log_every, steps=7)
    same_run(a, b)
    assert [r["step"] for r in metrics(b)] == ([1, 2, 3, 4, 5, 6, 7] if log_every == "1" else [1, 4, 7])


def test_host_sync_log_counts_skipped_steps_and_stops_on_too_many(data_dir, tmp_path, monkeypatch, capsys):
    from codeforge.stages import lm
    from codeforge.train.losses import lm_loss_fn
    calls = [0]

    def poisoned(model, batch):  # steps 3 and 4 (1-based) are non-finite
        calls[0] += 1
        loss, parts = lm_loss_fn(model, batch)
        return (loss * math.nan if calls[0] in (3, 4) else loss), parts

    monkeypatch.setattr(lm, "lm_loss_fn", poisoned)
    a = train(data_dir, tmp_path / "step", "--host-sync", "step", "--log-every", "5")
    calls[0] = 0
    b = train(data_dir, tmp_path / "log", "--host-sync", "log", "--log-every", "5")
    same_run(a, b)
    out = capsys.readouterr().err
    assert out.count("step 3: non-finite loss nan") == 2 and out.count("step 4: non-finite loss nan") == 2
    from codeforge.checkpoint import find_checkpoint, load_train_state
    assert load_train_state(find_checkpoint(b))["skipped"] == 2
    # --max-bad-steps 2: the run stops, named at the step of the second bad one, without NaN weights
    calls[0] = 0
    assert main(["train", "--data", str(data_dir), "--out", str(tmp_path / "stop"), *TINY, "--max-iters", "6",
                 "--host-sync", "log", "--log-every", "5", "--max-bad-steps", "2"]) == 2
    assert "error: 2 non-finite losses in a row at step 4" in capsys.readouterr().err


def test_host_sync_log_where_the_optimizer_cannot_skip_on_the_device_is_said(data_dir, tmp_path, capsys):
    train(data_dir, tmp_path / "muon", "--host-sync", "log", "--set", "optimizer=muon", steps=2)
    assert "--host-sync log needs the fused AdamW" in capsys.readouterr().out


# -- prefetch: the same batches, and a checkpoint's cursor after the consumed ones --------------------------

def loader(data_dir, tok):
    return batch_source(ShardSet(data_dir, "train"), 2, 16, tok.special_ids, seed=5, fim_rate=0.5)


def test_the_prefetcher_gives_the_loaders_batches_and_its_cursor(data_dir):
    tok = CodeTokenizer.load(data_dir / "tokenizer")
    plain, fetched = loader(data_dir, tok), Prefetcher(loader(data_dir, tok), CPU, depth=2)
    assert fetched.per_epoch == plain.per_epoch  # the source's attributes pass through
    assert fetched.state_dict() == plain.state_dict()
    for _ in range(5):
        x, y = next(plain)
        fx, fy = next(fetched)
        assert torch.equal(x, fx) and torch.equal(y, fy)
        assert fetched.state_dict() == plain.state_dict()  # not the cursor of the batches built ahead
    state = fetched.state_dict()
    fetched.close()
    again = Prefetcher(loader(data_dir, tok), CPU)
    again.load_state_dict(state)
    for _ in range(3):
        assert torch.equal(next(again)[0], next(plain)[0])
    again.close()
    fetched.close()  # twice is harmless


def test_a_loader_error_reaches_the_step():
    class Broken:
        def __next__(self):
            raise ValueError("shard 3 is truncated")

        def state_dict(self):
            return {}

        def load_state_dict(self, s):
            pass

    with pytest.raises(ValueError, match="shard 3 is truncated"):
        next(Prefetcher(Broken(), CPU))


def test_prefetch_trains_as_without_and_resumes_exactly(data_dir, tmp_path):
    same = ["--fim-rate", "0.5", "--schedule", "constant"]  # an lr that ignores the step count
    a = train(data_dir, tmp_path / "plain", "--prefetch", "off", *same, steps=6)
    b = train(data_dir, tmp_path / "fetched", "--prefetch", *same, steps=6)
    same_run(a, b)
    # stopped at 3 and resumed to 6 with the prefetcher: the same as straight
    c = train(data_dir, tmp_path / "resumed", "--prefetch", "on", *same, steps=3)
    assert main(["train", "--out", str(c), "--resume", "--max-iters", "6", "--no-progress"]) in (0, None)
    same_run(a, c)


# -- compile: static shapes, one graph, and the fallback --------------------------------------------------

class Breaks(torch.nn.Module):
    """A model whose forward has a graph break (a print of a tensor's value)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        if float(y.detach().sum()) > 1e9:  # data-dependent Python: dynamo breaks the graph here
            y = y * 2
        return y.sum()


def test_a_model_that_breaks_the_graph_is_compiled_in_pieces_and_said():
    said = []
    m = Breaks()
    fwd = parallel.compiled(m, static=True, say=said.append, backend="eager")
    x = torch.randn(3, 4)
    assert torch.equal(fwd(x), m(x))
    assert fwd.whole is False and "does not run as one static graph" in said[0]
    fwd(x)
    assert len(said) == 1


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_the_models_compile_as_one_graph_with_equal_losses(arch):
    kw = {} if arch == "gpt" else {"n_kv_head": 1, "pos": "rope", "norm": "rmsnorm", "mlp": "swiglu"}
    torch.manual_seed(0)
    ref = GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=16, **kw))
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=16, **kw))
    said = []
    fwd = parallel.compiled(model, static=True, say=said.append, backend="aot_eager")
    idx = torch.randint(0, 64, (2, 8))
    a, b = ref(idx, idx), fwd(idx, idx)
    a.backward()
    b.backward()
    assert fwd.whole and not said
    assert a.item() == pytest.approx(b.item(), abs=1e-6)
    for p, q in zip(ref.parameters(), model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-5)
    assert fwd.flops_per_token() == model.flops_per_token()  # the model's other methods pass through


def test_compile_is_a_switch_that_reads_old_configs(tmp_path):
    assert resolve([], None, []).train.compile == "auto"
    assert resolve([], None, ["train.compile=true"]).train.compile == "on"
    assert resolve([], None, ["compile=false"]).train.compile == "off"
    f = tmp_path / "old.toml"
    f.write_text("[train]\ncompile = true\n")
    assert resolve([], str(f), []).train.compile == "on"
    assert resolve([], None, [], base={"train": {"compile": False}}).train.compile == "off"
    from codeforge.cli.main import build_parser
    p = build_parser()
    args = lambda *a: p.parse_args(["train", "--data", "d", "--out", "o", *a])  # noqa: E731
    assert getattr(args("--compile"), "train.compile") == "on"
    assert getattr(args("--no-compile"), "train.compile") == "off"
    assert getattr(args("--compile", "auto"), "train.compile") == "auto"
    assert getattr(args("--compile", "true"), "train.compile") == "on"
    assert getattr(args("--compile", "--max-iters", "3"), "train.compile") == "on"
    for wrong in (["--no-compile", "on"], ["--no-compile=off"]):
        with pytest.raises(SystemExit):
            args(*wrong)
    assert getattr(args(), "train.compile") is None
    with pytest.raises(SystemExit):
        args("--compile", "maybe")
    with pytest.raises(Exception, match="compile"):
        resolve([], None, ["train.compile=maybe"])


def test_a_compiled_training_run_keeps_the_losses_within_the_bound(data_dir, tmp_path, capsys):
    """`--compile on` (inductor, static whole graph) against eager on the CPU: the same run within 1e-4 of
    each loss (inductor fuses and reorders sums), and the compilation's seconds said."""
    a = train(data_dir, tmp_path / "eager", "--compile", "off", steps=4)
    b = train(data_dir, tmp_path / "compiled", "--compile", "on", "--compile-shapes", "static", steps=4)
    err = capsys.readouterr().err
    assert "compile: the first step took" in err and "does not run as one static graph" not in err
    la, lb = metrics(a), metrics(b)
    assert len(la) == len(lb) == 4
    for x, y in zip(la, lb):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-4)
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-3)


def test_a_static_graph_past_the_recompile_limit_falls_back_to_dynamic_shapes():
    said = []
    m = torch.nn.Linear(4, 4)
    fwd = parallel.compiled(m, static=True, say=said.append, backend="eager")
    for n in range(1, 14):  # 13 shapes: past torch's limit of 8 recompiles of one static graph
        x = torch.randn(n, 4)
        assert torch.equal(fwd(x), m(x))
    assert fwd.whole is False and len(said) == 1 and "dynamic shapes" in said[0]
