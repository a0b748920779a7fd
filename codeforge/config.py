"""Run configuration: model + training settings from presets, a TOML/YAML file and `--set key=value`,
validated where they enter and saved resolved into the run directory.

Precedence, later wins: defaults < presets (in the order given) < config file < `--set` < plain flags.
"""

from __future__ import annotations

import dataclasses
import json
import math
import tomllib
from dataclasses import dataclass, field, fields
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from .catalog import CATALOG, catalog_key
from .checkpoint import CheckpointError, find_checkpoint, read_config, vet_checkpoint
from .checkpoint.guard import CONFIG_BYTES, field_problem, read_regular
from .fields import ConfigError, check_fields, saved, setting, switch_value
from .models import ARCHS, build_model, config_class
from .models.gpt import GPTConfig


@dataclass(frozen=True)
class Stage:
    """What a training stage is, said once: every other place asks this table."""
    name: str
    kind: str  # the stage file that trains it: stages/lm.py, hrm.py, prefs.py or rl.py
    chat: str  # "yes": trains on chat data; "no": plain text; "inherits": continues --init-from's format
    fsdp: bool  # may run under --parallel fsdp: one model and a loss on its outputs, nothing beside it
    data: str  # what --data holds: shards | chat shards | plans | pairs | tasks
    # --resume on another number of ranks: "rescale" keeps the global batch by scaling the accumulation (the
    # loader's cursor counts global batches of a fixed token stream); "refuse": the batches depend on the
    # ranks (chat packed per rank, pairs/tasks/plans dealt per rank), so it resumes on as many as it saved
    other_ranks: str


STAGE_TABLE = (
    Stage("pretrain", "lm", "no", True, "shards", "rescale"),
    Stage("code", "lm", "no", True, "shards", "rescale"),
    Stage("sft", "lm", "yes", True, "chat shards", "refuse"),
    Stage("tools", "lm", "yes", True, "chat shards", "refuse"),
    Stage("hrm", "hrm", "no", False, "plans", "refuse"),
    Stage("reward", "prefs", "inherits", False, "pairs", "refuse"),  # JSONL from `codeforge make-pairs`
    Stage("dpo", "prefs", "inherits", False, "pairs", "refuse"),
    Stage("ppo", "rl", "inherits", False, "tasks", "refuse"),  # JSONL from `codeforge make-tasks`
    Stage("grpo", "rl", "inherits", False, "tasks", "refuse"),
)
STAGE = {s.name: s for s in STAGE_TABLE}
STAGES = tuple(STAGE)
CHAT_STAGES = tuple(s.name for s in STAGE_TABLE if s.chat == "yes")
PAIR_STAGES = tuple(s.name for s in STAGE_TABLE if s.kind == "prefs")
RL_STAGES = tuple(s.name for s in STAGE_TABLE if s.kind == "rl")
FSDP_STAGES = tuple(s.name for s in STAGE_TABLE if s.fsdp)


def chat_notice(saved: dict) -> str | None:
    """What to tell a user who chats with a run no chat stage trained (None when one did)."""
    if speaks_chat(saved):
        return None
    stage = saved.get("train", {}).get("stage", "pretrain")
    return (f"this model was trained only as a base model (stage {stage}), never taught to chat: a reply "
            f"continues the conversation's text rather than answers it. Train it with `codeforge train "
            f"--stage sft` (docs/chat-and-tools.md), or try `codeforge quickstart --chat`")


def speaks_chat(saved: dict) -> bool:
    """Whether a saved run config is a chat model's: trained by a chat stage, or by a preference or RL stage
    that continued one (they record it as "chat"; older runs of theirs are taken as chat)."""
    if "chat" in saved:
        return bool(saved["chat"])
    stage = STAGE.get(saved.get("train", {}).get("stage"))
    return stage is not None and stage.chat != "no"


# -- the common [train] section, by component --------------------------------------------------------------
# Each class below holds the settings one component reads, and its docstring names that component's module.
# They are declared here rather than beside their readers because config.py (layer 3) may not import train/
# or stages/ (layers 4 and 5), and resolve() must see every field. CommonTrain joins them, so a stage still
# reads cfg.train.<field> and config.toml keeps one flat [train] table.


@dataclass
class RunSettings:
    """What run this is (stages/__init__.py picks the stage file; stages/common.py opens the run directory,
    loads --init-from and seeds the weights)."""
    stage: str = setting("pretrain",
                         "training stage: packed text (pretrain, code) or chat conversations with a loss "
                         "mask (sft, tools); each stage has its own defaults (presets/stages.toml)",
                         choices=STAGES)
    out: str = setting("", "run directory (checkpoints, metrics, config)", required=True, metavar="RUN")
    init_from: str = setting("",
                             "start from another run's weights (staged training); a run or checkpoint dir",
                             metavar="RUN")
    seed: int = setting(1337, "seed of weights, data order and dropout", range=(0, 2**63 - 1))


