"""msgpack from another machine, decoded within a bound on what it makes.

msgpack asks for no more bytes than it holds, but what it makes can be far larger: an empty array is one byte on
the wire and a Python list of 56 bytes, so 4 MiB of them decoded to 289 MiB (and 4 MiB of one-byte negative
integers inside nested arrays to 151 MiB). ``bounded_loads`` first walks the input's headers without building
anything and counts every element of every array and map (a tuple's, hivemind's ext type, too); past
``max_items`` in all it refuses the input. Only then does it decode, as ``MSGPackSerializer.loads`` does: what is
built is then at most ``max_items`` objects.
"""

from __future__ import annotations

import msgpack
from hivemind.utils.serializer import MSGPackSerializer

MAX_ITEMS = 1 << 17  # objects in all: a proof's digests (1000 parts from 64 senders) and their lists fit
TUPLE = MSGPackSerializer._TUPLE_EXT_TYPE_CODE

# bytes after the first of a header whose length field is that wide: (size of the length field, extra fixed bytes)
_SIZED = {0xC4: 1, 0xC5: 2, 0xC6: 4, 0xD9: 1, 0xDA: 2, 0xDB: 4}  # bin and str: a length, then that many bytes
_FIXED = {0xC0: 0, 0xC2: 0, 0xC3: 0, 0xCA: 4, 0xCB: 8, 0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8, 0xD0: 1, 0xD1: 2, 0xD2: 4,
          0xD3: 8}  # fmt: skip
_FIXEXT = {0xD4: 1, 0xD5: 2, 0xD6: 4, 0xD7: 8, 0xD8: 16}
_EXT = {0xC7: 1, 0xC8: 2, 0xC9: 4}
_ARRAY, _MAP = {0xDC: 2, 0xDD: 4}, {0xDE: 2, 0xDF: 4}


class TooManyItems(ValueError):
    """Input whose arrays and maps hold more than their bound allows."""


def _length(blob: bytes, at: int, width: int) -> int:
    if at + width > len(blob):
        raise ValueError("not msgpack: cut short")
    return int.from_bytes(blob[at : at + width], "big")


def count_items(blob: bytes, max_items: int) -> int:
    """The elements of every array and map in ``blob`` (a tuple's payload included), read from the headers alone;
    ``TooManyItems`` as soon as they pass ``max_items``, ``ValueError`` for bytes that are not msgpack."""
    items, at, todo, end = 0, 0, 1, len(blob)
    while todo:
        if at >= end:
            raise ValueError("not msgpack: cut short")
        head, at, todo = blob[at], at + 1, todo - 1
        children = 0
        if head <= 0x7F or head >= 0xE0:
            pass
        elif head <= 0x8F:
            children = 2 * (head & 0x0F)
        elif head <= 0x9F:
            children = head & 0x0F
        elif head <= 0xBF:
            at += head & 0x1F
        elif head in _FIXED:
            at += _FIXED[head]
        elif head in _SIZED:
            at += _SIZED[head] + _length(blob, at, _SIZED[head])
        elif head in _ARRAY:
            children, at = _length(blob, at, _ARRAY[head]), at + _ARRAY[head]
        elif head in _MAP:
            children, at = 2 * _length(blob, at, _MAP[head]), at + _MAP[head]
        elif head in _FIXEXT or head in _EXT:
            width = _EXT.get(head, 0)
            size = _FIXEXT[head] if head in _FIXEXT else _length(blob, at, width)
            code, payload = blob[at + width : at + width + 1], blob[at + width + 1 : at + width + 1 + size]
            if code == bytes([TUPLE]) and len(payload) == size:
                items += count_items(payload, max_items - items)
            at += width + 1 + size
        else:
            raise ValueError(f"not msgpack: byte {head:#x}")
        items, todo = items + children, todo + children  # a map's keys and values each
        if items > max_items:
            raise TooManyItems(f"more than {max_items} elements")
    if at > end:
        raise ValueError("not msgpack: cut short")
    return items


def bounded_loads(blob: bytes, max_items: int = MAX_ITEMS) -> object:
    """``MSGPackSerializer.loads(blob)``, or ``TooManyItems`` / ``ValueError`` for input past ``max_items`` elements or
    not msgpack (an ext type other than a tuple too)."""

    def ext(code: int, data: bytes):
        if code != TUPLE:
            raise ValueError(f"an ext type {code} no peer of ours sends")
        return tuple(msgpack.unpackb(data, raw=False, ext_hook=ext))

    try:
        count_items(blob, max_items)
        return msgpack.unpackb(blob, raw=False, ext_hook=ext)
    except ValueError:
        raise
    except Exception as e:  # msgpack's own errors (extra data, out of data, ...), and RecursionError
        raise ValueError(f"not msgpack: {type(e).__name__}") from e
