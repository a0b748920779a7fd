"""Loading from a checkpoint: weights (whole or from a sharded DCP directory), the sharded training state,
and a model for inference, vetted before it is built (store.vet_checkpoint: files, config ranges, the
weights' header, memory)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file as st_load_file
from safetensors.torch import load_model as st_load_model

from .guard import check_regular, model_shapes, safetensors_header, weights_problem
from .store import DAMAGED, SHARDED, CheckpointError, find_checkpoint, is_sharded, read_config, vet_checkpoint
from ..models import build_model, lora
from ..tokenizer import CodeTokenizer, TokenizerError


def _dcp_load(state: dict, ck: Path, alone: bool = False) -> None:
    """Load the tensors of `state` in place from the checkpoint's DCP shards, resharding to however `state`
    is laid out (DTensor shards on any number of ranks, or whole tensors in one process). alone: this
    process reads whole tensors for itself, even inside a process group (no collective: the other ranks
    need not be loading too)."""
    import warnings

    import torch.distributed.checkpoint as dcp
    with warnings.catch_warnings():  # one process: DCP says it assumes so, which is what is meant
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        try:
            dcp.load(state, checkpoint_id=str(ck / SHARDED), no_dist=alone)
        except Exception as e:  # a missing key, another shape, an unreadable shard: all raised as one kind
            raise CheckpointError(f"{ck / SHARDED}: the sharded checkpoint does not load into this model "
                                  f"({type(e).__name__}: {str(e)[:600]}); the checkpoint is damaged or was "
                                  f"written for another model") from e


def load_whole_into_sharded(model: torch.nn.Module, optimizer, ck: Path, optimizer_state: dict) -> None:
    """A whole checkpoint (one process or DDP: model.safetensors, the optimizer's state by parameter index)
    into an FSDP model and its optimizer: every rank reads it whole, keys the optimizer state by parameter
    name (the order of the optimizer's groups, which the same model builds the same way), and PyTorch's
    set_state_dict keeps this rank's shard of each."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict
    check_regular(Path(ck) / "model.safetensors", CheckpointError, DAMAGED)
    try:
        weights = st_load_file(str(Path(ck) / "model.safetensors"), device="cpu")
    except (OSError, SafetensorError) as e:
        raise CheckpointError(
            f"{ck}/model.safetensors cannot be read ({e}); the checkpoint is damaged") from e
    names = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    for ids in names.values():  # tied weights are stored once: give every name its tensor
        have = [n for n in ids if n in weights]
        for n in ids:
            if have and n not in weights:
                weights[n] = weights[have[0]]
    flat = [p for g in optimizer.param_groups for p in g["params"]]
    saved_groups = optimizer_state["param_groups"]
    if sum(len(g["params"]) for g in saved_groups) != len(flat):
        raise CheckpointError(f"{ck}: its optimizer state has {sum(len(g['params']) for g in saved_groups)} "
                              f"parameters and this model's optimizer {len(flat)}; "
                              "it was written for another model")
    fqn = {}
    for g in saved_groups:
        for i in g["params"]:
            fqn[i] = names[id(flat[len(fqn)])][0]
    osd = {"state": {fqn[int(i)]: v for i, v in optimizer_state["state"].items()},
           "param_groups": [{**g, "params": [fqn[i] for i in g["params"]]} for g in saved_groups]}
    set_state_dict(model, optimizer, model_state_dict=weights, optim_state_dict=osd,
                   options=StateDictOptions(full_state_dict=True))


def load_sharded_state(model: torch.nn.Module, optimizer, ck: Path) -> None:
    """Weights and optimizer state of a sharded checkpoint into `model` and `optimizer`, on this run's ranks
    (FSDP on any world size, DDP, or one process): DCP reshards them by parameter name."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    msd, osd = get_state_dict(model, optimizer)
    state = {"model": msd, "optim": osd}
    _dcp_load(state, Path(ck))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def load_weights(model: torch.nn.Module, ckpt: Path, new_ok: tuple[str, ...] = ()) -> None:
    """The checkpoint's weights into `model`, every key matched; `new_ok`: prefixes of parameters the model
    may have that the checkpoint lacks (a head added on a trained trunk keeps its initialisation). The
    names and shapes are compared with the file's header before any tensor is read."""
    if is_sharded(ckpt):
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             set_model_state_dict)
        sd = {k: v for k, v in get_model_state_dict(model).items() if not (new_ok and k.startswith(new_ok))}
        state = {"model": sd}
        _dcp_load(state, Path(ckpt), alone=True)  # a whole model in this process, whatever other ranks do
        set_model_state_dict(model, state["model"], options=StateDictOptions(strict=not new_ok))
        return
    # --resume of a LoRA run: its starting weights are in; the adapters come from here
    if lora.is_lora(model):
        try:
            lora.load_adapter(model, lora.read_adapter(Path(ckpt))[1], str(ckpt))
        except lora.LoraError as e:
            raise CheckpointError(str(e)) from e
        return
    f = Path(ckpt) / "model.safetensors"
    problem = weights_problem(safetensors_header(f, CheckpointError, DAMAGED), *model_shapes(model), new_ok)
    if problem:
        raise CheckpointError(f"{f}: weights do not fit the model ({problem}); the checkpoint was written "
                              f"for another model, or damaged")
    try:
        missing, unexpected = st_load_model(model, str(f), strict=False)
    except (OSError, SafetensorError) as e:
        raise CheckpointError(f"{f} cannot be read ({e}); {DAMAGED}") from e
    except RuntimeError as e:  # a tensor of another shape
        raise CheckpointError(f"{f}: weights do not fit the model ({e})") from e
    missing = sorted(k for k in missing if not (new_ok and k.startswith(new_ok)))  # safetensors gives sets
    if missing or unexpected:
        raise CheckpointError(f"{ckpt}: weights do not fit the model (missing {missing[:5]}, unexpected "
                              f"{sorted(unexpected)[:5]})")


def load_model(path: str | Path, device: torch.device, which: str = "auto",
               log: Callable[[str], None] | None = None):
    """(model in eval mode, tokenizer, checkpoint dir, saved config) from a run or checkpoint directory; a
    damaged checkpoint is skipped or refused as find_checkpoint() says, and one whose files, config, weights
    or size would not load is refused before anything is built (vet_checkpoint)."""
    ck = find_checkpoint(path, which, log=log)
    m = vet_checkpoint(ck)
    cfg = read_config(ck)
    if not (ck / "tokenizer" / "tokenizer.json").exists():
        raise CheckpointError(f"{ck} has no tokenizer/ directory; copy the tokenizer the run was trained "
                              f"with to {ck / 'tokenizer'}")
    try:
        tok = CodeTokenizer.load(ck / "tokenizer", log=log)  # vetted: a split rule that fails is refused
    except TokenizerError as e:
        raise CheckpointError(str(e)) from e
    model = build_model(m)
    load_weights(model, ck)
    return model.to(device).eval(), tok, ck, cfg
