"""agentkiln: reproducible multi-turn RL for LLM agents.

The path of one trajectory: envs (TextWorld game) -> rollout (constrained generation, exact token
ids) -> algos.advantages (GRPO) -> algos.losses (PPO-clip + KL) -> trainers.rl (the update).
"""

__version__ = "0.1.0"
