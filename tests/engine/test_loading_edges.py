"""Edges of the engine's verified weight loading (mxrl/engine/loading.py), on a stand-in engine:
`WeightLoading` on a hand-built module tree (an embedding, an MXFP8 attention projection held by
a `RolloutLinear`, a final norm, an fp32 router bias) under a plan resolved for those four
names. No model is built, so each test runs in milliseconds; every expectation is worked out by
hand from the module's docstrings (all or nothing, the step sequence, in-place copies into the
held buffers, new buffers only on a first load or a changed layout)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import mxrl.engine.loading as loading
from mxrl.engine.loading import WeightLoading, _leaves, _same_layout
from mxrl.formats import QTensor
from mxrl.kernels import Backend
from mxrl.nn.experts import GroupedExperts
from mxrl.nn.operands import Form
from mxrl.nn.paths.rollout import RolloutExperts, RolloutLinear
from mxrl.recipe import resolve
from mxrl.weights import VerifiedRecord, WeightRecord, checksum
from mxrl.weights.digest import verified_records

EMBED = "model.embed_tokens.weight"
Q = "model.layers.1.self_attn.q_proj.weight"
NORM = "model.norm.weight"
BIAS = "model.layers.1.mlp.gate.e_score_correction_bias"
QB = "model.layers.1.self_attn.q_proj.bias"
GATE_UP = "model.layers.1.mlp.experts.gate_up_proj"
DOWN = "model.layers.1.mlp.experts.down_proj"
SHAPES = {EMBED: (4, 32), Q: (32, 32), NORM: (32,), BIAS: (4,), QB: (32,), GATE_UP: (2, 64, 32),
          DOWN: (2, 32, 32)}  # fmt: skip


class Host(WeightLoading):
    """What `Engine` provides to `WeightLoading`, and no more; counts graph drops and prefix
    cache resets."""

    def __init__(self, tie: bool = False, compute_dtype=torch.float32):
        self.plan = resolve("mxfp8", SHAPES, num_layers=4)
        self.config = SimpleNamespace(tie_word_embeddings=tie)
        self.device = torch.device("cpu")
        self.compute_dtype = compute_dtype
        self.weight_dtype = torch.bfloat16
        self.weights, self.hashes = {}, {}
        self.weights_version, self.weights_step = 0, None
        self.dropped = self.resets = 0
        net = nn.Module()
        net.model = nn.Module()
        net.model.embed_tokens = nn.Module()
        net.model.embed_tokens.weight = None
        net.model.norm = nn.Module()
        net.model.norm.weight = None
        layer = nn.Module()
        layer.self_attn = nn.Module()
        layer.self_attn.q_proj = RolloutLinear(self.plan[Q], compute_dtype, Backend.REFERENCE, 8)
        layer.mlp = nn.Module()
        layer.mlp.gate = nn.Module()
        layer.mlp.gate.e_score_correction_bias = None
        specs = {role: self.plan[f"model.layers.1.mlp.experts.{role}_proj"]
                 for role in ("gate_up", "down")}  # fmt: skip
        layer.mlp.experts = RolloutExperts(
            GroupedExperts(2, 32, 32), specs, compute_dtype, 8, Backend.REFERENCE
        )
        net.model.layers = nn.ModuleList([nn.Module(), layer])
        net.lm_head = SimpleNamespace(weight="untied")
        self.net = net

    def _invalidate_graphs(self):
        self.dropped += 1

    def reset_prefix_cache(self):
        self.resets += 1


def _value(name: str, seed: int):
    """A value of `name` as the plan wants it: bf16, the bias fp32, q_proj MXFP8 codes and
    scales (the E4M3 byte 0x38 is 1.0, the E8M0 byte 127 is 2^0; seed moves both)."""
    shape = SHAPES[name]
    if name in (Q, GATE_UP, DOWN):
        qdata = torch.full(shape, 0x38 + seed, dtype=torch.uint8)
        scale = torch.full((*shape[:-1], 1), 127 + seed, dtype=torch.uint8)
        scale = scale.view(torch.float8_e8m0fnu)
        return QTensor(qdata, scale, "mxfp8", shape)
    dtype = torch.float32 if name == BIAS else torch.bfloat16
    return torch.full(shape, float(seed + 1), dtype=dtype)


def _records(seed: int, names=tuple(SHAPES)) -> list[WeightRecord]:
    return [WeightRecord(n, _value(n, seed), checksum(n, _value(n, seed))) for n in names]


def _loaded(seed: int = 0, **kw) -> Host:
    host = Host(**kw)
    assert host.load_weights(_records(seed), host.plan.hash()) == 1
    return host


def _state(host: Host):
    """Everything a refused load must leave alone: version, step, hashes, and each held
    tensor's storage and bytes."""
    held = [t for n in SHAPES for t in _leaves(host._installed(n)) if t is not None]
    return (
        host.weights_version,
        host.weights_step,
        dict(host.hashes),
        [(t.data_ptr(), t.clone()) for t in held],
    )


