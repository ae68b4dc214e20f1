"""Training loops: SFT (expert or teacher trajectories), RL (GRPO + PPO-clip), distillation."""
