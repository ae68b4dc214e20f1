"""Task synthesis: procedurally generated, verified, versioned task sets."""

from agentkiln.synthesis.textworld_games import env_version, synthesize

__all__ = ["env_version", "synthesize"]
