"""What every command group shares: the error a command raises for bad arguments, the parser class (no
silent abbreviations), parsing with "did you mean" hints, and the corpus options of tokenizer and prepare."""

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


def sampling_args(p: argparse.ArgumentParser, max_new_tokens: int, temperature: float, what: str) -> None:
    """The sampling flags generate and chat share (their defaults differ)."""
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens,
                   help=f"tokens to generate at most (default {max_new_tokens})")
    p.add_argument("--temperature", type=float, default=temperature,
                   help=f"sampling temperature; 0 is greedy (default {temperature})")
    p.add_argument("--top-k", type=int, default=50,
                   help="sample from the K most likely tokens only; 0 is off "
                                                          "(default 50)")
    p.add_argument("--top-p", type=float, default=0.95,
                   help="sample from the smallest set of tokens whose "
                        "probabilities reach P; 1 is off (default 0.95)")
    p.add_argument("--seed", type=int, default=None,
                   help=f"random seed for reproducible {what} (default: fresh each run)")


def corpus_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input", nargs="+", required=True, metavar="PATH",
                   help="directories, .txt, .jsonl[.gz|.zst], .parquet files, or hf:NAME[:SPLIT]")
    p.add_argument("--languages", nargs="+", default=None,
                   help="keep files of these languages (by extension)")
    p.add_argument("--text-field", default="text", help="JSONL/parquet field that holds the text")
    p.add_argument("--max-file-bytes", type=int, default=1_000_000, help="skip larger documents")
    p.add_argument("--max-line-length", type=int, default=1000, help="a longer line marks a file minified")
    p.add_argument("--exclude-tests", action="store_true",
                   help="skip test files (_test.go, test_*.py, tests/)")
    p.add_argument("--strict", action="store_true", help="fail on a malformed input instead of skipping it")


def corpus_opts(a: argparse.Namespace, **kw):
    from ..corpus import CorpusOptions
    return CorpusOptions(languages=a.languages, text_field=a.text_field, max_file_bytes=a.max_file_bytes,
                         max_line_length=a.max_line_length, exclude_tests=a.exclude_tests, strict=a.strict,
                         **kw)


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
