import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from codeforge import CodeforgeError
from codeforge.checkpoint import find_checkpoint, load_train_state
from codeforge.config import ConfigError, resolve
from codeforge.stages import run as run_stage
from codeforge.train.trainer import Trainer, TrainingError

TINY = {"model.n_layer": 2, "model.n_head": 2, "model.n_embd": 64, "model.block_size": 32,
        "train.batch_size": 4, "train.learning_rate": 3e-3, "train.warmup_steps": 2, "train.eval_every": 5,
        "train.eval_tokens": 128, "train.save_every": 4, "train.log_every": 1, "train.progress": False,
        "train.device": "cpu", "train.loss_chunk_rows": 0}


def cfg_for(data_dir, out, **over):
    flags = {**TINY, "train.data": str(data_dir), "train.out": str(out)}
    flags.update({k.replace("__", "."): v for k, v in over.items()})
    return resolve([], None, [], flags, vocab_from_data=True)


def train_run(cfg, resume=False):
    return run_stage(cfg, resume=resume, log=lambda m: None)


def losses(run):
    recs = [json.loads(x) for x in open(os.path.join(run, "metrics.jsonl"))]
    return {r["step"]: r["loss"] for r in recs if "loss" in r}


def test_loss_falls_and_files_written(data_dir, tmp_path):
    r = train_run(cfg_for(data_dir, tmp_path / "run", train__max_iters=60))
    ls = losses(tmp_path / "run")
    first = sum(ls[s] for s in range(1, 6)) / 5
    last = sum(ls[s] for s in range(56, 61)) / 5
    assert last < first - 1.0, (first, last)
    assert r["step"] == 60 and r["val_loss"] is not None and math.isfinite(r["val_loss"])
    recs = [json.loads(x) for x in open(tmp_path / "run" / "metrics.jsonl")]
    train = [x for x in recs if "loss" in x]
    assert all({"step", "loss", "lr", "tokens_per_s"} <= set(x) for x in train)
    assert any("val_loss" in x and "val_bpb" in x for x in recs)
    assert list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))
    ck = tmp_path / "run" / "checkpoints"
    names = sorted(p.name for p in ck.iterdir() if p.name.startswith("step_"))
    # keep_last 3 plus best: periodic saves at 4..56, final at 60
    assert names[-1] == "step_000060" and len(names) <= 4
    assert (ck / "final").read_text().strip() == "step_000060"
    assert (tmp_path / "run" / "config.toml").exists()


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_stop_and_resume_equals_straight(data_dir, tmp_path, monkeypatch, optimizer):
    over = dict(train__max_iters=12, model__resid_dropout=0.1, model__attn_dropout=0.1,
                train__grad_accum_steps=2, train__optimizer=optimizer)
    train_run(cfg_for(data_dir, tmp_path / "a", **over))
    straight = losses(tmp_path / "a")

    # Second run: SIGTERM arrives during step 6; the trainer saves and exits, then --resume finishes.
    import codeforge.train.trainer as tr
    real = tr.Trainer._optimisation_step

    def step_then_signal(self):
        out = real(self)
        if self.step == 5:
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    monkeypatch.setattr(tr.Trainer, "_optimisation_step", step_then_signal)
    r = train_run(cfg_for(data_dir, tmp_path / "b", **over))
    assert r["interrupted"] == "SIGTERM" and r["step"] == 6
    monkeypatch.setattr(tr.Trainer, "_optimisation_step", real)
    with pytest.raises(ConfigError, match="--resume"):
        train_run(cfg_for(data_dir, tmp_path / "b", **over))
    train_run(cfg_for(data_dir, tmp_path / "b", **over), resume=True)
    resumed = losses(tmp_path / "b")
    assert sorted(resumed) == sorted(straight) == list(range(1, 13))
    assert all(resumed[s] == straight[s] for s in straight), (resumed, straight)


