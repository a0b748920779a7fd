"""Export a codeforge run to the formats the ecosystem runs, and import a Hugging Face model to start from.

  hf.py     Hugging Face: config.json + model.safetensors + tokenizer files, for GPT2LMHeadModel,
            LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM and ArceeForCausalLM; one literal key map per
            family, the fused projections split explicitly; the reverse (import) with the same maps.
  gguf.py   GGUF for llama.cpp (gpt2, llama, qwen2, qwen3, arcee architectures), f32 / f16 / q8_0, with the
            tokenizer, its pre-tokenizer name and the chat template.
  families.py  every export fact of a model family in one record, read by hf.py and gguf.py
  adapter.py  a LoRA run's adapter alone, and merging one back onto its base run
  hub.py      where an open model is read from: a directory, or a name on the Hugging Face Hub
  options.py  the options of `codeforge export` and `codeforge import`, declared once (flags come from them)

Both refuse what they cannot express exactly, with the list of what does not map.
"""

from __future__ import annotations

from pathlib import Path

from .. import CodeforgeError


class ExportError(CodeforgeError):
    """A run that cannot be exported exactly, or a Hugging Face directory that cannot be imported exactly;
    the message says why."""


def check_out(out: str | Path, overwrite: bool, what: str = "--out") -> Path:
    """The output path, refusing an existing one unless `overwrite`."""
    p = Path(out)
    if p.exists() and not overwrite and (p.is_file() or any(p.iterdir())):
        raise ExportError(f"{what} {p} already exists; choose another path, or pass --overwrite "
                          "to replace it")
    return p
