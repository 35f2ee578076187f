"""DeepSeek-V3's layers (transformers' `modeling_deepseek_v3.py`, matched op for op): multi-head
latent attention and the MoE block with the sigmoid, group-limited router.

Legend: B batch, S query length, L key/value length, H hidden size, N heads, T = B*S tokens,
E experts, G expert groups, k experts per token; per head Dn = qk_nope_head_dim, Dr =
qk_rope_head_dim (`config.head_dim`), Dv = v_head_dim, C = kv_lora_rank (the latent).

MLA: q = q_b_proj(q_a_layernorm(q_a_proj(x))) (or q_proj(x)), [B, N, S, Dn + Dr]; the latent
[C | Dr] = kv_a_proj_with_mqa(x), one RoPE key of Dr shared by all heads; kv_b_proj expands
kv_a_layernorm(latent) to each head's [Dn key | Dv value]. Attention runs on the expanded
per-head keys [Dn | Dr] and values, scaled by 1/sqrt(Dn + Dr), times yarn's mscale^2 under YaRN
(`mxrl.models.yarn`). A KV cache given to the trainer's forward, and the rollout engine's paged
cache, store the expanded keys and values, not DeepSeek's latent (docs/models.md has the sizes).
"""

from __future__ import annotations

import torch
from torch import nn

from mxrl.arch.config import ModelConfig
from mxrl.models import yarn
from mxrl.models.context import get_forward_context
from mxrl.models.layers import MLP, LayerInputs, RMSNorm, RoutedBlock, attend
from mxrl.nn import GroupedExperts, invariant

# transformers' DeepseekV3Attention builds q_a_layernorm and kv_a_layernorm with RMSNorm's
# default eps, not config.rms_norm_eps
LATENT_NORM_EPS = 1e-6


