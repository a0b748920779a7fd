"""The run commands (generate, eval, chat, export, import, serve) take their options from one declaration
each: every flag is a field of the command's options class (its default, range and help the field's), a value
out of its declared range is refused with the flag's name before anything loads, and a new field is a new
flag."""

from __future__ import annotations

import argparse
import subprocess
import sys
from dataclasses import dataclass, fields

import pytest

from codeforge.cli import main
from codeforge.cli import run as run_cli
from codeforge.cli.args import Parser
from codeforge.evaluation.options import CHECKPOINTS, HUMANEVAL_PROBLEMS, EvalOptions
from codeforge.export.options import ExportOptions, ImportOptions
from codeforge.fields import ConfigError, add_flags, default_of, flag_name, from_args, setting
from codeforge.serve.options import ServeOptions

COMMANDS = {"generate": run_cli.GenerateOptions, "eval": EvalOptions, "chat": run_cli.ChatOptions,
            "export": ExportOptions, "import": ImportOptions, "serve": ServeOptions}


def command_parser(name: str) -> argparse.ArgumentParser:
    sub = Parser(prog="codeforge").add_subparsers(dest="command")
    add = {"generate": run_cli.add_generate_parser, "eval": run_cli.add_eval_parser,
           "chat": run_cli.add_chat_parser, "export": run_cli.add_export_parser,
           "import": run_cli.add_export_parser, "serve": run_cli.add_serve_parser}  # export adds import too
    add[name](sub)
    return sub.choices[name]


@pytest.mark.parametrize("name", COMMANDS)
def test_every_flag_is_a_field_of_the_commands_options(name):
    cls, parser = COMMANDS[name], command_parser(name)
    actions = {a.dest: a for a in parser._actions if not isinstance(a, argparse._HelpAction)}
    on_cli = [f for f in fields(cls) if f.metadata.get("cli", True)]
    assert sorted(actions) == sorted(f.name for f in on_cli), "a flag without a field, or the reverse"
    for f in on_cli:
        a = actions[f.name]
        assert a.field == (cls, f) and a.option_strings == [flag_name(f)], f.name
        assert a.default == default_of(f), f.name
        assert a.required == bool(f.metadata.get("required")), f.name
    # the object the command body gets is the class's, with the class's defaults where no flag was given
    argv = {"eval": [], "import": ["--out", "o"], "export": ["--run", "r", "--format", "hf", "--out", "o"]}
    a = parser.parse_args(argv.get(name, ["--run", "r"]))
    o = from_args(cls, a, name)
    assert type(o) is cls
    assert all(getattr(o, f.name) == default_of(f) for f in on_cli if f.name not in ("run", "out", "format"))


