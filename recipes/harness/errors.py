"""The harness's bottom layer: the error a check raises for bad input, and the one-line stderr write. Every
other harness module may import it; it imports none of them."""

from __future__ import annotations

import sys


class ConfigError(Exception):
    """Bad input found before any process starts talking to another. Its message says what to change."""


def stderr_line(text: str) -> None:
    """``text`` and its newline in one write. Ranks often print the same message at the same moment into one
    log, unbuffered (PYTHONUNBUFFERED=1): print() writes the text and the newline separately, and two ranks'
    lines then run into each other ("...error: A[...] error: A\\n\\n")."""
    sys.stderr.write(text + "\n")
    sys.stderr.flush()
