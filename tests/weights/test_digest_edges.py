"""Edges of the record checksum (mxrl/weights/digest.py), from the mutation run (issue 33,
docs/mutation/weights.digest.md): each checksum against sha256 of the layout the module
docstring documents, written out by hand here (the header's lines, the 0x00, each field's
64-byte digest in field order), the refusals of the inputs it documents, `verified_records`
and `weights_digest` against their documented definitions.

The field digests come from `mxrl.kernels.digest.field_digest_reference` (its own tests,
tests/kernels/test_digest_kernel.py, hold it to its algorithm): what is under test here is how
mxrl/weights/digest.py frames them, not the digest of one tensor."""

import hashlib
import importlib

import pytest
import torch

from mxrl.formats import quantize
from mxrl.weights import PendingChecksums, WeightRecord, checksum, checksums, verified_records
from mxrl.weights.record import VerifiedRecord

digest = importlib.import_module("mxrl.weights.digest")  # the module, not the function
levels = importlib.import_module("mxrl.kernels.digest")


def field(t: torch.Tensor) -> bytes:
    """One field's 64 bytes (the kernels module's reference, the oracle of the CUDA kernel)."""
    out = levels.field_digest_reference(t).numpy().tobytes()
    assert len(out) == 64
    return out


def expected(header: bytes, *fields: torch.Tensor) -> str:
    """sha256(header ‖ 0x00 ‖ the fields' digests), the module docstring's definition."""
    return hashlib.sha256(header + b"\x00" + b"".join(field(t) for t in fields)).hexdigest()


X = torch.arange(64, dtype=torch.float32).view(2, 32) / 8 - 4  # exact in every format


def test_a_plain_tensor_checksum_is_the_documented_sha256():
    x = torch.tensor([[1.0, -2.0, 3.5]], dtype=torch.float32)
    head = b'mxrl-checksum-v2\nname|"w"\ntensor|torch.float32|(1, 3)\n|torch.float32|(1, 3)'
    assert digest.header("w", x) == head
    assert checksum("w", x) == expected(head, x)
    zero_d = torch.tensor(2.0, dtype=torch.bfloat16)
    head0 = b'mxrl-checksum-v2\nname|"s"\ntensor|torch.bfloat16|()\n|torch.bfloat16|()'
    assert digest.header("s", zero_d) == head0
    assert checksum("s", zero_d) == expected(head0, zero_d)


def test_an_nvfp4_checksum_is_the_documented_sha256_over_its_three_fields():
    q = quantize(X, "nvfp4")  # global_scale 0-d
    assert q.global_scale.shape == ()
    head = (
        b'mxrl-checksum-v2\nname|"model.w"\nqtensor|nvfp4|(2, 32)|-1\n'
        b"qdata|torch.uint8|(2, 16)\nscale|torch.float8_e4m3fn|(2, 2)\n"
        b"global_scale|torch.float32|()"
    )
    assert digest.header("model.w", q) == head
    assert checksum("model.w", q) == expected(head, q.qdata, q.scale, q.global_scale)


def test_an_mxfp8_column_wise_checksum_binds_its_axis():
    q = quantize(X.T.contiguous(), "mxfp8", axis=0)  # [32, 2], blocks of 32 down the columns
    head = (
        b'mxrl-checksum-v2\nname|"w"\nqtensor|mxfp8|(32, 2)|0\n'
        b"qdata|torch.uint8|(32, 2)\nscale|torch.float8_e8m0fnu|(1, 2)"
    )
    assert digest.header("w", q) == head
    assert checksum("w", q) == expected(head, q.qdata, q.scale)


def test_a_name_is_json_quoted_in_the_header():
    x = torch.zeros(1)
    head = (
        b'mxrl-checksum-v2\nname|"a\\"b\\n\\u00e9"\ntensor|torch.float32|(1,)\n|torch.float32|(1,)'
    )
    assert digest.header('a"b\n\u00e9', x) == head
    assert checksum('a"b\n\u00e9', x) == expected(head, x)


@pytest.mark.parametrize("name", [b"w", 3, None])
def test_a_name_that_is_not_a_str_is_refused(name):
    with pytest.raises(TypeError, match="must be a str"):
        digest.header(name, torch.zeros(1))
    with pytest.raises(TypeError, match="must be a str"):
        checksum(name, torch.zeros(1))


def test_names_must_be_one_per_value_and_not_one_str():
    x, y = torch.zeros(1), torch.ones(1)
    with pytest.raises(TypeError, match="one record name per value"):
        checksums("ab", [x, y])  # a str of two characters is not two names
    with pytest.raises(TypeError, match="one record name per value"):
        checksums(["a", "b", "c"], [x, y])
    with pytest.raises(TypeError, match="one record name per value"):
        PendingChecksums(["a"], [x, y])
    assert checksums([], []) == []


