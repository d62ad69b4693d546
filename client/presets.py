"""Run presets and manifest files.

``tiny`` is for CPUs and tests (about 1.3M parameters; one round of 3 peers on a
2-core CPU in well under 20 s). ``150m`` is the DiLoCo paper's 150M shape and
``1b`` OpenDiLoCo's 1.1B (TinyLlama) shape, with the papers' hyperparameters.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from client.byte_tokenizer import ByteTokenizer
from swarm import ManifestError, RunManifest

_HUB_TOKENIZER = {"kind": "auto", "name": "TinyLlama/TinyLlama_v1.1"}
_C4 = {"source": "hub", "path": "allenai/c4", "config": "en", "split": "train", "num_shards": 1024}

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        name="tiny-demo",
        model=dict(
            model_type="llama",
            vocab_size=ByteTokenizer.vocab_size,
            hidden_size=128,
            intermediate_size=512,
            num_hidden_layers=5,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=128,
            tie_word_embeddings=True,
        ),
        seq_len=128,
        samples_per_step=8,
        inner_steps=20,
        inner=dict(lr=2e-3, warmup_steps=10, total_steps=2000, weight_decay=0.1),
        # plain averaging, not the paper's lr 0.7 with Nesterov 0.9: with CPU batches of a few thousand tokens and
        # short rounds, momentum over the noisy pseudo-gradients overshoots (benchmarks/results/convergence-plain/)
        outer=dict(lr=1.0, momentum=0.0, nesterov=False),
        averaging=dict(
            matchmaking_time=2.0,
            matchmaking_timeout=30.0,
            allreduce_timeout=30.0,
            chunk_timeout=10.0,
            consistency_timeout=5.0,
        ),
        dataset=dict(source="builtin", num_shards=32),
    ),
    "150m": dict(
        name="diloco-150m",
        model=dict(
            model_type="llama",
            vocab_size=32000,
            hidden_size=1024,
            intermediate_size=2688,
            num_hidden_layers=12,
            num_attention_heads=16,
            num_key_value_heads=16,
            max_position_embeddings=1024,
            tie_word_embeddings=False,
        ),
        tokenizer=_HUB_TOKENIZER,
        dataset=_C4,
        seq_len=1024,
        samples_per_step=512,
        inner_steps=500,
        inner=dict(lr=4e-4, warmup_steps=1000, total_steps=88_000, weight_decay=0.1),
    ),
    "1b": dict(
        name="opendiloco-1b",
        model=dict(
            model_type="llama",
            vocab_size=32000,
            hidden_size=2048,
            intermediate_size=5632,
            num_hidden_layers=22,
            num_attention_heads=32,
            num_key_value_heads=4,
            max_position_embeddings=2048,
            tie_word_embeddings=False,
        ),
        tokenizer=_HUB_TOKENIZER,
        dataset=_C4,
        seq_len=2048,
        samples_per_step=512,
        inner_steps=500,
        inner=dict(lr=4e-4, warmup_steps=1000, total_steps=88_000, weight_decay=0.1),
        mixed_precision="bf16",
    ),
}


def _set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = data
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ManifestError(f"--set {dotted}: '{part}' is not a section of the manifest.")
    node[leaf] = value


def parse_override(text: str) -> tuple[str, Any]:
    """``key.sub=value``; the value is read as JSON when it parses (numbers, booleans), else as a string."""
    if "=" not in text:
        raise ManifestError(f"--set '{text}' must look like section.key=value, e.g. inner_steps=100.")
    key, raw = text.split("=", 1)
    try:
        return key.strip(), json.loads(raw)
    except json.JSONDecodeError:
        return key.strip(), raw


def build_manifest(
    preset: str | None = None, manifest_file: Path | None = None, overrides: list[str] = ()
) -> RunManifest:
    """A preset or a TOML/JSON manifest file, with ``--set`` overrides, validated."""
    if manifest_file is not None:
        try:
            text = Path(manifest_file).read_text()
        except OSError as e:
            raise ManifestError(f"Cannot read manifest file {manifest_file}: {e.strerror}.") from None
        try:
            data = tomllib.loads(text) if str(manifest_file).endswith(".toml") else json.loads(text)
        except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
            raise ManifestError(f"Manifest file {manifest_file} is not valid TOML/JSON: {e}.") from None
    else:
        if preset not in PRESETS:
            raise ManifestError(f"Unknown preset '{preset}'; choose one of {', '.join(PRESETS)}.")
        data = json.loads(json.dumps(PRESETS[preset]))
    for override in overrides:
        _set_dotted(data, *parse_override(override))
    try:
        return RunManifest.model_validate(data)
    except ValidationError as e:
        raise ManifestError(f"The manifest is invalid:\n{e}") from None
