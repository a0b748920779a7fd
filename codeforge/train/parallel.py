"""Wrapping the model for speed and for data parallelism, in one place (torchtitan's `parallelize` idea).

The trainer calls `wrap` once, before it builds the optimizer; what it returns is what the loss function
runs. Three ways, all PyTorch's own and launched by torchrun:
  - none: one process; `torch.compile` of the whole model if asked (`static`: for the one batch shape,
          as one graph where the model traces without a break, `compiled`).
  - ddp:  DistributedDataParallel. Every rank holds the whole model, its gradients and optimizer state;
          gradients are averaged in backward. The returned wrapper is what runs; the bare model is what the
          optimizer, checkpoints and evaluation use.
  - fsdp: FSDP2 (`torch.distributed.fsdp.fully_shard`) per transformer block and then the root, over a 1-D
          device mesh of all ranks: each rank keeps 1/N of every parameter, gradient and optimizer state and
          gathers a block's weights only while it runs. The model is sharded in place (its parameters become
          DTensors), so the model is also what runs; checkpoints are sharded with DCP (checkpoint/save.py).
          On GPUs a mixed-precision policy computes in bf16 (or fp16) with fp32 gradient reduction; `offload`
          keeps shards and optimizer state in CPU memory; `compile` compiles each block on its own (whole-
          model compile does not trace through FSDP's hooks); activation checkpointing is the model's own
          (`grad_checkpointing`: the recomputation re-gathers the block's weights, as FSDP2 expects).
          Only rank 0 needs the whole model in memory (`materialises`): the other ranks may build it on the
          meta device, and `wrap` fills every rank's shards from rank 0's weights (random initialisation or
          loaded), so a job holds one whole copy (rank 0's, while it starts), not one per rank, and the run
          starts from exactly the weights one process would.
"""

from __future__ import annotations

import torch

from .. import CodeforgeError
from ..distributed import startup_group


class ParallelError(CodeforgeError):
    """A parallelism setting that cannot work for this run; the message says what to use instead."""


def choose_mode(asked: str, world: int, device: torch.device, plan: tuple[float, float, float] | None = None,
                ) -> tuple[str, str]:
    """(mode, why) for a run of `world` ranks asking for --parallel `asked` (auto, ddp, fsdp).
    plan: (DDP, FSDP) estimated bytes per rank (train/memory.py) and the smallest device's memory, given only
    where FSDP could run (GPUs, AdamW); auto picks FSDP when the DDP estimate does not fit and the FSDP one
    does."""
    if world <= 1:
        if asked == "fsdp" and torch.distributed.is_initialized():  # torchrun with one rank joined a group
            return "fsdp", ("--parallel fsdp on one rank: FSDP2 over a mesh of one (its checkpoints are "
                            "sharded; with --fsdp-offload the state lives in CPU memory)")
        if asked == "fsdp":
            return "none", ("one process: nothing to shard; its checkpoints load on any number of ranks "
                            "(under torchrun --nproc_per_node 1 it runs FSDP2 over one rank)")
        return "none", "one process"
    if asked == "ddp":
        return "ddp", f"--parallel ddp over {world} ranks"
    if asked == "fsdp":
        return "fsdp", (f"--parallel fsdp over {world} ranks: "
                        "parameters, gradients and optimizer state sharded")
    if plan and plan[0] > 0.9 * plan[2] and plan[1] <= 0.9 * plan[2]:
        return "fsdp", (f"auto: DDP would need ~{plan[0] / 2**30:.1f} GiB per rank on a "
                        f"{plan[2] / 2**30:.0f} GiB device, FSDP ~{plan[1] / 2**30:.1f} GiB")
    return "ddp", (f"auto over {world} ranks (each holds the whole model; --parallel fsdp shards it when it "
                   f"does not fit)")


def materialises(mode: str, rank: int) -> bool:
    """Whether this rank builds the model's weights itself (initialises or loads them). Under FSDP only rank 0
    does; the others build the model under `torch.device("meta")` (shapes, no memory)
    and `wrap` fills them."""
    return mode != "fsdp" or rank == 0


def blocks_of(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated transformer blocks FSDP shards one by one (every model here keeps them in `blocks`)."""
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, torch.nn.ModuleList) or not len(blocks):
        raise ParallelError(f"--parallel fsdp shards per transformer block, and {type(model).__name__} has "
                            f"no `blocks` list; use --parallel ddp")
    return list(blocks)


def wrap(model: torch.nn.Module, device: torch.device, mode: str = "none", compile: bool = False,
         precision: str = "fp32", offload: bool = False, static: bool = True, say=print,
         backend: str = "inductor") -> torch.nn.Module:
    """The module the loss function runs, wrapped as `mode` says (see the module docstring). The model may
    come on the host: FSDP moves each block's shard to the device as it shards it (the device never holds
    the whole model); the other modes move it whole."""
    if mode == "fsdp":
        return _fully_shard(model, device, compile, precision, offload)
    model.to(device)
    fwd = compiled(model, static, say, backend) if compile else model
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        # gradients as views into DDP's reduction buckets: no second copy of them (4 bytes a parameter)
        fwd = DDP(fwd, device_ids=[device.index] if device.type == "cuda" else None,
                  gradient_as_bucket_view=True)
    return fwd


def compiled(model: torch.nn.Module, static: bool = True, say=print, backend: str = "inductor"):
    """torch.compile of `model` for training. static: no symbolic sizes (training runs one batch shape; the
    evaluation and samples run the bare model, so nothing recompiles the training graph) and the whole
    forward as one graph (fullgraph: no Python between kernels); a model that does not trace as one graph is
    compiled in pieces instead, said once. Otherwise PyTorch's defaults."""
    if not static:
        return torch.compile(model, backend=backend)
    return WholeGraph(model, say, backend)


