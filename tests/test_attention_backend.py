"""--attention (train.attention): which PyTorch SDPA kernels the model's attention runs under.

On a CPU (torch 2.13) `math` and `flash` have kernels (flash without dropout); `efficient` and `cudnn` are
CUDA only and refused up front. `auto` off a Hopper GPU is PyTorch's own choice: no sdpa_kernel context at
all, so its losses are today's exactly. `math` and `flash` forced on a CPU agree with today's path within
1e-5 (a different kernel sums in a different order)."""

from dataclasses import fields

import pytest
import torch
from torch.nn.attention import SDPBackend

from codeforge.cli.main import main
from codeforge.config import DeviceSettings, TrainConfig
from codeforge.device import ATTENTION_CHOICES, attention_backends
from codeforge.fields import ConfigError, check_fields
from codeforge.models import gpt
from codeforge.models.gpt import GPT, GPTConfig, set_attention

CPU = torch.device("cpu")


def tiny(**kw) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=128, block_size=16, n_layer=2, n_head=4, n_embd=32, **kw))


def step(model: GPT) -> tuple[float, torch.Tensor]:
    """One forward and backward on fixed tokens: the loss and the first layer's attention gradient."""
    torch.manual_seed(1)
    idx = torch.randint(0, 128, (3, 16))
    model.zero_grad()
    loss = model(idx, idx)
    loss.backward()
    return loss.item(), model.blocks[0].attn.c_attn.weight.grad.clone()


@pytest.mark.parametrize("kw", [{}, {"n_kv_head": 2, "pos": "rope", "norm": "rmsnorm", "mlp": "swiglu"}])
@pytest.mark.parametrize("choice", ["auto", "math", "flash"])
def test_losses_match_todays_path(choice, kw):
    ref_loss, ref_grad = step(tiny(**kw))  # no set_attention: the path before --attention
    model = tiny(**kw)
    set_attention(model, choice, CPU)
    loss, grad = step(model)
    if choice == "auto":  # no context on a CPU: the very same call
        assert all(m.sdpa_backends is None for m in model.modules() if isinstance(m, gpt.Attention))
        assert loss == ref_loss and torch.equal(grad, ref_grad)
    else:
        assert loss == pytest.approx(ref_loss, abs=1e-5)
        torch.testing.assert_close(grad, ref_grad, atol=1e-5, rtol=1e-4)


def test_the_choice_reaches_the_sdpa_call(monkeypatch):
    seen = []
    real = gpt.sdpa_under

    def spy(backends, *a, **kw):
        seen.append(list(backends))
        return real(backends, *a, **kw)

    monkeypatch.setattr(gpt, "sdpa_under", spy)
    model = tiny()
    assert "math" in set_attention(model, "math", CPU)
    step(model)
    assert seen == [[SDPBackend.MATH]] * 2  # once per layer
    seen.clear()
    set_attention(model, "auto", CPU)
    step(model)
    assert seen == []  # auto on a CPU: PyTorch's choice, no restriction

    # and torch's own context manager is entered with that list, in priority order
    entered = []
    import torch.nn.attention as attn
    real_kernel = attn.sdpa_kernel

    def kernel(backends, set_priority=False):
        entered.append((list(backends), set_priority))
        return real_kernel(backends, set_priority=set_priority)

    monkeypatch.setattr(attn, "sdpa_kernel", kernel)
    set_attention(model, "flash", CPU)
    step(model)
    assert entered == [([SDPBackend.FLASH_ATTENTION], True)] * 2


def test_auto_prefers_cudnn_on_hopper(monkeypatch):
    import codeforge.device as device
    monkeypatch.setattr(device, "cudnn_sdpa", lambda d: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    backends, why = attention_backends(torch.device("cuda", 0), "auto")
    assert backends == [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                        SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH] and "Hopper" in why
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 0))  # an A100: torch's choice
    assert attention_backends(torch.device("cuda", 0), "auto")[0] is None


def test_unknown_value_is_refused_naming_the_setting(capsys):
    with pytest.raises(ConfigError, match="attention"):
        check_fields(DeviceSettings(attention="fastest"), "train")
    with pytest.raises(ConfigError, match=r"--attention .*'xformers'"):
        attention_backends(CPU, "xformers")
    with pytest.raises(SystemExit):
        main(["train", "--attention", "xformers"])
    assert "--attention" in capsys.readouterr().err


@pytest.mark.parametrize("choice", ["efficient", "cudnn"])
def test_a_kernel_the_device_lacks_is_refused_up_front(choice):
    with pytest.raises(ConfigError, match=rf"--attention \(train.attention\) {choice}: .* pick auto"):
        set_attention(tiny(), choice, CPU)


@pytest.mark.filterwarnings("ignore:.*(kernel not used|do not support):UserWarning")
def test_a_forced_kernel_that_cannot_run_the_shapes_names_the_setting():
    model = tiny(attn_dropout=0.1)  # the CPU flash kernel has no dropout
    set_attention(model, "flash", CPU)
    model.train()
    said = r"--attention \(train.attention\) flash cannot run .*dropout.*math"
    with pytest.raises(ConfigError, match=said):
        step(model)


def test_the_flag_is_in_train_help_and_not_in_the_architecture(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    assert "--attention {auto,cudnn,flash,efficient,math}" in out
    assert "attention" not in {f.name for f in fields(GPTConfig)}  # checkpoints' config.json never has it
    assert TrainConfig().attention == "auto" and "attention" in TrainConfig().to_dict()
    declared = next(f for f in fields(DeviceSettings) if f.name == "attention")
    assert ATTENTION_CHOICES == declared.metadata["choices"]


def test_train_applies_the_choice_and_says_which(data_dir, tmp_path, capsys):
    """`codeforge train --attention math` runs every attention layer on that kernel, and the log says so."""
    out = tmp_path / "run"
    main(["train", "--data", str(data_dir), "--out", str(out), "--n-layer", "1", "--n-head", "2", "--n-embd",
          "32", "--max-iters", "2", "--device", "cpu", "--no-progress", "--eval-tokens", "128",
          "--batch-size", "2", "--attention", "math"])
    said = capsys.readouterr()
    assert "attention: math" in said.out + said.err
    assert (out / "checkpoints" / "latest").exists()
