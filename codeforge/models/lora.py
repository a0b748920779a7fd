"""LoRA: low-rank adapters on a model's linear layers, the rest frozen, with Hugging Face's PEFT library
(`inject_adapter_in_model`, its LoRA layers, their `get_delta_weight`, its adapter state dict).

A run with train.lora_rank > 0 trains only the adapters (W x + scale * B A x on each target layer, B = 0 at
the start, so step 0 is the starting model). Its checkpoints hold two things:
  model.safetensors          the merged weights (W + scale * B A) under the model's own names, so every
                             reader (eval, generate, serve, the HF and GGUF exports, --init-from) sees an
                             ordinary model and needs nothing of LoRA
  adapter_model.safetensors  the adapters alone (PEFT's names relative to the model: small), and
  adapter_config.json        PEFT's LoraConfig for them; --resume loads these onto the starting weights
A run resumes on the very checkpoint it started from (recorded in its config with that file's sha256), so a
resumed run is the straight one.

PEFT is imported only when adapters are made or read (it loads transformers: seconds).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
# attention's q/k/v and output, the MLP's in and out: every block matrix
TARGETS = ("c_attn", "c_proj", "c_fc")
NAME = "default"  # PEFT's adapter name


class LoraError(ValueError):
    pass


def _peft():
    try:
        import peft
    except ImportError as e:
        raise LoraError(
            f"LoRA needs Hugging Face's PEFT library ({e}): pip install 'codeforge[lora]'") from None
    return peft


def lora_config(rank: int, alpha: float, dropout: float, targets: tuple[str, ...] | list[str]):
    LoraConfig = _peft().LoraConfig

    return LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(targets),
                      bias="none")


def attach(model: nn.Module, rank: int, alpha: float, dropout: float = 0.0,
           targets: tuple[str, ...] | list[str] = TARGETS) -> nn.Module:
    """Adapters of `rank` on every linear layer named in `targets` (in place); everything else frozen."""
    inject_adapter_in_model = _peft().inject_adapter_in_model
    if rank < 1:
        raise LoraError(f"--lora-rank {rank}: give 1 or more (0 means no LoRA: full fine-tuning)")
    # the blocks' layers only: the output head's weight is read directly by the loss (models/lm_loss.py), so
    # an adapter on it would never train, and a tied head would be saved twice
    blocks = getattr(model, "blocks", None)
    if blocks is None:
        raise LoraError(f"{type(model).__name__} has no transformer blocks to put adapters on")
    names = {n.rsplit(".", 1)[-1] for n, m in blocks.named_modules() if isinstance(m, nn.Linear)}
    unknown = sorted(set(targets) - names)
    if unknown or not targets:
        raise LoraError(f"--lora-targets {','.join(unknown) or '(none)'}: the blocks have no linear layer of "
                        f"that name (theirs: {', '.join(sorted(names))})")
    wanted = {f"blocks.{n}" for n, m in blocks.named_modules()
              if isinstance(m, nn.Linear) and n.rsplit(".", 1)[-1] in targets}
    inject_adapter_in_model(lora_config(rank, alpha, dropout, sorted(wanted)), model, adapter_name=NAME)
    for n, p in model.named_parameters():
        # PEFT's rule too; said here so the contract does not rest on a default
        p.requires_grad_(".lora_" in n)
    return model


def is_lora(model: nn.Module) -> bool:
    """Whether the model carries adapters (without importing PEFT)."""
    return any(hasattr(m, "lora_A") and hasattr(m, "base_layer") for m in model.modules())


def _layers(model: nn.Module):
    return [(n, m) for n, m in model.named_modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer")]


@torch.no_grad()
def merged_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict under its own names with each adapter merged (W + scale * B A): what the same
    model without LoRA would hold. Tied tensors appear once (under the first name),
    as safetensors stores them."""
    wrapped = dict(_layers(model))
    out: dict[str, torch.Tensor] = {}
    seen: dict[int, str] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if ".lora_" in name:
            continue
        plain = name.replace(".base_layer.", ".")
        layer = plain.rsplit(".", 1)[0]
        # merged layer by layer, each straight to the host:
        if layer in wrapped and plain.endswith(".weight"):
            m = wrapped[layer]  # no second copy of the model on the device at a save
            t = (m.base_layer.weight + m.get_delta_weight(NAME).to(m.base_layer.weight.dtype)).cpu()
        elif id(t) in seen:
            continue  # a tied tensor, already written under its first name
        else:
            seen[id(t)] = plain
        out[plain] = t.detach().contiguous()
    return out


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters alone, in PEFT's adapter file names (`blocks.0.attn.c_attn.lora_A.weight`, ...)."""
    get_peft_model_state_dict = _peft().get_peft_model_state_dict
    return {k: v.detach().contiguous()
            for k, v in get_peft_model_state_dict(model, adapter_name=NAME).items()}


