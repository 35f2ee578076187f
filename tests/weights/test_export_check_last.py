"""The whole-update export's NaN/Inf check on the exported bytes (`quantized_values(check_last=
True)`, `export(bucket_bytes=WHOLE_UPDATE)`, mxrl.weights.export.OutputCheck): the same
refusal, with the same message, as the check on the masters before the first value, but made
once every value exists and before the one bucket does; the block FP8 / MXFP8 / bf16 masters
then read once (by their quantizer or cast) instead of twice, NVFP4 masters still twice (the
check is their global amax); the same bytes and checksums either way; a finite master that
overflows bf16 passes in both. The 0x7F rule it relies on (a NaN/Inf element and only such an
element gives that E4M3 byte) is checked on the reference quantizers over every code."""

from __future__ import annotations

import importlib
import math

import pytest
import torch

from mxrl.formats import QTensor, quantize
from mxrl.formats.constants import Format
from mxrl.recipe import resolve
from mxrl.weights import WHOLE_UPDATE, export, quantized_values
from mxrl.weights.record import stored_tensors
from tests.numerics import assert_bytes_equal
from tests.sync.helpers import ALL_NVFP4, FP8_BLOCK_32, MIXED, tiny

export_module = importlib.import_module("mxrl.weights.export")
RECIPES = {"bf16": "bf16", "mxfp8": "mxfp8", "fp8-block-32": FP8_BLOCK_32,
           "all-nvfp4": ALL_NVFP4, "mixed": MIXED}  # fmt: skip
EXPERT = "model.layers.1.mlp.experts.down_proj"  # [E, H, I]
Q = "model.layers.0.self_attn.q_proj.weight"
O_PROJ = "model.layers.2.self_attn.o_proj.weight"
NORM = "model.layers.3.post_attention_layernorm.weight"
ROUTER = "model.layers.0.mlp.gate.weight"


def _params(seed=3):
    return {n: p.detach().clone() for n, p in tiny(seed=seed).named_parameters()}


def _plan(params, recipe):
    return resolve(RECIPES[recipe], {n: p.shape for n, p in params.items()})


def _error(params, plan, check_last):
    """(values produced before the refusal, its message)."""
    got = []
    with pytest.raises(ValueError, match="refusing to export") as err:
        for item in quantized_values(params, plan, check_last=check_last):
            got.append(item)
    return len(got), str(err.value)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize(
    ("recipe", "name", "index"),
    [("bf16", EXPERT, (3, 17, 5)), ("bf16", NORM, (0,)), ("mxfp8", Q, (63, 0)),
     ("mxfp8", EXPERT, (7, 63, 31)), ("fp8-block-32", EXPERT, (0, 0, 0)),
     ("fp8-block-32", O_PROJ, (40, 33)), ("fp8-block-32", ROUTER, (1, 2)),
     ("mixed", Q, (5, 6)), ("mixed", O_PROJ, (0, 63)), ("all-nvfp4", EXPERT, (2, 1, 1))],
)  # fmt: skip
def test_the_bytes_check_refuses_as_the_masters_check_with_its_message(recipe, name, index, bad):
    params = _params()
    plan = _plan(params, recipe)
    params[name][index] = bad
    before, first = _error(params, plan, check_last=False)
    after, last = _error(params, plan, check_last=True)
    assert before == 0 and last == first
    assert f"{name}: 1 non-finite" in last and "Nothing was sent" in last
    # the bytes show it: refused once every value exists; NVFP4 (its amax read): before any
    assert after == (0 if plan[name].format is Format.NVFP4 else len(plan))


