"""The interval planner: per-row key intervals, the row pass, plan assembly and Plan values."""
