# shellcheck shell=bash
# What the launcher and the recipes say to each other, defined once on this side; the recipes' side is
# recipes/harness/contract.py (with the environment variables the launcher exports to the ranks), and
# tests/unit/test_contract.py holds the two equal. Sourced by launch.sh before the others.
# shellcheck disable=SC2034 # (used by the files sourced beside it)

EXIT_BAD_INPUT=2              # one line says what to change (a recipe's ConfigError; the launcher's own checks)
EXIT_COLLECTIVE_FAILED=4      # a rank's collective failed because another rank died or hung
STOP_MARKER=stopped_by_signal # RUN_DIR/$STOP_MARKER: the ranks stopped on SIGUSR1/SIGTERM; holds the signal's name
