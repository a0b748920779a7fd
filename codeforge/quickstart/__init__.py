"""`codeforge quickstart`: the whole pipeline on a corpus the machine already has, in about ten CPU minutes.

tokenizer -> prepare -> train -> eval -> sample, each stage writing under OUT/ so any of them can be re-run
alone with the regular commands. Re-running the quickstart reuses what is already there (the tokenizer,
identical shards) and resumes the training run. Each recipe (from scratch, a small repository with a base,
--from-hf, --chat, --hrm) is a row of stages in recipes.RECIPES; `run_quickstart` chooses the row and walks
it.

  options.py   QuickstartOptions: the command's flags, declared once; which recipe they ask for
  recipes.py   the table of recipes, the choice of one, the walk, run_quickstart
  survey.py    the corpus and what --out already holds, looked at before any stage; the Quickstart state
  pretrain.py  the corpus line, tokenizer, shards and pretraining stages; the recipe's numbers from scratch
  base.py      a small repository's base: which corpus, its stage, the repository's plan after it
  from_hf.py   an open model imported and fine-tuned (the import and settings are open_model.py's)
  chat.py      --chat: its base, SFT and tools data, the SFT and tools stages, tool calling scored
  hrm.py       --hrm: plans, the hierarchical model's training and its metrics
  report.py    the last stage: the best checkpoint scored, a sample, what to run next
"""

from __future__ import annotations

import importlib
from typing import Any

# Each name, loaded from its module on first use (PEP 562): building the command's parser imports
# options.py alone, and the stages' modules bring torch in, seconds on a busy CPU. No name here is also a
# module's (survey.survey): once that module is imported, the package's attribute of that name is the module.
_HOME = {
    "recipes": ("RECIPES", "RESUME", "Recipe", "Stage", "choose", "run_quickstart", "stage", "walk"),
    "options": ("QuickstartOptions",),
    "survey": ("CORPUS_RECORD", "DECONTAMINATE", "QUICK_VAL", "Quickstart", "corpus_language",
               "corpus_languages", "corpus_path", "describe_corpus", "same_corpus", "sized_split"),
    "pretrain": ("MODEL_PRESET", "PRESETS", "REPO_FIM", "REPO_TOKENIZER_WEIGHT", "RUN", "RUN_TOKENS_PER_STEP",
                 "STEPS", "TIME_BUDGET", "VOCAB", "Plan", "corpus_tokenizer", "eval_cadence",
                 "pretrain_config", "saved_step_count"),
    "base": ("BASE_OF", "BASE_SHARE", "BYTES_PER_TOKEN", "REPO_STAGE", "choose_base"),
    "chat": ("CHAT_MODEL", "CHAT_STEPS", "CHAT_TRAIN", "SFT", "TOOLS", "TOOL_CASES", "TOOL_EXAMPLES",
             "finetune", "from_plain"),
    "hrm": ("HRM_CASES", "HRM_TRAIN"),
    "report": ("REPO_CASES", "ROSE", "repo_fim_score", "scored_checkpoint", "share", "validations"),
}
_WHERE = {name: (module, name) for module, names in _HOME.items() for name in names}
# the names benchmarks/fim_mix.py and older scripts use, from when the quickstart was one module
_WHERE.update({"_sized_split": ("survey", "sized_split"), "_tokenizer": ("pretrain", "corpus_tokenizer"),
               "_from_plain": ("chat", "from_plain")})

__all__ = sorted(name for names in _HOME.values() for name in names)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attr = _WHERE[name]
    return getattr(importlib.import_module(f"{__name__}.{module}"), attr)


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE])
