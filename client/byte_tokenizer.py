"""The built-in byte-level tokenizer, apart from ``client.data`` (which imports torch and datasets): the presets
read its vocabulary size, and the client builds a manifest before it loads either (``client.preflight``)."""

from __future__ import annotations

BYTE_VOCAB = 256
BOS, EOS, PAD = 256, 257, 258


class ByteTokenizer:
    """UTF-8 bytes plus three specials: no download, no vocabulary file."""

    vocab_size = BYTE_VOCAB + 3
    eos_id = EOS

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8", errors="replace"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(text) for text in texts]

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < BYTE_VOCAB).decode("utf-8", errors="replace")
