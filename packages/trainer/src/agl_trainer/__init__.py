"""AGL trainer: rollouts → rows → GRPO → policy updates, collocated with the engine."""