def _same_state(a, b) -> bool:
    return a[:3] == b[:3] and all(
        p == q and torch.equal(_u8(x), _u8(y)) for (p, x), (q, y) in zip(a[3], b[3], strict=True)
    )


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype.itemsize == 1 else t


def test_a_first_load_installs_every_tensor_where_the_forward_reads_it():
    """First load: new buffers (graphs dropped once, prefixes reset once), version 1, the step
    left None (no update), each hash recorded; the embedding and norm as frozen fp32 Parameters
    of 1.0 (seed 0), the router bias kept fp32, q_proj's QTensor held with its dequantized
    operand (1.0 * 2^0 everywhere) and no plain weight; lm_head untouched when untied."""
    host = _loaded()
    assert (host.weights_version, host.weights_step, host.dropped, host.resets) == (1, None, 1, 1)
    assert host.hashes == {r.name: r.hash for r in _records(0)}
    emb = host.net.model.embed_tokens.weight
    assert isinstance(emb, nn.Parameter) and not emb.requires_grad
    assert emb.dtype == torch.float32 and torch.equal(emb, torch.ones(4, 32))
    assert host.net.model.norm.weight.dtype == torch.float32
    bias = host.net.model.layers[1].mlp.gate.e_score_correction_bias
    assert bias.dtype == torch.float32 and torch.equal(bias, torch.ones(4))
    q = host.net.model.layers[1].self_attn.q_proj
    assert q.w.q is host.weights[Q] and q.weight is None
    assert torch.equal(
        q.w.operand(Form.LP, torch.float32), torch.ones(32, 32)
    )  # E4M3 0x38 = 1.0 times E8M0 127 = 1
    assert host.net.lm_head.weight == "untied"
    assert host.weights[EMBED].dtype == torch.bfloat16  # the record's value, as received


def test_bf16_compute_keeps_the_router_bias_fp32():
    """keeps_fp32 names (the router bias) stay fp32 under a bf16 compute dtype; the others take
    the compute dtype."""
    host = _loaded(compute_dtype=torch.bfloat16)
    assert host.net.model.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32
    assert host.net.model.norm.weight.dtype == torch.bfloat16


def test_a_tied_embedding_is_also_the_lm_head():
    """tie_word_embeddings: lm_head reads the embedding's held storage (the Parameter wraps the
    same tensor), and follows it on a reload in place."""
    host = _loaded(tie=True)
    head, emb = host.net.lm_head.weight, host.net.model.embed_tokens.weight
    assert head.data_ptr() == emb.data_ptr() and torch.equal(head, torch.ones(4, 32))
    host.load_weights(_records(1), host.plan.hash())
    assert torch.equal(host.net.lm_head.weight, torch.full((4, 32), 2.0))


def test_a_reload_copies_into_the_held_buffers():
    """Second load (seed 1): every held tensor keeps its storage and takes the new bytes (2.0;
    q_proj's codes 0x39 and scales 128), no graph drop, prefixes reset again, version 2, the
    update's step taken."""
    host = _loaded()
    ptrs = [t.data_ptr() for n in SHAPES for t in _leaves(host._installed(n)) if t is not None]
    assert host.load_weights(_records(1), host.plan.hash(), step=0) == 2
    after = [t.data_ptr() for n in SHAPES for t in _leaves(host._installed(n)) if t is not None]
    assert after == ptrs
    assert (host.dropped, host.resets, host.weights_step) == (1, 2, 0)
    assert torch.equal(host.net.model.embed_tokens.weight, torch.full((4, 32), 2.0))
    assert torch.equal(host.net.model.norm.weight, torch.full((32,), 2.0))
    assert torch.equal(host.weights[EMBED], torch.full((4, 32), 2.0, dtype=torch.bfloat16))
    q = host.weights[Q]
    assert torch.equal(q.qdata, torch.full((32, 32), 0x39, dtype=torch.uint8))
    assert torch.equal(q.scale.view(torch.uint8), torch.full((32, 1), 128, dtype=torch.uint8))
    assert host.hashes == {r.name: r.hash for r in _records(1)}
    # the GEMM operands follow: E4M3 0x39 is 1.125 and E8M0 128 is 2, so 2.25 everywhere
    q_proj, experts = (
        host.net.model.layers[1].self_attn.q_proj,
        host.net.model.layers[1].mlp.experts,
    )
    for wq in (q_proj.w, experts.values["gate_up"], experts.values["down"]):
        lp = wq.operand(Form.LP, torch.float32)
        assert torch.equal(lp, torch.full(lp.shape, 2.25))


