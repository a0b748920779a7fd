"""Data parallelism on CPU ranks (gloo) through torchrun: FSDP2 against DDP and one process, sharded DCP
checkpoints (exact resume, resharding 2 -> 1 and 4 -> 2, inference from them), a killed rank, two "nodes"
on loopback, and the refusals."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from codeforge import checkpoint as ckpt_io
from codeforge.config import ConfigError, resolve
from codeforge.data.loader import BatchLoader
from codeforge.data.shards import ShardSet
from codeforge.train.resume import check_resume

GLOBAL_BATCH = 8
COMMON = ["--n-layer", "2", "--n-head", "2", "--n-embd", "64", "--block-size", "32", "--log-every", "1",
          "--no-progress", "--device", "cpu", "--eval-every", "4", "--save-every", "4", "--eval-tokens",
          "2048", "--schedule", "constant", "--warmup-steps", "2"]
TOL = 2e-5  # float32 sums taken in another order (per rank, then all-reduced)


def train(data_dir, out, ranks: int, *extra: str, steps: int = 8, check=True) -> subprocess.CompletedProcess:
    """`codeforge train` on `ranks` CPU processes (torchrun; plain python for
    1), global batch GLOBAL_BATCH."""
    args = ["-m", "codeforge", "train", "--data", str(data_dir), "--out", str(out), *COMMON,
            "--batch-size", str(GLOBAL_BATCH // ranks), "--max-iters", str(steps), *extra]
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                 str(ranks)]
                if ranks > 1 else [sys.executable])
    r = subprocess.run(launcher + args, capture_output=True, text=True, timeout=600)
    # a rank's own error lines first: torchrun's summary at the end hides them
    if check and r.returncode != 0:
        why = [x for x in r.stderr.splitlines()
               if any(w in x for w in ("rror", "terminate", "what()", "bort"))]
        pytest.fail(f"exit {r.returncode}\n--- the ranks' error lines:\n" + "\n".join(why[-30:])
                    + f"\n--- stdout:\n{r.stdout[-1500:]}\n--- stderr:\n{r.stderr[-3000:]}", pytrace=False)
    return r


def records(run):
    return [json.loads(x) for x in open(os.path.join(run, "metrics.jsonl"))]


def losses(run):
    return {r["step"]: r["loss"] for r in records(run) if "loss" in r}


def close(a: dict, b: dict, tol=TOL):
    assert sorted(a) == sorted(b), (a, b)
    return all(abs(a[k] - b[k]) <= tol * max(1.0, abs(b[k])) for k in a)


@pytest.mark.parametrize("ranks", [2, 4])
def test_fsdp_equals_ddp_and_one_process(data_dir, tmp_path, ranks):
    """The same global batch split over N ranks: FSDP's and DDP's losses, gradient norms and validation
    losses equal one process's within float32 tolerance."""
    one = train(data_dir, tmp_path / "one", 1, steps=4)
    fsdp = train(data_dir, tmp_path / "fsdp", ranks, "--parallel", "fsdp", steps=4)
    train(data_dir, tmp_path / "ddp", ranks, "--parallel", "ddp", steps=4)
    assert f"parallel: fsdp (--parallel fsdp over {ranks} ranks" in fsdp.stdout
    assert "parallel:" not in one.stdout
    ref = losses(tmp_path / "one")
    assert close(losses(tmp_path / "fsdp"), ref), (losses(tmp_path / "fsdp"), ref)
    assert close(losses(tmp_path / "ddp"), ref), (losses(tmp_path / "ddp"), ref)
    norm = {r["step"]: r["grad_norm"] for r in records(tmp_path / "one") if "loss" in r}
    assert close({r["step"]: r["grad_norm"] for r in records(tmp_path / "fsdp") if "loss" in r}, norm, 1e-4)
    val = {r["step"]: r["val_loss"] for r in records(tmp_path / "one") if "val_loss" in r}
    assert close({r["step"]: r["val_loss"] for r in records(tmp_path / "fsdp") if "val_loss" in r}, val)
    # each rank wrote its own shard of the weights and optimizer state; no whole-model file
    ck = ckpt_io.find_checkpoint(tmp_path / "fsdp", train_state=True)
    assert sorted(p.name for p in (ck / "sharded").glob("*.distcp")) == [
        f"__{r}_0.distcp" for r in range(ranks)
    ]
    assert not (ck / "model.safetensors").exists() and ckpt_io.verify_checkpoint(ck) is None



