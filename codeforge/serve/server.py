"""`codeforge serve`: load a run, check the options, bind the socket, run uvicorn over the app."""

from __future__ import annotations

import ipaddress
import os
import socket
import sys
from pathlib import Path

from .. import CodeforgeError, rundir
from ..checkpoint import load_model
from ..device import choose_device, choose_precision
from ..engine import Engine
from .app import ServeOptions, create_app


class ServeError(CodeforgeError):
    """A serve option that cannot work; the message names it and the fix."""


def run_name(run: str) -> str:
    """The model's name in the API: the run directory's name (also when a checkpoint directory is given)."""
    p = Path(run).resolve()
    if p.parent.name == rundir.CHECKPOINTS:
        p = p.parent.parent
    return p.name or "codeforge"


def check_options(a) -> None:
    for flag, value, lo in (("--max-batch", a.max_batch, 1), ("--max-queue", a.max_queue, 1),
                            ("--max-prompt-tokens", a.max_prompt_tokens, 0), ("--max-tokens-cap", a.max_tokens_cap, 0),
                            ("--max-body-bytes", a.max_body_bytes, 1024)):
        if value < lo:
            raise ServeError(f"{flag} {value} must be at least {lo}")
    if a.max_batch > 256:
        raise ServeError(f"--max-batch {a.max_batch} is more than 256 rows per step; the cache is sized for it")
    if a.request_timeout < 0:
        raise ServeError(f"--request-timeout {a.request_timeout} must be >= 0 (0: no limit)")
    if not 0 <= a.port <= 65535:
        raise ServeError(f"--port {a.port} is not a TCP port (0..65535; 0 picks a free one)")
    if a.api_key is not None and not a.api_key.strip():
        raise ServeError("--api-key is empty; give a key, or leave the option out for no authentication")


def bind(host: str, port: int) -> socket.socket:
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        return socket.create_server((host, port), family=family)
    except OSError as e:
        raise ServeError(f"cannot listen on {host}:{port}: {os.strerror(e.errno) if e.errno else e}; pick another --port "
                         f"(0 picks a free one) or --host") from None


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def serve_command(a) -> int:
    import uvicorn

    check_options(a)
    dev, why = choose_device(a.device)
    precision, _ = choose_precision(dev, "auto")
    model, tok, ck, cfg = load_model(a.run, dev, a.checkpoint, log=lambda m: print(f"note: {m}", file=sys.stderr))
    engine = Engine(model, tok, dev, precision)
    block = engine.block_size
    if a.max_prompt_tokens >= block:
        raise ServeError(f"--max-prompt-tokens {a.max_prompt_tokens} must be below the model's context of {block} "
                         f"(one position is left for the reply)")
    stage = cfg.get("train", {}).get("stage", "pretrain")
    opts = ServeOptions(model_name=a.model_name or run_name(a.run), api_key=a.api_key, max_batch=a.max_batch,
                        max_queue=a.max_queue, max_prompt_tokens=a.max_prompt_tokens, max_tokens_cap=a.max_tokens_cap,
                        request_timeout=a.request_timeout, max_body_bytes=a.max_body_bytes, stage=stage,
                        checkpoint=str(ck))
    sock = bind(a.host, a.port)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    app = create_app(engine, opts)
    kinds = "chat and tools" if stage in ("sft", "tools") else "completions and fill-in-the-middle"
    print(f"serving {opts.model_name} ({model.num_params() / 1e6:.1f}M parameters, {stage} run: {kinds}; "
          f"context {block}) from {ck}")
    print(f"device {dev} ({why}), {precision}; batch {a.max_batch} rows, queue {a.max_queue}")
    print(f"listening on http://{shown}:{port}/  (OpenAI base URL http://{shown}:{port}/v1"
          f"{', API key required' if a.api_key else ''})", flush=True)
    if not a.api_key and not _loopback(host):
        print(f"warning: {host} is reachable from other machines and there is no --api-key: anyone who can reach "
              f"port {port} can use the model", file=sys.stderr)
    config = uvicorn.Config(app, log_level="info" if a.access_log else "warning", access_log=a.access_log,
                            timeout_graceful_shutdown=5)
    uvicorn.Server(config).run(sockets=[sock])
    return 0
