"""Damaged runs (issue 9), through the real trainer on a tiny model: a damaged latest checkpoint is named and
skipped (resume then equals a straight run), a full disk during a save loses nothing, a second trainer on a
run directory is refused, --resume with another batch, seed or data says what differs, a tampered
training state runs no code, and nonsense in a run's own files (a step of 10^18, -5 or "x"; `model = "x"` in
config.toml) is one error line naming the file and the field."""

import errno
import json
import math
import os
import pathlib
import random
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from safetensors import SafetensorError

import codeforge.checkpoint as ckpt_io
import codeforge.checkpoint.save as ckpt_save
from codeforge import rundir
from codeforge.checkpoint import (CheckpointError, decode_state, encode_state, find_checkpoint, load_model,
                                  load_train_state, read_config, verify_checkpoint)
from codeforge.rundir import RunLockedError
from codeforge.cli import main
from codeforge.config import ConfigError
from codeforge.stages import run as run_stage
from codeforge.train.trainer import TrainingError
from test_trainer import cfg_for, losses, train_run

CONST = {"train__schedule": "constant",  # the learning rate does not depend on the budget: 8 + 4 steps == 12
         "train__eval_every": 4}  # evaluated where saved, so an improving evaluation adds no checkpoint
CPU = torch.device("cpu")