def _after_a_replaced_one_the_rest_is_copied(host: Host) -> None:
    """The tensors after NORM in load order still take seed 1's bytes in place."""
    assert torch.equal(
        host.net.model.layers[1].mlp.gate.e_score_correction_bias, torch.full((4,), 2.0)
    )
    assert torch.equal(host.net.model.layers[1].self_attn.q_proj.bias, torch.full((32,), 2.0))
    experts = host.net.model.layers[1].mlp.experts
    lp = experts.values["down"].operand(Form.LP, torch.float32)
    assert torch.equal(lp, torch.full((2, 32, 32), 2.25))


@pytest.mark.parametrize("budget", [loading.STAGE_AHEAD_BYTES, 0])
def test_a_changed_operand_layout_is_installed_and_the_rest_copied(budget, monkeypatch):
    """The held value fits the record but the module's operand does not (changed behind the
    engine's back): found when the record is staged (ahead of the checksums, or with a budget
    of 0 after the write began), so installed anew (graphs dropped) and the load goes on with
    the tensors after it."""
    monkeypatch.setattr(loading, "STAGE_AHEAD_BYTES", budget)
    host = _loaded()
    host.net.model.norm.weight = nn.Parameter(torch.zeros(16), requires_grad=False)
    host.load_weights(_records(1), host.plan.hash())
    assert host.dropped == 2
    assert torch.equal(host.net.model.norm.weight, torch.full((32,), 2.0))
    _after_a_replaced_one_the_rest_is_copied(host)


@pytest.mark.parametrize("budget", [loading.STAGE_AHEAD_BYTES, 0])
def test_a_changed_layout_installs_new_buffers_and_drops_the_graphs(budget, monkeypatch):
    """A held value whose shape differs from the record's (changed behind the engine's back) is
    replaced, not copied into: new storage, the graphs dropped a second time (staged ahead
    whatever the budget: it cannot be loaded in place)."""
    monkeypatch.setattr(loading, "STAGE_AHEAD_BYTES", budget)
    host = _loaded()
    host.weights[NORM] = torch.zeros(16, dtype=torch.bfloat16)
    host.load_weights(_records(1), host.plan.hash())
    assert host.dropped == 2
    assert torch.equal(host.weights[NORM], torch.full((32,), 2.0, dtype=torch.bfloat16))
    assert torch.equal(host.net.model.norm.weight, torch.full((32,), 2.0))
    _after_a_replaced_one_the_rest_is_copied(host)


def test_a_partial_update_writes_only_its_records():
    """partial=True: the sent tensor changes, the others keep their bytes and hashes."""
    host = _loaded()
    host.load_weights(_records(1, (NORM,)), host.plan.hash(), partial=True, step=7)
    assert torch.equal(host.net.model.norm.weight, torch.full((32,), 2.0))
    assert torch.equal(host.net.model.embed_tokens.weight, torch.ones(4, 32))
    assert host.hashes[EMBED] == _records(0)[0].hash
    assert (host.weights_version, host.weights_step) == (2, 7)


def _refused(host, records, match, **kw):
    before = _state(host)
    with pytest.raises(ValueError, match=match):
        host.load_weights(records, host.plan.hash(), **kw)
    assert _same_state(_state(host), before)


def _forged(name, **changes):
    return [dataclasses.replace(r, **changes) if r.name == name else r for r in _records(1)]


