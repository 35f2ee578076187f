"""The FP8 KV cache (recipe `kv_cache: fp8`, mxrl.nn.kv_quant): block FP8 per token and KV head,
transcribed from the spec; the engine stores exactly those bytes and attends to what they give
back; the trainer's attention sees the same values; batch invariance and prefix sharing hold; the
plan hash carries it, and only when it is set."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from mxrl.arch import builtin_config
from mxrl.engine import Engine, SamplingParams
from mxrl.engine.kv_cache import KVCache
from mxrl.models import build_model
from mxrl.nn import apply_plan
from mxrl.nn.kv_quant import dequantize_kv, fake_quant_kv, quantize_kv
from mxrl.recipe import Recipe, load_recipe, resolve
from tests.engine.test_engine import tiny
from tests.numerics import assert_bytes_equal

pytestmark = pytest.mark.capability  # byte-exact on every CPU capability (tests/numeric_env.py)

PROMPTS = [[5, 9, 2, 7, 1, 33, 12], [3, 4], [60, 61, 62, 63, 1], [8] * 11]


def _recipe(kv: str, preset: str = "mxfp8") -> Recipe:
    """A preset with its KV cache set (`kv_cache:` in a recipe file)."""
    return dataclasses.replace(load_recipe(preset), name=f"{preset}-kv-{kv}", kv_cache=kv)


def _model(seed: int = 0):
    return build_model(builtin_config("tiny-moe"), seed=seed)


def _plan(model, kv: str, preset: str = "mxfp8"):
    return resolve(_recipe(kv, preset), {n: p.shape for n, p in model.named_parameters()})


def _params(seed: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_new_tokens=12, seed=seed)


# --- the numbers, from the spec (block FP8, spec §5, in one 1 x D block) ---------------------


def test_a_vector_by_hand():
    """amax 896: sf = 896/448 = 2, 1/sf = 0.5; x/2 = 448, 0.5, -1.5, 0.25 are E4M3 codes 0x7E,
    0x30, 0xBC, 0x28 (bias 7: 448 = 1.75 * 2^8, 0.5 = 2^-1, -1.5 = -1.5 * 2^0, 0.25 = 2^-2); they
    decode to the vector itself. A zero vector gets sf = fl(1e-4 / 448) and zero codes."""
    x = torch.tensor([[896.0, 1.0, -3.0, 0.5], [0.0, 0.0, 0.0, 0.0]])
    codes, scales = quantize_kv(x)
    assert codes.dtype == torch.uint8 and scales.dtype == torch.float32
    assert codes[0].tolist() == [0x7E, 0x30, 0xBC, 0x28] and codes[1].tolist() == [0] * 4
    floor = torch.tensor(1e-4, dtype=torch.float32) / torch.tensor(448.0)
    assert_bytes_equal(scales, torch.stack([torch.tensor(2.0), floor]), "scales")
    assert_bytes_equal(dequantize_kv(codes, scales, torch.float32), x, "decoded")


def test_one_scale_per_token_and_head_from_that_vector_alone():
    """A vector's codes and scale do not depend on the other vectors quantized with it."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 16, generator=g) * torch.logspace(-3, 3, 5)[:, None, None]
    codes, scales = quantize_kv(x)
    assert codes.shape == (5, 3, 16) and scales.shape == (5, 3)
    for t in range(5):
        for h in range(3):
            one_codes, one_scale = quantize_kv(x[t, h][None])
            assert_bytes_equal(codes[t, h], one_codes[0], f"codes {t},{h}")
            assert_bytes_equal(scales[t, h], one_scale[0], f"scale {t},{h}")
            amax = x[t, h].abs().max()
            assert scales[t, h] == amax / 448  # fl(amax / 448), amax above the 1e-4 floor


def test_fake_quant_is_the_decoded_cache_with_a_straight_through_gradient():
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(2, 4, 16, generator=g) * 5).requires_grad_()
    y = fake_quant_kv(x)
    assert_bytes_equal(y.detach(), dequantize_kv(*quantize_kv(x.detach()), x.dtype), "values")
    assert not torch.equal(y.detach(), x.detach())  # it does round
    (y * torch.arange(16.0)).sum().backward()
    assert_bytes_equal(x.grad, torch.arange(16.0).expand(2, 4, 16), "straight-through")


