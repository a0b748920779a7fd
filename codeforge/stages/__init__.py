"""Training stages: wiring only. Each builds the parts (data, model, loss, callbacks) and hands them to the
one Trainer. `run(cfg)` picks the stage file by the stage table's `kind` (config.py), so the CLI and the
quickstart call one function and "resume" means one thing everywhere.

- common.py  the start of every run, once: launch, begin (lock, recorded config, resume), init_from, budget
- lm.py      pretrain, code, sft, tools: the language-model stages on prepared shards
- hrm.py     the hierarchical planner/generator on mined plans
- prefs.py   reward and dpo on preference pairs
- rl.py      ppo and grpo on programming tasks with hidden tests
- local.py   --local-ranks N: one run as N processes on this machine (rank 0 is the caller)
"""

from __future__ import annotations

from ..config import STAGE, RunConfig
from . import hrm, lm, local, prefs, rl

KINDS = {"lm": lm, "hrm": hrm, "prefs": prefs, "rl": rl}


def run(cfg: RunConfig, resume: bool = False, log=print) -> dict:
    cfg = local.resolve_auto(cfg)
    body = KINDS[STAGE[cfg.train.stage].kind].run
    if local.launches(cfg):
        return local.run_local(cfg, resume, log, body)
    return body(cfg, resume, log)
