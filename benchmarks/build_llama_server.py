"""Build llama.cpp's own `llama-server` from the sources inside the pinned llama-cpp-python source
distribution (pyproject.toml's `llama` extra), for the tests and checks that run codeforge's GGUF files and
/infill against the real server. Nothing is downloaded beyond the package registry pip already uses.

    python benchmarks/build_llama_server.py            # ~15-30 min on 2 cores; prints the binary's path

The binary is cached in $CODEFORGE_CACHE (default ~/.cache/codeforge)/llama-server-VERSION/bin/llama-server; a
second run prints the path at once. tests/test_llama_server.py (marked slow) finds it there, or at
$CODEFORGE_LLAMA_SERVER.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def pinned_version() -> str:
    text = (ROOT / "pyproject.toml").read_text()
    m = re.search(r'"llama-cpp-python==([^"]+)"', text)
    if not m:
        raise SystemExit("pyproject.toml pins no llama-cpp-python version (the `llama` extra)")
    return m.group(1)


def cache_dir() -> Path:
    return Path(os.environ.get("CODEFORGE_CACHE", Path.home() / ".cache" / "codeforge"))


def binary_path(version: str | None = None) -> Path:
    return cache_dir() / f"llama-server-{version or pinned_version()}" / "bin" / "llama-server"


def build(jobs: int) -> Path:
    version = pinned_version()
    out = binary_path(version)
    if out.exists():
        return out
    work = cache_dir() / f"llama-cpp-python-{version}"
    work.mkdir(parents=True, exist_ok=True)
    sdist = work / f"llama_cpp_python-{version}.tar.gz"
    if not sdist.exists():
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", f"llama-cpp-python=={version}",
                        "--no-deps", "--no-binary", ":all:", "-d", str(work)], check=True)
    src = work / f"llama_cpp_python-{version}"
    if not src.exists():
        with tarfile.open(sdist) as t:
            t.extractall(work, filter="data")
    llama = src / "vendor" / "llama.cpp"
    build_dir = work / "build"
    subprocess.run(["cmake", "-S", str(llama), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release",
                    "-DLLAMA_CURL=OFF",
                    "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                    "-DLLAMA_BUILD_SERVER=ON", "-DGGML_NATIVE=OFF", "-DBUILD_SHARED_LIBS=OFF"], check=True)
    subprocess.run(["cmake", "--build", str(build_dir), "--target", "llama-server", "-j", str(jobs)],
                   check=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(build_dir / "bin" / "llama-server", out)  # static: it needs nothing from the build tree
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2, help="parallel compile jobs")
    a = ap.parse_args()
    print(build(a.jobs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
