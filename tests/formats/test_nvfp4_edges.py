"""Edge cases of the NVFP4 reference quantizer found by mutation testing (docs/mutation/README.md):
each expectation is worked out by hand from docs/formats.md, never from the function under test."""

from __future__ import annotations

import math

import pytest
import torch

from mxrl.formats import codecs, dequantize, quantize
from mxrl.formats.constants import FLT_MAX
from mxrl.formats.nvfp4 import caller_amax, quantize_nvfp4
from tests.numerics import assert_bytes_equal

pytestmark = pytest.mark.capability  # byte-exact on every CPU capability (tests/numeric_env.py)


def test_caller_amax_checks_by_default_and_is_fp32():
    """caller_amax's `check` is on unless a caller turns it off; the amax comes back fp32 (the
    dtype of S_enc's numerator and of the kernels' operand) whatever the caller passed."""
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="finite and non-negative"):
        caller_amax(float("nan"), torch.Size([2, 16]), cpu)
    with pytest.raises(ValueError, match="finite and non-negative"):
        caller_amax(-1.0, torch.Size([2, 16]), cpu)
    for given in (torch.tensor(3.0, dtype=torch.float64), 3, torch.tensor([[2], [5]])):
        g = caller_amax(given, torch.Size([2, 16]), cpu)
        assert g.dtype == torch.float32, (given, g.dtype)
    rows = caller_amax(torch.tensor([[2], [5]]), torch.Size([2, 16]), cpu)
    assert rows.tolist() == [[2.0], [5.0]]


@pytest.mark.parametrize(
    ("x_shape", "g_shape"),
    [
        ((2, 16), (2, 16)),  # x's rank but last dim 16: one amax per element, not per row
        ((3, 4, 32), (3, 1, 2)),  # last dim 2
        ((3, 4, 32), (3, 4)),  # rank 2 for x's 3
        ((3, 4, 32), (2, 1, 1)),  # 2 experts for 3
        ((3, 4, 32), (3, 2, 1)),  # 2 rows for 4
        ((2, 16), (2,)),  # rank 1 for x's 2
    ],
)
def test_a_global_amax_that_does_not_fit_x_is_refused(x_shape, g_shape):
    """docs: a scalar, or a tensor of x's rank whose last dim is 1 and whose other dims are 1 or
    x's (broadcasts over x's leading dims)."""
    with pytest.raises(ValueError, match="does not fit x of shape"):
        caller_amax(torch.ones(g_shape), torch.Size(x_shape), torch.device("cpu"))


@pytest.mark.parametrize("g_shape", [(), (1, 1, 1), (3, 1, 1), (1, 4, 1), (3, 4, 1)])
def test_every_global_amax_that_fits_is_taken(g_shape):
    g = caller_amax(torch.full(g_shape, 2.0), torch.Size([3, 4, 32]), torch.device("cpu"))
    assert g.shape == g_shape and (g == 2.0).all()


def test_a_one_d_tensor_names_the_index_of_its_amax():
    """x of one row [32], global_amax [1]: the refusal names index (0,), a 1-d index."""
    x = torch.full((32,), 2.0)
    with pytest.raises(ValueError, match=r"global_amax 0.5 at index \(0,\) is below .* 2:"):
        quantize(x, "nvfp4", global_amax=torch.tensor([0.5]))
    with pytest.raises(ValueError, match=r"holds -1.0 at index \(0,\)"):
        quantize(x, "nvfp4", global_amax=torch.tensor([-1.0]))


def test_without_the_data_only_a_zero_amax_is_refused():
    """caller_amax without `data_amax` (a caller that has not read its data): the data's amax is
    unknown, taken as +Inf, so 0 (all-zero data only) is refused, naming that unknown amax, and
    any positive finite amax is taken; a NaN/negative one is refused as always."""
    cpu = torch.device("cpu")
    with pytest.raises(
        ValueError, match=r"global_amax 0 at index \(\) is below .* scales, inf: a 0"
    ):
        caller_amax(0.0, torch.Size([2, 16]), cpu)
    with pytest.raises(ValueError, match=r"global_amax 0 at index \(1, 0\) is below .* inf: a 0"):
        caller_amax(torch.tensor([[1e-30], [0.0]]), torch.Size([2, 16]), cpu)
    for ok in (1e-30, 1.0, FLT_MAX):
        assert caller_amax(ok, torch.Size([2, 16]), cpu).item() == torch.tensor(ok).item()
    assert caller_amax(0.0, torch.Size([2, 16]), cpu, check=False).item() == 0.0