@pytest.mark.parametrize("argv,flag,allowed", [
    (["serve", "--run", "r", "--max-batch", "0"], "--max-batch", "[1, 256]"),
    (["serve", "--run", "r", "--max-batch", "257"], "--max-batch", "[1, 256]"),
    (["serve", "--run", "r", "--request-timeout", "-1"], "--request-timeout", "(0.0, 86400.0]"),
    (["serve", "--run", "r", "--port", "70000"], "--port", "[0, 65535]"),
    (["serve", "--run", "r", "--max-body-bytes", "100"], "--max-body-bytes", "[1024, "),
    (["serve", "--run", "r", "--header-timeout", "0"], "--header-timeout", "(0.0, 3600.0]"),
    (["serve", "--run", "r", "--keep-alive", "-1"], "--keep-alive", "[0.0, 3600.0]"),
    (["serve", "--run", "r", "--max-connections", "-1"], "--max-connections", "[1, "),
    (["serve", "--run", "r", "--infill-predict", "-2"], "--infill-predict", "[-1, "),
    (["eval", "--run", "r", "--samples-per-problem", "0"], "--samples-per-problem", "[1, 100000]"),
    (["eval", "--run", "r", "--timeout", "0"], "--timeout", "(0.0, 86400.0]"),
    (["eval", "--run", "r", "--eval-tokens", "-5"], "--eval-tokens", "[1, "),
    (["eval", "--run", "r", "--k", "1", "0"], "--k", "[1, 100000]"),
    (["eval", "--run", "r", "--humaneval", "200"], "--humaneval", f"[1, {HUMANEVAL_PROBLEMS}]"),
    (["generate", "--run", "r", "--prompt", "x", "--top-p", "0"], "--top-p", "(0.0, 1.0]"),
    (["generate", "--run", "r", "--prompt", "x", "--num-samples", "0"], "--num-samples", "[1, "),
    (["chat", "--run", "r", "--temperature", "-1"], "--temperature", "[0.0, "),
])
def test_a_value_out_of_range_is_refused_with_the_flag_before_anything_loads(argv, flag, allowed, capsys):
    """The run "r" does not exist: the range is what is refused, with the flag, its range and the fix."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {argv[0]} {flag} = ") and allowed in err, err
    assert f"{flag} to a value in that range" in err, err  # the fix names the flag


def test_zero_keeps_its_declared_meaning():
    """0 is outside some ranges but means something declared: a free port, no timeout, the file limit."""
    a = command_parser("serve").parse_args(["--run", "r", "--port", "0", "--request-timeout", "0",
                                            "--max-connections", "0", "--keep-alive", "0", "--threads", "0"])
    o = from_args(ServeOptions, a, "serve")
    assert (o.port, o.request_timeout, o.max_connections, o.keep_alive, o.threads) == (0, 0.0, 0, 0.0, 0)


def test_flags_in_the_forms_add_flags_does_not_make_keep_their_behaviour():
    g = command_parser("generate")
    o = from_args(run_cli.GenerateOptions, g.parse_args(["--run", "r", "--stop", "a", "--stop", "\\ndef "]),
                  "generate")
    assert o.stop == ["a", "\\ndef "]  # repeatable, each value kept
    e = command_parser("eval")
    assert e.parse_args([]).humaneval == 0
    assert e.parse_args(["--humaneval"]).humaneval == HUMANEVAL_PROBLEMS  # alone: every problem
    assert e.parse_args(["--humaneval", "5"]).humaneval == 5


def test_serve_lists_read_from_one_comma_separated_flag():
    a = command_parser("serve").parse_args(["--run", "r", "--allowed-hosts", "a.example, b.example:8000,",
                                            "--allowed-origins", "http://x.example"])
    o = from_args(ServeOptions, a, "serve")
    assert o.allowed_hosts == ("a.example", "b.example:8000") and o.allowed_origins == ("http://x.example",)
    assert ServeOptions(allowed_hosts=("*",)).allowed_hosts == ("*",)  # the app's callers give a tuple


def test_both_prompt_flags_are_refused(capsys):
    assert main(["generate", "--run", "r", "--prompt", "x", "--prompt-file", "f"]) == 2
    assert "--prompt and --prompt-file" in capsys.readouterr().err


def test_a_new_serve_option_is_one_field(monkeypatch, capsys):
    """A field added to ServeOptions becomes a flag of `codeforge serve` with its help, default and range,
    and reaches the server in the options object: nothing else names it."""

    @dataclass
    class WithWidgets(ServeOptions):
        max_widgets: int = setting(4, range=(1, 8), metavar="N", help="widgets per request")

    import codeforge.serve.server as server
    got = []
    monkeypatch.setattr(run_cli, "ServeOptions", WithWidgets)
    monkeypatch.setattr(server, "serve_command", lambda opts: got.append(opts) or 0)
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    assert "--max-widgets N" in capsys.readouterr().out
    assert main(["serve", "--run", "r", "--max-widgets", "9"]) == 2
    assert "error: serve --max-widgets = 9 is out of range [1, 8]" in capsys.readouterr().err
    assert not got
    assert main(["serve", "--run", "r", "--max-widgets", "3", "--max-batch", "2"]) == 0
    assert type(got[0]) is WithWidgets and (got[0].max_widgets, got[0].max_batch) == (3, 2)
    assert main(["serve", "--run", "r"]) == 0 and got[1].max_widgets == 4


def test_a_subclass_field_is_range_checked_by_from_args():
    @dataclass
    class WithWidgets(ServeOptions):
        max_widgets: int = setting(4, range=(1, 8), help="widgets per request")

    p = Parser(prog="serve")
    add_flags(p, WithWidgets)
    with pytest.raises(ConfigError, match=r"serve --max-widgets = 0 is out of range \[1, 8\]"):
        from_args(WithWidgets, p.parse_args(["--run", "r", "--max-widgets", "0"]), "serve")


def test_constants_written_out_to_stay_torch_free_match_their_sources():
    from codeforge.checkpoint.store import POINTERS
    from codeforge.serve import connections
    from codeforge.serve import options as serve_options
    assert set(CHECKPOINTS) == {"auto", *POINTERS}
    assert serve_options.MAX_DEFAULT_CONNECTIONS == connections.MAX_DEFAULT_CONNECTIONS


def test_run_commands_help_does_not_import_torch():
    code = ("import sys\nfrom codeforge.cli.main import build_parser\nfor c in ('generate', 'eval', 'chat', "
            "'export', 'import', 'serve'):\n    build_parser(c)\nimport codeforge.serve\nassert 'torch' not "
            "in sys.modules, 'torch imported'\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
