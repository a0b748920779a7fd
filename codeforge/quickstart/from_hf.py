"""--from-hf's stages: the open model imported (before the tokenizer stage, which then reuses the model's own
tokenizer), and its fine-tune's plan and fit. The import and the fine-tune's settings are open_model.py's;
the rest of the pipeline is the one a model trained from scratch goes through.
"""

from __future__ import annotations

from ..config import RunConfig
from ..open_model import estimate_first, imported_model, tune_settings
from ..stages.lm import MANY_PASSES
from .pretrain import RUN_TOKENS_PER_STEP, STEPS, Plan, kept_count, pretraining_seconds
from .survey import Quickstart


def import_model(q: Quickstart) -> None:
    q.imported = imported_model(q.out_dir, q.opts.from_hf)


def fine_tune(q: Quickstart) -> Plan:
    """As many passes over your training files as fit in the time budget, at most MANY_PASSES (and STEPS);
    --max-iters, or the count a first run chose, instead where there is one."""
    passes_fit, over = tune_settings(q.imported, q.opts.lora_rank, q.meta["splits"]["train"]["tokens"],
                                     RUN_TOKENS_PER_STEP, STEPS, MANY_PASSES)
    kept = kept_count(q)
    if q.opts.max_iters or kept:
        return Plan(q.opts.max_iters or kept, over=over, kept=bool(kept))
    return Plan(passes_fit, pretraining_seconds(q), over)


def fitted_to_memory(q: Quickstart, cfg: RunConfig) -> tuple[RunConfig, list[str]]:
    """An open model has 0.5B+ parameters: its time and memory are said before the long part, and a new run is
    fitted to this machine's memory (open_model.estimate_first)."""
    cfg, said = estimate_first(cfg, q.run_dir, q.trained)
    adapted = f"LoRA adapters of rank {q.opts.lora_rank}" if q.opts.lora_rank else "every weight"
    return cfg, [*said, f"from {q.imported}, {adapted}, AdamW at learning rate {cfg.train.learning_rate:g}, "
                        f"batch {cfg.train.batch_size} x {cfg.model.block_size} tokens"]
