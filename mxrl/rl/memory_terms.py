"""The terms of the memory estimate (mxrl/rl/memory.py), each counted from the code that
allocates it: what autograd saves in mxrl.models' forward, what mxrl.nn's training ops and the
engine hold for a weight under its spec, the engine's KV blocks, a logits chunk.

Byte sizes are plain ints (master, compute: 4 for fp32, 2 for bf16); `cuda` picks the CUDA
paths (the grouped expert GEMMs, packed quantized weights) over the CPU reference's. torch is
imported inside the functions that need a dtype: preflight runs these before the model exists.
"""

from __future__ import annotations

import math
from typing import Any

LOGITS_COPIES = 3  # a logits chunk at its peak: logits, log-softmax, their gradient
PER_TOKEN_LOSS = 32  # fp32 logprob, old logprob, advantage, mask, ... per token


def _norm(width: int, x_bytes: int) -> int:
    """RMSNorm saves its input in fp32, the 1/rms and the normalised input in its dtype."""
    return 4 * width + 4 + x_bytes * width


def activation_bytes(
    c: Any,
    master: int,
    compute: int,
    cuda: bool,
    seq: int,
    ckpt: bool,
    experts: dict[int, tuple[int, int]] | None = None,
) -> tuple[int, int]:
    """(bytes per padded token the training forward saves for the backward, the backward's
    working set: one decoder layer's worth of activation gradients, and with `ckpt` that layer's
    recomputed activations too). Under autocast (fp32 master, bf16 compute) the residual
    stream stays fp32 and every linear saves its own bf16 cast of its input. `experts`
    (`expert_input_bytes`, CUDA): per MoE layer, what its quantized routed experts keep of
    their projections' inputs where that is less than bf16 rows."""
    h, nd, kd = (
        c.hidden_size,
        c.num_attention_heads * c.head_dim,
        c.num_key_value_heads * c.head_dim,
    )
    casts = master == 4 and compute == 2

    def inputs(n: int) -> int:  # the saved inputs of n linears reading one tensor
        return compute * h * (n if casts else 1)

    attn = _norm(h, master) + inputs(3) + compute * (2 * nd + 2 * kd) + 4 * c.num_attention_heads
    if c.qk_norm:
        attn += _norm(nd, compute) + _norm(kd, compute)
    attn += compute * seq  # SDPA's float mask [S, L] (padding), per query
    layers = []
    for i in range(c.num_hidden_layers):
        mlp = _norm(h, master)
        if i in c.moe_layers:
            k, shared = c.num_experts_per_tok, c.shared_expert_intermediate_size
            # per (token, expert): its input, gate_up, silu, down's input and output (the CPU
            # loop; the grouped GEMMs keep no separate down output), weighted output (the
            # grouped GEMMs save bf16 whatever the master; the loop the master's). On an H200,
            # a Qwen3-30B-A3B layer saved one [tokens x k, hidden] and one [tokens, k, hidden]
            # bf16 tensor (benchmarks/results/activations-h200-5f09152.log)
            expert, out = (2, 2) if cuda else (compute, master)
            widths = (1 if cuda else 2) * h + 4 * c.moe_intermediate_size
            mlp += inputs(1 + (3 if shared else 0)) + 4 * c.num_experts + 4 + 36 * k
            mlp += k * (expert * widths + out * h + 4)
            if cuda and i in (experts or {}):  # the gate/up input's bf16 rows, the down's
                token, row = experts[i]
                mlp += token + k * row - k * 2 * (h + c.moe_intermediate_size)
            if shared:
                mlp += compute * (4 * shared + h + 2)  # its MLP, its output, the sigmoid gate
        else:
            mlp += inputs(2) + compute * 4 * c.intermediate_size
        layers.append(attn + mlp)
    # ids, RoPE's cos and sin, the final norm, the logits' input, the loss's per-token values
    once = 8 + 2 * c.head_dim * master + _norm(h, master) + compute * h + PER_TOKEN_LOSS
    if ckpt:  # each layer keeps its input; the backward recomputes one layer at a time
        return once + c.num_hidden_layers * master * h, 2 * max(layers)
    return once + sum(layers), max(layers)