@dataclass
class DataSettings:
    """What a step trains on (each stage's batch source, data/; the accumulation loop in
    train/trainer.py)."""
    data: str = setting("",
                        "prepared data directory (from `codeforge prepare`; --stage hrm: mined plans from "
                        "`codeforge make-plans`; reward, dpo: preference pairs, a JSONL file or a `codeforge "
                        "make-pairs` directory; ppo, grpo: tasks, a JSONL file or a `codeforge make-tasks` "
                        "directory)", required=True, metavar="DIR")
    tokenizer: str = setting("",
                             "tokenizer directory, for stages that train on raw JSONL (hrm); the prepared "
                             "stages take the one beside their shards", metavar="DIR")
    batch_size: int = setting(8, "micro-batch size", range=(1, 4096))
    grad_accum_steps: int = setting(1, "micro-batches per optimizer step", range=(1, 4096))


@dataclass
class OptimizerSettings:
    """The optimizer and the update it makes (train/optim.py's build_optimizer; the gradient clipping of
    train/trainer.py's train_step)."""
    learning_rate: float = setting(3e-4, "peak learning rate", range=(0.0, 0.1), open_low=True)
    weight_decay: float = setting(0.1, "AdamW weight decay of matrices", range=(0.0, 10.0))
    beta1: float = setting(0.9, "AdamW beta1", range=(0.0, 0.999999))
    beta2: float = setting(0.95, "AdamW beta2", range=(0.0, 0.999999))
    grad_clip: float = setting(1.0, "clip the gradient norm to this", range=(0.0, 1e6),
                               zero_means="no clipping")
    optimizer: str = setting("adamw",
                             "optimizer (adamw8bit: bitsandbytes, CUDA only; muon: Muon for the hidden "
                             "weight matrices, AdamW for embeddings, head and gains; GPT models)",
                             choices=("adamw", "adamw8bit", "muon"))
    muon_lr: float = setting(0.02,
                             "muon: peak learning rate of the hidden matrices (the schedule scales it as it "
                             "scales learning_rate)", range=(0.0, 10.0), open_low=True)
    muon_momentum: float = setting(0.95, "muon: momentum (Nesterov)", range=(0.0, 0.999999))
    muon_weight_decay: float = setting(0.0, "muon: decoupled weight decay of the hidden matrices",
                                       range=(0.0, 10.0))


@dataclass
class ScheduleSettings:
    """The learning rate over the run, a pure function of the step (train/optim.py's lr_at)."""
    min_lr_ratio: float = setting(0.1, "the schedule's floor, as a fraction of learning_rate",
                                  range=(0.0, 1.0))
    schedule: str = setting("cosine", "learning-rate schedule",
                            choices=("cosine", "linear", "constant", "wsd"))
    warmup_steps: int = setting(100, "linear warm-up steps", range=(0, 10**9))
    decay_fraction: float = setting(0.2, "wsd: share of the run spent decaying", range=(0.0, 1.0))


@dataclass
class StoppingSettings:
    """When training ends (stages/common.py's budget: steps from iterations, tokens or epochs; in
    train/trainer.py, the step count a time budget fits and the stop after non-finite losses)."""
    max_iters: int = setting(0, "optimizer steps (budget)", range=(0, 10**12),
                             zero_means="from max_tokens or epochs")
    max_tokens: int = setting(0, "tokens (budget, if max_iters is 0)", range=(0, 10**15),
                              zero_means="from epochs")
    epochs: float = setting(0.0, "epochs over the training split (budget)", range=(0.0, 1e6),
                            zero_means="1 epoch")
    time_budget: float = setting(0.0,
                                 "seconds the run may take: after its first steps it measures the pace and "
                                 "sets the step count (at most --max-iters) so that training and its "
                                 "evaluations end within this (on --resume: counted from the resumed step); "
                                 "the count is saved as max_iters, so a re-run or --resume repeats it",
                                 range=(1.0, 10.0**9), zero_means="no budget: --max-iters steps")
    max_bad_steps: int = setting(5, "stop after this many non-finite losses in a row", range=(1, 10**6))


@dataclass
class EvaluationSettings:
    """Validation and samples during training (train/trainer.py decides when; the evaluate and sample
    callbacks each stage hands it, through evaluation/lm.py, decide how much)."""
    eval_every: int = setting(250, "evaluate every N steps", range=(0, 10**9), zero_means="only at the end")
    eval_tokens: int = setting(262_144,
                               "validation tokens per evaluation, at most: the validation split in order, in "
                               "whole context windows until N tokens are covered (chat rows count their "
                               "masked and padding tokens). A pretraining run too short to pay for N scores "
                               "an eighth of the tokens it trains on, spread over its evaluations (at least "
                               "16,384) and saves that count; the same set in training, the quickstart and "
                               "`codeforge eval`", range=(1, 10**12), zero_means="the whole split")
    sample_every: int = setting(0, "write a sample every N steps", range=(0, 10**9), zero_means="never")
    sample_tokens: int = setting(64, "tokens per sample", range=(1, 10**6))


