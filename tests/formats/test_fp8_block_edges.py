"""Edge cases of DeepSeek-style block FP8 found by mutation testing (docs/mutation/README.md): each
expectation is worked out by hand from the DeepGEMM rule of spec §5.2 (sf = fl(max(amax, 1e-4) /
448), q = E4M3(x * fl(1 / sf)); ue8m0: sf rounded up to 2^k) and docs/formats.md, never from the
function under test."""

from __future__ import annotations

import pytest
import torch

from mxrl.formats import QTensor, dequantize, quantize
from mxrl.formats.constants import FLT_MAX
from mxrl.formats.fp8_block import dequantize_fp8_block, quantize_fp8_block
from tests.numerics import assert_bytes_equal

pytestmark = pytest.mark.capability  # byte-exact on every CPU capability (tests/numeric_env.py)

# fl(300 / 448) = 0.66964287 (0x3F2B6DB7): not a power of two, so fp32 and ue8m0 scales differ
SF_300 = 0.66964287


def _two_blocks() -> tuple[torch.Tensor, torch.Tensor]:
    """256 values in two blocks of 128 and their E4M3 bytes, by hand. Block 0: 448, -1.5, 2^-9,
    then 1.0 (amax 448: sf = 448 / 448 = 1, the values are E4M3 values already: 0x7E, 0xBC,
    0x01, 0x38). Block 1: 224, -0.75, then 0.5 (amax 224: sf = 1/2, so fl(1 / sf) = 2 doubles
    them: 448 -> 0x7E, -1.5 -> 0xBC, 1.0 -> 0x38)."""
    x = torch.cat([torch.full((128,), 1.0), torch.full((128,), 0.5)])
    x[0], x[1], x[2] = 448.0, -1.5, 2.0**-9
    x[128], x[129] = 224.0, -0.75
    codes = torch.cat([torch.full((128,), 0x38), torch.full((128,), 0x38)]).to(torch.uint8)
    codes[0], codes[1], codes[2], codes[128], codes[129] = 0x7E, 0xBC, 0x01, 0x7E, 0xBC
    return x, codes


def test_a_one_d_activation_quantizes_and_dequantizes():
    """A 1-D x [256] in (1, 128) blocks (one token; stored_layout allows it: a (1, b) block needs
    no rows): scale [2] = [1, 1/2], the hand bytes above, and dequantize gives x back (every value
    is representable). Dequantize used to read x's row count, shape[-2], before knowing the block
    had none, and raised IndexError on every 1-D tensor."""
    x, codes = _two_blocks()
    q = quantize_fp8_block(x, (1, 128))
    assert q.block == (1, 128)
    assert_bytes_equal(q.scale, torch.tensor([1.0, 0.5]), "scale")
    assert_bytes_equal(q.qdata, codes, "data")
    assert_bytes_equal(dequantize_fp8_block(q), x, "dequantized")
    assert_bytes_equal(dequantize(quantize(x, "fp8_block", block=(1, 128))), x, "through the api")


def test_the_defaults_are_128x128_blocks_and_fp32_scales():
    """quantize_fp8_block(x) with no block or scale_mode: (128, 128) blocks over the last two
    dims and fp32 scales. x [256, 128]: rows 0-127 are the hand block 0 laid over each row
    (amax 448, sf 1); rows 128-255 are 1.0 but 300 at [128, 0] and -150 at [200, 5] (amax 300:
    sf = fl(300/448) = 0.66964287, fl(1 / sf) = 1.4933333; 300 -> 448.0 (0x7E), -150 ->
    -224.0 (0xF6), 1.0 -> 1.4933, nearer E4M3 1.5 (0x3C) than 1.375). ue8m0 would have rounded
    that sf up to 1."""
    x = torch.ones(256, 128)
    x[:128, 0], x[:128, 1], x[:128, 2] = 448.0, -1.5, 2.0**-9
    x[128, 0], x[200, 5] = 300.0, -150.0
    q = quantize_fp8_block(x)
    assert q.block == (128, 128) and q.scale.shape == (2, 1)
    assert_bytes_equal(q.scale, torch.tensor([[1.0], [SF_300]]), "scale")
    want = torch.full((256, 128), 0x38, dtype=torch.uint8)
    want[:128, 0], want[:128, 1], want[:128, 2] = 0x7E, 0xBC, 0x01
    want[128:] = 0x3C
    want[128, 0], want[200, 5] = 0x7E, 0xF6
    assert_bytes_equal(q.qdata, want, "data")
    ue8m0 = quantize_fp8_block(x, scale_mode="ue8m0")  # for contrast: sf 2^0, 300 -> 288 (0x79)
    assert ue8m0.scale.tolist() == [[1.0], [1.0]] and int(ue8m0.qdata[128, 0]) == 0x79


