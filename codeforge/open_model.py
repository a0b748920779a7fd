"""`quickstart --from-hf SOURCE [--lora-rank R]`: an open code model (a directory, or a Hugging Face Hub name
such as Qwen/Qwen2.5-Coder-0.5B) imported once and fine-tuned on your code, whole or with LoRA.

What is its own here (the quickstart runs the rest of the pipeline as for a model trained from scratch, its
"from-hf" recipe in quickstart/recipes.py): the import (export/hf.py's import_hf, at FROM_HF_CONTEXT), the
training settings of a fine-tune (AdamW at the usual rates, the batch that keeps the quickstart's tokens per
step, the chunked loss where the vocabulary's logits would be large), and the estimate of time and memory
said before training (train/estimate.py), which also fits a CPU run to the memory there is: one process
where copies of the model in several would not fit, then a smaller batch with accumulation.
"""

from __future__ import annotations

import math
import shutil
from dataclasses import replace
from pathlib import Path

from . import rundir
from .checkpoint import find_checkpoint, read_config
from .config import load_file
from .export.hf import import_hf
from .fim import FIM_MIDDLE, FIM_PREFIX, FIM_SUFFIX
from .tokenizer import CodeTokenizer
from .train.estimate import before_training

# the usual rates for a real checkpoint (LoRA's adapters take a larger one); not swept here
# (docs/LOG.md#2026-11-27-quickstart-from-hf)
FULL_TUNE = {"learning_rate": 1e-4, "warmup_steps": 10, "min_lr_ratio": 0.1, "weight_decay": 0.0}
LORA_TUNE = {"learning_rate": 1e-3, "warmup_steps": 10, "min_lr_ratio": 0.1, "weight_decay": 0.0}
# The context an open model trains at here. The Hub's code models declare 32,768 positions, and one window
# that long keeps ~37 GiB of activations and ~46 GiB of logits for a 0.5B model (memory.py's terms, bf16);
# 1,024 holds most source files' fill-in-the-middle examples, with a batch that makes up the quickstart's
# tokens per step. Rotary positions have no weights, so nothing is lost but the length (the run's export
# declares it).
FROM_HF_CONTEXT = 1024
# rows per chunk of the fused loss where a step's fp32 logits, log-probs and gradient (12 bytes a row and
# token) would pass 1 GiB: Qwen's 151,936-token vocabulary at 4,096 tokens is 7 GiB
CHUNKED_LOSS = 1024


def imported_model(out_dir: Path, source: str) -> Path:
    """Before the tokenizer step: the open model imported into OUT/imported (once) at FROM_HF_CONTEXT, its
    tokenizer copied to OUT/tokenizer (the one the data is prepared with). Returns the imported run."""
    run = out_dir / "imported"
    if not (run / rundir.CHECKPOINTS).exists():
        out_dir.mkdir(parents=True, exist_ok=True)
        r = import_hf(source, run, log=lambda m: print(f"      {m}"), context=FROM_HF_CONTEXT, verify=None)
        where = f" from {r['path']}" if r["hub"] else ""  # a Hub name: the snapshot it was read from
        print(f"      model: imported {source}{where} ({r['family']}, {r['params']:,} parameters) -> {run}"
              + (f"; its logits equal transformers' to {r['max_abs_diff']:.1e}"
                 if r["max_abs_diff"] is not None else ""))
        if r["context"] < r["declared_context"]:
            print(f"      context: {r['context']:,} tokens (the model declares {r['declared_context']:,}; "
                  f"this run trains, serves and exports at {r['context']:,})")
    else:
        print(f"      model: reusing {run}")
    tok_dir = out_dir / "tokenizer"
    if not (tok_dir / "tokenizer.json").exists():
        shutil.copytree(find_checkpoint(run, "auto") / "tokenizer", tok_dir)
    return run


def has_fim(special_ids: dict) -> bool:
    """Whether a tokenizer has the three FIM tokens (codeforge's, or an imported model's own spelling)."""
    return all(special_ids.get(t) is not None for t in (FIM_PREFIX, FIM_MIDDLE, FIM_SUFFIX))


def tune_settings(imported: Path, lora_rank: int, train_tokens: int, tokens_per_step: int, most_steps: int,
                  passes: int) -> tuple[int, dict]:
    """(the step count for `passes` passes over train_tokens, at most most_steps; the training flags) of a
    fine-tune of the imported run: AdamW at FULL_TUNE's or LORA_TUNE's rates, a batch that makes up
    tokens_per_step at the model's context, the chunked loss where the logits would be large, and no
    fill-in-the-middle where the model's tokenizer has no FIM tokens (Qwen2 before 2.5, Llama)."""
    ck = find_checkpoint(imported, "auto")
    model = read_config(ck)["model"]
    special = CodeTokenizer.load(ck / "tokenizer", log=lambda m: None).special_ids
    block, vocab = model["block_size"], model["vocab_size"]
    batch = max(1, tokens_per_step // block)
    steps = min(most_steps, max(1, math.ceil(passes * train_tokens / (batch * block))))
    over = {"train.init_from": str(imported), "train.batch_size": batch, "train.optimizer": "adamw",
            **{f"train.{k}": v for k, v in (LORA_TUNE if lora_rank else FULL_TUNE).items()},
            **({"train.lora_rank": lora_rank, "train.lora_alpha": 2.0 * lora_rank} if lora_rank else {}),
            **({"train.loss_chunk_rows": CHUNKED_LOSS} if batch * block * vocab * 12 > 2**30 else {}),
            **({} if has_fim(special) else {"train.fim_rate": 0.0})}
    return steps, over


FIT = ("local_ranks", "batch_size", "grad_accum_steps")  # what before_training may change, and a resume keeps


def estimate_first(cfg, run_dir: Path, resume: bool) -> tuple[object, list[str]]:
    """(the config to train with, the estimate's lines). A resumed run keeps the processes and batch it saved
    (a resume refuses another batch on as many ranks); a new one is fitted to this machine's memory."""
    saved = None
    if resume:
        try:  # the same checks --resume applies to a saved config
            saved = load_file(run_dir / rundir.CONFIG).get("train", {})
        except (OSError, ValueError):
            saved = None
    kept = {k: saved[k] for k in FIT if isinstance((saved or {}).get(k), int) and saved[k] > 0}
    if len(kept) == len(FIT):
        cfg = replace(cfg, train=replace(cfg.train, **kept))
    return before_training(cfg, fit=len(kept) != len(FIT))