def test_several_bad_tensors_are_named_together_with_their_counts():
    params = _params()
    plan = _plan(params, "mixed")
    params[Q][0, :3] = math.nan  # MXFP8
    params[O_PROJ][63, 62] = math.inf  # block FP8
    params[NORM][1] = -math.inf  # bf16
    params[EXPERT][0, 0, 0] = math.nan  # NVFP4: checked first, alone
    _, first = _error(params, plan, check_last=True)
    assert "refusing to export: 1 master" in first and EXPERT in first
    params[EXPERT][0, 0, 0] = 0.0
    _, msg = _error(params, plan, check_last=True)
    assert "refusing to export: 3 master weight(s)" in msg
    for text in (f"{Q}: 3 non-finite, first {Q}[0, 0] = nan", f"{O_PROJ}: 1 non-finite",
                 f"{NORM}: 1 non-finite, first {NORM}[1] = -inf"):  # fmt: skip
        assert text in msg


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_the_same_values_and_checksums_either_way(recipe):
    params = _params()
    plan = _plan(params, recipe)
    first = dict(quantized_values(params, plan))
    last = dict(quantized_values(params, plan, check_last=True))
    assert list(last) == list(plan)
    for name, value in first.items():
        for key, t in stored_tensors(value).items():
            assert_bytes_equal(stored_tensors(last[name])[key], t, f"{name} {key}")
    a = export(params, plan, bucket_bytes=WHOLE_UPDATE, sqnr=False)
    b = export(params, plan, sqnr=False)
    assert {r.name: r.hash for r in a.records()} == {r.name: r.hash for r in b.records()}


def test_a_finite_master_that_overflows_bf16_passes_both_ways():
    params = _params()
    plan = _plan(params, "mixed")
    params[NORM][2] = 3.4e38  # finite in fp32, rounds to +Inf in bf16
    for check_last in (False, True):
        values = dict(quantized_values(params, plan, check_last=check_last))
        assert values[NORM][2].item() == math.inf


