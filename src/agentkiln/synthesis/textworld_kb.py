"""One parse of TextWorld's cooking knowledge base per process (imported by a synthesis worker before
its first TextWorld task).

cooking.make parses its logic files again for every game (KnowledgeBase.load: tatsu, ~0.8 s of a
cooking game's ~2.5 s of synthesis; the rest is two Inform compiles). The files do not change within a
process and a game does not change the knowledge base it reads, so one parse serves every game of a
worker, with the same game bytes (tests/test_synthesis.py). It lives apart from the textworld
generator because it changes no byte of any task: the family's environment version, a hash of the
code that shapes its tasks, stays as it was, and so do the panels frozen under it.
"""

from __future__ import annotations

import functools

from textworld.challenges import cooking
from textworld.generator.data import KnowledgeBase


class KnowledgeBaseOnce(KnowledgeBase):
    @classmethod
    @functools.cache
    def load(cls, target_dir=None, logic_path=None, grammar_path=None):
        return KnowledgeBase.load(target_dir=target_dir, logic_path=logic_path, grammar_path=grammar_path)


cooking.KnowledgeBase = KnowledgeBaseOnce  # the name cooking.make calls