def adapter_json(model: nn.Module) -> str:
    cfg = next(m for _, m in _layers(model))
    rank, alpha = cfg.r[NAME], cfg.lora_alpha[NAME]
    targets = sorted({n.rsplit(".", 1)[-1] for n, _ in _layers(model)})
    drop = cfg.lora_dropout[NAME]
    p = drop.p if isinstance(drop, nn.Dropout) else 0.0
    conf = lora_config(rank, alpha, p, targets).to_dict()
    conf["target_modules"] = sorted(conf["target_modules"])
    return json.dumps({k: (sorted(v) if isinstance(v, set) else v) for k, v in conf.items()}, indent=1,
                      default=str)


def read_adapter(d: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(adapter_config.json, the adapter tensors) of a checkpoint or adapter directory; a file that cannot be
    read -> LoraError naming it."""
    d = Path(d)
    f = d / ADAPTER_CONFIG
    try:
        conf = json.loads(f.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise LoraError(f"{f} is missing: no LoRA adapter here") from None
    except (OSError, ValueError, RecursionError) as e:  # RecursionError: JSON nested past what json reads
        why = "nested too deeply" if isinstance(e, RecursionError) else e
        raise LoraError(f"{f}: not readable JSON ({why})") from None
    if not isinstance(conf, dict):
        raise LoraError(f"{f}: not a LoRA adapter config (a JSON {type(conf).__name__}, not an object)")
    f = d / ADAPTER_FILE
    try:
        tensors = load_file(str(f))
    except FileNotFoundError:
        raise LoraError(f"{f} is missing: no LoRA adapter here") from None
    except (OSError, ValueError, SafetensorError) as e:  # safetensors' own error: a damaged header or data
        raise LoraError(f"{f}: not readable safetensors ({e})") from None
    return conf, tensors


def load_adapter(model: nn.Module, tensors: dict[str, torch.Tensor], where: str) -> None:
    """The adapter tensors into a model with adapters attached; every adapter matched, shapes equal."""
    set_peft_model_state_dict = _peft().set_peft_model_state_dict
    want = adapter_state(model)
    missing, unexpected = sorted(set(want) - set(tensors)), sorted(set(tensors) - set(want))
    other = sorted(k for k in set(want) & set(tensors) if want[k].shape != tensors[k].shape)
    if missing or unexpected or other:
        raise LoraError(f"{where}: the adapter does not fit this model's (missing {missing[:3]}, unexpected "
                        f"{unexpected[:3]}, other shape {other[:3]}): it was trained with another rank, "
                        f"other targets or another model")
    set_peft_model_state_dict(model, tensors, adapter_name=NAME)


def counts(model: nn.Module) -> tuple[int, int]:
    """(trainable parameters, all parameters), tied tensors once."""
    seen: set[int] = set()
    train = total = 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()
        train += p.numel() if p.requires_grad else 0
    return train, total
