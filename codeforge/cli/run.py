"""Commands on a trained run: generate, eval, chat, serve, export, import.

Every option of these commands is a field of an options class declared with `fields.setting` (GenerateOptions
and ChatOptions here; EvalOptions in evaluation/options.py, ServeOptions in serve/options.py, ExportOptions
and ImportOptions in export/options.py): `add_flags` makes the flags, `from_args` builds the object back and
checks every value against its declared range before anything loads. Those modules import no torch, so
`codeforge CMD --help` answers at once.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import dataclass, fields
from pathlib import Path

from .. import printable
from ..evaluation.options import BIG, HUMANEVAL_PROBLEMS, MAX_TEMPERATURE, EvalOptions, RunOnDevice
from ..export.options import ExportOptions, ImportOptions
from ..fields import add_flags, default_of, describe, flag_name, from_args, setting, value_type
from ..serve.options import ServeOptions
from .args import CLIError


def sampling_options(new_tokens: int, temp: float, what: str) -> type:
    """The sampling options generate and chat share, with each command's defaults (new_tokens, temp) and the
    words for what the seed makes reproducible. The ranges are the ones the engine's SamplingParams.validate
    holds. (The arguments are not named after the fields: a class body does not see a function's names that
    it assigns itself.)"""

    @dataclass
    class Sampling:
        max_new_tokens: int = setting(new_tokens, range=(1, BIG), metavar="N",
                                      help="tokens to generate at most")
        temperature: float = setting(temp, range=(0.0, MAX_TEMPERATURE),
                                     help="sampling temperature; 0 is greedy")
        top_k: int = setting(50, range=(1, BIG), zero_means="off", metavar="K",
                             help="sample from the K most likely tokens only")
        top_p: float = setting(0.95, range=(0.0, 1.0), open_low=True, metavar="P",
                               help="sample from the smallest set of tokens whose probabilities "
                                    "reach P; 1 is off")
        # any seed a run's RNGs take (numpy's are 32-bit); generate's sample i uses seed + i
        seed: int | None = setting(None, type=int, range=(0, 2**32 - 1),
                                   help=f"random seed for reproducible {what} (default: fresh each run)")

    return Sampling


@dataclass
class GenerateOptions(sampling_options(128, 0.8, "samples; sample i uses seed + i"), RunOnDevice):
    """`codeforge generate`: a prompt (and a suffix to fill in the middle) continued by a run."""

    prompt: str | None = setting(None, metavar="TEXT", help="prompt text ('-' reads stdin)")
    prompt_file: str | None = setting(None, metavar="FILE",
                                      help="read the prompt from this file (the whole file is one prompt)")
    suffix: str | None = setting(None, metavar="TEXT",
                                 help="fill in the middle: the text after the gap (the prompt is the text "
                                      "before it); prints the whole filled text")
    suffix_file: str | None = setting(None, metavar="FILE", help="--suffix read from a file")
    show_plan: bool = setting(False,
                              help="hrm runs: print the plan and each refinement round (the decision head's "
                                   "p_done) before the code")
    repetition_penalty: float = setting(1.0, range=(0.0, 100.0), open_low=True,
                                        help="divide the logits of tokens already written by this; 1 is off")
    num_samples: int = setting(1, range=(1, 100_000), metavar="N",
                               help="how many samples to write, one after another")
    stop: list[str] = setting([],
                              help="stop sequence, repeatable; \\n and \\t are read as newline and tab (e.g. "
                                   "--stop '\\ndef ')")


@dataclass
class ChatOptions(sampling_options(256, 0.7, "replies"), RunOnDevice):
    """`codeforge chat`: a conversation with a chat run, at the terminal or from stdin."""

    system: str | None = setting(None, metavar="TEXT", help="system message")
    tools: str | None = setting(None, metavar="FILE",
                                help="JSON file with a list of tool schemas offered to the model")
    no_constrain: bool = setting(False,
                                 help="let tool calls be written freely instead of held to the tools' "
                                      "schemas: measure the bare model")


def flag_by_hand(parser: argparse.ArgumentParser, cls: type, name: str, **form) -> None:
    """The flag of field `name` of `cls` in a form add_flags does not make (form: argparse's nargs and const
    for an optional value, or action="append" for a repeatable flag). Its name, type, help and default are
    still the field's; the caller passes skip=(name,) to add_flags."""
    f = next(f for f in fields(cls) if f.name == name)
    action = parser.add_argument(flag_name(f), dest=name, type=value_type(f), default=default_of(f),
                                 metavar=f.metadata.get("metavar") or "TEXT",
                                 help=describe(f).replace("%", "%%"), **form)
    action.field = (cls, f)


