"""The memory estimate's routed-expert inputs on CUDA (`mxrl.rl.memory_terms.expert_input_bytes`):
what the grouped GEMMs keep of quantized experts' inputs, read off the autograd graph, and the
count against the reference quantizer's bytes, layer by layer."""

from __future__ import annotations

import pytest
import torch

from mxrl.arch import ModelConfig, tensors_from_hf_config
from mxrl.models import build_model
from mxrl.recipe import resolve
from mxrl.rl import memory_terms
from tests.rl.test_memory import _hf


def _experts_kept_per_token(config: ModelConfig, recipe: dict | None) -> float:
    """Bytes per token the grouped expert GEMMs (`GroupedLinear`, on the CPU's tensor-core path:
    the CUDA path's code, the reference kernels) keep of their inputs over one forward of the
    decoder: the slope from 2 to 4 sequences of 16 tokens."""
    from mxrl.nn import apply_plan, set_gemm
    from tests.nn.test_gate_up_tokens import _kept_bytes

    kept = []
    for batch in (2, 4):
        model = build_model(config, dtype=torch.float32, seed=0).train()
        if recipe is not None:
            apply_plan(model, resolve(recipe, {n: p.shape for n, p in model.named_parameters()}))
        assert set_gemm(model, "tensor_core") == config.num_hidden_layers
        model.set_training_options(compute_dtype=torch.bfloat16, hold_bf16_weights=True)
        ids = torch.randint(0, config.vocab_size, (batch, 16), generator=torch.Generator())
        hidden, _ = model.model(ids, attention_mask=torch.ones(batch, 16, dtype=torch.long))
        kept.append(_kept_bytes(hidden))
    return (kept[1] - kept[0]) / (2 * 16)


@pytest.mark.parametrize(
    ("fmt", "backward"),
    [
        ("mxfp8", "high_precision"),
        ("mxfp8", "dequantized"),
        ("nvfp4", "high_precision"),
        ("nvfp4", "dequantized"),
        ("mxfp8", "quantized"),  # column copies of padded rows: the bf16 charge bounds them
    ],
)
def test_quantized_experts_inputs_as_the_grouped_gemms_keep_them(fmt, backward):
    """The estimate's routed-expert inputs on CUDA (`expert_input_bytes`) against what the
    grouped GEMMs keep, read off the autograd graph (their saved tensors and the quantized
    copies they hold): bf16 experts keep k bf16 rows of x and of the down projection's input a
    token; quantized ones under `high_precision` x's bf16 tokens (not its k rows), under
    `dequantized` the tokens' and rows' activation codes and scales (widths 256 and 96: 96
    features are 3 MXFP8 blocks, 6 NVFP4 ones). Exact, bytes per token; the quantized
    backward's column copies are at most the bf16 charge."""
    hf = _hf(
        hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        moe_intermediate_size=96, num_experts=8, num_experts_per_tok=2,
        shared_expert_intermediate_size=0, num_hidden_layers=2, mlp_only_layers=[],
    )  # fmt: skip
    config = ModelConfig.from_hf(hf)
    extra = {"activations": "per_token"} if fmt == "nvfp4" else {}
    recipe = {
        "name": "experts", "default": "bf16", "backward": backward,
        "rules": [{"match": {"kind": "routed_expert"}, "format": fmt, **extra}],
    }  # fmt: skip
    plan = resolve(recipe, tensors_from_hf_config(hf, "fused"))
    bf16 = _experts_kept_per_token(config, None)
    assert bf16 == 2 * 2 * 2 * (256 + 96), "bf16 experts: k rows of x and of the down input"
    got = _experts_kept_per_token(config, recipe)
    experts = memory_terms.expert_input_bytes(plan, config, cuda=True)

    def estimate(kept) -> int:
        return memory_terms.activation_bytes(config, 4, 2, True, 32, False, kept)[0]

    charged = bf16 + estimate(experts) - estimate(None)
    if backward == "quantized":
        assert experts == {} and got <= bf16
        return
    assert sorted(experts) == [0, 1] and got == charged < bf16, (got, charged, bf16)
    assert memory_terms.expert_input_bytes(plan, config, cuda=False) == {}


@pytest.mark.parametrize(
    ("fmt", "hidden"),
    [("fp8_block", 256), ("fp8_block", 129 * 128), ("mxfp8", 256), ("nvfp4", 256)],
)
def test_expert_inputs_layer_by_layer_as_the_quantizer_writes_them(fmt, hidden):
    """`expert_input_bytes` under `dequantized`, a layer at a time: layer 0's experts bf16 (no
    entry; the layers after it still get theirs), layers 1 and 2 quantized: one token's and one
    row's activation as the reference quantizer writes it (codes, scales, NVFP4's global
    scale; widths 256 or 129 x 128 and 384: block FP8's 1x128 groups, 3 of them in the down
    input, 129 in the widest, where a count by 129-wide groups would be one short). None on
    the CPU, under `quantized`, or for block FP8 in blocks the grouped kernels do not take."""
    from mxrl.recipe.quantize import quantize_activation

    hf = _hf(
        hidden_size=hidden, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        moe_intermediate_size=384, num_experts=4, num_experts_per_tok=2,
        shared_expert_intermediate_size=0, num_hidden_layers=3, mlp_only_layers=[],
    )  # fmt: skip
    config = ModelConfig.from_hf(hf)
    extra = {"nvfp4": {"activations": "per_token"}, "fp8_block": {"block": [128, 128]}}
    extra = extra.get(fmt, {})

    def plan(backward: str, **changes):
        rules = [{"match": {"layers": "0"}, "format": "bf16"},
                 {"match": {"kind": "routed_expert"}, "format": fmt, **extra, **changes}]  # fmt: skip
        recipe = {"name": "r", "default": "bf16", "backward": backward, "rules": rules}
        return resolve(recipe, tensors_from_hf_config(hf, "fused"))

    deq = plan("dequantized")
    spec = {s.role: s for s in deq.values() if s.kind == "routed_expert" and s.layer == 1}

    def written(role: str, width: int) -> int:
        q = quantize_activation(torch.randn(1, width, generator=torch.Generator()), spec[role])
        return sum(t.numel() * t.element_size() for t in q.tensors().values())

    want = (written("gate_up", hidden), written("down", 384))
    assert memory_terms.expert_input_bytes(deq, config, cuda=True) == {1: want, 2: want}
    assert want[0] < 2 * hidden and want[1] < 2 * 384
    assert memory_terms.expert_input_bytes(deq, config, cuda=False) == {}
    if fmt != "nvfp4":  # (NVFP4 has no quantized backward)
        assert memory_terms.expert_input_bytes(plan("quantized"), config, cuda=True) == {}
    if fmt == "fp8_block":  # 32 x 32 weight blocks: the loop path, not the grouped kernels
        other = plan("dequantized", block=[32, 32])
        assert memory_terms.expert_input_bytes(other, config, cuda=True) == {}
