"""Every export fact of a model family in one record (FAMILIES): its transformers class and key map, its
llama.cpp architecture and tensor map, the tensors stored transposed, the biases the class always has, the
rotary row order llama.cpp wants, what llama.cpp does not load. hf.py and gguf.py read these records; a new
family is one more record (and choose_family's rule for when a model is one). Also the row splits of the
tensors codeforge fuses, and a map written out layer by layer."""

from __future__ import annotations

from dataclasses import dataclass

from ..models.gpt import GPTConfig

# -- the literal key maps ------------------------------------------------------------------------------------
# "{i}" is the layer. A tuple value: the codeforge tensor is split along dim 0 into these parts (SPLITS says
# how). None: the tensor exists only in some configurations (bias, qk_norm, untied
# lm_head, learned positions).

GPT2_KEYS = {
    "wte.weight": "transformer.wte.weight",
    "wpe.weight": "transformer.wpe.weight",
    "blocks.{i}.ln_1.weight": "transformer.h.{i}.ln_1.weight",
    "blocks.{i}.ln_1.bias": "transformer.h.{i}.ln_1.bias",
    "blocks.{i}.attn.c_attn.weight": "transformer.h.{i}.attn.c_attn.weight",  # Conv1D: transposed
    "blocks.{i}.attn.c_attn.bias": "transformer.h.{i}.attn.c_attn.bias",
    "blocks.{i}.attn.c_proj.weight": "transformer.h.{i}.attn.c_proj.weight",  # Conv1D: transposed
    "blocks.{i}.attn.c_proj.bias": "transformer.h.{i}.attn.c_proj.bias",
    "blocks.{i}.ln_2.weight": "transformer.h.{i}.ln_2.weight",
    "blocks.{i}.ln_2.bias": "transformer.h.{i}.ln_2.bias",
    "blocks.{i}.mlp.c_fc.weight": "transformer.h.{i}.mlp.c_fc.weight",  # Conv1D: transposed
    "blocks.{i}.mlp.c_fc.bias": "transformer.h.{i}.mlp.c_fc.bias",
    "blocks.{i}.mlp.c_proj.weight": "transformer.h.{i}.mlp.c_proj.weight",  # Conv1D: transposed
    "blocks.{i}.mlp.c_proj.bias": "transformer.h.{i}.mlp.c_proj.bias",
    "ln_f.weight": "transformer.ln_f.weight",
    "ln_f.bias": "transformer.ln_f.bias",
    "lm_head.weight": "lm_head.weight",
}
GPT2_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")

