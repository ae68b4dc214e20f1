"""A scratch student's token embeddings taken from its teacher (`distill.embed_init: teacher`).

The teacher's embedding matrix E (vocabulary x teacher width), centred, is projected on its top d
principal directions (d = the student's width): of all d-dimensional linear maps of the teacher's
embeddings this keeps the most of their variance (Eckart-Young), so tokens the teacher tells apart
start apart in the student, and the student's layers learn on top of the teacher's geometry of the
vocabulary instead of a random one. The projection is rescaled to the spread of the student's own
random initialisation, so the layers above it see inputs of the size they were initialised for.

Why: the small default student lands on a FrozenLake-playing solution or not by its own seed (25% or
78% of the lakes on the same teacher wins; docs/journal.md, 2026-12-07); from the teacher's
embeddings it played the lakes at least as well as its teacher on nine of nine teacher and seed draws.
"""

from __future__ import annotations

import torch


def teacher_embedding_init(student: torch.nn.Module, teacher: torch.nn.Module) -> None:
    """Overwrite `student`'s input embeddings (tied to its output head where the model ties them) with
    the teacher's projected on their top principal directions. Both must share one vocabulary (rows). A
    student at least as wide as the teacher gets all of the teacher's directions in its first columns and
    zeros in the rest: the geometry between tokens is then exactly the teacher's, scaled."""
    t = teacher.get_input_embeddings().weight.detach().float()
    s = student.get_input_embeddings().weight
    if t.shape[0] != s.shape[0]:
        raise ValueError(f"distill.embed_init: 'teacher' needs the teacher's vocabulary: the teacher has {t.shape[0]} "
                         f"embedding rows, the student {s.shape[0]}; set distill.embed_init: random")
    centred = t - t.mean(0)
    _, _, vh = torch.linalg.svd(centred, full_matrices=False)  # rows of vh: principal directions, largest first
    proj = centred @ vh[: s.shape[1]].T
    proj = torch.nn.functional.pad(proj, (0, s.shape[1] - proj.shape[1]))  # a wider student: zeros beyond
    with torch.no_grad():
        s.copy_((proj * (s.detach().float().std() / proj.std())).to(s.dtype))
