"""The sync wire format (mxrl/sync/wire.py) against docs/sync.md, with every byte worked out by
hand: a bucket's header JSON (key order, separators, each field's dtype, shape, 16-byte-aligned
offset and byte count), its payload bytes (zero padding included), the 64 KiB meta (4 x int64
little-endian, the header's sha256, the header inline when it fits), the refusals of headers that
do not describe their payload, and the layout both ends remember (headers without checksums, step
and event; its id the first 16 bytes of the sha256 of its JSON)."""

import hashlib
import json
import struct

import pytest
import torch

from mxrl.formats import QTensor
from mxrl.sync import pack_bucket, unpack_bucket, wire
from mxrl.weights import Bucket, QuantizationEvent, WeightRecord

# a bf16 [3]: 1.0, -2.0, 0.5 (0x3F80, 0xC000, 0x3F00, little-endian)
BF16_BYTES = [0x80, 0x3F, 0x00, 0xC0, 0x00, 0x3F]
# an NVFP4 [1, 16]: 8 packed code bytes, one E4M3 block scale 1.0 (0x38), global scale 2.0 fp32
NV_QDATA = [0x01, 0x23, 0x45, 0x67, 0x89, 0xAB, 0xCD, 0xEF]
NV_SCALE = [0x38]
NV_GLOBAL = [0x00, 0x00, 0x00, 0x40]
# an MXFP8 [1, 32]: 32 E4M3 bytes, one E8M0 scale 2^0 (127)
MX_QDATA = list(range(0x40, 0x60))
MX_SCALE = [0x7F]


def u8(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.uint8)


def bf16_value() -> torch.Tensor:
    return u8(BF16_BYTES).view(torch.bfloat16)


def nvfp4_value() -> QTensor:
    return QTensor(
        u8(NV_QDATA).reshape(1, 8),
        u8(NV_SCALE).view(torch.float8_e4m3fn).reshape(1, 1),
        "nvfp4",
        (1, 16),
        global_scale=u8(NV_GLOBAL).view(torch.float32).reshape(()),
    )


def mxfp8_value() -> QTensor:
    return QTensor(
        u8(MX_QDATA).reshape(1, 32),
        u8(MX_SCALE).view(torch.float8_e8m0fnu).reshape(1, 1),
        "mxfp8",
        (1, 32),
    )


EVENT = QuantizationEvent(
    step=7, plan_hash="p" * 64, num_tensors=2, num_bytes=19, seconds=0.25, sqnr_db={"layer.0": 30.5}
)


def two_records(**kw) -> Bucket:
    fields = dict(index=0, plan_hash="p" * 64, last=True, num_buckets=1, step=7, event=EVENT)
    fields.update(kw)
    records = (
        WeightRecord("a.weight", bf16_value(), "h1"),
        WeightRecord("b.weight", nvfp4_value(), "h2"),
    )
    return Bucket(records=records, **fields)


A_FIELDS = '[{"key":"","dtype":"bfloat16","shape":[3],"offset":0,"nbytes":6}]'
B_FIELDS = (
    '[{"key":"qdata","dtype":"uint8","shape":[1,8],"offset":16,"nbytes":8},'
    '{"key":"scale","dtype":"float8_e4m3fn","shape":[1,1],"offset":32,"nbytes":1},'
    '{"key":"global_scale","dtype":"float32","shape":[],"offset":48,"nbytes":4}]'
)
RECORDS_JSON = (
    f'[{{"name":"a.weight","hash":"h1","qtensor":false,"fields":{A_FIELDS}}},'
    f'{{"name":"b.weight","hash":"h2","qtensor":true,"fields":{B_FIELDS}}}]'
)
EVENT_JSON = (
    '{"step":7,"plan_hash":"' + "p" * 64 + '","num_tensors":2,"num_bytes":19,"seconds":0.25,'
    '"sqnr_db":{"layer.0":30.5}}'
)
HEADER = (
    '{"wire":5,"index":0,"last":true,"num_buckets":1,"plan_hash":"' + "p" * 64 + '","step":7,'
    f'"event":{EVENT_JSON},"payload_bytes":64,"records":{RECORDS_JSON}}}'
).encode()
# each field at its 16-byte-aligned offset, zeros between
PAYLOAD = BF16_BYTES + [0] * 10 + NV_QDATA + [0] * 8 + NV_SCALE + [0] * 15 + NV_GLOBAL + [0] * 12


