"""The engine's `dense_gemm` option: "tiles" (the default) runs every bf16 projection on fixed
tiles, "grouped" all of a step's rows in one `torch._grouped_mm` launch on a GPU of sm90+ in
bf16 compute. Checked where it is set, carried to every projection, a no-op where the kernel
does not apply (the CPU: the tiles' bytes), and on CUDA batch-, chunk- and graph-invariant byte
for byte, close to the tiles (their bytes are not promised)."""

from __future__ import annotations

import pytest
import torch

from mxrl.engine import CacheOptions, Engine, EngineConfig
from mxrl.nn.paths.rollout import RolloutLinear
from tests.engine.test_engine import tiny
from tests.engine.test_scheduler import _alone, _params, _same

# prompts of 5 to 75 tokens: a prefill of ~500 rows crosses several 128-row tiles
PROMPTS = [[(7 * i + 3 * j) % 60 + 1 for j in range(5 + 10 * i)] for i in range(8)]


@pytest.mark.parametrize("bad", ["tile", "", None, 1])
def test_an_unknown_value_is_refused(bad):
    with pytest.raises(ValueError, match="dense_gemm must be one of"):
        EngineConfig(dense_gemm=bad)


def test_grouped_reaches_every_projection_and_only_there():
    model = tiny()
    grouped = Engine(model, "bf16", dense_gemm="grouped")
    tiles = Engine(model, "bf16")
    linears = [m for m in grouped.net.modules() if isinstance(m, RolloutLinear)]
    assert len(linears) > 4 and all(m.path.one_group for m in linears)
    assert not any(m.path.one_group for m in tiles.net.modules() if isinstance(m, RolloutLinear))
    # without batch invariance every projection already runs over the rows at once
    loose = Engine(model, "bf16", dense_gemm="grouped", batch_invariant=False)
    assert not any(m.path.one_group for m in loose.net.modules() if isinstance(m, RolloutLinear))


def test_on_the_cpu_it_keeps_the_tiles_bytes():
    model = tiny()
    params = _params(3)
    want = Engine(model, "bf16", tile=8).generate(PROMPTS[:3], params)
    _same(Engine(model, "bf16", tile=8, dense_gemm="grouped").generate(PROMPTS[:3], params), want)


@pytest.mark.gpu
def test_on_cuda_batch_chunk_and_graph_invariant(monkeypatch):
    """bf16 compute on CUDA: each request alone, in the batch, prefilled in 64-token chunks and
    decoded eagerly gives the same bytes; close to the tiles' engine (its tokens where the
    logprobs are not tied); one launch per projection in a prefill."""
    model = tiny()
    params = _params(len(PROMPTS))
    kw = dict(device="cuda", compute_dtype=torch.bfloat16, dense_gemm="grouped")
    engine = Engine(model, "bf16", **kw)
    assert engine.cuda_graphs
    calls = []
    grouped_mm = torch._grouped_mm
    monkeypatch.setattr(
        torch,
        "_grouped_mm",
        lambda *a, **k: calls.append((a[1].shape[0], a[0].shape[0])) or grouped_mm(*a, **k),
    )
    got = engine.generate(PROMPTS, params)
    assert max(rows for groups, rows in calls if groups == 1) > 128  # a prefill's rows at once
    monkeypatch.setattr(torch, "_grouped_mm", grouped_mm)
    assert engine.stats.graph_steps > 0
    _same(_alone(engine, PROMPTS, params), got, "alone")
    chunked = Engine(model, "bf16", cache=CacheOptions(max_num_batched_tokens=64), **kw)
    _same(chunked.generate(PROMPTS, params), got, "chunked")
    _same(Engine(model, "bf16", cuda_graphs=False, **kw).generate(PROMPTS, params), got, "eager")
    tiles = Engine(model, "bf16", device="cuda", compute_dtype=torch.bfloat16).generate(
        PROMPTS, params
    )
    for g, t in zip(got, tiles, strict=True):  # the first sampled token's logprob
        torch.testing.assert_close(g.logprobs[:1], t.logprobs[:1], rtol=0, atol=0.1)


def test_the_run_config_takes_it_and_checks_it():
    from mxrl.engine.config import DENSE_GEMMS
    from mxrl.rl.config import GRPOConfig
    from mxrl.rl.resolve import resolve_train

    assert GRPOConfig().engine_dense_gemm == "tiles"
    for value in DENSE_GEMMS:  # the run config's choices are the engine's
        assert GRPOConfig(engine_dense_gemm=value).engine_dense_gemm == value
    with pytest.raises(ValueError, match=r"rl\.engine_dense_gemm: must be one of tiles, grouped"):
        GRPOConfig(engine_dense_gemm="one")
    resolved = resolve_train(GRPOConfig(engine_dense_gemm="grouped"), tiny(), "cpu")
    assert resolved.engine.dense_gemm == "grouped"


def test_the_run_configs_tile_defaults_to_the_engines_for_the_device():
    from mxrl.engine.config import DEFAULT_TILE_CPU
    from mxrl.rl.config import GRPOConfig
    from mxrl.rl.resolve import resolve_train

    assert GRPOConfig().engine_tile is None
    assert resolve_train(GRPOConfig(), tiny(), "cpu").engine.tile == DEFAULT_TILE_CPU
    assert resolve_train(GRPOConfig(engine_tile=16), tiny(), "cpu").engine.tile == 16
    with pytest.raises(ValueError, match=r"rl\.engine_tile: must be >= 1"):
        GRPOConfig(engine_tile=0)
