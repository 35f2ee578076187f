"""Routing replay under training: with activation checkpointing (each decoder layer recomputed in
the backward) the replayed experts are the ones the forward and its recomputation use, so the
gradients are those of a model whose routing is forced by other means, and not those of free
routing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mxrl.arch import builtin_config
from mxrl.models import build_model
from mxrl.models.layers import DecoderLayer, SparseMoeBlock
from mxrl.nn import apply_plan
from mxrl.recipe import resolve

CONFIG = builtin_config("tiny-moe")
IDS = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))


def _model(preset: str, checkpoint: bool):
    model = build_model(CONFIG, seed=0)
    if preset != "bf16":
        apply_plan(model, resolve(preset, {n: p.shape for n, p in model.named_parameters()}))
    model.set_training_options(checkpoint_layers=checkpoint)
    return model.train()


def _force(model, routing: list[torch.Tensor]) -> None:
    """Each MoE block routes to `routing`'s experts, weighted by its own router's softmax at
    those experts, renormalised (norm_topk_prob): replay as documented, written out here in
    place of the model's route."""
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    assert len(blocks) == len(routing)
    for block, ids_BSk in zip(blocks, routing, strict=True):
        ids_Tk = ids_BSk.reshape(-1, ids_BSk.shape[-1])

        def route(x_TH, replay=None, block=block, ids=ids_Tk):
            assert replay is None
            probs = F.softmax(block.gate(x_TH), dim=-1, dtype=torch.float32)
            w = probs.gather(-1, ids)
            return ids, (w / w.sum(-1, keepdim=True)).to(x_TH.dtype)

        block.route = route


def _grads(model, **kw) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    """Parameter gradients of a fixed loss, and the routing the forward used."""
    logits, used = model(IDS, return_routing=True, **kw)
    weights = torch.linspace(-1, 1, logits.shape[-1])
    (torch.log_softmax(logits.float(), -1) * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return grads, used


@pytest.fixture
def layer_calls(monkeypatch) -> list[bool]:
    """One entry per decoder-layer forward (module hooks do not see checkpoint recomputation)."""
    calls: list[bool] = []
    forward = DecoderLayer.forward

    def counted(self, *args, **kwargs):
        calls.append(True)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(DecoderLayer, "forward", counted)
    return calls


@pytest.mark.parametrize("preset", ["bf16", "nvfp4-dequantized"])
def test_replayed_routing_is_used_in_the_recomputed_forward(preset, layer_calls):
    with torch.no_grad():
        _, free = _model(preset, checkpoint=False)(IDS, return_routing=True)
    forced = [(r + 3) % CONFIG["num_experts"] for r in free]  # every token's experts change
    layers = CONFIG["num_hidden_layers"]

    layer_calls.clear()
    replayed, used = _grads(_model(preset, checkpoint=True), replay_routing=forced)
    assert len(layer_calls) == 2 * layers  # each layer ran forward and again in the backward
    assert all(torch.equal(u, f) for u, f in zip(used, forced, strict=True))

    reference_model = _model(preset, checkpoint=False)
    _force(reference_model, forced)
    layer_calls.clear()
    reference, _ = _grads(reference_model)
    assert len(layer_calls) == layers
    assert replayed.keys() == reference.keys()
    assert any(".mlp.gate." in n for n in replayed)  # the router learns through the weights
    for name in reference:
        torch.testing.assert_close(replayed[name], reference[name], rtol=1e-6, atol=1e-9)

    free_grads, free_used = _grads(_model(preset, checkpoint=True))
    assert all(torch.equal(u, f) for u, f in zip(free_used, free, strict=True))
    differ = [n for n in reference if not torch.allclose(free_grads[n], reference[n])]
    assert any(".mlp.experts." in n for n in differ) and any(".mlp.gate." in n for n in differ)
