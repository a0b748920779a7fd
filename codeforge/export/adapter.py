"""A LoRA run's adapter alone, out and in: `codeforge export --format adapter`
writes the few-MB directory (PEFT's
adapter_model.safetensors and adapter_config.json, plus codeforge_adapter.json naming the starting weights
and their sha256); `codeforge import --adapter DIR --base RUN` merges it onto those weights into a run
every command takes as an ordinary model (serve, eval, generate, the HF and GGUF exports)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from ..checkpoint import (find_checkpoint, load_model, read_config, save_checkpoint, verify_checkpoint,
                          weights_sha256)
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


def import_adapter(adapter: str | Path, base: str | Path, out: str | Path, overwrite: bool = False,
                   which: str = "auto") -> dict:
    """A run at `out`: the checkpoint `base` names with the adapter in `adapter` merged onto it."""
    adapter = Path(adapter)
    try:
        record = json.loads((adapter / RECORD).read_text())
    except (OSError, ValueError):
        record = {}
    conf, tensors = lora.read_adapter(adapter)
    base_ck = find_checkpoint(base, which)
    problem = verify_checkpoint(base_ck, train_state=False)
    if problem:
        raise ExportError(f"--base {base_ck}: {problem}")
    want = (record.get("base") or {}).get("sha256")
    if want and weights_sha256(base_ck) != want:
        raise ExportError(f"{adapter} was trained on the weights of "
                          f"{record['base'].get('checkpoint')} (sha256 "
                          f"{want[:12]}...), not on {base_ck}'s: adapters mean something only on the weights "
                          f"they were trained on. Give that checkpoint as --base")
    model, tok, _, cfg = load_model(base_ck, torch.device("cpu"))
    if record.get("model") and record["model"] != cfg["model"]:
        raise ExportError(f"{adapter} was trained on another model than {base_ck}'s")
    try:
        lora.attach(model, int(conf["r"]), float(conf["lora_alpha"]), 0.0, list(conf["target_modules"]))
        lora.load_adapter(model, tensors, str(adapter))
    except (KeyError, TypeError, ValueError) as e:
        raise ExportError(f"{adapter / lora.ADAPTER_CONFIG}: {e}") from None
    out = check_out(out, overwrite)
    if out.exists() and overwrite:
        shutil.rmtree(out) if out.is_dir() else out.unlink()
    train = dict(cfg.get("train", {}), out=str(out), init_from=str(base_ck), lora_rank=int(conf["r"]),
                 lora_alpha=float(conf["lora_alpha"]), lora_targets=",".join(conf["target_modules"]))
    config = {**cfg, "train": train, "lora_base": {"checkpoint": str(base_ck.resolve()),
                                                   "sha256": weights_sha256(base_ck)},
              "imported_from": {"adapter": str(adapter.resolve())}}
    ck = save_checkpoint(out, 0, model.eval(), config, {}, {"tokenizer": base_ck / "tokenizer"}, keep_last=1,
                         final=True)
    return {"checkpoint": str(ck), "out": str(out), "rank": int(conf["r"])}
