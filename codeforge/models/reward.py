"""The reward model: the GPT trunk with a scalar head (InstructGPT's RM; Ouyang et al. 2022), `arch =
"reward"`. It scores a whole sequence by the head's output at the sequence's last token. The trunk's keys
are the GPT's own, so it starts from any GPT checkpoint (an SFT run) with only `score.*` new.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from ..fields import setting
from .gpt import GPT, GPTConfig


@dataclass
class RewardConfig(GPTConfig):
    arch: str = setting("reward", "model architecture (the registry key, saved in checkpoints)",
                        choices=("reward",))

    @classmethod
    def from_gpt(cls, d: dict) -> "RewardConfig":
        """The reward model over the trunk a GPT config (dict) describes."""
        return cls.from_dict({**d, "arch": "reward"})


class RewardModel(GPT):
    """GPT + `score`, a Linear(n_embd, 1). forward() stays the language model's; `scores` is the reward."""

    @staticmethod
    def shapes(cfg: RewardConfig) -> tuple[dict[str, tuple[int, ...]], list[list[str]]]:
        """GPT.shapes plus the score head."""
        out, tied = GPT.shapes(cfg)
        return {**out, "score.weight": (1, cfg.n_embd), "score.bias": (1,)}, tied

    def __init__(self, cfg: RewardConfig):
        super().__init__(cfg)
        self.score = nn.Linear(cfg.n_embd, 1)
        nn.init.zeros_(self.score.weight)  # every sequence starts at reward 0: no preference before training
        nn.init.zeros_(self.score.bias)

    def scores(self, idx: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        """(B,) float32 rewards: the head at position last[b] (each row's final real token; rows are padded
        on the right, so no mask is needed for causal attention)."""
        h = self(idx, return_hidden=True)
        rows = torch.arange(idx.size(0), device=idx.device)
        return self.score(h[rows, last]).squeeze(-1).float()