# --- the engine's cache ------------------------------------------------------------------------


def test_the_cache_holds_the_quantized_bytes_and_sizes_them():
    cache = KVCache(2, 4, 16, 2, 16, torch.float32, torch.device("cpu"), fp8=True)
    g = torch.Generator().manual_seed(2)
    k, v = torch.randn(2, 5, 16, generator=g), torch.randn(2, 5, 16, generator=g) * 100
    slots = torch.tensor([3, 17, 18, 40, 63])
    cache.write(1, slots, k, v)
    for held, scales, x in ((cache.k, cache.k_scale, k), (cache.v, cache.v_scale, v)):
        codes, sf = quantize_kv(x.transpose(0, 1))  # [T, K, D]
        assert_bytes_equal(held[1].view(-1, 2, 16)[slots], codes, "codes")
        assert_bytes_equal(scales[1].view(-1, 2)[slots], sf, "scales")
        assert held[0].count_nonzero() == 0  # another layer: untouched
    keys = cache.gather(1, False, torch.tensor([1]))  # block 1: slots 16..31
    assert_bytes_equal(keys[0, 1:3], dequantize_kv(*quantize_kv(k.transpose(0, 1)[1:3]),
                                                   torch.float32), "read back")  # fmt: skip
    # a code byte per element and a 4-byte scale per token slot and KV head, keys and values
    assert KVCache.bytes_per_block(3, 16, 2, 64, torch.bfloat16, fp8=True) == 2 * 3 * 16 * 2 * 68
    assert KVCache.bytes_per_block(3, 16, 2, 64, torch.bfloat16) == 2 * 3 * 16 * 2 * 128


def test_the_engine_serves_the_fp8_cache_batch_invariant_and_with_shared_prefixes():
    model = _model()
    engine = Engine(model, _plan(model, "fp8"), tile=8)
    params = [_params(100 + i) for i in range(len(PROMPTS))]
    batch = engine.generate(PROMPTS, params)
    for i, prompt in enumerate(PROMPTS):
        alone = engine.generate([prompt], [params[i]])[0]
        assert alone.tokens == batch[i].tokens, f"request {i}"
        assert_bytes_equal(alone.logprobs, batch[i].logprobs, f"request {i} logprobs")
    # the same prompt twice in one step: the second reads the first one's cached blocks
    shared = PROMPTS[3] + PROMPTS[0] * 3
    twice = engine.generate([shared, shared], [params[0], params[0]])
    assert twice[0].tokens == twice[1].tokens
    assert_bytes_equal(twice[0].logprobs, twice[1].logprobs, "shared prefix")
    # and it is not the compute-dtype cache: the same weights serve other logprobs there
    other = Engine(_model(), _plan(model, "compute"), tile=8).generate(PROMPTS, params)
    assert any(not torch.equal(a.logprobs, b.logprobs) for a, b in zip(batch, other, strict=True))


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["bf16", "fp8-block", "nvfp4-dequantized"])
def test_the_fp8_cache_on_cuda_graphs_and_alone_give_the_eager_bytes(preset):
    """On a GPU, in bf16 as users run it: the Triton paged attention on the FP8 cache (its
    hardware E4M3 decode), CUDA-graph decode against eager, and a request alone against its
    batch, byte for byte."""
    model = tiny(preset)  # wide enough for fp8-block's 128-blocks
    plan = _plan(model, "fp8", preset)
    params = [_params(100 + i) for i in range(len(PROMPTS))]
    outs = {}
    for graphs in (False, True):
        engine = Engine(
            model, plan, device="cuda", compute_dtype=torch.bfloat16, cuda_graphs=graphs
        )
        assert engine._attention_kernel
        outs[graphs] = engine.generate(PROMPTS, params)
        assert (engine.runner.num_graph_steps > 0) == graphs
    for i, (eager, graph) in enumerate(zip(outs[False], outs[True], strict=True)):
        assert eager.tokens == graph.tokens, f"request {i}"
        assert_bytes_equal(eager.logprobs, graph.logprobs, f"request {i} logprobs")
    alone = engine.generate([PROMPTS[2]], [params[2]])[0]
    assert alone.tokens == outs[True][2].tokens
    assert_bytes_equal(alone.logprobs, outs[True][2].logprobs, "alone")