@pytest.mark.parametrize("dummy", [0])
def test_kill_9_leaves_resumable_checkpoint(data_dir, tmp_path, dummy):
    common = ["--data", str(data_dir), "--n-layer", "2", "--n-head", "2", "--n-embd", "128", "--block-size",
              "64", "--batch-size", "8", "--schedule", "constant", "--warmup-steps", "0", "--eval-every", "0",
              "--save-every", "5", "--log-every", "1", "--device", "cpu", "--no-progress", "--dropout", "0.1",
              # pinned: the thread count chosen from the cores free at start changes sums' order
              "--threads", "2"]
    ref = tmp_path / "ref"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    run = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "codeforge", "train", *common, "--out", str(run),
                             "--max-iters", "100000"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    latest = run / "checkpoints" / "latest"
    while time.time() < deadline and not (latest.exists() and latest.read_text().strip() >= "step_000015"):
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    ck = find_checkpoint(run)
    start = load_train_state(ck)["step"]
    assert start >= 15
    end = start + 6
    # Resume the killed run to `end`; train a reference straight to `end` with the same settings.
    assert subprocess.run([sys.executable, "-m", "codeforge", "train", *common, "--out", str(run), "--resume",
                           "--max-iters", str(end)], env=env, capture_output=True).returncode == 0
    assert subprocess.run([sys.executable, "-m", "codeforge", "train", *common, "--out", str(ref),
                           "--max-iters", str(end)], env=env, capture_output=True).returncode == 0
    a, b = losses(run), losses(ref)
    assert all(a[s] == b[s] for s in range(1, end + 1)), (start,
                                                          [(s, a.get(s), b[s]) for s in range(1, end + 1)
                                                           if a.get(s) != b[s]])


class ToyBatches:
    """A batch source of random tokens (the trainer only needs next/state_dict/load_state_dict)."""

    def __init__(self, vocab=64, B=4, T=16):
        self.g, self.vocab, self.B, self.T, self.n = torch.Generator().manual_seed(0), vocab, B, T, 0

    def __next__(self):
        self.n += 1
        x = torch.randint(0, self.vocab, (self.B, self.T + 1), generator=self.g)
        return x[:, :-1], x[:, 1:]

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, s):
        self.n = s["n"]


def test_trainer_is_handed_its_parts_and_stops_on_non_finite_loss(tmp_path):
    """The loop alone: a model, a batch source and a loss function it did not build; a loss that turns NaN
    is skipped, and max_bad_steps in a row stop the run without writing NaN weights."""
    from codeforge.models import build_model
    cfg = resolve([], None, [],
                  {**TINY, "model.vocab_size": 256, "train.max_bad_steps": 4, "train.eval_every": 0})
    model = build_model(cfg.model)
    calls = {"n": 0}

    def loss_fn(m, batch):
        calls["n"] += 1
        loss = m(*batch)
        return (loss * float("nan") if calls["n"] > 3 else loss), {}

    t = Trainer(model, ToyBatches(), loss_fn, cfg.train, tmp_path / "run", device=torch.device("cpu"),
                precision="fp32", total_steps=50, tokens_per_step=64, run_config=cfg.to_dict(),
                log=lambda m: None)
    with pytest.raises(TrainingError, match="4 non-finite losses in a row"):
        t.run()
    assert t.skipped == 4 and t.step == 6  # 3 good steps, then 3 skipped ones counted before the 4th stops it
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_bad_configs_refused():
    with pytest.raises(ConfigError, match=r"model.n_layer = 0 is out of range \[1, 256\]; set --n-layer"):
        resolve([], None, [], {"model.n_layer": 0})
    with pytest.raises(ConfigError, match=r"train.learning_rate = 0.0 is out of range \(0.0"):
        resolve([], None, ["train.learning_rate=0"])
    with pytest.raises(ConfigError, match="not divisible by model.n_head"):
        resolve([], None, ["n_embd=100", "n_head=3"])
    with pytest.raises(ConfigError, match="dropout"):
        resolve(["fragment-lowend"], None, ["resid_dropout=0.95"])
    with pytest.raises(ConfigError, match="unknown setting 'model.n_layers'"):
        resolve([], None, ["model.n_layers=4"])
    with pytest.raises(ConfigError, match="key=value"):
        resolve([], None, ["n_layer"])
    with pytest.raises(ConfigError, match="unknown preset 'gpt5'"):
        resolve(["gpt5"])
    with pytest.raises(ConfigError, match="not an integer"):
        resolve([], None, ["n_layer=two"])
    with pytest.raises(ConfigError, match="schedule"):
        resolve([], None, ["schedule=exp"])