def add_generate_parser(sub) -> None:
    g = sub.add_parser("generate", help="generate text from a trained run")
    add_flags(g, GenerateOptions, skip=("stop",))
    flag_by_hand(g, GenerateOptions, "stop", action="append")  # --stop A --stop B: both
    g.set_defaults(func=cmd_generate)


def cmd_generate(a: argparse.Namespace) -> int:
    o = from_args(GenerateOptions, a, "generate")
    from ..engine import Engine, SamplingParams
    if o.prompt is not None and o.prompt_file:
        raise CLIError("--prompt and --prompt-file both give the prompt: give one")
    if o.suffix is not None and o.suffix_file:
        raise CLIError("--suffix and --suffix-file both give the suffix: give one")
    if o.prompt == "-" or (o.prompt is None and o.prompt_file is None):
        if sys.stdin.isatty() and o.prompt is None:
            raise CLIError("no prompt: pass --prompt TEXT, --prompt-file FILE, or pipe text on stdin "
                           "(--prompt '' generates from the start of a document)")
        prompt = sys.stdin.read()
    elif o.prompt_file:
        if not os.path.exists(o.prompt_file):
            raise CLIError(f"--prompt-file {o.prompt_file} does not exist")
        prompt = open(o.prompt_file, encoding="utf-8").read()
    else:
        prompt = o.prompt
    suffix = o.suffix
    if o.suffix_file:
        if not os.path.isfile(o.suffix_file):
            raise CLIError(f"--suffix-file {o.suffix_file} is not a file")
        suffix = open(o.suffix_file, encoding="utf-8").read()
    from ..checkpoint import load_model
    from ..device import choose_device, choose_precision
    dev, _ = choose_device(o.device)
    model, tok, ck, _ = load_model(o.run, dev, o.checkpoint)
    print(f"checkpoint: {ck} ({checkpoint_kind(o.run, ck, o.checkpoint)})", file=sys.stderr)
    if getattr(model.cfg, "arch", "gpt") == "hrm":
        return _generate_hrm(o, model, tok, prompt, suffix)
    eng = Engine(model, tok, dev, choose_precision(dev, "auto")[0])
    stops = [x.replace("\\n", "\n").replace("\\t", "\t") for x in o.stop]
    params = SamplingParams(o.max_new_tokens, o.temperature, o.top_k, o.top_p, o.repetition_penalty, o.seed,
                            stops)
    if not prompt:
        print("note: empty prompt; generating from the start of a document", file=sys.stderr)
    for i in range(o.num_samples):
        if o.num_samples > 1:
            print(f"--- sample {i + 1} ---")
        if o.seed is not None:
            params.seed = o.seed + i
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
            found = find_checkpoint(run, which, verify=False, log=lambda m: None)
            if Path(found).resolve() == Path(ck).resolve():
                names.append(which)
        except (CheckpointError, OSError):
            continue
    what = " and ".join(names) if names else "an earlier intact step"
    return f"{asked}: the run's {what}" if asked == "auto" else what


def _generate_hrm(o: GenerateOptions, model, tok, prompt: str, suffix: str | None) -> int:
    """Plan, write, refine (models/hrm.py generate): the final code after the prompt; with --show-plan, the
    plan and every refinement round first. Sampling: temperature and top-k (the hierarchical decoder has no
    top-p, stop sequences or fill-in-the-middle)."""
    if suffix is not None:
        raise CLIError("--suffix: an hrm run does not fill in the middle; pass the function's signature and "
                       "doc as --prompt")
    if not prompt:
        raise CLIError("an hrm run plans from a prompt: pass a function's signature and doc "
                       "comment as --prompt")
    for i in range(o.num_samples):
        if o.num_samples > 1:
            print(f"--- sample {i + 1} ---")
        seed = None if o.seed is None else o.seed + i
        r = model.generate(tok.encode(prompt), max_plan_tokens=min(128, o.max_new_tokens),
                           max_code_tokens=o.max_new_tokens, temperature=o.temperature, top_k=o.top_k,
                           seed=seed)
        if o.show_plan:
            print(f"# plan: {tok.decode(r['plan'])}")
            print(f"# draft:\n{prompt}{tok.decode(r['draft'])}")
            for it in r["iterations"]:
                print(f"# refinement {it['iteration'] + 1}: {it['decision']} (p_done {it['p_done']:.2f})")
            print("# final:")
        sys.stdout.write(prompt + tok.decode(r["code"]) + "\n")
    return 0


