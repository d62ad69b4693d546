"""Hardware detection with CUDA faked (no GPU here), and the micro-batch search."""

from types import SimpleNamespace

import pytest
import torch

from client.hardware import choose_precision, detect
from client.microbatch import auto_micro_batch, cached_or_search, cpu_estimate, gpu_trial, search
from client.model import build_model, model_config
from client.preflight import DeviceKind, parse_device
from client.presets import build_manifest
from swarm import SwarmError


class FakeCuda:
    def __init__(self, count=2, name="NVIDIA A100-SXM4-40GB", memory=40 * 2**30, capability=(8, 0)):
        self.count, self.props = (
            count,
            SimpleNamespace(name=name, total_memory=memory, major=capability[0], minor=capability[1]),
        )

    def is_available(self):
        return self.count > 0

    def device_count(self):
        return self.count

    def get_device_properties(self, index):
        return self.props


def test_cuda_is_detected_with_its_properties():
    hw = detect(parse_device("auto"), cuda=FakeCuda())
    assert hw.device == "cuda:0" and hw.kind is DeviceKind.CUDA and hw.name.startswith("NVIDIA A100")
    assert hw.memory_bytes == 40 * 2**30 and hw.compute_capability == (8, 0) and hw.bf16
    assert hw.host_memory_bytes > 0 and hw.cpu_cores >= 1
    assert detect(parse_device("cuda:1"), cuda=FakeCuda()).device == "cuda:1"


def test_precision_follows_the_gpu_and_the_manifest():
    ampere, turing = (
        detect(parse_device("cuda"), cuda=FakeCuda()),
        detect(parse_device("cuda"), cuda=FakeCuda(capability=(7, 5))),
    )
    assert not turing.bf16
    assert choose_precision(ampere, prefer_bf16=True).autocast_dtype is torch.bfloat16
    fp16 = choose_precision(turing, prefer_bf16=True)
    assert fp16.autocast_dtype is torch.float16 and fp16.use_scaler
    cpu = choose_precision(detect(parse_device("cpu")), prefer_bf16=True)
    assert cpu.autocast_dtype is None and not cpu.use_scaler


def test_missing_devices_are_explained():
    with pytest.raises(SwarmError, match="2 CUDA device"):
        detect(parse_device("cuda:2"), cuda=FakeCuda())
    with pytest.raises(SwarmError, match="no CUDA GPU"):
        detect(parse_device("cuda"), cuda=FakeCuda(count=0))
    with pytest.raises(SwarmError, match="mps"):
        detect(parse_device("mps"), cuda=FakeCuda(count=0), mps_available=False)
    assert detect(parse_device("auto"), cuda=FakeCuda(count=0), mps_available=False).device == "cpu"


class MemoryCeiling(torch.nn.Module):
    """Wraps a real model and runs out of 'GPU memory' above a micro-batch size, like a full card."""

    def __init__(self, model, max_batch):
        super().__init__()
        self.model, self.max_batch, self.calls = model, max_batch, []

    def forward(self, input_ids, labels):
        self.calls.append(input_ids.shape[0])
        if input_ids.shape[0] > self.max_batch:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return self.model(input_ids=input_ids, labels=labels)


@pytest.mark.parametrize("ceiling, limit, expected", [(13, 64, 11), (64, 64, 64), (1, 32, 1), (100, 24, 24)])
def test_search_finds_the_largest_fit_with_headroom(ceiling, limit, expected):
    manifest = build_manifest("tiny", overrides=["seq_len=16"])
    model = MemoryCeiling(build_model(manifest), ceiling)
    hw = detect(parse_device("cpu"))  # the trial really runs forward/backward/step, on the CPU
    before = [p.detach().clone() for p in model.parameters()]
    found = search(gpu_trial(model, hw, choose_precision(hw, False), 16, 259), limit)
    assert found == expected
    assert max(model.calls) > min(ceiling, limit) or ceiling >= limit  # it really probed past the ceiling
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # trials leave weights untouched


def test_search_reports_zero_when_nothing_fits_and_reraises_other_errors():
    def never(m):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    assert search(never, 8) == 0

    def broken(m):
        raise ValueError("a bug, not memory")

    with pytest.raises(ValueError):
        search(broken, 8)


def test_cpu_path_estimates_from_free_memory_and_caches(tmp_path):
    manifest = build_manifest("tiny")
    hw = detect(parse_device("cpu"))
    found = cpu_estimate(hw, model_config(manifest), manifest.seq_len, manifest.samples_per_step)
    assert 1 <= found <= manifest.samples_per_step
    small = cpu_estimate(hw.__class__(**{**hw.__dict__, "memory_bytes": 1}), model_config(manifest), 128, 8)
    assert small == 1
    calls = []
    cache = tmp_path / "microbatch.json"
    assert cached_or_search(cache, "cpu|tiny|128", lambda: calls.append(1) or found) == found
    assert cached_or_search(cache, "cpu|tiny|128", lambda: calls.append(1) or 999) == found
    assert cached_or_search(cache, "cpu|tiny|64", lambda: calls.append(1) or 3) == 3
    assert len(calls) == 2


def test_a_card_with_no_room_for_one_sample_gets_one_line_and_a_fitting_one_is_searched_once(tmp_path):
    """The client's choice on a CUDA card (faked: the kind says cuda, the trials run on the CPU, a ceiling OOMs)."""
    manifest = build_manifest("tiny", overrides=["seq_len=16"])
    cpu = detect(parse_device("cpu"))
    card = cpu.__class__(**{**cpu.__dict__, "kind": DeviceKind.CUDA, "name": "Fake GPU"})
    config, precision = model_config(manifest), choose_precision(cpu, False)
    full = MemoryCeiling(build_model(manifest), 0)
    with pytest.raises(SwarmError, match="runs out of memory even with one sample per micro-batch"):
        auto_micro_batch(full, card, precision, manifest, config, tmp_path / "full.json")
    assert not (tmp_path / "full.json").exists()  # nothing remembered: a freed card is searched again
    roomy = MemoryCeiling(build_model(manifest), 5)
    assert auto_micro_batch(roomy, card, precision, manifest, config, tmp_path / "mb.json") == 4  # 5 x 0.9
    probes = len(roomy.calls)
    assert auto_micro_batch(roomy, card, precision, manifest, config, tmp_path / "mb.json") == 4
    assert len(roomy.calls) == probes  # remembered for this card and run: no second search
