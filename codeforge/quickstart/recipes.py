"""The quickstart's recipes as data: each a row of stages, each stage with its settings, in one table.
`run_quickstart` chooses the row and walks it; adding a recipe is adding a row (and the flag that asks for
it, options.py).

Every stage is a function of the quickstart's state (survey.Quickstart) and its settings; it reads what the
stages before it made and fills in its own. A stage that returns a dict adds it to the result; one whose
result says "interrupted" (Ctrl-C, SIGTERM) ends the walk there, and a re-run of the same command resumes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from ..fields import check_fields
from .base import choose_base, from_base, said_from_base, train_base
from .chat import (CHAT_MODEL, CHAT_TRAIN, SFT, TOOL_CASES, TOOL_EXAMPLES, TOOLS, chat_count, make_chat_data,
                   reuse_plain, sft, tool_calling, train_tools)
from .from_hf import fine_tune, fitted_to_memory, import_model
from .hrm import HRM_CASES, HRM_TRAIN, evaluate_hrm, make_plans, train_hrm
from .options import QuickstartOptions
from .pretrain import REPO_FIM, from_scratch, make_tokenizer, prepare_data, say_corpus, train
from .report import evaluate
from .survey import Quickstart, survey

# the one way to go on after a Ctrl-C, said by training (CODEFORGE_RESUME_HINT, set by the CLI) and here
RESUME = "run the same quickstart command again to continue"


@dataclass(frozen=True)
class Stage:
    """One stage of a recipe: run(q, **settings). numbered: it is a step of the recipe's count ([3/5]); the
    stages that only prepare the next one (an import, a copy) say their lines under a numbered one."""

    name: str
    run: Callable[..., dict | None]
    settings: Mapping[str, Any] = field(default_factory=dict)
    numbered: bool = True


def stage(name: str, run: Callable[..., dict | None], numbered: bool = True, **settings: Any) -> Stage:
    return Stage(name, run, settings, numbered)


@dataclass(frozen=True)
class Recipe:
    """A row of stages. small_repository: the recipe a repository too small for this one gets instead (one
    that trains a base first; base.choose_base decides); shards: its run trains on OUT/data, so a re-run
    needs that data there and split as before (--hrm's trains on OUT/plans)."""

    stages: tuple[Stage, ...]
    small_repository: str | None = None
    shards: bool = True

    @property
    def steps(self) -> int:
        return sum(s.numbered for s in self.stages)

    def changed(self, name: str, **settings: Any) -> Recipe:
        """This recipe with stage `name`'s settings changed (a shorter stage for a test, a benchmark's
        variant)."""
        if name not in {s.name for s in self.stages}:
            raise KeyError(f"no stage {name!r} in this recipe: {[s.name for s in self.stages]}")
        return replace(self, stages=tuple(replace(s, settings={**s.settings, **settings}) if s.name == name
                                          else s for s in self.stages))


# the stages several rows share, with the same settings
CORPUS = stage("corpus", say_corpus)
TOKENIZER = stage("tokenizer", make_tokenizer)
PREPARE = stage("prepare", prepare_data, repo_fim=REPO_FIM)
EVAL = stage("eval", evaluate, small_model=True)
YOUR_FILES = " on your files"  # what the train line says the model trains on when it did not start there

RECIPES: dict[str, Recipe] = {
    # the default: a model from scratch on the corpus (cpu-small + lowend-cpu), as many steps as fit in 8 min
    "scratch": Recipe((CORPUS, TOKENIZER, PREPARE, stage("train", train, count=from_scratch), EVAL),
                      small_repository="base"),
    # a small repository: a base on a public corpus of its language first, then the repository from it
    "base": Recipe((CORPUS, TOKENIZER, PREPARE, stage("base", train_base),
                    stage("train", train, count=from_base, fit=said_from_base, on=YOUR_FILES), EVAL)),
    # --from-hf [--lora-rank R]: an open model, imported, fine-tuned with its own tokenizer
    "from-hf": Recipe((CORPUS, stage("import", import_model, numbered=False), TOKENIZER, PREPARE,
                       stage("train", train, count=fine_tune, fit=fitted_to_memory, on=YOUR_FILES),
                       stage("eval", evaluate, small_model=False))),
    # --chat: a base of its own with a context for tool conversations, then SFT, tools, and their scores
    "chat": Recipe((stage("reuse-plain", reuse_plain, numbered=False), CORPUS, TOKENIZER, PREPARE,
                    stage("train", train, count=chat_count, model=CHAT_MODEL, training=CHAT_TRAIN,
                          says_fim=False),
                    stage("chat-data", make_chat_data, tool_examples=TOOL_EXAMPLES),
                    stage("sft", sft, training=SFT), stage("tools", train_tools, training=TOOLS),
                    stage("tool-calling", tool_calling, cases=TOOL_CASES))),
    # --hrm: the hierarchical planner/generator model on plans mined from the corpus
    "hrm": Recipe((CORPUS, TOKENIZER, stage("plans", make_plans),
                   stage("train", train_hrm, training=HRM_TRAIN),
                   stage("eval", evaluate_hrm, cases=HRM_CASES)), shards=False),
}


def choose(q: Quickstart, asked: Recipe) -> Recipe:
    """The recipe to walk: the one the flags asked for, or, for a repository too small for it, the one that
    trains a base first."""
    if asked.small_repository:
        q.base = choose_base(q.opts.base, q.src, q.langs, q.lang, q.out_dir, q.trained, q.corpus.val_fraction)
        if q.base:
            return RECIPES[asked.small_repository]
    return asked


def walk(q: Quickstart, recipe: Recipe) -> dict:
    """Each stage of the recipe in order with its settings; the result is what the stages returned, merged.
    A stage interrupted ends the walk, its result saying so (the CLI's exit status 130 or 143)."""
    q.steps = recipe.steps
    for s in recipe.stages:
        q.step += s.numbered
        r = s.run(q, **s.settings) or {}
        q.result = {**q.result, **r}
        if r.get("interrupted"):
            print(f"interrupted; {RESUME}")
            break
    return q.result


def run_quickstart(out: str, *, base_dir: str | None = None, **options: Any) -> dict:
    """The quickstart into `out`. options: QuickstartOptions' fields (corpus, max_iters, device, chat, hrm,
    val_fraction, time_budget, base, from_hf, lora_rank), their defaults the command's flags'. base_dir: with
    chat, the plain quickstart's directory for the same corpus, whose tokenizer and shards are reused when it
    has them."""
    opts = QuickstartOptions(out=out, **options)
    check_fields(opts, "quickstart", via_set=False)
    asked = RECIPES[opts.recipe()]
    q = survey(opts, asked.steps, asked.shards, base_dir)
    return walk(q, choose(q, asked))

