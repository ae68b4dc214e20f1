"""The champion at work: an OpenAI-compatible endpoint over a policy (serving.app), the conversations it
keeps as episodes (serving.conversation), the registry alias it follows (serving.source), the episodes
it records (serving.recorder; agentkiln.collected seals them into a training split)."""
