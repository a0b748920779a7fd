"""Preference and RL stages from one small SFT checkpoint, on held-out procedural tasks (issue 14).

Everything goes through the `codeforge` command line, as a user would run it:

  make-tasks (train / held-out test split) -> a tokenizer on the training tasks' text -> prepare --chat of
  the training tasks' conversations -> train --stage sft from scratch (the common starting point) ->
  make-pairs --tasks (every rejected side fails its tests) -> from the SFT run:
     reward (Bradley-Terry) then ppo with that reward model (rewards from the model only),
     dpo (plain), dpo with the chosen side's LM loss (RPO, --dpo-sft 1),
     grpo (execution rewards from the sandbox),
     sft-more (the same SFT data for the same number of steps: the baseline any method must beat)
  -> eval --tasks on the held-out test split (greedy pass@1, syntax-valid rate, mean execution reward).

"Equal compute" is equal optimizer steps (--steps) of the same model at the same micro-batch size; the
wall-clock seconds of each stage are printed beside it, since a step of each method costs differently
(DPO runs the policy on both sides and a reference; PPO and GRPO also generate and run code; PPO's reward
model is trained first and its seconds are counted in PPO's). The table goes to stdout and --out as JSON.

  python benchmarks/preference_rl.py --work /tmp/prefrl [--tasks 1500] [--sft-steps 300] [--steps 60]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

MODEL = ["--set", "model.n_layer=4", "--set", "model.n_head=4", "--set", "model.n_embd=128",
         "--set", "model.block_size=320", "--set", "model.pos=rope", "--set", "model.norm=rmsnorm",
         "--set", "model.mlp=swiglu", "--set", "model.bias=false"]


def cf(*args: str, log: Path | None = None) -> float:
    """Run `codeforge ARGS`; the seconds it took. Output goes to log (appended) or the terminal."""
    t = time.perf_counter()
    cmd = [sys.executable, "-m", "codeforge.cli", *args]
    with open(log, "a") if log else open("/dev/null", "w") as out:
        if log:
            out.write("$ codeforge " + " ".join(args) + "\n")
            out.flush()
        rc = subprocess.call(cmd, stdout=out if log else None, stderr=subprocess.STDOUT if log else None)
    if rc:
        raise SystemExit(f"codeforge {' '.join(args)} failed ({rc}); see {log}")
    return time.perf_counter() - t


def evaluate(run: Path, tasks: Path, limit: int, log: Path) -> dict:
    out = subprocess.run([sys.executable, "-m", "codeforge.cli", "eval", "--run", str(run), "--tasks",
                          str(tasks),
                          "--task-limit", str(limit), "--max-new-tokens", "160", "--json", "--checkpoint",
                          "final", "--tool-cases", "0", "--syntax-samples", "0"],
                         capture_output=True, text=True)
    with open(log, "a") as f:
        f.write(out.stdout + out.stderr)
    if out.returncode:
        raise SystemExit(f"eval of {run} failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default="/tmp/codeforge_prefrl")
    ap.add_argument("--tasks", type=int, default=1500)
    ap.add_argument("--sft-steps", type=int, default=300)
    ap.add_argument("--steps", type=int, default=60, help="optimizer steps of every method from the SFT run")
    ap.add_argument("--lr", default="1e-4", help="learning rate of every method from the SFT run")
    ap.add_argument("--eval-limit", type=int, default=150, help="held-out tasks scored")
    ap.add_argument("--methods", nargs="+", default=["sft-more", "dpo", "dpo-rpo", "ppo", "grpo"])
    ap.add_argument("--out", default=None, help="JSON results (default WORK/results.json)")
    a = ap.parse_args()
    w = Path(a.work)
    w.mkdir(parents=True, exist_ok=True)
    log = w / "log.txt"
    common = ["--device", "cpu", "--set", "train.progress=false", "--set", "train.tensorboard=false"]
    seconds: dict[str, float] = {}
    if not (w / "tasks").exists():
        seconds["make-tasks"] = cf("make-tasks", "--out", str(w / "tasks"), "--count", str(a.tasks), log=log)
    if not (w / "tok").exists():
        corpus = w / "tok_corpus"
        corpus.mkdir(exist_ok=True)
        rows = [json.loads(x) for x in (w / "tasks" / "train.jsonl").read_text().splitlines()]
        (corpus / "tasks.py").write_text("\n\n".join("# " + r["prompt"].replace("\n", "\n# ") + "\n"
                                                     + r["solution"] for r in rows))
        cf("tokenizer", "train", "--input", str(corpus), "--vocab-size", "2048", "--out", str(w / "tok"),
           log=log)
    if not (w / "data").exists():
        cf("prepare", "--chat", "--input", str(w / "tasks" / "train.jsonl"), "--tokenizer", str(w / "tok"),
           "--out", str(w / "data"), "--val-fraction", "0.02", log=log)
    if not (w / "sft").exists():
        seconds["sft"] = cf("train", "--stage", "sft", "--data", str(w / "data"), "--out", str(w / "sft"),
                            *MODEL, *common, "--batch-size", "16", "--learning-rate", "3e-3", "--max-iters",
                            str(a.sft_steps), "--set", "train.warmup_steps=30", "--set", "train.eval_every=0",
                            log=log)
    if not (w / "pairs").exists():
        seconds["make-pairs"] = cf("make-pairs", "--tasks", str(w / "tasks"), "--out", str(w / "pairs"),
                                   log=log)
    sft = ["--init-from", str(w / "sft")]
    rl = ["--set", "train.rollout_tasks=8", "--set", "train.group_size=4", "--set",
          "train.rollout_tokens=160",
          "--batch-size", "16", "--set", "train.eval_every=0", "--set", "train.eval_tasks=16"]
    stages = {
        "sft-more": ["--stage", "sft", "--data", str(w / "data"), "--batch-size", "16", "--learning-rate",
                     a.lr, "--set", "train.eval_every=0"],
        "dpo": ["--stage", "dpo", "--data", str(w / "pairs"), "--batch-size", "8", "--learning-rate", a.lr,
                "--set", "train.eval_every=0"],
        "dpo-rpo": ["--stage", "dpo", "--data", str(w / "pairs"), "--batch-size", "8", "--learning-rate",
                    a.lr, "--set", "train.dpo_sft=1.0", "--set", "train.eval_every=0"],
        "ppo": ["--stage", "ppo", "--data", str(w / "tasks"), "--reward-model", str(w / "reward"),
                "--learning-rate", a.lr, *rl],
        "grpo": ["--stage", "grpo", "--data", str(w / "tasks"), "--learning-rate", a.lr, *rl],
    }
    results = {"sft": evaluate(w / "sft", w / "tasks", a.eval_limit, log)}
    for name in a.methods:
        run = w / name
        if run.exists():
            shutil.rmtree(run)
        extra = 0.0
        if name == "ppo":
            if (w / "reward").exists():
                shutil.rmtree(w / "reward")
            extra = cf("train", "--stage", "reward", "--data", str(w / "pairs"), "--out", str(w / "reward"),
                       *sft,
                       *common, "--batch-size", "8", "--learning-rate", a.lr, "--max-iters", str(a.steps),
                       "--set", "train.eval_every=0", log=log)
            rm = [json.loads(x) for x in (w / "reward" / "metrics.jsonl").read_text().splitlines()]
            results["reward_model"] = {k: v for k, v in rm[-1].items() if k.startswith("val_")}
        seconds[name] = extra + cf("train", *stages[name], "--out", str(run), *sft, *common, "--max-iters",
                                   str(a.steps), log=log)
        results[name] = evaluate(run, w / "tasks", a.eval_limit, log)
        if (run / "rollouts.jsonl").exists():
            rolls = [json.loads(x) for x in (run / "rollouts.jsonl").read_text().splitlines()]
            results[name]["rollouts"] = len(rolls)
            results[name]["early_exit_samples"] = sum(r.get("outcomes", {}).get("early_exit", 0)
                                                      for r in rolls)
            results[name]["rollout_samples"] = sum(sum(r.get("outcomes", {}).values()) for r in rolls)
            results[name]["first_rollout_reward"] = rolls[0]["reward"]
            results[name]["last_rollout_reward"] = rolls[-1]["reward"]
        print(f"{name}: {seconds[name]:.0f} s", flush=True)
    print(f"\nheld-out tasks: first {a.eval_limit} of {w / 'tasks'}/heldout.jsonl, greedy; {a.steps} steps "
          f"each at learning rate {a.lr} from the SFT run ({a.sft_steps} steps)\n")
    print("| model | pass@1 | solved | syntax-valid | mean reward | outcomes | train seconds |")
    print("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        if name == "reward_model":
            continue
        print(f"| {name} | {r['task_pass_at_1']:.1%} | {r['task_solved']}/{r['tasks']} | "
              f"{r['task_syntax_valid']:.1%} "
              f"| {r['task_mean_reward']:.3f} | {r['task_outcomes']} | {seconds.get(name, 0):.0f} |")
    if "reward_model" in results:
        print(f"\nreward model (held-out pairs): {results['reward_model']}")
    for name in ("ppo", "grpo"):
        if name in results and "rollouts" in results[name]:
            r = results[name]
            print(f"{name}: {r['rollouts']} rollouts, reward {r['first_rollout_reward']:.3f} -> "
                  f"{r['last_rollout_reward']:.3f}; early exits "
                  f"{r['early_exit_samples']}/{r['rollout_samples']}")
    Path(a.out or w / "results.json").write_text(json.dumps({"args": vars(a), "seconds": seconds,
                                                             "results": results}, indent=2))


if __name__ == "__main__":
    main()
