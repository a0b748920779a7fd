"""The `codeforge` command: the parser of every command group, main() and the process's exit."""

from __future__ import annotations

import argparse
import os
import sys
import time

from .. import CodeforgeError
from . import data, run, train
from .args import Parser, parse


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole parser; with `command`, the flags generated from the config fields (which need the model
    classes, hence torch) are added only if that command takes them, so `codeforge --help`, `presets` or
    `quickstart --help` answer without importing torch."""
    p = Parser(prog="codeforge", description="Train code language models from scratch.")
    sub = p.add_subparsers(dest="command", required=True)

    data.add_parsers(sub)
    train.add_parsers(sub, config_flags=command is None or command in train.CONFIG_COMMANDS)
    train.add_quickstart_parser(sub)
    run.add_generate_parser(sub)
    run.add_eval_parser(sub)
    run.add_chat_parser(sub)
    run.add_export_parser(sub)
    run.add_serve_parser(sub)
    data.add_plans_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else argv
    args = parse(build_parser(next((w for w in words if not w.startswith("-")), "")), argv)
    t0 = time.perf_counter()
    try:
        return args.func(args)
    except CodeforgeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into e.g. `head`, which stopped reading: not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        print(f"interrupted after {time.perf_counter() - t0:.0f}s", file=sys.stderr)
        return 130


def entry() -> None:
    """The `codeforge` command and `python -m codeforge`: main(), then the process ends (see exit_process;
    a command that never loaded torch has no process group to leave, and ends as any program)."""
    try:
        code = main()
    except SystemExit as e:  # argparse's --help and usage errors
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    except KeyboardInterrupt:  # before main's own handler (while the parser is built)
        code = 130
    except BaseException:
        import traceback
        traceback.print_exc()
        code = 1
    dist = sys.modules.get("codeforge.distributed")
    if dist is None:
        raise SystemExit(code)
    dist.exit_process(code)


if __name__ == "__main__":
    entry()
