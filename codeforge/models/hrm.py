"""HRM: a hierarchical planner / generator / refiner code model (seed 001), composed from gpt.py's Blocks.

Three causal transformer stacks share one token embedding, whose transpose is also the output matrix
(tied). Sharing is the point: with a 50k vocabulary the seed's per-module embeddings would each be
50k x 256 = 12.8M parameters, more than the 10-12M the seed budgets for a whole module, so one table serves
all three stacks and the output head.

  planner    causal over [P ; <plan> ; S ; <eot>], LM loss on S and its end.
  generator  causal over [planner states ; <code> ; Y ; <eot>], LM loss on Y. The planner's final (normed)
             hidden states are the first Lp positions of the generator's sequence, so every code position
             attends to all of them and to the code before it (the simplest honest composition: no new
             attention module, only gpt.Block). Planner padding positions are masked out as keys.
  refiner    causal over [planner states ; <draft> ; D ; <refine> ; Y ; <eot>], LM loss on Y, and a
             2-way decision head (0 refine, 1 done) read at the <refine> position, which has seen the plan
             and the whole draft D but nothing of Y.

Loss (seed 001's weights): total = 0.4 plan + 0.4 code + 0.2 (refine + decision), the decision CE folded
into refinement's 0.2 (both are the refiner's outputs); the refinement term is 0 for the first
refine_warmup_steps optimizer steps (the refiner is then not run at all, unless under DDP, where every
parameter must take part in each backward).

Scheduled sampling (Bengio et al. 2015), in its parallel one-pass form (Duckworth et al. 2019): from
ss_start_step, a row's generator (and refiner) sees planner states computed over [P ; <plan> ; S'] where
S' is the planner's own greedy prediction of each plan token under teacher forcing, with a probability
that ramps linearly from 0 to ss_max_prob over ss_ramp_steps. It costs one more planner forward, not a
plan_len-step decode.

Per-module learning rates: optim_groups gives each module its own groups carrying "lr_scale"; the trainer
sets every group's lr to the schedule's lr times its lr_scale, so warm-up and decay apply to all modules
alike. With the hrm stage's base rate 3e-4 the default scales 1.2 / 0.8 / 1.0 give seed 001's 3.6e-4
(planner), 2.4e-4 (generator), 3e-4 (refinement; the shared embedding too).

Marker tokens are reserved special tokens, whose ids are fixed in every codeforge tokenizer (tokenizer.py).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..fields import saved, setting
from ..tokenizer import EOT, SPECIAL_TOKENS
from .gpt import (Block, BlockConfig, GPTConfig, KVCache, attention_mask, init_gpt2, make_norm, refresh_rope,
                  rope_tables)
from .lm_loss import IGNORE_INDEX

EOT_ID = SPECIAL_TOKENS.index(EOT)
PAD_ID = SPECIAL_TOKENS.index("<pad>")
PLAN_ID = SPECIAL_TOKENS.index("<|reserved_0|>")    # starts the plan after the prompt
CODE_ID = SPECIAL_TOKENS.index("<|reserved_1|>")    # starts the code after the planner states
DRAFT_ID = SPECIAL_TOKENS.index("<|reserved_2|>")   # starts the draft in the refiner
REFINE_ID = SPECIAL_TOKENS.index("<|reserved_3|>")  # ends the draft; the decision is read here
REFINE, DONE = 0, 1


@dataclass
class HRMConfig(BlockConfig):
    """HRM's own fields; the block fields (width, heads, MLP, norm, positions, dropout) are BlockConfig's, the
    same for all three stacks (a learned position table is one per stack)."""
    arch: str = setting("hrm", "model architecture (the registry key, saved in checkpoints)",
                        choices=("hrm",))
    vocab_size: int = setting(50304, "model vocabulary (one embedding shared by all modules and the output)",
                              range=(256, 200_000),
                              zero_means="the data's tokenizer, padded to a multiple of 64")
    # a smaller default width and head count than GPT's (the seed's 10-12M per module); the rest of the block
    # is BlockConfig's, unchanged
    n_embd: int = setting(256, "model width (all modules)", range=(16, 16_384))
    n_head: int = setting(8, "attention heads", range=(1, 256))
    planner_layers: int = setting(3, "planner blocks", range=(1, 256))
    generator_layers: int = setting(3, "generator blocks", range=(1, 256))
    refiner_layers: int = setting(2, "refiner blocks", range=(1, 256))
    plan_len: int = setting(512, "planner context: prompt + plan tokens", range=(8, 65_536))
    code_len: int = setting(1024, "code context: body tokens (and draft tokens) with their markers",
                            range=(8, 65_536))
    refine_iters: int = setting(5, "refinement iterations at most at inference", range=(0, 100))
    plan_weight: float = setting(0.4, "loss weight of the plan", range=(0.0, 100.0))
    code_weight: float = setting(0.4, "loss weight of the code", range=(0.0, 100.0))
    refine_weight: float = setting(0.2, "loss weight of refinement: its LM loss plus the decision CE",
                                   range=(0.0, 100.0))
    refine_warmup_steps: int = setting(500, "optimizer steps with the refinement loss off", range=(0, 10**9))
    ss_start_step: int = setting(500,
                                 "scheduled sampling: the step the generator starts seeing the planner's "
                                 "own plan", range=(0, 10**9))
    ss_ramp_steps: int = setting(2000, "scheduled sampling: steps to ramp the probability to ss_max_prob",
                                 range=(0, 10**9), zero_means="at once")
    ss_max_prob: float = setting(0.5,
                                 "scheduled sampling: the largest share of rows given the planner's plan",
                                 range=(0.0, 1.0))
    planner_lr_scale: float = setting(1.2, "planner lr / base lr (3.6e-4 at the hrm stage's 3e-4)",
                                      range=(0.0, 100.0))
    generator_lr_scale: float = setting(0.8, "generator lr / base lr (2.4e-4 at 3e-4)", range=(0.0, 100.0))
    refiner_lr_scale: float = setting(1.0, "refiner (and shared embedding) lr / base lr (3e-4 at 3e-4)",
                                      range=(0.0, 100.0))

    # read by the CLI's preset table and by shape checks that expect a GPT-like config
    @property
    def n_layer(self) -> int:
        return self.planner_layers + self.generator_layers + self.refiner_layers

    @property
    def block_size(self) -> int:
        return self.plan_len + self.code_len

    def stack_config(self, n_layer: int, context: int) -> GPTConfig:
        """The GPTConfig of one module's Block stack (its own depth and context)."""
        return GPTConfig(**self.block_fields(), vocab_size=self.vocab_size, n_layer=n_layer,
                         block_size=context)

    # the key order of the model section in saved files (fields.saved), from before BlockConfig was shared
    SAVED_ORDER = ("arch", "vocab_size", "n_embd", "n_head", "n_kv_head", "planner_layers",
                   "generator_layers", "refiner_layers", "plan_len", "code_len", "refine_iters")

    def to_dict(self) -> dict:
        return saved(self, self.SAVED_ORDER)

    @classmethod
    def from_dict(cls, d: dict) -> "HRMConfig":
        names = {f.name for f in fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"unknown hrm model config keys {sorted(unknown)}; known: {sorted(names)}")
        return cls(**d)


