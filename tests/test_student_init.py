"""`distill.embed_init: teacher`: a scratch student's token embeddings are the teacher's, centred and
projected on their top principal directions, rescaled to the student's own initial spread; refused by
name where the student cannot take them."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from agentkiln.config import ModelParams
from agentkiln.policy import load_policy
from agentkiln.stages import distill as stage
from agentkiln.trainers.student_init import teacher_embedding_init
from tests.conftest import params_with
from tests.test_distill import STUDENT, distill_params, world  # noqa: F401  (the tiny teacher's fixture)


class Embedder(torch.nn.Module):
    """The one method the initialiser reads: a model's input embeddings."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.emb = torch.nn.Embedding.from_pretrained(weight.clone(), freeze=False)

    def get_input_embeddings(self):
        return self.emb


def test_the_projection_keeps_the_teachers_two_widest_directions_at_the_students_own_spread():
    # four tokens in 3-d, mean 0: spread 3 along x, 1 along y, none along z; a 2-wide student keeps x and y
    teacher = Embedder(torch.tensor([[3.0, 1, 0], [-3, 1, 0], [3, -1, 0], [-3, -1, 0]]) + torch.tensor([5.0, -2, 7]))
    student = Embedder(torch.tensor([[0.1, -0.3], [0.2, 0.0], [-0.1, 0.4], [0.3, 0.1]]))
    spread = student.emb.weight.std().item()
    teacher_embedding_init(student, teacher)
    got = student.emb.weight.detach()
    x, y = torch.tensor([3.0, -3, 3, -3]), torch.tensor([1.0, 1, -1, -1])
    k = spread / torch.stack([x, y], 1).std().item()  # the rescale, by hand
    for col, want in ((got[:, 0], k * x), (got[:, 1], k * y)):  # a principal direction has no sign of its own
        assert torch.allclose(col, want, atol=1e-5) or torch.allclose(col, -want, atol=1e-5)
    assert got.std().item() == pytest.approx(spread, rel=1e-5)
    # the geometry between tokens is the teacher's (centred), scaled: Gram matrices proportional
    centred = teacher.emb.weight.detach() - teacher.emb.weight.detach().mean(0)
    assert torch.allclose(got @ got.T, k * k * (centred @ centred.T), atol=1e-4)


def test_the_stage_builds_a_student_on_the_teachers_embeddings_its_head_tied_to_them(world):  # noqa: F811
    tasks, tasks_dir, teacher_dir, _ = world
    teacher = load_policy(teacher_dir)
    plain = stage.build_student(distill_params(), teacher, seed=0)
    student = stage.build_student(distill_params(embed_init="teacher"), teacher, seed=0)
    s = student.model.get_input_embeddings().weight.detach()
    assert torch.equal(student.model.get_output_embeddings().weight, student.model.get_input_embeddings().weight)
    assert s.std().item() == pytest.approx(plain.model.get_input_embeddings().weight.std().item(), rel=1e-5)
    # Eckart-Young, by another route (the Gram matrix's eigenvectors): the student's Gram matrix is the best
    # rank-16 approximation of the teacher's centred one, up to the rescale
    t = teacher.model.get_input_embeddings().weight.detach()
    c = t - t.mean(0)
    vals, vecs = torch.linalg.eigh(c @ c.T)  # ascending
    top = vecs[:, -STUDENT.hidden_size:]
    best = top @ torch.diag(vals[-STUDENT.hidden_size:]) @ top.T
    gram = s @ s.T
    assert torch.allclose(gram / gram.norm(), best / best.norm(), atol=1e-4)
    # the layers above are the plain student's: only the embeddings were taken
    for (name, a), (_, b) in zip(student.model.named_parameters(), plain.model.named_parameters()):
        if "embed_tokens" not in name and "lm_head" not in name:
            assert torch.equal(a, b), name


def test_a_wider_student_an_own_tokenizer_and_a_trained_student(world, tmp_path):  # noqa: F811
    tasks, tasks_dir, teacher_dir, corpus = world
    teacher = load_policy(teacher_dir)
    # wider than the teacher (64 against 32): all the teacher's directions, zeros beyond, so the geometry
    # between tokens is exactly the teacher's, scaled
    wide = stage.build_student(distill_params(student=ModelParams(**(STUDENT.model_dump() | {"hidden_size": 64})),
                                              embed_init="teacher"), teacher, seed=0)
    w = wide.model.get_input_embeddings().weight.detach()
    assert torch.equal(w[:, 32:], torch.zeros(w.shape[0], 32))
    t = teacher.model.get_input_embeddings().weight.detach()
    c = t - t.mean(0)
    gram, want = w @ w.T, c @ c.T
    assert torch.allclose(gram / gram.norm(), want / want.norm(), atol=1e-5)
    # a student with its own tokenizer (a pretrained teacher's vocabulary is larger) has none of the teacher's
    # embeddings to take: it starts from its own, and says so
    small = ModelParams(**(STUDENT.model_dump() | {"vocab_size": 300}))
    own = stage.build_student(distill_params(student=small, embed_init="teacher"), teacher, seed=0,
                              texts=lambda: corpus)
    assert own.source == "scratch student (own tokenizer)" and len(own.tokenizer) <= 300
    mine = stage.build_student(distill_params(student=small), teacher, seed=0, texts=lambda: corpus)
    assert torch.equal(own.model.get_input_embeddings().weight, mine.model.get_input_embeddings().weight)
    # in params: a trained student is refused; a wider one, or a pretrained teacher, is not
    model = tmp_path / "student"
    model.mkdir()
    (model / "config.json").write_text("{}")
    with pytest.raises(ValidationError, match=r"distill\.embed_init = 'teacher' initialises a scratch student"):
        params_with({"distill": {"embed_init": "teacher", "student": {"source": str(model)}}})
    assert params_with({"distill": {"student": {"hidden_size": 192}}}).distill.embed_init == "teacher"
    assert params_with({"sft": {"model": {"source": "smollm2-135m-instruct"}}}).distill.embed_init == "teacher"
