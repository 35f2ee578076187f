"""The edges of routing replay, with hand-worked routers: a Qwen router and a DeepSeek sigmoid
router whose gate weights are set so that a one-hot token's probabilities are simple fractions,
replayed experts taken as given (ids of another dtype, experts the router would not choose),
the block's [B, S, k] <-> [T, k] reshapes on a stand-in block, a decoder layer composed by hand
from its parts, replay lists indexed by MoE layer past a dense one, and the layers recomputed
only when checkpointing, training and gradients are all on."""

from __future__ import annotations

import math

import pytest
import torch

from mxrl.arch import builtin_config
from mxrl.models import build_model
from mxrl.models.layers import DecoderLayer, LayerInputs, RoutedBlock
from tests.models.configs import CONFIGS
from tests.models.deepseek_reference import CONFIGS as DEEPSEEK


def qwen_block(norm: bool, dtype=torch.float32):
    """The first MoE block of a tiny Qwen3-MoE (8 experts, top 2), its gate set so that hidden
    unit 0 gives expert j the logit log(j + 1): a one-hot token routes with probabilities
    (j + 1) / 36, a zero token with 1/8 each."""
    config = {**CONFIGS["qwen3_moe-norm-dense1"], "norm_topk_prob": norm}
    block = build_model(config, seed=0, dtype=dtype).model.layers[0].mlp
    with torch.no_grad():
        block.gate.weight.zero_()
        block.gate.weight[:, 0] = torch.log(torch.arange(1.0, 9.0))
    return block


def tokens(dtype=torch.float32) -> torch.Tensor:
    x = torch.zeros(2, 64, dtype=dtype)
    x[0, 0] = 1.0  # probabilities 1/36 .. 8/36; the second token: uniform
    return x


def test_replayed_experts_are_weighted_by_this_routers_renormalised_probabilities():
    block = qwen_block(norm=True)
    replay = torch.tensor([[7, 2], [0, 5]], dtype=torch.int32)
    ids, weights = block.route(tokens(), replay)
    assert ids.dtype == torch.int64 and ids.tolist() == [[7, 2], [0, 5]]
    want = torch.tensor([[8 / 11, 3 / 11], [0.5, 0.5]])
    torch.testing.assert_close(weights, want, rtol=1e-6, atol=0)
    assert weights.dtype == torch.float32


def test_replayed_experts_keep_the_raw_probabilities_without_norm_topk_prob():
    block = qwen_block(norm=False)
    ids, weights = block.route(tokens(), torch.tensor([[7, 2], [0, 5]]))
    assert ids.tolist() == [[7, 2], [0, 5]]
    want = torch.tensor([[8 / 36, 3 / 36], [1 / 8, 1 / 8]])
    torch.testing.assert_close(weights, want, rtol=1e-6, atol=0)


def test_free_routing_takes_the_two_most_probable_experts():
    ids, weights = qwen_block(norm=True).route(tokens()[:1])
    assert ids.tolist() == [[7, 6]]
    torch.testing.assert_close(weights, torch.tensor([[8 / 15, 7 / 15]]), rtol=1e-6, atol=0)


def test_replayed_weights_take_the_tokens_dtype_and_the_router_learns_through_them():
    block = qwen_block(norm=False, dtype=torch.bfloat16)
    ids, weights = block.route(tokens(torch.bfloat16), torch.tensor([[7, 2], [0, 5]]))
    assert weights.dtype == torch.bfloat16 and ids.tolist() == [[7, 2], [0, 5]]
    # the gate's logits rounded to bf16: log 8 and log 3 within 2^-8 relative
    torch.testing.assert_close(
        weights.float(), torch.tensor([[8 / 36, 3 / 36], [1 / 8, 1 / 8]]), rtol=2e-2, atol=0
    )
    block = qwen_block(norm=False)
    _, weights = block.route(tokens()[:1], torch.tensor([[7, 2]]))
    weights.sum().backward()
    # d(p7 + p2)/d logit_j = p_j (1[j in {7, 2}] - (p7 + p2)), times hidden unit 0 (= 1)
    p = torch.arange(1.0, 9.0) / 36
    chosen = torch.zeros(8)
    chosen[[7, 2]] = 1.0
    want = p * (chosen - 11 / 36)
    torch.testing.assert_close(block.gate.weight.grad[:, 0], want, rtol=1e-5, atol=1e-7)
    assert torch.count_nonzero(block.gate.weight.grad[:, 1:]) == 0


