"""Shared pieces of the engine tests: a tiny real transformers model, deterministic data, one inner step.

The swarm workers and the single-process reference DiLoCo both use these, so any
difference between them comes from the engine, not from the training code.
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from swarm import AveragingSpec, InnerOptimizerSpec, OuterOptimizerSpec, RunManifest

VOCAB, SEQ, BATCH = 64, 16, 4


def tiny_manifest(
    *,
    compression: str = "none",
    inner_steps: int = 4,
    min_group_size: int = 2,
    matchmaking_time: float = 2.0,
    matchmaking_timeout: float = 30.0,
    allreduce_timeout: float = 30.0,
    hidden: int = 32,
    name: str = "engine-test",
    seed: int = 1234,
    join_rounds_early: bool = True,
    overlap: bool = False,
    replay_rounds: int = 4,
    aggregation: str = "centered-clip",
    stand_in: str = "own",
    in_flight_steps_kept: float = 1.0,
    target_group_size: int = 8,
    merge_groups: bool = True,
    merge_timeout: float = 60.0,
) -> RunManifest:
    return RunManifest(
        name=name,
        model=dict(
            model_type="llama",
            vocab_size=VOCAB,
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=SEQ,
            tie_word_embeddings=False,
        ),
        seq_len=SEQ,
        samples_per_step=BATCH,
        inner_steps=inner_steps,
        inner=InnerOptimizerSpec(lr=3e-3, warmup_steps=0, total_steps=1000, weight_decay=0.0),
        outer=OuterOptimizerSpec(lr=0.7, momentum=0.9, nesterov=True),
        averaging=AveragingSpec(
            compression=compression,
            matchmaking_time=matchmaking_time,
            matchmaking_timeout=matchmaking_timeout,
            allreduce_timeout=allreduce_timeout,
            chunk_timeout=5.0,
            min_group_size=min_group_size,
            target_group_size=target_group_size,
            consistency_timeout=5.0,
            join_rounds_early=join_rounds_early,
            overlap=overlap,
            replay_rounds=replay_rounds,
            aggregation=aggregation,
            stand_in=stand_in,
            in_flight_steps_kept=in_flight_steps_kept,
            merge_groups=merge_groups,
            merge_timeout=merge_timeout,
        ),
        init_seed=seed,
    )


def make_model(manifest: RunManifest, extra_params: int = 0) -> torch.nn.Module:
    config = dict(manifest.model)
    config.pop("model_type")
    model = LlamaForCausalLM(LlamaConfig(**config))
    if extra_params:
        # an unused slab that makes the all-reduce long enough to be interrupted on purpose
        model.register_parameter("ballast", torch.nn.Parameter(torch.randn(extra_params) * 0.01))
    return model


def make_optimizer(model: torch.nn.Module, manifest: RunManifest) -> torch.optim.Optimizer:
    spec = manifest.inner
    return torch.optim.AdamW(
        model.parameters(), lr=spec.lr, betas=spec.betas, eps=spec.eps, weight_decay=spec.weight_decay
    )


def make_batch(rank: int, epoch: int, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1_000_003 * rank + 1009 * epoch + step)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)


def inner_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor) -> float:
    loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())
