"""A small repository trained from scratch: on its own files alone, or on a base of public code first (the
quickstart's default for a small repository), at equal total steps.

Each library is a pure-Python package installed beside codeforge (no test uses them), taken as "your
repository". Both arms are `codeforge quickstart --corpus LIB --max-iters STEPS` (its recipe, its split of
the library's files by content hash, the same in both arms): `--base none` trains STEPS steps on the
library; the default trains a base on Python's standard library for 3/4 of the steps, then the library from
the base's best weights. Both are scored on the library's held-out files: bits per byte of the best
checkpoint (tokenizer-free, so the two arms' different tokenizers compare) and `eval --repo` (edit
similarity and parseable fills, with other files as context and without).

    python benchmarks/base_then_repo.py --libs markdown_it starlette --out /tmp/base_then_repo

Equal steps are equal compute for the model (the same shape, batch and context); the base arm also
tokenizes the standard library once (printed as prepare seconds). About 15
minutes per library on 2 idle cores.
"""

from __future__ import annotations

import argparse
import json
import sysconfig
import time
from pathlib import Path

from codeforge.evaluation.repo import run_repo_eval
from codeforge.quickstart import STEPS, run_quickstart


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--libs", nargs="+", default=["markdown_it", "starlette"])
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--cases", type=int, default=20, help="eval --repo cases of each kind")
    ap.add_argument("--out", default="/tmp/base_then_repo")
    a = ap.parse_args()
    site = Path(sysconfig.get_paths()["purelib"])
    rows = []
    for lib in a.libs:
        src = site / lib if "/" not in lib else Path(lib)
        for base in ("none", "auto"):
            out = Path(a.out) / f"{src.name}-{base}"
            t0 = time.perf_counter()
            r = run_quickstart(str(out), corpus=str(src), max_iters=a.steps, base=base, device="cpu")
            minutes = (time.perf_counter() - t0) / 60
            fim = run_repo_eval(str(src), run=str(out / "run"), n=a.cases, device="cpu", both=True)
            row = {"lib": src.name, "base": base, "steps": a.steps, "bits_per_byte": r["bits_per_byte"],
                   "scored_step": r["scored_step"], "minutes": round(minutes, 1),
                   "held_out_files": fim["held_out_files"], "cases": fim["cases"],
                   "with": fim["scores"]["all"], "without": fim["scores_without_context"]["all"]}
            rows.append(row)
            print(json.dumps(row), flush=True)
            Path(a.out, "results.json").write_text(json.dumps(rows, indent=1))
    print("\n| library | arm | held-out bpb | best step | edit "
          "sim, context | parses | edit sim, none | parses |")
    print("| --- " * 8 + "|")
    for r in rows:
        arm = "repository alone" if r["base"] == "none" else "base, then repository"
        print(f"| {r['lib']} ({r['held_out_files']} held-out files) | {arm} | {r['bits_per_byte']:.3f} | "
              f"{r['scored_step']} | {r['with']['edit_similarity']:.3f} | {r['with']['syntax_valid']:.0%} | "
              f"{r['without']['edit_similarity']:.3f} | {r['without']['syntax_valid']:.0%} |")


if __name__ == "__main__":
    main()
