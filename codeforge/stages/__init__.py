"""Training stages: wiring only. Each builds the parts (data, model, loss, callbacks) and hands them to the
one Trainer. `run(cfg)` picks the stage file by the stage table's `kind` (config.py), so the CLI and the
quickstart call one function and "resume" means one thing everywhere.

- common.py  the start of every run, once: launch, begin (lock, recorded config, resume), init_from, budget
- lm.py      pretrain, code, sft, tools: the language-model stages on prepared shards
- hrm.py     the hierarchical planner/generator on mined plans
- prefs.py   reward and dpo on preference pairs
- rl.py      ppo and grpo on programming tasks with hidden tests
"""

from __future__ import annotations

from ..config import STAGE, RunConfig
from . import hrm, lm, prefs, rl

KINDS = {"lm": lm, "hrm": hrm, "prefs": prefs, "rl": rl}


def run(cfg: RunConfig, resume: bool = False, log=print) -> dict:
    return KINDS[STAGE[cfg.train.stage].kind].run(cfg, resume, log)
