"""The start of every training run, written once: each stage file calls these in order and then reads
straight down (data -> model -> loss and evaluation -> Trainer).

    launch(cfg, log)              device and precision (said once), the process group under torchrun, a `say`
                                  only rank 0 speaks through, and what the run holds (the run lock)
    vocabulary(cfg, ...)          cfg with the vocabulary from the tokenizer (a new config: nothing is changed
                                  in place)
    begin(run, cfg, ...)          validation, the run lock, the run's recorded configuration, and the
                                  checkpoint a --resume continues (checked, and the accumulation kept or
                                  refused on another number of ranks): a frozen Began (cfg, record, start)
    built(cfg)                    the model, seeded by train.seed (on the meta device for FSDP's other ranks)
    init_from(...)                --init-from: the starting weights, checked against this model
    adapters(...)                 --lora-rank: LoRA adapters on the starting weights, the rest frozen
    record_documents(run, ...)    RUN/trained_documents.*: what the run trains on, with what its starting runs
                                  trained on
    budget(...)                   the number of optimizer steps: max_iters, else max_tokens, else epochs
    sized_evaluation(...)         fewer validation tokens for a run too short to pay for --eval-tokens
    train(run, began, ...)        the one Trainer, handed the run and begin's result, run to the end
    start_point(cfg, say)         (preference and RL stages) the run --init-from names, which they continue
    frozen_copy(...)              (preference and RL stages) the reference model, never trained

What a stage is (chat or not, FSDP or not, its data, what a change of ranks does) is config.py's stage table.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from .. import checkpoint as ckpt_io
from .. import rundir
from ..config import FSDP_STAGES, STAGE, ConfigError, RunConfig
from ..data.trained import record_trained, recorded
from ..device import choose_device, choose_precision
from ..distributed import (distributed_env, found_by_rank0, launched_by_torchrun, setup_distributed,
                           teardown_distributed)
from ..evaluation.lm import sized_eval_tokens
from ..models import build_model, lora
from ..tokenizer import CodeTokenizer
from ..train.resume import check_resume
from ..train.trainer import Trainer


def round_up(n: int, k: int) -> int:
    return (n + k - 1) // k * k


@dataclass
class Run:
    """What launch() hands a stage's body: who speaks, where it runs, this rank and how many there are, and
    the stack the run holds things in for as long as it lasts."""
    cfg: RunConfig
    say: Callable[[str], None]
    device: torch.device
    precision: str
    rank: int
    world: int
    held: contextlib.ExitStack

    @property
    def dir(self) -> Path:
        return Path(self.cfg.train.out)


@contextlib.contextmanager
def launch(cfg: RunConfig, log) -> Iterator[Run]:
    """The preamble every stage shares, as `with launch(cfg, log) as run:`: the device and precision (said
    once), the process group under torchrun (alive exactly as long as the block), a `say` that only rank 0
    speaks through, and an ExitStack for what the run holds (the run-directory lock)."""
    t = cfg.train
    device, why_dev = choose_device(t.device, t.threads or None)
    precision, why_prec = choose_precision(device, t.precision)
    rank, world = distributed_env()
    if t.parallel == "fsdp" and not STAGE[t.stage].fsdp and (world > 1 or launched_by_torchrun()):
        raise ConfigError(f"--parallel fsdp is for the language-model stages ({', '.join(FSDP_STAGES)}); "
                          f"--stage {t.stage} builds extra models (reference, reward, value) beside the "
                          "trained one and runs with --parallel ddp")
    setup_distributed(device, t.dist_timeout, alone=t.parallel == "fsdp")
    try:
        say = log if rank == 0 else (lambda m: None)
        say(f"device: {device} ({why_dev}); precision: {precision} ({why_prec})")
        with contextlib.ExitStack() as held:
            yield Run(cfg, say, device, precision, rank, world, held)
    finally:
        teardown_distributed()


def check_init_from(init_from: str) -> None:
    if init_from and not Path(init_from).exists():
        raise ConfigError(f"--init-from {init_from} does not exist: pass a run directory (from `codeforge "
                          f"train --out`) or one of its checkpoints")


def vocabulary(cfg: RunConfig, tok: CodeTokenizer, source: str) -> RunConfig:
    """cfg with model.vocab_size from the tokenizer when it is 0 (padded to a multiple of 64 for fast
    matmuls); a set one smaller than the tokenizer's vocabulary is refused. source: where the tokenizer came
    from."""
    m = cfg.model
    if m.vocab_size == 0:
        return replace(cfg, model=replace(m, vocab_size=round_up(tok.vocab_size, 64)))
    if m.vocab_size < tok.vocab_size:
        raise ConfigError(f"model.vocab_size = {m.vocab_size} is smaller than the tokenizer's vocabulary "
                          f"({tok.vocab_size}); drop --vocab-size to take it from the {source}")
    return cfg


def resume_point(run_dir: Path, resume: bool, model_dict: dict, tok_hash: str, data, run_config: dict, say,
                 other_ranks: str = "rescale") -> tuple[Path | None, int]:
    """(the checkpoint a --resume continues from (None: start fresh), the gradient accumulation to train
    with), checked against this run's model shape, tokenizer, data and fixed settings; without --resume, a
    run directory that already holds checkpoints is refused (nothing is overwritten)."""
    start = None
    accum = run_config["train"]["grad_accum_steps"]
    if resume:
        def newest() -> Path | None:
            try:  # the newest intact checkpoint (a damaged newer one is named and skipped)
                return ckpt_io.find_checkpoint(run_dir, "latest", train_state=True, log=say)
            except ckpt_io.NoCheckpointError:
                say(f"--resume: no checkpoint in {run_dir} yet; starting fresh")
                return None
        start = found_by_rank0(newest)
    elif (run_dir / rundir.CHECKPOINTS).exists() and any((run_dir / rundir.CHECKPOINTS).iterdir()):
        raise ConfigError(f"{run_dir} already holds a training run; pass --resume to continue it, or "
                          f"choose another --out (nothing was changed)")
    if start is not None:
        ckpt_io.check_compatible(start, model_dict, tok_hash, "--resume", data)
        notes, accum = check_resume(start, run_config, other_ranks)
        for note in notes:
            say(f"--resume: {note}")
    return start, accum


@dataclass(frozen=True)
class Began:
    """What begin() hands a stage's body: the configuration the run trains with (a new RunConfig, never the
    one it was given changed), the configuration recorded with every checkpoint, and the checkpoint --resume
    continues (None: a fresh start)."""
    cfg: RunConfig
    record: dict
    start: Path | None


def begin(run: Run, cfg: RunConfig, resume: bool, tok: CodeTokenizer, data_identity: dict, **record) -> Began:
    """The run's start after its data is read: validate `cfg` (the run's, as the stage derived it: the
    vocabulary from the tokenizer, a reward model's head), take the run lock (rank 0 holds it for all ranks),
    the configuration recorded with every checkpoint (plus `record`: "chat" for the stages that continue a
    run), and the checkpoint --resume continues, if any. On a resume on another number of ranks the
    accumulation the resume policy chose becomes the run's."""
    cfg.validate()
    if run.rank == 0:
        run.held.enter_context(rundir.run_lock(run.dir))
    run_config = {**cfg.to_dict(), "tokenizer_hash": tok.hash, **record, "data_identity": data_identity,
                  "world_size": run.world}
    start, accum = resume_point(run.dir, resume, cfg.model.to_dict(), tok.hash, cfg.train.data, run_config,
                                run.say, STAGE[cfg.train.stage].other_ranks)
    if accum != cfg.train.grad_accum_steps:  # resumed on another number of ranks: the global batch is kept
        cfg = replace(cfg, train=replace(cfg.train, grad_accum_steps=accum))
        run_config["train"]["grad_accum_steps"] = accum
    return Began(cfg, run_config, start)


