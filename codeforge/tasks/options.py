"""The options of `make-tasks` and `make-tools`, each declared once with fields.setting: cli/data.py makes
their flags from these classes and builds them back (fields.from_args), which checks every value against its
declaration.

Apart from code_tasks.py and tool_calls.py because every `codeforge` command builds every parser, `--help`
included: this module imports only fields.py (the task families alone take 10 ms, the sandbox more).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..fields import setting


@dataclass
class TasksOptions:
    """`codeforge make-tasks` (code_tasks.write_tasks)."""
    out: str = setting("", "directory: train.jsonl, heldout.jsonl, meta.json", required=True, metavar="DIR")
    count: int = setting(2000, "tasks in all (about a fifth are held out)", range=(1, 10**7))
    seed: int = setting(0, "random seed: the same seed writes the same tasks")
    no_validate: bool = setting(False, "skip running every reference solution against its tests in the "
                                "sandbox")
    overwrite: bool = setting(False, "replace an existing --out directory")


@dataclass
class ToolsOptions:
    """`codeforge make-tools` (tool_calls.write_tool_data)."""
    out: str = setting("", "directory: train.jsonl, heldout.jsonl, meta.json", required=True, metavar="DIR")
    count: int = setting(2000, "training conversations (0: a held-out set alone)", range=(0, 10**7))
    heldout: int = setting(200, "held-out conversations", range=(0, 10**7))
    seed: int = setting(0, "random seed: the same seed writes the same conversations")
    overwrite: bool = setting(False, "replace an existing --out directory")