EVAL_USAGE = ("codeforge eval --run RUN [options]\n"
              "       codeforge eval --tasks TASKS --completions FILE.jsonl [--k 1 10] [--out F]\n"
              "       codeforge eval --humaneval --samples samples.jsonl [--k 1 10] [--out F]")


def add_eval_parser(sub) -> None:
    e = sub.add_parser("eval", help="loss, perplexity, bits per byte, syntax validity and pass@k of a run",
                       usage=EVAL_USAGE)
    add_flags(e, EvalOptions, skip=("humaneval",))
    # --humaneval alone scores every problem
    flag_by_hand(e, EvalOptions, "humaneval", nargs="?", const=HUMANEVAL_PROBLEMS)
    e.set_defaults(func=cmd_eval)


def cmd_eval(a: argparse.Namespace) -> int:
    o = from_args(EvalOptions, a, "eval")
    if o.completions or o.samples:
        return _score_files(o)
    if o.repo:
        return _score_repo(o)
    if o.gguf or o.endpoint:
        raise CLIError(f"{'--gguf' if o.gguf else '--endpoint'} scores fill-in-the-middle on your files: "
                       f"give --repo DIR (the other scores are the run's: --run RUN)")
    if not o.run:
        raise CLIError("eval needs --run RUN (or --tasks TASKS --completions FILE, or --humaneval --samples "
                       "FILE to score completions without a model)")
    from ..evaluation.run import run_eval
    r = run_eval(o.run, data=o.data, eval_tokens=o.eval_tokens, syntax_samples=o.syntax_samples,
                 language=o.language, humaneval=o.humaneval, ks=o.k,
                 samples_per_problem=o.samples_per_problem, max_new_tokens=o.max_new_tokens,
                 timeout=o.timeout, which=o.checkpoint, device=o.device, tool_cases=o.tool_cases,
                 unsafe_no_sandbox=o.unsafe_no_sandbox, infill=o.infill, hrm_cases=o.hrm_cases,
                 tasks=o.tasks, task_samples=o.task_samples, task_temperature=o.task_temperature,
                 task_limit=o.task_limit, constrained=not o.no_constrain)
    print(json.dumps(r) if o.json else format_report(r))
    return 0