def _f32(bits: int) -> float:
    return torch.tensor([bits], dtype=torch.int32).view(torch.float32).item()


def test_a_block_scale_of_exactly_464_is_taken_one_ulp_above_is_refused():
    """g = 0x3F772C23 (0.9655172): S_enc = fl(2688 / g) = 2784 exactly and t = fl(1 * fl(2784 *
    fl(1/6))) = 464.0 for a block of amax 1 (by hand: 2784 * 0x3E2AAAAB = 464.0000138, within
    half an ulp (3.05e-5 / 2) of 464). RNE takes 464 to 448 (the tie goes to 448's even
    mantissa): nothing is clipped, the amax is taken and the block scale is 0x7E. One ulp of g
    lower (0x3F772C22), S_enc = 2784.0002 and t = 464.00006 > 464: saturated, refused."""
    x = torch.zeros(2, 16)
    x[1, 3] = 1.0
    q = quantize(x, "nvfp4", global_amax=_f32(0x3F772C23))
    assert q.global_scale.item() == 2784.0
    assert q.scale.view(torch.uint8).tolist() == [[0x00], [0x7E]]
    with pytest.raises(ValueError, match="below the amax of the data"):
        quantize(x, "nvfp4", global_amax=_f32(0x3F772C22))


def test_global_encode_scale_edge_rules():
    """§3.2: S_enc = fl(2688 / amax); 0 or Inf amax -> 1; capped at FLT_MAX (2688 / 2^-149 is
    +Inf in fp32). By hand: 2688 / 448 = 6, 2688 / 2688 = 1, 2688 / 2^-20 = 2688 * 2^20."""
    from mxrl.formats.nvfp4 import global_encode_scale

    amax = torch.tensor([448.0, 2688.0, 2.0**-20, 2.0**-149, 0.0, math.inf])
    want = torch.tensor([6.0, 1.0, 2688.0 * 2.0**20, FLT_MAX, 1.0, 1.0])
    assert_bytes_equal(global_encode_scale(amax), want, "S_enc")


def test_a_tiny_tensor_gets_the_largest_global_scale():
    """x = 2^-149 (the smallest fp32 subnormal) in one element: S_enc = FLT_MAX (capped);
    t = 2^-149 * fl(FLT_MAX * fl(1/6)) ~ 8e-8, below E4M3's smallest 2^-9: scale 0 -> enc is
    +Inf capped at FLT_MAX, and the element times it is 2^-149 * (2 - 2^-23) * 2^127 ~ 2^-21,
    below E2M1's 0.25 tie: code 0."""
    x = torch.zeros(1, 16)
    x[0, 0] = 2.0**-149
    q = quantize(x, "nvfp4")
    assert q.global_scale.item() == FLT_MAX
    assert q.scale.view(torch.uint8).tolist() == [[0]]
    assert codecs.unpack_nibbles(q.qdata)[0].tolist() == [0] * 16


def test_a_caller_inf_amax_unchecked_gives_a_unit_global_scale():
    """check_amax=False takes the caller's word: an Inf amax gives fl(2688 / Inf) = 0, which the
    §3.2 rule replaces by 1 (as a 0 amax): the bytes of S_enc = 1."""
    x = torch.zeros(1, 16)
    x[0, 2] = 448.0 * 6.0
    q = quantize(x, "nvfp4", global_amax=math.inf, check_amax=False)
    assert q.global_scale.item() == 1.0
    assert q.scale.view(torch.uint8).tolist() == [[0x7E]]  # t = 2688 * fl(1/6) -> 448


def test_an_empty_tensor_gets_a_unit_global_scale():
    """quantize refuses a zero-size tensor; the reference itself (a [0, 16] batch of no tokens)
    takes the amax of no blocks as 0: S_enc = 1, empty data and scales."""
    q = quantize_nvfp4(torch.zeros(0, 32))
    assert q.global_scale.shape == () and q.global_scale.item() == 1.0
    assert q.qdata.shape == (0, 16) and q.scale.shape == (0, 2)