def test_bf16_replayed_weights_are_the_exact_renormalised_probabilities_rounded_once():
    """bf16 tokens and gate: the probabilities in fp32 (then renormalised and rounded to bf16
    once) are the float64 ones of the gate's bf16 logits, rounded once; a softmax in bf16 would
    round each probability first and the quotient again."""
    block = qwen_block(norm=True, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 64, generator=g).to(torch.bfloat16)
    first = torch.randint(0, 8, (64,), generator=g)
    ids = torch.stack([first, (first + 1 + torch.randint(0, 7, (64,), generator=g)) % 8], -1)
    with torch.no_grad():
        p = torch.softmax(block.gate(x).double(), -1).gather(-1, ids)
        _, weights = block.route(x, ids)
        _, free = block.route(x)
    assert torch.equal(weights, (p / p.sum(-1, keepdim=True)).to(torch.bfloat16))
    assert free.dtype == torch.bfloat16  # free routing's weights too


class Stand(RoutedBlock):
    """A block whose route and experts are written out: route records the [T, H] tokens and the
    [T, k] replay it is given; expert output = x * 10 + sum of ids * weights."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list = []
        self.experts = lambda x, ids, w: x * 10 + (ids * w).sum(-1, keepdim=True)

    def route(self, x_TH, replay_ids_Tk=None):
        self.seen.append((x_TH.clone(), replay_ids_Tk))
        ids = replay_ids_Tk if replay_ids_Tk is not None else torch.zeros(x_TH.shape[0], 2)
        return ids.long(), torch.full(ids.shape, 0.5)


def test_a_block_routes_tokens_batch_major_and_hands_back_ids_per_position():
    block = Stand()
    x = torch.arange(2 * 3 * 1.0).reshape(2, 3, 1)  # token t = b * 3 + s holds t
    replay = torch.tensor([[[1, 2], [3, 4], [5, 6]], [[7, 8], [9, 10], [11, 12]]])
    out, ids = block(x, replay)
    tokens_seen, replay_seen = block.seen[0]
    assert tokens_seen.reshape(-1).tolist() == [0, 1, 2, 3, 4, 5]
    assert replay_seen.tolist() == [[1, 2], [3, 4], [5, 6], [7, 8], [9, 10], [11, 12]]
    assert ids.tolist() == replay.tolist()
    # token t: 10 t + (a + b) / 2 for its replayed experts a, b
    assert out.reshape(-1).tolist() == [1.5, 13.5, 25.5, 37.5, 49.5, 61.5]
    _, free = block(x)
    assert block.seen[1][1] is None and free.shape == (2, 3, 2)


def test_a_moe_layer_is_attention_then_the_replayed_block_each_with_its_residual():
    model = build_model(CONFIGS["qwen3_moe-norm-dense1"], seed=3)
    x = torch.randn(1, 4, 64, generator=torch.Generator().manual_seed(1))
    inputs = LayerInputs(model.model.rotary_emb(torch.arange(4)[None], x.dtype), None, None)
    replay = torch.tensor([[[0, 1], [2, 3], [4, 5], [6, 7]]])
    moe, dense = model.model.layers[0], model.model.layers[1]
    with torch.no_grad():
        out, ids = moe(x, inputs, replay)
        h = x + moe.self_attn(moe.input_layernorm(x), inputs)
        mlp_out, _ = moe.mlp(moe.post_attention_layernorm(h), replay)
        assert torch.equal(out, h + mlp_out) and torch.equal(ids, replay)
        out, ids = dense(x, inputs, replay)  # a dense layer has no routing to replay
        h = x + dense.self_attn(dense.input_layernorm(x), inputs)
        assert torch.equal(out, h + dense.mlp(dense.post_attention_layernorm(h))) and ids is None


def deepseek_block():
    """The first MoE block of a tiny DeepSeek-V3 (layer 1; 8 experts, top 2, norm_topk_prob,
    scaling 2.5), its gate set so that a one-hot token scores experts 0, 1, 2 at sigmoid(0),
    sigmoid(log 3), sigmoid(-log 3) = 1/2, 3/4, 1/4 (the others 1/2)."""
    model = build_model(DEEPSEEK["qlora-grouped-shared1"], seed=0)
    block = model.model.layers[1].mlp
    with torch.no_grad():
        block.gate.weight.zero_()
        block.gate.weight[1, 0], block.gate.weight[2, 0] = math.log(3), -math.log(3)
        # the correction bias chooses, never weighs: it would pick experts 6 and 7
        block.gate.e_score_correction_bias[6:] = 10.0
    return block


def test_deepseek_replay_weighs_the_given_experts_by_unbiased_scores_renormalised_and_scaled():
    block = deepseek_block()
    assert block.gate.norm_topk_prob and block.gate.scaling == 2.5
    x = torch.zeros(1, 64)
    x[0, 0] = 1.0
    ids, weights = block.route(x, torch.tensor([[1, 2]], dtype=torch.int32))
    assert ids.dtype == torch.int64 and ids.tolist() == [[1, 2]]
    # 3/4 and 1/4 renormalised (they sum to 1), times 2.5
    torch.testing.assert_close(weights, torch.tensor([[1.875, 0.625]]), rtol=1e-6, atol=0)
    free, weights = block.route(x)
    assert sorted(free[0].tolist()) == [6, 7]  # the biased choice
    torch.testing.assert_close(weights, torch.tensor([[1.25, 1.25]]), rtol=1e-6, atol=0)


def test_replay_lists_are_indexed_by_moe_layer_past_dense_ones():
    model = build_model(CONFIGS["qwen2_moe-shared"], seed=0)  # layer 0 dense, 1 and 2 MoE
    ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(0))
    first = torch.zeros(2, 5, 2, dtype=torch.long)
    first[..., 1] = 1
    second = torch.full((2, 5, 2), 6, dtype=torch.long)
    second[..., 1] = 7
    with torch.no_grad():
        _, used = model(ids, return_routing=True, replay_routing=[first, second])
    assert len(used) == 2 and torch.equal(used[0], first) and torch.equal(used[1], second)
    with pytest.raises(ValueError, match="replay_routing has 3 tensors; the model has 2 MoE"):
        model(ids, replay_routing=[first, second, second])


@pytest.fixture
def layer_calls(monkeypatch) -> list[int]:
    """One entry (the layer index) per decoder-layer forward, recomputations included."""
    calls: list[int] = []
    forward = DecoderLayer.forward

    def counted(self, *args, **kwargs):
        calls.append(self.layer_idx)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(DecoderLayer, "forward", counted)
    return calls


@pytest.mark.parametrize(
    ("checkpoint", "train", "grad", "recomputed"),
    [(True, True, True, True), (False, True, True, False), (True, False, True, False),
     (True, True, False, False)],
)  # fmt: skip
def test_layers_are_recomputed_only_when_checkpointing_in_training_with_gradients(
    layer_calls, checkpoint, train, grad, recomputed
):
    model = build_model(builtin_config("tiny-moe"), seed=0)
    model.set_training_options(checkpoint_layers=checkpoint)
    model.train(train)
    ids = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.set_grad_enabled(grad):
        logits, routing = model(ids, return_routing=True)
        forced = [(r + 1) % 8 for r in routing]
        layer_calls.clear()
        logits, used = model(ids, return_routing=True, replay_routing=forced)
    assert layer_calls == [0, 1, 2, 3]
    if grad:
        logits.sum().backward()
    assert layer_calls == [0, 1, 2, 3] + ([3, 2, 1, 0] if recomputed else [])
    assert all(torch.equal(u, f) for u, f in zip(used, forced, strict=True))


def test_deepseek_replayed_weights_take_the_tokens_dtype():
    """The sigmoid router's scores are fp32 whatever the tokens' dtype; the weights are cast
    back to it."""
    block = build_model(DEEPSEEK["qlora-grouped-shared1"], seed=0, dtype=torch.bfloat16)
    block = block.model.layers[1].mlp
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    ids, weights = block.route(x, torch.tensor([[0, 1], [2, 3], [4, 5]]))
    assert weights.dtype == torch.bfloat16 and ids.tolist() == [[0, 1], [2, 3], [4, 5]]


def positions_seen(model, ids, **kwargs) -> list[list[int]]:
    """The position ids the rotary embedding is given (a forward pre-hook)."""
    seen = []
    hook = model.model.rotary_emb.register_forward_pre_hook(
        lambda module, args: seen.append(args[0].tolist())
    )
    with torch.no_grad():
        model(ids, **kwargs)
    hook.remove()
    return seen[0]


def test_default_positions_count_the_real_tokens_of_a_left_padded_row():
    """RoPE is relative, so logits cannot tell positions shifted by the padding: the positions
    themselves are held. Row 0 has 2 pad tokens then 3 real ones: 0 0 0 1 2 (pads clamped to
    0); row 1 has no padding: 0 1 2 3 4."""
    model = build_model(CONFIGS["qwen3_moe-norm-dense1"], seed=0)
    ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(0))
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert positions_seen(model, ids, attention_mask=mask) == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]]
    assert positions_seen(model, ids) == [[0, 1, 2, 3, 4]] * 2
    given = torch.tensor([[5, 6, 7, 8, 9]])
    assert positions_seen(model, ids, position_ids=given) == [[5, 6, 7, 8, 9]] * 2


@pytest.mark.gpu
@pytest.mark.parametrize("config", ["tiny-moe", "deepseek"])
def test_on_a_gpu_host_replay_ids_masks_and_default_positions_reach_the_device(config):
    """A replay list on the host (as a rollout's routing may arrive), a padding mask and the
    default positions: each taken to the model's GPU, the forced experts used."""
    cfg = builtin_config("tiny-moe") if config == "tiny-moe" else DEEPSEEK["qlora-grouped-shared1"]
    cuda = torch.device("cuda", torch.cuda.current_device())
    model = build_model(cfg, seed=0).to(cuda)
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(0)).to(cuda)
    with torch.no_grad():
        logits, routing = model(ids, return_routing=True)
        forced = [((r + 1) % 8).cpu() for r in routing]
        replayed, used = model(ids, return_routing=True, replay_routing=forced)
        mask = torch.ones(2, 6, dtype=torch.long, device=cuda)
        mask[0, :2] = 0
        padded = model(ids, attention_mask=mask)
    assert all(
        u.device == cuda and torch.equal(u.cpu(), f) for u, f in zip(used, forced, strict=True)
    )
    assert replayed.device == cuda and not torch.equal(replayed, logits)
    assert padded.device == cuda and torch.isfinite(padded).all()


