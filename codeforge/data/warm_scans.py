"""Imported by prepare's fork server (fork_server.PRELOAD): the secrets step's Hyperscan databases compiled
there once (redact.warm), so every worker forked from it starts with them instead of compiling its own."""

from ..redact import warm

warm()