def test_the_backend_reaches_the_field_digests():
    """An unknown backend is refused by the kernels' backend selection: it was passed on."""
    x = torch.zeros(3)
    for call in (
        lambda: checksum("a", x, backend="bogus"),
        lambda: checksums(["a"], [x], backend="bogus"),
        lambda: PendingChecksums(["a"], [x], "bogus"),
    ):
        with pytest.raises(ValueError, match="unknown kernel backend"):
            call()
    assert checksum("a", x, backend="reference") == checksum("a", x)


def test_many_records_of_many_fields_are_each_their_own_sha256():
    """Fields of several records, digested in one batch, go back to their own record and
    position: 3, 1, 2 and 3 fields."""
    g = torch.Generator().manual_seed(5)
    a = quantize(torch.randn(4, 64, generator=g), "nvfp4", per_token=True)
    b = torch.randn(3, 5, generator=g)
    c = quantize(torch.randn(2, 64, generator=g), "mxfp8")
    d = quantize(torch.randn(2, 32, generator=g), "nvfp4")
    names, values = ["a", "b", "c", "d"], [a, b, c, d]
    want = [
        expected(digest.header("a", a), a.qdata, a.scale, a.global_scale),
        expected(digest.header("b", b), b),
        expected(digest.header("c", c), c.qdata, c.scale),
        expected(digest.header("d", d), d.qdata, d.scale, d.global_scale),
    ]
    assert checksums(names, values) == want
    assert PendingChecksums(names, values).wait() == want
    # the same fields in another order of records: each still its own
    assert checksums(names[::-1], values[::-1]) == want[::-1]


def _record(name: str, value) -> WeightRecord:
    return WeightRecord(name, value, checksum(name, value))


def test_verified_records_keep_name_value_and_hash_in_order():
    x, y = torch.randn(2, 3), quantize(X, "mxfp8")
    records = [_record("x", x), _record("y", y)]
    out = verified_records(records, [r.hash for r in records])
    assert isinstance(out, tuple) and len(out) == 2
    for got, want in zip(out, records, strict=True):
        assert type(got) is VerifiedRecord
        assert (got.name, got.value, got.hash) == (want.name, want.value, want.hash)
    assert verified_records([], []) == ()


def test_verified_records_refuse_a_mismatch_naming_the_first_and_counting_the_rest():
    records = [_record(n, torch.full((2,), float(i))) for i, n in enumerate("abcd")]
    sums = [r.hash for r in records]
    one = [sums[0], "0" * 64, sums[2], sums[3]]
    with pytest.raises(ValueError) as e:
        verified_records(records, one)
    msg = str(e.value)
    assert msg.startswith("b: checksum mismatch: it carries " + records[1].hash[:16])
    assert "give " + "0" * 16 in msg and "more" not in msg
    three = [sums[0], "1" * 64, "2" * 64, "3" * 64]
    with pytest.raises(ValueError, match=r"^b: checksum mismatch.*give 1{16} .*, and 2 more;"):
        verified_records(records, three)
    with pytest.raises(ValueError):  # one sum per record (zip strict)
        verified_records(records, sums[:3])


def test_weights_digest_is_sha256_of_the_sorted_pairs():
    pairs = [("b", "22"), ("a", "11"), ("c", "33")]
    want = hashlib.sha256(b"a\x0011\nb\x0022\nc\x0033\n").hexdigest()
    assert digest.weights_digest(pairs) == want
    assert digest.weights_digest(iter(dict(pairs).items())) == want  # any iterable, any order
    assert digest.weights_digest([]) == hashlib.sha256(b"").hexdigest()


def test_a_tensor_without_bytes_has_no_checksum():
    """A device other than the CPU and CUDA has its digests copied to the host; a meta tensor
    (no data) is refused there, by that copy, rather than read or given a checksum."""
    with pytest.raises(NotImplementedError):
        checksum("w", torch.zeros(3, device="meta"))