class WholeGraph(torch.nn.Module):
    """The model compiled as one static graph, falling back to a static compile in pieces the first time
    tracing meets a graph break. Attributes other than forward are the model's (loss functions call its
    other methods uncompiled, as they would through torch.compile's wrapper)."""

    def __init__(self, model: torch.nn.Module, say=print, backend: str = "inductor"):
        super().__init__()
        self.inner = model
        self._run = torch.compile(model, dynamic=False, fullgraph=True, backend=backend)
        self._say, self._backend, self.whole = say, backend, True

    def forward(self, *args, **kwargs):
        if not self.whole:
            return self._run(*args, **kwargs)
        from torch._dynamo import exc
        try:
            return self._run(*args, **kwargs)
        except (exc.Unsupported, exc.UserError, getattr(exc, "FailOnRecompileLimitHit", exc.Unsupported)
                ) as e:
            why = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
            self._say(f"compile: {type(self.inner).__name__} does not run as one static graph ({why}); "
                      "compiled in pieces, with dynamic shapes")
            self.whole = False
            self._run = torch.compile(self.inner, backend=self._backend)
            return self._run(*args, **kwargs)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["inner"], name)


def _fully_shard(model, device, compile, precision, offload):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    # the other ranks arrive first and wait here while rank 0 builds (or loads) the whole model: in the
    # startup group, whose timeout is long, not under the training collectives' --dist-timeout
    dist.barrier(group=startup_group())
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    kw: dict = {"mesh": mesh}
    if device.type == "cuda" and precision in ("bf16", "fp16"):
        # compute in half precision, keep fp32 master shards and reduce gradients in fp32
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if precision == "bf16"
                                               else torch.float16, reduce_dtype=torch.float32)
    if offload:
        kw["offload_policy"] = CPUOffloadPolicy()
    blocks = blocks_of(model)
    whole = model.state_dict()  # rank 0's weights, kept until broadcast (elsewhere meta: the names only)
    persistent = set(whole)
    if dist.get_rank() != 0:
        whole = {}
    for i, block in enumerate(blocks):
        if compile:
            block.compile()  # in place: parameter names (and so checkpoints) stay the same
        # the last block's weights are needed at once by backward: keeping them gathered saves one all-gather
        fully_shard(block, reshard_after_forward=i < len(blocks) - 1, **kw)
    fully_shard(model, **kw)
    _fill_from_rank0(model, whole, persistent, device, offload)
    return model


def _fill_from_rank0(model, whole: dict, persistent: set, device: torch.device, offload: bool) -> None:
    """Every rank's shards (and buffers, and the CPU random state) from rank 0's: the ranks that built the
    model on the meta device get memory first. Run on all ranks together."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        model.to_empty(device="cpu" if offload else device)  # offloaded shards live in host memory
        if offload:  # buffers are not offloaded: they belong where FSDP put rank 0's, on the device
            for mod in model.modules():
                for k, b in mod._buffers.items():
                    if b is not None:
                        mod._buffers[k] = b.to(device)
    set_model_state_dict(model, whole,
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    whole.clear()
    with torch.no_grad():
        for name, buf in model.named_buffers():  # computed, not saved (RoPE tables): rank 0's as they are
            if name not in persistent:
                dist.broadcast(buf, src=0)
    # rank 0 drew its initial weights from the CPU generator, the meta-built ranks did not: all continue
    # from rank 0's state, as every rank did when each built the whole model
    state = [torch.get_rng_state()]
    dist.broadcast_object_list(state, src=0)
    torch.set_rng_state(state[0])


def set_grad_sync(fwd: torch.nn.Module, mode: str, sync: bool):
    """A context for one micro-batch's backward: under DDP gradient reduction only on the last micro-batch of
    an accumulation (`no_sync()`); under FSDP on every one (gradients stay sharded)."""
    import contextlib
    if mode == "ddp" and not sync:
        return fwd.no_sync()
    # FSDP reduce-scatters after every micro-batch: skipping it would keep every parameter's whole gradient
    # until the last one (4 bytes a parameter per rank), which is what FSDP is used to avoid
    return contextlib.nullcontext()


# what gloo and NCCL say when the other side of a collective is gone or late
