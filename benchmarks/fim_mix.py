"""Which fill-in-the-middle mix the quickstart should train: file-level FIM
alone, or with repo-level documents.

Each setting trains the quickstart's recipe (its presets, 4,096 tokens a step, a fixed step count so every
setting gets the same steps whatever the load) on the same corpus, tokenizer and validation split, with one
or more seeds (weights, data order and the FIM cuts all follow the seed). Then, per run:
  - held-out bits per byte on the corpus' validation split (the left-to-right cost of the FIM documents);
  - `codeforge eval --repo` on libraries no setting trained on (pure-Python packages installed beside
    codeforge: packaging, h11, click by default), with the repository's other files as context (as
    llama.vscode sends them) and without: edit similarity and the share of filled files that parse.

A setting is FIM_RATE:REPO_FIM: the loader's file-level FIM share and `prepare --repo-fim`'s share.

    python benchmarks/fim_mix.py --settings 0.5:0 0.5:0.25 0.5:0.5 --seeds 0 1 --out /tmp/fim_mix
    python benchmarks/fim_mix.py --steps 60 --settings 0.5:0 0.5:0.5 --seeds 0
    --heldout packaging  # a quick look

It prints one table (mean over seeds, then each seed) and writes OUT/results.json. About 6 minutes a run on
2 idle cores at 560 steps, plus about a minute of eval --repo per library.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sysconfig
import time
from dataclasses import replace
from pathlib import Path

from codeforge import quickstart
from codeforge.config import resolve
from codeforge.corpus import CorpusOptions
from codeforge.data.shards import prepare
from codeforge.evaluation.repo import run_repo_eval
from codeforge.evaluation.run import run_eval
from codeforge.stages import run as run_stage
from codeforge.stages.local import resolve_auto


def heldout_dirs(names: list[str]) -> list[Path]:
    site = Path(sysconfig.get_paths()["purelib"])
    out = []
    for n in names:
        p = Path(n) if "/" in n else site / n
        if not p.is_dir():
            raise SystemExit(f"--heldout {n}: no directory {p} (a package "
                             "installed beside codeforge, or a path)")
        out.append(p)
    return out


def train_one(data: Path, out: Path, fim_rate: float, seed: int, steps: int) -> Path:
    if (out / "checkpoints").exists() and any((out / "checkpoints").glob("step_*")):
        return out  # already trained (the benchmark resumes where it stopped)
    flags = {**{f"train.{k}": v for k, v in quickstart.RUN.items()},
             "train.data": str(data), "train.out": str(out), "train.max_iters": steps, "train.device": "cpu",
             "train.fim_rate": fim_rate, "train.seed": seed}
    cfg = resolve(quickstart.PRESETS, None, [], flags, vocab_from_data=True)
    meta = json.loads((data / "meta.json").read_text())
    cfg = replace(cfg,
                  train=replace(cfg.train,
                                eval_every=quickstart.eval_cadence(cfg, meta["splits"]["train"]["tokens"])))
    cfg = resolve_auto(cfg)
    run_stage(cfg, resume=False)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", default="python-stdlib", help="as the quickstart's --corpus")
    ap.add_argument("--settings", nargs="+", default=["0.5:0", "0.5:0.25", "0.5:0.5"],
                    help="FIM_RATE:REPO_FIM")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    ap.add_argument("--steps", type=int, default=quickstart.STEPS)
    ap.add_argument("--heldout", nargs="+", default=["packaging", "h11", "click"])
    ap.add_argument("--cases", type=int, default=20, help="eval --repo cases per kind and library")
    ap.add_argument("--out", default="/tmp/fim_mix")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    src, langs = quickstart.corpus_path(a.corpus)
    libs = heldout_dirs(a.heldout)
    opts = CorpusOptions(languages=langs, exclude_tests=True,
                         val_fraction=quickstart._sized_split(src, langs, None))
    tok_dir = quickstart._tokenizer(out, src, opts)
    rows = []
    for seed in a.seeds:  # every setting at one seed first: a stopped benchmark still compares them
        for setting in a.settings:
            fim_rate, repo_fim = (float(x) for x in setting.split(":"))
            data = out / f"data-repo{repo_fim:g}"
            if not (data / "meta.json").exists():
                prepare([src], tok_dir, data, opts, overwrite=True, log=lambda m: None, repo_fim=repo_fim)
            dmeta = json.loads((data / "meta.json").read_text())
            t0 = time.perf_counter()
            run = train_one(data, out / f"run-fim{fim_rate:g}-repo{repo_fim:g}-seed{seed}", fim_rate, seed,
                            a.steps)
            minutes = (time.perf_counter() - t0) / 60
            ev = run_eval(str(run), syntax_samples=0, device="cpu", which="latest")
            row = {"setting": setting, "fim_rate": fim_rate, "repo_fim": repo_fim, "seed": seed,
                   "steps": a.steps,
                   "train_tokens": dmeta["splits"]["train"]["tokens"], "bits_per_byte": ev["bits_per_byte"],
                   "minutes": round(minutes, 1), "repo": {}}
            for lib in libs:
                r = run_repo_eval(str(lib), run=str(run), n=a.cases, seed=0, device="cpu", which="latest",
                                  both=True)
                row["repo"][lib.name] = {"with": r["scores"]["all"],
                                         "without": r["scores_without_context"]["all"]}
            rows.append(row)
            print(json.dumps(row), flush=True)
            (out / "results.json").write_text(json.dumps(rows, indent=1))
    report(rows, [lib.name for lib in libs])


def report(rows: list[dict], libs: list[str]) -> None:
    def mean(vals):
        return statistics.fmean(vals) if vals else float("nan")

    def cols(rs):
        c = [mean([r["bits_per_byte"] for r in rs])]
        for ctx in ("with", "without"):
            c.append(mean([r["repo"][lib][ctx]["edit_similarity"] for r in rs for lib in libs]))
            c.append(mean([r["repo"][lib][ctx]["syntax_valid"] for r in rs for lib in libs]))
        return c

    head = ("| setting (fim:repo) | seeds | held-out bpb | edit sim, context | parses, context | edit sim, "
            "none | parses, none |")
    print("\n" + head + "\n" + "| --- " * 7 + "|")
    for setting in dict.fromkeys(r["setting"] for r in rows):
        rs = [r for r in rows if r["setting"] == setting]
        c = cols(rs)
        print(f"| {setting} | {','.join(str(r['seed']) for r in rs)} | {c[0]:.3f} | {c[1]:.3f} | {c[2]:.1%} "
              f"| {c[3]:.3f} | {c[4]:.1%} |")
    print(f"\n(edit similarity and parses: mean over {', '.join(libs)}; per seed:)")
    for r in rows:
        c = cols([r])
        print(f"| {r['setting']} | {r['seed']} | {c[0]:.3f} | "
              f"{c[1]:.3f} | {c[2]:.1%} | {c[3]:.3f} | {c[4]:.1%} |")


if __name__ == "__main__":
    main()