@pytest.mark.gpu
def test_values_on_another_gpu_than_the_current_one_are_read_after_their_copy():
    """The digests of values on cuda:1, taken while cuda:0 is the current device: the event
    the host waits on is recorded on cuda:1's stream, behind the copy (an event on cuda:0's
    stream would let the host read the pinned buffer before the copy is done)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    g = torch.Generator().manual_seed(4)
    host = [
        torch.randint(0, 256, (64 * 2**20 + i,), dtype=torch.uint8, generator=g) for i in range(3)
    ]
    names = ["a", "b", "c"]
    want = checksums(names, host)
    with torch.cuda.device(0):
        for _ in range(3):
            assert checksums(names, [t.to("cuda:1") for t in host]) == want


def test_a_header_formatted_once_per_layout_is_the_one_formatted_each_time():
    """`header` keeps each (name, layout) it formatted: the same name with another format,
    axis, shape or field dtype gets its own, equal to formatting it anew."""
    values = [
        torch.zeros(2, 32),
        torch.zeros(2, 32, dtype=torch.bfloat16),
        torch.zeros(32, 2),
        quantize(X, "mxfp8"),
        quantize(X.T.contiguous(), "mxfp8", axis=0),
        quantize(X, "nvfp4"),
        quantize(X, "fp8_block", block=(1, 32)),
    ]
    heads = [digest.header("w", v) for v in values]
    assert len(set(heads)) == len(values)
    for v, head in zip(values * 2, heads * 2, strict=True):  # the second pass: kept ones
        assert digest.header("w", v) == head == digest._header("w", v)
    assert digest.header("v", values[0]) == digest._header("v", values[0]) != heads[0]

    class Name(str):  # not exactly a str: formatted each time, the same text
        pass

    assert digest.header(Name("w"), values[0]) == heads[0]


_FORMAT = digest._header  # the header formatted now, no memo (a test may stand in for it)


def _fresh(name, value) -> bytes:
    return _FORMAT(name, value)


def test_the_header_memo_formats_each_name_and_layout_once(monkeypatch):
    """`header` formats a (name, layout) once and hands the same text back; a name that is not
    exactly a str (a subclass could format itself otherwise) is formatted every time."""
    monkeypatch.setattr(digest, "_HEADERS", {})
    calls = []
    monkeypatch.setattr(digest, "_header", lambda n, v: calls.append(n) or _fresh(n, v))
    q = quantize(X, "mxfp8")
    first = digest.header("m.w", q)
    assert digest.header("m.w", q) == first == _fresh("m.w", q) and calls == ["m.w"]
    assert digest.header("m.b", X) == _fresh("m.b", X)
    assert digest.header("m.b", X.clone()) == _fresh("m.b", X) and calls == ["m.w", "m.b"]

    class Name(str):
        pass

    digest.header(Name("m.w"), q)
    digest.header(Name("m.w"), q)
    assert calls == ["m.w", "m.b", "m.w", "m.w"]


def test_the_header_memo_tells_apart_every_input_of_the_text(monkeypatch):
    """Values that differ only in the name, the format, the shape, the axis, a field's dtype or
    shape, or the global scale's shape each get their own text, whatever came before."""
    monkeypatch.setattr(digest, "_HEADERS", {})
    w = torch.arange(2 * 32 * 32, dtype=torch.float32).view(2, 32, 32) / 64 - 8
    per_tensor = quantize(w, "nvfp4")
    per_expert = quantize(w, "nvfp4", global_amax=w.abs().amax(dim=(1, 2), keepdim=True))
    assert per_tensor.global_scale.shape != per_expert.global_scale.shape
    y = torch.arange(32 * 64, dtype=torch.float32).view(32, 64) / 256 - 4
    values = [
        ("m.w", quantize(y, "mxfp8")),
        ("m.v", quantize(y, "mxfp8")),  # another name
        ("m.w", quantize(y, "mxfp8", axis=0)),  # another axis
        ("m.w", quantize(y, "nvfp4")),  # another format
        ("m.w", quantize(y.reshape(64, 32), "mxfp8")),  # another shape
        ("m.w", X),
        ("m.w", X.to(torch.bfloat16)),  # another dtype
        ("m.e", per_tensor),
        ("m.e", per_expert),  # the global scale's shape alone
    ]
    for name, value in values + values[::-1]:
        assert digest.header(name, value) == _fresh(name, value), name


def test_the_header_memo_is_bounded(monkeypatch):
    """At `_MAX_HEADERS` entries the memo starts again, so it never holds more."""
    monkeypatch.setattr(digest, "_HEADERS", {})
    monkeypatch.setattr(digest, "_MAX_HEADERS", 2)
    for i in range(5):
        digest.header(f"m.{i}", X)
        assert len(digest._HEADERS) <= 2


@pytest.mark.gpu
def test_values_on_the_cpu_and_a_gpu_are_checksummed_per_device_in_one_call():
    """One batch of digests per device, read back in the values' order."""
    cpu = torch.arange(5000, dtype=torch.int32)
    gpu = torch.arange(3000, dtype=torch.int16).cuda()
    names = ["on.cpu", "on.gpu", "on.cpu.too"]
    values = [cpu, gpu, cpu[1:]]
    assert checksums(names, values) == [checksum(n, v) for n, v in zip(names, values, strict=True)]
