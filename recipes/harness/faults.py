"""Mistakes made on purpose, for the tests only: each negative control breaks one step of a run so that a test
can show its check catches it. Switched on by the environment (``HPCML_TEST_FAULT=name``), never by an option,
so that nothing of it shows in a recipe's --help. The faults here:

    schedule-restart   a resumed run starts its learning-rate schedule again from the first step
"""

from __future__ import annotations

import os

FAULT_ENV = "HPCML_TEST_FAULT"
FAULTS = ("schedule-restart",)


def active(name: str) -> bool:
    """Is the fault ``name`` switched on for this process?"""
    assert name in FAULTS, name
    return os.environ.get(FAULT_ENV) == name
