"""Serving a run over HTTP: OpenAI-compatible completions and chat (tool calls, streaming), llama.cpp-style
/infill, health and Prometheus metrics, on one continuous-batching generation loop.

  batcher.py   the generation loop: slot KV cache, rows joining and leaving at step boundaries
  protocol.py  request bodies, OpenAI's error shape, response and stream-chunk builders
  app.py       the FastAPI app: server state, handlers, streaming, the route table
  guard.py     the middleware around every request: Host, Origin, API key, body size, metrics, a last 500
  metrics.py   /metrics in the Prometheus text format
  connections.py  the HTTP connection: head and body deadlines, a connection cap below the file limit
  server.py    `codeforge serve`: load the run, bind, run uvicorn with the connection guard
"""

from .app import ServeOptions, create_app
from .server import ServeError, serve_command

__all__ = ["ServeOptions", "ServeError", "create_app", "serve_command"]
