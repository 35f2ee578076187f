"""The export's NVFP4 global amax is its NaN/Inf check (mxrl.weights.export.check_finite): one
read of each NVFP4 master gives both, the export's bytes and checksums stay those of the
reference quantizer (`quantize_weight`), a NaN or Inf anywhere in an NVFP4 tensor (an expert, a
gate/up half, one tensor of a fuse pair) is still refused before the first value, and every
master is read twice per export whatever its format: the check, then its quantizer."""

from __future__ import annotations

import importlib
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mxrl.formats import QTensor
from mxrl.recipe import resolve
from mxrl.recipe.quantize import quantize_weight
from mxrl.weights import checksum, export, export_weights, quantized_values
from mxrl.weights.export import fuse_partners
from tests.numerics import HostReads, assert_bytes_equal, assert_qtensor_bytes_equal
from tests.sync.helpers import ALL_NVFP4, FP8_BLOCK_32, tiny

export_module = importlib.import_module("mxrl.weights.export")  # `mxrl.weights.export` is
# also the name of the bucketed export function, which `import ... as` would give
pytestmark = pytest.mark.capability  # byte-exact on every CPU capability (tests/numeric_env.py)

# attention 2-D NVFP4 alone; the shared expert's gate and up a 2-D fuse pair (one amax for the
# two); routed experts per expert ([E, 1, 1]), their fused gate_up per expert (ALL_NVFP4) or per
# half ([E, 2I, 1], not fused); the router and the norms bf16.
ALL_NVFP4_HALVES = {
    **ALL_NVFP4,
    "name": "all-nvfp4-halves",
    "rules": [
        *ALL_NVFP4["rules"][:3],
        {"match": {"kind": "routed_expert"}, "format": "nvfp4", "activations": "per_token"},
    ],
}
RECIPES = {"fused": ALL_NVFP4, "halves": ALL_NVFP4_HALVES}
GATE_UP = "model.layers.1.mlp.experts.gate_up_proj"
SHARED_GATE = "model.layers.2.mlp.shared_expert.gate_proj.weight"
SHARED_UP = "model.layers.2.mlp.shared_expert.up_proj.weight"