def record_documents(run: Run, began: Began, data: str | None = None, started_from: str | None = None, *,
                     also_from: tuple[str, ...] = (), unknown: tuple[str, ...] = ()) -> None:
    """Write what this run trains on (data/trained.py): the training split of `data` (prepared shards; None
    for a stage whose data has no document keys, which says why in `unknown`), with what the runs it starts
    from trained on. Once: at a fresh start, or on a resume that finds no intact record (rank 0 writes it).
    An incomplete record is said, so a later score that cannot be called held-out is no surprise."""
    if run.rank != 0 or (began.start is not None and recorded(run.dir)):
        return
    r = record_trained(run.dir, data, started_from, also_from=also_from, unknown=unknown)
    if not r.complete:
        run.say(f"note: recorded {len(r.keys):,} trained document(s) in {run.dir / rundir.TRAINED}, but not "
                f"everything the model has seen: {r.unknown}. `codeforge eval --repo` leaves the recorded "
                f"files out and does not call its score held-out")


def built(cfg: RunConfig, on_meta: bool = False) -> torch.nn.Module:
    """The model, seeded by train.seed so every rank and every resume builds the same one (on the meta
    device when another rank's weights will fill it: FSDP's ranks other than 0)."""
    torch.manual_seed(cfg.train.seed)
    with torch.device("meta") if on_meta else contextlib.nullcontext():
        return build_model(cfg.model)


