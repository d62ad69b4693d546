"""Building the model a manifest describes, with transformers."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from swarm import RunManifest, SwarmError, seeded_init


def model_config(manifest: RunManifest) -> PretrainedConfig:
    config = dict(manifest.model)
    model_type = config.pop("model_type")
    try:
        return AutoConfig.for_model(model_type, **config)
    except (KeyError, ValueError, TypeError) as e:
        raise SwarmError(f"The manifest's model config is not a valid transformers config: {e}") from None


def build_model(manifest: RunManifest) -> torch.nn.Module:
    """The manifest's model, initialized from its seed (identical on every peer)."""
    config = model_config(manifest)
    with seeded_init(manifest):
        return AutoModelForCausalLM.from_config(config)


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _meta_model(manifest: RunManifest) -> torch.nn.Module:
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(model_config(manifest))


def manifest_parameters(manifest: RunManifest) -> int:
    """The model's size without allocating it (on the meta device): for observers that train nothing."""
    return count_parameters(_meta_model(manifest))


def parameter_shapes(manifest: RunManifest) -> list[tuple[int, ...]]:
    """The shapes of ``model.parameters()``, in order, without allocating the model."""
    return [tuple(p.shape) for p in _meta_model(manifest).parameters()]
