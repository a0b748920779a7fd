"""The quickstart as data: each recipe a row of stages in recipes.RECIPES, chosen by the flags (and, for a
small repository, by the corpus), walked by run_quickstart; the command's flags generated from
QuickstartOptions. Nothing here trains: the rows' stages are replaced by ones that record their calls."""

from __future__ import annotations

import inspect
import subprocess
import sys
from dataclasses import fields

import pytest

from codeforge.cli.main import build_parser
from codeforge.fields import ConfigError, default_of, from_args
from codeforge.quickstart import RECIPES, RESUME, QuickstartOptions, Recipe, run_quickstart, stage

from conftest import STDLIB


def small_repository(root, files=3):
    """A Python repository far smaller than the default run's tokens (a base is chosen for it on auto)."""
    root.mkdir()
    for i in range(files):
        (root / f"m{i}.py").write_text(f'def f{i}(x):\n    """Add {i}."""\n    return x + {i}\n')
    return root


def recorder(calls: list, name: str, result: dict | None = None):
    def run(q, **settings):
        calls.append((name, q.head, settings))
        return result
    return run


def recording_row(calls: list, name: str) -> Recipe:
    return Recipe((stage("first", recorder(calls, name)), stage("last", recorder(calls, name))))


def test_the_table_has_a_row_per_recipe_with_the_stages_users_see():
    names = {k: [s.name for s in r.stages] for k, r in RECIPES.items()}
    assert names == {
        "scratch": ["corpus", "tokenizer", "prepare", "train", "eval"],
        "base": ["corpus", "tokenizer", "prepare", "base", "train", "eval"],
        "from-hf": ["corpus", "import", "tokenizer", "prepare", "train", "eval"],
        "chat": ["reuse-plain", "corpus", "tokenizer", "prepare", "train", "chat-data", "sft", "tools",
                 "tool-calling"],
        "hrm": ["corpus", "tokenizer", "plans", "train", "eval"],
    }
    # the count the stage lines say ([k/n]): the import and the copy of the plain quickstart's data are not
    # steps
    assert {k: r.steps for k, r in RECIPES.items()} == {"scratch": 5, "base": 6, "from-hf": 5, "chat": 8,
                                                         "hrm": 5}
    assert RECIPES["scratch"].small_repository == "base" and not RECIPES["hrm"].shards


def test_every_stage_takes_the_settings_its_row_gives_it():
    """A row is data: a misspelt setting would only fail when that recipe reaches the stage, minutes in."""
    for name, recipe in RECIPES.items():
        assert len({s.name for s in recipe.stages}) == len(recipe.stages), name  # changed() finds one
        for s in recipe.stages:
            inspect.signature(s.run).bind(object(), **s.settings)


@pytest.mark.parametrize("flags, recipe", [
    ({}, "scratch"),
    ({"chat": True}, "chat"),
    ({"hrm": True}, "hrm"),
    ({"from_hf": "Qwen/Qwen2.5-Coder-0.5B"}, "from-hf"),
    ({"from_hf": "some/dir", "lora_rank": 16}, "from-hf"),
    ({"base": "none"}, "scratch"),
])
def test_the_flags_choose_the_row(flags, recipe):
    assert QuickstartOptions(**flags).recipe() == recipe
    assert recipe in RECIPES


@pytest.mark.parametrize("flags, said", [
    ({"chat": True, "hrm": True}, "two different quickstarts: pick one"),
    ({"chat": True, "base": "none"}, "not --chat or --hrm"),
    ({"hrm": True, "from_hf": "x"}, "not --chat or --hrm"),
    ({"chat": True, "lora_rank": 4, "from_hf": "x"}, "not --chat or --hrm"),
    ({"lora_rank": 4}, "give --from-hf DIR|ORG/NAME"),
])
def test_contradictory_flags_are_refused_before_anything_is_read(flags, said, tmp_path, capsys):
    with pytest.raises(ConfigError, match=said.replace("|", r"\|")):
        QuickstartOptions(**flags).recipe()
    with pytest.raises(ConfigError, match=said.replace("|", r"\|")):
        run_quickstart(str(tmp_path / "qs"), corpus="/nonexistent", **flags)
    assert not (tmp_path / "qs").exists()
    argv = ["quickstart", "--out", str(tmp_path / "qs")]
    for k, v in flags.items():
        argv += [f"--{k.replace('_', '-')}"] + ([] if v is True else [str(v)])
    from codeforge.cli import main
    assert main(argv) == 2 and said in capsys.readouterr().err


@pytest.mark.parametrize("flags, row", [
    ({"base": "none"}, "scratch"),
    ({}, "base"),  # a small Python repository: the standard library first
    ({"chat": True}, "chat"),
    ({"hrm": True}, "hrm"),
    ({"from_hf": "some/dir", "lora_rank": 4}, "from-hf"),
])
def test_run_quickstart_walks_the_row_the_flags_and_the_corpus_choose(flags, row, tmp_path, monkeypatch):
    src = small_repository(tmp_path / "repo")
    calls: list = []
    for name in RECIPES:
        monkeypatch.setitem(RECIPES, name, Recipe(recording_row(calls, name).stages,
                                                  small_repository=RECIPES[name].small_repository))
    r = run_quickstart(str(tmp_path / "qs"), corpus=str(src), **flags)
    assert [c[0] for c in calls] == [row, row] and r == {}