def init_from(run: Run, model: torch.nn.Module, tok: CodeTokenizer, ck: Path | None = None, load: bool = True,
              new_ok: tuple[str, ...] = (), arch: str | None = None, why: str = "") -> Path:
    """--init-from: the checkpoint (found once, on rank 0; `ck` when the stage found it already) checked
    against this model's shape and tokenizer, and its weights loaded (load=False: this rank's come from rank
    0 later). new_ok: parameters the checkpoint may lack (a new head); arch: the saved model's arch when it
    differs from this one's (a reward model starts from a GPT). Returns the checkpoint."""
    t = run.cfg.train
    ck = ck or found_by_rank0(lambda: ckpt_io.find_checkpoint(t.init_from, "auto", log=run.say))
    model_dict = run.cfg.model.to_dict()
    ckpt_io.check_compatible(ck, {**model_dict, "arch": arch} if arch else model_dict, tok.hash,
                             "--init-from", t.data)
    if load:
        ckpt_io.load_weights(model, ck, new_ok=new_ok)
    run.say(f"initialised weights from {ck}{why}")
    return ck


def adapters(run: Run, model: torch.nn.Module, run_config: dict, start_ckpt: Path | None, began: Path | None,
             mode: str) -> None:
    """--lora-rank: LoRA adapters on the starting weights, the rest frozen (models/lora.py). The starting
    checkpoint (`began`, the one --init-from loaded) is recorded in the run's config with its weights' sha256;
    a --resume loads that very checkpoint again (refused if it is gone or changed), and the Trainer then the
    adapters saved beside the merged weights."""
    t = run.cfg.train
    if not t.init_from:
        raise ConfigError("--lora-rank trains adapters on trained weights: pass --init-from RUN (a codeforge "
                          "run, or a Hugging Face model brought in with `codeforge import --hf DIR`)")
    if mode == "fsdp":
        raise ConfigError("--lora-rank trains with --parallel ddp (or one process): the adapters are small, "
                          "and the frozen weights are not sharded; a model too large for one device is not "
                          "LoRA-trained here yet")
    if start_ckpt is not None:  # resume: the same starting weights as the straight run
        saved = ckpt_io.read_config(start_ckpt).get("lora_base") or {}
        if not saved:
            raise ConfigError(f"--resume {start_ckpt}: that checkpoint was not written by a LoRA run, so "
                              f"there are no adapters to go on with; drop --lora-rank, or start a new run")
        began = Path(saved["checkpoint"])
        # the manifest's hashes are checked against the files first, so the recorded sha256 can be trusted
        problem = ckpt_io.verify_checkpoint(began, train_state=False) if began.is_dir() else "it is gone"
        sha = None if problem else ckpt_io.weights_sha256(began)
        if sha != saved.get("sha256"):
            raise ConfigError(f"--resume {start_ckpt}: the LoRA run started from {began}, and "
                              f"{problem or 'its weights changed since'}; the adapters mean something only "
                              "on those weights. Restore that checkpoint, or start a new run from this one's "
                              f"merged weights (--init-from {start_ckpt})")
        ckpt_io.load_weights(model, began)
    sha = ckpt_io.weights_sha256(began)
    if sha is None:
        raise ConfigError(f"--lora-rank starts from a whole-model checkpoint (model.safetensors); {began} is "
                          "sharded (an FSDP run's): export it (`codeforge export --format hf`) and import it "
                          "back (`codeforge import --hf`), then start from that")
    run_config["lora_base"] = {"checkpoint": str(began.resolve()), "sha256": sha}
    targets = [x.strip() for x in t.lora_targets.split(",") if x.strip()]
    try:
        lora.attach(model, t.lora_rank, t.lora_alpha, t.lora_dropout, targets)
    except lora.LoraError as e:
        raise ConfigError(str(e)) from e
    trainable, total = lora.counts(model)
    run.say(f"LoRA: rank {t.lora_rank}, alpha {t.lora_alpha:g} on {', '.join(targets)}: {trainable:,} "
            f"trainable parameters of {total:,} ({trainable / total:.2%}); the starting weights are frozen")


