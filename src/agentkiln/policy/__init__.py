"""The policy: a causal LM, its tokenizer and the prompt format it was trained with."""

from agentkiln.policy.model import Policy, build_scratch_model, build_scratch_policy, load_policy, save_policy
from agentkiln.policy.prompt import AgentFormat, build_prompt

__all__ = ["AgentFormat", "Policy", "build_prompt", "build_scratch_model", "build_scratch_policy", "load_policy", "save_policy"]
