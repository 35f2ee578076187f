"""Building blocks of the Qwen decoder: RMSNorm, RoPE, attention, SwiGLU MLP, sparse MoE block
(DeepSeek-V3's MLA and sigmoid-routed MoE: `mxrl.models.mla`; `DecoderLayer` picks by config).

Legend: B batch, S query length, L key/value length (S plus cached tokens), H hidden size,
N query heads, K key/value heads, D head_dim, T = B*S tokens, E experts, k experts per token.

Every projection is a plain `nn.Linear` and the routed experts are one `mxrl.nn.GroupedExperts`,
so `apply_plan` can swap modules in place by name; attribute names are the HF ones, so
`state_dict()` keys are the canonical (fused-layout) HF tensor names.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from mxrl.arch.config import ModelConfig
from mxrl.kernels.backend import Backend
from mxrl.kernels.norm_train import fused_norm_fits, rms_norm_train
from mxrl.kernels.rope_train import rope_train
from mxrl.kernels.rowwise import rope_reference, topk_softmax
from mxrl.models import yarn
from mxrl.models.context import get_forward_context
from mxrl.nn import GroupedExperts, invariant
from mxrl.nn.kv_quant import fake_quant_kv


class KVCache(Protocol):
    """What `Attention.forward` needs of a KV cache (the engine provides one)."""

    def update(
        self, layer_idx: int, k_BKSD: torch.Tensor, v_BKSD: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this step's keys/values (after RoPE); return all of them, [B, K, L, D]."""
        ...


@dataclass(frozen=True)
class LayerInputs:
    """What every decoder layer of one forward reads besides its hidden states, made once per
    forward by `DecoderModel.forward`.

    rope: (cos, sin) [B, S, D] for the query positions (MLA: [B, S, Dr]).
    mask_BSL: bool [B, 1, S, L], True = attend; None = causal, with the S queries being the
      last S of the L positions (prefill: S == L; decode: S == 1, attend to all).
    kv_cache: None, or an object with `update(layer_idx, k, v) -> (k_all, v_all)`.
    """

    rope: tuple[torch.Tensor, torch.Tensor]
    mask_BSL: torch.Tensor | None = None
    kv_cache: KVCache | None = None


