"""The quickstart's options, each declared once: `codeforge quickstart`'s flags are generated from these
fields (cli/train.py), `run_quickstart` builds the same object from its keywords, and the recipe they ask
for is chosen here, with the refusals of flags that contradict each other.

No torch: building the command's parser imports this module alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..fields import ConfigError, setting


@dataclass
class QuickstartOptions:
    out: str | None = setting(
        None, "default runs/quickstart (runs/quickstart-chat with --chat, -hrm with --hrm); another --corpus "
        "adds its name: runs/quickstart-go, runs/quickstart-NAME", metavar="DIR")
    corpus: str = setting(
        "python-stdlib", "python-stdlib (the default: Python's standard library) | go (Go's, where "
        "installed) | PATH (your code: a directory or a file)", metavar="NAME|PATH")
    max_iters: int | None = setting(
        None, "pretraining steps, a fixed count (default: as many of 560 as fit in --time-budget)", type=int,
        range=(1, 10**12), zero_means="as many as fit in --time-budget")
    time_budget: float | None = setting(
        None, "minutes pretraining may take on this CPU; the step count follows the pace it measures "
        "(default 8; ignored with --max-iters)", type=float, metavar="MINUTES", range=(0.0, 100_000.0))
    val_fraction: float | None = setting(
        None, "share of the corpus's files kept for validation (default: 0.02, or more for a small corpus, "
        "so validation holds at least ~20k tokens (at most a tenth of the code) in 3+ files; a run that has "
        "trained keeps the split it trained on)", type=float, range=(0.0, 0.999999))
    device: str = setting(
        "auto", "auto (a GPU if there is one, else the CPU), cpu, cuda, cuda:N or mps (default auto)",
        metavar="DEVICE")
    base: str = setting(
        "auto", "a small repository of yours (one the run would pass over more than 4 times) first trains "
        "a base on a public corpus of its language, then goes on on your files: auto (the default: Python's "
        "or Go's standard library), none (your files alone), python-stdlib, go or a PATH", metavar="CORPUS")
    from_hf: str | None = setting(
        None, "fine-tune an open code model on your code with its own tokenizer, instead of training one "
        "from scratch: a Hugging Face directory or a Hub name (Qwen/Qwen2.5-Coder-0.5B; fetched once, then "
        "read from the cache)", metavar="DIR|ORG/NAME")
    lora_rank: int = setting(
        0, "--from-hf: train LoRA adapters of rank R (e.g. 16), the model frozen", metavar="R",
        range=(1, 4096), zero_means="every weight")
    chat: bool = setting(
        False, "then chat SFT on pairs mined from the corpus and tool calling (about 20 CPU minutes; "
        "default --out runs/quickstart-chat)")
    hrm: bool = setting(
        False, "the hierarchical planner/generator model instead (docs/hierarchical-model.md): mine plans "
        "from the corpus, train it, print its metrics (about 7 CPU minutes; default --out "
        "runs/quickstart-hrm)")

    def recipe(self) -> str:
        """The name of the recipe (a row of recipes.RECIPES) the flags ask for. Looking at the corpus may
        then give a small repository the recipe that trains a base first (recipes.choose). Flags that
        contradict each other are refused here, before anything is read or written."""
        if self.chat and self.hrm:
            raise ConfigError("--chat and --hrm are two different quickstarts: pick one")
        if (self.chat or self.hrm) and (self.base != "auto" or self.from_hf or self.lora_rank):
            raise ConfigError("--base, --from-hf and --lora-rank are for the plain quickstart on your code, "
                              "not --chat or --hrm")
        if self.lora_rank and not self.from_hf:
            raise ConfigError("--lora-rank adapts an open model: give --from-hf DIR|ORG/NAME (a model "
                              "trained from scratch trains every weight)")
        return "chat" if self.chat else "hrm" if self.hrm else "from-hf" if self.from_hf else "scratch"
