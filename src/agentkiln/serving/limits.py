"""What one client may ask of the endpoint, and what the endpoint keeps: every bound in one place
(`agentkiln endpoint --max-...` sets them). A request over a size bound is refused before it reaches
the decoding thread (413 for the body, 400 naming the field otherwise); one whose preparation runs
past `prepare_seconds` fails alone (422); what is kept past a memory bound is dropped, oldest first,
and counted in /health. The defaults are far above what an agent harness sends (a whole conversation
resent every turn, tens of admissible actions) and keep one request's cost to about a second of CPU."""

from __future__ import annotations

import time
from dataclasses import dataclass

MiB = 2**20


@dataclass(frozen=True)
class Limits:
    body_bytes: int = 8 * MiB  # one request body, checked before it is parsed
    inflight_bytes: int = 256 * MiB  # the bodies of all requests being served at once (503 past it)
    messages: int = 4096  # messages of one conversation
    message_chars: int = 256 * 1024  # one message's text (its content parts and tool call arguments)
    conversation_chars: int = MiB  # all messages' text together
    admissible: int = 4096  # admissible actions of one request
    action_chars: int = 2048  # one admissible action
    admissible_chars: int = 256 * 1024  # all admissible actions together
    tools: int = 128  # tool specs of one request
    prepare_seconds: float = 5.0  # rendering the conversation and building the admissible trie
    kept_bytes: int = 256 * MiB  # conversations kept to continue them token-in/token-out (approximate)
    record_bytes: int = 4096 * MiB  # the --record directory's episode files


# the command-line option that sets each limit (named in errors, so a refused client can tell the operator)
OPTION = {"body_bytes": "--max-body-bytes", "inflight_bytes": "--max-inflight-bytes", "messages": "--max-messages",
          "message_chars": "--max-message-chars", "conversation_chars": "--max-conversation-chars",
          "admissible": "--max-admissible", "action_chars": "--max-action-chars",
          "admissible_chars": "--max-admissible-chars", "prepare_seconds": "--max-prepare-seconds",
          "kept_bytes": "--max-kept-bytes", "record_bytes": "--max-record-bytes"}


class Deadline:
    """A preparation's time bound, checked between its steps (a step itself is kept short by the size limits)."""

    def __init__(self, seconds: float):
        self.seconds, self.end = seconds, time.monotonic() + seconds

    def passed(self) -> bool:
        return time.monotonic() > self.end
