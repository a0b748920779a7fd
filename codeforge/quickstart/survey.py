"""What a quickstart starts from: the corpus (a named one or your path, its languages, the share of its files
kept for validation) and what --out already holds (the corpus it was made from, a run that has trained, the
data that run trained on). `survey` looks at both before any stage runs, so every refusal comes before
anything is written but the record of the corpus; `Quickstart` is the state the stages then fill in.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path

from .. import rundir
from ..corpus import (EXT_TO_LANG, CorpusOptions, CorpusStats, describe_skipped, iter_documents,
                      sized_val_fraction, walk_tree)
from ..fields import ConfigError
from .options import QuickstartOptions

CORPUS_RECORD = "quickstart.json"  # in --out: the corpus the quickstart there was made from
# the least share of files kept for validation; a small corpus gets more (corpus.sized_val_fraction)
QUICK_VAL = 0.02
DECONTAMINATE = ("humaneval",)  # benchmark sources no training document may overlap (decontam.py)


def corpus_path(corpus: str) -> tuple[str, list[str] | None]:
    """(path, languages) of a named corpus or a user path (languages None: every language known by
    extension)."""
    if corpus == "python-stdlib":
        return sysconfig.get_paths()["stdlib"], ["python"]
    if corpus == "go":
        roots = sorted(glob.glob("/usr/share/go-*/src") + glob.glob("/usr/lib/go-*/src")
                       + glob.glob("/usr/local/go/src"))
        if shutil.which("go"):
            root = subprocess.run(["go", "env", "GOROOT"], capture_output=True, text=True).stdout.strip()
            if root and os.path.isdir(os.path.join(root, "src")):
                roots.append(os.path.join(root, "src"))
        if not roots:
            raise FileNotFoundError("no Go standard library source found: install it with `sudo apt-get "
                                    "install golang-src` (Debian/Ubuntu) or from go.dev, then rerun")
        return roots[-1], ["go"]
    if not os.path.exists(corpus):
        raise FileNotFoundError(f"--corpus {corpus!r}: not python-stdlib, go, or an existing path")
    return corpus, None


def corpus_languages(src: str, langs: list[str] | None) -> dict[str, int]:
    """Files per known language in a corpus, most first (a named corpus: its own language alone,
    uncounted)."""
    if langs:
        return {lang: 0 for lang in langs}
    counts: dict[str, int] = {}
    paths = [Path(src)] if os.path.isfile(src) else (Path(r) / f for r, _, fs in walk_tree(src) for f in fs)
    for i, f in enumerate(paths):
        if i >= 200_000:  # enough to tell the language; a huge tree is not walked twice
            break
        lang = EXT_TO_LANG.get(f.suffix)
        if lang:
            counts[lang] = counts.get(lang, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def corpus_language(counts: dict[str, int]) -> str | None:
    """The corpus's language for prompts, benchmarks and hints (counts: corpus_languages'): the one most files
    are in when it is one the prompts know (python or go), else None."""
    best = next(iter(counts), None)
    return best if best in ("python", "go") else None


def describe_corpus(counts: dict[str, int], langs: list[str] | None) -> str:
    """The corpus line's parenthesis: what will be read, in the words of what is there."""
    if langs:
        return f"{', '.join(langs)}, test files excluded"
    if not counts:
        return "no file of a known language found"
    found = ", ".join(f"{n:,} {lang}" for lang, n in list(counts.items())[:4])
    return f"{found}{' ...' if len(counts) > 4 else ''} file(s) by extension, test files excluded"


def record_of(src: str, langs: list[str] | None) -> dict:
    """The corpus record a quickstart made from `src` writes in its directory."""
    return {"corpus": os.path.realpath(src), "languages": langs}


def read_record(out_dir: Path) -> dict | None:
    """The corpus record of a quickstart directory, or None where it has none (or it cannot be read)."""
    try:
        return json.loads((out_dir / CORPUS_RECORD).read_text())
    except (OSError, ValueError):
        return None


def same_corpus(out_dir: Path, src: str, langs: list[str] | None) -> None:
    """Refuse a corpus other than the one --out was made from (its tokenizer, shards and run would be mixed
    with the new corpus's, and the old run's data overwritten); record the corpus on first use. A directory
    made before the record is judged by the sources its shards name."""
    record = out_dir / CORPUS_RECORD
    now = record_of(src, langs)
    try:
        was = json.loads(record.read_text())
        seen = [was["corpus"]] if was != now else None
    except FileNotFoundError:
        try:
            sources = json.loads((out_dir / "data" / "meta.json").read_text())["sources"]
            seen = sources if [os.path.realpath(x) for x in sources] != [now["corpus"]] else None
        except (OSError, ValueError, KeyError, TypeError):
            seen = None
    except (OSError, ValueError, KeyError, TypeError):
        seen = [f"an unreadable {record}"]
    if seen:
        raise ConfigError(f"{out_dir} holds a quickstart made from {', '.join(map(str, seen))}, not "
                          f"{now['corpus']}; give this corpus its own directory with --out (e.g. --out "
                          f"{out_dir}-new), or delete {out_dir} to start over there")
    if not record.exists():
        out_dir.mkdir(parents=True, exist_ok=True)
        record.write_text(json.dumps(now) + "\n")


def prepared_meta(data_dir: Path) -> dict | None:
    """DIR/meta.json of prepared data, or None where there is none or it predates the options it records."""
    try:
        meta = json.loads((data_dir / "meta.json").read_text())
        return meta if isinstance(meta.get("options"), dict) and "val_fraction" in meta["options"] else None
    except (OSError, ValueError, AttributeError):
        return None


