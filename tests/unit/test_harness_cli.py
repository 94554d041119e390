"""recipes/harness/cli.py: a --config file gives defaults, the command line wins."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

from support.runs import REPO

sys.path.insert(0, str(REPO / "recipes"))
import harness  # noqa: E402


def test_config_file_gives_defaults_and_the_command_line_wins(tmp_path):
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-steps", type=int, default=30)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--out-dir", type=Path, default=Path("runs"))
    parser.add_argument("--no-resume", action="store_true")
    parser.add_argument("--config", type=Path)
    config = tmp_path / "run.toml"
    config.write_text('max-steps = 50\nlr = 1\nout_dir = "elsewhere"\nno-resume = true\n')
    args = harness.parse_args_with_config(parser, ["--config", str(config), "--max-steps", "7"])
    assert (args.max_steps, args.lr, args.out_dir, args.no_resume) == (7, 1.0, Path("elsewhere"), True)
    config.write_text("no-resume = 1\n")
    with pytest.raises(harness.ConfigError, match="'no-resume' in --config .* must be true/false, got 1"):
        harness.parse_args_with_config(parser, ["--config", str(config)])
    with pytest.raises(harness.ConfigError, match="cannot read --config .*missing.toml"):
        harness.parse_args_with_config(parser, ["--config", str(tmp_path / "missing.toml")])