@dataclass
class CheckpointSettings:
    """When checkpoints are written and how many are kept (train/trainer.py's saves, through
    checkpoint/save.py)."""
    save_every: int = setting(500,
                              "checkpoint every N steps (and at every evaluation that beats the best so far, "
                              "so the `best` checkpoint is the best evaluated weights)", range=(0, 10**9),
                              zero_means="only at the end and at improving evaluations")
    keep_last: int = setting(3, "periodic checkpoints kept (plus best and final)", range=(1, 10**6))
    async_checkpoint: str = setting("auto",
                                    "fsdp: write checkpoint shards in the background while training goes on "
                                    "(DCP async_save; the state is copied to host memory first, and the "
                                    "checkpoint is published once every rank's part is written); auto: on "
                                    "GPUs", choices=("auto", "on", "off"))


@dataclass
class LoggingSettings:
    """Where the run's numbers go (train/logging.py's RunLogger)."""
    log_every: int = setting(10, "log a training line every N steps", range=(1, 10**9))
    tensorboard: bool = setting(True, "write TensorBoard events")
    wandb: bool = setting(False, "log to Weights & Biases")
    wandb_project: str = setting("codeforge", "W&B project")
    progress: bool = setting(True, "a progress bar on a terminal; off (or output not a terminal): a progress "
                                   "line every log_every steps, at least once a minute")


@dataclass
class DeviceSettings:
    """What the model runs on and how (device.py, called once by stages/common.py's launch; the compiled
    and checkpointed forward that train/parallel.py and the stages build; the attention kernel,
    models/gpt.py's set_attention)."""
    device: str = setting("auto", "auto|cpu|cuda|cuda:N|mps")
    threads: int = setting(0, "CPU threads for PyTorch's operations (0: the cores other work leaves free at "
                              "start; $CODEFORGE_THREADS does the same for every command)", range=(0, 4096))
    precision: str = setting("auto",
                             "numeric precision (auto: bf16 on GPUs that have it, else fp16; fp32 on a CPU. "
                             "fastest: the same, but bf16 on a CPU that multiplies bfloat16 natively, "
                             "AVX512-BF16 or AMX: about 30 percent more tokens/s)",
                             choices=("auto", "fastest", "fp32", "fp16", "bf16"))
    compile: str = setting("auto",
                           "torch.compile the model for training; evaluation and samples run it uncompiled. "
                           "auto: on a CUDA GPU, where it is worth 1.67x "
                           "(docs/LOG.md#2026-11-27-gpu-suite-h100), off elsewhere (on a CPU compiling "
                           "takes longer than most runs save); `--compile` alone is on, --no-compile off "
                           "(true/false in an older config.toml read as on/off)",
                           choices=("auto", "on", "off"), switch=True)
    compile_shapes: str = setting(
        "static",
        "what a compiled training step is compiled for. static: in the LM stages (pretrain, code, sft, "
        "tools: every batch is batch x context) that one shape, as one whole graph where the model traces "
        "without a break (fullgraph; a model that breaks, or a graph past torch's recompile limit, is "
        "compiled in pieces with dynamic shapes, said once); the stages whose batches are padded per batch "
        "compile with dynamic shapes whatever this says. dynamic: PyTorch's default (a second shape "
        "recompiles with symbolic sizes)",
        choices=("static", "dynamic"))
    host_sync: str = setting(
        "auto",
        "when the step's loss and gradient norm are read to the host. step: after every step (the GPU idles "
        "while the host reads, then while the optimizer's launches queue); log: kept on the device and read "
        "once per log line, a step late, with a non-finite step skipped on the device by the fused AdamW "
        "(the same weights, losses and skip counts; a run stopped for --max-bad-steps stops up to one log "
        "interval later, its weights untouched). auto: log on a GPU where the optimizer can skip on the "
        "device (fused AdamW, not fp16, not FSDP), step elsewhere",
        choices=("auto", "step", "log"))
    prefetch: str = setting(
        "auto",
        "build the next training batch in a background thread while the current step runs (on a GPU copied "
        "from pinned memory on a side stream). The same batches in the same order; a checkpoint's cursor is "
        "the consumed batches'. auto: on on a GPU, off on a CPU (its cores are busy with the step)",
        choices=("auto", "on", "off"), switch=True)
    attention: str = setting(
        "auto",
        "PyTorch SDPA kernel for attention (a runtime choice, not saved with the model's architecture). "
        "auto: cuDNN first, then flash, efficient, math on a Hopper GPU (sm90+) with cuDNN attention, "
        "PyTorch's own choice elsewhere; cudnn: cuDNN fused attention (CUDA sm80+, cuDNN 9); flash: "
        "FlashAttention-2 (CUDA sm80+ in fp16/bf16; also a CPU kernel, without dropout); efficient: "
        "memory-efficient kernel (CUDA only); math: the plain reference implementation (every device, "
        "slowest). A forced kernel the device or the model's shapes cannot run is refused",
        choices=("auto", "cudnn", "flash", "efficient", "math"))
    grad_checkpointing: bool = setting(False, "recompute activations in backward (less memory)",
                                       flag="--gradient-checkpointing")


