"""The data commands' options are declared once: every flag of tokenizer train|eval, prepare, data info and
the miners comes from a field of the command's options class (its default, choices and help are the
field's), a value outside a field's range is refused naming the flag, and a field added to a class is a
flag with nothing else to change."""

from __future__ import annotations

import argparse
import inspect
import subprocess
import sys
from dataclasses import asdict, dataclass, fields

import pytest

from codeforge.cli import data as cli_data
from codeforge.cli import main
from codeforge.cli.main import build_parser
from codeforge.corpus import CorpusError, CorpusOptions
from codeforge.data.options import (TOKENIZER_FIXED, DataInfoOptions, PrepareOptions, TokenizerEvalOptions,
                                    TokenizerTrainOptions)
from codeforge.fields import ConfigError, default_of, describe, from_args, setting
from codeforge.mining.options import PairsOptions, PlansOptions, SftOptions
from codeforge.tasks.options import TasksOptions, ToolsOptions

# command -> the options classes its flags come from
COMMANDS = {
    ("tokenizer", "train"): {TokenizerTrainOptions, CorpusOptions},
    ("tokenizer", "eval"): {TokenizerEvalOptions, CorpusOptions},
    ("prepare",): {PrepareOptions, CorpusOptions},
    ("data", "info"): {DataInfoOptions},
    ("make-sft",): {SftOptions},
    ("make-pairs",): {PairsOptions},
    ("make-plans",): {PlansOptions},
    ("make-tasks",): {TasksOptions},
    ("make-tools",): {ToolsOptions},
}


def command_parser(root: argparse.ArgumentParser, words: tuple[str, ...]) -> argparse.ArgumentParser:
    parser = root
    for word in words:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[word]
    return parser