def test_pack_writes_the_documented_header_and_payload_bytes():
    header, payload = pack_bucket(two_records())
    assert header == HEADER
    assert payload.dtype == torch.uint8 and payload.device.type == "cpu"
    assert payload.tolist() == PAYLOAD


def test_pack_a_middle_bucket_without_event():
    header, payload = pack_bucket(
        two_records(index=3, last=False, num_buckets=None, step=0, event=None)
    )
    assert (
        header
        == (
            '{"wire":5,"index":3,"last":false,"num_buckets":null,"plan_hash":"' + "p" * 64 + '",'
            f'"step":0,"event":null,"payload_bytes":64,"records":{RECORDS_JSON}}}'
        ).encode()
    )
    assert payload.tolist() == PAYLOAD


def test_pack_an_empty_bucket_and_a_field_of_exactly_sixteen_bytes():
    header, payload = pack_bucket(Bucket(index=1, plan_hash="q", records=(), last=False))
    assert header == (
        b'{"wire":5,"index":1,"last":false,"num_buckets":null,"plan_hash":"q","step":0,'
        b'"event":null,"payload_bytes":0,"records":[]}'
    )
    assert payload.dtype == torch.uint8 and payload.tolist() == []
    # 16 bytes take exactly one aligned slot, 17 two; an MXFP8 record's 32 bytes two
    f16 = torch.arange(4, dtype=torch.float32)
    i17 = u8(list(range(17)))
    records = (
        WeightRecord("x", f16, "1"),
        WeightRecord("y", i17, "2"),
        WeightRecord("z", mxfp8_value(), "3"),
    )
    header, payload = pack_bucket(Bucket(index=0, plan_hash="q", records=records, last=True))
    h = json.loads(header)
    offsets = [(f["key"], f["offset"], f["nbytes"]) for r in h["records"] for f in r["fields"]]
    assert offsets == [("", 0, 16), ("", 16, 17), ("qdata", 48, 32), ("scale", 80, 1)]
    assert h["payload_bytes"] == 96 and payload.numel() == 96
    raw = payload.tolist()
    assert raw[0:16] == list(f16.view(torch.uint8).tolist())
    assert raw[16:33] == list(range(17)) and raw[33:48] == [0] * 15
    assert raw[48:80] == MX_QDATA and raw[80:81] == MX_SCALE and raw[81:] == [0] * 15


def test_pack_copies_non_contiguous_and_column_views_in_logical_order():
    base = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    t = base.t()  # [3, 2], not contiguous: 0, 3, 1, 4, 2, 5
    header, payload = pack_bucket(Bucket(0, "q", (WeightRecord("t", t, "h"),), True))
    want = torch.tensor([0.0, 3.0, 1.0, 4.0, 2.0, 5.0]).view(torch.uint8).tolist()
    assert payload.tolist() == want + [0] * 8
    assert json.loads(header)["records"][0]["fields"][0]["shape"] == [3, 2]


def test_pack_a_tensor_that_requires_grad():
    t = torch.ones(2, dtype=torch.float32, requires_grad=True)
    _, payload = pack_bucket(Bucket(0, "q", (WeightRecord("t", t, "h"),), True))
    assert payload.tolist() == [0, 0, 0x80, 0x3F] * 2 + [0] * 8


