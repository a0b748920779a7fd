"""Training stages: wiring only. Each builds the parts (data, model, loss, callbacks) and hands them to the
one Trainer. `run(cfg)` picks the stage named by `train.stage`, so the CLI and the quickstart call one
function and "resume" means one thing everywhere."""

from __future__ import annotations

from ..config import CHAT_STAGES, PAIR_STAGES, RL_STAGES, RunConfig


def run(cfg: RunConfig, resume: bool = False, log=print) -> dict:
    if cfg.train.stage == "hrm":
        from . import hrm
        return hrm.run(cfg, resume, log)
    if cfg.train.stage in PAIR_STAGES:
        from . import prefs
        return prefs.run(cfg, resume, log)
    if cfg.train.stage in RL_STAGES:
        from . import rl
        return rl.run(cfg, resume, log)
    if cfg.train.stage in CHAT_STAGES:
        from . import sft
        return sft.run(cfg, resume, log)
    from . import pretrain
    return pretrain.run(cfg, resume, log)