def train(run: Run, began: Began, model: torch.nn.Module, batches, loss_fn, *, total_steps: int,
          tokens_per_step: int, tok: CodeTokenizer, **parts) -> dict:
    """The one Trainer over a stage's parts, handed the run (device, precision, ranks, the run directory, who
    speaks) and begin's result (the config it trains with, the record saved with checkpoints, the resume
    point); `parts`: the Trainer's optional ones (evaluate, sample, aux, mode). Returns Trainer.run()'s
    summary."""
    trainer = Trainer(model, batches, loss_fn, began.cfg.train, run.dir, device=run.device,
                      precision=run.precision,
                      total_steps=total_steps, tokens_per_step=tokens_per_step, run_config=began.record,
                      assets={"tokenizer": tok.path}, start_checkpoint=began.start, rank=run.rank,
                      world=run.world, log=run.say, **parts)
    try:
        return trainer.run()
    finally:
        close = getattr(batches, "close", None)  # a Prefetcher's thread
        if callable(close):
            close()


def budget(cfg: RunConfig, tokens_per_step: int, epoch_steps: int) -> int:
    """Optimizer steps of the run: train.max_iters when set, else train.max_tokens over the tokens a step
    reads, else `epoch_steps` (the stage's steps for train.epochs, 1 by default, of its data)."""
    t = cfg.train
    if t.max_iters:
        return t.max_iters
    if t.max_tokens:
        return math.ceil(t.max_tokens / tokens_per_step)
    return epoch_steps


def sized_evaluation(began: Began, tokens_per_step: int, total: int, say) -> Began:
    """Fewer validation tokens for a run too short to pay for --eval-tokens (evaluation/lm.py's rule): said,
    and returned in a new Began whose config and record (saved with the run, so `codeforge eval` scores the
    same) carry the count."""
    t = began.cfg.train
    evaluations = (total // t.eval_every if t.eval_every else 0) + 1
    sized = sized_eval_tokens(t.eval_tokens, tokens_per_step * total, evaluations)
    if sized != t.eval_tokens:
        say(f"evaluation: up to {sized:,} validation tokens each (of --eval-tokens {t.eval_tokens:,}): a run "
            f"of {total} steps x {tokens_per_step:,} tokens with {evaluations} evaluation(s) scores an "
            "eighth of what it trains on; saved as eval_tokens in config.toml")
        record = {**began.record, "train": {**began.record["train"], "eval_tokens": sized},
                  "eval_tokens_asked": t.eval_tokens}  # what --resume compares a re-run's --eval-tokens with
        return Began(replace(began.cfg, train=replace(t, eval_tokens=sized)), record, began.start)
    return began


# -- the stages that continue a trained run (preference and RL) ---------------------------------------

def start_point(cfg: RunConfig, say) -> tuple[CodeTokenizer, Path, dict]:
    """(tokenizer, checkpoint, its saved config) of the run --init-from names: these stages continue one."""
    t = cfg.train
    if not t.init_from:
        raise ConfigError(f"--stage {t.stage} continues a trained model: pass --init-from RUN (a chat run "
                          f"from --stage sft, or any GPT run)")
    check_init_from(t.init_from)
    ck = found_by_rank0(lambda: ckpt_io.find_checkpoint(t.init_from, "auto", log=say))
    saved = ckpt_io.read_config(ck)
    if saved["model"].get("arch", "gpt") != "gpt":
        raise ConfigError(f"--init-from {ck}: a {saved['model']['arch']} model; --stage {t.stage} trains a "
                          f"GPT (an SFT run, usually)")
    tok = CodeTokenizer.load(ck / "tokenizer")
    return tok, ck, saved


def frozen_copy(model_cfg, ck: Path, device: torch.device) -> torch.nn.Module:
    """The reference model: the starting checkpoint, in eval mode, never trained."""
    ref = build_model(model_cfg)
    ckpt_io.load_weights(ref, ck)
    ref.to(device).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref
