"""The learning math the learner role runs: the policy-gradient objective, its off-policy corrections
and LoRA adapters. No transport, no roles: torch and the engine's schemas only."""