def test_refusals_write_nothing():
    """Each refusal names its cause and leaves version, step, hashes and every held byte and
    storage alone: the plan hash, an unknown name, a name sent twice, a missing tensor, a wrong
    shape, a wrong dtype, a checksum mismatch of a bf16, an fp32 and an MXFP8 record (its codes
    and, separately, its scales changed under the old checksum)."""
    host = _loaded()
    host.load_weights(_records(0), host.plan.hash(), step=3)
    with pytest.raises(ValueError, match="plan hash mismatch"):
        host.load_weights(_records(1), "0" * 64)
    extra = WeightRecord("model.layers.9.mlp.gate.weight", torch.zeros(1), "x")
    _refused(host, [*_records(1), extra], "unknown tensor", step=4)
    _refused(host, [*_records(1), _records(1)[0]], "sent twice", step=4)
    _refused(host, _records(1)[1:], "incomplete update: 1 tensor", step=4)
    bad = torch.full((31,), 2.0, dtype=torch.bfloat16)
    _refused(host, _forged(NORM, value=bad), "model.norm.weight", step=4)
    _refused(host, _forged(NORM, value=torch.full((32,), 2.0)), "model.norm.weight", step=4)
    for name in (EMBED, BIAS):
        _refused(host, _forged(name, hash="f" * 64), "checksum mismatch", step=4)
    v = _value(Q, 1)
    codes = QTensor(_value(Q, 2).qdata, v.scale, "mxfp8", v.shape)
    scales = QTensor(v.qdata, _value(Q, 2).scale, "mxfp8", v.shape)
    for forged in (codes, scales):
        _refused(host, _forged(Q, value=forged), "checksum mismatch", step=4)
    assert host.load_weights(_records(1), host.plan.hash(), step=4) == 3


def test_steps_must_increase_and_none_is_outside_the_sequence():
    """Without a step yet any int is taken (0 included); then only a greater one: the same step
    is 'replayed', a smaller 'stale'; None loads and leaves the step; a bool or a float is a
    TypeError."""
    host = _loaded()
    assert host.weights_step is None
    host.load_weights(_records(1), host.plan.hash(), step=5)
    _refused(host, _records(0), "step 5 refused.*step 5.*a replayed update", step=5)
    _refused(host, _records(0), "step 4 refused.*step 5.*a stale update", step=4)
    for step in (True, 6.0):
        with pytest.raises(TypeError, match="step must be an int"):
            host.load_weights(_records(0), host.plan.hash(), step=step)
    host.load_weights(_records(0), host.plan.hash())
    assert (host.weights_step, host.weights_version) == (5, 3)
    host.load_weights(_records(1), host.plan.hash(), step=6)
    assert host.weights_step == 6


def test_before_write_runs_once_after_the_checks_and_can_stop_the_write():
    """before_write is called once, after every check (a refused update never calls it) and
    before any byte is written; if it raises, nothing changes."""
    host = _loaded()
    calls = []
    with pytest.raises(ValueError):
        host.load_weights(_records(1)[1:], host.plan.hash(), before_write=lambda: calls.append(1))
    assert calls == []

    def stop():
        calls.append(host.net.model.norm.weight.clone())
        raise RuntimeError("a peer cannot load")

    before = _state(host)
    with pytest.raises(RuntimeError, match="a peer"):
        host.load_weights(_records(1), host.plan.hash(), step=1, before_write=stop)
    assert _same_state(_state(host), before) and torch.equal(calls[0], torch.ones(32))
    host.load_weights(_records(1), host.plan.hash(), before_write=lambda: calls.append(2))
    assert calls[1:] == [2] and host.weights_version == 2


def test_verified_records_are_not_checksummed_again(monkeypatch):
    """A VerifiedRecord's checksum is not recomputed: only the plain records reach checksums."""
    host = _loaded()
    seen = []

    class Recording(loading.PendingChecksums):
        def __init__(self, names, values):
            seen.append(list(names))
            super().__init__(names, values)

    monkeypatch.setattr(loading, "PendingChecksums", Recording)
    plain = _records(1)
    verified = verified_records(plain[:2], [r.hash for r in plain[:2]])
    assert all(isinstance(r, VerifiedRecord) for r in verified)
    host.load_weights([*verified, *plain[2:]], host.plan.hash())
    assert seen == [list(SHAPES)[2:]]


def test_records_are_the_held_weights_with_their_checksums():
    """records(): one record per held tensor, in load order, its value the live tensor and its
    hash the checksum of name and bytes."""
    host = _loaded()
    got = list(host.records())
    assert [r.name for r in got] == list(SHAPES)
    assert all(r.value is host.weights[r.name] for r in got)
    assert [r.hash for r in got] == [r.hash for r in _records(0)]


