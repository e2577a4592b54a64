"""The orchestrator (step loop and phases), metrics, run receipts, the rollout archive, the CLI."""
