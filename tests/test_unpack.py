"""msgpack from another machine is decoded within a bound (``swarm.defence.unpack``): what honest peers send decodes as
hivemind's serializer decodes it, and any input is decoded or refused with a ValueError, its peak memory under 64 MB."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hivemind.utils.serializer import MSGPackSerializer
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.defence.unpack import MAX_ITEMS, TooManyItems, bounded_loads

_honest = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False) | st.text(max_size=8)
    | st.binary(max_size=40),
    lambda inner: st.lists(inner, max_size=5) | st.tuples(inner, inner) | st.dictionaries(st.text(max_size=6), inner,
                                                                                           max_size=4),
    max_leaves=30,
)  # fmt: skip


@given(_honest)
def test_what_honest_peers_send_decodes_as_hivemind_decodes_it(value):
    blob = MSGPackSerializer.dumps(value)
    assert bounded_loads(blob) == MSGPackSerializer.loads(blob)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_any_bytes_decode_or_are_refused_with_a_value_error(blob):
    try:
        bounded_loads(blob, max_items=64)
    except ValueError:
        pass


def test_a_receipt_reply_and_a_proofs_digests_at_their_largest_fit():
    proof = [1, 999, [b"d" * 32] * 1000, [[b"d" * 32] * 1000 for _ in range(64)]]
    assert bounded_loads(MSGPackSerializer.dumps(proof)) == proof
    with pytest.raises(TooManyItems):
        bounded_loads(MSGPackSerializer.dumps([[0] * 1000 for _ in range(MAX_ITEMS // 1000 + 1)]))


BOMBS = r"""
import resource, sys
from swarm.defence.unpack import bounded_loads
size = 4 << 20
bombs = [
    b"\xdd" + size.to_bytes(4, "big") + b"\x90" * size,  # one array of 4M empty arrays
    b"\xdc\x10\x00" + (b"\xdc\x10\x00" + b"\x90" * 4096) * 1000,  # 4096 arrays of 4096 empty arrays
    b"\xdf" + size.to_bytes(4, "big") + b"\xa1a\x80" * (size // 3),  # a map of empty maps
    b"\xdd" + size.to_bytes(4, "big") + b"\xc4\x02ab" * (size // 4),  # an array of 2-byte strings
    b"\x91" * 100_000 + b"\x90",  # nested past any stack
    b"\xc7" + b"\xff" + b"\x40" + b"\x90" * 255,  # a tuple's ext of empty arrays
    b"\xdd" + size.to_bytes(4, "big") + b"\xec" * size,  # one-byte negative integers: each a new object
    b"\xdc\x00\x80" + (b"\xdc\x7f\xff" + b"\xec" * 0x7FFF) * 128,  # the same in 128 arrays: counted as each ends
    b"\xc9" + (size + 5).to_bytes(4, "big") + b"\x40" + b"\xdd" + size.to_bytes(4, "big") + b"\x90" * size,  # a tuple
    b"\xd4\x40\x90" * 3 + b"\xc7\x03\x40" * 200_000 + b"\x90",  # tuples nested past any stack
]
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
refused = 0
for bomb in bombs:
    try:
        bounded_loads(bomb)
    except ValueError:
        refused += 1
print(refused, len(bombs), (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024)
"""


def test_known_bombs_are_refused_within_64_mb():
    out = subprocess.run([sys.executable, "-c", BOMBS], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    refused, bombs, peak_mib = out.stdout.split()
    assert int(refused) == int(bombs), out.stdout
    assert float(peak_mib) < 64, f"peak memory rose by {float(peak_mib):.0f} MiB"