def _score_repo(o: EvalOptions) -> int:
    """eval --repo DIR: FIM on held-out files of a repository, for a run or an endpoint."""
    from ..evaluation.repo import run_repo_eval
    if not o.run and not o.endpoint and not o.gguf:
        raise CLIError("eval --repo DIR scores a run (--run RUN), a GGUF in llama-server (--gguf FILE) or a "
                       "server (--endpoint URL)")
    if o.gguf and o.endpoint_api != "infill":
        raise CLIError("--gguf scores llama-server's /infill; --endpoint-api completions is for "
                       "--endpoint URL")
    if (o.endpoint or o.gguf) and not o.run:
        print("note: without --run, whether these files were trained on cannot be checked", file=sys.stderr)
    if o.repo_report and o.no_repo_report:
        raise CLIError("--repo-report DIR says where the cases go, --no-repo-report that they go "
                       "nowhere: give one")
    if o.repo_report and Path(o.repo_report).exists() and not Path(o.repo_report).is_dir():
        raise CLIError(f"--repo-report {o.repo_report} is a file: give a directory (cases.jsonl and "
                       "report.html go in it)")
    records: list[dict] = []
    r = run_repo_eval(o.repo, o.run, o.endpoint, o.endpoint_api, o.endpoint_model, o.repo_cases,
                      o.repo_context, o.repo_seed, device=o.device, which=o.checkpoint, both=o.repo_both,
                      gguf=o.gguf, llama_server=o.llama_server, log=lambda m: print(m, file=sys.stderr),
                      data_files=o.repo_data_files, records=records)
    where = _repo_report_dir(o, r)
    if where is not None:
        from ..evaluation.report import write_report
        try:
            cases, page = write_report(where, r, records)
        except OSError as e:
            raise CLIError(f"cannot write the cases to {where}: {e}; give a writable directory with "
                           f"--repo-report DIR (or --no-repo-report)") from None
        r["report"] = {"cases": str(cases), "html": str(page)}
    if o.run and not o.out:
        from ..evaluation.run import record_eval
        record_eval(o.run, {"repo_eval": r})
    if o.out:
        Path(o.out).write_text(json.dumps(r, indent=1) + "\n")
    if o.json:
        print(json.dumps(r))
        return 0
    unknown = r.get("held_out_unknown")
    print(f"eval --repo {r['repo']}: {r['cases']} cases from {r['held_out_files']} "
          f"{'held-out ' if r['held_out_checked'] else ''}files of {r['files']}"
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


def _repo_report_dir(o: EvalOptions, r: dict) -> Path | None:
    """Where eval --repo writes cases.jsonl and report.html: --repo-report DIR; beside --out FILE (which
    keeps the run untouched) as FILE_report/; RUN/eval_repo/ with --run; else ./eval_repo/."""
    from ..evaluation.report import REPORT_DIR
    if o.no_repo_report:
        return None
    if o.repo_report:
        return Path(o.repo_report)
    if o.out:
        out = Path(o.out)
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
        out.append(f"every case: {printable(r['report']['cases'])}; "
                   f"side by side: {printable(r['report']['html'])}")
    return out


def _score_files(o: EvalOptions) -> int:
    """eval --tasks T --completions F | --humaneval --samples F: score given completions, no model."""
    from ..atomic import write_jsonl
    from ..tasks.code_tasks import load_completions, load_tasks
    if o.completions and o.samples:
        raise CLIError("--completions (with --tasks) and --samples (with --humaneval) are two "
                       "modes: give one")
    if o.run:
        raise CLIError("--completions and --samples score given completions without a model: leave out --run")
    path = o.completions or o.samples
    rows = load_completions(path)
    if o.completions:
        if not o.tasks:
            raise CLIError("--completions FILE needs --tasks TASKS (the tasks whose ids the "
                           "completions name)")
        from ..evaluation.tasks import score_completions
        tasks = load_tasks(o.tasks, split="heldout") if Path(o.tasks).is_dir() else load_tasks(o.tasks)
        summary, results = score_completions(tasks, rows, o.k, o.timeout, o.unsafe_no_sandbox)
    else:
        if not o.humaneval:
            raise CLIError("--samples FILE is for HumanEval: add --humaneval (or use --tasks T "
                           "--completions F)")
        from ..evaluation.humaneval import score_samples
        summary, results = score_samples(rows, ks=o.k, timeout=o.timeout,
                                         unsafe_no_sandbox=o.unsafe_no_sandbox)
    out = Path(o.out or f"{path}_results.jsonl")
    write_jsonl(out, results)
    summary["results"] = str(out)
    print(json.dumps(summary) if o.json else format_report(summary))
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
    c = sub.add_parser("chat", help="chat with a chat run (after --stage sft/tools) at the terminal, or "
                                    "reply to stdin when it is not a terminal")
    add_flags(c, ChatOptions)
    c.set_defaults(func=cmd_chat)


def cmd_chat(a: argparse.Namespace) -> int:
    """Interactive: each line is a user turn, the reply streams, history is kept; /reset clears it, /system
    TEXT sets the system message, /quit (or Ctrl-D) leaves. Piped: stdin is one user message (or a JSON
    object {"messages": [...], "tools": [...]}); the reply is printed and the command exits."""
    o = from_args(ChatOptions, a, "chat")
    from ..engine import Engine, SamplingParams
    tools = None
    if o.tools:
        from ..constrain import ConstraintError, open_tools
        shape = ('the file holds a JSON list of OpenAI tool specs, e.g. [{"type": "function", "function": '
                 '{"name": "get_weather", "description": "...", "parameters": {"type": "object", '
                 '"properties": {"city": {"type": "string"}}, "required": ["city"]}}}]')
        try:
            tools = json.loads(open(o.tools, encoding="utf-8").read())
        except OSError as e:
            raise CLIError(f"--tools {o.tools}: {e}") from e
        except json.JSONDecodeError as e:
            raise CLIError(f"--tools {o.tools}: not JSON ({e}); {shape}") from e
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise CLIError(f"--tools {o.tools}: expected a JSON list of tool objects; {shape}")
        try:
            loose = open_tools(tools)
        except ConstraintError as e:
            raise CLIError(f"--tools {o.tools}: {e}; {shape}") from e
        if loose and not o.no_constrain:
            print(f"note: --tools {o.tools}: {', '.join(loose)} allow(s) argument keys their schema does "
                  "not list (\"additionalProperties\" is true or a schema), and the grammar follows the "
                  "schema, so the model may add keys; leave \"additionalProperties\" out (or false) to keep "
                  "calls to the listed keys", file=sys.stderr)
    params = SamplingParams(o.max_new_tokens, o.temperature, o.top_k, o.top_p, seed=o.seed)
    eng = Engine.from_run(o.run, o.device, o.checkpoint)
    if eng.chat_note:
        print(f"note: {eng.chat_note}", file=sys.stderr)
    system = [{"role": "system", "content": o.system}] if o.system else []

    constrained = not o.no_constrain
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
              "and it answers in text; offer tools with --tools FILE (a JSON list of tool schemas; "
              "`codeforge make-tools` writes the ones it makes conversations with to tools.json in its "
              "output, `quickstart --chat` to tool_pairs/tools.json)", file=sys.stderr)


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
                                   "or ArceeForCausalLM, whichever computes exactly this model (else refused "
                                   "with what does not map); the logits are checked against transformers "
                                   "when it is installed. GGUF: llama.cpp's gpt2/llama/qwen2/qwen3/arcee "
                                   "architectures.")
    add_flags(e, ExportOptions)
    e.set_defaults(func=cmd_export)
    i = sub.add_parser("import", help="a codeforge run from a Hugging Face model, a directory or a Hub "
                                      "name (GPT-2, Llama, Qwen2, Qwen3, Arcee), to train from with "
                                      "--init-from RUN")
    add_flags(i, ImportOptions)
    i.set_defaults(func=cmd_import)