LLAMA_KEYS = {  # Llama, Qwen2, Qwen3 and Arcee share the names; each class has a subset of them
    "wte.weight": "model.embed_tokens.weight",
    "blocks.{i}.ln_1.weight": "model.layers.{i}.input_layernorm.weight",
    "blocks.{i}.attn.c_attn.weight": ("model.layers.{i}.self_attn.q_proj.weight",
                                      "model.layers.{i}.self_attn.k_proj.weight",
                                      "model.layers.{i}.self_attn.v_proj.weight"),
    "blocks.{i}.attn.c_attn.bias": ("model.layers.{i}.self_attn.q_proj.bias",
                                    "model.layers.{i}.self_attn.k_proj.bias",
                                    "model.layers.{i}.self_attn.v_proj.bias"),
    "blocks.{i}.attn.c_proj.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blocks.{i}.attn.c_proj.bias": "model.layers.{i}.self_attn.o_proj.bias",
    "blocks.{i}.attn.q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "blocks.{i}.attn.k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
    "blocks.{i}.ln_2.weight": "model.layers.{i}.post_attention_layernorm.weight",
    # swiglu: c_fc holds gate | up (models/gpt.py MLP: gate, up = h.chunk(2))
    "blocks.{i}.mlp.c_fc.weight": ("model.layers.{i}.mlp.gate_proj.weight",
                                   "model.layers.{i}.mlp.up_proj.weight"),
    "blocks.{i}.mlp.c_fc.bias": ("model.layers.{i}.mlp.gate_proj.bias", "model.layers.{i}.mlp.up_proj.bias"),
    "blocks.{i}.mlp.c_proj.weight": "model.layers.{i}.mlp.down_proj.weight",
    "blocks.{i}.mlp.c_proj.bias": "model.layers.{i}.mlp.down_proj.bias",
    "ln_f.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}
ARCEE_KEYS = {**LLAMA_KEYS,  # a non-gated MLP: c_fc is up_proj alone
              "blocks.{i}.mlp.c_fc.weight": "model.layers.{i}.mlp.up_proj.weight",
              "blocks.{i}.mlp.c_fc.bias": "model.layers.{i}.mlp.up_proj.bias"}


# -- the literal tensor maps: codeforge name -> llama.cpp name ("{i}": layer).
# Tuples: split along dim 0 -------
GPT2_TENSORS = {
    "wte.weight": "token_embd.weight",
    "wpe.weight": "position_embd.weight",
    "blocks.{i}.ln_1.weight": "blk.{i}.attn_norm.weight",
    "blocks.{i}.ln_1.bias": "blk.{i}.attn_norm.bias",
    "blocks.{i}.attn.c_attn.weight": "blk.{i}.attn_qkv.weight",
    "blocks.{i}.attn.c_attn.bias": "blk.{i}.attn_qkv.bias",
    "blocks.{i}.attn.c_proj.weight": "blk.{i}.attn_output.weight",
    "blocks.{i}.attn.c_proj.bias": "blk.{i}.attn_output.bias",
    "blocks.{i}.ln_2.weight": "blk.{i}.ffn_norm.weight",
    "blocks.{i}.ln_2.bias": "blk.{i}.ffn_norm.bias",
    "blocks.{i}.mlp.c_fc.weight": "blk.{i}.ffn_up.weight",
    "blocks.{i}.mlp.c_fc.bias": "blk.{i}.ffn_up.bias",
    "blocks.{i}.mlp.c_proj.weight": "blk.{i}.ffn_down.weight",
    "blocks.{i}.mlp.c_proj.bias": "blk.{i}.ffn_down.bias",
    "ln_f.weight": "output_norm.weight",
    "ln_f.bias": "output_norm.bias",
    "lm_head.weight": "output.weight",
}
LLAMA_TENSORS = {  # llama, qwen2, qwen3 (arcee: ARCEE_TENSORS)
    "wte.weight": "token_embd.weight",
    "blocks.{i}.ln_1.weight": "blk.{i}.attn_norm.weight",
    "blocks.{i}.attn.c_attn.weight": ("blk.{i}.attn_q.weight", "blk.{i}.attn_k.weight",
                                      "blk.{i}.attn_v.weight"),
    "blocks.{i}.attn.c_attn.bias": ("blk.{i}.attn_q.bias", "blk.{i}.attn_k.bias", "blk.{i}.attn_v.bias"),
    "blocks.{i}.attn.c_proj.weight": "blk.{i}.attn_output.weight",
    "blocks.{i}.attn.c_proj.bias": "blk.{i}.attn_output.bias",
    "blocks.{i}.attn.q_norm.weight": "blk.{i}.attn_q_norm.weight",
    "blocks.{i}.attn.k_norm.weight": "blk.{i}.attn_k_norm.weight",
    "blocks.{i}.ln_2.weight": "blk.{i}.ffn_norm.weight",
    "blocks.{i}.mlp.c_fc.weight": ("blk.{i}.ffn_gate.weight", "blk.{i}.ffn_up.weight"),  # swiglu: gate | up
    "blocks.{i}.mlp.c_fc.bias": ("blk.{i}.ffn_gate.bias", "blk.{i}.ffn_up.bias"),
    "blocks.{i}.mlp.c_proj.weight": "blk.{i}.ffn_down.weight",
    "blocks.{i}.mlp.c_proj.bias": "blk.{i}.ffn_down.bias",
    "ln_f.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
ARCEE_TENSORS = {**LLAMA_TENSORS, "blocks.{i}.mlp.c_fc.weight": "blk.{i}.ffn_up.weight",
                 "blocks.{i}.mlp.c_fc.bias": "blk.{i}.ffn_up.bias"}
# Biases llama.cpp does not load for Qwen (it would silently ignore them): refused unless zero.
QWEN_NOT_LOADED = ("attn_output.bias", "ffn_gate.bias", "ffn_up.bias", "ffn_down.bias")


# Every model option the families below map, by name. An option not listed here (a
# new attention variant, say),
# set on a model, makes choose_family refuse the export: written without it, the file would compute another
# model. Teaching a family the option (its HF config key, its GGUF key) is where it is added.
EXPORTED_OPTIONS = frozenset({
    "arch", "vocab_size", "block_size", "n_layer", "tie_embeddings", "n_embd", "n_head", "n_kv_head", "mlp",
    "ffn_hidden", "norm", "norm_eps", "pos", "rope_base", "qk_norm", "bias", "embd_dropout", "attn_dropout",
    "resid_dropout",
})


@dataclass(frozen=True)
class FamilyRecord:
    """One model family, as both exporters and the importer see it."""
    model_type: str  # transformers' model_type (config.json), the key of FAMILIES
    hf_class: str  # the transformers class that computes it
    hf_keys: dict  # codeforge tensor -> Hugging Face tensor(s)
    hidden_act: str  # config.json's hidden_act (Arcee writes the model's own activation instead)
    gguf_arch: str  # llama.cpp's architecture name
    gguf_tensors: dict  # codeforge tensor -> llama.cpp tensor(s)
    conv1d: tuple[str, ...] = ()  # tensors Hugging Face stores transposed (GPT-2's Conv1D)
    every_bias: bool = False  # the class always has biases: zeros are written where the model has none
    rope_permuted: bool = False  # llama.cpp's rope type NORM: Q/K rows re-ordered (permute_rows)
    # tensors llama.cpp ignores for this architecture: refused unless zero
    gguf_not_loaded: tuple[str, ...] = ()
    gguf_mlp: str | None = None  # the only MLP llama.cpp's architecture computes (None: any the family has)
    hf_absent: tuple[str, ...] = ()  # biases the class does not have (choose_family checked they are zero)


FAMILIES: dict[str, FamilyRecord] = {r.model_type: r for r in (
    FamilyRecord("gpt2", "GPT2LMHeadModel", GPT2_KEYS, "gelu_pytorch_tanh", "gpt2", GPT2_TENSORS,
                 conv1d=GPT2_CONV1D, every_bias=True),
    FamilyRecord("llama", "LlamaForCausalLM", LLAMA_KEYS, "silu", "llama", LLAMA_TENSORS, rope_permuted=True),
    FamilyRecord("qwen2", "Qwen2ForCausalLM", LLAMA_KEYS, "silu", "qwen2", LLAMA_TENSORS,
                 gguf_not_loaded=QWEN_NOT_LOADED,
                 hf_absent=("o_proj.bias", "mlp.gate_proj.bias", "mlp.up_proj.bias", "mlp.down_proj.bias")),
    FamilyRecord("qwen3", "Qwen3ForCausalLM", LLAMA_KEYS, "silu", "qwen3", LLAMA_TENSORS,
                 gguf_not_loaded=QWEN_NOT_LOADED,
                 hf_absent=("mlp.gate_proj.bias", "mlp.up_proj.bias", "mlp.down_proj.bias")),
    FamilyRecord("arcee", "ArceeForCausalLM", ARCEE_KEYS, "relu2", "arcee", ARCEE_TENSORS, rope_permuted=True,
                 gguf_mlp="relu2"),
)}


def splits(m: GPTConfig) -> dict[str, list[int]]:
    """Row counts of the fused tensors' parts, in the order of the tuples above."""
    hd = m.head_dim
    return {"attn.c_attn": [m.n_head * hd, m.n_kv_head * hd, m.n_kv_head * hd],
            "mlp.c_fc": [m.ffn_hidden, m.ffn_hidden]}


def expand(keys: dict, n_layer: int) -> list[tuple[str, str | tuple[str, ...]]]:
    """The key map written out for n_layer layers: (codeforge name, Hugging Face name or names) per tensor."""
    out = []
    for ours, theirs in keys.items():
        layers = range(n_layer) if "{i}" in ours else [None]
        for i in layers:
            f = (lambda s: s.format(i=i)) if i is not None else (lambda s: s)
            out.append((f(ours), tuple(map(f, theirs)) if isinstance(theirs, tuple) else f(theirs)))
    return out
