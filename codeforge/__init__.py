"""codeforge: train code language models from scratch.

The package is in layers; a module imports only from its own layer or a lower one (tests/test_layers.py
reads the table below, the one place it is written, and checks the rules after it, and that the imports make
no cycle, by parsing every import; a name ending in / is a package, every module in it in that layer):

  0  atomic box_memory box_runner box_values catalog device distributed fields parquet_pages prescan rundir
                                                                  (nothing of codeforge's above layer 0)
  1  corpus decontam redact tokenizer chat constrain grammar_ways json_schema fim sandbox syntax   text, code
  2  models/ tasks/ mining/
  3  checkpoint/ data/ config engine
  4  evaluation/ train/
  5  stages/
  6  quickstart open_model serve/ export/
  7  cli __main__

1. A module imports only from its own layer or a lower one.
2. evaluation/ never imports train/ or stages/; train/ never imports stages/ or evaluation/ (the Trainer is
   handed its callbacks).
3. models/ never imports train/, checkpoint/ or data/.
4. mining/ and tasks/ never import data/, evaluation/, train/ or stages/.
5. No import of another module's _private name: a helper two modules use is public and lives below both.
6. A stage imports stages/common.py, never another stage.
7. Imports inside functions only in the CLI and for heavy optional third-party packages.
"""

import os as _os

__version__ = "0.1.0"

# OpenMP threads that wait for each other sleep instead of spinning, so on cores shared with other work a
# waiting thread does not burn the time the thread it waits for needs (with device.py's thread count, 2.7x
# the training rate beside a second training: docs/LOG.md#2026-11-25-under-load-idle-cores). libgomp reads
# this once, when torch loads it: hence here, before any codeforge module imports torch. A value already set
# is kept. The thread count is device.py's thread_policy.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# The same for the OpenBLAS numpy ships, which decoding's matrix-vector products use (models/cpu_linear.py):
# its idle threads sleep after 2**4 cycles instead of spinning for about 0.1 s.
_os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")


class CodeforgeError(ValueError):
    """Base of the errors codeforge raises for bad input: the CLI prints the message and exits 2."""


_CONTROL = {c: f"\\x{c:02x}" for c in (*range(0x00, 0x20), 0x7F, *range(0x80, 0xA0)) if c not in (0x09, 0x0A)}
# bidi overrides
_CONTROL.update({c: f"\\u{c:04x}" for c in (*range(0x202A, 0x202F), *range(0x2066, 0x206A))})


def printable(text: str) -> str:
    """`text` safe to print on a terminal or store as a label: control characters (an ESC starts a sequence
    that can retitle the window, rewrite what is shown or hide text) and bidirectional overrides are written
    as escapes (\\x1b). Newlines and tabs stay. For names that come from outside: directory names, run and
    model names."""
    return text.translate(_CONTROL)
