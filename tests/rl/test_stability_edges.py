"""Edge cases of mxrl/rl/stability.py that its mutation run (docs/mutation/rl.stability.md) found
untested: the defaults and bounds of GradSpikeDetector's config, a z exactly at the threshold,
the first step after min_history, norms below 1, the window's bound on the history (also after a
resume), the counters, gradients sharded over ranks (a DTensor's local shard, a sum over ranks),
a parameter without a gradient before others, the "other" group, and top_growth's 0 -> 0 and
default k. Every expectation is worked out by hand from the module docstring's rule
(z = (log g - median) / max(1.4826 * MAD, min_scale); a spike when z > z_threshold)."""

from __future__ import annotations

import math

import pytest
import torch

from mxrl.rl import GradSpikeDetector, layer_grad_norms, top_growth
from mxrl.rl.stability import layer_group


def _fed(det: GradSpikeDetector, norms) -> GradSpikeDetector:
    for g in norms:
        det.update(g)
    return det


# --- GradSpikeDetector: its config -------------------------------------------------------------


def test_the_config_accepts_its_bounds_and_refuses_past_them():
    GradSpikeDetector(window=2, min_history=1)  # the smallest window, the smallest history
    GradSpikeDetector(window=2, min_history=2)  # min_history may be the whole window
    GradSpikeDetector(z_threshold=0.5, min_scale=1e-6)  # any positive threshold and floor
    for bad in ({"window": 1, "min_history": 1}, {"min_history": 0}, {"z_threshold": 0.0},
                {"min_scale": 0.0}):  # fmt: skip
        with pytest.raises(ValueError):
            GradSpikeDetector(**bad)


def test_the_defaults_are_the_docstring_s():
    # min_history 10: the 11th value is the first one scored
    det = _fed(GradSpikeDetector(), [1.0] * 10)
    assert det.update(100.0).spike
    # z_threshold 6 with min_scale 0.05: "a jump needs exp(6 * 0.05) = 1.35x over the median"
    # (a constant history: MAD = 0, so the scale is the floor 0.05)
    assert _fed(GradSpikeDetector(), [1.0] * 20).update(1.38).spike  # z = log(1.38) / 0.05 = 6.4
    assert not _fed(GradSpikeDetector(), [1.0] * 20).update(1.34).spike  # z = 5.9
    # window 50: the history keeps the last 50 values
    assert len(_fed(GradSpikeDetector(), [1.0] * 60).state_dict()["history"]) == 50


# --- GradSpikeDetector: the rule ---------------------------------------------------------------


def test_the_first_value_after_min_history_is_scored():
    det = _fed(GradSpikeDetector(min_history=3), [1.0, 1.0, 1.0])
    d = det.update(math.e)  # x = 1 over a history of log 1 = 0: z = 1 / min_scale = 20
    assert d.spike and d.z == pytest.approx(20.0)


def test_z_is_zero_while_warming_up():
    det = GradSpikeDetector(min_history=3)
    assert [det.update(g).z for g in (1.0, 5.0, 0.2)] == [0.0, 0.0, 0.0]


def test_z_exactly_at_the_threshold_is_not_a_spike():
    # history log 1 = 0 (MAD 0): z = x / min_scale, with min_scale = x / 2 exactly 2.0
    x = math.log(3.0)
    det = _fed(GradSpikeDetector(z_threshold=2.0, min_history=2, min_scale=x / 2), [1.0, 1.0])
    d = det.update(3.0)
    assert d.z == 2.0 and not d.spike


def test_z_is_the_robust_score_of_the_log_norm():
    # log norms 0, 0.2, 0.4, 0.6, 0.8: median 0.4, |x - median| = 0.4 0.2 0 0.2 0.4, MAD 0.2
    history = [math.exp(0.2 * i) for i in range(5)]
    det = _fed(GradSpikeDetector(min_history=5, window=5), history)
    d = det.update(math.exp(2.0))
    assert d.z == pytest.approx((2.0 - 0.4) / (1.4826 * 0.2), rel=1e-9)


def test_norms_below_one_keep_their_log():
    # log(0.01) joins the history, not log(1): a norm at 0.01 then looks steady, and 1.0
    # (100x) is a spike
    det = _fed(GradSpikeDetector(min_history=3), [0.01, 0.01, 0.01])
    assert det.state_dict()["history"] == pytest.approx([math.log(0.01)] * 3)
    assert not det.update(0.01).spike
    assert det.update(1.0).spike
    # a zero norm is floored at 1e-30 before the log (no log(0) error)
    det = GradSpikeDetector()
    assert det.update(0.0).z == 0.0
    assert det.state_dict()["history"] == pytest.approx([math.log(1e-30)])


def test_the_counters_count_every_update_spike_and_skip():
    det = _fed(GradSpikeDetector(min_history=2, action="skip"), [1.0, 1.0])
    assert det.num_updates == 2
    for g in (100.0, float("nan"), 1.0, float("inf"), 200.0):
        det.update(g)
    # 100 and 200 are spikes and skipped (action skip); NaN and Inf always are; 1.0 is not
    assert (det.num_updates, det.num_spikes, det.num_skipped) == (7, 4, 4)
    det = _fed(GradSpikeDetector(min_history=2), [1.0, 1.0, 100.0, 100.0, float("nan")])
    assert (det.num_updates, det.num_spikes, det.num_skipped) == (5, 3, 1)  # log: NaN skipped