def test_dequantize_without_the_global_scale():
    """By hand: amax 1344 -> S_enc = 2688 / 1344 = 2, S_dec = 0.5. Block scale t = 1344 *
    fl(2 * fl(1/6)) = 448.0000134 -> E4M3 448 (0x7E); enc = fl(1 / (448 * 0.5)) = fl(1/224).
    1344, 224, -112 code to 6, 1, -0.5 (0x7, 0x2, 0x9). Without the global scale they decode to
    e2m1 * 448 = 2688, 448, -224; with it, times 0.5: 1344, 224, -112."""
    x = torch.zeros(1, 16)
    x[0, :3] = torch.tensor([1344.0, 224.0, -112.0])
    q = quantize(x, "nvfp4")
    assert q.global_scale.item() == 2.0
    assert q.scale.view(torch.uint8).tolist() == [[0x7E]]
    assert codecs.unpack_nibbles(q.qdata)[0, :4].tolist() == [0x7, 0x2, 0x9, 0x0]
    want = torch.zeros(1, 16)
    want[0, :3] = torch.tensor([2688.0, 448.0, -224.0])
    assert_bytes_equal(dequantize(q, global_scale=False), want, "e2m1 * s_block")
    assert_bytes_equal(dequantize(q), want * 0.5, "times S_dec")


def test_the_refusals_say_what_the_amax_would_do_to_the_data():
    """The whole message of each refusal of an amax below its data: a 0 amax (quantized without
    a scale) and a positive one (clipped to about ±g)."""
    x = torch.zeros(2, 16)
    x[1, 4] = 2.0
    zero = (
        r"nvfp4: global_amax 0 at index \(1, 0\) is below the amax of the data it scales, 2: "
        r"a 0 amax stands for all-zero data \(S_enc = 1\), so this data would be quantized "
        r"without its scale \(small values to 0, large ones clipped\)\. Pass the max \|x\| over "
        r"every tensor sharing the scale \(gate and up: the max of both\), or global_amax=None "
        r"to use x's own$"
    )
    with pytest.raises(ValueError, match=zero):
        quantize(x, "nvfp4", global_amax=torch.tensor([[0.0], [0.0]]))
    low = (
        r"nvfp4: global_amax 1\.5 at index \(\) is below the amax of the data it scales, 2: "
        r"the E4M3 block scales would saturate and clip the data to about ±1\.5\. Pass"
    )
    with pytest.raises(ValueError, match=low):
        quantize(x, "nvfp4", global_amax=1.5)


def test_dequantize_with_one_global_scale_per_expert_and_row():
    """A caller's amax of shape [E, R, 1] (one per row of each expert). Row (e, r) holds one
    element a = 2688 * 2^-k, k = 3e + r + 1, and gets global_amax a: S_enc = 2^k exactly, the
    block scale t = a * fl(2^k * fl(1/6)) = 2688 * fl(1/6) -> 448 (0x7E), enc = fl(2^k / 448),
    a * enc -> 6 (code 0x7), and x_hat = 6 * 448 * 2^-k = a: dequantize gives x back, each row
    with its own S_dec (the default of dequantize_nvfp4 applies it)."""
    from mxrl.formats.nvfp4 import dequantize_nvfp4

    k = torch.arange(6, dtype=torch.float32).reshape(2, 3, 1) + 1
    a = 2688.0 * torch.exp2(-k)
    x = torch.zeros(2, 3, 16)
    x[..., :1] = a
    q = quantize(x, "nvfp4", global_amax=a)
    assert_bytes_equal(q.global_scale, torch.exp2(k), "S_enc = 2^k")
    assert (q.scale.view(torch.uint8) == 0x7E).all()
    assert_bytes_equal(dequantize(q), x, "x back")
    assert_bytes_equal(dequantize_nvfp4(q), x, "the default applies S_dec")


@pytest.mark.gpu
def test_an_empty_cuda_tensor_gets_its_global_scale_on_the_gpu():
    q = quantize_nvfp4(torch.zeros(0, 32, device="cuda"))
    assert q.global_scale.device.type == "cuda" and q.global_scale.item() == 1.0


