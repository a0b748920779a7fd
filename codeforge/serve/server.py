"""`codeforge serve`: load a run, check the options, bind the socket, run uvicorn over the app with the
connection guard (connections.py).

The API key is read from --api-key, --api-key-file or the CODEFORGE_API_KEY environment variable (the first
shows in `ps` to every user of the machine; the other two do not)."""

from __future__ import annotations

import ipaddress
import os
import socket
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path

from .. import CodeforgeError, rundir
from ..checkpoint import load_model
from ..data.shards import ShardSet
from ..syntax import guess_language
from ..config import chat_notice, speaks_chat
from ..device import choose_device, choose_precision, system_memory
from ..engine import Engine
from .app import create_app
from .guard import parse_hosts, parse_origins
from .options import ServeOptions
from .connections import (MAX_DEFAULT_CONNECTIONS, ConnectionGuard, ConnectionLimits, Server, body_pieces,
                          connection_budget)

API_KEY_ENV = "CODEFORGE_API_KEY"


class ServeError(CodeforgeError):
    """A serve option that cannot work; the message names it and the fix."""


def check_options(opts: ServeOptions) -> tuple[ServeOptions, str]:
    """What the declared ranges (options.py, checked when the flags were read) cannot say: the Host and
    Origin lists parse, and the API key is readable. Returns the options with the key read, and where it
    came from."""
    try:
        parse_hosts(opts.allowed_hosts)
        parse_origins(opts.allowed_origins)
    except ValueError as e:
        raise ServeError(str(e)) from None
    key, key_from = api_key(opts)
    return replace(opts, api_key=key), key_from


def api_key(a) -> tuple[str | None, str]:
    """(the key, where it came from): --api-key, else --api-key-file, else $CODEFORGE_API_KEY, else none."""
    if a.api_key is not None and a.api_key_file:
        raise ServeError("--api-key and --api-key-file both given; use one (--api-key-file keeps the key "
                         "out of `ps`)")
    if a.api_key is not None:
        if not a.api_key.strip():
            raise ServeError("--api-key is empty; give a key, or leave the option out for no authentication")
        return a.api_key.strip(), "--api-key"
    if a.api_key_file:
        path = Path(a.api_key_file)
        try:
            key = path.read_text(encoding="utf-8").strip()
        except FileNotFoundError:
            raise ServeError(f"--api-key-file {path}: no such file") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ServeError(f"--api-key-file {path}: cannot read it ({e})") from None
        if not key:
            raise ServeError(f"--api-key-file {path} is empty; put the key in it (one line)")
        if "\n" in key:
            raise ServeError(f"--api-key-file {path} holds more than one line; put only the key in it")
        return key, "--api-key-file"
    env = os.environ.get(API_KEY_ENV)
    if env is not None:
        if not env.strip():
            raise ServeError(f"{API_KEY_ENV} is set but empty; give a key, or unset it for no authentication")
        return env.strip(), API_KEY_ENV
    return None, ""


def connection_limits(opts: ServeOptions) -> tuple[ConnectionLimits, int]:
    """The limits from the options, the cap checked against the file limit, and the listen backlog."""
    safe, backlog, soft, now = connection_budget()
    if opts.max_connections > safe:
        raise ServeError(f"--max-connections {opts.max_connections} is more than this process's file limit "
                         f"allows: {safe} (ulimit -n {soft}, {now} files open, {soft - now - safe} kept free "
                         f"for accepting and serving); lower it, or raise the limit (ulimit -n)")
    if safe < 1:
        raise ServeError(f"this process may open only {soft} files (ulimit -n) and has {now} open: too few "
                         f"to take connections; raise the limit (ulimit -n 1024)")
    cap = opts.max_connections or min(MAX_DEFAULT_CONNECTIONS, safe)
    return ConnectionLimits(header_timeout=opts.header_timeout, body_timeout=opts.body_timeout,
                            keep_alive=opts.keep_alive, max_body_pieces=body_pieces(opts.max_body_bytes),
                            max_connections=cap), backlog


