"""Mine chat instruction pairs from a code corpus, offline: documented function -> its real source.

Every Go or Python function that carries documentation becomes one conversation in the OpenAI chat shape:

    {"messages": [{"role": "user", "content": REQUEST}, {"role": "assistant", "content": CODE}],
     "meta": {"source": PATH, "language": "go" | "python", "name": NAME}}

The request shows the function's *stub* in a fenced code block and asks for the whole function:

* Python: decorators, the `def` header up to its colon (it may span lines) and the docstring literal, all
  exactly as written. The answer is the function from its first decorator to its last line, so it repeats
  the stub and goes on with the body. Methods (also of nested classes) count; they are dedented by the
  indentation of their first line. Functions nested inside functions are not mined: they lean on the
  enclosing scope.
* Go: the `//` doc comment directly above a top-level `func` (compiler directives such as `//go:noinline`
  dropped) and the signature up to the body's `{`. The answer is the declaration from `func` to its
  closing brace, *without* the doc comment: the doc is already in the request, so the model learns to
  answer with code only.

The wording of the request is one of a few phrasings, drawn by a `random.Random` seeded from (seed, hash
of the function's code), so the output depends only on the inputs. The same hash deduplicates functions
(identical code mined twice, e.g. a vendored copy, is kept once) and picks the held-out split with
`corpus.split_of`, so a function stays in its split when files are added.

Functions that do not make a useful pair are counted by reason: `no_doc`, `short_doc` (under
`MIN_DOC_CHARS`), `trivial_body` (only `pass`, `...`, `raise NotImplementedError` or the docstring; an
empty Go body), `no_body` (a Go declaration implemented in assembly), `syntax_error` (tree-sitter found an
error inside it), `too_long` (more than `max_chars` characters), `duplicate`.
"""

from __future__ import annotations

import inspect
import random
from collections import Counter
from pathlib import Path

from ..atomic import output_dir, write_splits
from ..corpus import CorpusOptions, CorpusStats, content_hash, split_of
from .functions import DOC_NAME, LANG_NAME, MineError, mined_files

# several wordings, so the model learns the task rather than one sentence (conversation() draws one)
PHRASINGS = (
    "Implement this {Lang} function. The signature and {doc} are given; write the whole function.\n\n{block}",
    "Write `{name}` in {Lang} so that it does what its {doc} says:\n\n{block}",
    "{block}\n\nComplete the function above: keep the signature and the {doc}, and write the body.",
    ("Here is the signature of a {Lang} function together with its {doc}. Please write the full "
     "implementation.\n\n{block}"),
    "Fill in the body of the following {Lang} function.\n\n{block}",
)


# -- conversations ---------------------------------------------------------------------------------------

def conversation(fn: dict, language: str, source: str, digest: bytes, seed: int = 0) -> dict:
    """One chat example: a request phrased by a Random seeded from (seed, digest), answered by the code."""
    rng = random.Random(f"{seed}:{digest.hex()}")
    block = f"```{language}\n{fn['stub']}\n```"
    request = rng.choice(PHRASINGS).format(Lang=LANG_NAME[language], doc=DOC_NAME[language],
                                           name=fn["name"].rsplit(".", 1)[-1], block=block)
    return {"messages": [{"role": "user", "content": request}, {"role": "assistant", "content": fn["code"]}],
            "meta": {"source": source, "language": language, "name": fn["name"]}}


def mine_sft(sources: list[str], languages: list[str] | None = None, max_examples: int = 0,
             heldout_fraction: float = 0.05, seed: int = 0, max_chars: int = 4000,
             exclude_tests: bool = True) -> tuple[list[dict], list[dict], dict]:
    """(train, heldout, stats) conversations mined from `sources` (paths as `codeforge.corpus` reads them).

    Files are read in the corpus's deterministic order, with exact file dedup and, by default, test files
    left out; a file's language comes from its extension (.go, .py), other files are counted as
    `unsupported_file`. `max_examples` (0: no limit) caps train + heldout; reading stops there. stats is
    {"files", "functions", "examples", "train", "heldout", "skipped": {reason: n}, "corpus_skipped"}.
    """
    for lang in languages or []:
        if lang not in LANG_NAME:
            raise MineError(f"--languages {lang!r}: only {', '.join(sorted(LANG_NAME))} can be mined")
    if not 0.0 <= heldout_fraction < 1.0:
        raise MineError(f"heldout_fraction {heldout_fraction} must be in [0, 1)")
    if max_examples < 0 or max_chars <= 0:
        raise MineError(f"max_examples {max_examples} must be >= 0 and max_chars {max_chars} > 0")
    # mined from code with its secrets replaced and benchmark copies left out, as `prepare` does
    opts = CorpusOptions(languages=languages or ["go", "python"], exclude_tests=exclude_tests, dedup="exact",
                         val_fraction=0.0, redact_secrets=True, decontaminate=["humaneval"])
    cstats = CorpusStats()
    skipped: Counter = Counter()
    seen: set[bytes] = set()
    train: list[dict] = []
    heldout: list[dict] = []
    counts: Counter = Counter()  # files, functions
    for doc, language, found in mined_files(sources, opts, cstats, skipped, counts):
        for fn in found:
            if len(fn["code"]) > max_chars:
                skipped["too_long"] += 1
                continue
            digest = content_hash(fn["code"])
            if digest in seen:
                skipped["duplicate"] += 1
                continue
            seen.add(digest)
            split = heldout if split_of(digest, heldout_fraction) == "val" else train
            split.append(conversation(fn, language, doc.source, digest, seed))
            if max_examples and len(train) + len(heldout) >= max_examples:
                break
        if max_examples and len(train) + len(heldout) >= max_examples:
            break
    stats = {"files": counts["files"], "functions": counts["functions"],
             "examples": len(train) + len(heldout),
             "train": len(train), "heldout": len(heldout), "skipped": dict(sorted(skipped.items())),
             "corpus_skipped": dict(sorted(cstats.skipped.items()))}
    return train, heldout, stats


def write_sft(sources: list[str], out_dir: str | Path, overwrite: bool = False, **options) -> dict:
    """Mine `sources` (options as in `mine_sft`) into out_dir/{train,heldout}.jsonl and meta.json.

    The directory is written aside and renamed into place (codeforge.atomic), so a crash never leaves a
    half-written one. Returns the stats.
    """
    out = output_dir(out_dir, overwrite, MineError)
    bound = inspect.signature(mine_sft).bind(sources, **options)  # a bad option fails here, before mining
    bound.apply_defaults()
    train, heldout, stats = mine_sft(sources, **options)
    if not stats["examples"]:
        raise MineError(f"no instruction pairs found in {sources}: {stats['files']} .go/.py files, "
                        f"{stats['functions']} functions, skipped {stats['skipped']}; check the paths hold "
                        f"documented Go or Python functions, or pass --languages go python "
                        f"(now {' '.join(bound.arguments['languages'] or ['go', 'python'])})")
    write_splits(out, {"train.jsonl": train, "heldout.jsonl": heldout},
                 {"sources": list(sources),
                  "options": {k: v for k, v in bound.arguments.items() if k != "sources"}, "stats": stats})
    return stats
