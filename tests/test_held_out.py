"""``client.step.evaluate_outer``: the held-out figure of an overlapped peer is its outer state's (what its
groupmates and its checkpoint hold), not the model it trains, which also holds the steps taken in flight."""

from __future__ import annotations

import pytest
import torch

from client.model import build_model
from client.presets import build_manifest
from client.step import evaluate, evaluate_outer
from swarm.state.outer import OuterState


def setup(dtype=torch.float32):
    manifest = build_manifest("tiny", overrides=["seq_len=16"])
    model = build_model(manifest).to(dtype)
    outer = OuterState(list(model.parameters()), manifest.outer)
    torch.manual_seed(0)
    batches = [torch.randint(0, model.config.vocab_size, (2, 16)) for _ in range(2)]
    return manifest, model, outer, batches


# fp32 on the CPU reads the outer tensors in place; bf16 (as a GPU's model would be) gets them copied in
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_figure_is_the_outer_states_and_the_model_comes_back_bitwise(dtype):
    manifest, model, outer, batches = setup(dtype)
    global_loss = evaluate(model, batches, "cpu")
    with torch.no_grad():  # the steps taken while the average was in flight
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    trained = [p.detach().clone() for p in model.parameters()]
    local_loss = evaluate(model, batches, "cpu")
    assert abs(local_loss - global_loss) > 1e-3  # the two models score apart: the test can tell them apart

    assert evaluate_outer(model, outer, batches, "cpu") == global_loss
    assert all(torch.equal(p, t) for p, t in zip(model.parameters(), trained))  # training goes on from there
    assert model.training
    assert evaluate_outer(model, None, batches, "cpu") == local_loss  # blocking: the model is that state


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_model_comes_back_when_scoring_fails(dtype):
    manifest, model, outer, batches = setup(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
    trained = [p.detach().clone() for p in model.parameters()]
    bad = [torch.full((2, 16), model.config.vocab_size + 7)]  # an index past the vocabulary: the forward fails
    with pytest.raises(IndexError):
        evaluate_outer(model, outer, bad, "cpu")
    assert all(torch.equal(p, t) for p, t in zip(model.parameters(), trained))


def test_a_cpu_fp32_model_is_scored_on_the_outer_tensors_themselves_and_they_are_left_as_they_were():
    manifest, model, outer, batches = setup()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    before = [g.clone() for g in outer.params]
    read = []
    handle = model.register_forward_pre_hook(lambda module, args: read.append(next(module.parameters()).data_ptr()))
    evaluate_outer(model, outer, batches, "cpu")
    handle.remove()
    assert read and set(read) == {outer.params[0].data_ptr()}  # no copy of the model was made
    assert all(torch.equal(g, b) for g, b in zip(outer.params, before))
    assert next(model.parameters()).data_ptr() != outer.params[0].data_ptr()  # the model's own tensors are back
