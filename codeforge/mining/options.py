"""The options of `make-sft`, `make-pairs` and `make-plans`, each declared once with fields.setting:
cli/data.py makes their flags from these classes and builds them back (fields.from_args), which checks every
value against its declaration. The miners' own functions (mine_sft, mine_pairs, mine_plans) keep checking
their keyword arguments for callers that are not the command line; tests/test_data_options.py checks that
their defaults are these.

Apart from the miners because every `codeforge` command builds every parser, `--help` included: this module
imports nothing but fields.py, the miners import tree-sitter, the sandbox and the task sets.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..fields import setting

# the languages the miners parse (functions.py), with their names as prompts write them
LANG_NAME = {"go": "Go", "python": "Python"}
# 1 - 1e-6: a held-out share of 1 would leave nothing to train on (config.py bounds its betas alike)
BELOW_ONE = 0.999999


@dataclass
class SftOptions:
    """`codeforge make-sft` (mining/sft.py)."""
    input: list[str] = setting([], "directories or files of code", required=True, metavar="PATH")
    out: str = setting("", "directory: train.jsonl, heldout.jsonl, meta.json", required=True, metavar="DIR")
    languages: list[str] | None = setting(None, "mine only these languages (default: both)", type=str,
                                          many=True, choices=tuple(LANG_NAME))
    max_examples: int = setting(0, "cap on pairs", range=(1, 10**12), zero_means="all")
    heldout_fraction: float = setting(0.05, "share of examples held out for evaluation",
                                      range=(0.0, BELOW_ONE))
    max_chars: int = setting(4000, "skip longer functions", range=(1, 10**9))
    include_tests: bool = setting(False, "also mine test files")
    seed: int = setting(0, "random seed: the same seed writes the same examples")
    overwrite: bool = setting(False, "replace an existing --out directory")


@dataclass
class PairsOptions:
    """`codeforge make-pairs` (mining/pairs.py): from code (--input) or from tasks (--tasks), one of the
    two."""
    input: list[str] | None = setting(None, "directories or files of code", type=str, many=True,
                                      metavar="PATH")
    tasks: str | None = setting(None, "instead of code: tasks with reference solutions (a `codeforge "
                                "make-tasks` directory's train split, or JSONL); every rejected variant is "
                                "run and must fail the tests", type=str, metavar="TASKS")
    out: str = setting("", "directory: train.jsonl, heldout.jsonl, meta.json", required=True, metavar="DIR")
    languages: list[str] | None = setting(None, "mine only these languages (default: both)", type=str,
                                          many=True, choices=tuple(LANG_NAME))
    max_pairs: int = setting(0, "cap on pairs", range=(1, 10**12), zero_means="all")
    per_function: int = setting(1, "broken variants per function (per task with --tasks)", range=(1, 1000))
    heldout_fraction: float = setting(0.05, "share of pairs held out for evaluation", range=(0.0, BELOW_ONE))
    seed: int = setting(0, "random seed: the same seed writes the same pairs")
    overwrite: bool = setting(False, "replace an existing --out directory")


@dataclass
class PlansOptions:
    """`codeforge make-plans` (mining/plans.py)."""
    input: list[str] = setting([], "directories or files of code", required=True, metavar="PATH")
    out: str = setting("", "directory: train.jsonl, val.jsonl, meta.json", required=True, metavar="DIR")
    languages: list[str] | None = setting(None, "mine only these languages (default: both)", type=str,
                                          many=True, choices=tuple(LANG_NAME))
    max_examples: int = setting(0, "cap on records", range=(1, 10**12), zero_means="all")
    val_fraction: float = setting(0.05, "share of functions kept for validation", range=(0.0, BELOW_ONE))
    max_chars: int = setting(4000, "skip longer functions", range=(1, 10**9))
    # 2: a cut plan ends with `...`, so it needs room for one word before it
    max_plan_words: int = setting(128, "cut longer plans (ending them with ...)", range=(2, 10**6))
    exclude_tests: bool = setting(False, "skip test files (_test.go, test_*.py, tests/)")
    seed: int = setting(0, "salt of the split: 0 is the split make-sft uses, another value another split")
    overwrite: bool = setting(False, "replace an existing --out directory")
