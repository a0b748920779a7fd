"""Checkpoints, the format only: atomic, verified save; keep-last-N plus best and final; the compatibility
checks; loading weights, training state and a model for inference. Model-agnostic: models are built through
the registry by the saved `arch`. The resume policy is train/resume.py's; the run lock and the names under
RUN/ are rundir.py's.

- store.py  names, errors, pointers, manifest and verification, find_checkpoint, read_config, vet_checkpoint,
            check_compatible
- state.py  the training state as safetensors + JSON; RNG states; older train_state.pt read safely; its
            counters checked
- save.py   save_checkpoint, the sharded (DCP) save and its background form, keep-last-N
- load.py   load_weights, the sharded training state, load_model (inference)
- guard.py  what a file from outside may cost before anything is built from it: regular files only (read
            without blocking), links that stay inside, size caps, safetensors headers read alone, model config
            fields checked against their declarations, the memory a model needs against what there is

RUN/checkpoints/step_NNNNNN/
  model.safetensors        weights (tied tensors stored once)
  config.json              the resolved run configuration (model + train), the tokenizer hash and the
                           training data's identity (`data_identity`: see data_identity())
  train_state.safetensors  every tensor of the training state (optimizer moments, RNG states)
  train_state.json         the rest of it (step and token counters, loader cursor, scaler, Python and NumPy
                           RNG states), with {"__tensor__": key} where a tensor of the file above goes
  tokenizer/               the tokenizer, so a checkpoint alone can generate
  manifest.json            {"format", "step", "files": {relative path: {"bytes", "sha256"}}}: every file
                           above, hashed after it was written; written last
  sharded/                 instead of model.safetensors and the optimizer moments, in runs with --parallel
                           fsdp: a torch.distributed.checkpoint (DCP) directory, `.metadata` plus one
                           `__R_0.distcp` per rank, written by every rank in parallel. It holds the weights
                           ("model.*") and the optimizer state ("optim.*") by parameter name, so it loads on
                           any number of ranks (DCP reshards), on one process (resume, generate, export), and
                           into DDP. For several nodes, RUN must be on a filesystem all of them see.
RUN/checkpoints/latest, best, final   one line each: the name of a step directory
RUN/.train.lock            flock()ed by the training process for the whole run (rundir.py)

Safety. Loading a checkpoint runs no code from it: weights and state tensors are safetensors, the rest is
JSON. Nor does it cost more than the model it holds: a manifest proves only that the files are the ones it
lists (anyone can edit config.json and hash the files again), so before a model is built (load_model,
--init-from, --resume) vet_checkpoint() checks that every file is a regular one inside the checkpoint (a FIFO
would block the read forever), that every model field is in its declared range, that model.safetensors' header
holds exactly the declared model (a config that declares 24 x 4096 beside small weights is refused without
allocating it) and that the model fits in the memory there is; each refusal is one line naming the file and
the field. Checkpoints of older codeforge versions (train_state.pt, no manifest) are read with
torch.load(weights_only=True), which admits only tensors, plain values and NumPy arrays; one holding anything
else is refused, never unpickled.

Damage. A checkpoint is written to a hidden temporary directory and renamed into place, and `latest` is
replaced atomically after that, so a crash (even kill -9) never leaves a half-written checkpoint behind
`latest`; the manifest catches what the rename cannot (a truncated or changed file, a disk that lost
unsynced data). find_checkpoint() checks it before trusting a checkpoint:
  - `latest` (and `auto` when its `best` is damaged) falls back to the newest intact step and says which
    one it skipped and why; --resume then trains the skipped steps again;
  - a named checkpoint directory, `best` or `final` is refused with the reason
    (the caller asked for that one).
A checkpoint without a manifest (older codeforge) is checked as far as it can be without one: on --resume
its files must open (safetensors header, JSON, the zip CRCs of train_state.pt); elsewhere a file that does
not load is reported by name when it is loaded.

A failed write (a full disk, or any OSError) removes the unfinished checkpoint, leaves `latest` and the
earlier checkpoints as they were, and raises CheckpointWriteError saying what happened and what to do.
"""
from .load import load_model, load_sharded_state, load_weights, load_whole_into_sharded
from .save import ShardedSave, save_checkpoint, save_sharded_checkpoint
from .state import decode_state, encode_state, load_train_state, rng_state, set_rng_state
from .store import (LEGACY_STATE, MANIFEST, MANIFEST_FORMAT, POINTERS, SHARDED, STATE_JSON, STATE_TENSORS,
                    STEP_PREFIX, CheckpointError, CheckpointWriteError, NoCheckpointError, check_compatible,
                    find_checkpoint, is_sharded, latest_step, read_config, shape_diff, verify_checkpoint,
                    vet_checkpoint, weights_sha256)

__all__ = ["CheckpointError", "CheckpointWriteError", "LEGACY_STATE", "MANIFEST", "MANIFEST_FORMAT",
           "NoCheckpointError",
           "POINTERS", "SHARDED", "STATE_JSON", "STATE_TENSORS", "STEP_PREFIX", "ShardedSave",
           "check_compatible",
           "decode_state", "encode_state", "find_checkpoint", "is_sharded", "latest_step", "load_model",
           "load_sharded_state", "load_train_state", "load_weights", "load_whole_into_sharded", "read_config",
           "rng_state", "save_checkpoint", "save_sharded_checkpoint", "set_rng_state", "shape_diff",
           "verify_checkpoint", "vet_checkpoint", "weights_sha256"]
