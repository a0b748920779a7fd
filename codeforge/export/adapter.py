"""A LoRA run's adapter alone, out and in: `codeforge export --format adapter` writes the few-MB directory
(PEFT's adapter_model.safetensors and adapter_config.json, plus codeforge_adapter.json naming the starting
weights and their sha256); `codeforge import --adapter DIR --base RUN` merges it onto those weights into a
run every command takes as an ordinary model (serve, eval, generate, the HF and GGUF exports).

An adapter is checked before anything is allocated for it: its record of the base must be there (without it
the merge could not be checked), its rank must be that of its tensors, its numbers finite and its PEFT
settings ones codeforge merges; each refusal is an ExportError naming the file, the field and the fix."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import torch

from ..checkpoint import (find_checkpoint, load_model, read_config, save_checkpoint, verify_checkpoint,
                          weights_sha256)
from ..data.trained import adapter_reason, record_trained
from ..models import lora
from . import ExportError, check_out

RECORD = "codeforge_adapter.json"


def export_adapter(run: str | Path, out: str | Path, which: str = "auto", overwrite: bool = False) -> dict:
    ck = find_checkpoint(run, which)
    if not (ck / lora.ADAPTER_FILE).exists():
        raise ExportError(f"{ck} holds no LoRA adapter: it was not trained with --lora-rank (export it as a "
                          f"whole model with --format hf or gguf)")
    cfg = read_config(ck)
    out = check_out(out, overwrite)
    if out.exists() and overwrite:
        shutil.rmtree(out) if out.is_dir() else out.unlink()
    out.mkdir(parents=True, exist_ok=True)
    for name in (lora.ADAPTER_FILE, lora.ADAPTER_CONFIG):
        shutil.copyfile(ck / name, out / name)
    (out / RECORD).write_text(json.dumps({"base": cfg.get("lora_base"), "model": cfg["model"],
                                          "tokenizer_hash": cfg.get("tokenizer_hash"), "from": str(ck)},
                                         indent=1))
    return {"checkpoint": str(ck), "out": str(out), "bytes": sum(f.stat().st_size for f in out.iterdir())}


# PEFT settings codeforge's LoRA does not reproduce (it merges W + lora_alpha / r * B A on every target
# layer) with the values under which they change nothing
PLAIN = {"use_rslora": False, "use_dora": False, "rank_pattern": {}, "alpha_pattern": {}, "bias": "none"}
# the tensors' types an adapter may hold: what codeforge's training writes (float32) and what PEFT saves
FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
AGAIN = ("export the adapter again with `codeforge export --run RUN --format adapter` from the LoRA run "
         "that trained it")


def read_record(adapter: Path) -> dict:
    """codeforge_adapter.json: the weights the adapter was trained on (base.sha256). Without it the adapter
    would be merged onto any weights of the right shapes, where it means nothing: refused."""
    f = adapter / RECORD
    try:
        record = json.loads(f.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ExportError(f"{f} is missing: it names the weights the adapter was trained on, the only ones "
                          f"it means something on, so without it the merge cannot be checked; {AGAIN} (it "
                          f"writes this record)") from None
    except (OSError, ValueError, RecursionError) as e:
        why = "nested too deeply" if isinstance(e, RecursionError) else e
        raise ExportError(f"{f}: not readable JSON ({why}); {AGAIN}") from None
    base = record.get("base") if isinstance(record, dict) else None
    sha = base.get("sha256") if isinstance(base, dict) else None
    if not isinstance(sha, str) or not re.fullmatch("[0-9a-f]{64}", sha):
        raise ExportError(f"{f}: base.sha256, the sha256 of the weights the adapter was trained on, is "
                          f"missing or not a sha256 ({sha!r}); {AGAIN}")
    return record


def check_adapter(adapter: Path, conf: dict,
                  tensors: dict[str, torch.Tensor]) -> tuple[int, float, list[str]]:
    """(rank, lora_alpha, target layer names) of an adapter, each checked before anything is allocated: the
    rank against the tensors' shapes (adapters of the config's rank are made before the tensors are loaded
    into them: r = 50,000,000 would ask for GBs), finite numbers, settings codeforge merges as PEFT does."""
    f, src = adapter / lora.ADAPTER_CONFIG, adapter / lora.ADAPTER_FILE
    rank = conf.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ExportError(f"{f}: r = {rank!r}: the adapters' rank must be a whole number of 1 or "
                          f"more; {AGAIN}")
    alpha = conf.get("lora_alpha")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise ExportError(f"{f}: lora_alpha = {alpha!r}: must be a finite number (the adapters' scale is "
                          f"lora_alpha / r); {AGAIN}")
    targets = conf.get("target_modules")
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise ExportError(f"{f}: target_modules = {targets!r}: must be a list of the layer names the "
                          f'adapters are on (e.g. ["c_attn", "c_fc", "c_proj"]); {AGAIN}')
    for key, plain in PLAIN.items():
        if conf.get(key) not in (None, plain):
            raise ExportError(f"{f}: {key} = {conf[key]!r}: a PEFT setting codeforge does not merge (it "
                              f"merges W + lora_alpha / r * B A on every target layer, {key} {plain!r}); "
                              f"merge this adapter with PEFT instead")
    if not tensors:
        raise ExportError(f"{src} holds no tensors; {AGAIN}")
    for name in sorted(tensors):
        t = tensors[name]
        kind = next((k for k in ("lora_A", "lora_B") if name.endswith(f".{k}.weight")), None)
        if kind is None or t.dim() != 2:
            raise ExportError(f"{src}: {name} {tuple(t.shape)} is not a LoRA matrix (NAME.lora_A.weight of "
                              f"shape (r, in), NAME.lora_B.weight of shape (out, r)); {AGAIN}")
        have = t.shape[0] if kind == "lora_A" else t.shape[1]
        if have != rank:
            raise ExportError(f"{f}: r = {rank}, but {src.name} holds {name} of shape {tuple(t.shape)}, "
                              f"adapters of rank {have}: the config and the tensors are not of one "
                              f"adapter; {AGAIN}")
        if t.dtype not in FLOATS:  # float8's have no isfinite: a NotImplementedError, not a refusal
            raise ExportError(
                f"{src}: {name} is {t.dtype}, not one of {', '.join(str(d) for d in FLOATS)}; {AGAIN}")
        if not torch.isfinite(t).all():
            raise ExportError(f"{src}: {name} holds values that are not finite (NaN or infinity): the "
                              f"training that wrote it diverged; export a checkpoint from before it did")
    return rank, float(alpha), targets


def import_adapter(adapter: str | Path, base: str | Path, out: str | Path, overwrite: bool = False,
                   which: str = "auto") -> dict:
    """A run at `out`: the checkpoint `base` names with the adapter in `adapter` merged onto it. A damaged
    or hostile adapter (no record of its base, unreadable files, a rank its tensors do not have, numbers
    that are not finite) -> ExportError naming the file and field, before anything large is allocated."""
    adapter = Path(adapter)
    record = read_record(adapter)
    try:
        conf, tensors = lora.read_adapter(adapter)
    except lora.LoraError as e:
        raise ExportError(f"{e}; {AGAIN}") from None
    rank, alpha, targets = check_adapter(adapter, conf, tensors)
    base_ck = find_checkpoint(base, which)
    problem = verify_checkpoint(base_ck, train_state=False)
    if problem:
        raise ExportError(f"--base {base_ck}: {problem}")
    want = record["base"]["sha256"]
    if weights_sha256(base_ck) != want:
        raise ExportError(f"{adapter} was trained on the weights of {record['base'].get('checkpoint')} "
                          f"(sha256 {want[:12]}...), not on {base_ck}'s: adapters mean something only on the "
                          "weights they were trained on. Give that checkpoint as --base")
    model, tok, _, cfg = load_model(base_ck, torch.device("cpu"))
    if record.get("model") and record["model"] != cfg["model"]:
        raise ExportError(f"{adapter} was trained on another model than {base_ck}'s")
    try:
        lora.attach(model, rank, alpha, 0.0, targets)
    except lora.LoraError as e:
        raise ExportError(f"{adapter / lora.ADAPTER_CONFIG}: target_modules {targets} do not fit the model "
                          f"of {base_ck} ({e}); give the base the adapter was trained on") from None
    try:
        lora.load_adapter(model, tensors, str(adapter))
    except (KeyError, TypeError, ValueError) as e:  # LoraError included: tensors that do not fit
        raise ExportError(f"{adapter / lora.ADAPTER_FILE}: {e}") from None
    # finite adapters can still overflow once scaled (lora_alpha / r of 1e308): the merged weights say so
    bad = next((n for n, t in lora.merged_state(model).items()
                if t.is_floating_point() and not torch.isfinite(t).all()), None)
    if bad is not None:
        raise ExportError(f"{adapter}: merged onto {base_ck}, {bad} is not finite: lora_alpha {alpha:g} / r "
                          f"{rank} scales the adapters past what a float holds; {AGAIN}")
    out = check_out(out, overwrite)
    if out.exists() and overwrite:
        shutil.rmtree(out) if out.is_dir() else out.unlink()
    train = dict(cfg.get("train", {}), out=str(out), init_from=str(base_ck), lora_rank=rank,
                 lora_alpha=alpha, lora_targets=",".join(targets))
    config = {**cfg, "train": train, "lora_base": {"checkpoint": str(base_ck.resolve()),
                                                   "sha256": weights_sha256(base_ck)},
              "imported_from": {"adapter": str(adapter.resolve())}}
    ck = save_checkpoint(out, 0, model.eval(), config, {}, {"tokenizer": base_ck / "tokenizer"}, keep_last=1,
                         final=True)
    # the base's record goes on; what the adapter was trained on, an adapter file does not say
    record_trained(out, None, base_ck, unknown=[adapter_reason(adapter.name)])
    return {"checkpoint": str(ck), "out": str(out), "rank": rank}
