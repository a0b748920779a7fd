"""The options of `tokenizer train`, `tokenizer eval`, `prepare` and `data info`, each declared once with
fields.setting: cli/data.py makes their flags from these classes and builds them back (fields.from_args),
which checks every value against its declaration. The corpus options these commands share are
corpus.CorpusOptions, and --input is corpus.CorpusInput's.

They live here, not in shards.py or pipeline.py (which read them), because every `codeforge` command builds
every parser, `--help` included, and those modules import NumPy and datatrove (0.3 s more than this one,
which imports only corpus.py, tokenizer.py and fields.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..corpus import CorpusInput, CorpusOptions
from ..fields import setting
from ..tokenizer import DEFAULT_SPLIT, MAX_VOCAB, MIN_VOCAB, SPLITS

# The corpus options the tokenizer commands take no flag for: they read every document once, with exact
# dedup (train) or none (eval), no validation split and nothing replaced (cli/data.py fixes these).
TOKENIZER_FIXED = ("dedup", "val_fraction", "redact_pii")


@dataclass
class TokenizerTrainOptions(CorpusInput):
    """`codeforge tokenizer train` (plus CorpusOptions but TOKENIZER_FIXED)."""
    vocab_size: int = setting(32000, "tokens in the vocabulary, special tokens included",
                              range=(MIN_VOCAB, MAX_VOCAB))
    out: str = setting("", "directory to write the tokenizer to (tokenizer.json and its settings)",
                       required=True, metavar="DIR")
    max_train_bytes: float | None = setting(None, "stop reading after this many characters (default: read "
                                            "them all)", type=float, range=(1.0, 1e18), zero_means="read all")
    overwrite: bool = setting(False, "replace what --out already holds")
    split: str = setting(DEFAULT_SPLIT, "pre-tokenizer rule: llama3 (what llama.cpp implements, so the model "
                         "exports to GGUF) or code (identifiers with _ and digits whole, indentation after "
                         "punctuation: 8-12% fewer tokens on code, but no GGUF export)",
                         choices=tuple(SPLITS))


@dataclass
class TokenizerEvalOptions(CorpusInput):
    """`codeforge tokenizer eval` (plus CorpusOptions but TOKENIZER_FIXED)."""
    tokenizer: str = setting("", "directory holding tokenizer.json", required=True, metavar="DIR")
    json: bool = setting(False, "print the numbers as one JSON object")


@dataclass
class PrepareOptions(CorpusInput):
    """`codeforge prepare` (plus CorpusOptions): the tokenizer and output, benchmark and secret hygiene, and
    the engine that runs it (pipeline.py; slurm.py for --executor slurm, ray_executor.py for --executor
    ray)."""
    tokenizer: str = setting("", "directory holding tokenizer.json", required=True, metavar="DIR")
    out: str = setting("", "directory to write the token shards, the tokenizer copy and meta.json to",
                       required=True, metavar="DIR")
    decontaminate: list[str] = setting(
        ["humaneval"], "drop every document that shares a 13-token run, or most of a solution's shape (names "
        "and layout aside), with a benchmark: humaneval (the default), a JSONL file of benchmark records "
        "(every string field), or a directory of held-out files (those `eval --repo` will score); counted in "
        "the report", metavar="SRC")
    no_decontaminate: bool = setting(False, "keep documents that overlap benchmarks (their later scores may "
                                     "then be inflated)")
    keep_secrets: bool = setting(False, "keep API keys, tokens, private keys and passwords found in the code "
                                 "(by default each is replaced with a placeholder per kind, "
                                 "REDACTED_AWS_ACCESS_KEY, ..., and counted): a model learns them and "
                                 "completes them for anyone")
    repo_fim: float = setting(0.0, "also train repo-level fill-in-the-middle: this share of the training "
                              "files (chosen by hash) gets a second document with up to 2 earlier files of "
                              "its directory as context, in the layout llama-server's /infill builds for "
                              "editors (<|repo_name|>, <|file_sep|>); the quickstart uses 0.25, the measured "
                              "best",
                              range=(0.0, 1.0), zero_means="off", metavar="SHARE")
    workers: int = setting(0, "processes working at once, one core each; the shards are the same for any "
                           "number", range=(1, 100_000), zero_means="this machine's cores, one per 8 MB of "
                           "input at most (a single one then encodes on every core)")
    executor: str = setting("local", "local: a process pool here; slurm: one job array per stage, submitted "
                            "with sbatch (needs --slurm-partition), the last job writes --out; ray: each "
                            "stage's tasks on Ray, a local instance or --ray-address (needs pip install "
                            "'codeforge[ray]'); every executor writes the same shards",
                            choices=("local", "slurm", "ray"))  # pipeline.EXECUTORS (tests check they agree)
    # at most pipeline.MAX_TASKS (the exact-dedup stage holds files of every task open); pipeline.py imports
    # datatrove, too slow for --help, so tests/test_data_options.py checks that the two agree
    tasks: int = setting(0, "cut the corpus into this many tasks; the shards depend on it, so keep it when "
                         "you rerun", range=(1, 300), zero_means="about 32 MB of input each, 16 to 300")
    slurm_partition: str | None = setting(None, "--executor slurm: the partition the jobs run in", type=str,
                                          metavar="NAME")
    slurm_time: str = setting("04:00:00", "--executor slurm: time limit per job", metavar="HH:MM:SS")
    slurm_cpus: int = setting(1, "--executor slurm: CPUs per task", range=(1, 100_000))
    slurm_mem_gb: int = setting(2, "--executor slurm: memory per CPU in GB", range=(1, 100_000))
    slurm_env: str | None = setting(None, "--executor slurm: the shell command a job runs first (default: "
                                    "activate the virtual environment this command runs in, if any)",
                                    type=str, metavar="COMMAND")
    ray_address: str | None = setting(None, "--executor ray: the Ray cluster to run on: auto (the one `ray "
                                      "start` joined this machine to), HOST:6379, or ray://HOST:10001 (Ray "
                                      "Client); default: RAY_ADDRESS if set, else a local instance started "
                                      "for this command and stopped after it", type=str, metavar="ADDRESS")
    ray_cpus: int = setting(1, "--executor ray: CPUs each task reserves", range=(1, 100_000))
    ray_mem_gb: float = setting(2.0, "--executor ray: memory each task reserves per CPU, in GB",
                                range=(0.1, 100_000.0), zero_means="none reserved (Ray schedules by CPUs "
                                "alone)")
    shard_tokens: int = setting(100_000_000, "tokens per shard file", range=(1, 10**12))
    overwrite: bool = setting(False, "replace an existing, different dataset")
    chat: bool = setting(False, 'inputs are chat JSONL ({"messages": [...], "tools": [...]}); render with '
                         "ChatML and write a loss mask (assistant turns only) for --stage sft/tools")

    def corpus(self, opts: CorpusOptions) -> CorpusOptions:
        """`opts` with this command's hygiene: benchmarks out and secrets replaced unless turned off. Chat
        JSONL (--chat) is read as conversations, which these steps do not see yet, so its options do not
        claim them."""
        code = not self.chat
        benchmarks = list(dict.fromkeys(self.decontaminate)) if code and not self.no_decontaminate else []
        return replace(opts, decontaminate=benchmarks, redact_secrets=code and not self.keep_secrets,
                       redact_pii=code and opts.redact_pii)

    def slurm(self) -> dict:
        """The --slurm-* options as slurm.submit takes them; with --executor ray, the --ray-* ones too, under
        "ray" (pipeline.run's `slurm` argument carries the cluster options of either executor)."""
        got = {"partition": self.slurm_partition, "time": self.slurm_time, "cpus_per_task": self.slurm_cpus,
               "mem_per_cpu_gb": self.slurm_mem_gb, "env_command": self.slurm_env}
        if self.executor == "ray":
            got["ray"] = {"address": self.ray_address, "cpus_per_task": self.ray_cpus,
                          "mem_per_cpu_gb": self.ray_mem_gb}
        return got


@dataclass
class DataInfoOptions:
    """`codeforge data info`."""
    dir: str = setting("", "a prepared data directory (from `codeforge prepare` or make-plans)",
                       positional=True, metavar="DIR")
