"""llama.cpp's own `llama-server`, started on a GGUF file for `codeforge eval --repo DIR --gguf FILE`.

The binary comes from `--llama-server PATH`, $CODEFORGE_LLAMA_SERVER, the cache that
`python benchmarks/build_llama_server.py` builds into ($CODEFORGE_CACHE, default ~/.cache/codeforge:
llama-server-VERSION/bin/llama-server), or the PATH, in that order. It is started with the settings
docs/serving.md names for a small model: `-c` the model's context, `-b`/`-ub` half of it (what codeforge
serve's /infill keeps by default), `-n` infill_predict(context), on a free local port, and stopped when the
scoring is done.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from .lm import EvalError



def infill_predict(ctx: int) -> int:
    """The tokens a fill may take (llama-server's -n, which caps every request's n_predict and sets aside 2 n
    of the context in /infill's prompt layout): an eighth of the context, 16 to 128, so other files keep
    room."""
    return max(16, min(128, ctx // 8))


FIM_KEYS = ("tokenizer.ggml.fim_pre_token_id", "tokenizer.ggml.fim_suf_token_id",
            "tokenizer.ggml.fim_mid_token_id")


def find_binary(given: str | None = None) -> str:
    """The llama-server to run, or an error that says how to get one."""
    if given or os.environ.get("CODEFORGE_LLAMA_SERVER"):
        path = Path(given or os.environ["CODEFORGE_LLAMA_SERVER"])
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise EvalError(f"llama-server {path} (--llama-server or $CODEFORGE_LLAMA_SERVER) "
                            "is not an executable file")
        return str(path)
    cache = Path(os.environ.get("CODEFORGE_CACHE", Path.home() / ".cache" / "codeforge"))
    built = sorted(cache.glob("llama-server-*/bin/llama-server"), key=lambda p: p.stat().st_mtime)
    if built:
        return str(built[-1])
    found = shutil.which("llama-server")
    if not found:
        raise EvalError("no llama-server found (--llama-server PATH, $CODEFORGE_LLAMA_SERVER, the build "
                        "cache, or the PATH): build it from the pinned llama-cpp-python's sources with "
                        "`python benchmarks/build_llama_server.py`, or start one yourself and pass "
                        "--endpoint URL")
    return found


def gguf_facts(path: str) -> dict:
    """The context length and whether the file has the FIM token ids llama-server's /infill needs."""
    import gguf  # heavy optional import (the export extra's reader)

    p = Path(path)
    if not p.is_file():
        raise EvalError(f"--gguf {path}: no such file")
    try:
        reader = gguf.GGUFReader(str(p))
    except Exception as e:  # any unreadable file gets the same message
        raise EvalError(f"--gguf {path}: not a GGUF file llama.cpp reads ({type(e).__name__}: {e})") from None
    fields = reader.fields
    arch_field = fields.get("general.architecture")
    if arch_field is None:
        raise EvalError(
            f"--gguf {path}: no general.architecture in its metadata: not a model llama-server loads")
    arch = bytes(arch_field.parts[arch_field.data[0]]).decode()
    ctx_field = fields.get(f"{arch}.context_length")
    ctx = int(ctx_field.parts[ctx_field.data[0]][0]) if ctx_field is not None else 0
    return {"architecture": arch, "context": ctx, "fim": all(k in fields for k in FIM_KEYS)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running(gguf_path: str, binary: str | None = None, threads: int | None = None, log=print,
            startup_seconds: float = 300.0):
    """Yields the URL of a llama-server serving gguf_path with codeforge's documented /infill settings."""
    facts = gguf_facts(gguf_path)
    if not facts["fim"]:
        raise EvalError(f"--gguf {gguf_path} has no fill-in-the-middle token ids ({', '.join(FIM_KEYS)}), so "
                        "llama-server's /infill refuses it: export it again with "
                        "`codeforge export --run RUN --format gguf` from a run whose tokenizer has "
                        "<fim_prefix>/<fim_suffix>/<fim_middle> (every tokenizer codeforge trains has them)")
    exe = find_binary(binary)
    ctx = facts["context"] or 2048
    batch = max(32, ctx // 2)
    port = _free_port()
    argv = [exe, "-m", str(gguf_path), "-c", str(ctx), "-b", str(batch), "-ub", str(batch), "-n",
            str(infill_predict(ctx)), "-t", str(threads or max(1, os.cpu_count() or 1)), "--host",
            "127.0.0.1", "--port", str(port)]
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile() as out:
        log(f"starting {' '.join(argv)}")
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + startup_seconds
            while True:
                if proc.poll() is not None:
                    out.seek(0)
                    tail = out.read()[-2000:].decode(errors="replace")
                    raise EvalError(f"llama-server exited ({proc.returncode}) before it served "
                                    f"{gguf_path}:\n{tail}")
                try:
                    with urllib.request.urlopen(url + "/health", timeout=2) as r:
                        if r.status == 200:
                            break
                except (urllib.error.URLError, OSError):
                    pass
                if time.monotonic() > deadline:
                    raise EvalError(f"llama-server did not answer /health within {startup_seconds:.0f}s")
                time.sleep(0.2)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
