"""``client.moments.FlightMoments``: the steps taken while an overlapped round is in flight leave AdamW's first
moment when it lands, as ``benchmarks.convergence``'s ``moments=forget`` takes them out; nothing else moves."""

from __future__ import annotations

import os

import torch

from client.moments import FlightMoments

BETA1 = 0.9
# TEST_DEVICE=cuda runs these with the moments on a GPU (as on a lent machine); the copy stays on the host
DEVICE = torch.device(os.environ.get("TEST_DEVICE", "cpu"))


def setup(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).to(DEVICE)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(BETA1, 0.95), weight_decay=0.1)
    return model, optimizer


def step(model, optimizer, scaler: torch.amp.GradScaler | None = None, poison: bool = False) -> list[torch.Tensor]:
    """One AdamW step on random data (through ``scaler`` if given; ``poison``: an inf loss); the gradients."""
    x, y = torch.randn(32, 8).to(DEVICE), torch.randn(32, 4).to(DEVICE)
    loss = torch.nn.functional.mse_loss(model(x), y) * (float("inf") if poison else 1.0)
    if scaler is None:
        loss.backward()
        optimizer.step()
    else:
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    grads = [p.grad.clone() for p in model.parameters()]
    optimizer.zero_grad(set_to_none=True)
    return grads


def moment(optimizer, name: str = "exp_avg") -> list[torch.Tensor]:
    return [optimizer.state[p][name].clone() for g in optimizer.param_groups for p in g["params"]]


def assert_decayed(optimizer, copy: list[torch.Tensor], steps: int) -> None:
    """The first moment is ``copy`` times beta1^steps, up to the bf16 copy's rounding."""
    for a, t in zip(moment(optimizer), copy):
        torch.testing.assert_close(a, t * BETA1**steps, rtol=1e-2, atol=1e-6)


def test_landing_takes_the_flights_gradients_out_of_the_first_moment_and_nothing_else():
    model, optimizer = setup()
    moments, flight = FlightMoments(optimizer), object()
    for _ in range(3):
        step(model, optimizer)
        moments.after_step(None)
    step(model, optimizer)
    moments.after_step(flight)  # the round took off after this step
    at_takeoff = moment(optimizer)
    displaced = []
    for _ in range(3):
        displaced.append(step(model, optimizer))
        moments.after_step(flight)
    before = moment(optimizer)
    second, params = moment(optimizer, "exp_avg_sq"), [p.detach().clone() for p in model.parameters()]
    moments.after_step(None)  # landed
    after = moment(optimizer)
    assert moments.landed == 1
    for a, b, t in zip(after, before, at_takeoff):
        assert not torch.allclose(a, b)  # it did change
        torch.testing.assert_close(a, t * BETA1**3, rtol=1e-2, atol=1e-6)  # bf16 copy
    # the same as the simulator's subtraction of (1 - beta1) * beta1^k * g for each displaced step
    for i, (a, b) in enumerate(zip(after, before)):
        expected = b.clone()
        for n, grads in enumerate(displaced):
            expected -= (1 - BETA1) * BETA1 ** (len(displaced) - 1 - n) * grads[i]
        torch.testing.assert_close(a, expected, rtol=1e-2, atol=1e-5)
    for a, b in zip(moment(optimizer, "exp_avg_sq"), second):
        assert torch.equal(a, b)
    for p, q in zip(model.parameters(), params):
        assert torch.equal(p.detach(), q)


def test_without_a_flight_nothing_changes():
    model, optimizer = setup()
    reference_model, reference = setup()
    moments = FlightMoments(optimizer)
    for _ in range(4):
        torch.manual_seed(len(optimizer.state) + 7)
        step(model, optimizer)
        moments.after_step(None)
        torch.manual_seed(len(reference.state) + 7)
        step(reference_model, reference)
    assert moments.landed == 0
    for a, b in zip(moment(optimizer), moment(reference)):
        assert torch.equal(a, b)


def test_a_round_that_lands_where_the_next_takes_off_corrects_and_copies_again():
    model, optimizer = setup()
    moments, first, second = FlightMoments(optimizer), object(), object()
    step(model, optimizer)
    moments.after_step(first)
    at_first = moment(optimizer)
    step(model, optimizer)
    step(model, optimizer)
    moments.after_step(second)  # the first landed at the boundary, the second took off at once
    assert moments.landed == 1
    landed = moment(optimizer)
    assert_decayed(optimizer, at_first, 2)
    step(model, optimizer)
    moments.after_step(None)
    assert moments.landed == 2
    assert_decayed(optimizer, landed, 1)


def test_a_state_rebuilt_during_the_flight_is_left_alone():
    """Non-finite losses or a re-sync clear the optimizer's state: the copy is not of the new one."""
    model, optimizer = setup()
    moments, flight = FlightMoments(optimizer), object()
    for _ in range(5):
        step(model, optimizer)
    moments.after_step(flight)
    optimizer.state.clear()
    for _ in range(7):  # more steps than before the clear: the step count alone would not tell
        step(model, optimizer)
    rebuilt = moment(optimizer)
    moments.after_step(None)
    assert moments.landed == 0
    for a, b in zip(moment(optimizer), rebuilt):
        assert torch.equal(a, b)


def test_a_step_the_gradient_scaler_skipped_is_not_counted():
    """Under a GradScaler an overflowing step leaves AdamW untouched: beta1 is raised to the steps taken."""
    model, optimizer = setup()
    scaler = torch.amp.GradScaler(DEVICE.type)
    moments, flight = FlightMoments(optimizer), object()
    step(model, optimizer, scaler)
    moments.after_step(flight)
    at_takeoff = moment(optimizer)
    steps_at_takeoff = float(next(iter(optimizer.state.values()))["step"])
    step(model, optimizer, scaler, poison=True)  # skipped: inf gradients
    step(model, optimizer, scaler)
    assert float(next(iter(optimizer.state.values()))["step"]) == steps_at_takeoff + 1  # the skip did happen
    moments.after_step(None)
    assert moments.landed == 1
    assert_decayed(optimizer, at_takeoff, 1)


def test_the_copy_is_bf16_on_the_host():
    model, optimizer = setup()
    moments = FlightMoments(optimizer)
    step(model, optimizer)
    moments.after_step(object())
    copies = [values for _, _, values in moments._saved.values()]
    assert len(copies) == len(list(model.parameters()))
    assert all(c.dtype == torch.bfloat16 and c.device.type == "cpu" for c in copies)