@dataclass
class ParallelSettings:
    """How many processes train and how they share the model (train/parallel.py; stages/local.py for
    --local-ranks; distributed.py's process group)."""
    local_ranks: int = setting(1,
                               "CPU: run as N processes on this machine, data parallel (DDP over gloo, as "
                               "torchrun would start them), the cores' threads split between them; "
                               "--batch-size and --threads are per process, as under torchrun. On cores "
                               "other programs share, N one-thread processes keep their share where one "
                               "N-thread process waits for its slowest thread "
                               "(docs/LOG.md#2026-11-25-local-ranks-measured)", range=(1, 256),
                               zero_means="auto: on a CPU, one process per usable core (at most 4, a divisor "
                                          "of --batch-size), with --batch-size the global batch split "
                                          "between them (the quickstart's choice); one process on a GPU")
    parallel: str = setting("auto",
                            "data parallelism under torchrun: ddp (every rank holds the whole model, its "
                            "gradients and optimizer state) or fsdp (PyTorch FSDP2: each rank holds 1/N of "
                            "them; sharded checkpoints with DCP); auto: ddp, or fsdp on GPUs when `codeforge "
                            "plan` says DDP does not fit", choices=("auto", "ddp", "fsdp"))
    fsdp_offload: bool = setting(False,
                                 "fsdp: keep parameter shards, gradients and optimizer state in CPU memory "
                                 "(PyTorch's CPUOffloadPolicy): slower, for shards that do not fit the GPU")
    dist_timeout: int = setting(600,
                                "seconds a rank waits in a collective for the others before failing (a "
                                "killed or stuck rank then ends the job instead of hanging it)",
                                range=(5, 86400))


# the components in the order `codeforge config keys` lists them (and the flags appear in --help)
COMMON_SECTIONS = {"run": RunSettings, "data": DataSettings, "optimizer": OptimizerSettings,
                   "schedule": ScheduleSettings, "stopping": StoppingSettings,
                   "evaluation": EvaluationSettings, "checkpointing": CheckpointSettings,
                   "logging": LoggingSettings, "device": DeviceSettings, "parallelism": ParallelSettings}


@dataclass
class CommonTrain(ParallelSettings, DeviceSettings, LoggingSettings, CheckpointSettings, EvaluationSettings,
                  StoppingSettings, ScheduleSettings, OptimizerSettings, DataSettings, RunSettings):
    """The [train] settings every stage reads: COMMON_SECTIONS joined into one flat class, so that a reader
    writes cfg.train.learning_rate, not cfg.train.optimizer.learning_rate. The bases are listed last-first
    because a dataclass collects its bases' fields from the last base to the first: this way the fields
    (and the flags in --help) run in COMMON_SECTIONS' order."""


@dataclass
class LMTrain:
    """The language-model stages' own (pretrain, code, sft, tools): fill-in-the-middle, the fused loss,
    LoRA."""
    fim_rate: float = setting(0.0,
                              "share of training documents reordered for fill-in-the-middle (prefix-suffix-"
                              "middle or suffix-prefix-middle; 0.5 in the pretrain and code stages)",
                              range=(0.0, 1.0))
    fim_spm_rate: float = setting(0.5, "of those, the share in suffix-prefix-middle order", range=(0.0, 1.0))
    # fused chunked lm_head + cross-entropy (train/losses.py): off by default. It saves the (B*T, vocab)
    # logits' memory; neutral in speed on a CPU (docs/LOG.md#2026-11-22-cpu-training-step), and on an H200
    # it saved memory at some cost in speed (docs/LOG.md#2026-11-27-chunked-loss-h200)
    loss_chunk_rows: int = setting(0, "fused chunked LM loss, rows per chunk", range=(0, 10**7),
                                   zero_means="off")
    lora_rank: int = setting(0, "LoRA: train adapters of this rank on the blocks' linear layers, the "
                             "--init-from weights frozen (models/lora.py, with PEFT); checkpoints hold the "
                             "merged weights and the adapter alone", range=(1, 4096),
                             zero_means="full fine-tuning")
    lora_alpha: float = setting(16.0, "LoRA: the adapters' scale is alpha / rank", range=(0.0, 1e6),
                                open_low=True)
    lora_dropout: float = setting(0.0, "LoRA: dropout on the adapters' input", range=(0.0, 1.0))
    lora_targets: str = setting("c_attn,c_fc,c_proj", "LoRA: the linear layers that get adapters, by name "
                                "(comma-separated: c_attn is attention's q/k/v, c_proj both output "
                                "projections, c_fc the MLP's input)")


@dataclass
class HRMTrain:
    """The hierarchical model's stage's own (hrm)."""
    syntax_cases: int = setting(8, "hrm stage: held-out functions planned, written and parsed at each "
                                "evaluation (syntax-valid rate, avg iterations in metrics.jsonl)",
                                range=(0, 10**6), zero_means="off")


@dataclass
class PrefsTrain:
    """The preference stages' own (reward, dpo)."""
    beta: float = setting(0.1,
                          "dpo: strength of the implicit KL to the reference model (Rafailov et al. 2023)",
                          range=(0.0, 100.0), open_low=True)
    dpo_sft: float = setting(0.0, "dpo: weight of the chosen answers' own language-model loss added to DPO's "
                             "(RPO, Pang et al. 2024; keeps their likelihood from sinking with the rejected)",
                             range=(0.0, 100.0))