# --- the trainer -----------------------------------------------------------------------------


@pytest.mark.parametrize("autocast", [None, torch.bfloat16])
def test_the_trainers_attention_sees_what_the_cache_gives_back(monkeypatch, autocast):
    """Under `kv_cache: fp8` every layer's attention (SDPA) gets, byte for byte, what the cache
    gives back for the keys and values that layer computed, in the dtype attention computes in
    (bf16 under a bf16 autocast, as the engine's cache holds them in its bf16 compute dtype);
    the first layer's are the ones the compute-dtype cache's model attends to (later layers'
    inputs differ: the cache rounds)."""
    import mxrl.models.layers as layers

    sdpa, real_fake_quant = F.scaled_dot_product_attention, layers.fake_quant_kv
    attended: list[tuple[torch.Tensor, torch.Tensor]] = []
    computed: list[torch.Tensor] = []

    def spy(q, k, v, **kw):
        attended.append((k.detach().clone(), v.detach().clone()))
        return sdpa(q, k, v, **kw)

    def recorded(x):
        computed.append(x.detach().clone())
        return real_fake_quant(x)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    monkeypatch.setattr(layers, "fake_quant_kv", recorded)
    ids = torch.tensor([PROMPTS[0] + PROMPTS[3]])
    compute = copy.deepcopy(_model())
    apply_plan(compute, _plan(compute, "compute"))
    compute.set_training_options(compute_dtype=autocast)
    compute(ids)
    assert not computed  # no rounding under the compute-dtype cache
    first_k, first_v = attended[0]
    attended.clear()
    fp8 = copy.deepcopy(_model())
    apply_plan(fp8, _plan(fp8, "fp8"))
    fp8.set_training_options(compute_dtype=autocast)
    fp8(ids)
    assert len(attended) == 4 and len(computed) == 8  # per layer: keys, then values
    dtype = autocast or torch.float32  # (the spy sees SDPA's inputs before autocast casts them)
    assert computed[0].dtype == dtype
    assert_bytes_equal(computed[0], first_k.to(dtype), "layer 0 keys before the cache")
    assert_bytes_equal(computed[1], first_v.to(dtype), "layer 0 values before the cache")
    for layer, (k, v) in enumerate(attended):
        k_in, v_in = computed[2 * layer], computed[2 * layer + 1]
        assert_bytes_equal(k, dequantize_kv(*quantize_kv(k_in), k_in.dtype), f"layer {layer} k")
        assert_bytes_equal(v, dequantize_kv(*quantize_kv(v_in), v_in.dtype), f"layer {layer} v")


def test_a_model_without_an_fp8_capable_attention_in_every_layer_is_refused():
    model = _model()
    del model.model.layers[2].self_attn.kv_fp8
    with pytest.raises(ValueError, match="kv_cache: fp8 needs an FP8-capable attention"):
        apply_plan(model, _plan(model, "fp8"))


# --- the contract ------------------------------------------------------------------------------


def test_the_plan_hash_carries_the_kv_cache_only_when_it_is_fp8():
    model = _model()
    preset = resolve("mxfp8", {n: p.shape for n, p in model.named_parameters()})
    compute, fp8 = _plan(model, "compute"), _plan(model, "fp8")
    assert compute.hash() == preset.hash()  # the same tensors, the default cache
    assert fp8.hash() != compute.hash()
    again = type(fp8).from_json(fp8.to_json())
    assert again.kv_cache.value == "fp8" and again.hash() == fp8.hash()
    assert "KV cache fp8" in fp8.summary()


def test_a_bad_kv_cache_value_names_the_field():
    with pytest.raises(ValueError, match="kv_cache"):
        resolve(
            {"name": "x", "kv_cache": "fp4"}, {"model.layers.0.mlp.down_proj.weight": (64, 128)}
        )