class RMSNorm(nn.Module):
    """HF's Qwen RMSNorm: normalise in fp32, cast back to the input dtype, then scale.

    `rowwise`: REFERENCE runs the eager ops below; TRITON the fused forward and backward
    (mxrl.kernels.norm_train: the engine's forward statistics, gradients within its bounds),
    which `apply_plan` picks for a run whose row-wise kernels are Triton; inputs the kernels do
    not take (float64, rows over 16384) run the eager ops there too."""

    def __init__(self, dim: int, eps: float, *, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))
        self.eps = eps
        self.rowwise = Backend.REFERENCE

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rowwise is Backend.TRITON and fused_norm_fits(x, self.weight):
            return rms_norm_train(x, self.weight, self.eps)
        x_dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(x_dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class RotaryEmbedding(nn.Module):
    """Default RoPE (rotate-half convention, as HF Qwen). No buffers: nothing to load or save.

    inv_freq is computed in fp32 on the CPU exactly as transformers does and cached per device, so
    the angles are the same bytes on every device and after meta-device construction.

    On the CPU, cos and sin come from a table filled `TABLE_CHUNK` positions at a time, each
    chunk by one fixed-shape call: a position's values are computed once, the same way whatever
    batch asks for them (ATen's CPU cos/sin round differently in their vector body and scalar
    tail, so computing them over a batch's positions made them depend on the batch; see
    `mxrl.nn.invariant`). On CUDA they are computed per element, which is already invariant.
    """

    TABLE_CHUNK = 256

    def __init__(
        self, head_dim: int, theta: float, scaling: Mapping[str, Any] | None = None
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        # YaRN (mxrl.models.yarn; None: default RoPE): other frequencies, cos/sin scaled
        self.scaling = dict(scaling) if scaling else None
        self.attention_factor = yarn.attention_factor(scaling) if scaling else 1.0
        self._inv_freq: dict[torch.device, torch.Tensor] = {}
        # the CPU table, [positions, D] fp32, grown by whole chunks
        self._table_cos = self._table_sin = torch.empty(0, head_dim, device="cpu")

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        if device not in self._inv_freq:
            d = self.head_dim
            if self.scaling is not None:
                inv = yarn.inv_freq(d, self.theta, self.scaling)
            else:
                inv = 1.0 / (self.theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
            self._inv_freq[device] = inv.to(device)
        return self._inv_freq[device]

    def _angles(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq(position_ids.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    def _cpu_table(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if position_ids.numel() and int(position_ids.min()) < 0:
            raise ValueError("position_ids must be >= 0 (absolute token positions)")
        needed = int(position_ids.max()) + 1 if position_ids.numel() else 1
        while self._table_cos.shape[0] < needed:
            start = self._table_cos.shape[0]
            cos, sin = self._angles(torch.arange(start, start + self.TABLE_CHUNK))
            self._table_cos = torch.cat([self._table_cos, cos])
            self._table_sin = torch.cat([self._table_sin, sin])
        return self._table_cos[position_ids], self._table_sin[position_ids]

    def forward(
        self, position_ids_BS: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [B, S, D] in `dtype` (angles in fp32)."""
        if position_ids_BS.device.type == "cpu":
            cos, sin = self._cpu_table(position_ids_BS)
        else:
            cos, sin = self._angles(position_ids_BS)
        if self.attention_factor != 1.0:  # transformers: emb.cos() * attention_scaling, in fp32
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), sin.to(dtype)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, theta={self.theta}"


class ApplyRope(nn.Module):
    """RoPE applied to a layer's queries and keys: a module (no parameters), so the rollout
    engine can swap in a fused launch (mxrl.kernels.rowwise.rope, the same bytes). `rowwise`
    TRITON (set by `apply_plan` as for the norms): the trainer's fused forward and backward
    (mxrl.kernels.rope_train, the eager ops' bytes and their autograd's)."""

    def __init__(self) -> None:
        super().__init__()
        self.rowwise = Backend.REFERENCE

    def forward(
        self,
        q_BNSD: torch.Tensor,
        k_BKSD: torch.Tensor,
        cos_BSD: torch.Tensor,
        sin_BSD: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.rowwise is Backend.TRITON:
            return rope_train(q_BNSD, k_BKSD, cos_BSD, sin_BSD)
        return rope_reference(q_BNSD, k_BKSD, cos_BSD, sin_BSD)


class Attention(nn.Module):
    """Grouped-query attention through `F.scaled_dot_product_attention`; under the engine's
    forward context (mxrl.models.context) the context's ragged attention instead."""

    def __init__(self, config: ModelConfig, layer_idx: int, *, dtype: torch.dtype) -> None:
        super().__init__()
        c = config
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = (
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
        )
        q_dim, kv_dim = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, q_dim, bias=c.qkv_bias, dtype=dtype)
        self.k_proj = nn.Linear(c.hidden_size, kv_dim, bias=c.qkv_bias, dtype=dtype)
        self.v_proj = nn.Linear(c.hidden_size, kv_dim, bias=c.qkv_bias, dtype=dtype)
        self.o_proj = nn.Linear(q_dim, c.hidden_size, bias=c.o_bias, dtype=dtype)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype=dtype) if c.qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype=dtype) if c.qk_norm else None
        self.rope = ApplyRope()
        # recipe `kv_cache: fp8` (set by `apply_plan`): attend to the keys and values the
        # engine's FP8 cache gives back (mxrl.nn.kv_quant)
        self.kv_fp8 = False

    def forward(self, x_BSH: torch.Tensor, inputs: LayerInputs) -> torch.Tensor:
        """Attention of the S new tokens [B, S, H] (`LayerInputs`: RoPE, mask, KV cache)."""
        B, S, _ = x_BSH.shape
        q = self.q_proj(x_BSH).view(B, S, self.num_heads, self.head_dim)
        k = self.k_proj(x_BSH).view(B, S, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x_BSH).view(B, S, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = self.rope(q, k, *inputs.rope)
        ctx = get_forward_context()
        if self.kv_fp8 and ctx is None:  # (the engine quantizes them as it writes its cache)
            k, v = fake_quant_kv(_as_attended(k)), fake_quant_kv(_as_attended(v))
        if ctx is not None:  # the engine's ragged batch: [1, T] tokens of many requests
            if B != 1:
                raise ValueError(f"under a forward context the batch is one ragged row, got B={B}")
            out = ctx.attention(self.layer_idx, q[0], k[0], v[0])  # [N, T, D]
            return self.o_proj(out.transpose(0, 1).reshape(1, S, -1))
        if inputs.kv_cache is not None:
            k, v = inputs.kv_cache.update(self.layer_idx, k, v)
        out = attend(q, k, v, inputs.mask_BSL)
        return self.o_proj(out.transpose(1, 2).reshape(B, S, -1))


def _as_attended(x: torch.Tensor) -> torch.Tensor:
    """`x` in the dtype attention computes in: autocast's, when it is on (SDPA casts to it)."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        return x.to(torch.get_autocast_dtype(device))
    return x


def attend(
    q_BNSD: torch.Tensor,
    k_BKLD: torch.Tensor,
    v_BKLD: torch.Tensor,
    attn_mask_BSL: torch.Tensor | None,
    scale: float | None = None,
) -> torch.Tensor:
    """SDPA of S queries over L keys, [B, N, S, Dv]: the mask as given, else causal with the
    queries the last S of the L positions. scale: None for SDPA's 1/sqrt(D)."""
    S, L = q_BNSD.shape[2], k_BKLD.shape[2]
    is_causal = attn_mask_BSL is None and S == L and S > 1
    if attn_mask_BSL is None and 1 < S < L:
        # SDPA's is_causal aligns top-left; cached prefixes need bottom-right alignment.
        attn_mask_BSL = causal_mask(S, L, device=q_BNSD.device)[None, None]
    return F.scaled_dot_product_attention(
        q_BNSD,
        k_BKLD,
        v_BKLD,
        attn_mask=attn_mask_BSL,
        is_causal=is_causal,
        enable_gqa=True,
        scale=scale,
    )


def causal_mask(q_len: int, kv_len: int, device: torch.device | str | None = None) -> torch.Tensor:
    """bool [q_len, kv_len]: query i (at position kv_len - q_len + i) sees keys 0..that position."""
    offset = kv_len - q_len
    q_pos = torch.arange(q_len, device=device)[:, None] + offset
    return torch.arange(kv_len, device=device)[None, :] <= q_pos


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)). Dense layers and the shared expert."""

    def __init__(self, hidden: int, intermediate: int, *, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(invariant.silu_mul(self.gate_proj(x), self.up_proj(x)))


class TopKSoftmax(nn.Module):
    """The router's selection from its logits: fp32 softmax over the E experts, the k largest
    probabilities (renormalised to sum to 1 if `norm_topk_prob`), cast to the output dtype. No
    parameters (the `gate` projection stays in `SparseMoeBlock`, so checkpoint names do not
    change): a module so that the rollout engine can swap in one fused launch
    (mxrl.kernels.rowwise.moe_route, the same ids, weights within its stated bound)."""

    def __init__(self, num_experts: int, top_k: int, norm_topk_prob: bool) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob

    def forward(
        self, logits_TE: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids [T, k] int64, weights [T, k] in `dtype`), in descending probability."""
        return topk_softmax(logits_TE, self.top_k, self.norm_topk_prob, dtype)

    def extra_repr(self) -> str:
        return f"{self.num_experts}, top_k={self.top_k}, norm_topk_prob={self.norm_topk_prob}"


class RoutedBlock(nn.Module):
    """The MoE block's forward, one for every family: `route`, the routed experts, then the
    family's shared part (`add_shared`). Subclasses hold `experts` and define `route`."""

    def route(
        self, x_TH: torch.Tensor, replay_ids_Tk: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def add_shared(self, x_TH: torch.Tensor, out_TH: torch.Tensor) -> torch.Tensor:
        return out_TH

    def forward(
        self, x_BSH: torch.Tensor, replay_ids_BSk: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(output [B, S, H], chosen expert ids [B, S, k])."""
        B, S, H = x_BSH.shape
        x_TH = x_BSH.reshape(-1, H)
        replay = None if replay_ids_BSk is None else replay_ids_BSk.reshape(B * S, -1)
        ids_Tk, weights_Tk = self.route(x_TH, replay)
        out_TH = self.add_shared(x_TH, self.experts(x_TH, ids_Tk, weights_Tk))
        return out_TH.reshape(B, S, H), ids_Tk.reshape(B, S, -1)


class SparseMoeBlock(RoutedBlock):
    """Softmax top-k router + grouped routed experts (+ Qwen2-MoE shared expert with sigmoid gate)."""

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype) -> None:
        super().__init__()
        c = config
        self.gate = nn.Linear(c.hidden_size, c.num_experts, bias=False, dtype=dtype)
        self.select = TopKSoftmax(c.num_experts, c.num_experts_per_tok, c.norm_topk_prob)
        self.experts = GroupedExperts(
            c.num_experts, c.hidden_size, c.moe_intermediate_size, dtype=dtype
        )
        self.shared_expert: MLP | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if c.shared_expert_intermediate_size > 0:
            self.shared_expert = MLP(c.hidden_size, c.shared_expert_intermediate_size, dtype=dtype)
            self.shared_expert_gate = nn.Linear(c.hidden_size, 1, bias=False, dtype=dtype)

    def route(
        self, x_TH: torch.Tensor, replay_ids_Tk: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(topk_ids [T, k] int64, topk_weights [T, k] in x's dtype).

        With `replay_ids_Tk` (routing replay) those experts are used, and their weights are
        the current router's probabilities at those ids, renormalised the same way.
        """
        logits_TE = self.gate(x_TH)
        if replay_ids_Tk is None:
            return self.select(logits_TE, x_TH.dtype)
        probs_TE = F.softmax(logits_TE, dim=-1, dtype=torch.float32)
        ids_Tk = replay_ids_Tk.to(device=x_TH.device, dtype=torch.int64)
        weights_Tk = probs_TE.gather(-1, ids_Tk)
        if self.select.norm_topk_prob:
            weights_Tk = weights_Tk / weights_Tk.sum(dim=-1, keepdim=True)
        return ids_Tk, weights_Tk.to(x_TH.dtype)

    def add_shared(self, x_TH: torch.Tensor, out_TH: torch.Tensor) -> torch.Tensor:
        """Qwen2-MoE's gated shared expert (none for Qwen3-MoE)."""
        if self.shared_expert is None:
            return out_TH
        gate_T1 = invariant.sigmoid(self.shared_expert_gate(x_TH))
        return out_TH + gate_T1 * self.shared_expert(x_TH)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, *, dtype: torch.dtype) -> None:
        super().__init__()
        c = config
        self.layer_idx = layer_idx
        self.is_moe = layer_idx in c.moe_layers
        from mxrl.models.mla import DeepseekMoE, MLAttention  # which imports this file

        self.self_attn: Attention | MLAttention = (
            MLAttention(c, layer_idx, dtype=dtype)
            if c.is_mla
            else Attention(c, layer_idx, dtype=dtype)
        )
        self.mlp: MLP | SparseMoeBlock | DeepseekMoE
        if not self.is_moe:
            self.mlp = MLP(c.hidden_size, c.intermediate_size, dtype=dtype)
        elif c.scoring_func == "sigmoid":
            self.mlp = DeepseekMoE(c, dtype=dtype)
        else:
            self.mlp = SparseMoeBlock(c, dtype=dtype)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype=dtype)

    def forward(
        self, x_BSH: torch.Tensor, inputs: LayerInputs, replay_ids_BSk: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(hidden [B, S, H], expert ids [B, S, k] or None for a dense layer)."""
        h = x_BSH + self.self_attn(self.input_layernorm(x_BSH), inputs)
        if self.is_moe:
            mlp_out, ids = self.mlp(self.post_attention_layernorm(h), replay_ids_BSk)
            return h + mlp_out, ids
        return h + self.mlp(self.post_attention_layernorm(h)), None
