"""The key maps both exporters share (Hugging Face in hf.py, GGUF in gguf.py): one literal table per model
family from codeforge's tensor names to Hugging Face's, the row splits of the tensors codeforge fuses, and a
table written out layer by layer."""

from __future__ import annotations

from ..models.gpt import GPTConfig

# -- the literal key maps --------------------------------------------------------------------------------------
# "{i}" is the layer. A tuple value: the codeforge tensor is split along dim 0 into these parts (SPLITS says
# how). None: the tensor exists only in some configurations (bias, qk_norm, untied lm_head, learned positions).

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
    "blocks.{i}.mlp.c_fc.weight": ("model.layers.{i}.mlp.gate_proj.weight", "model.layers.{i}.mlp.up_proj.weight"),
    "blocks.{i}.mlp.c_fc.bias": ("model.layers.{i}.mlp.gate_proj.bias", "model.layers.{i}.mlp.up_proj.bias"),
    "blocks.{i}.mlp.c_proj.weight": "model.layers.{i}.mlp.down_proj.weight",
    "blocks.{i}.mlp.c_proj.bias": "model.layers.{i}.mlp.down_proj.bias",
    "ln_f.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}
ARCEE_KEYS = {**LLAMA_KEYS,  # a non-gated MLP: c_fc is up_proj alone
              "blocks.{i}.mlp.c_fc.weight": "model.layers.{i}.mlp.up_proj.weight",
              "blocks.{i}.mlp.c_fc.bias": "model.layers.{i}.mlp.up_proj.bias"}


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