class Stack(nn.Module):
    """A causal stack of gpt.Block over given input vectors: its own positions (a learned table or rotary
    tables), dropout, blocks and final norm. The token embedding lives in HRM (shared)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd) if cfg.pos == "learned" else None
        self.drop = nn.Dropout(cfg.embd_dropout)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layer))
        self.ln_f = make_norm(cfg, cfg.n_embd)
        if cfg.pos == "rope":
            cos, sin = rope_tables(cfg.head_dim, cfg.block_size, cfg.rope_base)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, attn_mask: torch.Tensor | None = None,
                kv_cache: KVCache | None = None) -> torch.Tensor:
        """x (B, T, C) input vectors; pos (B|1, T) positions; attn_mask (B, 1, T, L) bool or None (causal).
        Returns the normed final hidden states (B, T, C)."""
        if int(pos.max()) >= self.cfg.block_size:
            raise ValueError(f"position {int(pos.max())} exceeds this module's context of "
                             f"{self.cfg.block_size}")
        rope = None
        if self.wpe is not None:
            x = x + self.wpe(pos)
        else:
            rope = (self.rope_cos[pos].unsqueeze(1), self.rope_sin[pos].unsqueeze(1))  # (B|1, 1, T, hd)
        x = self.drop(x)
        if attn_mask is None and kv_cache is not None:  # causal after a cached prefix: gpt.py's one rule
            attn_mask = attention_mask(x.size(1), kv_cache.len, None, x.device)
        for block in self.blocks:
            x = block(x, rope, kv_cache, attn_mask)
        if kv_cache is not None:
            kv_cache.len += x.size(1)
        return self.ln_f(x)


def prefix_mask(valid: torch.Tensor, T: int) -> torch.Tensor:
    """(B, 1, T, T) bool: causal, and no query sees a planner padding key. valid (B, Lp): real prefix
    positions (Lp <= T; positions after the prefix are all real keys)."""
    B, Lp = valid.shape
    causal = torch.ones(T, T, dtype=torch.bool, device=valid.device).tril()
    keys = torch.cat([valid, valid.new_ones(B, T - Lp)], dim=1)  # (B, T)
    return causal[None, None] & keys[:, None, None, :]


class HRM(nn.Module):
    @staticmethod
    def shapes(cfg: HRMConfig) -> tuple[dict[str, tuple[int, ...]], list[list[str]]]:
        """({state-dict name: shape}, tied groups: none) of HRM(cfg), from the config alone
        (gpt.Block.shapes)."""
        out = {"wte.weight": (cfg.vocab_size, cfg.n_embd)}
        for name, n_layer, context in (("planner", cfg.planner_layers, cfg.plan_len),
                                       ("generator", cfg.generator_layers, cfg.plan_len + cfg.code_len),
                                       ("refiner", cfg.refiner_layers, cfg.plan_len + 2 * cfg.code_len)):
            sc = cfg.stack_config(n_layer, context)
            if sc.pos == "learned":
                out[f"{name}.wpe.weight"] = (context, cfg.n_embd)
            for i in range(n_layer):
                out.update(Block.shapes(sc, f"{name}.blocks.{i}."))
            out[f"{name}.ln_f.weight"] = (cfg.n_embd,)
            if sc.norm == "layernorm" and sc.bias:
                out[f"{name}.ln_f.bias"] = (cfg.n_embd,)
        out.update({"decision.weight": (2, cfg.n_embd), "decision.bias": (2,)})
        return out, []

    def __init__(self, cfg: HRMConfig):
        super().__init__()
        if cfg.pos not in ("learned", "rope") or cfg.norm not in ("layernorm", "rmsnorm"):
            raise ValueError(
                f"pos must be learned|rope and norm layernorm|rmsnorm, got {cfg.pos}, {cfg.norm}")
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.planner = Stack(cfg.stack_config(cfg.planner_layers, cfg.plan_len))
        # generator: planner states then <code> Y <eot>; refiner: planner states, <draft> D <refine> Y <eot>
        self.generator = Stack(cfg.stack_config(cfg.generator_layers, cfg.plan_len + cfg.code_len))
        self.refiner = Stack(cfg.stack_config(cfg.refiner_layers, cfg.plan_len + 2 * cfg.code_len))
        self.decision = nn.Linear(cfg.n_embd, 2)
        self.grad_checkpointing = False  # set by stages; not used here (the modules are small)
        self.loss_chunk_rows = 0
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2 initialisation per stack: weights N(0, 0.02), residual projections N(0, 0.02/sqrt(2 n_layer))
        with n_layer the stack's own depth (its residual stream sums that many branches),
        biases 0, norms 1."""
        std = 0.02
        for stack in (self.planner, self.generator, self.refiner):
            for m in stack.modules():
                init_gpt2(m, stack.cfg.n_layer, std)
            refresh_rope(stack, stack.cfg, self.wte.weight.device)
        nn.init.normal_(self.wte.weight, 0.0, std)
        nn.init.normal_(self.decision.weight, 0.0, std)
        nn.init.zeros_(self.decision.bias)

    # -- the shared surface -------------------------------------------------------------------------------
    @property
    def context_length(self) -> int:
        return self.cfg.plan_len + self.cfg.code_len

    def num_params(self, non_embedding: bool = False) -> int:
        """Exact count of distinct parameters (the shared embedding, also the output matrix, counts once)."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.wte.weight.numel()
            n -= sum(s.wpe.weight.numel() for s in (self.planner, self.generator, self.refiner)
                     if s.wpe is not None)
        return n

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs per prompt+plan+body token at full contexts (Lp = plan_len, Ly = code_len): 6 per
        matrix weight per position a stack processes (planner Lp, generator Lp + Ly, refiner Lp + 2 Ly), the
        output matmul at every scored position (Lp + 2 Ly), attention 12 * n_layer * C * T per position, all
        divided by Lp + Ly. The refiner's share is paid only after refine_warmup_steps."""
        c = self.cfg
        Lp, Ly = c.plan_len, c.code_len

        def mats(s: Stack) -> int:
            return sum(p.numel() for p in s.blocks.parameters() if p.dim() >= 2)

        C, V = c.n_embd, c.vocab_size
        parts = [(self.planner, Lp), (self.generator, Lp + Ly), (self.refiner, Lp + 2 * Ly)]
        total = sum(6 * mats(s) * T + 12 * s.cfg.n_layer * C * T * T for s, T in parts)
        total += 6 * V * C * (Lp + 2 * Ly)
        return int(total // (Lp + Ly))

    def optim_groups(self, weight_decay: float) -> list[dict]:
        """Per module (shared embedding, planner, generator, refiner + decision head), matrices decayed and
        vectors not, each group carrying "lr_scale" (the trainer's lr times it). The shared group comes first,
        so the trainer's logged lr is the base lr. Every parameter is in exactly one group (asserted)."""
        c = self.cfg
        modules = [("shared", [self.wte], c.refiner_lr_scale),
                   ("planner", [self.planner], c.planner_lr_scale),
                   ("generator", [self.generator], c.generator_lr_scale),
                   ("refiner", [self.refiner, self.decision], c.refiner_lr_scale)]
        groups, seen = [], set()
        for name, mods, scale in modules:
            ps = [p for m in mods for p in m.parameters() if p.requires_grad]
            seen.update(id(p) for p in ps)
            decay = [p for p in ps if p.dim() >= 2]
            no_decay = [p for p in ps if p.dim() < 2]
            groups.append({"params": decay, "weight_decay": weight_decay, "lr_scale": scale, "name": name})
            if no_decay:
                groups.append({"params": no_decay, "weight_decay": 0.0, "lr_scale": scale, "name": name})
        every = {id(p) for p in self.parameters() if p.requires_grad}
        assert seen == every and sum(len(g["params"]) for g in groups) == len(every), \
            "a parameter is in no optimizer group, or in two"
        return groups

    # -- the modules ----------------------------------------------------------------------------------------
    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.wte.weight)  # tied output head

    def plan_states(self, plan_idx: torch.Tensor) -> torch.Tensor:
        """(B, Lp, C) planner states over [P ; <plan> ; S ; <eot>] (right-padded)."""
        pos = torch.arange(plan_idx.size(1), device=plan_idx.device).unsqueeze(0)
        return self.planner(self.wte(plan_idx), pos)

    def _over_prefix(self, stack: Stack, prefix: torch.Tensor, plan_lens: torch.Tensor,
                     idx: torch.Tensor) -> torch.Tensor:
        """States of `stack` over [prefix (B, Lp, C) ; tokens idx (B, T)], of the token positions only (B, T,
        C). Token j of row b sits at position plan_lens[b] + j, right after the row's real prefix."""
        B, Lp, _ = prefix.shape
        T = idx.size(1)
        ar_p = torch.arange(Lp, device=idx.device)
        valid = ar_p[None] < plan_lens[:, None]  # (B, Lp)
        pos = torch.cat([ar_p[None].expand(B, Lp),
                         plan_lens[:, None] + torch.arange(T, device=idx.device)[None]], 1)
        x = torch.cat([prefix, self.wte(idx)], dim=1)  # (B, Lp + T, C)
        return stack(x, pos, prefix_mask(valid, Lp + T))[:, Lp:]

    def code_states(self, prefix: torch.Tensor, plan_lens: torch.Tensor,
                    code_idx: torch.Tensor) -> torch.Tensor:
        return self._over_prefix(self.generator, prefix, plan_lens, code_idx)

    def refine_states(self, prefix: torch.Tensor, plan_lens: torch.Tensor,
                      ref_idx: torch.Tensor) -> torch.Tensor:
        return self._over_prefix(self.refiner, prefix, plan_lens, ref_idx)

    def sampling_prob(self, step: int) -> float:
        """Share of rows whose generator sees the planner's own plan at optimizer step `step`."""
        c = self.cfg
        if step < c.ss_start_step or c.ss_max_prob == 0:
            return 0.0
        if c.ss_ramp_steps == 0:
            return c.ss_max_prob
        return c.ss_max_prob * min(1.0, (step - c.ss_start_step + 1) / c.ss_ramp_steps)

    def forward(self, batch: dict, step: int | None = None) -> dict:
        """Losses of one batch (codeforge/data/hrm_batches.py's layout). step: the optimizer step (default
        batch["step"]) for the refinement warm-up and scheduled sampling; in eval mode neither applies
        (refinement on, gold plan). Returns {"loss": weighted total, "plan", "code", "refine", "decision":
        parts, and token/decision accuracies} (detached except "loss")."""
        c = self.cfg
        step = int(batch.get("step", 0)) if step is None else step
        plan_idx, plan_lens = batch["plan_idx"], batch["plan_lens"]
        B = plan_idx.size(0)
        hp = self.plan_states(plan_idx)
        plan_logits = self.logits(hp)
        plan_loss = _ce(plan_logits, batch["plan_tgt"])
        prefix, p = hp, self.sampling_prob(step) if self.training else 0.0
        if p > 0:
            use = torch.rand(B, device=plan_idx.device) < p  # (B,) the torch RNG: resumed exactly
            # the planner's greedy guess of each plan token under teacher forcing, shifted onto its position
            guess = torch.cat([plan_idx[:, :1], plan_logits.detach().argmax(-1)[:, :-1]], dim=1)
            own = torch.where(batch["plan_s_mask"] & use[:, None], guess, plan_idx)
            prefix = torch.where(use[:, None, None], self.plan_states(own), hp)
        code_logits = self.logits(self.code_states(prefix, plan_lens, batch["code_idx"]))
        code_loss = _ce(code_logits, batch["code_tgt"])
        zero = plan_loss.new_zeros(())
        refine_on = not self.training or step >= c.refine_warmup_steps
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        refine_loss = decision_loss = zero
        dec_acc = torch.full((), float("nan"))
        if refine_on or distributed:
            hr = self.refine_states(prefix, plan_lens, batch["ref_idx"])  # (B, Lr, C)
            refine_loss = _ce(self.logits(hr), batch["ref_tgt"])
            dec = self.decision(hr[torch.arange(B, device=hr.device), batch["sep_pos"]]).float()  # (B, 2)
            decision_loss = F.cross_entropy(dec, batch["label"])
            dec_acc = (dec.argmax(-1) == batch["label"]).float().mean().detach()
        w_ref = c.refine_weight if refine_on else 0.0
        loss = c.plan_weight * plan_loss + c.code_weight * code_loss + w_ref * (refine_loss + decision_loss)
        return {"loss": loss, "plan": plan_loss.detach(), "code": code_loss.detach(),
                "refine": refine_loss.detach(),
                "decision": decision_loss.detach(), "plan_accuracy": _acc(plan_logits, batch["plan_tgt"]),
                "code_accuracy": _acc(code_logits, batch["code_tgt"]), "decision_accuracy": dec_acc,
                "ss_prob": p, "refine_on": refine_on}

    # -- inference ------------------------------------------------------------------------------------------
    def _decode(self, stack: Stack, x0: torch.Tensor, pos0: torch.Tensor, max_new: int, temperature: float,
                top_k: int, gen: torch.Generator | None, halt=None) -> tuple[list[int], bool, torch.Tensor]:
        """Sample up to max_new tokens from `stack` after the input vectors x0 (1, T0, C) at positions pos0
        (1, T0), with a KV cache. Returns (ids without <eot>, ended with <eot>, the hidden state at the end of
        the input (1, C)). halt(that state) -> True: return before sampling anything."""
        T0 = x0.size(1)
        max_new = max(0, min(max_new, stack.cfg.block_size - int(pos0.max()) - 1))
        cache = KVCache(stack.cfg, 1, T0 + max_new + 1, x0.device, x0.dtype)
        h = stack(x0, pos0, kv_cache=cache)
        first = h[:, -1]
        if halt is not None and halt(first):
            return [], False, first
        nxt = int(pos0.max()) + 1
        out: list[int] = []
        for _ in range(max_new):
            tok = _pick(self.logits(h[:, -1]).float(), temperature, top_k, gen)
            if tok == EOT_ID:
                return out, True, first
            out.append(tok)
            h = stack(self.wte(torch.tensor([[tok]], device=x0.device)),
                      torch.tensor([[nxt]], device=x0.device), kv_cache=cache)
            nxt += 1
        return out, False, first

    @torch.no_grad()
    def generate(self, prompt_ids: list[int], max_plan_tokens: int = 128, max_code_tokens: int = 256,
                 temperature: float = 0.0, top_k: int = 0, seed: int | None = None,
                 max_iters: int | None = None) -> dict:
        """Plan, write, refine for one prompt. Returns {"plan": ids, "code": ids (the final version),
        "draft": the generator's ids, "iterations": [{"iteration", "p_done", "decision", "code"}...]}: each
        iteration is the decision head's verdict on the current code and, on "refine", the rewrite. The
        loop ends when the head says done or after max_iters rewrites (default cfg.refine_iters)."""
        c = self.cfg
        dev = self.wte.weight.device
        gen = torch.Generator(device=dev).manual_seed(seed) if seed is not None else None
        max_iters = c.refine_iters if max_iters is None else max_iters
        room = c.plan_len - 2  # <plan> and <eot>
        prompt_ids = list(prompt_ids)[-max(1, room - max_plan_tokens):]
        head = torch.tensor([prompt_ids + [PLAN_ID]], device=dev)
        plan, _, _ = self._decode(self.planner, self.wte(head), torch.arange(head.size(1), device=dev)[None],
                                  min(max_plan_tokens, room - len(prompt_ids)), temperature, top_k, gen)
        plan_seq = torch.tensor([prompt_ids + [PLAN_ID] + plan + [EOT_ID]], device=dev)
        hp = self.plan_states(plan_seq)  # (1, Lp, C)
        Lp = hp.size(1)
        pos_p = torch.arange(Lp + 1, device=dev)[None]
        code_x = torch.cat([hp, self.wte(torch.tensor([[CODE_ID]], device=dev))], 1)
        draft, _, _ = self._decode(self.generator, code_x, pos_p, min(max_code_tokens, c.code_len - 2),
                                   temperature, top_k, gen)
        code, iterations = draft, []
        for i in range(max_iters):
            d = code[:c.code_len - 2]
            ids = torch.tensor([[DRAFT_ID] + d + [REFINE_ID]], device=dev)
            x = torch.cat([hp, self.wte(ids)], 1)
            pos = torch.arange(x.size(1), device=dev)[None]
            verdict = {}

            def done(h_sep: torch.Tensor) -> bool:  # the decision head at <refine>, before any rewrite
                verdict["p_done"] = float(torch.softmax(self.decision(h_sep).float(), -1)[0, DONE])
                return verdict["p_done"] >= 0.5

            rewrite, _, _ = self._decode(self.refiner, x, pos, min(max_code_tokens, c.code_len - 2),
                                         temperature, top_k, gen, halt=done)
            p_done = verdict["p_done"]
            if p_done >= 0.5:
                iterations.append({"iteration": i, "p_done": p_done, "decision": "done", "code": code})
                break
            iterations.append({"iteration": i, "p_done": p_done, "decision": "refine", "code": rewrite})
            code = rewrite
        return {"plan": plan, "code": code, "draft": draft, "iterations": iterations}


def _ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token CE over targets != -1 (0 when none), float32 softmax:
    models/lm_loss.py's convention."""
    flat = logits.reshape(-1, logits.size(-1)).float()
    total = F.cross_entropy(flat, targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")
    return total / (targets != IGNORE_INDEX).sum().clamp(min=1)


@torch.no_grad()
def _acc(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    counted = targets != IGNORE_INDEX
    hit = (logits.argmax(-1) == targets) & counted
    return hit.sum().float() / counted.sum().clamp(min=1)


def _pick(logits: torch.Tensor, temperature: float, top_k: int, gen: torch.Generator | None) -> int:
    """One token from (1, vocab) logits: greedy at temperature 0, else sampled (top-k when top_k > 0)."""
    if temperature <= 0:
        return int(logits.argmax(-1))
    logits = logits / temperature
    if top_k > 0:
        v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
        logits = logits.masked_fill(logits < v[:, -1:], float("-inf"))
    return int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
