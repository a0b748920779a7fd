"""`codeforge export` and `codeforge import` options, declared once with `fields.setting`: cli/run.py makes
their flags and checks from these classes. No torch here, so `codeforge export --help` answers at once.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..evaluation.options import RunChoice
from ..fields import setting

FORMATS = ("hf", "gguf", "adapter")
GGUF_DTYPES = ("f32", "f16", "q8_0")  # the tensor types gguf.py writes matrices in


@dataclass
class ExportOptions(RunChoice):
    """A run written as a Hugging Face directory, a GGUF file, or its LoRA adapter alone."""

    format: str | None = setting(None, required=True, choices=FORMATS,
                                 help="hf: a Hugging Face model directory (safetensors + config, loads in "
                                      "transformers); gguf: one file for llama.cpp; adapter: a LoRA run's "
                                      "adapter alone (a directory of a few MB; `codeforge import --adapter "
                                      "DIR --base RUN` merges it back)")
    out: str | None = setting(None, required=True, metavar="PATH",
                              help="hf, adapter: a directory; gguf: a file (.gguf)")
    dtype: str = setting("f32", choices=GGUF_DTYPES, help="gguf: tensor type of the matrices")
    allow_tokenizer_mismatch: bool = setting(False,
                                             help="gguf: write the file even though llama.cpp would split "
                                                  "text differently from codeforge's tokenizer (the model "
                                                  "then sees other tokens than it was trained on); see "
                                                  "docs/export.md")
    overwrite: bool = setting(False, help="replace what --out holds")
    no_verify: bool = setting(False, help="hf: skip the logits check against transformers")
    verbose: bool = setting(False, help="gguf: say how the tokenizer's split differs from llama.cpp's")


@dataclass
class ImportOptions:
    """A codeforge run made from a Hugging Face model, or from a LoRA adapter merged onto its base run."""

    hf: str | None = setting(None, metavar="DIR|ORG/NAME",
                             help="directory with config.json, *.safetensors, tokenizer.json, or a Hub name "
                                  "(fetched once with huggingface_hub, then read from its cache)")
    adapter: str | None = setting(None, metavar="DIR",
                                  help="instead of --hf: a LoRA adapter (`export --format adapter`), "
                                       "merged onto --base")
    base: str | None = setting(None, metavar="RUN",
                               help="--adapter: the run (or checkpoint) it was trained on")
    out: str | None = setting(None, required=True, metavar="RUN",
                              help="the run directory to create from the imported model")
    overwrite: bool = setting(False, help="replace what --out holds")
    no_verify: bool = setting(False, help="skip the logits check against transformers")
