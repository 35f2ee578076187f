"""EngineConfig: the engine's options spelled once, checked when built, resolved for a device;
KVCache.allocate: the cache's size from CacheOptions."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mxrl.engine import CacheOptions, Engine, EngineConfig
from mxrl.engine.config import DEFAULT_TILE_CPU
from mxrl.engine.kv_cache import KVCache
from mxrl.kernels import Kernels
from tests.engine.test_engine import tiny


def test_a_config_with_a_device_is_resolved_for_it():
    unresolved = EngineConfig()
    assert unresolved.device is None and unresolved.tile is None and unresolved.overlap is None
    cpu = EngineConfig(device="cpu")
    assert cpu.device == torch.device("cpu") and cpu.tile == DEFAULT_TILE_CPU
    assert cpu.overlap is False and isinstance(cpu.backend, Kernels)
    assert cpu.gemm_tile == DEFAULT_TILE_CPU and cpu.cache == CacheOptions()
    fast = EngineConfig(device="cpu", batch_invariant=False)
    assert fast.tile is None and fast.gemm_tile == 0
    assert EngineConfig(cache=None).cache == CacheOptions()


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"tile": 0}, "tile must be >= 1"),
        ({"tile": 8, "batch_invariant": False}, "leave it unset with batch_invariant=False"),
        ({"compute_dtype": "bfloat16"}, "compute_dtype must be a torch.dtype"),
        ({"weight_dtype": None}, "weight_dtype must be a torch.dtype"),
        ({"cache": {"block_size": 4}}, "cache must be a CacheOptions"),
    ],
)
def test_refusals_name_the_field(kw, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kw)


def test_options_and_overrides_build_the_same_engine():
    model = tiny("mxfp8")
    by_name = Engine(model, "mxfp8", tile=8, cache=CacheOptions(block_size=4))
    by_config = Engine(model, "mxfp8", EngineConfig(tile=8, cache=CacheOptions(block_size=4)))
    over = Engine(model, "mxfp8", EngineConfig(tile=16), tile=8, cache=CacheOptions(block_size=4))
    assert by_name.options == by_config.options == over.options
    assert by_name.tile == 8 and by_name.device == torch.device("cpu")
    assert by_name.hashes == by_config.hashes
    with pytest.raises(TypeError, match=r"unknown engine option\(s\) \['tiles'\]"):
        Engine(model, "mxfp8", tiles=8)
    records = list(by_name.records())
    loaded = Engine.from_records(model.config, by_name.plan, records, tile=8)
    assert loaded.device == torch.device("cpu") and loaded.hashes == by_name.hashes


def test_a_resolved_record_of_another_device_is_refused():
    cpu = EngineConfig(device="cpu")
    with pytest.raises(ValueError, match="resolved for cpu, but the engine runs on cuda"):
        dataclasses.replace(cpu, device="cuda")


def test_kv_cache_allocate_sizes_the_cache():
    config = tiny().config
    per_block = KVCache.bytes_per_block(
        config.num_hidden_layers, 4, config.num_key_value_heads, config.head_dim, torch.float32
    )
    opt = CacheOptions(block_size=4, kv_cache_bytes=5 * per_block + 1)
    kv = KVCache.allocate(config, opt, torch.device("cpu"), torch.float32, scratch=1)
    assert kv.k[0].shape == (5, 4, config.num_key_value_heads, config.head_dim)
    with pytest.raises(ValueError, match="raise kv_cache_bytes or gpu_memory_fraction"):
        KVCache.allocate(config, opt, torch.device("cpu"), torch.float32, scratch=5)