def expert_input_bytes(plan: Any, c: Any, cuda: bool) -> dict[int, tuple[int, int]]:
    """Per MoE layer whose quantized routed experts run the grouped GEMMs (CUDA), what their
    backward keeps of each projection's input (`GroupedLinear`: the form its WGRAD reads,
    `mxrl.nn.operands.form_of`): (bytes a token, for the gate/up projection, which keeps x's
    tokens under a row-wise quantized format, not its k rows; bytes a routed row, for the
    down projection). `high_precision`: bf16, 2 a feature; `dequantized`: the activation's
    codes and scales (MXFP8 1 + 1/32 a feature, per-token NVFP4 1/2 + 1/16 and its fp32 global
    scale, block FP8 1 + 4/128). The `quantized` backward's column copies (1 + 1/32 or 4/128 a
    feature, but of the rows padded to whole blocks per expert) are left out: their bf16 rows'
    charge is an upper bound where the experts average more than ~33 rows."""
    from mxrl.nn.operands import Form, GemmKind, Operand, form_of
    from mxrl.nn.paths.grouped import grouped_supported
    from mxrl.recipe import Backward

    if not cuda or plan.backward is Backward.QUANTIZED:
        return {}
    import torch

    form = form_of(plan.backward, GemmKind.WGRAD, Operand.FWD_INPUT)
    h, inter = c.hidden_size, c.moe_intermediate_size
    layers: dict[int, dict[str, Any]] = {}
    for spec in plan.values():
        if spec.kind == "routed_expert":
            layers.setdefault(spec.layer, {})[spec.role] = spec
    kept = {}
    for layer, specs in layers.items():
        if any(s.format.value == "bf16" for s in specs.values()) or not grouped_supported(
            specs, (h, inter), torch.device("cuda"), plan.backward
        ):
            continue
        kept[layer] = tuple(
            2 * width if form is Form.HP else _activation_bytes(specs[role], width)
            for role, width in (("gate_up", h), ("down", inter))
        )
    return kept


def _activation_bytes(spec: Any, width: int) -> int:
    """One row's quantized activation of `width` features in the spec's format: the fields of a
    one-row QTensor (`stored_layout`), its codes, block scales and (NVFP4) fp32 global scale.
    A row's blocks and global scale are its own whatever the blocks' rows (block FP8's
    1 x 128 here) and the scale's granularity (NVFP4 per token), so the defaults give them."""
    from mxrl.formats import stored_layout

    return _layout_bytes(stored_layout(spec.format, (1, width)))


def _layout_bytes(layout: dict) -> int:
    """The bytes of a QTensor's fields, from their (dtype, shape) (`stored_layout`)."""
    return sum(math.prod(shape) * dtype.itemsize for dtype, shape in layout.values())


def logits_chunk_bytes(vocab: int, max_tokens: int) -> int:
    """One chunk of the logprob computation's fp32 logits, LOGITS_COPIES times; a chunk holds
    no more tokens than the pass (`max_tokens`: the step's)."""
    from mxrl.rl.logprobs import logits_chunk_tokens

    return LOGITS_COPIES * min(logits_chunk_tokens(vocab), max_tokens) * vocab * 4


def _contract_bytes(spec: Any) -> int:
    """A quantized weight's stored bytes (codes, scales, global scales) under its spec."""
    from mxrl.recipe.quantize import weight_layout

    return _layout_bytes(weight_layout(spec))