def _model(dtype=torch.float32):
    """The tiny MoE with amaxes that differ per expert, per gate/up half and across the fuse
    pair (the up tensor's larger, so the pair's max is not the tensor's own)."""
    model = tiny(seed=3, dtype=dtype)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in params.items():
            if p.dim() == 3:  # expert e scaled by e + 1, the up half of gate_up by 3 more
                p.mul_(torch.arange(1, p.shape[0] + 1, dtype=p.dtype)[:, None, None])
                if "gate_up" in name:
                    p[:, p.shape[1] // 2 :].mul_(3)
            elif "shared_expert.up_proj" in name:
                p.mul_(7)
    return model


def _plan(model, recipe):
    return resolve(recipe, {n: p.shape for n, p in model.named_parameters()})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_export_bytes_and_checksums_are_the_reference_quantizers(recipe, dtype):
    model = _model(dtype)
    plan = _plan(model, RECIPES[recipe])
    params = dict(model.named_parameters())
    partners = fuse_partners(plan)
    assert partners[SHARED_GATE] == SHARED_UP
    assert (plan[GATE_UP].fuse_group is None) == (recipe == "halves")
    records = list(export_weights(params, plan))
    assert [r.name for r in records] == list(plan)
    num_nvfp4 = 0
    for record in records:
        spec = plan[record.name]
        if not isinstance(record.value, QTensor):
            assert_bytes_equal(record.value, params[record.name].detach().to(torch.bfloat16))
            assert record.hash == checksum(record.name, record.value)
            continue
        num_nvfp4 += 1
        partner = params[partners[record.name]] if record.name in partners else None
        want = quantize_weight(params[record.name], spec, partner)
        assert_qtensor_bytes_equal(record.value, want, record.name)
        assert record.hash == checksum(record.name, want), record.name
    assert num_nvfp4 == sum(1 for s in plan.values() if s.format.value == "nvfp4") > 20


@pytest.mark.parametrize("bad", [math.nan, math.inf])
@pytest.mark.parametrize(
    ("recipe", "name", "index", "where"),
    [
        # one expert of a fused gate_up (its per-expert amax); the up half of an unfused one
        # (only that half's amax sees it)
        ("fused", GATE_UP, (5, 2, 7), "model.layers.1.mlp.experts.5.gate_proj.weight[2, 7]"),
        ("halves", GATE_UP, (6, 40, 1), "model.layers.1.mlp.experts.6.up_proj.weight[8, 1]"),
        ("halves", "model.layers.0.mlp.experts.down_proj", (0, 63, 31),
         "model.layers.0.mlp.experts.0.down_proj.weight[63, 31]"),
        # either tensor of a 2-D fuse pair: the error names that one, not its partner
        ("fused", SHARED_GATE, (0, 0), f"{SHARED_GATE}[0, 0]"),
        ("fused", SHARED_UP, (63, 17), f"{SHARED_UP}[63, 17]"),
    ],
)  # fmt: skip
def test_a_non_finite_nvfp4_master_is_refused_before_the_first_value(
    recipe, name, index, where, bad
):
    model = _model()
    plan = _plan(model, RECIPES[recipe])
    with torch.no_grad():
        dict(model.named_parameters())[name][index] = bad
    values = quantized_values(model.named_parameters(), plan)
    with pytest.raises(ValueError, match="refusing to export: 1 master") as err:
        next(values)
    msg = str(err.value)
    assert f"{name}: 1 non-finite, first {where} = {bad}" in msg
    assert "Nothing was sent" in msg
    exp = export(model, plan)  # the check is queued, its verdict read by the first bucket
    with pytest.raises(ValueError, match="refusing to export"):
        next(iter(exp))  # before any bucket exists


def test_every_bad_tensor_is_named_with_its_count():
    model = _model()
    plan = _plan(model, ALL_NVFP4_HALVES)
    params = dict(model.named_parameters())
    with torch.no_grad():
        params[GATE_UP][1, 3, 4] = -math.inf  # the gate half
        params[GATE_UP][7, 60, 0] = math.nan  # the up half
        params[SHARED_UP][2, 2] = math.inf
        params["model.layers.0.self_attn.q_norm.weight"][5] = math.nan  # bf16: aminmax
    with pytest.raises(ValueError, match="3 master weight") as err:
        next(quantized_values(params, plan))
    msg = str(err.value)
    assert f"{GATE_UP}: 2 non-finite, first model.layers.1.mlp.experts.1.gate_proj" in msg
    assert f"{SHARED_UP}: 1 non-finite" in msg and SHARED_GATE not in msg
    assert "q_norm.weight: 1 non-finite" in msg


class _Reads(TorchDispatchMode):
    """Elements of the master weights each op reads (view ops read nothing), per master;
    the quantizer (`kernel_quantize`, one kernel on the GPU) counted as one read apart."""

    def __init__(self, params: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.names = {p.untyped_storage().data_ptr(): n for n, p in params.items()}
        self.elements = dict.fromkeys(params, 0)
        self.quantizer = dict.fromkeys(params, 0)
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused and not func.is_view:
            for a in torch.utils._pytree.tree_leaves((args, kwargs)):
                if isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() in self.names:
                    self.elements[self.names[a.untyped_storage().data_ptr()]] += a.numel()
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("recipe", ["bf16", "mxfp8", "fp8-block-32", "fused", "halves"])
def test_each_master_is_read_twice_the_check_and_its_quantizer(recipe, monkeypatch):
    model = _model()
    plan = _plan(model, {**RECIPES, "fp8-block-32": FP8_BLOCK_32}.get(recipe, recipe))
    params = {n: p.detach() for n, p in model.named_parameters()}
    reads = _Reads(params)
    quantize = export_module.kernel_quantize

    def counted(w, *args, **kwargs):
        reads.quantizer[reads.names[w.untyped_storage().data_ptr()]] += 1
        reads.paused = True
        try:
            return quantize(w, *args, **kwargs)
        finally:
            reads.paused = False

    monkeypatch.setattr(export_module, "kernel_quantize", counted)
    with reads:
        values = list(quantized_values(params, plan))
    assert len(values) == len(plan)
    for name, spec in plan.items():
        passes = reads.elements[name] / params[name].numel() + reads.quantizer[name]
        assert passes == 2, (name, spec.format, reads.elements[name], reads.quantizer[name])


class _Copies(TorchDispatchMode):
    """Ops that make a tensor of the master's size from the master or from such a tensor
    (the copies the export makes of it)."""

    def __init__(self, master: torch.Tensor) -> None:
        super().__init__()
        self.numel = master.numel()
        self.from_master = {master.untyped_storage().data_ptr()}
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = torch.utils._pytree.tree_leaves((args, kwargs))
        derived = any(
            isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() in self.from_master
            for a in inputs
        )
        copy = derived and not func.is_view and isinstance(out, torch.Tensor)
        if copy and out.numel() == self.numel:
            self.ops.append(str(func))
            self.from_master.add(out.untyped_storage().data_ptr())
        return out


def test_a_bf16_value_is_one_contiguous_copy_of_a_strided_master():
    model = _model()
    plan = _plan(model, "bf16")
    params = {n: p.detach() for n, p in model.named_parameters()}
    name = "lm_head.weight"
    params[name] = params[name].t().contiguous().t()  # the same values, column-major
    assert not params[name].is_contiguous()
    with _Copies(params[name]) as copies:
        value = dict(quantized_values(params, plan))[name]
    assert copies.ops == ["aten._to_copy.default"]
    assert value.is_contiguous() and value.data_ptr() != params[name].data_ptr()
    assert_bytes_equal(value, params[name].to(torch.bfloat16).contiguous())


@pytest.mark.parametrize("recipe", ["fused", "halves"])
def test_nvfp4_export_quantizes_without_reading_back(recipe):
    """The export's amaxes are proven finite by its one check (one host read for all tensors,
    `.tolist()`, outside torch's dispatch): quantizing reads nothing back per tensor (on a GPU,
    no sync between one tensor's quantization and the next)."""
    model = _model()
    params = dict(model.named_parameters())
    plan = _plan(model, RECIPES[recipe])
    with HostReads() as reads:
        values = list(quantized_values(params, plan))
    assert len(values) == len(plan)
    assert not reads.ops, reads.ops
