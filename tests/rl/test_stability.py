"""GradSpikeDetector, layer_grad_norms and top_growth."""

import json
import math
import random

import pytest
import torch

from mxrl.rl import GradSpikeDetector, layer_grad_norms, top_growth


def _steady(n, seed=0):
    rng = random.Random(seed)
    return [1.0 * math.exp(rng.gauss(0.0, 0.05)) for _ in range(n)]


def test_no_spike_on_a_steady_series():
    det = GradSpikeDetector()
    decisions = [det.update(g) for g in _steady(300)]
    assert not any(d.spike for d in decisions) and det.num_spikes == 0


def test_a_100x_jump_is_a_spike_and_logged_only_by_default():
    det = GradSpikeDetector()
    for g in _steady(20):
        det.update(g)
    d = det.update(100.0)
    assert d.spike and d.z > det.z_threshold and not d.skip
    assert d.as_dict() == {"grad/spike": 1.0, "grad/z": d.z, "grad/skipped": 0.0}
    assert not det.update(1.0).spike  # one outlier does not move the median


def test_skip_action():
    det = GradSpikeDetector(action="skip")
    for g in _steady(20):
        det.update(g)
    assert det.update(100.0).skip and det.num_skipped == 1
    assert not det.update(1.02).skip


def test_min_history_and_constant_series():
    det = GradSpikeDetector(min_history=10)
    for _ in range(9):
        assert not det.update(1.0).spike
    assert not det.update(1e6).spike  # 10th value: still warming up
    det = GradSpikeDetector()
    for _ in range(20):
        det.update(2.0)  # MAD = 0: the min_scale floor keeps small moves quiet
    assert not det.update(2.02).spike
    assert det.update(4.0).spike


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_norm_is_a_spike_and_skipped(bad):
    det = GradSpikeDetector(action="log")
    d = det.update(bad)  # even before min_history
    assert d.spike and d.skip and math.isinf(d.z)
    assert det.state_dict()["history"] == []  # never enters the statistics
    d = det.update(torch.tensor(bad))
    assert d.spike


def test_state_round_trip_resumes_the_same_decisions():
    series = [*_steady(30), 50.0, *_steady(10, seed=1), 80.0]
    a = GradSpikeDetector(action="skip")
    for g in series[:25]:
        a.update(g)
    state = json.loads(json.dumps(a.state_dict()))  # checkpoints may store it as JSON
    b = GradSpikeDetector(action="skip")
    b.load_state_dict(state)
    for g in series[25:]:
        assert a.update(g) == b.update(g)
    assert a.state_dict() == b.state_dict() and b.num_spikes == 2


def test_detector_validates_its_config():
    with pytest.raises(ValueError, match="action"):
        GradSpikeDetector(action="clip")
    with pytest.raises(ValueError, match="min_history"):
        GradSpikeDetector(window=5, min_history=10)


class _Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.input_layernorm = torch.nn.LayerNorm(8)
        self.mlp = torch.nn.Linear(8, 8)

    def forward(self, x):
        return x + self.mlp(self.input_layernorm(x))


class _Body(torch.nn.Module):
    def __init__(self, num_layers):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(16, 8)
        self.layers = torch.nn.ModuleList(_Layer() for _ in range(num_layers))
        self.norm = torch.nn.LayerNorm(8)


class _TinyLM(torch.nn.Module):
    """The parameter names of mxrl.models.CausalLM (model.layers.{i}..., lm_head), small."""

    def __init__(self, num_layers=3):
        super().__init__()
        self.model = _Body(num_layers)
        self.lm_head = torch.nn.Linear(8, 16, bias=False)

    def forward(self, ids):
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = layer(x)
        return self.lm_head(self.model.norm(x))


def test_layer_grad_norms_groups_by_decoder_layer():
    torch.manual_seed(0)
    model = _TinyLM()
    model(torch.randint(0, 16, (2, 5))).logsumexp(-1).mean().backward()
    norms = layer_grad_norms(model)
    assert set(norms) == {"embed", "lm_head", "norm", "layer.0", "layer.1", "layer.2"}
    expect = math.sqrt(
        sum(
            float(p.grad.pow(2).sum())
            for n, p in model.named_parameters()
            if ".layers.1." in n and p.grad is not None
        )
    )
    assert norms["layer.1"] == pytest.approx(expect, rel=1e-5)
    model.zero_grad(set_to_none=True)
    assert layer_grad_norms(model) == {}


def test_top_growth_names_the_layers_that_grew_most():
    prev = {"layer.0": 1.0, "layer.1": 2.0, "layer.2": 1.0, "embed": 0.0, "norm": 1.0}
    cur = {"layer.0": 1.1, "layer.1": 40.0, "layer.2": float("nan"), "embed": 0.5, "new": 9.0}
    top = top_growth(cur, prev, k=3)
    assert [name for name, _ in top] == ["layer.2", "embed", "layer.1"]
    assert top[2][1] == pytest.approx(20.0)
    assert top_growth(cur, prev, k=10)[-1] == ("layer.0", pytest.approx(1.1))