def sized_split(src: str, langs: list[str] | None, val_fraction: float | None) -> float:
    """The share of files kept for validation: val_fraction when given, else QUICK_VAL, or more where that
    leaves a validation split too small to score on. Stops here, at step 1, when the corpus holds no code."""
    stats = CorpusStats()
    docs, code = [], 0
    for d in iter_documents([src], CorpusOptions(languages=langs, exclude_tests=True), stats):
        docs.append((d.digest, d.nbytes))
        code += d.nbytes if EXT_TO_LANG.get(Path(d.source).suffix) != "text" else 0  # README.md is not code
    if not code:
        raise ConfigError(f"no code found in {src}: the quickstart reads source files by extension (.py, "
                          f".go, .rs, .js, ...; test files left out) and found none it could use (skipped: "
                          f"{describe_skipped(stats.skipped)}). Point --corpus at a directory of source code")
    return val_fraction if val_fraction is not None else sized_val_fraction(docs, QUICK_VAL)


def same_split(out_dir: Path, old: dict, opts: CorpusOptions) -> None:
    """Refuse to prepare the data of a run that has trained on it with other options (another --val-fraction
    would move documents it trained on into validation, and every later score would flatter it)."""
    diff = [f"{k.replace('_', '-')} {old['options'].get(k)!r} -> {v!r}" for k, v in opts.to_dict().items()
            if old["options"].get(k) != v]
    if diff:
        raise ConfigError(f"{out_dir / 'run'} trained on data prepared with other settings "
                          f"({'; '.join(diff)}); preparing it again would move files between its training "
                          f"and validation splits, so later scores could count files it trained on. Give the "
                          f"new settings their own directory (--out {out_dir}-new), or drop --val-fraction "
                          f"to go on with this run (nothing was changed)")


@dataclass
class Quickstart:
    """One quickstart as it goes: its options, what the survey found, and what each stage has made so far.
    Every stage of a recipe reads and fills in this one object."""

    opts: QuickstartOptions
    out_dir: Path
    src: str  # the corpus's path
    langs: list[str] | None  # a named corpus's language; None: every language known by extension
    counts: dict[str, int]  # files per language, most first
    lang: str | None  # python or go: the language of the sample prompt, HumanEval and the hints
    trained: bool  # OUT/run has a checkpoint: a re-run, which resumes it on the data it trained on
    corpus: CorpusOptions  # how the corpus is read and split (a trained run's own, kept)
    plain_dir: Path | None = None  # --chat: the plain quickstart's directory (its tokenizer and shards)
    started: float = field(default_factory=time.perf_counter)
    base: tuple[str, list[str] | None] | None = None  # a small repository's base corpus (recipes.choose)
    # made by the stages, in the order they run
    imported: Path | None = None  # --from-hf: the imported run
    tok_dir: Path | None = None
    meta: dict | None = None  # OUT/data/meta.json
    repo_fim: float = 0.0  # the share of repo-level FIM documents OUT/data holds
    base_run: Path | None = None  # the base's run (None: interrupted) and the seconds it has trained
    base_seconds: float = 0.0
    chat_results: dict = field(default_factory=dict)  # the chat stages' runs and scores, returned at the end
    result: dict = field(default_factory=dict)
    step: int = 0  # the numbered stage running, of `steps`
    steps: int = 0

    @property
    def data_dir(self) -> Path:
        return self.out_dir / "data"

    @property
    def run_dir(self) -> Path:
        return self.out_dir / "run"

    @property
    def head(self) -> str:
        """The running stage's number, as its first line starts: [3/5]."""
        return f"[{self.step}/{self.steps}]"


def survey(opts: QuickstartOptions, steps: int, shards: bool, plain_dir: str | None = None) -> Quickstart:
    """The corpus and --out, looked at before any stage runs. steps: the asked recipe's count, for the corpus
    line said with a refusal at step 1; shards: the recipe's run trains on OUT/data (the hierarchical model's
    on OUT/plans), so a run that has trained needs that data still there and split the same way."""
    started = time.perf_counter()
    out_dir = Path(opts.out)
    src, langs = corpus_path(opts.corpus)
    same_corpus(out_dir, src, langs)
    counts = corpus_languages(src, langs)  # one walk of the tree for the language and the corpus line
    data_dir, run_dir = out_dir / "data", out_dir / "run"
    trained = (run_dir / rundir.CHECKPOINTS).exists()
    old = prepared_meta(data_dir)
    if trained and not old and shards:
        raise ConfigError(f"{data_dir}, the data {run_dir} trained on, is gone (or unreadable): preparing "
                          f"it again could split the files differently and score the run on files it "
                          f"trained on. Restore it, give a new run its own directory (--out {out_dir}-new), "
                          f"or delete {out_dir} to start over")
    val_fraction = opts.val_fraction
    if val_fraction is None and trained and old:
        val_fraction = old["options"]["val_fraction"]  # the split the run trained on
    elif not trained or val_fraction is None:
        try:
            val_fraction = sized_split(src, langs, val_fraction)
        except ConfigError:  # no code: said at step 1, after the line that says what was read
            print(f"[1/{steps}] corpus: {src} ({describe_corpus(counts, langs)})")
            raise
    # a run that has trained keeps the options its data was prepared with; a new one leaves out the
    # benchmarks the quickstart scores (decontam.py: HumanEval) and replaces secrets (redact.py)
    kept = old["options"] if trained and old else None
    corpus = CorpusOptions(languages=langs, exclude_tests=True, val_fraction=val_fraction,
                           decontaminate=kept.get("decontaminate", []) if kept else list(DECONTAMINATE),
                           redact_secrets=bool(kept.get("redact_secrets")) if kept else True)
    if kept and shards:
        same_split(out_dir, old, corpus)
    return Quickstart(opts, out_dir, src, langs, counts, corpus_language(counts), trained, corpus,
                      plain_dir=Path(plain_dir) if plain_dir else None, started=started)
