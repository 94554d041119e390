"""What the launcher (slurm/lib/*.sh) and the recipes say to each other, defined once on this side; its bash
side is slurm/lib/contract.sh, and tests/unit/test_contract.py holds the two equal.

Exit codes: 0 done (or stopped by a signal, with the stop marker); EXIT_BAD_INPUT, one line says what to change
(before any rank starts, where it can be seen then); EXIT_COLLECTIVE_FAILED, a collective failed because another
rank died or hung (the line names this rank and host). The environment: what the launcher exports to the ranks.
"""

EXIT_BAD_INPUT = 2
EXIT_COLLECTIVE_FAILED = 4
# RUN_DIR/STOP_MARKER: the ranks stopped after the same step on SIGUSR1 or SIGTERM and checkpointed; it holds
# the signal's name (SIGUSR1: the launcher requeues the job)
STOP_MARKER = "stopped_by_signal"

EXPECTED_WORLD_SIZE_ENV = "HPCML_EXPECTED_WORLD_SIZE"  # the ranks Slurm was asked for (SLURM_NTASKS)
CONTAINER_RUNTIME_ENV = "HPCML_CONTAINER_RUNTIME"  # shifter, podman-hpc, podman or none
CONTAINER_MOUNTS_ENV = "HPCML_CONTAINER_MOUNTS"  # podman, podman-hpc: the mounted host directories, ':'-separated
LOGIN_NODE_CHECK_ENV = "HPCML_LOGIN_NODE_CHECK"  # 1: slurm/preflight.sh on a login node (no GPU there to see)
NSYS_ENV = "HPCML_NSYS"  # 1: each rank under Nsight Systems, which needs the recipe's --profile
PREFLIGHT_RECORD_ENV = "HPCML_PREFLIGHT_RECORD"  # where --preflight writes its answer as JSON (RUN_DIR/preflight.json)
RANK_OUTCOMES_ENV = "HPCML_RANK_OUTCOMES"  # the directory where each rank writes how it ended (harness/outcome.py)
