"""`swarm-client export`: the latest checkpoint's global model in Hugging Face format, with its tokenizer.

The checkpoint's parameters are checked (sha256, CRC32) and read straight into a freshly built model. The
tokenizer goes beside it, so the folder loads with ``AutoTokenizer`` and ``AutoModelForCausalLM`` and generates
text: a run's hub tokenizer as it is, or the built-in byte tokenizer as an equivalent ``PreTrainedTokenizerFast``
(the same ids for the same text).
"""

from __future__ import annotations

from pathlib import Path

import torch

from client import checkpoint
from client.byte_tokenizer import BOS, EOS, PAD
from client.model import build_model, parameter_shapes
from swarm import RunManifest, SwarmError
from swarm.manifest import TokenizerSpec
from swarm.state import file as state_file


def export_model(workdir: Path, out: Path, run_id: str | None = None) -> Path:
    runs = sorted(p.name for p in (workdir / "runs").glob("*") if (p / "manifest.json").exists())
    if run_id is None:
        if len(runs) != 1:
            listing = ", ".join(runs) or "none"
            raise SwarmError(f"{workdir} holds {len(runs)} runs ({listing}); pick one with --run.")
        run_id = runs[0]
    if run_id not in runs:
        raise SwarmError(f"No run {run_id} in {workdir}; runs there: {', '.join(runs) or 'none'}.")
    manifest = RunManifest.from_json((workdir / "runs" / run_id / "manifest.json").read_text())
    shapes = parameter_shapes(manifest)
    found = checkpoint.find(checkpoint.checkpoint_dir(workdir, run_id), run_id, shapes)
    if found is None:
        raise SwarmError(f"Run {run_id} in {workdir} has no readable checkpoint yet.")
    model = build_model(manifest)
    with torch.no_grad():
        state_file.load_into(found.path, found.header, [p.detach() for p in model.parameters()])
    tokenizer = hf_tokenizer(manifest.tokenizer)
    model.config.update(dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id))  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def hf_tokenizer(spec: TokenizerSpec):
    """The run's tokenizer as a transformers tokenizer that ``save_pretrained`` can write."""
    if spec.kind == "auto":
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(spec.name)
    return byte_tokenizer_fast()


def byte_tokenizer_fast():
    """``client.byte_tokenizer.ByteTokenizer`` as a ``PreTrainedTokenizerFast``: each UTF-8 byte is its own id
    (0-255, through the byte-level alphabet of GPT-2's tokenizer), then ``<s>``, ``</s>`` and ``<pad>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {char: byte for byte, char in byte_level_chars().items()}
    vocab.update({"<s>": BOS, "</s>": EOS, "<pad>": PAD})
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def byte_level_chars() -> dict[int, str]:
    """The character the byte-level pre-tokenizer writes each byte as (GPT-2's table: printable bytes as
    themselves, the rest shifted past 255)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1), *range(ord("\u00ae"), 256)]
    shifted = [b for b in range(256) if b not in kept]
    return {**{b: chr(b) for b in kept}, **{b: chr(256 + i) for i, b in enumerate(shifted)}}
