"""What the default tier proves, by name: every test `make test` collects (every parity row and control, every
matrix cell, every bad input, ...), in tests/default_tier.txt. tests/test_inventory.py fails when a test leaves
the default tier without a line in tests/moved_to_full.toml that says why, or when the list is out of date.

    python tests/support/inventory.py            # rewrite tests/default_tier.txt from what pytest collects now
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
LIST = TESTS / "default_tier.txt"
MOVED = TESTS / "moved_to_full.toml"
DEFAULT_TIER = "not full and not cuda_images and not scale"  # make test's -m (the Makefile's `test` target)
HEADER = ("# Every test of the default tier (make test), by pytest node id: tests/support/inventory.py writes it,\n"
          "# tests/test_inventory.py checks it. A test that leaves needs its line in tests/moved_to_full.toml.\n")


def collected() -> list[str]:
    """The node ids pytest collects for the default tier, sorted (no test runs)."""
    result = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:randomly", "-p", "no:xdist",
                             "-m", DEFAULT_TIER], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return sorted(line for line in result.stdout.splitlines() if "::" in line and not line.startswith(" "))


def listed() -> list[str]:
    return [line for line in LIST.read_text().splitlines() if line and not line.startswith("#")]


def moved() -> dict[str, str]:
    """{node id: why it is in the full tier now}."""
    return {entry["test"]: entry["why"] for entry in tomllib.loads(MOVED.read_text()).get("moved", [])}


if __name__ == "__main__":
    now = collected()
    lost = sorted(set(listed()) - set(now) - set(moved())) if LIST.exists() else []
    if lost:  # the list only loses a test that moved_to_full.toml explains (or one removed by hand, in the diff)
        sys.exit(f"inventory: {len(lost)} tests would leave the default tier: add each to {MOVED.name} with why, "
                 f"or remove its line by hand: {lost[:20]}")
    LIST.write_text(HEADER + "\n".join(now) + "\n")
    print(f"wrote {LIST.relative_to(REPO)}: {len(now)} tests")
