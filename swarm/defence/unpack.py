"""msgpack from another machine, decoded within a bound on what it makes.

msgpack asks for no more bytes than it holds, but what it makes can be far larger: an empty array is one byte on
the wire and a Python list of 56 bytes, so 4 MiB of them decoded to 289 MiB. ``bounded_loads`` decodes as
hivemind's ``MSGPackSerializer.loads`` does (tuples included, its ext type), counting the elements of every array
and map as each is made, and refuses the input once they pass ``max_items`` in all. Leaves (numbers, strings, bytes)
are counted with the array or map that holds them; what one holds before it is counted is bounded by the input's
bytes (the smallest leaf that costs memory takes 3 of them) and by ``max_items`` per array and map.
"""

from __future__ import annotations

import msgpack
from hivemind.utils.serializer import MSGPackSerializer

MAX_ITEMS = 1 << 17  # elements in all: a proof's digests (1000 parts from 64 senders) and their lists fit


class TooManyItems(ValueError):
    """Input whose arrays and maps hold more than their bound allows."""


def bounded_loads(blob: bytes, max_items: int = MAX_ITEMS) -> object:
    """``MSGPackSerializer.loads(blob)``, or ``TooManyItems`` / ``ValueError`` for input past ``max_items`` elements or
    not msgpack (an ext type other than a tuple too)."""
    made = 0

    def counted(container):
        nonlocal made
        made += len(container) + 1
        if made > max_items:
            raise TooManyItems(f"more than {max_items} elements")
        return container

    def ext(code: int, data: bytes):
        if code != MSGPackSerializer._TUPLE_EXT_TYPE_CODE:
            raise ValueError(f"an ext type {code} no peer of ours sends")
        return tuple(counted(_unpack(data)))

    def _unpack(data: bytes):
        return msgpack.unpackb(
            data, raw=False, ext_hook=ext, list_hook=counted, object_hook=counted,
            max_array_len=max_items, max_map_len=max_items, max_ext_len=len(data),
        )  # fmt: skip

    try:
        return _unpack(blob)
    except (TooManyItems, ValueError):
        raise
    except Exception as e:  # msgpack's own errors (extra data, out of data, ...), and RecursionError
        raise ValueError(f"not msgpack: {type(e).__name__}") from e