def flags(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    plumbing = (argparse._HelpAction, argparse._SubParsersAction)
    return [a for a in parser._actions if not isinstance(a, plumbing)]


@pytest.mark.parametrize("words", list(COMMANDS), ids=" ".join)
def test_every_flag_is_a_declared_field(words):
    """No hand-written argument is left: each one carries its field, and its default, help, choices and
    requiredness are the declaration's. Every field meant for the command line is a flag."""
    parser = command_parser(build_parser("prepare"), words)
    assert set(parser.options) == COMMANDS[words]
    made = {}
    for action in flags(parser):
        assert hasattr(action, "field"), f"`{' '.join(words)}` declares {action.option_strings} by hand"
        cls, f = action.field
        assert action.dest == f.name and action.default == default_of(f)
        assert action.help == describe(f).replace("%", "%%")
        assert tuple(action.choices or ()) == tuple(f.metadata["choices"] or ())
        if not f.metadata["positional"]:
            assert action.required == f.metadata["required"]
        made[f.name] = cls
    skipped = TOKENIZER_FIXED if words[0] == "tokenizer" else ()
    for cls in COMMANDS[words]:
        for f in fields(cls):
            if f.metadata["cli"] and f.name not in skipped:
                assert made.get(f.name) is cls, (words, f.name)


def test_the_corpus_flags_are_one_declaration_shared():
    """tokenizer train, tokenizer eval and prepare take the same corpus flags, from the same fields."""
    root = build_parser("prepare")
    by_command = {words: {a.dest: a.field[1] for a in flags(command_parser(root, words))
                          if a.field[0] is CorpusOptions}
                  for words in [("tokenizer", "train"), ("tokenizer", "eval"), ("prepare",)]}
    shared = {"languages", "text_field", "max_file_bytes", "max_line_length", "exclude_tests", "strict"}
    declared = {f.name: f for f in fields(CorpusOptions)}
    for got in by_command.values():
        assert shared <= set(got) and all(got[name] is declared[name] for name in shared)
    assert {"dedup", "val_fraction", "redact_pii"} <= set(by_command[("prepare",)])
    assert not set(TOKENIZER_FIXED) & set(by_command[("tokenizer", "train")])


@pytest.mark.parametrize("argv, flag", [
    (["prepare", "--val-fraction", "1.5"], "--val-fraction"),
    (["prepare", "--workers", "-1"], "--workers"),
    (["prepare", "--tasks", "-2"], "--tasks"),
    (["prepare", "--repo-fim", "2"], "--repo-fim"),
    (["prepare", "--max-file-bytes", "0"], "--max-file-bytes"),
    (["prepare", "--shard-tokens", "0"], "--shard-tokens"),
    (["prepare", "--slurm-cpus", "0"], "--slurm-cpus"),
    (["tokenizer", "train", "--max-line-length", "0"], "--max-line-length"),
    (["tokenizer", "train", "--vocab-size", "100"], "--vocab-size"),
])
def test_out_of_range_values_are_refused_naming_the_flag(tmp_path, capsys, argv, flag):
    """Refused before any work (the inputs and the tokenizer do not even exist), exit 2, the message names the
    command, the flag, the value and the allowed range."""
    words = argv[:2] if argv[0] == "tokenizer" else argv[:1]
    needed = ["--input", str(tmp_path / "missing"), "--out", str(tmp_path / "out")]
    if words == ["prepare"]:
        needed += ["--tokenizer", str(tmp_path / "no-tokenizer")]
    assert main([*argv, *needed]) == 2
    err = capsys.readouterr().err
    value = argv[argv.index(flag) + 1]
    assert f"{' '.join(words)} {flag} = {value}" in err and "out of range [" in err and f"set {flag}" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv, flag", [
    (["make-sft", "--input", "x", "--heldout-fraction", "1"], "--heldout-fraction"),
    (["make-sft", "--input", "x", "--max-chars", "0"], "--max-chars"),
    (["make-pairs", "--input", "x", "--per-function", "0"], "--per-function"),
    (["make-plans", "--input", "x", "--max-plan-words", "1"], "--max-plan-words"),
    (["make-plans", "--input", "x", "--val-fraction", "-0.1"], "--val-fraction"),
    (["make-tasks", "--count", "0"], "--count"),
    (["make-tools", "--heldout", "-1"], "--heldout"),
])
def test_miner_values_out_of_range_are_refused_naming_the_flag(tmp_path, capsys, argv, flag):
    assert main([*argv, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"{argv[0]} {flag} = " in err and "out of range" in err
    assert not (tmp_path / "out").exists()


def test_a_choice_outside_the_declaration_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["prepare", "--input", "x", "--tokenizer", "t", "--out", "o", "--dedup", "fuzzy"])
    assert e.value.code == 2 and "--dedup: invalid choice: 'fuzzy'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["make-sft", "--input", "x", "--out", "o", "--languages", "rust"])
    assert "--languages: invalid choice: 'rust'" in capsys.readouterr().err


def test_a_field_added_to_prepare_options_is_a_flag(monkeypatch, tmp_path, capsys):
    """One place: a new prepare option declared on the class (here a subclass swapped in) is a flag with its
    help, default and range, and the command body gets it in the object it builds."""

    @dataclass
    class WithStars(PrepareOptions):
        min_stars: int = setting(0, "keep only repositories with at least this many stars", range=(0, 10**9))

    monkeypatch.setattr(cli_data, "PrepareOptions", WithStars)
    parser = command_parser(build_parser("prepare"), ("prepare",))
    action = next(a for a in flags(parser) if a.dest == "min_stars")
    assert action.option_strings == ["--min-stars"] and action.default == 0
    assert action.help.startswith("keep only repositories with at least this many stars; [0, 1000000000]")
    assert "--min-stars N" in parser.format_help()

    built = []
    monkeypatch.setattr(WithStars, "slurm", lambda self: built.append(self) or {})
    import codeforge.data.shards as shards
    monkeypatch.setattr(shards, "prepare", lambda *a, **k: None)  # None: as if submitted to a cluster
    common = ["prepare", "--input", "x", "--tokenizer", "t", "--out", str(tmp_path / "o")]
    assert main([*common, "--min-stars", "50"]) == 0
    assert isinstance(built[0], WithStars) and built[0].min_stars == 50
    assert main([*common, "--min-stars", "-1"]) == 2
    assert "prepare --min-stars = -1 is out of range" in capsys.readouterr().err


def test_a_field_added_to_corpus_options_is_a_flag_of_every_corpus_command(monkeypatch):
    @dataclass
    class WithLicense(CorpusOptions):
        licenses: list[str] | None = setting(None, "keep only files under these licenses", type=str,
                                             many=True)

    monkeypatch.setattr(cli_data, "CorpusOptions", WithLicense)
    root = build_parser("prepare")
    for argv in (["tokenizer", "train", "--out", "o"], ["tokenizer", "eval", "--tokenizer", "t"],
                 ["prepare", "--tokenizer", "t", "--out", "o"]):
        a = root.parse_args([*argv, "--input", "x", "--licenses", "mit", "apache-2.0"])
        assert a.licenses == ["mit", "apache-2.0"]
        assert from_args(WithLicense, a, argv[0]).licenses == ["mit", "apache-2.0"]


def test_prepare_builds_what_the_flags_say(monkeypatch, tmp_path):
    """The command body passes the declared defaults on as before: benchmarks out (HumanEval) and secrets
    replaced, 0 workers and tasks left to the engine, the Slurm settings as slurm.py takes them."""
    got = {}
    import codeforge.data.shards as shards

    def fake(sources, tokenizer_dir, out_dir, opts, **kw):
        got.update(sources=sources, tokenizer=tokenizer_dir, out=out_dir, opts=opts, **kw)
        return None

    monkeypatch.setattr(shards, "prepare", fake)
    assert main(["prepare", "--input", "a", "b", "--tokenizer", "t", "--out", "o"]) == 0
    opts = got["opts"]
    assert (got["sources"], got["tokenizer"], got["out"]) == (["a", "b"], "t", "o")
    assert opts.decontaminate == ["humaneval"] and opts.redact_secrets and not opts.redact_pii
    assert (opts.dedup, opts.val_fraction, opts.max_file_bytes) == ("exact", 0.01, 1_000_000)
    assert got["workers"] is None and got["tasks"] is None and got["executor"] == "local"
    assert got["slurm"] == {"partition": None, "time": "04:00:00", "cpus_per_task": 1, "mem_per_cpu_gb": 2,
                            "env_command": None}
    assert (got["shard_tokens"], got["repo_fim"], got["chat"], got["overwrite"]) == (100_000_000, 0.0, False,
                                                                                      False)
    assert main(["prepare", "--input", "a", "--tokenizer", "t", "--out", "o", "--decontaminate", "x.jsonl",
                 "humaneval", "x.jsonl", "--keep-secrets", "--redact-pii", "--workers", "3", "--tasks", "7",
                 "--dedup", "near", "--languages", "go"]) == 0
    opts = got["opts"]
    assert opts.decontaminate == ["x.jsonl", "humaneval"] and not opts.redact_secrets and opts.redact_pii
    assert (got["workers"], got["tasks"], opts.dedup, opts.languages) == (3, 7, "near", ["go"])
    # chat JSONL is read as conversations, which the hygiene steps do not see: its options do not claim them
    assert main(["prepare", "--chat", "--input", "a", "--tokenizer", "t", "--out", "o", "--redact-pii"]) == 0
    opts = got["opts"]
    assert not opts.decontaminate and not opts.redact_secrets and not opts.redact_pii
    assert main(["prepare", "--input", "a", "--tokenizer", "t", "--out", "o", "--no-decontaminate"]) == 0
    assert got["opts"].decontaminate == [] and got["opts"].redact_secrets


def test_corpus_options_keep_their_fingerprint_and_check_through_the_declaration():
    """to_dict() (part of a prepared dataset's fingerprint) is what it was before the declaration, and
    validate() refuses what the declaration refuses, as a CorpusError naming the flag."""
    assert CorpusOptions().to_dict() == {
        "languages": None, "text_field": "text", "max_file_bytes": 1_000_000, "max_line_length": 1000,
        "exclude_tests": False, "dedup": "exact", "near_threshold": 0.85, "val_fraction": 0.01,
        "strict": False}
    assert list(CorpusOptions(decontaminate=["humaneval"], redact_secrets=True).to_dict())[-2:] == [
        "decontaminate", "redact_secrets"]

    def before(o: CorpusOptions) -> dict:  # to_dict as it was written before the declaration
        d = asdict(o)
        for k in ("decontaminate", "redact_secrets", "redact_pii"):
            if not d[k]:
                del d[k]
        return d

    for kw in [{}, {"languages": ["go"], "dedup": "near", "val_fraction": 0.2}, {"redact_pii": True},
               {"decontaminate": ["humaneval", "x.jsonl"], "redact_secrets": True, "strict": True}]:
        assert CorpusOptions(**kw).to_dict() == before(CorpusOptions(**kw))

    @dataclass
    class WithLicense(CorpusOptions):  # a filter added later: off, it leaves every fingerprint as it was
        licenses: list[str] | None = setting(None, "keep only files under these licenses", type=str,
                                             many=True)

    assert WithLicense().to_dict() == CorpusOptions().to_dict()
    assert WithLicense(licenses=["mit"]).to_dict()["licenses"] == ["mit"]
    for bad, flag in [({"val_fraction": 1.0}, "--val-fraction"), ({"max_file_bytes": 0}, "--max-file-bytes"),
                      ({"max_line_length": -5}, "--max-line-length"), ({"dedup": "fuzzy"}, "--dedup")]:
        with pytest.raises(CorpusError, match=f"prepare {flag} = "):
            CorpusOptions(**bad).validate("prepare")
    with pytest.raises(CorpusError, match="out of range"):  # a field set in code only, checked the same way
        CorpusOptions(near_threshold=0.0).validate()
    with pytest.raises(CorpusError, match="unknown language 'cobol'"):
        CorpusOptions(languages=["cobol"]).validate()


def test_library_prepare_checks_against_the_same_declaration(tmp_path):
    from codeforge.data.shards import prepare
    with pytest.raises(ConfigError, match=r"prepare --repo-fim = 2 is out of range \[0.0, 1.0\]"):
        prepare([str(tmp_path)], tmp_path / "no-tokenizer", tmp_path / "out", repo_fim=2)


def test_declarations_agree_with_the_code_that_reads_them():
    """Where a declaration repeats a bound of a module too slow to import for --help (pipeline.py imports
    datatrove), or a miner keeps its own keyword defaults, they agree."""
    from codeforge.data import pipeline
    from codeforge.mining.pairs import mine_pairs
    from codeforge.mining.plans import mine_plans
    from codeforge.mining.sft import mine_sft
    from codeforge.tasks.code_tasks import write_tasks
    tasks = next(f for f in fields(PrepareOptions) if f.name == "tasks")
    executor = next(f for f in fields(PrepareOptions) if f.name == "executor")
    assert tasks.metadata["range"][1] == pipeline.MAX_TASKS
    assert f"16 to {pipeline.MAX_TASKS}" in tasks.metadata["zero_means"] and pipeline.MIN_TASKS == 16
    assert set(executor.metadata["choices"]) == set(pipeline.EXECUTORS)
    for fn, cls in [(mine_sft, SftOptions), (mine_pairs, PairsOptions), (mine_plans, PlansOptions)]:
        params = inspect.signature(fn).parameters
        for f in fields(cls):
            if f.name in params:
                assert params[f.name].default == default_of(f), (fn.__name__, f.name)
    assert inspect.signature(write_tasks).parameters["n"].default == default_of(
        next(f for f in fields(TasksOptions) if f.name == "count"))


def test_prepare_help_imports_no_torch():
    code = ("import sys; from codeforge.cli.main import build_parser; build_parser('prepare'); "
            "print('torch' in sys.modules, 'datatrove' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]
