"""Serving a run over HTTP: OpenAI-compatible completions and chat (tool calls, streaming), llama-server's own
/infill and /completion, health and Prometheus metrics, on one continuous-batching generation loop.

  options.py   ServeOptions: every option of `codeforge serve`, declared once (flags and checks come from it)
  batcher.py   the generation loop: slot KV cache, rows joining and leaving at step boundaries; n_indent and
               the time budget as llama-server stops
  sampling.py  llama.cpp's sampler chain (top_k, top_p, min_p, temperature, the infill sampler)
  prompt_cache.py  the prompt cache per slot: a prompt sharing a prefix with a slot's last computes the rest
  protocol.py  request bodies, OpenAI's error shape, response and stream-chunk builders
  state.py     what every handler shares: server state and checks, a request's generation, streaming
  app.py       the FastAPI app: the OpenAI-style handlers and the route table
  llama_api.py llama-server's /infill and /completion: its fields, its reply objects, response_fields
  guard.py     the middleware around every request: Host, Origin, API key, body size, metrics, a last 500
  metrics.py   /metrics in the Prometheus text format
  connections.py  the HTTP connection: head and body deadlines, a connection cap below the file limit
  server.py    `codeforge serve`: load the run, bind, run uvicorn with the connection guard

The names below are imported when first used (PEP 562): `codeforge serve --help` reads options.py alone,
and importing app.py or server.py would load torch and FastAPI first.
"""

import importlib

_HOME = {"ServeOptions": "options", "create_app": "app", "ServeError": "server", "serve_command": "server"}

__all__ = list(_HOME)


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