def test_leaves_lists_tensors_in_a_fixed_order():
    """None and a tensor are one leaf; a QTensor its codes, scales and global scale (None for
    MXFP8); lists and tuples flatten; a dict by sorted key; a dataclass by field; others raise."""
    a, b, c = torch.zeros(1), torch.ones(1), torch.full((1,), 2.0)
    assert _leaves(None) == [None] and _leaves(a)[0] is a
    q = _value(Q, 0)
    assert [t is u for t, u in zip(_leaves(q), (q.qdata, q.scale), strict=False)] == [True] * 2
    assert len(_leaves(q)) == 3 and _leaves(q)[2] is None
    assert [id(t) for t in _leaves({"z": a, "b": [b, (c, None)]})] == [id(b), id(c), id(None),
                                                                        id(a)]  # fmt: skip

    @dataclasses.dataclass
    class Pair:
        y: torch.Tensor
        x: torch.Tensor

    assert [id(t) for t in _leaves(Pair(a, b))] == [id(a), id(b)]
    with pytest.raises(TypeError, match="no tensors known in str"):
        _leaves("x")


def test_same_layout_compares_shapes_dtypes_devices_and_absence():
    """False with nothing held, a different leaf count, a leaf present on one side only, another
    shape, dtype or device; values_only compares the first items and ignores the device."""
    cpu, meta = torch.zeros(2), torch.zeros(2, device="meta")
    assert not _same_layout(None, (cpu, None))
    assert _same_layout((cpu, None), (torch.ones(2), None))
    assert not _same_layout([cpu], [cpu, cpu])
    assert not _same_layout([cpu, None], [cpu, cpu])
    assert not _same_layout([None, cpu], [cpu, cpu])
    assert not _same_layout([cpu], [torch.zeros(3)])
    assert not _same_layout([cpu], [torch.zeros(2, dtype=torch.bfloat16)])
    assert not _same_layout([cpu], [meta])
    assert _same_layout((cpu, "held"), (meta, None), values_only=True)
    assert not _same_layout((cpu, None), (torch.zeros(3), None), values_only=True)
    assert _same_layout((cpu, [cpu]), (cpu, [cpu, cpu]), values_only=True)


def test_experts_and_a_projection_bias_are_installed_then_copied_in_place():
    """RolloutExperts: each role's value is held under its role (gate_up, down), dequantized
    on a first load and reloaded in place (same storage, no graph drop); the q_proj bias (a RolloutLinear
    attribute other than its weight) is held as a plain compute-dtype tensor, copied in place."""
    host = _loaded()
    experts = host.net.model.layers[1].mlp.experts
    assert set(experts.values) == {"gate_up", "down"}
    assert all(any(t is not None for t in _leaves(v)) for v in experts.values.values())
    bias = host.net.model.layers[1].self_attn.q_proj.bias
    assert bias.dtype == torch.float32 and torch.equal(bias, torch.ones(32))
    ptrs = {r: [t.data_ptr() for t in _leaves(experts.values[r]) if t is not None]
            for r in ("gate_up", "down")}  # fmt: skip
    bias_ptr = bias.data_ptr()
    host.load_weights(_records(1), host.plan.hash())
    assert host.dropped == 1
    assert host.net.model.layers[1].self_attn.q_proj.bias.data_ptr() == bias_ptr
    assert torch.equal(host.net.model.layers[1].self_attn.q_proj.bias, torch.full((32,), 2.0))
    for role in ("gate_up", "down"):
        after = [t.data_ptr() for t in _leaves(experts.values[role]) if t is not None]
        assert after == ptrs[role]
        codes = host.weights[GATE_UP if role == "gate_up" else DOWN].qdata
        assert torch.equal(codes, torch.full(codes.shape, 0x39, dtype=torch.uint8))


def test_plain_records_must_have_the_engine_weight_dtype():
    """An engine whose weight dtype is fp32 refuses bf16 plain records (the plan's unquantized
    tensors must come in the engine's weight dtype), naming the first one, the embedding."""
    host = _loaded()
    host.weight_dtype = torch.float32
    _refused(host, _records(1), "model.embed_tokens.weight")


@pytest.mark.gpu
def test_host_records_are_loaded_onto_the_engine_device():
    """An engine on CUDA given CPU records holds them on CUDA (stage moves each value to the
    engine's device), first load and reload alike."""
    host = Host()
    host.device = torch.device("cuda")
    host.net.to("cuda")
    host.load_weights(_records(0), host.plan.hash())
    assert host.weights[EMBED].is_cuda and host.net.model.embed_tokens.weight.is_cuda
    assert host.weights[Q].qdata.is_cuda