class _Reads(torch.utils._python_dispatch.TorchDispatchMode):
    """Elements of each master the ops read (view ops read nothing)."""

    def __init__(self, params):
        super().__init__()
        self.names = {p.untyped_storage().data_ptr(): n for n, p in params.items()}
        self.elements = dict.fromkeys(params, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            for a in torch.utils._pytree.tree_leaves((args, kwargs)):
                if isinstance(a, torch.Tensor):
                    name = self.names.get(a.untyped_storage().data_ptr())
                    if name is not None:
                        self.elements[name] += a.numel()
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("recipe", ["bf16", "mxfp8", "fp8-block-32", "mixed"])
def test_only_nvfp4_masters_are_read_by_a_check_when_it_is_last(recipe, monkeypatch):
    params = _params()
    plan = _plan(params, recipe)
    quantize_calls = dict.fromkeys(params, 0)
    real = export_module.kernel_quantize

    def counted(w, *args, **kwargs):  # the quantizer: one read of its master, counted once
        quantize_calls[reads.names[w.untyped_storage().data_ptr()]] += 1
        with torch.utils._python_dispatch._disable_current_modes():
            return real(w, *args, **kwargs)

    monkeypatch.setattr(export_module, "kernel_quantize", counted)
    reads = _Reads(params)
    with reads:
        assert len(list(quantized_values(params, plan, check_last=True))) == len(plan)
    for name, spec in plan.items():
        passes = reads.elements[name] / params[name].numel() + quantize_calls[name]
        assert passes == (2 if spec.format is Format.NVFP4 else 1), (name, spec.format, passes)


def test_a_whole_update_export_is_refused_before_its_bucket_and_a_bucketed_one_at_once():
    params = _params()
    plan = _plan(params, "fp8-block-32")
    params[EXPERT][1, 2, 3] = math.nan
    exp = export(params, plan, bucket_bytes=WHOLE_UPDATE)  # the bytes are checked at the end
    buckets = []
    with pytest.raises(ValueError, match=f"refusing to export: 1 master.*{EXPERT}"):
        buckets.extend(exp)
    assert buckets == []
    with pytest.raises(ValueError, match=f"refusing to export: 1 master.*{EXPERT}"):
        export(params, plan, bucket_bytes=WHOLE_UPDATE - 1)  # the masters, before returning


@pytest.mark.parametrize(("fmt", "options"), [("fp8_block", {"block": (32, 32)}),
                                             ("fp8_block", {"block": (1, 32)}),
                                             ("fp8_block", {"block": (32, 32), "scale_mode": "ue8m0"}),
                                             ("mxfp8", {})])  # fmt: skip
def test_0x7f_is_the_byte_of_a_non_finite_element_and_of_no_finite_one(fmt, options):
    """Every finite E4M3 value and its neighbours at every scale exponent, with the largest
    and smallest finite fp32 magnitudes: no finite element becomes 0x7F (as int8 the largest
    code is then 0x7E), and NaN / ±Inf become 0x7F whatever the block holds."""
    codes = torch.arange(256, dtype=torch.uint8)
    e4m3 = codes.view(torch.float8_e4m3fn).float()
    e4m3 = e4m3[torch.isfinite(e4m3)]
    scales = 2.0 ** torch.arange(-140, 128, 6, dtype=torch.float32)
    grid = torch.cat([(e4m3[:, None] * scales[None, :]).reshape(-1),
                      torch.tensor([3.4028235e38, -3.4028235e38, 1e-45, -1e-45])])  # fmt: skip
    for jitter in (1.0, 1.0 + 2.0**-10, 1.0 - 2.0**-12):
        x = (grid * jitter).to(torch.float32)
        x = x[torch.isfinite(x)]  # (the top scales overflow fp32: those are not inputs here)
        assert x.numel() > 11000
        x = torch.cat([x, x.new_zeros((-x.numel()) % (32 * 32))]).reshape(-1, 32)
        q = quantize(x, Format(fmt), **options).qdata.view(torch.int8)
        assert int(q.max()) <= 0x7E
        assert (q == 0x7F).sum() == 0
    x = torch.randn(64, 64)
    x[3, 4], x[10, 40], x[63, 63] = math.nan, math.inf, -math.inf
    q = quantize(x, Format(fmt), **options).qdata.view(torch.uint8)
    assert sorted(map(tuple, (q == 0x7F).nonzero().tolist())) == [(3, 4), (10, 40), (63, 63)]


def test_an_empty_tensor_is_checked_first_and_one_element_last(monkeypatch):
    """An empty tensor has no bytes to probe (the masters' check skips it too); one element is
    enough for the bytes' check."""
    one = "model.layers.1.input_layernorm.weight"
    shapes = {Q: (64, 64), NORM: (0,), one: (1,)}
    plan = resolve("mxfp8", shapes)
    w = {n: torch.randn(s) for n, s in shapes.items()}
    first = []
    real = export_module.check_finite
    monkeypatch.setattr(
        export_module, "check_finite", lambda t, *a: first.append(set(t)) or real(t, *a)
    )
    values = dict(quantized_values(w, plan, check_last=True))
    assert values[NORM].shape == (0,) and isinstance(values[Q], QTensor)
    assert first == [{NORM}]  # the one call: the masters checked first
    w[one][0] = math.inf
    with pytest.raises(ValueError, match=f"{one}: 1 non-finite"):
        list(quantized_values(w, plan, check_last=True))
    assert first[1:] == [{NORM}, {one}]  # first, then the flagged one's master


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["bf16", "mxfp8", "fp8-block-32", "mixed"])
def test_on_cuda_the_triton_bytes_refuse_as_the_masters_check(recipe):
    """The same on the GPU, where the Triton quantizers make the bytes the check reads."""
    params = {n: t.cuda() for n, t in _params().items()}
    plan = _plan(params, recipe)
    first = dict(quantized_values(params, plan))
    last = dict(quantized_values(params, plan, check_last=True))
    for name, value in first.items():
        for key, t in stored_tensors(value).items():
            assert_bytes_equal(stored_tensors(last[name])[key], t, f"{name} {key}")
    for name in (EXPERT, Q, NORM):
        params[name].view(-1)[7] = math.nan
        assert _error(params, plan, check_last=True)[1] == _error(params, plan, False)[1]
        params[name].view(-1)[7] = 0.0


@pytest.mark.gpu
def test_on_cuda_masters_on_two_devices_are_checked_each_on_its_own():
    """Probes are stacked per device: the CPU's and the GPU's apart."""
    params = _params()
    plan = _plan(params, "mixed")
    params = {n: (t.cuda() if ".layers.0." in n else t) for n, t in params.items()}
    assert {t.device.type for t in params.values()} == {"cpu", "cuda"}
    assert len(dict(quantized_values(params, plan, check_last=True))) == len(plan)
    params[Q][1, 1] = math.nan  # on the GPU
    params[NORM][0] = math.inf  # on the CPU
    _, msg = _error(params, plan, check_last=True)
    assert "2 master weight(s)" in msg and Q in msg and NORM in msg