def train_copy_bytes(
    plan: Any, c: Any, master: int, compute: int, cuda: bool, hold_bf16: bool = False
) -> int:
    """What the training ops hold besides the master weights: each quantized weight's cache
    (mxrl.nn: its packed bytes on CUDA's tensor-core path, fp32 operands on the CPU reference;
    a column-wise copy for the quantized backward), under autocast the bf16 casts of the
    bf16 matmul weights, saved for the backward, and with `hold_bf16` (rl.hold_bf16_weights on
    one process) the bf16 routed experts' held copies of their fp32 masters on CUDA."""
    from mxrl.formats.constants import Format
    from mxrl.recipe import Backward

    total = 0
    for spec in plan.values():
        n = math.prod(spec.shape)
        if spec.format is Format.BF16:
            matmul = spec.kind != "norm" and (spec.kind != "embedding" or c.tie_word_embeddings)
            if spec.kind == "routed_expert" and cuda:
                # the grouped GEMMs cast expert weights per call and keep none, or hold one
                # copy (in any compute dtype: they run in bf16)
                total += 2 * n if master == 4 and hold_bf16 else 0
                continue
            total += 2 * n if master == 4 and compute == 2 and matmul else 0
            continue
        col = plan.backward is Backward.QUANTIZED
        if cuda:
            total += _contract_bytes(spec) * (2 if col else 1)
            if spec.kind == "routed_expert" and hold_bf16:
                total += _kept_bytes(spec, plan.backward, master)
        else:
            total += 4 * n * (1 + (spec.format is Format.NVFP4) + col)
    return total


def _kept_bytes(spec: Any, backward: Any, master: int) -> int:
    """A quantized routed expert's bf16 operand kept per optimizer step under hold_bf16
    (`mxrl.nn.qlinear.kept_forms`): 2 bytes a weight, but none for HP over a bf16 master (its
    cast is the master itself)."""
    from mxrl.nn.operands import Form
    from mxrl.nn.qlinear import kept_forms

    forms = kept_forms(backward)
    if not forms or (forms == (Form.HP,) and master == 2):
        return 0
    return 2 * math.prod(spec.shape)


def engine_weight_bytes(plan: Any, compute: int, cuda: bool) -> int:
    """The engine's weights: every record as received (bf16 2 bytes, a quantized weight its
    stored bytes) plus the operand the GEMM reads where it is not the record: a compute-dtype
    copy of a bf16 weight when computing in fp32, and on the CPU the fp32 dequantized weight
    (and its globally scaled copy for NVFP4). On CUDA quantized weights stay packed (the
    Triton low-bit and block-FP8 GEMMs)."""
    from mxrl.formats.constants import Format

    total = 0
    for spec in plan.values():
        n = math.prod(spec.shape)
        if spec.format is Format.BF16:
            total += 2 * n + (4 * n if compute == 4 else 0)
        else:
            total += _contract_bytes(spec) + (0 if cuda else 4 * n * (1 + (spec.format == "nvfp4")))
    return total


def kv_cache_bytes(
    c: Any, rl: Any, seq: int, compute: int, cuda: bool, ranks: int, fp8: bool = False
) -> int:
    """The KV cache a rollout of this rank's groups (`rl`: the GRPOConfig) needs: every
    sequence (at most the scheduler's max_num_seqs at once) at its longest, `seq` tokens, in
    whole blocks, without prefix sharing (an upper bound); plus CUDA graphs' scratch block.
    fp8: the recipe's `kv_cache: fp8` (codes and scales)."""
    import torch

    from mxrl.engine.config import CacheOptions
    from mxrl.engine.kv_cache import KVCache, cache_dims

    opt = CacheOptions()
    sequences = min(
        math.ceil(rl.prompts_per_step / ranks) * rl.samples_per_prompt, opt.max_num_seqs
    )
    dtype = torch.bfloat16 if compute == 2 else torch.float32
    heads, k_dim, v_dim = cache_dims(c)  # MLA: the expanded per-head keys and values
    per_block = KVCache.bytes_per_block(
        c.num_hidden_layers, opt.block_size, heads, k_dim, dtype, v_dim, fp8=fp8
    )
    blocks = sequences * math.ceil(seq / opt.block_size) + (1 if cuda else 0)
    return blocks * per_block
