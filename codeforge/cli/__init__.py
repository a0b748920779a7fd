"""The `codeforge` command: parses arguments, calls the library, prints; no work happens here. Imports of
the library stay inside the command functions, so `codeforge --help` starts without loading torch.

- main.py   the whole parser, main() (errors -> exit 2, Ctrl-C -> 130) and entry() (the console script)
- args.py   CLIError, the parser class, "did you mean" parsing, the corpus options
- data.py   tokenizer train|eval, prepare, data info, make-sft, make-pairs, make-tasks, make-tools, make-plans
- train.py  train (every stage), plan, presets, config keys, quickstart
- run.py    generate, eval, chat, serve, export, import
"""

from .main import build_parser, entry, main

__all__ = ["build_parser", "entry", "main"]
