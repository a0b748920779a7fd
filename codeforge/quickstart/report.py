"""The last stage of a language model's recipe: the best checkpoint scored (training's own validation numbers
where it has them; syntax, HumanEval and fill-in-the-middle on your held-out files new), a sample, and what
to run next.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from .. import rundir
from ..checkpoint import find_checkpoint
from ..engine import Engine, SamplingParams
from ..evaluation.lm import EvalError
from ..evaluation.repo import run_repo_eval
from ..evaluation.run import run_eval
from ..open_model import has_fim
from ..sandbox import SandboxUnavailable, check_available
from ..tokenizer import CodeTokenizer
from .survey import Quickstart

REPO_CASES = 10  # eval --repo cases of each kind the quickstart scores on your held-out files
# a later evaluation this share above the best is called a rise (0.003 nats on 3.4 was said to be one)
ROSE = 0.01
PROMPTS = {"python": "def fibonacci(n):\n", "go": "func fibonacci(n int) int {\n"}
HINTS = {"python": "def ", "go": "func "}


def humaneval_problems(lang: str | None) -> tuple[int, str]:
    """(HumanEval problems to score, why none: said on the stage's first line)."""
    if lang != "python":
        why = f"its problems are Python, and this corpus is {lang or 'in another language'}"
        print(f"      HumanEval skipped: {why}")
        return 0, why
    try:
        check_available()
    except SandboxUnavailable as e:
        print(f"      HumanEval skipped: {e}")
        return 0, "no sandbox: see above"
    return 5, ""


def evaluate(q: Quickstart, small_model: bool) -> dict:
    """Score the best checkpoint, print a sample. small_model: one trained here, too small to pass HumanEval
    (an imported open model is not said to be)."""
    print(f"{q.head} eval and sample (the validation loss is training's; syntax and HumanEval are new)")
    he, he_skip = humaneval_problems(q.lang)
    evals = validations(q.run_dir)
    best = find_checkpoint(q.run_dir, "auto")
    best_step = int(best.name.split("_")[-1]) if best.name.startswith("step_") else None
    ev = run_eval(str(best), syntax_samples=8, humaneval=he, ks=[1, 5], samples_per_problem=5,
                  max_new_tokens=128, timeout=5.0, device=q.opts.device, language=q.lang,
                  validation=evals.get(best_step))
    prompt = PROMPTS.get(q.lang, "")
    sample = Engine.from_run(str(best), q.opts.device).generate(
        [prompt], SamplingParams(max_new_tokens=96, temperature=0.7, top_k=40, seed=0))[0]
    trained_step = q.result["step"]
    if ev.get("eval_split") == "train":
        print(f"\nthe checkpoint at step {ev['step']}; there is no validation split, so this scores the "
              f"training split, which the model has seen (a corpus of more files gives one):\n"
              f"training-split loss {ev['val_loss']:.3f} (perplexity {ev['perplexity']:.1f}), "
              f"{ev['bits_per_byte']:.3f} bits per byte")
    else:
        print(f"\n{scored_checkpoint(ev['step'], trained_step, evals)}:\nvalidation loss "
              f"{ev['val_loss']:.3f} (perplexity {ev['perplexity']:.1f}), {ev['bits_per_byte']:.3f} bits "
              f"per byte")
    sv = ev["syntax_valid_rate"]
    sv_text = ("n/a (no function in the validation files to prompt with)" if sv is None
               else share(round(sv * ev["syntax_samples"]), ev["syntax_samples"]))
    if ev["pass_at_1"] is None:
        he_text = f"HumanEval not run ({he_skip or 'no problems scored'})"
    else:
        he_text = (f"HumanEval pass@1 {ev['pass_at_1']:.3f}, pass@5 {ev['pass_at_k'].get('5', 0.0):.3f} on "
                   f"{ev['humaneval_problems']} problems"
                   + (" (a model this small is not expected to pass any)" if small_model else ""))
    print(f"syntax-valid completions: {sv_text}; {he_text}")
    fim = repo_fim_score(q.src, best, q.opts.device) if not q.langs else None  # your own code, as editors ask
    print(f"sample (step {ev['step']}):\n{prompt}{sample}\n")
    print(f"finished in {(time.perf_counter() - q.started) / 60:.1f} min. Next: codeforge generate --run "
          f"{q.run_dir} --prompt {HINTS.get(q.lang, '')!r}   |   codeforge eval --run {q.run_dir}   |   "
          f"tensorboard --logdir {q.run_dir}/tensorboard")
    # step: training's; scored_step: the checkpoint's
    return {**ev, "step": trained_step, "scored_step": ev["step"], **({"repo_eval": fim} if fim else {})}


def share(k: int, n: int) -> str:
    """'k of n' where n is too small for a percentage to mean much, else 'p% of n'."""
    return f"{k} of {n} parse" if n < 10 else f"{k / n:.0%} of {n}"


def repo_fim_score(src: str, best: Path, device: str) -> dict | None:
    """`eval --repo` on your held-out files (the validation split: files the run trained on are left out),
    with the other files as context, printed in a line; None (and said) when no held-out file gives a case."""
    if not has_fim(CodeTokenizer.load(best / "tokenizer", log=lambda m: None).special_ids):
        print("fill-in-the-middle on your files: not scored (the model's tokenizer has no FIM tokens)")
        return None
    try:
        r = run_repo_eval(src, run=str(best), n=REPO_CASES, device=device)
    except EvalError as e:
        print(f"fill-in-the-middle on your held-out files: not scored ({str(e).splitlines()[0]})")
        return None
    a = r["scores"]["all"]
    held = r["held_out_checked"]  # the run's record is complete: no file it trained on is among these
    print(f"fill-in-the-middle on your {'held-out ' if held else ''}files (as an editor asks, with other "
          f"files as context): {r['cases']} cases from {r['held_out_files']} files, exact "
          f"{a['exact_match']:.0%}, edit similarity {a['edit_similarity']:.3f}, {a['syntax_valid']:.0%} of "
          f"filled files parse (codeforge eval --repo)")
    if not held:  # a model imported with --from-hf trained on what nobody here knows, maybe these very files
        unknown = r.get("held_out_unknown") or "what the run trained on is not known"
        print(f"      not a held-out score: {unknown} (the {r['trained_on_files']} file(s) it is known to "
              f"have trained on were left out)")
    return r


def validations(run_dir: Path) -> dict[int, dict]:
    """Training's evaluations (RUN/metrics.jsonl) by step, in run_eval's names, so the quickstart's last stage
    does not score a checkpoint training already scored on the same tokens; the last record of a step wins
    (a resumed run may have evaluated it again)."""
    out: dict[int, dict] = {}
    try:
        with open(run_dir / rundir.METRICS) as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue  # a line cut by a crash
                if not (isinstance(rec, dict) and "val_loss" in rec and "val_bpb" in rec
                        and isinstance(rec.get("step"), int)):
                    continue
                out[rec["step"]] = {"val_loss": rec["val_loss"], "perplexity": rec.get("val_perplexity"),
                                    "bits_per_byte": rec["val_bpb"], "eval_tokens": rec.get("val_tokens"),
                                    "validation_step": rec["step"]}
    except OSError:
        pass
    return out


def scored_checkpoint(step: int, at: int, evals: dict[int, dict]) -> str:
    """Which weights the summary scores, by step, and where the run's last evaluation stands beside them."""
    if step == at:
        return f"the checkpoint at step {step} (the run's last, and its best on validation)"
    last = max(evals) if evals else None
    tail = ""
    if last is not None and last > step:
        rise = evals[last]["val_loss"] - evals[step]["val_loss"] if step in evals else None
        tail = f"; the last evaluation, at step {last}, scored {evals[last]['val_loss']:.3f}"
        if rise is not None and rise < ROSE * evals[step]["val_loss"]:
            # within the noise of a small validation split: no sign of memorising, and not said to be one
            tail += f", {rise:.3f} above it (no real rise)"
        else:
            tail += (f": validation loss rose after step {step} (the model memorising its training files, "
                     f"when there are few)")
    return f"the best checkpoint: step {step} of the run's {at}{tail}"