@pytest.mark.gpu
@pytest.mark.parametrize("how", ["float", "cpu scalar", "cpu rows"])
def test_a_host_global_amax_follows_x_onto_the_gpu(how):
    """A CUDA x with a global_amax given as a Python float or a CPU tensor: the amax is taken
    onto x's device, so every field of the result is on the GPU and its bytes are the CPU's."""
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(3))
    amax = {
        "float": float(x.abs().amax()),
        "cpu scalar": x.abs().amax(),
        "cpu rows": x.abs().amax(dim=-1, keepdim=True),
    }[how]
    cpu = quantize(x, "nvfp4", global_amax=amax)
    for check_amax in (True, False):
        gpu = quantize(x.cuda(), "nvfp4", global_amax=amax, check_amax=check_amax)
        for field in ("qdata", "scale", "global_scale"):
            assert getattr(gpu, field).device.type == "cuda", field
            assert_bytes_equal(getattr(gpu, field).cpu(), getattr(cpu, field), field)


def test_the_reference_defaults_are_one_global_scale_and_te_order():
    """quantize_nvfp4(x) with no options: one global scale for the tensor (shape []), TE order.
    Two rows of amax 2688 and 1344: S_enc = 1 for both (not 1 and 2 per row), so row 1's block
    scale is t = 1344 * fl(1/6) = 224.0000067 -> E4M3 224 (0x76), row 0's 448 (0x7E)."""
    x = torch.zeros(2, 16)
    x[0, 0], x[1, 0] = 2688.0, 1344.0
    q = quantize_nvfp4(x)
    assert q.global_scale.shape == () and q.global_scale.item() == 1.0
    assert q.scale.view(torch.uint8).tolist() == [[0x7E], [0x76]]


def test_the_reference_checks_a_caller_amax_by_default():
    """quantize_nvfp4 called directly checks a caller's amax as quantize does."""
    x = torch.ones(2, 16)
    with pytest.raises(ValueError, match="finite and non-negative"):
        quantize_nvfp4(x, global_amax=float("nan"))
    with pytest.raises(ValueError, match="below the amax of the data"):
        quantize_nvfp4(x, global_amax=0.5)


def test_torchao_global_scale_is_the_reciprocal_of_its_per_tensor_scale():
    """torchao mode (§3.5) stores 1 / per_tensor_scale, per_tensor_scale = amax / (448 * 6).
    By hand, amax 2688: per_tensor_scale = 1, S_enc = 1; block scale fl(2688 / 6) / 1 = 448
    (0x7E); enc = fl(1 / 448), 2688 * enc -> 6 (0x7), 448 * enc -> 1 (0x2); dequantized:
    6 * 448 * 1 = 2688 and 448. A caller's amax 5376: per_tensor_scale 2, S_enc 0.5, block
    scale 448 / 2 = 224 (0x76), enc = fl(fl(1/2) / 224) = fl(1/448): the same codes, e2m1 * 224
    is half of x and the global scale's S_dec = 2 gives x back."""
    x = torch.zeros(1, 16)
    x[0, :2] = torch.tensor([2688.0, 448.0])
    for amax, s_enc, byte in ((2688.0, 1.0, 0x7E), (5376.0, 0.5, 0x76)):
        q = quantize(x, "nvfp4", scale_mode="torchao", global_amax=amax)
        assert q.global_scale.item() == s_enc
        assert q.scale.view(torch.uint8).tolist() == [[byte]]
        assert codecs.unpack_nibbles(q.qdata)[0, :3].tolist() == [0x7, 0x2, 0x0]
        assert_bytes_equal(dequantize(q, global_scale=False), x * s_enc, "e2m1 * s_block")
        assert_bytes_equal(dequantize(q), x, "x back")


def test_torchao_clamps_an_overflowing_block_scale_to_448():
    """torchao clamps the block scale to [2^-6, 448] (§3.4). With an unchecked caller amax of
    1e-38, per_tensor_scale = 1e-38 / 2688 (subnormal) and 1000 / 6 over it is +Inf in fp32:
    the clamp makes it 448 (0x7E), where an unclamped +Inf would be the NaN byte 0x7F."""
    x = torch.zeros(1, 16)
    x[0, 0] = 1000.0
    q = quantize(x, "nvfp4", scale_mode="torchao", global_amax=1e-38, check_amax=False)
    assert q.scale.view(torch.uint8).tolist() == [[0x7E]]