def test_unpack_rebuilds_the_bucket_as_views_of_the_payload():
    payload = u8(PAYLOAD)
    bucket = unpack_bucket(HEADER, payload)
    assert (bucket.index, bucket.plan_hash, bucket.last, bucket.num_buckets, bucket.step) == (
        0, "p" * 64, True, 1, 7,
    )  # fmt: skip
    assert bucket.event == EVENT
    a, b = bucket.records
    assert (a.name, a.hash, b.name, b.hash) == ("a.weight", "h1", "b.weight", "h2")
    assert a.value.dtype == torch.bfloat16 and a.value.tolist() == [1.0, -2.0, 0.5]
    assert isinstance(b.value, QTensor)
    assert (b.value.fmt.value, tuple(b.value.shape), b.value.axis) == ("nvfp4", (1, 16), -1)
    assert b.value.qdata.tolist() == [NV_QDATA]
    assert b.value.scale.view(torch.uint8).tolist() == [NV_SCALE]
    assert b.value.global_scale.dim() == 0 and b.value.global_scale.item() == 2.0
    # views: a byte of the payload written afterwards shows in the records
    payload[0] = 0x00
    payload[17] = 0xFF
    assert a.value.view(torch.uint8).tolist()[0] == 0 and b.value.qdata[0, 1].item() == 0xFF


def test_unpack_a_middle_bucket_keeps_none_for_num_buckets_and_event():
    header, payload = pack_bucket(
        two_records(index=2, last=False, num_buckets=None, step=5, event=None)
    )
    bucket = unpack_bucket(header, payload)
    assert (bucket.index, bucket.last, bucket.num_buckets, bucket.step, bucket.event) == (
        2, False, None, 5, None,
    )  # fmt: skip


def test_unpack_converts_the_header_fields_to_their_types():
    h = json.loads(HEADER)
    h.update(index="4", step="9", last=1, plan_hash=12, event=None)
    h["records"][0]["hash"] = 34
    h["records"][0]["fields"][0].update(offset="0", nbytes="6", shape=["3"])
    bucket = unpack_bucket(json.dumps(h).encode(), u8(PAYLOAD))
    assert (bucket.index, bucket.step, bucket.last, bucket.plan_hash) == (4, 9, True, "12")
    assert bucket.records[0].hash == "34" and bucket.records[1].hash == "h2"
    assert bucket.records[0].value.tolist() == [1.0, -2.0, 0.5]


def test_unpack_refuses_another_wire_version_and_another_payload_length():
    for version in (4, 6):
        h = json.loads(HEADER)
        h["wire"] = version
        with pytest.raises(ValueError, match=f"wire version {version}, this mxrl speaks 5"):
            unpack_bucket(json.dumps(h).encode(), u8(PAYLOAD))
    for n in (48, 63, 65, 80):
        with pytest.raises(ValueError, match=f"header says 64 payload bytes, got {n}"):
            unpack_bucket(HEADER, torch.zeros(n, dtype=torch.uint8))


@pytest.mark.parametrize(
    "header",
    [
        b"\xff\xfe",  # not UTF-8
        b'{"wire":5',  # not JSON
        b"[5]",  # not an object: TypeError on h["wire"]
        HEADER.replace(b'"event":', b'"evnt":'),  # a key missing
        HEADER.replace(b'"records":[', b'"records":7,"x":['),  # records not a list
        HEADER.replace(b'"index":0', b'"index":null'),  # int(None)
        HEADER.replace(b'"step":7,"event"', b'"step":null,"event"'),
        HEADER.replace(b'"name":"a.weight"', b'"nam":"a.weight"'),
        HEADER.replace(b'"offset":0', b'"offset":null'),
    ],
)
def test_unpack_refuses_a_malformed_header(header):
    with pytest.raises(ValueError, match=r"malformed bucket header .*; the update is refused"):
        unpack_bucket(header, u8(PAYLOAD))


def view(fields, qtensor=False, name="r", payload_len=64) -> WeightRecord:
    r = {"name": name, "hash": "h", "qtensor": qtensor, "fields": fields}
    return wire.record_views(r, torch.arange(payload_len, dtype=torch.uint8))


def field(key="", dtype="float32", shape=(4,), offset=0, nbytes=16):
    return {"key": key, "dtype": dtype, "shape": list(shape), "offset": offset, "nbytes": nbytes}


@pytest.mark.parametrize(
    "dtype",
    ["uint8", "int8", "float32", "float16", "bfloat16", "float64", "float8_e4m3fn",
     "float8_e5m2", "float8_e8m0fnu"],
)  # fmt: skip
def test_record_views_takes_the_dtypes_a_record_uses(dtype):
    want = getattr(torch, dtype)
    n = 16 // want.itemsize
    record = view([field(dtype=dtype, shape=(n,), offset=16, nbytes=16)])
    assert record.value.dtype == want and tuple(record.value.shape) == (n,)
    assert record.value.view(torch.uint8).tolist() == list(range(16, 32))