@dataclass
class RLTrain:
    """The reinforcement-learning stages' own (ppo, grpo): rollouts, rewards, the clipped objective."""
    kl_coef: float = setting(0.0, "ppo, grpo: weight of the KL penalty to the frozen reference (0.05 in ppo; "
                             "grpo leaves it off)", range=(0.0, 100.0))
    rewards: str = setting("auto",
                           "ppo, grpo: where rewards come from: running the sample's code against the "
                           "task's tests, the reward model (--reward-model), or their sum; auto: the reward "
                           "model when one is given, else execution",
                           choices=("auto", "execution", "model", "both"))
    reward_model: str = setting("", "ppo: a reward-model run (from --stage reward) that scores samples",
                                metavar="RUN")
    group_size: int = setting(4, "ppo, grpo: samples per task in a rollout (GRPO's G)", range=(1, 1024))
    rollout_tasks: int = setting(8, "ppo, grpo: tasks per rollout (each sampled group_size times)",
                                 range=(1, 100_000))
    rollout_tokens: int = setting(128, "ppo, grpo: most tokens a sample may write", range=(1, 100_000))
    rollout_temperature: float = setting(1.0, "ppo, grpo: sampling temperature of rollouts",
                                         range=(0.0, 10.0), open_low=True)
    ppo_epochs: int = setting(1,
                              "ppo, grpo: passes over each rollout (in micro-batches of batch_size samples)",
                              range=(1, 1000))
    clip_eps: float = setting(0.2, "ppo, grpo: clip range of the probability ratio", range=(0.0, 10.0),
                              open_low=True)
    gae_gamma: float = setting(1.0, "ppo: discount", range=(0.0, 1.0))
    gae_lambda: float = setting(0.95, "ppo: GAE lambda", range=(0.0, 1.0))
    vf_coef: float = setting(0.5, "ppo: weight of the value head's loss", range=(0.0, 100.0))
    eval_tasks: int = setting(64, "ppo, grpo: held-out tasks solved (greedy) at each evaluation",
                              range=(0, 10**6), zero_means="all of them")


@dataclass
class TrainConfig(RLTrain, PrefsTrain, HRMTrain, LMTrain, CommonTrain):
    """Every [train] setting: the common section (CommonTrain, by component) plus one per stage kind
    (SECTION_OF_KIND), each field declared once, in its section. config.toml keeps them in one flat [train]
    table, in the order it always had (SAVED_ORDER), so a saved run loads as it did."""

    # the key order of [train] in saved files (fields.saved), from before the sections: common and per-stage
    # settings as they were interleaved then (a new setting goes after them without being listed)
    SAVED_ORDER = (
        "stage", "data", "tokenizer", "out", "batch_size", "grad_accum_steps", "learning_rate",
        "min_lr_ratio", "schedule", "warmup_steps", "decay_fraction", "max_iters", "max_tokens", "epochs",
        "weight_decay", "beta1", "beta2", "grad_clip", "optimizer", "muon_lr", "muon_momentum",
        "muon_weight_decay", "eval_every", "time_budget", "eval_tokens", "sample_every", "sample_tokens",
        "syntax_cases", "save_every", "keep_last", "log_every", "seed", "device", "threads", "precision",
        "compile", "grad_checkpointing", "local_ranks", "parallel", "fsdp_offload", "async_checkpoint",
        "dist_timeout", "fim_rate", "fim_spm_rate", "loss_chunk_rows", "max_bad_steps", "beta", "dpo_sft",
        "kl_coef", "rewards", "reward_model", "group_size", "rollout_tasks", "rollout_tokens",
        "rollout_temperature", "ppo_epochs", "clip_eps", "gae_gamma", "gae_lambda", "vf_coef", "eval_tasks",
        "init_from", "lora_rank", "lora_alpha", "lora_dropout", "lora_targets", "tensorboard", "wandb",
        "wandb_project", "progress")

    def to_dict(self) -> dict:
        return saved(self, self.SAVED_ORDER)


# the section of settings each kind of stage adds to the common one (config.STAGE_TABLE's `kind`)
SECTION_OF_KIND = {"lm": LMTrain, "hrm": HRMTrain, "prefs": PrefsTrain, "rl": RLTrain}


def _model_fields() -> type:
    """The model section as the command line and `config keys` see it: every architecture's fields, each
    declared once in its own config class (models/), merged in registry order; `arch` chooses among them and
    resolve() builds that architecture's class, refusing keys it does not have."""
    merged, seen = [], set()
    for arch, (cls, _) in ARCHS.items():
        for f in fields(cls):
            if f.name in seen:
                continue
            seen.add(f.name)
            meta = dict(f.metadata)
            if f.name == "arch":
                meta["choices"] = tuple(ARCHS)
            elif arch != "gpt":
                meta["help"] = f"({arch}) {meta.get('help', '')}"
            merged.append((f.name, f.type, dataclasses.field(default=f.default, metadata=meta)))
    return dataclasses.make_dataclass("ModelFields", merged)