# --- GradSpikeDetector: its state --------------------------------------------------------------


def test_the_state_records_its_window_and_the_history_stays_bounded():
    det = _fed(GradSpikeDetector(window=3, min_history=1), [1.0, 2.0, 4.0, 8.0])
    state = det.state_dict()
    assert state["window"] == 3
    assert state["history"] == pytest.approx([math.log(2.0), math.log(4.0), math.log(8.0)])


def test_a_resume_with_a_smaller_window_keeps_the_newest_and_stays_bounded():
    state = _fed(GradSpikeDetector(window=5, min_history=1), [1.0, 2.0, 4.0, 8.0, 16.0])
    small = GradSpikeDetector(window=3, min_history=1)
    small.load_state_dict(state.state_dict())
    logs = [math.log(v) for v in (4.0, 8.0, 16.0)]
    assert small.state_dict()["history"] == pytest.approx(logs)
    small.update(32.0)  # still at most 3: the oldest leaves
    assert small.state_dict()["history"] == pytest.approx([*logs[1:], math.log(32.0)])
    same = GradSpikeDetector(window=5, min_history=1)
    same.load_state_dict(state.state_dict())
    same.update(32.0)
    assert len(same.state_dict()["history"]) == 5


def test_a_state_without_its_counters_is_refused():
    state = GradSpikeDetector().state_dict()
    del state["num_spikes"]
    with pytest.raises(ValueError, match="num_spikes"):
        GradSpikeDetector().load_state_dict(state)


# --- layer_grad_norms, layer_group ---------------------------------------------------------------


class _Params:
    """Only what layer_grad_norms reads of a model: named_parameters()."""

    def __init__(self, named):
        self.named = named

    def named_parameters(self):
        return iter(self.named)


def _param(grad):
    p = torch.nn.Parameter(torch.zeros(len(grad)))
    p.grad = grad if isinstance(grad, torch.Tensor) else torch.tensor(grad)
    return p


def test_a_parameter_without_a_gradient_is_skipped_not_the_end():
    frozen = torch.nn.Parameter(torch.zeros(2))  # no .grad
    model = _Params([
        ("model.embed_tokens.weight", frozen),
        ("model.layers.0.mlp.weight", _param([3.0, 4.0])),
        ("model.layers.0.mlp.bias", _param([12.0])),
        ("lm_head.weight", _param([6.0, 8.0])),
    ])  # fmt: skip
    assert layer_grad_norms(model) == {"layer.0": 13.0, "lm_head": 10.0}


class _Shard(torch.Tensor):
    """A gradient that, like a DTensor, gives this rank's part with to_local(): here its
    first element."""

    def to_local(self):
        return torch.Tensor._make_subclass(torch.Tensor, self)[:1].clone()


def test_a_sharded_gradient_counts_its_local_shard():
    grad = torch.Tensor._make_subclass(_Shard, torch.tensor([3.0, 4.0]))
    model = _Params([("model.norm.weight", _param(grad))])
    assert layer_grad_norms(model) == {"norm": 3.0}  # the shard [3], not the whole [3, 4]


class _Ranks:
    def __init__(self, size, other):
        self.size, self.other = size, other

    def sum(self, t):
        if self.size == 1:
            raise AssertionError("one rank: nothing to reduce")
        return t + torch.tensor(self.other)


def test_the_squares_are_summed_over_ranks_before_the_root():
    model = _Params([("model.layers.0.w", _param([3.0])), ("lm_head.weight", _param([6.0]))])
    # the other rank's squares: 16 for layer.0, 64 for lm_head
    assert layer_grad_norms(model, _Ranks(2, [16.0, 64.0])) == {"layer.0": 5.0, "lm_head": 10.0}
    assert layer_grad_norms(model, _Ranks(1, [0.0, 0.0])) == {"layer.0": 3.0, "lm_head": 6.0}


def test_a_name_of_no_group_is_other():
    assert layer_group("model.rotary_emb.inv_freq") == "other"
    assert layer_group("score.weight") == "other"
    assert layer_group("model.layers.12.self_attn.q_proj.weight") == "layer.12"
    assert layer_group("model.norm.weight") == "norm"


# --- top_growth ----------------------------------------------------------------------------------


def test_top_growth_of_zero_to_zero_is_one_and_zero_to_more_is_inf():
    prev = {"a": 0.0, "b": 0.0, "c": 2.0}
    cur = {"a": 0.0, "b": 0.5, "c": 3.0}
    assert top_growth(cur, prev) == [("b", math.inf), ("c", 1.5), ("a", 1.0)]


def test_top_growth_skips_new_groups_and_keeps_five_by_default():
    prev = {f"layer.{i}": 1.0 for i in range(7)}
    cur = {"new": 100.0, **{f"layer.{i}": float(i + 1) for i in range(7)}}  # new comes first
    top = top_growth(cur, prev)
    assert top == [(f"layer.{i}", float(i + 1)) for i in (6, 5, 4, 3, 2)]
