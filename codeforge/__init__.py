"""codeforge: train code language models from scratch."""

__version__ = "0.1.0"


class CodeforgeError(ValueError):
    """Base of the errors codeforge raises for bad input: the CLI prints the message and exits 2."""