def test_an_amax_below_the_floor_is_scaled_as_1e_4():
    """amax 5e-5 < 1e-4: sf = fl(fl32(1e-4) / 448) = 2.2321429e-07, and 5e-5 * fl(1 / sf) = 224
    (1.75 * 2^7: 0x76; -5e-5: 0xF6), half the range, where its own amax would give 448."""
    x = torch.zeros(1, 128)
    x[0, 0], x[0, 1] = 5e-5, -5e-5
    q = quantize_fp8_block(x, (1, 128))
    assert_bytes_equal(q.scale, torch.tensor([[2.2321429e-07]]), "scale")
    assert q.qdata[0, :2].tolist() == [0x76, 0xF6] and (q.qdata[0, 2:] == 0).all()


def test_ue8m0_at_the_top_caps_the_elements_of_that_block_only():
    """docs/formats.md, "The top of the fp32 range": a (1, 128) block holding FLT_MAX gets
    sf = fl(FLT_MAX / 448) = 7.6e35 = 2^119.19, rounded up to 2^120; FLT_MAX * 2^-120 = 255.99
    would round to 256 (+Inf once scaled) and is stored as 240 (0x77), -FLT_MAX as 0xF7. The
    next block (amax 448: sf 1) keeps 448 (0x7E): the cap is per block."""
    x = torch.ones(1, 256)
    x[0, 0], x[0, 1], x[0, 128] = FLT_MAX, -FLT_MAX, 448.0
    q = quantize_fp8_block(x, (1, 128), scale_mode="ue8m0")
    assert q.scale.tolist() == [[2.0**120, 1.0]]
    assert q.qdata[0, [0, 1, 2, 128, 129]].tolist() == [0x77, 0xF7, 0x00, 0x7E, 0x38]
    assert torch.isfinite(dequantize_fp8_block(q)).all()


def test_a_partial_row_block_takes_its_amax_from_the_rows_it_has():
    """x [130, 128] in (128, 128) blocks: the second row-block holds rows 128 and 129 only
    (amax 224 at [129, 3]: sf 1/2, so 224 -> 448 (0x7E) and 0.5 -> 1.0 (0x38)); the first,
    rows 0-127 of 448 at [0, 0] and 1.0, sf 1. Dequantize gives x back."""
    x = torch.ones(130, 128)
    x[0, 0] = 448.0
    x[128:] = 0.5
    x[129, 3] = 224.0
    q = quantize_fp8_block(x, (128, 128))
    assert_bytes_equal(q.scale, torch.tensor([[1.0], [0.5]]), "scale")
    assert q.qdata[128:].unique().tolist() == [0x38, 0x7E] and int(q.qdata[129, 3]) == 0x7E
    assert int(q.qdata[0, 0]) == 0x7E and (q.qdata[1:128] == 0x38).all()
    assert_bytes_equal(dequantize_fp8_block(q), x, "dequantized")


def test_dequantize_hand_built_qtensors_with_and_without_a_partial_row_block():
    """Codes 0x38 (1.0) everywhere, in (2, 2) blocks, so each element is its block's scale.
    [4, 4] with scales [[1, 2], [4, 8]]: the rows divide into blocks (the transpose-free path).
    [5, 4] with scales [[1, 2], [4, 8], [16, 32]]: row 4 is a block of one row (5 % 2 = 1;
    the padded path), which must take the third row of scales."""
    q = QTensor(
        qdata=torch.full((4, 4), 0x38, dtype=torch.uint8),
        scale=torch.tensor([[1.0, 2.0], [4.0, 8.0]]),
        fmt="fp8_block",
        shape=(4, 4),
    )
    want = torch.tensor([[1.0, 1.0, 2.0, 2.0]] * 2 + [[4.0, 4.0, 8.0, 8.0]] * 2)
    assert_bytes_equal(dequantize_fp8_block(q), want, "dequantized")
    q = QTensor(
        qdata=torch.full((5, 4), 0x38, dtype=torch.uint8),
        scale=torch.tensor([[1.0, 2.0], [4.0, 8.0], [16.0, 32.0]]),
        fmt="fp8_block",
        shape=(5, 4),
    )
    assert q.block == (2, 2)
    want = torch.cat([want, torch.tensor([[16.0, 16.0, 32.0, 32.0]])])
    assert_bytes_equal(dequantize_fp8_block(q), want, "dequantized, partial")