def cmd_export(a: argparse.Namespace) -> int:
    o = from_args(ExportOptions, a, "export")
    if o.format == "adapter":
        from ..export.adapter import export_adapter
        r = export_adapter(o.run, o.out, o.checkpoint, overwrite=o.overwrite)
        print(printable(f"exported the LoRA adapter of {r['checkpoint']} ({r['bytes'] / 2**20:,.1f} MiB) "
                        f"-> {r['out']}"))
        return 0
    if o.format == "hf":
        from ..export.hf import export_hf
        r = export_hf(o.run, o.out, o.checkpoint, overwrite=o.overwrite, verify=not o.no_verify)
        print(printable(f"exported {r['checkpoint']} as {r['family']} -> {r['out']}"))
    else:
        from ..export.gguf import export_gguf
        r = export_gguf(o.run, o.out, o.checkpoint, dtype=o.dtype, overwrite=o.overwrite,
                        allow_tokenizer_mismatch=o.allow_tokenizer_mismatch,
                        verbose=(lambda m: print(m, file=sys.stderr)) if o.verbose else (lambda m: None))
        print(printable(f"exported {r['checkpoint']} as GGUF ({r['arch']}, {o.dtype}, pre-tokenizer "
                        f"{r['pre']}, {r['bytes'] / 2**20:,.1f} MiB) -> {r['out']}; for Ollama: "
                        f"{r['modelfile']}"))
    if r.get("max_abs_diff") is not None:
        print(f"parity: transformers' logits equal codeforge's to {r['max_abs_diff']:.2e} (max abs) on "
              "a code sample")
    return 0


def cmd_import(a: argparse.Namespace) -> int:
    o = from_args(ImportOptions, a, "import")
    if bool(o.hf) == bool(o.adapter):
        raise CLIError("import needs --hf DIR (a Hugging Face model) or --adapter DIR --base RUN "
                       "(a LoRA adapter)")
    if o.adapter:
        if not o.base:
            raise CLIError("--adapter DIR needs --base RUN: the run (or checkpoint) the adapter "
                           "was trained on")
        from ..export.adapter import import_adapter
        r = import_adapter(o.adapter, o.base, o.out, overwrite=o.overwrite)
        print(printable(f"merged the rank-{r['rank']} adapter {o.adapter} onto {o.base} -> "
                        f"{r['checkpoint']}"))
        return 0
    from ..export.hf import import_hf
    r = import_hf(o.hf, o.out, overwrite=o.overwrite, verify=not o.no_verify)
    print(f"imported {o.hf} ({r['family']}, {r['params']:,} parameters) -> {r['checkpoint']}")
    if r["max_abs_diff"] is not None:
        print(f"parity: codeforge's logits equal transformers' to {r['max_abs_diff']:.2e} (max abs) on "
              "a code sample")
    print(f"next: codeforge train --init-from {r['out']} --data DATA --out NEW_RUN ... (prepare DATA with "
          f"--tokenizer {r['checkpoint']}/tokenizer)")
    return 0


def add_serve_parser(sub) -> None:
    s = sub.add_parser("serve", help="serve a run over HTTP: OpenAI-compatible completions, chat and tool "
                                     "calls, /infill, a playground page; continuous batching",
                       usage="codeforge serve --run RUN [--host 127.0.0.1] [--port 8000] [--api-key KEY] "
                             "[options]")
    add_flags(s, ServeOptions)
    s.set_defaults(func=cmd_serve)


def cmd_serve(a: argparse.Namespace) -> int:
    from ..serve.server import serve_command
    return serve_command(from_args(ServeOptions, a, "serve"))
