"""One optimisation step, and the three things around it that decide whether a GPU waits: when the step's
numbers reach the host (`Readback`), where the next batch comes from (`Prefetcher`), and whether a
non-finite step is skipped by the host or on the device (`skips_on_device`).

A step launches its kernels and returns at once on a GPU; the first read of a result on the host (a
`.tolist()`, `float(t)`) waits for everything queued before it. train_step with `defer=True` reads nothing:
it returns the loss, the gradient norm and the applied flag as device tensors, the fused AdamW skips a
non-finite update itself (its `found_inf`), and the caller reads many steps' numbers in one `Readback.read`.
"""

from __future__ import annotations

import math
import queue
import threading
from collections.abc import Callable

import torch

from ..device import autocast
from . import parallel

LossFn = Callable[[torch.nn.Module, object], tuple[torch.Tensor, dict]]


def skips_on_device(opt, precision: str, mode: str) -> bool:
    """Whether `opt` can skip a non-finite update on the device: torch's fused Adam/AdamW takes a
    `found_inf` tensor (the update and its step counters left as they were where it is 1), as it does for
    the fp16 gradient scaler. Not under fp16 (the scaler decides there, on the host), nor under FSDP (its
    sharded parameters are DTensors, a path not checked)."""
    return (precision != "fp16" and mode != "fsdp" and isinstance(opt, torch.optim.Adam)
            and all(g.get("fused") for g in opt.param_groups))


def train_step(fwd, model, opt, scaler, batches, loss_fn: LossFn, accum: int, clip: float,
               device: torch.device, precision: str, mode: str = "none", parts: dict | None = None,
               params: list | None = None, sync: list | None = None, defer: bool = False):
    """Forward/backward over `accum` micro-batches from `batches`, unscale, clip, and step unless the loss or
    the gradient is non-finite (then the weights stay as they were). Returns (mean loss, grad norm, applied):
    floats and a bool read to the host in one sync, or with `defer` (only where skips_on_device) device
    tensors, nothing read. The benchmarks time this.
    `parts`, when given, gathers the metrics loss_fn returns beside the loss (a model's loss terms), each
    averaged over the micro-batches and added to what the dict holds, as tensors (no sync). `params`: what
    the gradient norm is clipped over (default: the model's). `sync`: parameters DDP does not cover (the
    trainer's aux module) whose gradients are all-reduced here. mode: parallel.py's none, ddp or fsdp; with
    several ranks the loss returned is the mean over all of them (each rank's is a mean over an equal share
    of the global batch) and the norm is the global one, so every rank takes the same decision."""
    loss_acc = torch.zeros((), device=device)
    for micro in range(accum):
        batch = next(batches)
        with parallel.set_grad_sync(fwd, mode, micro == accum - 1):
            with autocast(device, precision):
                loss, metrics = loss_fn(fwd, batch)
                loss = loss / accum
            if parts is not None:
                for k, v in metrics.items():
                    v = v.detach().float() if torch.is_tensor(v) else float(v)
                    parts[k] = parts.get(k, 0.0) + v / accum
            scaler.scale(loss).backward()
        loss_acc += loss.detach()
    for p in sync or ():  # parameters outside DDP (an aux head): average their gradients across ranks by hand
        if p.grad is not None:
            torch.distributed.all_reduce(p.grad)
            p.grad /= torch.distributed.get_world_size()
    scaler.unscale_(opt)
    norm = torch.nn.utils.clip_grad_norm_(params if params is not None else model.parameters(),
                                          clip if clip > 0 else math.inf)
    if hasattr(norm, "full_tensor"):  # FSDP: a DTensor, already reduced over the ranks' shards
        norm = norm.full_tensor()
    if mode != "none":
        torch.distributed.all_reduce(loss_acc)
        loss_acc /= torch.distributed.get_world_size()
    if defer:
        if not skips_on_device(opt, precision, mode):
            raise ValueError("train_step(defer=True) needs an optimizer that skips on the device "
                             "(skips_on_device)")
        loss_t, norm_t = loss_acc.float(), norm.float()
        applied = torch.isfinite(loss_t) & torch.isfinite(norm_t)
        # where found_inf is 1 the fused kernel leaves weights, moments and step counts as they were (a
        # skipped first step still creates the zero moments the host's skip would create at the next step:
        # the checkpoint's optimizer state has them a step early, every update is the same)
        opt.found_inf = (~applied).float()
        try:
            opt.step()
        finally:
            del opt.found_inf
        opt.zero_grad(set_to_none=True)
        return loss_t, norm_t, applied
    loss_v, norm_v = torch.stack([loss_acc.float(), norm.float()]).tolist()
    fp16_overflow = precision == "fp16" and math.isfinite(loss_v) and not math.isfinite(norm_v)
    applied = math.isfinite(loss_v) and (math.isfinite(norm_v) or fp16_overflow)
    if applied:
        scaler.step(opt)  # on an fp16 overflow the scaler skips the step itself and lowers the scale
    scaler.update()
    opt.zero_grad(set_to_none=True)
    return loss_v, norm_v, applied