def test_fsdp_ranks_take_rank0s_weights(data_dir, tmp_path):
    """Under FSDP only rank 0 materialises the model; the others build it on the meta device and get their
    shards, the RoPE tables (buffers not in the state dict) and the random state from rank 0: a rotary model
    fine-tuned from another run's weights (--init-from) on 2 ranks equals the same on one process."""
    rope = ("--pos", "rope", "--norm", "rmsnorm")
    base = tmp_path / "base"
    train(data_dir, base, 1, *rope, steps=4)
    one = train(data_dir, tmp_path / "one", 1, *rope, "--init-from", str(base), steps=4)
    fsdp = train(data_dir, tmp_path / "fsdp", 2, *rope, "--init-from", str(base), "--parallel", "fsdp",
                 steps=4)
    assert "initialised weights from" in one.stdout and "initialised weights from" in fsdp.stdout
    assert close(losses(tmp_path / "fsdp"), losses(tmp_path / "one"))
    val = {r["step"]: r["val_loss"] for r in records(tmp_path / "one") if "val_loss" in r}
    assert close({r["step"]: r["val_loss"] for r in records(tmp_path / "fsdp") if "val_loss" in r}, val)
    # the fine-tuned run started from the base run's weights, not from a fresh initialisation
    assert records(tmp_path / "fsdp")[0]["val_loss"] < records(base)[0]["val_loss"]

def test_sharded_resume_exact_and_resharded(data_dir, tmp_path):
    """Saved on 2 ranks at step 4: resumed on 2 ranks it equals the straight run exactly; resumed on 1
    process (accumulation 2 keeps the global batch) it equals it within float32 tolerance; saved on 4 ranks
    and resumed on 2, the same; resumed under DDP, the same."""
    straight = tmp_path / "straight"
    train(data_dir, straight, 2, "--parallel", "fsdp")
    ref = losses(straight)
    part = tmp_path / "part"
    train(data_dir, part, 2, "--parallel", "fsdp", steps=4)
    shutil.copytree(part, tmp_path / "to1")
    shutil.copytree(part, tmp_path / "to_ddp")
    r = train(data_dir, part, 2, "--parallel", "fsdp", "--resume")
    assert "resumed from" in r.stdout
    assert losses(part) == ref  # bit for bit

    r = train(data_dir, tmp_path / "to1", 1, "--batch-size", "4", "--resume")
    assert "resuming on 1 rank(s), saved on 2: the global batch stays 8" in r.stdout, r.stdout
    assert "batch 4 x accumulation 2 x 1 rank(s)" in r.stdout
    assert close(losses(tmp_path / "to1"), ref)
    # the one-process run goes on writing ordinary checkpoints
    assert (ckpt_io.find_checkpoint(tmp_path / "to1") / "model.safetensors").exists()

    four = tmp_path / "four"
    train(data_dir, four, 4, "--parallel", "fsdp", steps=4)
    r = train(data_dir, four, 2, "--parallel", "fsdp", "--batch-size", "2", "--resume")
    assert "resuming on 2 rank(s), saved on 4" in r.stdout and ("batch 2 x accumulation "
                                                                "2 x 2 rank(s)") in r.stdout
    assert close(losses(four), ref)
    # a sharded checkpoint also resumes under DDP (each rank loads the whole model and optimizer from it)
    train(data_dir, tmp_path / "to_ddp", 2, "--parallel", "ddp", "--resume")
    assert close(losses(tmp_path / "to_ddp"), ref)
    # and a whole checkpoint (one process) resumes under FSDP: each rank reads it and keeps its shard
    whole = tmp_path / "whole"
    train(data_dir, whole, 1, steps=4)
    r = train(data_dir, whole, 2, "--parallel", "fsdp", "--batch-size", "4", "--resume")
    assert "resuming on 2 rank(s), saved on 1" in r.stdout
    assert close(losses(whole), ref)