@pytest.mark.parametrize("dtype", ["int32", "int64", "complex64", "bool", "torch.float32", ""])
def test_record_views_refuses_other_dtypes(dtype):
    with pytest.raises(ValueError, match=f"r: dtype '{dtype}' is not one a weight record uses"):
        view([field(dtype=dtype)])


def test_record_views_a_field_at_the_end_of_the_payload_fits_one_byte_more_does_not():
    record = view([field(offset=48, nbytes=16)])
    assert record.value.view(torch.uint8).tolist() == list(range(48, 64))
    assert record.name == "r" and record.hash == "h"
    with pytest.raises(ValueError, match=r"r\.: field does not fit the payload"):
        view([field(offset=48, nbytes=16)], payload_len=63)
    with pytest.raises(ValueError, match="does not fit"):
        view([field(offset=64, shape=(1,), nbytes=4)])
    assert view([field(offset=48, shape=(), nbytes=4)], payload_len=52).value.dim() == 0


@pytest.mark.parametrize("offset", [1, 4, 8, 15, 17, 24])
def test_record_views_refuses_an_offset_off_the_sixteen_byte_grid(offset):
    with pytest.raises(ValueError, match="does not fit"):
        view([field(offset=offset, shape=(1,), nbytes=4)])


@pytest.mark.parametrize(("shape", "nbytes"), [((4,), 15), ((4,), 17), ((2, 2), 8), ((5,), 16)])
def test_record_views_refuses_a_byte_count_that_is_not_the_shapes(shape, nbytes):
    with pytest.raises(ValueError, match="does not fit"):
        view([field(shape=shape, nbytes=nbytes)])


def test_record_views_a_qtensor_from_its_fields_and_its_refusals():
    fields = [
        field("qdata", "uint8", (1, 32), 0, 32),
        field("scale", "float8_e8m0fnu", (1, 1), 32, 1),
    ]
    record = view(fields, qtensor=True, name="m.w")
    assert record.name == "m.w" and record.hash == "h"
    assert record.value.fmt.value == "mxfp8" and tuple(record.value.shape) == (1, 32)
    assert record.value.qdata.tolist() == [list(range(32))]
    assert record.value.scale.view(torch.uint8).tolist() == [[32]]
    assert record.value.global_scale is None
    # a plain field under a key is not a plain record
    with pytest.raises(ValueError, match=r"m\.w: its fields are not a QTensor .*refused"):
        view(fields[:1], qtensor=True, name="m.w")  # KeyError: no scale
    with pytest.raises(ValueError, match="not a QTensor"):  # TypeError: no format's scale
        view([fields[0], field("scale", "float16", (1, 1), 32, 2)], qtensor=True, name="m.w")
    with pytest.raises(ValueError, match="not a QTensor"):  # ValueError: NVFP4 without global
        view([fields[0], field("scale", "float8_e4m3fn", (1, 2), 32, 2)], qtensor=True)
    with pytest.raises(KeyError):  # a plain record's field carries no key
        view([field("qdata")], qtensor=False)


def meta_of(flags, header, payload_len) -> bytes:
    """The meta as docs/sync.md describes it, built here from the description."""
    head = (
        (5).to_bytes(8, "little")
        + flags.to_bytes(8, "little")
        + len(header).to_bytes(8, "little")
        + payload_len.to_bytes(8, "little")
        + hashlib.sha256(header).digest()
    )
    inline = header if len(header) <= 65536 - 64 else b""
    return (head + inline).ljust(65536, b"\0")


@pytest.mark.parametrize(("flags", "payload_len"), [(0, 0), (1, 64), (2, 2**40 + 3)])
def test_the_meta_holds_the_head_and_the_header(flags, payload_len):
    meta = wire.meta_message(flags, HEADER, payload_len, torch.device("cpu"))
    assert meta.dtype == torch.uint8 and meta.shape == (65536,)
    assert bytes(meta.tolist()) == meta_of(flags, HEADER, payload_len)


