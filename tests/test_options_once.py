"""Every option is declared once: each flag of every command either comes from an options dataclass's
`fields.setting` declaration (its default, choices and help are the field's), or has no options object
behind it at all. A hand-written flag that shadows a field would be a second declaration that can drift."""

from __future__ import annotations

import argparse
from dataclasses import fields

from codeforge.cli.main import build_parser
from codeforge.fields import default_of, describe


def _commands(parser: argparse.ArgumentParser, prefix: str = ""):
    """(name, parser) of every command and subcommand, depth first."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield prefix + name, sub
                yield from _commands(sub, prefix + name + " ")


def _flags(parser: argparse.ArgumentParser):
    skip = (argparse._HelpAction, argparse._SubParsersAction)
    return [a for a in parser._actions if not isinstance(a, skip)]


def test_generated_flags_carry_their_fields_declaration():
    checked = 0
    for name, sub in _commands(build_parser()):
        for action in _flags(sub):
            if not hasattr(action, "field"):
                continue
            cls, f = action.field
            given_only = action.dest.startswith(("model.", "train."))
            assert action.default == (None if given_only else default_of(f)), (name, action.dest)
            assert action.help == describe(f).replace("%", "%%"), (name, action.dest)
            if f.metadata.get("choices"):
                assert tuple(action.choices) == tuple(f.metadata["choices"]), (name, action.dest)
            checked += 1
    assert checked > 150


def test_no_hand_written_flag_shadows_a_declared_field():
    """A hand-written argument whose destination is a field of an options class the same command builds
    would declare that option a second time."""
    hand = {}
    for name, sub in _commands(build_parser()):
        declared = {f.name for cls in getattr(sub, "options", []) for f in fields(cls)}
        for action in _flags(sub):
            if hasattr(action, "field"):
                continue
            hand.setdefault(name, []).append(action.dest)
            assert action.dest not in declared, (
                f"`codeforge {name}` declares {action.option_strings} by hand, but its options class "
                f"declares the field {action.dest!r}: generate it with fields.add_flags")
    print("hand-written arguments:", sum(map(len, hand.values())), hand)
