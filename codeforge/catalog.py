"""The shipped catalog of model presets (presets/catalog.json: each preset's shape and parameter count), read
without torch so `codeforge presets` answers at once; config.preset_catalog() computes it afresh."""

from __future__ import annotations

import hashlib
import json
import tomllib
from importlib import resources

CATALOG = "catalog.json"  # in codeforge/presets/, beside models.toml


def catalog_key(models_toml: str) -> str:
    """What ties a catalog to the models.toml it was computed from."""
    return hashlib.sha256(models_toml.encode()).hexdigest()


def shipped_catalog() -> dict | None:
    """The shipped catalog, or None where models.toml no longer matches it (edited in place) or it is
    missing or unreadable."""
    base = resources.files("codeforge.presets")
    models_toml = base.joinpath("models.toml").read_text()
    try:
        cat = json.loads(base.joinpath(CATALOG).read_text())
    except (OSError, ValueError):
        return None
    if cat.get("models_toml") != catalog_key(models_toml) or set(cat.get("presets", {})) != set(
            tomllib.loads(models_toml)):
        return None
    return cat
