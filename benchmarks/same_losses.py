"""Do two checkouts of codeforge train the same, bit for bit? (pretraining, chat SFT, DPO, a reward model)

Runs the same small pretraining, chat SFT, DPO and reward-model run (CPU, float32, fixed seed and threads)
with each checkout's code and prints both loss curves and whether they are bit-identical.

Used to check that a restructuring changed no behaviour: put the old commit in a worktree and compare,

    git worktree add /tmp/old <commit>
    python benchmarks/same_losses.py --old /tmp/old --new .

Data: the Python standard library's json and email packages (always on the machine).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

STDLIB = Path(sysconfig.get_paths()["stdlib"])
TINY = ["--n-layer", "2", "--n-head", "2", "--n-embd", "64", "--block-size", "256", "--batch-size", "4",
        "--eval-every", "10", "--save-every", "10", "--log-every", "1", "--no-progress", "--device", "cpu",
        "--precision", "fp32", "--no-tensorboard", "--threads", "2"]  # threads fixed: the
# default follows the cores other work leaves free, and another thread count sums in another order


EMPTY_DIR = tempfile.mkdtemp(prefix="same_losses_cwd_")


def cf(checkout: Path, *args: str) -> None:
    # run from an empty directory: `python -m` puts the working directory first on the import path, so run
    # from a checkout it would import that checkout's codeforge whatever PYTHONPATH says (and from a shared
    # directory such as /tmp, any stray timeit.py there would shadow the standard library's)
    env = {**os.environ, "PYTHONPATH": str(checkout.resolve())}
    here = EMPTY_DIR
    found = subprocess.run([sys.executable, "-c", "import codeforge; print(codeforge.__file__)"], env=env,
                           cwd=here, capture_output=True, text=True).stdout.strip()
    if not Path(found).resolve().is_relative_to(checkout.resolve()):
        raise SystemExit(f"{checkout}: `import codeforge` finds {found}, not this checkout's")
    r = subprocess.run([sys.executable, "-m", "codeforge", *args], env=env, capture_output=True, text=True,
                       cwd=here)
    if r.returncode:
        raise SystemExit(f"{checkout}: codeforge {' '.join(args)} failed:\n{r.stderr[-3000:]}")


def losses(run: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def pipeline(checkout: Path, work: Path) -> dict[str, dict[int, float]]:
    src = [str(STDLIB / "json"), str(STDLIB / "email")]
    cf(checkout, "tokenizer", "train", "--input", *src, "--vocab-size", "1024", "--out", str(work / "tok"))
    cf(checkout, "prepare", "--input", *src, "--tokenizer", str(work / "tok"), "--out", str(work / "data"),
       "--val-fraction", "0.1")
    cf(checkout, "train", "--data", str(work / "data"), "--out", str(work / "pre"), "--max-iters", "30",
       *TINY)
    cf(checkout, "make-sft", "--input", *src, "--languages", "python", "--out", str(work / "pairs"))
    cf(checkout, "prepare", "--chat", "--input", str(work / "pairs" / "train.jsonl"), "--tokenizer",
       str(work / "tok"), "--out", str(work / "sft_data"), "--val-fraction", "0.1")
    cf(checkout, "train", "--stage", "sft", "--data", str(work / "sft_data"), "--out", str(work / "sft"),
       "--init-from", str(work / "pre"), "--max-iters", "20", *TINY)
    cf(checkout, "make-pairs", "--input", *src, "--languages", "python", "--max-pairs", "200",
       "--out", str(work / "pairs_pref"))
    for stage in ("dpo", "reward"):
        cf(checkout, "train", "--stage", stage, "--data", str(work / "pairs_pref"), "--out",
           str(work / stage), "--init-from", str(work / "sft"), "--max-iters", "10", *TINY)
    return {"pretrain": losses(work / "pre"), "sft": losses(work / "sft"), "dpo": losses(work / "dpo"),
            "reward": losses(work / "reward")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", type=Path, required=True, help="checkout of the code before the change")
    ap.add_argument("--new", type=Path, default=Path("."),
                    help="checkout of the code after it (default: here)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        old = pipeline(a.old, Path(d) / "old")
        new = pipeline(a.new, Path(d) / "new")
    print(f"{'run':8} {'steps':>5}  {'first loss (old / new)':>26} "
          f" {'last loss (old / new)':>26}  bit-identical")
    for run in ("pretrain", "sft", "dpo", "reward"):
        o, n = old[run], new[run]
        same = o == n
        first, last = min(o), max(o)
        differ = [s for s in sorted(set(o) | set(n)) if o.get(s) != n.get(s)]
        print(f"{run:8} {len(o):5d}  {o[first]:12.9f} / {n.get(first, float('nan')):12.9f}  "
              f"{o[last]:12.9f} / {n.get(last, float('nan')):12.9f}  {'yes' if same else 'NO'}"
              + "".join(f"\n         step {s}: {o.get(s)} / {n.get(s)}" for s in differ[:5]))


if __name__ == "__main__":
    main()