def test_a_header_of_exactly_the_room_left_travels_inline_one_byte_more_does_not():
    room = 65536 - 64
    assert wire.META_BYTES == 65536 and wire.HEAD_BYTES == 64
    assert wire.fits_inline(room) and wire.fits_inline(0)
    assert not wire.fits_inline(room + 1)
    fits, longer = b"x" * room, b"y" * (room + 1)
    meta = bytes(wire.meta_message(1, fits, 0, torch.device("cpu")).tolist())
    assert meta == meta_of(1, fits, 0) and meta[64:] == fits
    meta = bytes(wire.meta_message(1, longer, 0, torch.device("cpu")).tolist())
    assert meta == meta_of(1, longer, 0) and meta[64:] == bytes(room)
    assert struct.unpack_from("<4q", meta) == (5, 1, room + 1, 0)


def test_the_layout_is_the_headers_without_checksums_step_and_event():
    h0 = json.loads(HEADER)
    h1 = json.loads(pack_bucket(two_records(index=1, step=3, event=None, plan_hash="z"))[0])
    layout = wire.PayloadLayout.of([h0, h1])
    a_fields, b_fields = json.loads(A_FIELDS), json.loads(B_FIELDS)
    records = [
        {"name": "a.weight", "qtensor": False, "fields": a_fields},
        {"name": "b.weight", "qtensor": True, "fields": b_fields},
    ]
    assert layout.buckets == (
        {"plan_hash": "p" * 64, "payload_bytes": 64, "records": records},
        {"plan_hash": "z", "payload_bytes": 64, "records": records},
    )
    assert layout.plan_hash == "p" * 64  # the first bucket's
    text = (
        '[{"plan_hash":"' + "p" * 64 + '","payload_bytes":64,"records":'
        f'[{{"name":"a.weight","qtensor":false,"fields":{A_FIELDS}}},'
        f'{{"name":"b.weight","qtensor":true,"fields":{B_FIELDS}}}]}},'
        '{"plan_hash":"z","payload_bytes":64,"records":'
        f'[{{"name":"a.weight","qtensor":false,"fields":{A_FIELDS}}},'
        f'{{"name":"b.weight","qtensor":true,"fields":{B_FIELDS}}}]}}]'
    )
    assert layout.id == hashlib.sha256(text.encode()).digest()[:16]
    assert len(layout.id) == 16


def test_updates_that_differ_only_in_values_share_a_layout_and_others_do_not():
    def layout(**kw):
        return wire.PayloadLayout.of([json.loads(pack_bucket(two_records(**kw))[0])])

    base = layout()
    other_values = two_records(step=8, event=None)
    other_values = Bucket(
        index=0, plan_hash="p" * 64, last=True, num_buckets=1, step=8,
        records=(WeightRecord("a.weight", -bf16_value(), "h9"), other_values.records[1]),
    )  # fmt: skip
    same = wire.PayloadLayout.of([json.loads(pack_bucket(other_values)[0])])
    assert same == base and same.id == base.id
    assert layout(plan_hash="q").id != base.id
    assert wire.PayloadLayout.of([json.loads(pack_bucket(two_records())[0])] * 2).id != base.id


def test_the_layout_plan_hash_is_a_string():
    h = json.loads(HEADER)
    h["plan_hash"] = 42
    assert wire.PayloadLayout.of([h]).plan_hash == "42"


@pytest.mark.gpu
def test_the_meta_and_the_payload_are_on_the_device_asked_for():
    """NCCL broadcasts CUDA tensors only: the meta and the payload on the communicator's
    device, the same bytes as on the CPU."""
    cuda = torch.device("cuda", torch.cuda.current_device())
    meta = wire.meta_message(1, HEADER, 64, cuda)
    assert meta.device == cuda and bytes(meta.cpu().tolist()) == meta_of(1, HEADER, 64)
    header, payload = pack_bucket(two_records(), cuda)
    assert header == HEADER and payload.device == cuda and payload.cpu().tolist() == PAYLOAD