def test_ranks_agree_on_a_damaged_checkpoint(data_dir, tmp_path):
    """Rank 0 alone verifies the checkpoint to resume from (or to start from) and tells the others: with the
    newest one damaged, every rank falls back to the same older one and the run equals the straight run; a
    damaged --init-from ends every rank with the error (no rank left waiting)."""
    run = tmp_path / "run"
    train(data_dir, run, 2, "--parallel", "fsdp")
    ref = losses(run)
    # an intact sharded checkpoint as --init-from: rank 0 reads it whole for itself (no collective), the
    # others take its weights in their shards; the first evaluation scores the checkpoint's weights
    good = train(data_dir, tmp_path / "ft_ok", 2, "--parallel", "fsdp", "--init-from",
                 str(run / "checkpoints" / "step_000008"), "--dist-timeout", "60", steps=4)
    assert "initialised weights from" in good.stdout
    val = {r["step"]: r["val_loss"] for r in records(run) if "val_loss" in r}
    assert abs(records(tmp_path / "ft_ok")[0]["val_loss"] - val[8]) < 1e-5
    damaged = tmp_path / "damaged"
    shutil.copytree(run, damaged)
    newest = ckpt_io.find_checkpoint(damaged)
    assert newest.name == "step_000008"
    with open(newest / "sharded" / "__1_0.distcp", "r+b") as f:  # rank 1's shard: one byte changed
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    bad = train(data_dir, tmp_path / "ft", 2, "--parallel", "fsdp", "--init-from", str(newest),
                "--dist-timeout", "60", check=False)
    assert bad.returncode != 0
    assert bad.stderr.count(f"checkpoint {newest} is damaged") >= 2, bad.stderr[-3000:]
    r = train(data_dir, damaged, 2, "--parallel", "fsdp", "--resume", "--dist-timeout", "60")
    assert "resumed from" in r.stdout and "step_000004" in r.stdout, r.stdout[-2000:]
    assert losses(damaged) == ref

def test_sharded_checkpoint_serves_inference(data_dir, tmp_path):
    """One process loads an FSDP run's checkpoint (DCP consolidates it): the weights score the validation
    split as the training run did, and `generate` and the Hugging Face export work from it."""
    from codeforge.tokenizer import token_byte_lengths
    from codeforge.evaluation.lm import validation_loss
    run = tmp_path / "run"
    train(data_dir, run, 2, "--parallel", "fsdp", steps=4)
    model, tok, ck, cfg = ckpt_io.load_model(run, torch.device("cpu"), "final")
    assert ckpt_io.is_sharded(ck)
    r = validation_loss(model, ShardSet(data_dir, "val"), 32, tok.special_ids, 2048, torch.device("cpu"),
                        "fp32", token_byte_lengths(tok, cfg["model"]["vocab_size"]))
    saved = [x["val_loss"] for x in records(run) if x.get("step") == 4 and "val_loss" in x][0]
    assert abs(r["val_loss"] - saved) < 1e-5, (r["val_loss"], saved)
    g = subprocess.run([sys.executable, "-m", "codeforge", "generate", "--run", str(run), "--prompt", "def ",
                        "--max-new-tokens", "8", "--device", "cpu"], capture_output=True, text=True,
                       timeout=300)
    assert g.returncode == 0 and g.stdout.startswith("def "), g.stderr[-2000:]
    e = subprocess.run([sys.executable, "-m", "codeforge", "export", "--run", str(run), "--format", "hf",
                        "--out", str(tmp_path / "hf")], capture_output=True, text=True, timeout=300)
    assert e.returncode == 0, e.stderr[-2000:]
    from safetensors.torch import load_file
    exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert any(torch.equal(t, model.state_dict()["wte.weight"]) for t in exported.values())