def test_a_new_recipe_is_a_row_walked_without_touching_run_quickstart(tmp_path, monkeypatch, capsys):
    """A row of stages that record their calls: each gets its settings and its number ([k/n] counts the
    numbered stages alone), the results merge, and an interrupted stage ends the walk with the one way on."""
    calls: list = []
    row = Recipe((
        stage("note", recorder(calls, "note"), numbered=False, said="before the first step"),
        stage("one", recorder(calls, "one", {"a": 1, "step": 1}), steps=10),
        stage("two", recorder(calls, "two", {"b": 2, "step": 2})),
        stage("three", recorder(calls, "three"), cases=3),
    ))
    monkeypatch.setitem(RECIPES, "fake", row)
    monkeypatch.setattr(QuickstartOptions, "recipe", lambda self: "fake")  # the flag that would ask for it
    r = run_quickstart(str(tmp_path / "qs"), corpus=str(STDLIB / "json"))
    assert calls == [("note", "[0/3]", {"said": "before the first step"}), ("one", "[1/3]", {"steps": 10}),
                     ("two", "[2/3]", {}), ("three", "[3/3]", {"cases": 3})]
    assert r == {"a": 1, "b": 2, "step": 2}
    assert (tmp_path / "qs" / "quickstart.json").exists()  # the survey recorded the corpus first

    calls.clear()
    stopped = Recipe((row.stages[1], stage("stop", recorder(calls, "stop", {"interrupted": "SIGINT"})),
                      row.stages[3]))
    monkeypatch.setitem(RECIPES, "fake", stopped)
    r = run_quickstart(str(tmp_path / "qs"), corpus=str(STDLIB / "json"))
    assert [c[0] for c in calls] == ["one", "stop"] and r == {"a": 1, "step": 1, "interrupted": "SIGINT"}
    assert f"interrupted; {RESUME}" in capsys.readouterr().out


def test_changed_gives_a_new_row_with_one_stages_settings_changed():
    chat = RECIPES["chat"]
    short = chat.changed("sft", training={"max_iters": 2}).changed("tool-calling", cases=3)
    assert dict(short.stages[6].settings) == {"training": {"max_iters": 2}}
    assert dict(short.stages[8].settings) == {"cases": 3}
    assert chat.stages[6].settings["training"]["max_iters"] == 150  # the table's own row is left as it was
    assert chat.stages[8].settings == {"cases": 50}
    with pytest.raises(KeyError, match="no stage 'sfft'"):
        chat.changed("sfft", training={})


def test_the_quickstart_flags_are_quickstart_options_fields():
    parser = build_parser("quickstart")
    sub = next(a for a in parser._actions if a.dest == "command").choices["quickstart"]
    actions = {a.dest: a for a in sub._actions if hasattr(a, "field")}
    assert set(actions) == {f.name for f in fields(QuickstartOptions)}
    assert all(a.field[0] is QuickstartOptions for a in actions.values())
    given = parser.parse_args(["quickstart"])
    for f in fields(QuickstartOptions):  # defaults equal
        assert getattr(given, f.name) == default_of(f), f.name
    assert from_args(QuickstartOptions, given, "quickstart") == QuickstartOptions()
    a = parser.parse_args(["quickstart", "--corpus", "go", "--max-iters", "30", "--from-hf", "d",
                           "--lora-rank", "8", "--time-budget", "2.5"])
    opts = from_args(QuickstartOptions, a, "quickstart", out="o")
    assert opts == QuickstartOptions(out="o", corpus="go", max_iters=30, from_hf="d", lora_rank=8,
                                     time_budget=2.5)
    with pytest.raises(ConfigError, match="--lora-rank"):
        from_args(QuickstartOptions, parser.parse_args(["quickstart", "--lora-rank", "-1"]), "quickstart")


def test_an_option_out_of_range_is_refused_by_its_flag(tmp_path):
    with pytest.raises(ConfigError, match=r"quickstart --val-fraction = 1\.5 is out of range"):
        run_quickstart(str(tmp_path / "qs"), corpus=str(STDLIB / "json"), val_fraction=1.5)
    assert not (tmp_path / "qs").exists()


def test_the_quickstart_parser_does_not_import_the_stages():
    """The options are the package's one light module: building the parser brings neither torch nor the
    stages in."""
    code = ("import sys\nfrom codeforge.cli.main import build_parser\nbuild_parser('quickstart')\n"
            "print(*sorted(m for m in sys.modules if m.startswith('codeforge.quickstart')), 'torch' in "
            "sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.stdout.split() == ["codeforge.quickstart", "codeforge.quickstart.options", "False"], r.stderr