def damage(f: pathlib.Path, how: str) -> None:
    b = bytearray(f.read_bytes())
    if how == "truncate":
        f.write_bytes(b[:len(b) // 2])
    else:  # one flipped byte, same size: only the sha256 can tell
        b[len(b) // 2] ^= 0xFF
        f.write_bytes(bytes(b))


@pytest.fixture(scope="module")
def straight12(data_dir, tmp_path_factory):
    """Losses of an uninterrupted 12-step run: what every resumed run below must reproduce bit for bit."""
    out = tmp_path_factory.mktemp("straight") / "r"
    train_run(cfg_for(data_dir, out, train__max_iters=12, **CONST))
    return losses(out)


@pytest.mark.parametrize("victim,how",
                         [("train_state.safetensors", "truncate"), ("model.safetensors", "flip"),
                                        ("train_state.json", "flip")])
def test_resume_skips_damaged_latest_and_equals_straight(data_dir, tmp_path, straight12, victim, how):
    run = tmp_path / "r"
    # saves steps 4 and 8 (and 5 if it was best)
    train_run(cfg_for(data_dir, run, train__max_iters=8, **CONST))
    ck8 = run / "checkpoints" / "step_000008"
    before = sorted(p.name for p in (run / "checkpoints").glob("step_*"))[-2]  # the newest one before step 8
    damage(ck8 / victim, how)
    assert victim in verify_checkpoint(ck8)
    msgs = []
    run_stage(cfg_for(data_dir, run, train__max_iters=12, **CONST), resume=True, log=msgs.append)
    text = "\n".join(msgs)
    assert f"{ck8} is damaged: {victim}" in text and f"using {before}, the newest intact checkpoint" in text
    assert "resumed from" in text and f"{before} at step {int(before[5:])}" in text
    resumed = losses(run)
    assert sorted(resumed) == sorted(straight12) == list(range(1, 13))
    assert all(resumed[s] == straight12[s] for s in straight12)
    assert verify_checkpoint(ck8) is None  # saved again by the resumed run


def test_damaged_checkpoints_for_inference(data_dir, tmp_path, capsys):
    run = tmp_path / "r"
    # evaluated and saved at 4 and 8
    train_run(cfg_for(data_dir, run, train__max_iters=8, train__eval_every=4))
    root = run / "checkpoints"
    ck4, ck8 = root / "step_000004", root / "step_000008"
    assert (root / "final").read_text().strip() == "step_000008"
    damage(ck8 / "model.safetensors", "truncate")
    capsys.readouterr()
    # latest and auto fall back to the newest intact checkpoint, saying which was skipped and why
    for which in ("latest", "auto"):
        _, _, ck, _ = load_model(run, CPU, which)
        assert ck == ck4
        err = capsys.readouterr().err
        assert "warning:" in err and str(ck8) in err and "model.safetensors is" in err and "truncated" in err
    # a checkpoint asked for by name is refused, not swapped
    with pytest.raises(CheckpointError,
                       match=r"'final' checkpoint .*step_000008 is damaged: model.safetensors"):
        find_checkpoint(run, "final")
    with pytest.raises(CheckpointError, match=r"checkpoint .*step_000008 is damaged: model.safetensors is"):
        load_model(ck8, CPU)
    assert main(["generate", "--run", str(run), "--checkpoint", "final", "--prompt", "x"]) == 2
    assert "is damaged" in capsys.readouterr().err
    assert main(["generate", "--run", str(run), "--prompt", "def", "--max-new-tokens", "4"]) == 0
    assert "step_000008 is damaged" in capsys.readouterr().err
    # a damaged training state does not matter to generation, only to --resume
    damage(ck4 / "train_state.safetensors", "flip")
    assert find_checkpoint(ck4) == ck4
    with pytest.raises(CheckpointError, match="train_state.safetensors does not match the sha256"):
        find_checkpoint(ck4, train_state=True)
    # nothing intact: a clear error, and --resume does not quietly start over
    with pytest.raises(CheckpointError, match=r"no intact checkpoint in .*step_000008: .*step_000004: "):
        find_checkpoint(run, train_state=True)
    with pytest.raises(CheckpointError, match="no intact checkpoint"):
        train_run(cfg_for(data_dir, run, train__max_iters=12), resume=True)
    assert sorted(p.name for p in root.iterdir()) == ["best", "final", "latest", "step_000004", "step_000008"]


def test_a_directory_holding_runs_names_them(tmp_path, capsys):
    """`codeforge eval/generate --run DIR` on a quickstart's directory (DIR/run, DIR/base hold the runs) said
    "train first"; it names the runs inside instead."""
    qs = tmp_path / "qs"
    for name in ("base", "run"):
        (qs / name / "checkpoints" / "step_000004").mkdir(parents=True)
    (qs / "data").mkdir()
    with pytest.raises(ckpt_io.NoCheckpointError, match=r"holds runs: pass .*qs/base or .*/run"):
        find_checkpoint(qs)
    assert main(["generate", "--run", str(qs), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert f"{qs / 'run'}" in err and "train first" not in err
    with pytest.raises(ckpt_io.NoCheckpointError, match="train first"):  # an empty directory: as before
        find_checkpoint(qs / "data")


@pytest.mark.parametrize("error", ["OSError", "SafetensorError"])
def test_disk_full_during_save_loses_nothing(data_dir, tmp_path, monkeypatch, straight12, error):
    real = ckpt_save.st_save_file
    calls = []

    def disk_fills_up(tensors, filename, *a, **k):
        """The second checkpoint's training state gets half written, then the disk is full."""
        calls.append(filename)
        real(tensors, filename, *a, **k)
        if len(calls) == 2:
            damage(pathlib.Path(filename), "truncate")
            if error == "OSError":
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), filename)
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(ckpt_save, "st_save_file", disk_fills_up)
    run = tmp_path / "r"
    root = run / "checkpoints"
    with pytest.raises(TrainingError) as e:
        train_run(cfg_for(data_dir, run, train__max_iters=12, **CONST))
    msg = str(e.value)
    assert msg.startswith(f"training stopped at step 8: could not write checkpoint step_000008 in {root}: "
                          f"the disk is full")
    assert "needs about" in msg and "MiB are free there" in msg
    assert "the unfinished step_000008 was removed, `latest` still names step_000004" in msg
    assert "then continue with --resume" in msg
    # no staging directory left
    assert sorted(p.name for p in root.iterdir()) == ["best", "latest", "step_000004"]
    assert verify_checkpoint(root / "step_000004") is None
    monkeypatch.setattr(ckpt_save, "st_save_file", real)
    train_run(cfg_for(data_dir, run, train__max_iters=12, **CONST), resume=True)
    resumed = losses(run)
    assert sorted(resumed) == list(range(1, 13)) and all(resumed[s] == straight12[s] for s in straight12)


def test_disk_full_on_the_command_line_is_a_message(data_dir, tmp_path, monkeypatch, capsys):
    def full(tensors, filename, *a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), filename)

    monkeypatch.setattr(ckpt_save, "st_save_file", full)
    out = tmp_path / "r"
    assert main(["train", "--data", str(data_dir), "--out", str(out), "--n-layer", "1", "--n-head", "2",
                 "--n-embd", "32", "--block-size", "32", "--batch-size", "2", "--max-iters", "2",
                 "--eval-every", "0", "--device", "cpu", "--no-progress", "--no-tensorboard"]) == 2
    err = capsys.readouterr().err
    assert "\nerror: training stopped at step 2: could not write checkpoint step_000002" in err
    assert "the disk is full" in err and "there was no earlier checkpoint" in err and "Traceback" not in err
    assert [p.name for p in (out / "checkpoints").iterdir()] == []


def test_second_trainer_on_a_run_is_refused(data_dir, tmp_path):
    run = tmp_path / "r"
    first = subprocess.Popen([sys.executable, "-m", "codeforge", "train", "--data", str(data_dir), "--out",
                              str(run),
                              "--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--block-size", "32",
                              "--batch-size", "2", "--max-iters", "1000000", "--eval-every", "0",
                              "--save-every", "0", "--device", "cpu", "--no-progress", "--no-tensorboard"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        lock = run / rundir.LOCK_FILE
        deadline = time.time() + 120
        while time.time() < deadline and first.poll() is None:
            try:
                if json.loads(lock.read_text())["pid"] == first.pid:
                    break
            except (OSError, ValueError, KeyError):
                pass
            time.sleep(0.05)
        assert first.poll() is None, "the first trainer exited early"
        with pytest.raises(RunLockedError,
                           match=rf"{run} is in use by another training process \(PID {first.pid} on"):
            train_run(cfg_for(data_dir, run, train__max_iters=2), resume=True)
    finally:
        first.kill()  # SIGKILL: no clean-up code runs, the kernel frees the lock
        first.wait()
    r = train_run(cfg_for(data_dir, run, train__max_iters=2), resume=True)
    assert r["step"] == 2
    with rundir.run_lock(run):  # released at the end of a run in this process too
        pass


def test_resume_refuses_other_batch_seed_or_data(data_dir, tmp_path):
    run = tmp_path / "r"
    train_run(cfg_for(data_dir, run, train__max_iters=4))
    latest = (run / "checkpoints" / "latest").read_text()
    with pytest.raises(ConfigError) as e:
        train_run(cfg_for(data_dir, run, train__max_iters=8, train__batch_size=8, train__seed=7), resume=True)
    msg = str(e.value)
    assert "train.batch_size 4 -> 8" in msg and "train.seed 1337 -> 7" in msg and "grad_accum" not in msg
    assert "drop the options that change them" in msg and "--init-from" in msg and "--out NEW_RUN" in msg
    other = tmp_path / "other"
    shutil.copytree(data_dir, other)
    damage(other / "train_000000.bin", "flip")
    with pytest.raises(ConfigError, match=rf"data file train_000000.bin changed .*it was {data_dir}\)"):
        train_run(cfg_for(other, run, train__max_iters=8), resume=True)
    assert (run / "checkpoints" / "latest").read_text() == latest  # nothing was changed
    # the same data elsewhere, and a new learning rate: continues, and says the rate changed from here on
    moved = tmp_path / "moved"
    shutil.copytree(data_dir, moved)
    msgs = []
    r = run_stage(cfg_for(moved, run, train__max_iters=6, train__learning_rate=1e-3), resume=True,
                  log=msgs.append)
    assert r["step"] == 6
    assert any("in effect from the resumed step on" in m and "train.learning_rate 0.003 -> 0.001" in m
               for m in msgs)


def test_resume_compares_the_asked_eval_tokens_not_the_sized_ones(data_dir, tmp_path):
    """A short run sizes its evaluation down from --eval-tokens and saves the sized number; re-running it with
    the same --eval-tokens (as a re-run quickstart does) changes nothing, so --resume says nothing changed. A
    different --eval-tokens is still said."""
    run = tmp_path / "r"
    msgs = []
    run_stage(cfg_for(data_dir, run, train__max_iters=2, train__eval_tokens=1 << 20), log=msgs.append)
    assert any("saved as eval_tokens" in m for m in msgs)  # sized down
    msgs.clear()
    run_stage(cfg_for(data_dir, run, train__max_iters=3, train__eval_tokens=1 << 20), resume=True,
              log=msgs.append)
    assert not [m for m in msgs if "changed settings" in m], msgs
    sized = read_config(find_checkpoint(run, "latest"))
    sized = sized["train"]["eval_tokens"]
    assert sized < 1 << 20
    run_stage(cfg_for(data_dir, run, train__max_iters=3, train__eval_tokens=sized), resume=True,
              log=msgs.append)
    assert not [m for m in msgs if "changed settings" in m], msgs  # the number config.toml holds: the same
    msgs.clear()
    run_stage(cfg_for(data_dir, run, train__max_iters=4, train__eval_tokens=100), resume=True,
              log=msgs.append)
    assert any("changed settings" in m and f"train.eval_tokens {sized} -> 100" in m for m in msgs), msgs


class Touch:
    """Unpickling this creates a file: what a tampered pickle could do (here harmlessly)."""

    def __init__(self, path):
        self.path = pathlib.Path(path)

    def __reduce__(self):
        return pathlib.Path.touch, (self.path,)


def as_older_codeforge(ck: pathlib.Path, state: dict) -> None:
    """What codeforge wrote before the manifest: the training state as one pickle, no data identity."""
    for f in (ckpt_io.MANIFEST, ckpt_io.STATE_JSON, ckpt_io.STATE_TENSORS):
        (ck / f).unlink()
    torch.save(state, ck / ckpt_io.LEGACY_STATE)
    cfg = json.loads((ck / "config.json").read_text())
    del cfg["data_identity"]
    (ck / "config.json").write_text(json.dumps(cfg))


def test_tampered_train_state_runs_no_code(data_dir, tmp_path):
    run = tmp_path / "r"
    train_run(cfg_for(data_dir, run, train__max_iters=4))
    ck = run / "checkpoints" / "step_000004"
    marker = tmp_path / "code-ran"
    # beside a checkpoint of this version a pickle is never read
    torch.save({"step": Touch(marker)}, ck / ckpt_io.LEGACY_STATE)
    assert load_train_state(ck)["step"] == 4 and not marker.exists()
    # an older-format checkpoint whose pickle calls a function: refused, not run
    as_older_codeforge(ck, {**load_train_state(ck), "loader": Touch(marker)})
    with pytest.raises(CheckpointError, match=r"holds more than tensors and plain values \(it names .*pathlib"
                                              r".*would run code from the file, "
                                              r"so it was not loaded.*--init-from"):
        train_run(cfg_for(data_dir, run, train__max_iters=8), resume=True)
    assert not marker.exists()


def test_older_checkpoints_resume_exactly_and_damage_is_caught(data_dir, tmp_path, straight12):
    run = tmp_path / "r"
    train_run(cfg_for(data_dir, run, train__max_iters=8, **CONST))
    root = run / "checkpoints"
    for ck in (root / "step_000004", root / "step_000008"):
        as_older_codeforge(ck, load_train_state(ck))
    damage(root / "step_000008" / ckpt_io.LEGACY_STATE, "truncate")
    msgs = []
    run_stage(cfg_for(data_dir, run, train__max_iters=12, **CONST), resume=True, log=msgs.append)
    text = "\n".join(msgs)
    assert "step_000008 is damaged: train_state.pt is unreadable" in text and "using step_000004" in text
    assert "records no identity of its training data" in text
    resumed = losses(run)
    assert sorted(resumed) == list(range(1, 13)) and all(resumed[s] == straight12[s] for s in straight12)


def test_state_encoding_round_trips_exactly_and_refuses_objects():
    t = torch.randn(3, 2)
    state = {"optimizer": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": t}, 1: {}},
                           "param_groups": [{"betas": (0.9, 0.95), "params": [0, 1], "eps": 1e-8}]},
             "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
                     "python": random.getstate()},
             "shared": [t, t[1:]], "empty": torch.zeros(0, 2), "best_val": math.inf, "last_val": None,
             "np_scalar": np.int64(7), "looks_tagged": {"__tensor__": "x"}, "bf16": t.to(torch.bfloat16)}
    skeleton, tensors = encode_state(state)
    back = decode_state(json.loads(json.dumps(skeleton)), tensors)
    assert back["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.95)
    assert torch.equal(back["optimizer"]["state"][0]["exp_avg"], t) and back["optimizer"]["state"][1] == {}
    assert (
        torch.equal(back["rng"]["torch"], state["rng"]["torch"])
        and back["rng"]["python"] == random.getstate()
    )
    n0, n1 = back["rng"]["numpy"], state["rng"]["numpy"]
    assert n0[0] == n1[0] and n0[1].dtype == np.uint32 and np.array_equal(n0[1], n1[1]) and n0[2:] == n1[2:]
    assert torch.equal(back["shared"][1], t[1:]) and back["empty"].shape == (0, 2)
    assert (
        back["best_val"] == math.inf
        and back["last_val"] is None
        and back["looks_tagged"] == {"__tensor__": "x"}
    )
    assert back["np_scalar"] == 7 and isinstance(back["np_scalar"], np.int64)
    assert torch.equal(back["bf16"], state["bf16"])
    with pytest.raises(CheckpointError,
                       match=r"training state at /loader: a function cannot be stored safely"):
        encode_state({"loader": lambda: 0})


# -- hostile values in a run's own files ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def run4(data_dir, tmp_path_factory):
    """A 4-step run to copy and damage: its state and config.toml are what --resume reads."""
    out = tmp_path_factory.mktemp("run4") / "r"
    train_run(cfg_for(data_dir, out, train__max_iters=4, train__save_every=4))
    return out


def resume_args(data_dir, run) -> list[str]:
    return ["train", "--data", str(data_dir), "--out", str(run), "--resume", "--max-iters", "6", "--device",
            "cpu", "--no-progress", "--no-tensorboard"]


@pytest.mark.parametrize("step,words",
                         [(10**18, "step = 1000000000000000000 is out of range [0, 1000000000000]"),
                                        (1e18, "step = 1e+18 is not an integer"),
                                        (-5, "step = -5 is out of range [0, 1000000000000]"),
                                        ("x", "step = 'x' is not an integer"),
                                        (3, "step = 3 but the checkpoint is step_000004")])
def test_resume_refuses_a_training_state_with_a_nonsense_step(data_dir, run4, tmp_path, capsys, step, words):
    """Before: 1e18 and 'x' were tracebacks (a float step cannot name a
    checkpoint; 'x' < 6 is a TypeError), and
    -5 or 3 were taken as they were (steps trained again, checkpoints named by a step the model never saw)."""
    from test_hostile_inputs import error_line, rehash
    run = tmp_path / "r"
    shutil.copytree(run4, run)
    ck = run / "checkpoints" / "step_000004"
    state = json.loads((ck / ckpt_io.STATE_JSON).read_text())
    state["step"] = step
    (ck / ckpt_io.STATE_JSON).write_text(json.dumps(state))
    rehash(ck)
    assert main(resume_args(data_dir, run)) == 2
    line = error_line(capsys.readouterr().err)
    assert f"{ck / ckpt_io.STATE_JSON}: {words}" in line
    assert [p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step_")] == ["step_000004"]


LOADER = "loader"  # the data cursor's entry in train_state.json: BatchLoader.state_dict() for a pretrain run


@pytest.mark.parametrize("edit,words", [
    (lambda ld: {"cursor": -10**12, "epoch": "x"}, "loader has no pos, seed, shuffle, world_size, B, T"),
    (lambda ld: {k: v for k, v in ld.items() if k != "seed"}, "loader has no seed"),
    (lambda ld: {**ld, "epoch": "x"}, "loader.epoch = 'x' is not an integer"),
    (lambda ld: {**ld, "shuffle": "yes"}, "loader.shuffle = 'yes' is not true or false"),
    (lambda ld: {**ld, "fim_rate": 7.5}, "loader.fim_rate = 7.5 is out of range [0.0, 1.0]"),
    (lambda ld: {**ld, "pos": -10**12}, "loader.pos = -1000000000000 is out of range [0, "),
    (lambda ld: {**ld, "B": 0}, "loader.B = 0 is out of range [1, "),
    (lambda ld: {**ld, "pos": 10**9}, "loader.pos = 1000000000 is beyond the data"),
    (lambda ld: {**ld, "start": 10**15}, "loader.start = 1000000000000000 is beyond the data"),
    (lambda ld: [1, 2], "loader is a list, not the data loader's cursor"),
])
def test_resume_refuses_a_damaged_loader_entry(data_dir, run4, tmp_path, capsys, edit, words):
    """Before: a loader entry with keys missing was `KeyError: 'seed'`, a wrong type a TypeError traceback,
    and a negative or absurd cursor was trained from (silently starting another epoch)."""
    from test_hostile_inputs import error_line, rehash
    run = tmp_path / "r"
    shutil.copytree(run4, run)
    ck = run / "checkpoints" / "step_000004"
    state = json.loads((ck / ckpt_io.STATE_JSON).read_text())
    state[LOADER] = edit(state[LOADER])
    (ck / ckpt_io.STATE_JSON).write_text(json.dumps(state))
    rehash(ck)
    assert main(resume_args(data_dir, run)) == 2
    line = error_line(capsys.readouterr().err)  # one line, no traceback
    assert f"{ck / ckpt_io.STATE_JSON}: {words}" in line and "use another checkpoint" in line, line
    assert [p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step_")] == ["step_000004"]


def test_resume_takes_the_loader_entry_it_saved(data_dir, run4, tmp_path):
    """The check refuses no loader entry codeforge writes: one without the keys
    the loader reads with a default
    (`start` and `rank`, written by later versions) resumes."""
    run = tmp_path / "r"
    shutil.copytree(run4, run)
    from test_hostile_inputs import rehash
    ck = run / "checkpoints" / "step_000004"
    state = json.loads((ck / ckpt_io.STATE_JSON).read_text())
    assert set(state[LOADER]) == {"epoch", "pos", "seed", "shuffle", "rank", "world_size", "B", "T",
                                  "fim_rate", "fim_spm_rate", "start"}
    for k in ("start", "rank"):
        del state[LOADER][k]
    (ck / ckpt_io.STATE_JSON).write_text(json.dumps(state))
    rehash(ck)
    assert main(resume_args(data_dir, run)) == 0
    assert (run / "checkpoints" / "step_000006").is_dir()


@pytest.mark.parametrize("text,words", [('model = "x"\n', "model = 'x' is not a table of settings"),
                                        ('[model]\nn_layer = "x"\n', "model.n_layer = 'x' is not an integer"),
                                        ('[model]\nn_embd = -4\n',
                                         "model.n_embd = -4 is out of range [16, 16384]"),
                                        ('[train]\nbatch_size = true\n',
                                         "train.batch_size = True is not an integer"),
                                        ('[model]\nn_layers = 2\n', "unknown setting 'model.n_layers'")])
def test_resume_refuses_a_run_config_toml_that_is_not_one(data_dir, run4, tmp_path, capsys, text, words):
    """Before: `model = "x"` was an AttributeError traceback; the values went unchecked into the model."""
    from test_hostile_inputs import error_line
    run = tmp_path / "r"
    shutil.copytree(run4, run)
    (run / rundir.CONFIG).write_text(text)
    assert main(resume_args(data_dir, run)) == 2
    line = error_line(capsys.readouterr().err)
    assert f"{run / rundir.CONFIG}: {words}" in line


def test_weights_that_do_not_fit_say_which(tmp_path, tokenizer_dir):
    """Before: a TypeError (safetensors reports what is missing as a set; the message sliced it)."""
    from codeforge.models import build_model
    from test_hostile_inputs import tiny_model_cfg
    m, tok = tiny_model_cfg(tokenizer_dir)
    ck = ckpt_io.save_checkpoint(tmp_path / "r", 1, build_model(m), {"model": m.to_dict(), "train": {}}, {},
                                 {"tokenizer": tokenizer_dir}, keep_last=1)
    untied = build_model(type(m)(**{**m.to_dict(), "tie_embeddings": False}))
    with pytest.raises(CheckpointError, match=r"weights do not fit the model \(missing \['wte.weight'\], "
                                              r"unexpected \[\]\)"):
        ckpt_io.load_weights(untied, ck)


def test_a_checkpoint_whose_tokenizer_split_backtracks_is_refused(tmp_path, tokenizer_dir, capsys):
    """Before: loaded, and `codeforge generate` on a 35-character prompt ended in a traceback (the tokenizer's
    PanicException). Now load_model and generate refuse it, naming the file, its pre_tokenizer and the fix."""
    from codeforge.models import build_model
    from test_hostile_inputs import tiny_model_cfg
    from test_tokenizer import (BACKTRACKING_PROMPT, BACKTRACKING_SPLITS, assert_raw_tokenizers_panics,
                                with_split)
    bad = with_split(tokenizer_dir, tmp_path / "bad", BACKTRACKING_SPLITS[0])
    assert_raw_tokenizers_panics(bad)
    m, _ = tiny_model_cfg(tokenizer_dir)
    ck = ckpt_io.save_checkpoint(tmp_path / "r", 1, build_model(m), {"model": m.to_dict(), "train": {}}, {},
                                 {"tokenizer": bad}, keep_last=1)
    with pytest.raises(CheckpointError, match=r"tokenizer\.json: the split rule in its pre_tokenizer"):
        load_model(ck, CPU)
    capsys.readouterr()
    assert main(["generate", "--run", str(tmp_path / "r"), "--prompt", BACKTRACKING_PROMPT,
                 "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert str(ck / "tokenizer" / "tokenizer.json") in err and "pre_tokenizer" in err, err
    assert "PanicException" not in err and "Traceback" not in err, err


def test_resume_refuses_a_declared_model_its_weights_do_not_hold(data_dir, run4, tmp_path):
    """config.toml and the checkpoint's config.json both edited to 24 x 4096 (so they agree), the manifest
    hashed again: refused before the model is built. Before: built (19 GB), here until the 3 GiB cap."""
    from test_hostile_inputs import capped_cli, error_line, rehash
    run = tmp_path / "r"
    shutil.copytree(run4, run)
    ck = run / "checkpoints" / "step_000004"
    big = {"n_layer": 24, "n_embd": 4096, "n_head": 32, "n_kv_head": 32, "ffn_hidden": 16384}
    cfg = json.loads((ck / "config.json").read_text())
    cfg["model"].update(big)
    (ck / "config.json").write_text(json.dumps(cfg))
    rehash(ck)
    toml = (run / rundir.CONFIG).read_text()
    for k, v in big.items():
        toml = "\n".join(f"{k} = {v}" if line.split(" = ")[0] == k else line for line in toml.splitlines())
    (run / rundir.CONFIG).write_text(toml + "\n")
    line = error_line(capped_cli(*resume_args(data_dir, run)).stderr)
    assert f"{ck / 'model.safetensors'} does not hold the model {ck / 'config.json'} declares" in line
