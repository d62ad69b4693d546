"""A groupmate's word about itself in its gathered data (``swarm.round.gathered``), checked before a round uses it."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from swarm.round.gathered import gathered_epochs, gathered_samples

CAP = 1000


def test_counts_are_believed_up_to_the_rounds_cap_and_anything_else_is_none():
    gathered = {
        "a": dict(epoch=3, samples=10),
        "b": dict(epoch=3, samples=2**63),  # past what a group record holds: failed the round for the group
        "c": dict(epoch=3, samples="x"),  # not a number: the sum raised TypeError for every member
        "d": dict(epoch=[3], samples=True),  # an unhashable epoch raised in the set of epochs
        "e": "not a dict",
        "f": dict(epoch=3, samples=-5),
        "g": dict(epoch=3, samples=12.7),  # a float count: floored
        "h": dict(epoch=3, samples=float("inf")),
    }
    assert gathered_samples(gathered, CAP) == dict(a=10, b=CAP, c=0, d=0, e=0, f=0, g=12, h=0)
    assert gathered_epochs(gathered) == {3, None}
    assert gathered_epochs({"a": dict(epoch=3.0)}) == {None}  # an epoch is a whole count
    assert gathered_epochs({"a": dict(epoch=3), "b": dict(epoch=3)}) == {3}


_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=4) | st.binary(max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)


@given(st.dictionaries(st.text(max_size=4), _values | st.fixed_dictionaries({"epoch": _values, "samples": _values})))
def test_no_gathered_data_raises_or_counts_past_the_cap(gathered):
    samples = gathered_samples(gathered, CAP)
    assert set(samples) == set(gathered) and all(isinstance(s, int) and 0 <= s <= CAP for s in samples.values())
    assert all(e is None or (isinstance(e, int) and e >= 0) for e in gathered_epochs(gathered))
    assert 0 <= float(sum(samples.values())) <= CAP * len(gathered)