def test_killed_rank_ends_the_job_with_a_clear_message(data_dir, tmp_path):
    """kill -9 of rank 1 mid-run: rank 0 says it lost the other ranks and where the last checkpoint is, and
    the job ends (a hang would run into the subprocess timeout)."""
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             "--nproc_per_node", "2",
                             "-m", "codeforge", "train", "--data", str(data_dir), "--out", str(out), *COMMON,
                             "--batch-size", "4", "--max-iters", "1000000", "--parallel", "fsdp",
                             "--dist-timeout", "30"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        latest = out / "checkpoints" / "latest"
        deadline = time.time() + 240
        while time.time() < deadline and not latest.exists():
            time.sleep(0.1)
        assert latest.exists(), "no checkpoint within 240 s"
        victim = None
        for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
            try:
                env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
                cmd = open(f"/proc/{pid}/cmdline", "rb").read()
            except OSError:
                continue
            if b"RANK=1" in env and str(out).encode() in cmd:
                victim = pid
        assert victim is not None
        os.kill(victim, signal.SIGKILL)
        text, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode != 0
    assert "error: rank 0: lost contact with the other ranks at step" in text, text[-3000:]
    assert "continue with --resume" in text
    assert ckpt_io.verify_checkpoint(ckpt_io.find_checkpoint(out, train_state=True)) is None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_on_loopback(data_dir, tmp_path):
    """Two torchrun groups (one rank each) meet through the c10d rendezvous, as two machines would: FSDP
    over both trains the same losses as one process with the same global batch."""
    port = free_port()
    out = tmp_path / "run"
    cmd = lambda: [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",  # noqa: E731
                   "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "cf-test",
                   "-m", "codeforge", "train", "--data", str(data_dir), "--out", str(out), *COMMON,
                   "--batch-size", "4", "--max-iters", "4", "--parallel", "fsdp"]
    nodes = [subprocess.Popen(cmd(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(2)]
    texts = []
    try:
        for p in nodes:
            texts.append(p.communicate(timeout=300)[0])
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in nodes] == [0, 0], texts
    assert sum("parallel: fsdp (--parallel fsdp over 2 ranks" in t for t in texts) == 1  # rank 0 speaks
    train(data_dir, tmp_path / "one", 1, steps=4)
    assert close(losses(out), losses(tmp_path / "one"))


def test_loader_continues_on_another_world_size(data_dir):
    """What 2 ranks of batch 4 would read next is what 1 rank of batch 8 reads after loading their state."""
    shards = ShardSet(data_dir, "train")
    ranks = [BatchLoader(shards, 4, 32, rank=r, world_size=2) for r in range(2)]
    for _ in range(3):
        for lo in ranks:
            next(lo)
    one = BatchLoader(shards, 8, 32, world_size=1)
    one.load_state_dict(ranks[0].state_dict())
    x1, _ = next(one)
    both = torch.cat([next(lo)[0] for lo in ranks])
    assert sorted(map(tuple, x1.tolist())) == sorted(map(tuple, both.tolist()))
    # any split reads on from the same sequence, e.g. 8 read by 2 ranks of 4, then 1 rank of batch 3, to
    # the end of the epoch, then the next epoch from its start
    single = BatchLoader(shards, 1, 32)
    order = [next(single)[0] for _ in range(single.per_epoch + 3)]
    odd = BatchLoader(shards, 4, 32, rank=0, world_size=2)
    odd.pos = 1
    three = BatchLoader(shards, 3, 32)
    three.load_state_dict(odd.state_dict())
    got = []
    while three.epoch == 0 or len(got) < (single.per_epoch - 8) // 3 * 3 + 3:
        got.extend(next(three)[0])
    rest = (single.per_epoch - 8) // 3 * 3  # whole batches of 3 left in the epoch
    assert [x.tolist() for x in got[:rest]] == [x[0].tolist() for x in order[8:8 + rest]]
    assert [x.tolist() for x in got[rest:rest + 3]] == [x[0].tolist() for x in order[single.per_epoch:]]


def test_resume_on_other_world_size_keeps_the_global_batch(tmp_path):
    """check_resume: the accumulation is scaled to keep the global batch; where it cannot be, the refusal
    says what to set."""
    ck = tmp_path / "ck"
    ck.mkdir()
    saved = resolve([], None, [], {"train.batch_size": 3, "train.grad_accum_steps": 1}).to_dict()
    (ck / "config.json").write_text(json.dumps({**saved, "world_size": 4}))
    now = {**saved, "train": dict(saved["train"]), "world_size": 2}
    notes, accum = check_resume(ck, now)
    assert accum == 2 and "global batch stays 12" in notes[0]
    now = {**saved, "train": dict(saved["train"]), "world_size": 8}  # 12 sequences over 8 ranks of 3: no
    with pytest.raises(ConfigError,
                       match=r"global batch 3 x 1 x 4 rank\(s\) = 12 sequences -> 3 x 1 x 8 = 24"):
        check_resume(ck, now)
    (ck / "config.json").write_text(json.dumps({**saved, "world_size": 4, "data_identity": {"chat": True}}))
    now = {**saved, "train": dict(saved["train"]), "world_size": 2, "data_identity": {"chat": True}}
    with pytest.raises(ConfigError, match=r"the number of ranks 4 -> 2 \(chat batches are packed per rank"):
        check_resume(ck, now)


def test_fsdp_refusals(tmp_path, monkeypatch):
    from codeforge.models import build_model
    from codeforge.stages import run as run_stage
    from codeforge.train.trainer import Trainer, TrainingError
    cfg = resolve([], None, [],
                  {"model.n_layer": 2, "model.n_head": 2, "model.n_embd": 64, "model.block_size": 32,
                                 "model.vocab_size": 256, "train.parallel": "fsdp",
                                 "train.optimizer": "muon"})
    with pytest.raises(TrainingError, match="--parallel fsdp trains with adamw, not muon"):
        Trainer(build_model(cfg.model), iter(()), None, cfg.train, tmp_path, device=torch.device("cpu"),
                precision="fp32", total_steps=1, tokens_per_step=1, run_config={}, rank=0, world=2)
    monkeypatch.setenv("WORLD_SIZE", "2")
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("")
    dpo = resolve([], None, [], {"train.stage": "dpo", "train.parallel": "fsdp", "train.data": str(pairs),
                                 "train.out": str(tmp_path / "dpo"), "train.device": "cpu"})
    with pytest.raises(ConfigError, match="--parallel fsdp is for the language-model stages"):
        run_stage(dpo, log=lambda m: None)


def test_background_checkpoints_are_snapshots(data_dir, tmp_path):
    """--async-checkpoint on: shards are written by DCP's async_save while training goes on. Training is
    unchanged, and a checkpoint written in the background resumes exactly (it holds the state of its step,
    not a later one)."""
    straight = tmp_path / "sync"
    train(data_dir, straight, 2, "--parallel", "fsdp")
    run = tmp_path / "async"
    train(data_dir, run, 2, "--parallel", "fsdp", "--async-checkpoint", "on", "--save-every", "2")
    assert losses(run) == losses(straight)
    root = run / "checkpoints"
    assert sorted(p.name for p in root.glob("step_*")) == ["step_000004", "step_000006", "step_000008"]
    assert all(ckpt_io.verify_checkpoint(p) is None for p in root.glob("step_*"))
    # go back to step 6 (written in the background while steps 7 and 8 trained) and train 7-8 again
    shutil.rmtree(root / "step_000008")
    (root / "final").unlink()
    (root / "latest").write_text("step_000006\n")
    (root / "best").write_text("step_000004\n")
    with open(run / "metrics.jsonl") as f:
        kept = [x for x in f if json.loads(x).get("step", 0) <= 6]
    (run / "metrics.jsonl").write_text("".join(kept))
    train(data_dir, run, 2, "--parallel", "fsdp", "--async-checkpoint", "on", "--save-every", "2", "--resume")
    assert losses(run) == losses(straight)


@pytest.mark.slow
def test_fsdp_composes_with_compile_and_checkpointing(data_dir, tmp_path):
    """torch.compile per block and activation checkpointing under FSDP: the same losses as plain FSDP."""
    train(data_dir, tmp_path / "plain", 2, "--parallel", "fsdp", steps=4)
    train(data_dir, tmp_path / "both", 2, "--parallel", "fsdp", "--compile", "--gradient-checkpointing",
          steps=4)
    assert close(losses(tmp_path / "both"), losses(tmp_path / "plain"))


def test_auto_chooses_fsdp_only_when_ddp_does_not_fit():
    from codeforge.train.parallel import choose_mode
    cpu, gib = torch.device("cpu"), 2**30
    assert choose_mode("auto", 4, cpu, (30 * gib, 10 * gib, 24 * gib))[0] == "fsdp"
    assert choose_mode("auto", 4, cpu, (10 * gib, 5 * gib, 24 * gib))[0] == "ddp"
    # neither fits: the default
    assert choose_mode("auto", 4, cpu, (60 * gib, 30 * gib, 24 * gib))[0] == "ddp"
    assert choose_mode("auto", 4, cpu, None)[0] == "ddp"
    assert choose_mode("fsdp", 1, cpu)[0] == "none" and choose_mode("ddp", 2, cpu)[0] == "ddp"


def test_plan_command(capsys):
    """`codeforge plan`: per-rank terms under DDP and FSDP from the shapes, and what fits."""
    from codeforge.cli import main
    from codeforge.train.memory import estimate
    assert main(["plan", "--preset", "large", "--world-size", "8", "--gpu-memory", "24"]) == 0
    out = capsys.readouterr().out
    assert "1,034,344,000 parameters" in out and "-> --parallel fsdp: DDP does not fit" in out
    cfg = resolve(["large"])
    p = estimate(cfg.model, cfg.train, 8, "bf16")
    assert p.rows["parameters"] == (4 * 1_034_344_000, 4 * 1_034_344_000 / 8)
    assert p.rows["optimizer state"][1] == 8 * 1_034_344_000 / 8
    assert p.total("fsdp") < p.total("ddp")
    ck = estimate(cfg.model, resolve(["large"], None, [], {"train.grad_checkpointing": True}).train, 8,
                  "bf16")
    assert ck.rows["activations"][0] < p.rows["activations"][0] / 3  # the logits stay
    assert main(["plan", "--preset", "medium", "--world-size", "2", "--gpu-memory", "80"]) == 0
    assert "-> --parallel ddp (the default)" in capsys.readouterr().out
    assert main(["plan", "--preset", "medium", "--world-size", "2", "--gpu-memory", "1", "--optimizer",
                 "muon"]) == 0
    assert "FSDP trains with AdamW, not muon" in capsys.readouterr().out
    assert main(["plan", "--preset", "medium", "--world-size", "0"]) != 0
    assert "--world-size 0" in capsys.readouterr().err


def test_exit_codes_and_the_joined_rank_exit(tmp_path):
    """The command's exit codes pass through `entry`; a process that joined a group leaves through os._exit
    with its code and with what it printed flushed (the interpreter's finalization is skipped)."""
    def run(*a):
        return subprocess.run([sys.executable, *a], capture_output=True, text=True, timeout=120)
    assert run("-m", "codeforge", "--help").returncode == 0
    bad = run("-m", "codeforge", "no-such-command")
    assert bad.returncode == 2 and "invalid choice" in bad.stderr
    missing = run("-m", "codeforge", "generate", "--run", str(tmp_path / "nothing"), "--prompt", "x")
    assert missing.returncode == 2 and missing.stderr.startswith("error:")
    script = tmp_path / "joined.py"
    script.write_text("import atexit, sys\nfrom codeforge import distributed as device\n"
                      "atexit.register(lambda: print('finalized'))\n"
                      "device._JOINED = True\nprint('unflushed', end='')\nsys.stderr.write('err')\n"
                      "device.exit_process(3)\n")
    r = run(str(script))
    assert (r.returncode, r.stdout, r.stderr) == (3, "unflushed", "err")


def test_ranks_wait_for_rank0_longer_than_the_training_timeout(tmp_path):
    """The other ranks wait on rank 0's work alone (verifying a checkpoint, building the model) in the startup
    group, whose timeout is not --dist-timeout: rank 0 taking 8 s under a 5 s timeout is no failure."""
    script = tmp_path / "wait.py"
    script.write_text(
        "import time, torch\nfrom pathlib import Path\n"
        "from codeforge.distributed import setup_distributed, teardown_distributed\n"
        "from codeforge.distributed import found_by_rank0\n"
        "setup_distributed(torch.device('cpu'), 5)\n"
        "got = found_by_rank0(lambda: time.sleep(8) or Path('/run/step_000008'))\n"
        "torch.distributed.barrier()\n"
        f"open(f'{tmp_path}/got{{torch.distributed.get_rank()}}', 'w').write(str(got))\n"
        "teardown_distributed()\n")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                        "2", str(script)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [(tmp_path / f"got{rank}").read_text() for rank in (0, 1)] == ["/run/step_000008"] * 2