FLAG_OF = {"learning_rate": "--learning-rate", "batch_size": "--batch-size", "vocab_size": "--vocab-size"}
SECTIONS = {"model": _model_fields(), "train": TrainConfig}


@dataclass(frozen=True)
class RunConfig:
    """A run's whole configuration. Frozen: a step that changes it (the vocabulary from the tokenizer, the
    accumulation a resume chose) returns a new one with dataclasses.replace, so what a stage trains with is
    what it was handed last, never a value a helper changed behind it."""
    model: GPTConfig = field(default_factory=GPTConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def to_dict(self) -> dict:
        return {"model": self.model.to_dict(), "train": self.train.to_dict()}

    def validate(self) -> "RunConfig":
        check_fields(self.model, "model")
        check_fields(self.train, "train")
        m = self.model
        if m.n_embd % m.n_head:
            raise ConfigError(f"model.n_embd = {m.n_embd} is not divisible by model.n_head = {m.n_head}; "
                              "pick n_embd a multiple of n_head "
                              f"(e.g. {m.n_head * max(1, round(m.n_embd / m.n_head))})")
        if m.n_head % m.n_kv_head:
            raise ConfigError(
                f"model.n_head = {m.n_head} is not divisible by model.n_kv_head = {m.n_kv_head}")
        if m.pos == "rope" and m.head_dim % 2:
            raise ConfigError(f"rotary positions need an even head size; n_embd/n_head = {m.head_dim}")
        t = self.train
        if t.lora_rank and STAGE[t.stage].kind != "lm":
            lm = ", ".join(s.name for s in STAGE_TABLE if s.kind == "lm")
            raise ConfigError(f"--lora-rank trains adapters in the language-model stages ({lm}); --stage "
                              f"{t.stage} fine-tunes every weight: drop --lora-rank")
        if t.lora_rank and not [x for x in t.lora_targets.split(",") if x.strip()]:
            raise ConfigError("--lora-targets is empty: name the linear layers that get adapters (default "
                              "c_attn,c_fc,c_proj)")
        return self


def _preset_tables() -> dict[str, dict[str, dict]]:
    out = {}
    for kind, fname in (("model", "models.toml"), ("train", "hardware.toml"), ("stage", "stages.toml")):
        out[kind] = tomllib.loads(resources.files("codeforge.presets").joinpath(fname).read_text())
    return out


def preset_names() -> dict[str, list[str]]:
    return {k: sorted(v) for k, v in _preset_tables().items()}


def preset_catalog() -> dict:
    """{"models_toml": its key, "presets": {name: shape and parameter count}}: each model preset built on the
    meta device (no memory) and counted; catalog.py reads the shipped copy without torch."""
    rows = {}
    for n in preset_names()["model"]:
        m = resolve([n]).model
        with torch.device("meta"):
            count = build_model(m).num_params()
        rows[n] = {"params": count, "n_layer": m.n_layer, "n_head": m.n_head, "n_kv_head": m.n_kv_head,
                   "n_embd": m.n_embd, "ffn_hidden": m.ffn_hidden, "block_size": m.block_size,
                   "vocab_size": m.vocab_size, "kind": f"{m.norm}/{m.pos}/{m.mlp}"}
    text = resources.files("codeforge.presets").joinpath("models.toml").read_text()
    return {"models_toml": catalog_key(text), "presets": rows}


def write_catalog() -> str:
    """Compute the catalog and write it over the shipped one (`codeforge presets --write-catalog`); its
    path."""
    path = str(resources.files("codeforge.presets").joinpath(CATALOG))
    with open(path, "w") as f:
        f.write(json.dumps(preset_catalog(), indent=1, sort_keys=True) + "\n")
    return path


def _coerce(key: str, value: Any, current: Any) -> Any:
    """Convert a `--set` string (or a file value) to the type of the field it sets."""
    f = _field(key)
    if f is not None and f.metadata.get("switch"):
        return switch_value(f, value)
    if isinstance(current, bool):
        if isinstance(value, bool):
            return value
        s = str(value).lower()
        if s in ("1", "true", "yes", "on"):
            return True
        if s in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{key} = {value!r} is not a boolean; use true or false")
    try:
        if isinstance(current, int):
            f = float(value)
            if not f.is_integer():
                raise ValueError
            return int(f)
        if isinstance(current, float):
            return float(value)
    except (TypeError, ValueError):
        raise ConfigError(
            f"{key} = {value!r} is not a{'n integer' if isinstance(current, int) else ' number'}") from None
    return str(value)


RETIRED = {"train.eval_iters": "train.eval_tokens (validation targets per evaluation; 0: the whole split)"}


def _key(key: str) -> str:
    """`model.x`, `train.x`, or a bare `x` resolved to the section that has it."""
    section, _, name = key.rpartition(".")
    for old, new in RETIRED.items():
        if key in (old, old.split(".")[1]):
            raise ConfigError(f"{key} was replaced by {new}")
    sections = [section] if section else [s for s in SECTIONS if name in _field_names(s)]
    if not sections or section not in ("", *SECTIONS) or name not in _field_names(sections[0]):
        raise ConfigError(f"unknown setting {key!r}; model keys: {sorted(_field_names('model'))}; "
                          f"train keys: {sorted(_field_names('train'))}")
    return f"{sections[0]}.{name}"


def _field_names(section: str) -> set[str]:
    return {f.name for f in fields(SECTIONS[section])}


def load_file(path: str | Path) -> dict:
    """The settings of a TOML/YAML file (a --config file, or a run's saved RUN/config.toml that --resume
    builds on), each checked where it enters: [model] and [train] are tables, every key is a setting, every
    value has its field's type and lies in its range. Values come back converted to their field's type
    (`_coerce`); a problem is one ConfigError naming the file and the field."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"config file {p} does not exist")
    try:  # a regular file only (a FIFO would block the read), of a size settings can have
        text = read_regular(p, CONFIG_BYTES, ConfigError, "pass a TOML or YAML file of settings").decode()
    except UnicodeDecodeError as e:
        raise ConfigError(f"{p}: not UTF-8 text ({e})") from None
    if p.suffix in (".yaml", ".yml"):
        import yaml
        data = yaml.safe_load(text) or {}
    else:
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{p}: not valid TOML: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: expected a table of settings")
    out: dict = {}
    for k, v in data.items():
        if k in SECTIONS:
            if not isinstance(v, dict):
                raise ConfigError(f"{p}: {k} = {v!r} is not a table of settings; write them as [{k}] "
                                  f"followed by key = value lines (`codeforge config keys` lists them)")
            out[k] = {kk: _checked(p, f"{k}.{kk}", vv) for kk, vv in v.items()}
        else:
            out[k] = _checked(p, k, v)
    return out


def _field(key: str):
    """The declaration of setting `key` (section.name), None for a key no section has."""
    sec, _, name = key.partition(".")
    return next((f for f in fields(SECTIONS[sec]) if f.name == name), None) if sec in SECTIONS else None


def _checked(p: Path, key: str, v: Any) -> Any:
    """Value `v` of setting `key` as file `p` gives it, converted to its field's type and checked against
    the field's declaration (type, choices, range); retired keys pass (resolve() says what replaced them)."""
    if any(key in (old, old.split(".")[1]) for old in RETIRED):
        return v
    try:
        full = _key(key)
        sec, name = full.split(".")
        f = next(f for f in fields(SECTIONS[sec]) if f.name == name)
        if isinstance(v, bool) and not isinstance(f.default, bool) and not f.metadata.get("switch"):
            # _coerce would take true for 1
            raise ConfigError(
                f"{full} = {v!r} is not a{'n integer' if isinstance(f.default, int) else ' number'}")
        if isinstance(v, (dict, list)):
            raise ConfigError(f"{full} = {v!r} is not a single value")
        value = _coerce(full, v, f.default)
    except ConfigError as e:
        raise ConfigError(f"{p}: {e}") from None
    problem = field_problem(f, value)
    if problem:
        raise ConfigError(f"{p}: {full} = {v!r} {problem}; correct it in that file (`codeforge config keys` "
                          f"lists every setting with its range)")
    return value


def resolve(presets: list[str] = (), file: str | None = None, sets: list[str] = (),
            flags: dict[str, Any] | None = None, base: dict | None = None,
            vocab_from_data: bool = False) -> RunConfig:
    """Build and validate a RunConfig. Layers, later wins: the declared defaults (or `base`, a saved config
    dict), the stage's defaults (presets/stages.toml), presets, the file, --set, flags. The dataclasses are
    built once from the merged values, so derived fields (n_kv_head, ffn_hidden) follow the final values.
    vocab_from_data: a preset's vocab_size is dropped (0 = take it from the data; on --resume, the saved
    run's) unless the file, --set or a flag sets one."""
    layers: list[tuple[str, Any]] = []  # (section.key, value), in order of precedence
    tables = _preset_tables()
    pretrain_only: list[tuple[int, list]] = []  # (place in layers, a profile's [NAME.pretrain] recipe)
    for name in presets:
        kind = next((k for k in ("model", "train") if name in tables[k]), None)
        if kind is None:
            raise ConfigError(f"unknown preset {name!r}; models: {sorted(tables['model'])}; "
                              f"hardware: {sorted(tables['train'])}")
        table = tables[kind][name]
        layers += [(f"{kind}.{k}", v) for k, v in table.items() if not isinstance(v, dict)]
        if isinstance(table.get("pretrain"), dict):  # optimizer and rates for pretraining from scratch only:
            pretrain_only.append((len(layers), [(f"train.{k}", v) for k, v in table["pretrain"].items()]))
    if vocab_from_data and not base:
        layers.append(("model.vocab_size", 0))
    elif vocab_from_data and "vocab_size" in base.get("model", {}):  # --resume: the run's own (from its data)
        layers.append(("model.vocab_size", base["model"]["vocab_size"]))
    if file:
        for k, v in load_file(file).items():
            if isinstance(v, dict) and k in SECTIONS:
                layers += [(f"{k}.{kk}", vv) for kk, vv in v.items()]
            else:
                layers.append((k, v))
    for s in sets:
        if "=" not in s:
            raise ConfigError(f"--set {s!r} must look like key=value (e.g. --set model.n_layer=6)")
        k, v = s.split("=", 1)
        layers.append((k.strip(), v.strip()))
    layers += [(k, v) for k, v in (flags or {}).items() if v is not None]
    layers = [(_key(k), v) for k, v in layers]
    stage_asked = next((v for k, v in reversed(layers) if k == "train.stage"),
                       (base or {}).get("train", {}).get("stage", "pretrain"))
    if stage_asked == "pretrain":  # fine-tuning stages keep their own optimizer and rates (stages.toml)
        for at, recipe in reversed(pretrain_only):
            layers[at:at] = [(_key(k), v) for k, v in recipe]

    init_from = next((v for k, v in reversed(layers) if k == "train.init_from"), "")
    start_model: dict = {}
    if init_from and not base:  # staged training: the model is the one it starts from, unless flags change it
        try:
            # its configuration, its files and the model it declares, checked against its weights' header and
            # the memory there is before anything is built; the files' hashes are verified where the weights
            # are loaded (once, on rank 0)
            ck = find_checkpoint(str(init_from), "auto", verify=False)
            vet_checkpoint(ck)
            start_model = read_config(ck)["model"]
        except (CheckpointError, OSError, KeyError, ValueError) as e:
            raise ConfigError(f"--init-from {init_from}: {e}") from e
        layers = [(k, v) for k, v in layers if k != "model.vocab_size" or v != 0]
    # the architecture, later wins: a saved run's, the --init-from checkpoint's, presets, file, --set, flags
    arch = next((str(v) for k, v in reversed(layers) if k == "model.arch"),
                (base or {}).get("model", {}).get("arch") or start_model.get("arch") or "gpt")
    model_cls = config_class(arch) if arch in ARCHS else None
    if model_cls is None:
        raise ConfigError(f"model.arch = {arch!r} is not one of {tuple(ARCHS)}; set --arch or a preset")
    own = {f.name for f in fields(model_cls)}
    sections = {"model": model_cls, "train": TrainConfig}
    values = {sec: {f.name: f.default for f in fields(cls)} for sec, cls in sections.items()}
    if base:  # a saved config: keys this version retired are dropped (their replacement keeps its default)
        for sec in SECTIONS:
            values[sec].update({k: _coerce(f"{sec}.{k}", v, v) if isinstance(v, bool) else v
                                for k, v in base.get(sec, {}).items() if f"{sec}.{k}" not in RETIRED})
    values["model"].update(start_model)
    foreign = sorted({k for k, _ in layers if k.startswith("model.") and k.split(".", 1)[1] not in own})
    if foreign:
        raise ConfigError(f"{', '.join(foreign)}: not settings of model.arch = {arch!r} (its keys: "
                          f"{sorted(own)}); drop them, or choose the architecture that has them (--arch, or "
                          "a preset of it)")
    stage = next((v for k, v in reversed(layers) if k == "train.stage"), values["train"]["stage"])
    if stage not in STAGE:
        raise ConfigError(f"train.stage = {stage!r} is not one of {STAGES}; set --stage")
    if stage not in tables["stage"]:  # a stage added to STAGE_TABLE without its defaults
        raise ConfigError(f"train.stage = {stage!r} is a stage of config.py's STAGE_TABLE, but "
                          f"codeforge/presets/stages.toml has no [{stage}] section for its defaults; add one "
                          f"(an empty [{stage}] table keeps the declared defaults)")
    if not base:  # a resumed run keeps its saved values; the stage's defaults came in when it started
        layers = [(f"train.{k}", v) for k, v in tables["stage"][stage].items()] + layers
    for key, v in layers:
        sec, name = key.split(".")
        default = next(f.default for f in fields(sections[sec]) if f.name == name)
        values[sec][name] = _coerce(key, v, default)
    # one spelling of a set of layer names, so a resume that lists them in another order is the same run
    targets = values["train"].get("lora_targets")
    if isinstance(targets, str):
        values["train"]["lora_targets"] = ",".join(sorted({x.strip() for x in targets.split(",")
                                                           if x.strip()}))
    try:
        cfg = RunConfig(model_cls.from_dict(values["model"]), TrainConfig(**values["train"]))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"saved or given config: {e}") from e
    return cfg.validate()


def dumps_toml(d: dict) -> str:
    """TOML for a dict of tables of scalars (what RunConfig holds)."""
    def val(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, float) and (math.isinf(v) or math.isnan(v)):
            raise ConfigError(f"cannot save non-finite value {v}")
        if isinstance(v, (int, float)):
            return repr(v)
        return json.dumps(str(v))
    lines = []
    for table, kv in d.items():
        lines.append(f"[{table}]")
        lines += [f"{k} = {val(v)}" for k, v in kv.items()]
        lines.append("")
    return "\n".join(lines)
