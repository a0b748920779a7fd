"""`python -m codeforge.cli`: the same as `codeforge`."""

from .main import entry

entry()
