"""The training rate of a whole `codeforge train` command (every process it starts: --local-ranks included),
for benchmarks/under_load.py: it trains --steps steps of the quickstart's model and recipe (`cpu-small
lowend-cpu`, batch 16 x 256 tokens in all) on prepared shards into a temporary run directory, and prints one
JSON line: the median of the tokens/s the run logged after its first --skip steps, and the settings.

    python benchmarks/train_run_rate.py --data runs/quickstart/data [--local-ranks 2] [--steps 12] [--json]
    python benchmarks/under_load.py --loads none,spin6 -- python
    benchmarks/train_run_rate.py --data D --local-ranks 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True,
                    help="shards from `codeforge prepare` (e.g. runs/quickstart/data)")
    ap.add_argument("--local-ranks", type=int, default=1, help="processes; the batch is split between them")
    ap.add_argument("--batch", type=int, default=16, help="sequences per step, all ranks together")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--skip", type=int, default=2, help="logged steps left out of the median (start-up)")
    ap.add_argument("--precision", default="auto",
                    help="fp32, bf16 (the quickstart's on a CPU with native bf16)")
    ap.add_argument("--json", action="store_true", help="(the output is JSON either way)")
    a = ap.parse_args()
    if a.batch % a.local_ranks:
        ap.error(f"--batch {a.batch} does not split over --local-ranks {a.local_ranks}")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "codeforge", "train", "--preset", "cpu-small", "lowend-cpu", "--data",
               a.data,
               "--out", str(out), "--max-iters", str(a.steps), "--batch-size", str(a.batch // a.local_ranks),
               "--local-ranks", str(a.local_ranks), "--eval-every", "0", "--eval-tokens", "4096",
               "--log-every", "1",
               "--save-every", "0", "--warmup-steps", "5", "--no-progress", "--no-tensorboard",
               "--precision", a.precision]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            sys.exit(f"codeforge train failed ({r.returncode}):\n{r.stderr[-3000:]}")
        rates = [x["tokens_per_s"] for x in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
                 if "tokens_per_s" in x][a.skip:]
    print(json.dumps({"tokens_per_s": statistics.median(rates), "local_ranks": a.local_ranks,
                      "steps": a.steps, "precision": a.precision,
                      "logged": len(rates)}))


if __name__ == "__main__":
    main()
