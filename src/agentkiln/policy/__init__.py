"""The policy: a causal LM, its tokenizer and chat template, and the agent format it was trained with."""

from agentkiln.policy import lora, partial
from agentkiln.policy.chat import ChatFormat
from agentkiln.policy.model import Policy, build_scratch_model, build_scratch_policy, load_policy, place, save_policy
from agentkiln.policy.prompt import AgentFormat, observation_text, parse_reply, render_action

__all__ = ["AgentFormat", "ChatFormat", "Policy", "build_scratch_model", "build_scratch_policy", "load_policy",
           "lora", "observation_text", "partial", "place", "parse_reply", "render_action", "save_policy"]
