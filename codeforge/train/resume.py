"""The resume policy: what a --resume may change (and what it then says), what it refuses with the diff, the
training data's identity, and a resume on another number of ranks (the global batch kept, or refused)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ..checkpoint import STATE_JSON, read_config
from ..checkpoint.state import check_loader, loader_state
from ..config import STAGE
from ..fields import ConfigError


# The saved optimizer state and data cursor mean something only with these unchanged: the cursor counts
# batches of this size in this seed's order of this data; the optimizer's saved param groups carry its
# betas and weight decay (they would silently override new ones).
# muon_*: the optimizer state restores its groups' rate ratio, momentum and decay, so a change would not apply
RESUME_FIXED = ("stage", "batch_size", "grad_accum_steps", "seed", "optimizer", "weight_decay", "beta1",
                "beta2", "fim_rate", "fim_spm_rate", "muon_lr", "muon_momentum", "muon_weight_decay",
                "lora_rank", "lora_alpha", "lora_targets")  # lora_*: the adapters' shapes and scale


# Applied step by step from the configuration, so a change takes effect from the resumed step on; the run is
# then no longer the one a straight run would give, which --resume says.
RESUME_NOTED = ("learning_rate", "min_lr_ratio", "schedule", "warmup_steps", "decay_fraction", "grad_clip",
                "precision", "eval_tokens", "lora_dropout")


# The budget: extending a run is what --resume is for; only the schedule's shape follows it.
RESUME_BUDGET = ("max_iters", "max_tokens", "epochs")


def jsonl_identity(path: str | Path, tok_hash: str, names: tuple[str, ...] = ("train.jsonl",)) -> dict:
    """data_identity for stages that read JSONL (hrm, reward, dpo, ppo, grpo): the size and sha256 of the
    file, or of the named files in a directory, so --resume refuses other data."""
    p = Path(path)
    files = [p] if p.is_file() else [p / n for n in names if (p / n).is_file()]
    return {"tokenizer_hash": tok_hash, "chat": False, "tokens": None, "documents": None,
            "files": {f.name: f"{f.stat().st_size} bytes, sha256 "
                              f"{hashlib.sha256(f.read_bytes()).hexdigest()[:16]}"
                      for f in files}}


def _data_diff(saved: dict, now: dict) -> list[str]:
    out = [f"data {k} {saved.get(k)!r} -> {now.get(k)!r}"
           for k in ("tokenizer_hash", "chat", "tokens", "documents") if saved.get(k) != now.get(k)]
    a, b = saved.get("files", {}), now.get("files", {})
    for name in sorted(set(a) | set(b)):
        if name not in b:
            out.append(f"data file {name} is gone")
        elif name not in a:
            out.append(f"data file {name} is new")
        elif a[name] != b[name]:
            out.append(f"data file {name} changed ({a[name]} -> {b[name]})")
    return out


def check_resume(ck: Path, run_config: dict, other_ranks: str = "rescale") -> tuple[list[str], int]:
    """Compare the run about to resume with the one saved in checkpoint `ck`. Raises ConfigError listing every
    difference that breaks the saved state (RESUME_FIXED, the training data); returns (notes for the settings
    that take effect from here on (RESUME_NOTED, dropout), the gradient accumulation to train with).

    On another number of ranks (`world_size`), other_ranks says what the stage's batches allow (config.py's
    stage table): "rescale" keeps the global batch by scaling the accumulation, which is then not the one
    asked for; "refuse": the batches depend on the ranks, so the run resumes on as many as it saved.

    The saved data cursor (train_state.json's loader) is checked too (checkpoint/state.py's check_loader):
    CheckpointError naming the file and the field when it lacks a key this stage's loader reads, holds a value
    of the wrong type or range, or points past the training data."""
    saved = read_config(ck)
    st, nt = saved.get("train", {}), run_config["train"]
    accum = nt["grad_accum_steps"]
    notes = []
    keys = RESUME_FIXED
    sw, nw = saved.get("world_size") or _saved_world(ck), run_config.get("world_size")
    chat = bool((saved.get("data_identity") or {}).get("chat"))
    moved = bool(sw and nw and sw != nw)
    refuse = chat or other_ranks == "refuse"
    if moved and "batch_size" in st and not refuse:
        keys = tuple(k for k in RESUME_FIXED if k not in ("batch_size", "grad_accum_steps"))
        said, accum = _world_change(st, nt, sw, nw)
        notes += said
    fixed = [f"train.{k} {st[k]!r} -> {nt[k]!r}" for k in keys if k in st and st[k] != nt[k]]
    if moved and chat:
        fixed.append(f"the number of ranks {sw} -> {nw} (chat batches are packed per rank from its own share "
                     f"of the conversations, so a chat run resumes on as many ranks as it was saved with)")
    elif moved and refuse:
        stage = nt.get("stage")
        fixed.append(f"the number of ranks {sw} -> {nw} (--stage {stage} deals its examples to the ranks by "
                     f"rank, and its saved cursor counts them so, so a {stage} run resumes on as many ranks "
                     f"as it was saved with: run it with {sw})")
    elif moved and "batch_size" in st:
        was, now = st["batch_size"] * st["grad_accum_steps"] * sw, nt["batch_size"] * accum * nw
        if was != now:
            fixed.append(f"the global batch {st['batch_size']} x {st['grad_accum_steps']} x {sw} rank(s) = "
                         f"{was} sequences -> {nt['batch_size']} x {accum} x {nw} = {now} (set --batch-size "
                         f"and --grad-accum-steps so that their product times {nw} ranks is {was})")
    sd, nd = saved.get("data_identity"), run_config.get("data_identity")
    if sd is None:
        notes.append(f"{ck} records no identity of its training data (older codeforge): not checked that "
                     f"{nt['data']} is the same data")
    elif nd is not None:
        fixed += _data_diff(sd, nd)
    if fixed:
        fix = ["drop the options that change them (the saved settings are in RUN/config.toml)"]
        if any(x.startswith("data") for x in fixed):
            fix.append(f"point --data at the data the run was trained on (it was {st.get('data')})")
        raise ConfigError(
            f"--resume from {ck}: this run differs from the saved one where its optimizer state and data "
            f"cursor depend on it (checkpoint -> now): {'; '.join(fixed)}. To continue that run exactly, "
            f"{' and '.join(fix)}; or start a new run from its weights with these settings: "
            f"--init-from {ck} --out NEW_RUN")
    # The data cursor, checked against this stage's loader and (packed shards) the data it will read on from:
    # a damaged one would otherwise be a KeyError or TypeError inside the loader, or silently another epoch
    if (cursor := loader_state(ck)) is not None:
        stage = STAGE.get(nt.get("stage"))
        check_loader(*cursor, ck, stage.data if stage else None, (nd or {}).get("tokens"))
    # the run sized its evaluation down from this --eval-tokens: asked again, it is sized the same again
    if nt.get("eval_tokens") == saved.get("eval_tokens_asked"):
        st = {**st, "eval_tokens": nt["eval_tokens"]}
    changed = [f"train.{k} {st[k]!r} -> {nt[k]!r}" for k in RESUME_NOTED if k in st and st[k] != nt[k]]
    sm, nm = saved.get("model", {}), run_config["model"]
    changed += [f"model.{k} {sm[k]!r} -> {nm[k]!r}" for k in sm if k.endswith("dropout")
                and sm[k] != nm.get(k)]
    if changed:
        notes.append(f"resuming with changed settings, in effect from the resumed step on (so the run is no "
                     f"longer what an uninterrupted one would give): {'; '.join(changed)}")
    budget = [f"train.{k} {st[k]!r} -> {nt[k]!r}" for k in RESUME_BUDGET if k in st and st[k] != nt[k]]
    if budget and not st.get("schedule") == nt["schedule"] == "constant":
        notes.append(f"the budget changed ({'; '.join(budget)}): the {nt['schedule']} learning-rate schedule "
                     f"runs over the new budget from the resumed step on")
    return notes, accum


def _saved_world(ck: Path) -> int | None:
    """The number of ranks a checkpoint written before config.json recorded it was trained on, from its
    loader cursor (None when unknown)."""
    try:
        w = json.loads((Path(ck) / STATE_JSON).read_text()).get("loader", {}).get("world_size")
    except (OSError, ValueError, AttributeError):
        return None
    return w if isinstance(w, int) and w > 0 else None


def _world_change(st: dict, nt: dict, sw: int, nw: int) -> tuple[list[str], int]:
    """A resume on another number of ranks keeps the global batch (sequences per optimizer step): with the
    saved batch size and accumulation unchanged, the accumulation is scaled to make up for the ranks.
    Returns (what it says, the accumulation to train with)."""
    was = st["batch_size"] * st["grad_accum_steps"] * sw
    accum = nt["grad_accum_steps"]
    same = nt["batch_size"] == st["batch_size"] and accum == st["grad_accum_steps"]
    if same and was % (nt["batch_size"] * nw) == 0:
        accum = was // (nt["batch_size"] * nw)
    if nt["batch_size"] * accum * nw != was:
        return [], accum  # check_resume refuses it, saying what to set
    return [f"resuming on {nw} rank(s), saved on {sw}: the global batch stays {was} sequences (batch "
            f"{nt['batch_size']} x accumulation {accum} x {nw} ranks) and the data continues where it "
            "stopped; what changes is how it is split over ranks, so dropout masks and the order in which "
            f"gradients are summed (float rounding) differ from a run that kept {sw} rank(s)"], accum