def test_the_rotary_tables_take_the_hidden_states_dtype():
    model = build_model(builtin_config("tiny-moe"), seed=0, dtype=torch.bfloat16)
    seen = []
    model.model.rotary_emb.register_forward_hook(
        lambda module, args, out: seen.append([t.dtype for t in out])
    )
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))
    assert seen == [[torch.bfloat16, torch.bfloat16]]


def test_a_checkpointed_layer_learns_when_its_input_needs_no_gradient():
    """A frozen embedding: the first layer's input does not require grad. The layer is still
    recomputed in the backward and its weights get the gradients of the model without
    checkpointing, under replay (a reentrant checkpoint would give it none)."""
    ids = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(0))
    grads = {}
    for checkpoint in (False, True):
        model = build_model(builtin_config("tiny-moe"), seed=0)
        model.model.embed_tokens.weight.requires_grad_(False)
        model.set_training_options(checkpoint_layers=checkpoint)
        model.train()
        with torch.no_grad():
            _, routing = model(ids, return_routing=True)
        logits = model(ids, replay_routing=[(r + 1) % 8 for r in routing])
        logits.float().square().mean().backward()
        grads[checkpoint] = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    q0 = "model.layers.0.self_attn.q_proj.weight"
    assert grads[True][q0] is not None and grads[True].keys() == grads[False].keys()
    for name, want in grads[False].items():
        torch.testing.assert_close(grads[True][name], want, rtol=1e-6, atol=1e-9)
