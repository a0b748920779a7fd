"""Where an open model is read from: a directory, or a name on the Hugging Face Hub (`ORG/NAME`).

`quickstart --from-hf` and `codeforge import --hf` take either. A path that exists always wins (a clone named
`Qwen/Qwen2.5-Coder-0.5B` in the working directory is that clone); otherwise a text of the Hub's form
`ORG/NAME` is a name, fetched with huggingface_hub's `snapshot_download` into its usual cache (only what an
import reads: config, tokenizer, safetensors weights) or found there offline; anything else is a path that
does not exist, and is said to be one.

The environment is read at each call, not when huggingface_hub was imported (its own constants are fixed
then): HF_HUB_OFFLINE, HF_HUB_CACHE, HF_HOME and XDG_CACHE_HOME, as huggingface_hub documents them, so a
test or a wrapper that sets them before the call is obeyed.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Callable

from . import ExportError

# what import_hf reads, and nothing else (no PyTorch .bin duplicates, no GGUF or ONNX copies)
ALLOW_PATTERNS = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                  "special_tokens_map.json", "*.safetensors", "model.safetensors.index.json"]
# the Hub's rule for a repository id (huggingface_hub.utils.validate_repo_id), with the owner required: a bare
# word ("gpt2", "mymodel") is far more often a mistyped directory than a model's name
REPO_ID = re.compile(r"[A-Za-z0-9](?:[\w.-]{0,94}[A-Za-z0-9_])?/[A-Za-z0-9_](?:[\w.-]{0,94}[A-Za-z0-9_])?")
TRUE = {"1", "ON", "YES", "TRUE"}
EXAMPLE = "Qwen/Qwen2.5-Coder-0.5B"


def is_repo_id(text: str) -> bool:
    """Whether `text` has the form of a Hub model name, ORG/NAME (no `--`, `..` or `.git` ending, as the Hub
    refuses them)."""
    return bool(REPO_ID.fullmatch(text)) and "--" not in text and ".." not in text \
        and not text.endswith(".git")


def hub_cache() -> Path:
    """huggingface_hub's cache directory as the environment says now: HF_HUB_CACHE, else HF_HOME/hub, else
    XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.path.expandvars(os.environ["HF_HUB_CACHE"])).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface")
    return Path(os.path.expandvars(home)).expanduser() / "hub"


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) set true now."""
    v = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return v.strip().upper() in TRUE


def elsewhere(name: str) -> str:
    """How to bring the model over from a machine that can reach the Hub (the fix every refusal names)."""
    folder = name.split("/")[-1]
    return (f"on a machine that can reach huggingface.co run `hf download {name} --include '*.json' "
            f"'*.safetensors' --local-dir {folder}` (or `git clone https://huggingface.co/{name}`), copy "
            f"{folder}/ here and pass its path instead of the name")


def model_source(source: str | os.PathLike, log: Callable[[str], None] = print) -> tuple[Path, str | None]:
    """(the model's directory, the Hub name it came from or None) for --from-hf / import --hf SOURCE: an
    existing path as it is; an ORG/NAME from the Hub cache (downloading what is missing when online);
    ExportError naming the fix otherwise."""
    p = Path(source).expanduser()
    if p.exists():
        if not p.is_dir():
            raise ExportError(f"{source} is a file; give the model's directory (the one with config.json, "
                              f"tokenizer.json and the .safetensors weights) or a Hub name such as {EXAMPLE}")
        return p, None
    name = str(source)
    if not is_repo_id(name):
        raise ExportError(f"{source}: no such directory (so no config.json to read), and not a Hugging Face "
                          f"Hub name (ORG/NAME, such as {EXAMPLE}); check the path")
    return snapshot(name, log), name


def snapshot(name: str, log: Callable[[str], None] = print) -> Path:
    """The cached snapshot of Hub model `name` with the files an import reads, downloaded first when online
    (HF_HUB_OFFLINE unset); ExportError when it cannot be had, saying why, where the cache is and how to
    bring the model from another machine."""
    cache = hub_cache()
    offline = hub_offline()
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                            RepositoryNotFoundError, RevisionNotFoundError)
    except ImportError as e:
        raise ExportError(f"{name} looks like a Hugging Face Hub name, and reading one needs the "
                          f"huggingface_hub library ({e}): pip install huggingface_hub; or "
                          f"{elsewhere(name)}") from None
    log(f"{name}: " + (f"looking in the Hugging Face cache {cache} (HF_HUB_OFFLINE is set)" if offline else
                       f"fetching config, tokenizer and safetensors weights from the Hugging Face Hub into "
                       f"{cache} (what is there already is not fetched again)"))
    try:
        where = Path(snapshot_download(name, allow_patterns=ALLOW_PATTERNS, cache_dir=str(cache),
                                       local_files_only=offline))
    except GatedRepoError:
        raise ExportError(f"{name} is gated on the Hugging Face Hub: accept its licence on "
                          f"https://huggingface.co/{name} and log in (`hf auth login`, or HF_TOKEN), or "
                          f"{elsewhere(name)}") from None
    except RepositoryNotFoundError:
        raise ExportError(f"{name}: no such model on the Hugging Face Hub (or it is private: log in with "
                          "`hf auth login`), and no directory of that name here; check the spelling "
                          f"(e.g. {EXAMPLE})") from None
    except RevisionNotFoundError as e:
        raise ExportError(f"{name}: the Hub has no such revision ({e})") from None
    except LocalEntryNotFoundError as e:
        if type(e).__name__ == "IncompleteSnapshotError":  # newer huggingface_hub: part of it is cached
            raise ExportError(f"{name}: the copy in the Hugging Face cache {cache} is incomplete ({e}); "
                              f"fetch the rest where the Hub can be reached, or {elsewhere(name)}") from None
        why = ("HF_HUB_OFFLINE is set" if offline else
               "huggingface.co cannot be reached from here (no network, or a proxy in the way)")
        raise ExportError(f"no directory {name} here, and the model {name} is not in the Hugging Face cache "
                          f"{cache} and {why}. Either run this where the Hub can be reached (the download is "
                          "cached, later runs work offline), set HF_HUB_CACHE to a cache that has it, or "
                          f"{elsewhere(name)}") from None
    except HfHubHTTPError as e:
        raise ExportError(f"{name}: the Hugging Face Hub answered with an error ({str(e)[:300]}); try again "
                          f"later, or {elsewhere(name)}") from None
    except OSError as e:  # disk full, a cache that cannot be written
        raise ExportError(f"{name}: fetching it into {cache} failed ({e}); free space there or point "
                          f"HF_HUB_CACHE at a writable directory with room") from None
    missing = [f for f in ("config.json", "tokenizer.json") if not (where / f).is_file()]
    if not list(where.glob("*.safetensors")):
        missing.append("*.safetensors")
    if missing:
        raise ExportError(f"{name}: the copy in the Hugging Face cache ({where}) lacks {', '.join(missing)}"
                          + (" (HF_HUB_OFFLINE is set: fetch the rest online, " if offline else
                             " (the model may not publish them: codeforge reads safetensors weights and a "
                             "fast tokenizer.json; ") + f"or {elsewhere(name)})")
    return where
