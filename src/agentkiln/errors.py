"""Errors meant for the person running agentkiln, not for a developer.

A `UserError`'s message already says what is wrong (the file, field or value) and what to do next,
so a stage prints it once, as `agentkiln: <message>`, and exits with `exit_status`, without a
traceback (flows/_stage.py). Any other exception is a bug and keeps its traceback.
"""


class UserError(Exception):
    """Bad input (params, a missing or damaged artifact, an unusable model): the message is the whole story."""

    exit_status = 2  # a usage / configuration error, as argparse exits