def run_language(cfg: dict, tok, sample: int = 24) -> str | None:
    """The programming language a run was trained on, for the playground's examples: the one language its data
    was prepared with, else the one most of a sample of its validation (or training) documents are in; None
    when the data is not at hand or not code."""
    data = cfg.get("train", {}).get("data")
    if not data:
        return None
    try:
        meta = ShardSet(data, "train").meta
        langs = meta.get("options", {}).get("languages") or []
        if len(langs) == 1:
            return langs[0]
        split = "val" if meta["splits"]["val"]["documents"] else "train"
        docs = ShardSet(data, split)
        if docs.chat:
            return None
        seen = Counter(guess_language(tok.decode(docs.document(i).tolist()))
                       for i in range(min(sample, docs.documents)))
    except (CodeforgeError, OSError, ValueError, KeyError, TypeError):
        return None
    seen.pop(None, None)
    return seen.most_common(1)[0][0] if seen else None


def bind(host: str, port: int) -> socket.socket:
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        return socket.create_server((host, port), family=family)
    except OSError as e:
        raise ServeError(f"cannot listen on {host}:{port}: {os.strerror(e.errno) if e.errno else e}; pick "
                         f"another --port (0 picks a free one) or --host") from None


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def serve_command(opts: ServeOptions) -> int:
    """`codeforge serve` with options already checked against their declared ranges (fields.from_args)."""
    opts, key_from = check_options(opts)
    # glibc's memory policy while it serves (device.system_memory)
    with system_memory("a long-running server"):
        return _serve(opts, key_from)


def _serve(opts: ServeOptions, key_from: str) -> int:
    import uvicorn

    dev, why = choose_device(opts.device, opts.threads or None)
    precision, why_precision = choose_precision(dev, opts.precision)
    model, tok, ck, cfg = load_model(opts.run, dev, opts.checkpoint,
                                     log=lambda m: print(f"note: {m}", file=sys.stderr))
    engine = Engine(model, tok, dev, precision)
    block = engine.block_size
    if opts.max_prompt_tokens >= block:
        raise ServeError(f"--max-prompt-tokens {opts.max_prompt_tokens} must be below the model's context of "
                         f"{block} (one position is left for the reply)")
    if opts.infill_batch > block:
        raise ServeError(f"--infill-batch {opts.infill_batch} is larger than the model's context of {block}: "
                         f"give at most {block} (half of it, the default, leaves room for other files)")
    stage = cfg.get("train", {}).get("stage", "pretrain")
    opts = replace(opts, model_name=opts.model_name or rundir.model_name(opts.run), stage=stage,
                   checkpoint_name=Path(ck).name, chat_note=chat_notice(cfg), language=run_language(cfg, tok))
    sock = bind(opts.host, opts.port)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    limits, backlog = connection_limits(opts)  # after loading and binding: the files those hold are counted
    guard = ConnectionGuard(limits)
    app = create_app(engine, opts)
    app.state.srv.metrics.attach_connections(guard)
    kinds = "chat and tools" if speaks_chat(cfg) else "completions and fill-in-the-middle"
    print(f"serving {opts.model_name} ({model.num_params() / 1e6:.1f}M parameters, {stage} run: {kinds}; "
          f"context {block}) from {ck}")
    print(f"device {dev} ({why}), precision {precision} ({why_precision}); batch {opts.max_batch} rows, "
          f"queue {opts.max_queue}")
    print(f"connections: at most {limits.max_connections}; request head within {limits.header_timeout:g}s, "
          f"body within {limits.body_timeout:g}s, idle {limits.keep_alive:g}s between requests")
    print(f"listening on http://{shown}:{port}/  (OpenAI base URL http://{shown}:{port}/v1"
          f"{f', API key required (from {key_from})' if opts.api_key else ''})", flush=True)
    if opts.chat_note:
        print(f"note: /v1/chat/completions answers, but {opts.chat_note}", file=sys.stderr)
    if not opts.api_key and not _loopback(host):
        print(f"warning: {host} is reachable from other machines and there is no API key (--api-key-file): "
              f"anyone who can reach port {port} can use the model", file=sys.stderr)
    config = uvicorn.Config(app, log_level="info" if opts.access_log else "warning",
                            access_log=opts.access_log, timeout_graceful_shutdown=5,
                            http=guard.protocol_class(), ws="none", timeout_keep_alive=limits.keep_alive,
                            backlog=backlog)
    Server(config).run(sockets=[sock])
    return 0
