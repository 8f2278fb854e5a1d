"""The performance model: per-step cost accounting, measured rates, hardware files, the planner."""
