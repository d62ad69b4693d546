"""The convergence benchmark's fitted stand-in (``standin=fit``): each worker's least-squares guess of the coming
average from its own pseudo-gradient and the last average, learnt from the rounds it has seen; and when the
simulator's overlapped average lands."""

import torch

from benchmarks.diloco_sim import AverageFit


def vectors(seed: int, n: int = 3) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(50, generator=g), torch.randn(7, 3, generator=g)] for _ in range(n)]


def test_with_nothing_learnt_the_guess_is_ones_own_share():
    fit = AverageFit(group=4)
    own, last = vectors(0, 2)
    for guess in (fit.guess(own, None), fit.guess(own, last)):
        assert all(torch.equal(g, o * 0.25) for g, o in zip(guess, own))


def test_it_recovers_how_the_averages_were_made_and_guesses_by_it():
    fit = AverageFit(group=4)
    a, b = 0.3, 0.5
    for seed in range(4):
        own, last, noise = vectors(seed)
        average = [a * o + b * x + 1e-3 * n for o, x, n in zip(own, last, noise)]
        fit.learn(own, last, average)
    got_a, got_b = fit.coefficients()
    assert abs(got_a - a) < 1e-2 and abs(got_b - b) < 1e-2, (got_a, got_b)
    own, last, _ = vectors(99)
    guess = fit.guess(own, last)
    assert all(torch.allclose(g, got_a * o + got_b * x) for g, o, x in zip(guess, own, last))


def test_a_round_without_a_last_average_teaches_nothing():
    fit = AverageFit(group=4)
    own, average = vectors(1, 2)
    fit.learn(own, None, average)
    assert fit.coefficients() == (0.25, 0.0)


def simulate(steps: int, *variants: str) -> list:
    """The convergence simulator's curves for ``variants`` (2 workers, a few steps), on one torch thread as the
    benchmark's runs: with several, sums differ in their last bits between runs."""
    from benchmarks.diloco_sim import Variant, run_diloco
    from benchmarks.simulation import prepare

    setup = prepare("tiny", workers=2, steps=steps, batch=2, eval_sequences=4, eval_every=6)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return [run_diloco(setup, Variant.parse(v)) for v in variants]
    finally:
        torch.set_num_threads(threads)


def test_in_the_simulator_the_fitted_stand_in_takes_over_from_share_once_it_has_learnt():
    """Round 1 has no last average and round 2's guess has nothing learnt yet (share's); the landing in round 3
    teaches the fit, so round 4 steps from another stand-in: the runs part there, and only there."""
    variant = "h=2,wire=fp4,mode=eager,delay=1,standin={},moments=forget"
    share, fit = simulate(8, variant.format("share"), variant.format("fit"))
    assert fit.tokens == share.tokens and len(fit.eval_loss) == 3  # before, after round 3, after round 4
    assert fit.eval_loss[:2] == share.eval_loss[:2]
    assert fit.eval_loss[2] != share.eval_loss[2]


def test_in_the_simulator_an_average_landing_a_whole_round_late_lands_at_the_next_rounds_end():
    """delay = H: every step of the next round is taken from the stand-in, and the average lands at that round's
    end (the latest a client's does). It once landed at once, which simulated blocking rounds instead."""
    runs = simulate(6, "h=2", "h=2,mode=eager,delay=2", "h=2,mode=eager,delay=9")
    blocking, late, later = (run.eval_loss for run in runs)
    assert late[0] == blocking[0] and late[-1] != blocking[-1]
    assert later == late  # a delay past H lands where H's does


def test_in_the_simulator_streaming_diloco_s_merge_is_blocking_when_nothing_of_the_own_model_is_kept_at_once():
    """``mode=merge`` (Streaming DiLoCo): each worker goes on from its own model and, when the average lands,
    keeps ``mix`` of it beside ``1 - mix`` of the new global model. Landing before any step with nothing kept
    is blocking DiLoCo to the bit; keeping half, or landing a step late, is not."""
    merges = ("delay=0,mix=0", "delay=0,mix=0.5", "delay=1")
    runs = simulate(6, "h=2", *(f"h=2,mode=merge,{m}" for m in merges))
    blocking, merged_at_once, half, late = (run.eval_loss for run in runs)
    assert merged_at_once == blocking
    assert half != blocking and late != blocking


def test_in_the_simulator_damping_the_steps_taken_from_the_stand_in_keeps_that_share_of_them():
    """``keep=K`` (eager): when the average lands the model is the new global one plus K of the inner steps taken
    from the stand-in. With nothing in flight yet (delay 0) there is nothing to damp: blocking DiLoCo to the bit."""
    eager = "h=2,wire=fp4,mode=eager,standin=share,moments=forget"
    runs = simulate(6, "h=2,wire=fp4", f"{eager},delay=0,keep=0", f"{eager},delay=1", f"{eager},delay=1,keep=0.5")
    blocking, none_displaced, kept, damped = (run.eval_loss for run in runs)
    assert none_displaced == blocking
    assert damped != kept and damped != blocking