class Readback:
    """Steps' (loss, norm, applied) kept on the device until `read`, which brings all of them to the host in
    one transfer (one wait for the device) and returns [(step, loss, norm, applied)] in step order."""

    def __init__(self):
        self.rows: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def add(self, step: int, loss: torch.Tensor, norm: torch.Tensor, applied: torch.Tensor) -> None:
        self.rows.append((step, loss, norm, applied))

    def __len__(self) -> int:
        return len(self.rows)

    def read(self, upto: int | None = None) -> list[tuple[int, float, float, bool]]:
        """The rows of steps <= upto (all by default), removed from what is kept."""
        take = [r for r in self.rows if upto is None or r[0] <= upto]
        if not take:
            return []
        self.rows = self.rows[len(take):]
        flat = torch.stack([torch.stack([r[1], r[2], r[3].float()]) for r in take]).tolist()
        return [(r[0], loss, norm, bool(ok)) for r, (loss, norm, ok) in zip(take, flat)]


class Prefetcher:
    """A batch source whose next batch is built by a background thread while the current step runs, so the
    step never waits for the loader (on a GPU: the copy from pinned memory runs on a side stream and the
    batch is handed over behind an event). The same batches in the same order as `source` gives them;
    state_dict() is the source's cursor after the batches handed out so far (not after the one built ahead),
    so a checkpoint resumes exactly. The source must draw its randomness from its own generators (the data
    loaders' numpy ones), never the global torch RNG the step's dropout uses."""

    def __init__(self, source, device: torch.device, depth: int = 1):
        self.source, self.device, self.depth = source, device, depth
        self.q: queue.Queue | None = None
        self.thread: threading.Thread | None = None
        self.stop = threading.Event()
        self.state = None  # the source's cursor after the last batch handed out (None: no thread yet)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def __getattr__(self, name):  # per_epoch, split, dropped, ... of the source
        if name in ("source", "__setstate__"):
            raise AttributeError(name)
        return getattr(self.source, name)

    def _work(self) -> None:
        while not self.stop.is_set():
            try:
                if self.stream is not None:
                    with torch.cuda.stream(self.stream):
                        batch = next(self.source)
                        ready = torch.cuda.Event()
                        ready.record(self.stream)
                else:
                    batch, ready = next(self.source), None
                item = (batch, ready, self.source.state_dict(), None)
            except BaseException as e:  # handed to the consumer, raised there
                item = (None, None, None, e)
            while not self.stop.is_set():
                try:
                    self.q.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if item[3] is not None:
                return

    def __iter__(self):
        return self

    def __next__(self):
        if self.thread is None:
            self.state = self.source.state_dict()
            self.q = queue.Queue(maxsize=self.depth)
            self.stop.clear()
            self.thread = threading.Thread(target=self._work, name="codeforge-prefetch", daemon=True)
            self.thread.start()
        batch, ready, state, error = self.q.get()
        if error is not None:
            self.close()
            raise error
        if ready is not None:  # the step's stream waits for the copy; the memory is the step's from now on
            torch.cuda.current_stream(self.device).wait_event(ready)
            for t in batch if isinstance(batch, (tuple, list)) else (batch,):
                if torch.is_tensor(t):
                    t.record_stream(torch.cuda.current_stream(self.device))
        self.state = state
        return batch

    def close(self) -> None:
        """Stop the thread; the batch it built ahead is dropped (the source's cursor is put back)."""
        if self.thread is not None:
            self.stop.set()
            self.thread.join()
            self.thread = None
            self.source.load_state_dict(self.state)

    def state_dict(self) -> dict:
        return self.source.state_dict() if self.state is None else dict(self.state)

    def load_state_dict(self, state: dict) -> None:
        self.close()
        self.source.load_state_dict(state)
        self.state = None
