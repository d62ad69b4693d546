import pytest
import torch

from swarm.manifest import OuterOptimizerSpec
from swarm.state.outer import OuterState, checksum


def test_outer_step_matches_torch_sgd_with_nesterov():
    torch.manual_seed(0)
    params = [torch.randn(5, 3), torch.randn(7)]
    spec = OuterOptimizerSpec(lr=0.7, momentum=0.9, nesterov=True)
    state = OuterState(params, spec)
    reference = [torch.nn.Parameter(p.clone()) for p in params]
    optimizer = torch.optim.SGD(reference, lr=0.7, momentum=0.9, nesterov=True)
    for _ in range(4):
        grads = [torch.randn_like(p) for p in params]
        state.step(grads)
        for p, g in zip(reference, grads):
            p.grad = g.clone()
        optimizer.step()
    assert state.epoch == 4
    for mine, theirs in zip(state.params, reference):
        assert torch.allclose(mine, theirs.detach(), atol=1e-6)


def test_pseudo_gradient_is_global_minus_local_and_write_back_restores_the_model():
    model = torch.nn.Linear(3, 2)
    state = OuterState(list(model.parameters()), OuterOptimizerSpec())
    with torch.no_grad():
        model.weight.add_(1.0)
    pseudo = state.pseudo_gradient(list(model.parameters()))
    assert torch.allclose(pseudo[0], torch.full_like(pseudo[0], -1.0))
    state.write_to(list(model.parameters()))
    assert torch.equal(model.weight.detach(), state.params[0])


def test_checksum_sees_a_single_bit_and_load_refuses_wrong_shapes():
    state = OuterState([torch.zeros(4)], OuterOptimizerSpec())
    before = state.checksum()
    flipped = torch.zeros(4)
    flipped[2] = torch.finfo(torch.float32).tiny
    assert checksum([flipped, torch.zeros(4)]) != before and checksum([torch.zeros(4), torch.zeros(4)]) == before
    state.step([flipped])  # the cached checksum follows every change made through the state
    assert state.checksum() == checksum([*state.params, *state.momentum]) != before
    momentum_only = OuterState([torch.zeros(4)], OuterOptimizerSpec())
    momentum_only.load(0, [torch.zeros(4), torch.ones(4)])  # the same parameters, another momentum: another state
    assert momentum_only.checksum() != OuterState([torch.zeros(4)], OuterOptimizerSpec()).checksum()
    with pytest.raises(ValueError, match="shape"):
        state.load(3, [torch.zeros(5), torch.zeros(5)])
    with pytest.raises(ValueError, match="expected 2"):
        state.load(3, [torch.zeros(4)])
    state.load(3, [torch.ones(4), torch.zeros(4)])
    assert state.epoch == 3 and torch.equal(state.params[0], torch.ones(4))
    assert state.checksum() == checksum([torch.ones(4), torch.zeros(4)])


def test_pseudo_gradient_is_written_into_the_callers_buffers():
    model = torch.nn.Linear(3, 2)
    state = OuterState(list(model.parameters()), OuterOptimizerSpec())
    with torch.no_grad():
        model.bias.sub_(0.5)
    buffers = [torch.full_like(p, 7.0) for p in state.params]
    state.pseudo_gradient_into(buffers, list(model.parameters()))
    assert torch.equal(buffers[0], torch.zeros_like(buffers[0]))
    assert torch.allclose(buffers[1], torch.full_like(buffers[1], 0.5))


@pytest.mark.parametrize("nesterov", [True, False])
def test_stand_in_is_the_step_the_pseudo_gradient_would_make_and_moves_nothing(nesterov):
    torch.manual_seed(1)
    params = [torch.randn(64, 8), torch.randn(33)]
    state = OuterState(params, OuterOptimizerSpec(lr=0.7, momentum=0.9, nesterov=nesterov))
    state.step([torch.randn_like(p) for p in params])  # some momentum
    before, momentum, epoch = [p.clone() for p in state.params], [m.clone() for m in state.momentum], state.epoch
    delta = [torch.randn_like(p) for p in params]
    exact = state.stand_in(delta, dtype=torch.float32)
    rounded = state.stand_in(delta)
    assert all(r.dtype == torch.bfloat16 for r in rounded)  # 2 bytes per parameter while a round is in the air
    assert state.epoch == epoch and all(torch.equal(a, b) for a, b in zip(state.params, before))
    assert all(torch.equal(a, b) for a, b in zip(state.momentum, momentum))
    state.step(delta)
    for moved, a, b, r in zip(exact, state.params, before, rounded):
        assert torch.allclose(moved, a - b, atol=1e-6)
        assert torch.allclose(r.float(), a - b, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("nesterov", [True, False])
def test_a_blended_stand_in_is_the_step_of_the_blended_pseudo_gradient(nesterov):
    """``StandIn.blend``: a weight of our own step plus the rest of the last average's step is the step the
    blended pseudo-gradient would make (the momentum's share splits between the two), and moves nothing."""
    torch.manual_seed(2)
    params = [torch.randn(64, 8), torch.randn(33)]
    state = OuterState(params, OuterOptimizerSpec(lr=0.7, momentum=0.9, nesterov=nesterov))
    state.step([torch.randn_like(p) for p in params])  # some momentum
    own, last = [torch.randn_like(p) for p in params], [torch.randn_like(p) for p in params]
    before = [p.clone() for p in state.params]
    prior = state.stand_in(last, dtype=torch.float32)
    blended = state.stand_in(own, dtype=torch.float32, blend_into=prior, weight=0.25)
    assert blended[0] is prior[0]  # in place: no third copy while a round is in the air
    expected = state.stand_in([0.25 * a + 0.75 * b for a, b in zip(own, last)], dtype=torch.float32)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(blended, expected))
    assert not torch.allclose(expected[0], state.stand_in(own, dtype=torch.float32)[0], atol=1e-3)
    assert all(torch.equal(a, b) for a, b in zip(state.params, before))
    scaled = state.stand_in(own, dtype=torch.float32, grad_scale=0.25)  # StandIn.share: the step of own / 4
    expected = state.stand_in([0.25 * a for a in own], dtype=torch.float32)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(scaled, expected))