def test_config_precedence_and_file(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("[model]\nn_layer = 3\n[train]\nbatch_size = 5\n")
    y = tmp_path / "c.yaml"
    y.write_text("model:\n  n_layer: 7\n")
    c = resolve(["fragment-lowend", "lowend-cpu"], str(f), ["train.batch_size=6"], {"model.n_head": 2})
    assert (c.model.n_layer, c.model.n_embd, c.model.n_head, c.train.batch_size,
            c.train.grad_accum_steps) == (3, 256, 2, 6, 1)
    assert c.model.ffn_hidden == 1024 and c.model.n_kv_head == 2  # derived after overrides
    assert resolve([], str(y)).model.n_layer == 7


def test_profile_recipe_only_for_pretraining():
    """lowend-cpu's optimizer recipe ([lowend-cpu.pretrain]) reaches --stage pretrain only; fine-tuning
    stages keep their own optimizer and rates, and flags still win over the recipe."""
    pre = resolve(["cpu-small", "lowend-cpu"])
    assert (pre.train.optimizer, pre.train.learning_rate, pre.train.batch_size) == ("muon", 0.012, 16)
    for stage, lr in (("sft", 5e-5), ("code", 5e-6)):
        c = resolve(["cpu-small", "lowend-cpu"], None, [], {"train.stage": stage})
        assert (c.train.optimizer, c.train.learning_rate, c.train.batch_size) == ("adamw", lr, 16)
    assert resolve(["lowend-cpu"], None, ["train.learning_rate=0.001"]).train.learning_rate == 0.001


def test_init_from_checks_shape_and_tokenizer(data_dir, tmp_path):
    train_run(cfg_for(data_dir, tmp_path / "a", train__max_iters=4))
    with pytest.raises(CodeforgeError, match="model shape differs.*n_layer"):
        train_run(cfg_for(data_dir, tmp_path / "b", train__max_iters=4, model__n_layer=3,
                      train__init_from=str(tmp_path / "a")))
    captured = {}
    import codeforge.train.trainer as tr
    real_init = tr.Trainer.__init__

    def spy(self, model, *a, **k):
        captured["wte"] = model.wte.weight.detach().clone()  # the weights the trainer is handed
        real_init(self, model, *a, **k)

    tr.Trainer.__init__ = spy
    try:
        train_run(cfg_for(data_dir, tmp_path / "c", train__max_iters=4, train__init_from=str(tmp_path / "a")))
    finally:
        tr.Trainer.__init__ = real_init
    from safetensors.torch import load_file
    saved = load_file(str(find_checkpoint(tmp_path / "a", "best") / "model.safetensors"))
    emb = saved["wte.weight"] if "wte.weight" in saved else saved["lm_head.weight"]  # tied: stored once
    assert torch.equal(captured["wte"], emb)
    with pytest.raises(CodeforgeError, match="does not exist"):
        train_run(cfg_for(data_dir, tmp_path / "d", train__init_from=str(tmp_path / "nope")))


def test_torchrun_two_ranks_cpu(data_dir, tmp_path):
    """Data parallel through torchrun (gloo on CPU): both ranks step together, rank 0 writes the run."""
    out = tmp_path / "ddp"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                        "2",
                        "-m", "codeforge", "train", "--data", str(data_dir), "--out", str(out), "--n-layer",
                        "2", "--n-head", "2", "--n-embd", "64", "--block-size", "32", "--batch-size", "4",
                        "--max-iters", "6",
                        "--eval-every", "3", "--save-every", "3", "--log-every", "1", "--no-progress",
                        "--device", "cpu"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.count("done: step 6") == 1  # printed by rank 0 only
    assert "x 2 rank(s)" in r.stdout
    assert sorted(losses(out)) == [1, 2, 3, 4, 5, 6]
    assert find_checkpoint(out).name == "step_000006"


def test_init_from_refuses_other_tokenizer(data_dir, tmp_path, code_corpus):
    from codeforge.corpus import CorpusOptions
    from codeforge.data.shards import prepare
    from codeforge.tokenizer import train_tokenizer
    train_run(cfg_for(data_dir, tmp_path / "a", train__max_iters=2))
    texts = [p.read_text() for p in sorted(code_corpus.glob("pkg*/*.go"))] * 3
    train_tokenizer(iter(texts), 900, tmp_path / "tok2")
    other = prepare([str(code_corpus)], tmp_path / "tok2", tmp_path / "data2",
                    CorpusOptions(languages=["go"]), log=lambda *a: None)
    with pytest.raises(CodeforgeError, match="it was trained with tokenizer .* but .* uses"):
        # same shape: the vocab is set to the first run's so only the tokenizer differs
        train_run(cfg_for(tmp_path / "data2", tmp_path / "b", train__max_iters=2,
                          train__init_from=str(tmp_path / "a"),
                        model__vocab_size=1024))
    assert other["tokenizer_hash"]


def test_resume_after_crash_mid_metrics_line(data_dir, tmp_path):
    train_run(cfg_for(data_dir, tmp_path / "r", train__max_iters=4))
    with open(tmp_path / "r" / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "loss": 1.2')  # what kill -9 can leave behind
    train_run(cfg_for(data_dir, tmp_path / "r", train__max_iters=6), resume=True)
    recs = [json.loads(x) for x in open(tmp_path / "r" / "metrics.jsonl")]
    assert sorted(r["step"] for r in recs if "loss" in r) == [1, 2, 3, 4, 5, 6]


def test_checkpoints_sorted_by_step_number(tmp_path):
    from codeforge.checkpoint.save import _prune
    root = tmp_path / "checkpoints"
    for s in (999000, 999500, 1000000, 1000500):
        (root / f"step_{s:06d}").mkdir(parents=True)
        (root / f"step_{s:06d}" / "model.safetensors").write_bytes(b"x")
    _prune(root, keep_last=2)
    assert sorted(p.name for p in root.iterdir()) == ["step_1000000", "step_1000500"]
    assert find_checkpoint(tmp_path).name == "step_1000500"  # no latest pointer: the newest by number


def test_best_only_for_evaluated_steps(data_dir, tmp_path):
    train_run(cfg_for(data_dir, tmp_path / "r", train__max_iters=8, train__eval_every=4, train__save_every=2))
    best = (tmp_path / "r" / "checkpoints" / "best").read_text().strip()
    assert best in ("step_000004", "step_000008")  # steps 2 and 6 were saved but never evaluated


def test_best_is_kept_when_evaluated_not_only_at_saves(tmp_path):
    """A small corpus is memorised: validation is best early and rises after.
    The weights of the best evaluated
    step are kept (saved when evaluated) although no periodic save falls on that
    step, and `best` names them."""
    from codeforge.checkpoint import load_train_state
    from codeforge.models import build_model
    cfg = resolve([], None, [],
                  {**TINY, "model.vocab_size": 256, "train.eval_every": 2, "train.save_every": 100})
    model = build_model(cfg.model)
    scripted = iter([9.0, 5.0, 3.0, 4.0, 6.0, 7.0, 8.0])  # steps 0, 2, 4 (the best), 6, 8, 10, 12

    def evaluate(m):
        v = next(scripted)
        return {"val_loss": v, "perplexity": math.exp(v), "bits_per_byte": v / 2}
    t = Trainer(model, ToyBatches(vocab=256), lambda m, b: (m(*b), {}), cfg.train, tmp_path / "run",
                device=torch.device("cpu"), precision="fp32", total_steps=12, tokens_per_step=64,
                run_config=cfg.to_dict(), evaluate=evaluate, log=lambda m: None)
    t.run()
    root = tmp_path / "run" / "checkpoints"
    assert (root / "best").read_text().strip() == "step_000004"
    assert (root / "final").read_text().strip() == "step_000012"
    st = load_train_state(root / "step_000004")
    assert st["step"] == 4 and st["last_val"] == 3.0 and st["best_val"] == 3.0
    # steps 2 and 4 improved and were saved; 6-10 did not improve and fell on no save step
    assert sorted(p.name for p in root.glob("step_*")) == ["step_000002", "step_000004", "step_000012"]


def test_a_run_far_too_big_for_the_cpu_says_so_before_its_first_evaluation(tmp_path):
    """A GPU-sized plan on a CPU: the estimate and its warning come from the
    model's FLOPs and a measured matrix
    product before the first evaluation (which alone can take minutes at that
    size), not after the first steps."""
    from codeforge.models import build_model
    cfg = resolve([], None, [], {**TINY, "model.vocab_size": 256, "train.eval_every": 0})
    model = build_model(cfg.model)
    model.flops_per_token = lambda: 1e12  # as if 160B parameters
    said: list[str] = []
    first_eval: list[int] = []

    def evaluate(m):
        first_eval.append(len(said)) if not first_eval else None
        return {"val_loss": 1.0, "perplexity": 2.7, "bits_per_byte": 1.0}
    t = Trainer(model, ToyBatches(vocab=256), lambda m, b: (m(*b), {}), cfg.train, tmp_path / "run",
                device=torch.device("cpu"), precision="fp32", total_steps=2, tokens_per_step=64 * 1024,
                run_config=cfg.to_dict(), evaluate=evaluate, log=said.append)
    t.run()
    i = next(i for i, m in enumerate(said) if m.startswith("estimate:"))
    assert i < first_eval[0] and "GFLOP/s" in said[i] and "days" in said[i]
    assert "warning: that is far beyond what a CPU does" in said[i] and "--max-iters" in said[i]
    # a run the CPU does in seconds measures nothing and says nothing before its steps
    assert Trainer and __import__("codeforge.train.trainer", fromlist=["Pace"]).Pace.estimate(
        100, 100 * 4096, 2e7, torch.device("cpu"), "fp32") is None


def test_the_matmul_measurement_leaves_the_random_stream_alone():
    """Found in review: the estimate's matmul drew its matrices from the global generator, after a resumed
    run had restored its random state, so dropout masks after a resume differed from a straight run's."""
    from codeforge import device as dev
    dev._MATMUL_RATE.clear()
    torch.manual_seed(3)
    before = torch.get_rng_state()
    assert dev.matmul_flops(torch.device("cpu"), "fp32", seconds=0.01) > 0
    assert torch.equal(before, torch.get_rng_state())


def test_progress_lines_without_a_terminal(data_dir, tmp_path, capsys):
    """Output redirected (pytest's capture is not a tty): no bar, but compact progress lines with loss,
    tokens/s and ETA, and a measured pace with the estimate for the rest of the run."""
    from codeforge.cli import main
    assert main(["train", "--data", str(data_dir), "--out", str(tmp_path / "r"), "--n-layer", "1", "--n-head",
                 "2",
                 "--n-embd", "32", "--block-size", "32", "--batch-size", "2", "--max-iters", "12",
                 "--log-every", "1", "--eval-every", "0", "--eval-tokens", "64", "--device", "cpu"]) == 0
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("step ") and "/12 |" in x]
    assert lines and lines[0].startswith("step 1/12 | loss ") and lines[-1].startswith("step 12/12")
    assert "tok/s" in lines[-1] and "ETA" in lines[-1]
    assert "pace: " in err and "measured over" in err and "remaining" in err


def test_pace_warns_when_far_beyond_the_device(monkeypatch):
    from codeforge.train import trainer as tr
    now = [100.0]
    monkeypatch.setattr(tr.time, "perf_counter", lambda: now[0])
    p = tr.Pace(0, 5000, torch.device("cpu"))
    assert p.step(1) is None  # the first step (warm-up) is not timed
    msgs = []
    for s in range(2, 10):
        now[0] += 22.0  # 22 s a step, as fragment-midrange at vocab 32000 on this 2-core CPU
        msgs.append(p.step(s))
    said = [m for m in msgs if m]
    assert len(said) == 1
    assert "22.0 s/step" in said[0] and "warning" in said[0] and "--max-iters" in said[0] and "30h" in said[0]
    fast = tr.Pace(0, 100, torch.device("cpu"))
    fast.step(1)
    said = []
    for s in range(2, 10):
        now[0] += 0.1
        said.append(fast.step(s))
    said = [m for m in said if m]
    assert len(said) == 1 and "10.00 steps/s" in said[0] and "warning" not in said[0]


def test_interrupted_run_says_where_it_stopped(data_dir, tmp_path, capsys, monkeypatch):
    """Ctrl-C at step 3: exit status 130; the closing line says stopped and that the loss
    shown is step 0's; resuming with
    --max-iters 5 says 2 steps are left."""
    from codeforge.cli import main
    orig = Trainer._optimisation_step

    def step_then_interrupt(self):
        out = orig(self)
        if self.step == 2:  # the step being taken is the third
            os.kill(os.getpid(), signal.SIGINT)
        return out

    monkeypatch.setattr(Trainer, "_optimisation_step", step_then_interrupt)
    args = ["train", "--data", str(data_dir), "--out", str(tmp_path / "r"), "--n-layer", "1", "--n-head", "2",
            "--n-embd", "32", "--block-size", "32", "--batch-size", "2", "--max-iters", "100", "--eval-every",
            "50", "--eval-tokens", "64", "--device", "cpu", "--no-progress"]
    assert main(args) == 130  # a script can tell Ctrl-C from a finished run (128 + SIGINT)
    said = capsys.readouterr()
    out = said.out
    assert "stopped: step 3" in out and "(evaluated at step 0)" in out
    assert "SIGINT: stopping after this step (or evaluation), with a checkpoint" in said.err  # heard at once
    assert "saved a checkpoint at step 3; continue with --resume" in said.err + out
    # the quickstart's own way on is its command's alone: it does not outlive it in the process
    from codeforge.train.stopping import RESUME_HINT as HINT
    assert main(["quickstart", "--chat", "--hrm", "--out", str(tmp_path / "q")]) == 2  # refused inside it
    assert HINT not in os.environ
    monkeypatch.setattr(Trainer, "_optimisation_step", orig)
    args[args.index("100")] = "5"
    assert main(args + ["--resume"]) == 0
    assert "training steps 4-5 (2 left)" in capsys.readouterr().out
    # a command that wraps training says its own one way on (the quickstart: run it again; no --resume)
    from codeforge.quickstart import RESUME
    from codeforge.train.stopping import RESUME_HINT
    monkeypatch.setenv(RESUME_HINT, RESUME)
    monkeypatch.setattr(Trainer, "_optimisation_step", step_then_interrupt)
    args[args.index("5")] = "100"
    args[args.index(str(tmp_path / "r"))] = str(tmp_path / "r2")
    assert main(args) == 130
    said = capsys.readouterr()
    assert f"saved a checkpoint at step 3; {RESUME}" in said.err + said.out and "--resume" not in said.err


def test_a_second_ctrl_c_stops_at_once_without_a_checkpoint(data_dir, tmp_path, monkeypatch):
    from codeforge.cli import main
    orig = Trainer._optimisation_step

    def step_then_two(self):
        out = orig(self)
        if self.step == 2:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
        return out

    monkeypatch.setattr(Trainer, "_optimisation_step", step_then_two)
    run = tmp_path / "r"
    args = ["train", "--data", str(data_dir), "--out", str(run), "--n-layer", "1", "--n-head", "2",
            "--n-embd", "32",
            "--block-size", "32", "--batch-size", "2", "--max-iters", "100", "--eval-every", "50",
            "--eval-tokens", "64", "--device", "cpu", "--no-progress"]
    before = signal.getsignal(signal.SIGINT)  # Python's default, or SIG_IGN when started in the background
    assert main(args) == 130
    assert not (run / "checkpoints").exists() or not list((run / "checkpoints").glob("step_*3"))
    assert signal.getsignal(signal.SIGINT) is before  # the trainer's handler is gone, the one before is back


@pytest.mark.parametrize("native_bf16", ["1", "0"])
def test_quickstart_recipe_on_both_kinds_of_cpu(data_dir, tmp_path, monkeypatch, native_bf16):
    """The quickstart's recipe, `--preset cpu-small lowend-cpu`, picks bf16
    autocast on a CPU with native bfloat16
    and fp32 elsewhere (precision "fastest"); the choice is forced both ways
    here (CODEFORGE_CPU_BF16), so each
    path is tested on every CPU, not only on the machine that happens to have it. Its recipe (Muon:
    Newton-Schulz in bf16 where native, float32 elsewhere) then trains."""
    from codeforge.device import choose_precision, cpu_native_bf16
    from codeforge.quickstart import PRESETS
    monkeypatch.setenv("CODEFORGE_CPU_BF16", native_bf16)
    assert cpu_native_bf16() is (native_bf16 == "1")
    flags = {**TINY, "train.data": str(data_dir), "train.out": str(tmp_path / "run"), "train.max_iters": 30,
             "train.eval_every": 0, "train.save_every": 0, "train.local_ranks": 1}
    cfg = resolve(PRESETS, None, [], flags, vocab_from_data=True)
    assert cfg.train.optimizer == "muon" and cfg.train.precision == "fastest"
    precision, why = choose_precision(torch.device("cpu"), cfg.train.precision)
    assert precision == ("bf16" if native_bf16 == "1" else "fp32") and why.startswith("fastest")
    assert choose_precision(torch.device("cpu"), "auto")[0] == "fp32"  # auto stays fp32 on every CPU
    msgs = []
    r = run_stage(cfg, log=msgs.append)
    assert f"precision: {precision} (fastest" in "\n".join(msgs)
    ls = losses(tmp_path / "run")
    assert r["step"] == 30 and all(math.isfinite(v) for v in ls.values())
    first, last = sum(ls[s] for s in range(1, 4)) / 3, sum(ls[s] for s in range(28, 31)) / 3
    assert last < first - 1.0, (precision, first, last)


def test_the_lowend_cpu_profile_is_the_quickstarts_processes(monkeypatch):
    """`--preset cpu-small lowend-cpu` splits its batch of 16 over one process per usable core (up to 4), as
    the quickstart does; on a GPU, or with --local-ranks given, nothing changes."""
    from codeforge.stages import local
    from codeforge.quickstart import PRESETS
    for cores, want in ((2, 2), (3, 2), (8, 4), (1, 1)):
        monkeypatch.setattr(local, "usable_cores", lambda c=cores: c)
        cfg = resolve(PRESETS, None, [], {"train.device": "cpu"})
        assert cfg.train.local_ranks == 0 and cfg.train.batch_size == 16
        cfg = local.resolve_auto(cfg)
        assert (cfg.train.local_ranks, cfg.train.batch_size) == (want, 16 // want)
    cfg = resolve(PRESETS, None, ["train.local_ranks=3", "train.batch_size=6"], {"train.device": "cpu"})
    assert local.resolve_auto(cfg) is cfg  # --local-ranks given: nothing to choose


def test_cpu_bf16_switch_refuses_a_typo(monkeypatch):
    from codeforge.device import DeviceError, cpu_native_bf16
    monkeypatch.setenv("CODEFORGE_CPU_BF16", "maybe")
    with pytest.raises(DeviceError, match="CODEFORGE_CPU_BF16='maybe'"):
        cpu_native_bf16()


def test_evaluation_is_sized_to_a_short_run_and_eval_scores_the_same(data_dir, tmp_path):
    from codeforge.evaluation.lm import EVAL_FLOOR, sized_eval_tokens
    from codeforge.evaluation.run import run_eval
    assert sized_eval_tokens(262_144, 40 * 2048, 1) == EVAL_FLOOR  # 40 steps: the floor
    assert sized_eval_tokens(262_144, 560 * 2048, 6) == 560 * 2048 // 48  # the quickstart's shape
    assert sized_eval_tokens(262_144, 10**10, 21) == 262_144  # a long run: what was asked
    assert sized_eval_tokens(0, 40 * 2048, 1) == 0  # the whole split stays the whole split
    said = []
    out = tmp_path / "run"
    cfg = cfg_for(data_dir, out, train__max_iters=4, train__eval_every=2, train__eval_tokens=262_144)
    run_stage(cfg, log=said.append)
    assert any("evaluation: up to 16,384 validation tokens each (of --eval-tokens 262,144)" in m
               for m in said), said
    import tomllib
    saved = tomllib.loads((out / "config.toml").read_text())
    assert saved["train"]["eval_tokens"] == EVAL_FLOOR
    vals = [json.loads(x) for x in open(out / "metrics.jsonl") if "val_loss" in x]
    # steps 0, 2, 4: the same set each time
    assert len(vals) == 3 and len({v["val_tokens"] for v in vals}) == 1
    r = run_eval(str(out), syntax_samples=0, humaneval=0)
    assert r["eval_tokens"] == vals[-1]["val_tokens"] and abs(r["val_loss"] - vals[-1]["val_loss"]) < 1e-5


def test_time_budget_is_fitted_again_when_the_pace_changes(tmp_path, monkeypatch):
    """--time-budget: the count chosen from the first steps is fitted again after each evaluation, at the pace
    of the run so far, so load that arrives later shortens the run instead of overrunning the budget. The
    trainer's clock is one the test moves: 0.05 s a step, then 0.5 (as if another job took the cores)."""
    import tomllib
    import types

    from codeforge.models import build_model
    from codeforge.train import trainer as trainer_module
    clock = {"now": 0.0, "calls": 0}
    monkeypatch.setattr(trainer_module, "time", types.SimpleNamespace(perf_counter=lambda: clock["now"]))
    cfg = resolve([], None, [], {**TINY, "model.vocab_size": 256, "model.n_layer": 1, "model.n_embd": 32,
                                 "model.block_size": 16, "train.batch_size": 2, "train.eval_every": 10,
                                 "train.save_every": 0, "train.time_budget": 6.0})
    model = build_model(cfg.model)

    def loss_fn(m, batch):
        clock["calls"] += 1
        clock["now"] += 0.05 if clock["calls"] <= 15 else 0.5
        return m(*batch), {}
    said: list[str] = []
    t = Trainer(model, ToyBatches(B=2, T=16), loss_fn, cfg.train, tmp_path / "run",
                device=torch.device("cpu"),
                precision="fp32", total_steps=100_000, tokens_per_step=32, run_config=cfg.to_dict(),
                evaluate=lambda m: {"val_loss": 1.0, "perplexity": 2.7, "bits_per_byte": 1.0},
                log=said.append)
    t.run()
    first = next(m for m in said if m.startswith("time budget") and "measured" in m)
    chosen = int(first.split(", so ")[1].split(" steps")[0])
    again = [m for m in said if "instead of" in m]
    assert chosen > 100 and again, said  # 6 s at 0.05 s a step, then fitted again once the pace fell
    # it ends within one evaluation interval of slow steps of its budget (it checks at evaluations), where the
    # first count would have run to ~57 s
    assert t.step <= 31 and clock["now"] <= 6.0 + 10 * 0.5
    saved = tomllib.loads((tmp_path / "run" / "config.toml").read_text())["train"]
    assert saved["max_iters"] == t.step and saved["time_budget"] == 0


def test_a_budgeted_run_warns_about_the_plan_it_follows(data_dir, tmp_path, capsys):
    """The repository stage warned "N passes: the model will memorise" for --max-iters' count, then the time
    budget trained a fraction of one pass. Now a budgeted run says its plan is up to the budget, and says
    the plan again, judged, once the budget has chosen the count."""
    from codeforge.cli import main
    args = ["train", "--data", str(data_dir), "--out", str(tmp_path / "r"), "--n-layer", "1", "--n-head", "2",
            "--n-embd", "32", "--block-size", "32", "--batch-size", "2", "--max-iters", "100000",
            "--time-budget", "3", "--eval-every", "100000", "--eval-tokens", "64", "--device", "cpu",
            "--no-progress"]
    assert main(args) == 0
    said = capsys.readouterr()
    text = said.out + said.err
    assert "up to 100,000 steps" in text and "the time budget chooses how many" in text
    assert "will memorise" not in text  # a few seconds of steps are a fraction of one pass
    plans = [line for line in text.splitlines() if line.startswith("plan: ")]
    assert len(plans) == 2 and "up to" in plans[0]
    import re
    chosen = int(re.search(r"so (\d+) steps \(of --max-iters", text).group(1))
    assert plans[1].startswith(f"plan: {chosen:,} steps") and "up to" not in plans[1]  # judged, the count run