def rope_interleaved(
    q_BNSD: torch.Tensor, k_BNSD: torch.Tensor, cos_BSD: torch.Tensor, sin_BSD: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' `apply_rotary_pos_emb_interleave` (`rope_interleave: true`): pairs (x0, x1),
    (x2, x3), ... rotated by one angle each, the output de-interleaved (evens then odds)."""
    half = cos_BSD.shape[-1] // 2
    cos, sin = cos_BSD[..., :half].unsqueeze(1), sin_BSD[..., :half].unsqueeze(1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    return rotate(q_BNSD), rotate(k_BNSD)


class MLAttention(nn.Module):
    """Multi-head latent attention (module docstring). Attribute names are HF's."""

    def __init__(self, config: ModelConfig, layer_idx: int, *, dtype: torch.dtype) -> None:
        super().__init__()
        c = config
        self.layer_idx = layer_idx
        self.num_heads = c.num_attention_heads
        self.nope_dim, self.rope_dim, self.v_dim = c.qk_nope_head_dim, c.head_dim, c.v_head_dim
        self.kv_lora_rank = c.kv_lora_rank
        self.rope_interleave = c.rope_interleave
        qk_dim = self.nope_dim + self.rope_dim
        self.scaling = qk_dim ** (-0.5)  # transformers' float, passed to SDPA as its scale
        if c.rope_scaling:  # YaRN: times mscale(factor, mscale_all_dim)^2
            self.scaling = self.scaling * yarn.softmax_mscale(dict(c.rope_scaling))
        H, N, bias = c.hidden_size, c.num_attention_heads, c.qkv_bias
        self.q_proj: nn.Linear | None = None
        self.q_a_proj: nn.Linear | None = None
        self.q_a_layernorm: RMSNorm | None = None
        self.q_b_proj: nn.Linear | None = None
        if c.q_lora_rank:
            self.q_a_proj = nn.Linear(H, c.q_lora_rank, bias=bias, dtype=dtype)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, LATENT_NORM_EPS, dtype=dtype)
            self.q_b_proj = nn.Linear(c.q_lora_rank, N * qk_dim, bias=False, dtype=dtype)
        else:
            self.q_proj = nn.Linear(H, N * qk_dim, bias=False, dtype=dtype)
        self.kv_a_proj_with_mqa = nn.Linear(
            H, c.kv_lora_rank + self.rope_dim, bias=bias, dtype=dtype
        )
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, LATENT_NORM_EPS, dtype=dtype)
        self.kv_b_proj = nn.Linear(
            c.kv_lora_rank, N * (self.nope_dim + self.v_dim), bias=False, dtype=dtype
        )
        self.o_proj = nn.Linear(N * self.v_dim, H, bias=c.o_bias, dtype=dtype)

    def _query(self, x_BSH: torch.Tensor) -> torch.Tensor:
        if self.q_proj is not None:
            return self.q_proj(x_BSH)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_BSH)))

    def _rope(
        self, q: torch.Tensor, k: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.rope_interleave:
            return rope_interleaved(q, k, *rope)
        from mxrl.kernels.rowwise import rope_reference

        return rope_reference(q, k, *rope)

    def _expand(self, latent_BSC: torch.Tensor, k_rot_B1SD: torch.Tensor):
        """transformers' `expand_kv`: per-head keys [B, N, S, Dn + Dr] and values [B, N, S, Dv]."""
        B, S, _ = latent_BSC.shape
        kv = self.kv_b_proj(latent_BSC).view(B, S, -1, self.nope_dim + self.v_dim).transpose(1, 2)
        k_nope, v = torch.split(kv, [self.nope_dim, self.v_dim], dim=-1)
        k = kv.new_empty(*kv.shape[:-1], self.nope_dim + self.rope_dim)
        k[..., : self.nope_dim].copy_(k_nope)
        k[..., self.nope_dim :].copy_(k_rot_B1SD.expand(-1, k_nope.shape[1], -1, -1))
        return k, v

    def forward(self, x_BSH: torch.Tensor, inputs: LayerInputs) -> torch.Tensor:
        """As `mxrl.models.layers.Attention.forward`; inputs.rope: (cos, sin) [B, S, Dr]."""
        B, S, _ = x_BSH.shape
        q = self._query(x_BSH).view(B, S, -1, self.nope_dim + self.rope_dim).transpose(1, 2)
        q_pass, q_rot = torch.split(q, [self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rot = torch.split(
            self.kv_a_proj_with_mqa(x_BSH), [self.kv_lora_rank, self.rope_dim], dim=-1
        )
        latent = self.kv_a_layernorm(latent)
        k_rot = k_rot.view(B, 1, S, self.rope_dim)
        q_rot, k_rot = self._rope(q_rot, k_rot, inputs.rope)
        q = torch.cat((q_pass, q_rot), dim=-1)
        k, v = self._expand(latent, k_rot)
        ctx = get_forward_context()
        if ctx is not None:  # the engine's ragged batch: it caches the expanded keys and values
            if B != 1:
                raise ValueError(f"under a forward context the batch is one ragged row, got B={B}")
            out = ctx.attention(self.layer_idx, q[0], k[0], v[0], scale=self.scaling)  # [N, T, Dv]
            return self.o_proj(out.transpose(0, 1).reshape(1, S, -1))
        if inputs.kv_cache is not None:
            k, v = inputs.kv_cache.update(self.layer_idx, k, v)
        out = attend(q, k, v, inputs.mask_BSL, scale=self.scaling)
        return self.o_proj(out.transpose(1, 2).reshape(B, S, -1))


class GroupLimitedRouting:
    """The selection and weights of transformers' `DeepseekV3TopkRouter` from its fp32 sigmoid
    scores, for the trainer's `SigmoidRouter` and the engine's rollout router: scores +
    e_score_correction_bias choose (the topk_group groups with the largest sum of their two
    best biased scores, then the k best biased scores in them); the weights are the unbiased
    scores of the chosen experts, renormalised if norm_topk_prob, times routed_scaling_factor."""

    num_experts: int
    top_k: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    scaling: float
    e_score_correction_bias: torch.Tensor

    def _routing(self, c: ModelConfig) -> None:
        self.num_experts, self.top_k = c.num_experts, c.num_experts_per_tok
        self.n_group, self.topk_group = c.n_group, c.topk_group
        self.norm_topk_prob, self.scaling = c.norm_topk_prob, c.routed_scaling_factor

    def select(self, scores_TE: torch.Tensor) -> torch.Tensor:
        """The chosen experts [T, k] (transformers' order: topk unsorted)."""
        G, E = self.n_group, self.num_experts
        choice = scores_TE + self.e_score_correction_bias.float()
        group_scores = choice.view(-1, G, E // G).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores)
        group_mask.scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(-1, G, E // G).reshape(-1, E)
        choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
        return torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]

    def weights(self, scores_TE: torch.Tensor, ids_Tk: torch.Tensor) -> torch.Tensor:
        w = scores_TE.gather(1, ids_Tk)
        if self.norm_topk_prob:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return w * self.scaling

    def routing_repr(self) -> str:
        return (
            f"{self.num_experts}, top_k={self.top_k}, n_group={self.n_group}, "
            f"topk_group={self.topk_group}, norm_topk_prob={self.norm_topk_prob}, "
            f"routed_scaling_factor={self.scaling}"
        )


class SigmoidRouter(GroupLimitedRouting, nn.Module):
    """transformers' `DeepseekV3TopkRouter` (`GroupLimitedRouting`), its scores in fp32 whatever
    the autocast.

    e_score_correction_bias is a parameter (so that loading, plans and weight sync carry it)
    without a gradient, created in fp32 whatever the model dtype and never quantized (a
    recipe cannot name it: `mxrl.arch.is_matmul_weight`)."""

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype) -> None:
        super().__init__()
        c = config
        self._routing(c)
        self.weight = nn.Parameter(torch.empty(c.num_experts, c.hidden_size, dtype=dtype))
        self.e_score_correction_bias = nn.Parameter(
            torch.zeros(c.num_experts, dtype=torch.float32), requires_grad=False
        )

    def scores(self, x_TH: torch.Tensor) -> torch.Tensor:
        """sigmoid(x W^T) in fp32, [T, E]."""
        with torch.autocast(x_TH.device.type, enabled=False):
            logits = nn.functional.linear(x_TH.float(), self.weight.float())
        return invariant.sigmoid(logits)

    def extra_repr(self) -> str:
        return self.routing_repr()


class DeepseekMoE(RoutedBlock):
    """Sigmoid router + grouped routed experts + the shared experts (one SwiGLU, no gate):
    out = experts(x) + shared_experts(x), as transformers' `DeepseekV3MoE`."""

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype) -> None:
        super().__init__()
        c = config
        self.gate = SigmoidRouter(c, dtype=dtype)
        self.experts = GroupedExperts(
            c.num_experts, c.hidden_size, c.moe_intermediate_size, dtype=dtype
        )
        # zero wide (adds 0) for n_shared_experts 0, as transformers builds it: the same names
        self.shared_experts = MLP(c.hidden_size, c.shared_expert_intermediate_size, dtype=dtype)

    def route(
        self, x_TH: torch.Tensor, replay_ids_Tk: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(topk_ids [T, k] int64, topk_weights [T, k] in x's dtype). With `replay_ids_Tk`
        (routing replay) those experts, weighted by this router's scores at them (renormalised
        and scaled the same way), as `SparseMoeBlock.route`."""
        scores_TE = self.gate.scores(x_TH)
        if replay_ids_Tk is None:
            ids_Tk = self.gate.select(scores_TE)
        else:
            ids_Tk = replay_ids_Tk.to(device=x_TH.device, dtype=torch.int64)
        return ids_Tk, self.gate.weights(scores_TE, ids_Tk).to(x_TH.dtype)

    def add_shared(self, x_TH: torch.Tensor, out_TH: torch.Tensor) -> torch.Tensor:
        """DeepSeek's shared experts, ungated."""
        return out_TH + self.shared_experts(x_TH)
