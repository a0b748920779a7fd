"""Memory per rank before launching: parameters, gradients, optimizer state, FSDP's gathered working set,
autocast's weight copies and activations, under DDP and under FSDP, for a model and training config.

An estimate from the model's shapes, not a measurement: `benchmarks/fsdp_memory.py` measures peak memory of
CPU ranks against it (docs/LOG.md#2026-11-23-fsdp-memory has the comparison). The terms:
  - parameters, gradients: fp32, 4 bytes each; FSDP keeps 1/N of them per rank.
  - optimizer state: AdamW two fp32 moments (8 bytes per parameter); Muon one momentum for the hidden
    matrices; 8-bit AdamW 2 bytes. FSDP: 1/N. With LoRA (train.lora_rank) gradients and optimizer state are
    the adapters' alone (AdamW), and the frozen weights stay fp32 beside them.
  - gathered (FSDP only): the weights of the blocks being computed are all-gathered whole, and their
    gradients are whole until reduce-scattered: two blocks (the one running and the one prefetched), the
    last block (kept gathered between forward and backward) and the root's own weights (embeddings,
    head, final norm), in the compute dtype for weights and fp32 for gradients.
  - autocast copies (bf16/fp16 on GPUs, DDP): autocast caches a half-precision copy of every weight for the
    step. Under FSDP the mixed-precision policy gathers half-precision weights instead (counted above).
  - activations: what backward keeps per token and layer (pre-norm block: the block input, both norm
    outputs, q/k/v, attention output, and the MLP's hidden tensors; flash/SDPA attention keeps no T x T
    matrix), times layers, plus the logits with their gradient (unless the chunked loss is on). With
    gradient checkpointing only each block's input is kept, plus one block's worth while it is recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models import build_model

GIB = 2**30


@dataclass
class Plan:
    params: int
    block_params: int
    root_params: int
    world: int
    rows: dict[str, tuple[float, float]]  # term -> (DDP bytes, FSDP bytes) per rank
    no_fsdp: str = ""  # why FSDP is not an option for this run ("" when it is)
    adapters: int = 0  # LoRA's trainable parameters (0: every parameter trains)

    def total(self, mode: str) -> float:
        i = 0 if mode == "ddp" else 1
        return sum(v[i] for v in self.rows.values())


def estimate(model_cfg, train_cfg, world: int, precision: str = "fp32", offload: bool = False) -> Plan:
    """Per-rank bytes of a run of `model_cfg`/`train_cfg` on `world` ranks at `precision` (fp32, bf16,
    fp16: the compute dtype of activations and gathered weights). offload: FSDP's CPU offload (shards,
    gradients and optimizer state leave the device)."""
    with torch.device("meta"):
        model = build_model(model_cfg)
    params = model.num_params()
    blocks = getattr(model, "blocks", [])
    block_params = sum(p.numel() for p in blocks[0].parameters()) if len(blocks) else 0
    root_params = params - block_params * len(blocks)
    m, t = model_cfg, train_cfg
    half = precision in ("bf16", "fp16")
    cdt = 2 if half else 4  # bytes of a compute-dtype value

    # LoRA (train.lora_rank): the weights are frozen; gradients and optimizer state are the adapters' alone
    rank = getattr(t, "lora_rank", 0)
    targets = {x.strip() for x in getattr(t, "lora_targets", "").split(",") if x.strip()}
    adapters = sum(rank * (mod.in_features + mod.out_features) for b in blocks
                   for name, mod in b.named_modules()
                   if isinstance(mod, torch.nn.Linear) and name.rsplit(".", 1)[-1] in targets) if rank else 0
    trained = adapters if rank else params
    # AdamW; the adapters train with it whatever the optimizer (Muon skips LoRA's factors)
    opt_bytes = 8 * trained
    if t.optimizer == "adamw8bit" and not rank:
        opt_bytes = 2 * params
    elif t.optimizer == "muon" and not rank:
        hidden = sum(p.numel() for b in blocks for p in b.parameters() if p.dim() == 2)
        opt_bytes = 4 * hidden + 8 * (params - hidden)

    # activations of one micro-batch on one rank
    rows = t.batch_size * m.block_size
    C = m.n_embd
    H = getattr(m, "ffn_hidden", 4 * C) or 4 * C
    kv = getattr(m, "n_kv_head", m.n_head) or m.n_head
    qkv = C + 2 * C * kv // m.n_head
    mlp = 4 * H if getattr(m, "mlp", "gelu") == "swiglu" else 2 * H
    per_layer = (5 * C + qkv + mlp) * cdt  # input, 2 norm outputs, attn out, residual; q/k/v; MLP hidden
    V = m.vocab_size
    # logits, fp32 log-probs, grad
    logits = 0 if getattr(t, "loss_chunk_rows", 0) else rows * V * (cdt + 4 + 4)
    if t.grad_checkpointing:
        acts = rows * (len(blocks) * C * cdt + per_layer) + logits
    else:
        acts = rows * len(blocks) * per_layer + logits

    n = world
    shard = 0 if offload else 1
    # running + prefetched + the last one kept between forward and backward
    gathered_blocks = 3 * block_params
    r = {
        "parameters": (4 * (params + adapters), shard * 4 * params / n),
        "gradients": (4 * trained, shard * 4 * params / n),
        "optimizer state": (opt_bytes, shard * opt_bytes / n),
        "gathered weights + gradients": (0, (gathered_blocks + root_params) * (cdt + 4)),
        "autocast weight copies": (cdt * params if half else 0, 0),
        "activations": (acts, acts),
    }
    no_fsdp = ("FSDP shards per transformer block and this model has none" if not len(blocks) or
               getattr(model_cfg, "arch", "gpt") != "gpt" else
               "LoRA trains with DDP or one process" if rank else
               f"FSDP trains with AdamW, not {t.optimizer}" if t.optimizer != "adamw" else "")
    return Plan(params, block_params, root_params, world, r, no_fsdp, adapters)


def fits(plan: Plan, device_bytes: float) -> tuple[bool, bool]:
    """(DDP fits, FSDP fits) in 90% of `device_bytes` (the allocator, CUDA context and fragmentation)."""
    return plan.total("ddp") <= 0.9 * device_bytes, not plan.no_fsdp and plan.total(
        "fsdp"
    ) <= 0.9 * device_bytes


def report(plan: Plan, model_cfg, train_cfg, precision: str, device_bytes: float | None,
           name: str = "") -> str:
    m, t = model_cfg, train_cfg
    gib = lambda b: f"{b / GIB:8.2f} GiB" if b else "        -   "  # noqa: E731
    lines = [f"plan: {name or 'model'}: {plan.params:,} parameters ({m.n_layer} layers x {m.n_embd}, context "
             f"{m.block_size}, vocab {m.vocab_size}); micro-batch {t.batch_size} x {m.block_size} tokens per "
             f"rank, {t.optimizer}, {precision}{', gradient checkpointing' if t.grad_checkpointing else ''}"
             f"{', FSDP CPU offload' if t.fsdp_offload else ''}; {plan.world} rank(s)"
             + (f"; LoRA rank {t.lora_rank}: {plan.adapters:,} trainable "
                f"({plan.adapters / plan.params:.2%}), the rest frozen" if plan.adapters else ""),
             f"  {'per rank':30s} {'DDP':>12s} {'FSDP':>12s}"]
    for k, (d, f) in plan.rows.items():
        lines.append(f"  {k:30s} {gib(d)} {gib(f)}")
    lines.append(f"  {'total':30s} {gib(plan.total('ddp'))} {gib(plan.total('fsdp'))}")
    if device_bytes:
        ddp_ok, fsdp_ok = fits(plan, device_bytes)
        lines.append(f"  {'fits ' + f'{device_bytes / GIB:.0f} GiB':30s} {'yes' if ddp_ok else 'no':>12s} "
                     f"{'yes' if fsdp_ok else 'no':>12s}")
        if ddp_ok:
            advice = "--parallel ddp (the default): every rank holds the whole model and it fits"
        elif plan.no_fsdp:
            advice = (f"DDP does not fit and {plan.no_fsdp}: try --gradient-checkpointing, a smaller "
                      f"--batch-size with more --grad-accum-steps, or a smaller model")
        elif fsdp_ok:
            advice = "--parallel fsdp: DDP does not fit, the sharded run does"
        else:
            tips = [x for x, on in (("--gradient-checkpointing", not t.grad_checkpointing),
                                    ("a smaller --batch-size with more --grad-accum-steps", t.batch_size > 1),
                                    ("--fsdp-offload", not t.fsdp_offload), ("more ranks", True)) if on]
            advice = "neither fits: try " + ", ".join(tips)
        lines.append(f"  -> {advice}")
    if plan.no_fsdp:
        lines.append(f"  (FSDP column for comparison only: {plan.no_fsdp})")
    lines.append("  (an estimate from the shapes; the CUDA context and allocator add ~0.5-1 GiB. Under FSDP "
                 "one rank per host builds the whole model in host memory (4 bytes a parameter) and the "
                 "others start empty; each rank then holds its shard on its device)")
    return "\n".join(lines)
