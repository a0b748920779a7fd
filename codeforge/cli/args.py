"""What every command group shares: the error a command raises for bad arguments, the parser class (no
silent abbreviations), and parsing with "did you mean" hints."""

from __future__ import annotations

import argparse

from .. import CodeforgeError


class CLIError(CodeforgeError):
    pass


class Parser(argparse.ArgumentParser):
    """No silent abbreviations (--max-iter must not pass for --max-iters); subcommands inherit this class."""

    def __init__(self, *a, **k):
        k.setdefault("allow_abbrev", False)
        super().__init__(*a, **k)


def _chosen_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The (sub)subcommand parser `args` came from, for its usage line in errors."""
    current = parser
    while True:
        subs = [a for a in current._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs or getattr(args, subs[0].dest, None) is None:
            return current
        current = subs[0].choices[getattr(args, subs[0].dest)]


def parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """parse_args, but an unknown option is reported by the subcommand it was given to, with the nearest
    known options ("did you mean --max-iters?")."""
    import difflib
    args, extra = parser.parse_known_args(argv)
    if extra:
        sub = _chosen_parser(parser, args)
        known = [o for a in sub._actions for o in a.option_strings if o.startswith("--")]
        hints = []
        for tok in extra:
            if tok.startswith("--"):
                near = difflib.get_close_matches(tok.split("=", 1)[0], known, n=3, cutoff=0.6)
                if near:
                    hints.append(f"{tok.split('=', 1)[0]}: did you mean {' or '.join(near)}?")
        sub.error(f"unrecognized arguments: {' '.join(extra)}" + ("\n" + "\n".join(hints) if hints else "")
                  + f"\n(`{sub.prog} --help` lists every option)")
    return args
