"""Serving a run over HTTP: OpenAI-compatible completions and chat (tool calls, streaming), llama.cpp-style
/infill, health and Prometheus metrics, on one continuous-batching generation loop.

  batcher.py   the generation loop: slot KV cache, rows joining and leaving at step boundaries
  protocol.py  request bodies, OpenAI's error shape, response and stream-chunk builders
  app.py       the FastAPI app: guard middleware (API key, body size, metrics), handlers, streaming
  metrics.py   /metrics in the Prometheus text format
  server.py    `codeforge serve`: load the run, bind, run uvicorn
"""

from .app import ServeOptions, create_app
from .server import ServeError, serve_command

__all__ = ["ServeOptions", "ServeError", "create_app", "serve_command"]
