"""The torch.distributed sync (mxrl/sync/broadcast.py, broadcast_receive.py) inside one process:
every rank a thread, torch.distributed stood in for by tests/sync/fake_dist.py (queues and a
barrier, each collective logged), engine ranks on a stand-in engine, updates of hand-built
buckets (a bf16, an MXFP8, an empty bucket, an fp32 and an NVFP4 record). Each test holds what
docs/sync.md says of the protocol: the collectives of each mode in order with their sizes (worked
out by hand from the records' bytes), the layout agreement, the bytes each engine rank receives,
every refusal on both ends with nothing loaded, and the sender's bound on the payloads alive. The
real gloo ranks (spawned processes, a real engine) are test_broadcast.py's."""

import dataclasses
import json

import pytest
import torch

import mxrl.sync.broadcast as broadcast
import mxrl.sync.broadcast_receive as broadcast_receive
import mxrl.sync.transport as transport
from mxrl.formats import QTensor
from mxrl.sync import BroadcastReceiver, BroadcastSender, SyncReport, wire
from mxrl.weights import (
    Bucket,
    QuantizationEvent,
    VerifiedRecord,
    WeightRecord,
    checksum,
    stored_tensors,
)
from tests.sync.fake_dist import FakeDist

PLAN = "c" * 64
META = 65536
B0, B2 = 64, 80  # the payload bytes of buckets 0 and 2 (bucket 1 is empty), by hand below


def u8(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.uint8)


def values(step: int) -> dict:
    """The update's values, other bytes for every step."""
    s = step % 7
    return {
        # bf16 [3]: 6 bytes at 0 (padded to 16)
        "a": torch.tensor([1.0 + s, -2.0, 0.5], dtype=torch.bfloat16),
        # MXFP8 [1, 32]: qdata 32 bytes at 16, scale 1 byte at 48: 64 bytes
        "m": QTensor(
            ((torch.arange(32) + s) % 256).to(torch.uint8).reshape(1, 32),
            u8([120 + s]).view(torch.float8_e8m0fnu).reshape(1, 1),
            "mxfp8",
            (1, 32),
        ),
        # fp32 [5]: 20 bytes at 0 (padded to 32)
        "f": torch.arange(5, dtype=torch.float32) * (s + 1),
        # NVFP4 [1, 16]: qdata 8 bytes at 32, scale 1 at 48, global scale 4 at 64: 80 bytes
        "n": QTensor(
            u8([s, 1, 2, 3, 4, 5, 6, 7]).reshape(1, 8),
            u8([0x38]).view(torch.float8_e4m3fn).reshape(1, 1),
            "nvfp4",
            (1, 16),
            global_scale=torch.tensor(2.0 + s),
        ),
    }


def record(name: str, value) -> WeightRecord:
    return WeightRecord(name, value, checksum(name, value))


def event(step: int) -> QuantizationEvent:
    return QuantizationEvent(step, PLAN, 4, 6 + 33 + 20 + 13, 0.125, {"layer.0": 31.5})


def buckets(step: int, plan: str = PLAN) -> list[Bucket]:
    v = values(step)
    return [
        Bucket(0, plan, (record("a", v["a"]), record("m", v["m"])), False, None, step),
        Bucket(1, plan, (), False, None, step),
        Bucket(2, plan, (record("f", v["f"]), record("n", v["n"])), True, 3, step, event(step)),
    ]


class Update:
    """An export as the sender reads one: its buckets, step and event, and (keyed) the plan hash,
    bucket size and bf16 dtype its layout follows from."""

    def __init__(
        self, buckets, *, keyed=True, bucket_bytes=100, fail_after=None, sleep_cycles=0
    ) -> None:
        self.buckets, self.step, self.fail_after = buckets, buckets[0].step, fail_after
        self.sleep_cycles = sleep_cycles  # CUDA: each bucket produced behind a sleep
        self.event = buckets[-1].event
        if keyed:
            self.plan_hash, self.bucket_bytes = buckets[0].plan_hash, bucket_bytes
            self.bf16_dtype = torch.bfloat16

    def __iter__(self):
        for k, b in enumerate(self.buckets):
            if k == self.fail_after:
                raise RuntimeError(f"export failed after bucket {k - 1}")
            if self.sleep_cycles:  # on the stream the sender exports on (its side stream)
                torch.cuda._sleep(self.sleep_cycles)
            yield b


class Loader:
    """What BroadcastReceiver needs of an Engine: weights_version and a load_weights that reads
    every record (the bucket checks), calls before_write (the status all-gather) and counts."""

    def __init__(self, refuse: str | None = None) -> None:
        self.weights_version, self.refuse = 1, refuse
        self.calls, self.loaded = 0, None

    def load_weights(self, records, plan_hash, *, step, before_write=None):
        self.calls += 1
        got = list(records)
        if self.refuse:
            raise ValueError(self.refuse)
        if before_write is not None:
            before_write()
        self.loaded = (plan_hash, step, got)
        self.weights_version += 1
        return self.weights_version


def bytes_of(records) -> dict:
    return {
        r.name: {
            k: t.reshape(-1).view(torch.uint8).tolist() for k, t in stored_tensors(r.value).items()
        }
        for r in records
    }


def sent(step: int) -> dict:
    return bytes_of(r for b in buckets(step) for r in b.records)


@pytest.fixture
def fake(monkeypatch):
    """Two ranks: 0 sends, 1 receives."""
    return use(monkeypatch, FakeDist())


def use(monkeypatch, fake: FakeDist) -> FakeDist:
    monkeypatch.setattr(broadcast, "dist", fake)
    monkeypatch.setattr(broadcast_receive, "dist", fake)
    return fake


def as_rank(fake: FakeDist, rank: int, build):
    fake.local.rank = rank
    try:
        return build()
    finally:
        del fake.local.rank


def ends(fake, *, src=0, receivers=(1,), device=None):
    sender = as_rank(fake, src, lambda: BroadcastSender(src=src, device=device))
    engines = {r: Loader() for r in receivers}
    rec = {
        r: as_rank(fake, r, lambda r=r: BroadcastReceiver(engines[r], src=src, device=device))
        for r in receivers
    }
    return sender, rec, engines


def exchange(fake, sender, receivers, update, src=0):
    fns = {f"r{src}": lambda: sender.send(update)}
    fns.update({f"r{r}": rec.receive for r, rec in receivers.items()})
    fake.log.clear()
    return fake.run(**fns)


PER_BUCKET_SENDER = [
    ("gather", 3), ("bcast", META), ("bcast", B0), ("bcast", META), ("bcast", META),
    ("bcast", B2), ("gather", 2),
]  # fmt: skip
PER_BUCKET_RECEIVER = [(("recv" if op == "bcast" else op), n) for op, n in PER_BUCKET_SENDER]
SCHEDULED_SENDER = [("gather", 3), ("bcast", B0), ("bcast", B2), ("bcast", META), ("gather", 2)]
SCHEDULED_RECEIVER = [(("recv" if op == "bcast" else op), n) for op, n in SCHEDULED_SENDER]


def test_the_first_update_goes_bucket_by_bucket_and_loads_the_senders_bytes(fake):
    sender, (receivers), engines = ends(fake)
    out = exchange(fake, sender, receivers, Update(buckets(1)))
    assert fake.ops(0) == PER_BUCKET_SENDER and fake.ops(1) == PER_BUCKET_RECEIVER
    # at most two payloads alive on the sender: one in transfer, one being built
    assert [p for r, _, _, p in fake.log if r == 0] == [0, 0, 0, 1, 1, 1, 0]
    assert fake.pending == [] and fake.leftover == 0
    assert out[0] == SyncReport(2, 4, 72, out[0].seconds, event(1))
    assert out[1] == SyncReport(2, 4, 72, out[1].seconds, event(1))
    plan_hash, step, got = engines[1].loaded
    assert (plan_hash, step, [r.name for r in got]) == (PLAN, 1, ["a", "m", "f", "n"])
    assert all(type(r) is VerifiedRecord for r in got)
    assert bytes_of(got) == sent(1)
    assert [r.hash for r in got] == [r.hash for b in buckets(1) for r in b.records]
    assert sender.last_mode == receivers[1].last_mode == "per-bucket"
    assert set(receivers[1].timings) == {"arrived", "verified", "loaded"}


def test_once_both_ends_hold_the_layout_the_next_updates_go_scheduled(fake):
    sender, receivers, engines = ends(fake)
    exchange(fake, sender, receivers, Update(buckets(1)))
    for step in (2, 3):
        out = exchange(fake, sender, receivers, Update(buckets(step)))
        assert fake.ops(0) == SCHEDULED_SENDER and fake.ops(1) == SCHEDULED_RECEIVER
        assert [p for r, _, _, p in fake.log if r == 0] == [0, 0, 1, 0, 0]
        assert fake.pending == [] and fake.leftover == 0
        assert sender.last_mode == receivers[1].last_mode == "scheduled"
        assert out[0] == SyncReport(step + 1, 4, 72, out[0].seconds, event(step))
        assert out[1] == SyncReport(step + 1, 4, 72, out[1].seconds, event(step))
        plan_hash, got_step, got = engines[1].loaded
        assert (plan_hash, got_step) == (PLAN, step)
        assert all(type(r) is VerifiedRecord for r in got)
        assert bytes_of(got) == sent(step)
        assert [r.hash for r in got] == [r.hash for b in buckets(step) for r in b.records]


def test_a_scheduled_update_rebuilds_the_buckets_of_the_layout(fake, monkeypatch):
    """The buckets handed to apply_update: indices, last, num_buckets and the event on the
    last one only, the trailer's step and the layout's plan hash."""
    sender, receivers, _ = ends(fake)
    exchange(fake, sender, receivers, Update(buckets(1)))
    seen = []

    def recording(engine, bs, plan_hash, step, **kw):
        seen.append(([(b.index, b.last, b.num_buckets, b.step, b.event, b.plan_hash) for b in bs],
                     plan_hash, step))  # fmt: skip
        return SyncReport(0, 0, 0, 0.0, None)

    monkeypatch.setattr(broadcast_receive, "apply_update", recording)
    exchange(fake, sender, receivers, Update(buckets(5)))
    assert seen == [(
        [(0, False, None, 5, None, PLAN), (1, False, None, 5, None, PLAN),
         (2, True, 3, 5, event(5), PLAN)],
        PLAN, 5,
    )]  # fmt: skip


def test_another_key_a_new_sender_or_an_unkeyed_update_goes_bucket_by_bucket(fake):
    sender, receivers, _ = ends(fake)
    exchange(fake, sender, receivers, Update(buckets(1)))
    exchange(fake, sender, receivers, Update(buckets(2), bucket_bytes=101))  # another size
    assert sender.last_mode == receivers[1].last_mode == "per-bucket"
    exchange(fake, sender, receivers, Update(buckets(3), bucket_bytes=101))
    assert sender.last_mode == "scheduled"
    other = as_rank(fake, 0, lambda: BroadcastSender(src=0))
    exchange(fake, other, receivers, Update(buckets(4), bucket_bytes=101))
    assert other.last_mode == receivers[1].last_mode == "per-bucket"
    exchange(fake, other, receivers, Update(buckets(5), keyed=False))  # says no key
    assert other.last_mode == "per-bucket" and other._layout is None
    out = exchange(fake, other, receivers, Update(buckets(6), bucket_bytes=101))
    assert other.last_mode == "per-bucket" and out[1].version == 7
    exchange(fake, other, receivers, Update(buckets(7), bucket_bytes=101))
    assert other.last_mode == "scheduled"
    # a new engine rank: the layout is not agreed
    receivers[1] = as_rank(fake, 1, lambda: BroadcastReceiver(Loader(), src=0))
    exchange(fake, other, receivers, Update(buckets(8), bucket_bytes=101))
    assert other.last_mode == receivers[1].last_mode == "per-bucket"


def test_the_layout_key_is_the_plan_the_bucket_size_and_the_bf16_dtype():
    update = Update(buckets(1), bucket_bytes=100)
    assert broadcast._layout_key(update) == (PLAN, 100, "torch.bfloat16")
    update.bucket_bytes = 100.0
    assert broadcast._layout_key(update) == (PLAN, 100, "torch.bfloat16")
    for attr in ("plan_hash", "bucket_bytes", "bf16_dtype"):
        update = Update(buckets(1))
        delattr(update, attr)
        assert broadcast._layout_key(update) is None, attr
    assert broadcast._layout_key(Update(buckets(1), keyed=False)) is None


def test_headers_that_do_not_fit_the_meta_travel_on_their_own(fake, monkeypatch):
    monkeypatch.setattr(wire, "META_BYTES", 256)  # room for headers of 192 bytes
    sender, receivers, engines = ends(fake)
    lengths = [len(wire.pack_bucket(b)[0]) for b in buckets(1)]
    assert lengths[0] > 192 and lengths[1] <= 192 and lengths[2] > 192
    exchange(fake, sender, receivers, Update(buckets(1)))
    assert fake.ops(0) == [
        ("gather", 3), ("bcast", 256), ("bcast", lengths[0]), ("bcast", B0), ("bcast", 256),
        ("bcast", 256), ("bcast", lengths[2]), ("bcast", B2), ("gather", 2),
    ]  # fmt: skip
    assert bytes_of(engines[1].loaded[2]) == sent(1)
    exchange(fake, sender, receivers, Update(buckets(2)))  # the trailer is longer than 192
    hashes = [r.hash for b in buckets(2) for r in b.records]
    trailer = {
        "wire": 5,
        "plan_hash": PLAN,
        "step": 2,
        "event": event(2).to_dict(),
        "hashes": hashes,
    }
    n = len(json.dumps(trailer, separators=(",", ":")))
    assert fake.ops(0) == [("gather", 3), ("bcast", B0), ("bcast", B2), ("bcast", 256),
                           ("bcast", n), ("gather", 2)]  # fmt: skip
    assert bytes_of(engines[1].loaded[2]) == sent(2) and engines[1].loaded[1] == 2


def flip_in_bucket_2(index, payload):
    if index == 2:
        payload[0] ^= 0x01  # the first byte of record f


@pytest.mark.parametrize("scheduled", [False, True])
def test_bytes_corrupted_on_the_engine_rank_are_refused_on_both_ends(fake, scheduled):
    sender, receivers, engines = ends(fake)
    if scheduled:
        exchange(fake, sender, receivers, Update(buckets(1)))
    receivers[1].tamper = flip_in_bucket_2
    out = exchange(fake, sender, receivers, Update(buckets(2)))
    assert isinstance(out[1], ValueError) and "f: checksum mismatch" in str(out[1])
    assert isinstance(out[0], ValueError)
    assert "engine rank(s) [1] refused weight update step 2" in str(out[0])
    assert engines[1].calls == scheduled and engines[1].weights_version == 1 + scheduled
    assert fake.ops(0)[-1] == fake.ops(1)[-1] == ("gather", 2) and fake.leftover == 0
    assert receivers[1].last_mode == ("scheduled" if scheduled else "per-bucket")


@pytest.mark.parametrize("scheduled", [False, True])
def test_bytes_corrupted_by_the_sender_are_refused(fake, scheduled):
    sender, receivers, engines = ends(fake)
    if scheduled:
        exchange(fake, sender, receivers, Update(buckets(1)))
    sender.tamper = flip_in_bucket_2
    out = exchange(fake, sender, receivers, Update(buckets(2)))
    assert "f: checksum mismatch" in str(out[1])
    assert "engine rank(s) [1] refused" in str(out[0])
    assert engines[1].calls == scheduled


def test_one_engine_rank_refusing_makes_every_engine_rank_keep_its_weights(monkeypatch):
    fake = use(monkeypatch, FakeDist(ranks=(0, 1, 2)))
    sender, receivers, engines = ends(fake, receivers=(1, 2))
    exchange(fake, sender, receivers, Update(buckets(1)))
    assert engines[1].weights_version == engines[2].weights_version == 2
    for scheduled in (True, False):
        if not scheduled:
            sender._layout = None
        receivers[2].tamper = flip_in_bucket_2
        out = exchange(fake, sender, receivers, Update(buckets(2)))
        receivers[2].tamper = None
        assert "f: checksum mismatch" in str(out[2])
        assert "engine rank(s) [2] refused this update, so this rank does not load" in str(out[1])
        assert "engine rank(s) [2] refused weight update step 2" in str(out[0])
        assert engines[1].loaded[1] == 1 and engines[1].weights_version == 2
        assert engines[1].calls == (2 if scheduled else 3) and engines[2].calls == 1
    out = exchange(fake, sender, receivers, Update(buckets(2)))
    assert out[0].version == out[1].version == out[2].version == 3


def test_the_sender_reports_the_highest_version_and_names_every_refusing_rank(monkeypatch, caplog):
    fake = use(monkeypatch, FakeDist(ranks=(0, 1, 2)))
    sender, receivers, engines = ends(fake, receivers=(1, 2))
    out = exchange(fake, sender, receivers, Update(buckets(1)))
    assert "disagree" not in caplog.text
    engines[2].weights_version = 5
    out = exchange(fake, sender, receivers, Update(buckets(2)))
    assert out[0].version == 6 and (out[1].version, out[2].version) == (3, 6)
    assert "engine ranks disagree on weights_version: [3, 6]" in caplog.text
    engines[1].refuse = engines[2].refuse = "the plan says otherwise"
    out = exchange(fake, sender, receivers, Update(buckets(3)))
    assert "engine rank(s) [1, 2] refused weight update step 3" in str(out[0])
    assert str(out[1]) == str(out[2]) == "the plan says otherwise"


def test_a_group_names_the_ranks_by_their_global_rank(monkeypatch):
    group = object()
    fake = use(monkeypatch, FakeDist(ranks=(3, 7), group=group))
    sender = as_rank(fake, 3, lambda: BroadcastSender(group, src=3))
    engine = Loader()
    receiver = as_rank(fake, 7, lambda: BroadcastReceiver(engine, group, src=3))
    for step in (1, 2):  # bucket by bucket, then scheduled: every collective on the group
        out = fake.run(r3=lambda s=step: sender.send(Update(buckets(s))), r7=receiver.receive)
        assert out[3].version == out[7].version == step + 1
    engine.refuse = "no"
    out = fake.run(r3=lambda: sender.send(Update(buckets(3))), r7=receiver.receive)
    assert "engine rank(s) [7] refused weight update step 3" in str(out[3])
    assert sender.group is group and receiver.group is group and sender.src == receiver.src == 3


@pytest.mark.parametrize("scheduled", [False, True])
def test_an_export_failing_mid_way_aborts_on_every_rank(fake, scheduled):
    sender, receivers, engines = ends(fake)
    if scheduled:
        exchange(fake, sender, receivers, Update(buckets(1)))
    out = exchange(fake, sender, receivers, Update(buckets(2), fail_after=2))
    assert isinstance(out[0], RuntimeError) and str(out[0]) == "export failed after bucket 1"
    assert isinstance(out[1], ValueError) and "the trainer aborted the update" in str(out[1])
    if scheduled:  # every payload the receivers queued, the last of zeros, then the abort
        assert fake.ops(0) == [("gather", 3), ("bcast", B0), ("bcast", B2), ("bcast", META)]
    else:
        assert fake.ops(0) == [("gather", 3), ("bcast", META), ("bcast", B0), ("bcast", META),
                               ("bcast", META)]  # fmt: skip
    assert fake.pending == [] and fake.leftover == 0
    assert engines[1].calls == scheduled and engines[1].weights_version == 1 + scheduled


def test_the_sender_keeps_its_layout_after_a_failed_export(fake):
    sender, receivers, _ = ends(fake)
    exchange(fake, sender, receivers, Update(buckets(1)))
    exchange(fake, sender, receivers, Update(buckets(2), fail_after=1))
    exchange(fake, sender, receivers, Update(buckets(3)))
    assert sender.last_mode == receivers[1].last_mode == "scheduled"


def relaid(step):
    """The same key, other buckets: record f moved into bucket 0."""
    b = buckets(step)
    return [
        dataclasses.replace(b[0], records=(*b[0].records, b[2].records[0])),
        b[1],
        dataclasses.replace(b[2], records=b[2].records[1:]),
    ]


@pytest.mark.parametrize(
    ("update", "message"),
    [
        (lambda: relaid(2), "bucket 0 is laid out differently"),
        (lambda: buckets(2)[:2], "the export ended after 2 bucket(s)"),
        (lambda: [*buckets(2)[:2], dataclasses.replace(buckets(2)[2], last=False),
                  Bucket(3, PLAN, (), True, 4, 2)], "the export has more than 3 bucket(s)"),
    ],
)  # fmt: skip
def test_an_export_laid_out_otherwise_aborts_and_the_next_goes_bucket_by_bucket(
    fake, update, message
):
    sender, receivers, engines = ends(fake)
    exchange(fake, sender, receivers, Update(buckets(1)))
    out = exchange(fake, sender, receivers, Update(update()))
    assert isinstance(out[0], ValueError) and message in str(out[0])
    assert "weight update step 2" in str(out[0])
    assert "the next update is sent bucket by bucket" in str(out[0])
    assert "the trainer aborted" in str(out[1]) and engines[1].weights_version == 2
    assert fake.ops(0) == [("gather", 3), ("bcast", B0), ("bcast", B2), ("bcast", META)]
    assert sender.last_mode == "scheduled" and sender._layout is None
    assert fake.pending == [] and fake.leftover == 0
    out = exchange(fake, sender, receivers, Update(buckets(3)))
    assert sender.last_mode == receivers[1].last_mode == "per-bucket"
    assert out[1].version == 3 and bytes_of(engines[1].loaded[2]) == sent(3)
    exchange(fake, sender, receivers, Update(buckets(4)))
    assert sender.last_mode == "scheduled"


def edit_meta(monkeypatch, edit):
    """The sender's metas through edit(meta bytes as a bytearray) -> bytes."""
    make = wire.meta_message

    def edited(flags, header, payload_len, device):
        meta = bytearray(make(flags, header, payload_len, device).numpy().tobytes())
        return torch.frombuffer(bytearray(edit(meta, header)), dtype=torch.uint8)

    monkeypatch.setattr(wire, "meta_message", edited)


@pytest.mark.parametrize("scheduled", [False, True])
def test_a_header_corrupted_in_transit_is_refused(fake, monkeypatch, scheduled):
    sender, receivers, engines = ends(fake)
    if scheduled:
        exchange(fake, sender, receivers, Update(buckets(1)))

    def flip(meta, header):
        meta[64 + 3] ^= 0x20  # a letter of the header's JSON, under its sha256
        return meta

    edit_meta(monkeypatch, flip)
    out = exchange(fake, sender, receivers, Update(buckets(2)))
    what = "update trailer" if scheduled else "bucket header"
    assert f"{what} corrupted in transit (sha256 mismatch)" in str(out[1])
    assert "engine rank(s) [1] refused" in str(out[0]) and engines[1].calls == scheduled


def test_a_sender_of_another_wire_version_is_refused_before_anything_is_read(fake, monkeypatch):
    sender, receivers, engines = ends(fake)

    def version_4(meta, header):
        meta[0] = 4
        return meta

    edit_meta(monkeypatch, version_4)
    out = exchange(fake, sender, receivers, Update(buckets(1)))
    assert "the sender speaks sync wire version 4, this rank 5" in str(out[1])
    assert fake.ops(1) == [("gather", 3), ("recv", META)] and engines[1].calls == 0


def trailer_edit(monkeypatch, edit_json=None, flags=None):
    """The scheduled trailer edited (as JSON, a valid sha256 kept) or sent with other flags."""
    send_meta = BroadcastSender._send_meta

    def edited(self, f, header, payload_len):
        if b'"hashes"' in header:
            if edit_json is not None:
                trailer = json.loads(header)
                edit_json(trailer)
                header = json.dumps(trailer).encode()
            f = f if flags is None else flags
        send_meta(self, f, header, payload_len)

    monkeypatch.setattr(BroadcastSender, "_send_meta", edited)


def drop(key):
    return lambda t: t.pop(key)


def one_hash_less(t):
    t["hashes"].pop()


def one_hash_more(t):
    t["hashes"].append("0" * 64)


def other_plan(t):
    t["plan_hash"] = "d" * 64


def step_as_text(t):
    t["step"] = "x"


@pytest.mark.parametrize(
    ("edit", "flags", "message"),
    [
        (drop("step"), None, "malformed update trailer (KeyError('step'))"),
        (drop("hashes"), None, "malformed update trailer (KeyError('hashes'))"),
        (drop("event"), None, "malformed update trailer (KeyError('event'))"),
        (drop("plan_hash"), None, "malformed update trailer (KeyError('plan_hash'))"),
        (step_as_text, None, "invalid literal for int()"),
        (one_hash_less, None, "the update trailer does not list one checksum per record"),
        (one_hash_more, None, "the update trailer does not list one checksum per record"),
        (other_plan, None, "the update trailer does not close the agreed layout"),
        (None, 0, "the update trailer does not close the agreed layout"),
    ],
)
def test_a_trailer_that_does_not_close_the_layout_is_refused(
    fake, monkeypatch, edit, flags, message
):
    sender, receivers, engines = ends(fake)
    exchange(fake, sender, receivers, Update(buckets(1)))
    trailer_edit(monkeypatch, edit, flags)
    out = exchange(fake, sender, receivers, Update(buckets(2)))
    assert isinstance(out[1], ValueError) and message in str(out[1])
    assert "engine rank(s) [1] refused" in str(out[0]) and engines[1].calls == 1
    assert engines[1].weights_version == 2


def test_a_trailer_without_event_loads_without_one(fake):
    sender, receivers, _ = ends(fake)
    exchange(fake, sender, receivers, Update(buckets(1)))
    b = buckets(2)
    b[2] = dataclasses.replace(b[2], event=None)
    out = exchange(fake, sender, receivers, Update(b))
    assert out[1].event is None and out[1].version == 3 and sender.last_mode == "scheduled"


def test_the_trailer_is_the_documented_json(fake, monkeypatch):
    sender, receivers, _ = ends(fake)
    exchange(fake, sender, receivers, Update(buckets(1)))
    metas = []
    make = wire.meta_message

    def recording(flags, header, payload_len, device):
        metas.append((flags, header, payload_len))
        return make(flags, header, payload_len, device)

    monkeypatch.setattr(wire, "meta_message", recording)
    exchange(fake, sender, receivers, Update(buckets(2)))
    hashes = ",".join(f'"{r.hash}"' for b in buckets(2) for r in b.records)
    ev = json.dumps(event(2).to_dict(), separators=(",", ":"))
    trailer = f'{{"wire":5,"plan_hash":"{PLAN}","step":2,"event":{ev},"hashes":[{hashes}]}}'
    assert metas == [(1, trailer.encode(), 0)]


def test_a_bucket_header_refused_on_unpacking_is_refused_after_the_last_bucket(fake, monkeypatch):
    """A header that does not describe its payload: the receiver keeps receiving to the last
    bucket (the collectives in step), then refuses on both ends."""
    sender, receivers, engines = ends(fake)
    pack = broadcast.pack_bucket

    def short(bucket, device):
        header, payload = pack(bucket, device)
        if bucket.index == 0:
            h = json.loads(header)
            h["payload_bytes"] = 48
            header = json.dumps(h).encode()
        return header, payload

    monkeypatch.setattr(broadcast, "pack_bucket", short)
    out = exchange(fake, sender, receivers, Update(buckets(1)))
    assert "header says 48 payload bytes, got 64" in str(out[1])
    assert "engine rank(s) [1] refused" in str(out[0])
    assert fake.ops(1) == PER_BUCKET_RECEIVER and fake.leftover == 0
    assert engines[1].calls == 0 and receivers[1]._layout is None


def test_the_receiver_learns_the_layout_only_from_an_update_it_loaded(fake):
    sender, receivers, engines = ends(fake)
    engines[1].refuse = "no"
    exchange(fake, sender, receivers, Update(buckets(1)))
    assert receivers[1]._layout is None
    engines[1].refuse = None
    exchange(fake, sender, receivers, Update(buckets(2)))
    assert receivers[1].last_mode == "per-bucket"  # the sender did not keep it either
    layout = receivers[1]._layout
    headers = [json.loads(wire.pack_bucket(b)[0]) for b in buckets(2)]
    assert layout == wire.PayloadLayout.of(headers) and sender._layout[1] == layout


def test_a_refused_scheduled_update_keeps_the_layout_on_both_ends(fake):
    sender, receivers, engines = ends(fake)
    exchange(fake, sender, receivers, Update(buckets(1)))
    engines[1].refuse = "no"
    exchange(fake, sender, receivers, Update(buckets(2)))
    engines[1].refuse = None
    exchange(fake, sender, receivers, Update(buckets(2)))
    assert sender.last_mode == receivers[1].last_mode == "scheduled"


class Clock:
    def __init__(self, *times):
        self.times = iter(times)

    def perf_counter(self):
        return next(self.times)


def test_the_receivers_timings_and_the_senders_seconds(fake, monkeypatch):
    sender, receivers, _ = ends(fake)
    monkeypatch.setattr(broadcast_receive, "time", Clock(10.0, 11.0, 12.5, 14.0))
    monkeypatch.setattr(broadcast, "time", Clock(100.0, 103.25))
    # apply_update reads the clock once more, at its end: the receive's start is its start
    monkeypatch.setattr(transport, "time", Clock(13.0))
    out = exchange(fake, sender, receivers, Update(buckets(1)))
    assert receivers[1].timings == {"arrived": 1.0, "verified": 2.5, "loaded": 4.0}
    assert out[0].seconds == 3.25 and out[1].seconds == 3.0


def test_the_ends_refuse_the_wrong_rank(fake):
    with pytest.raises(ValueError, match="BroadcastSender runs on rank src=0, this is rank 1"):
        as_rank(fake, 1, lambda: BroadcastSender(src=0))
    with pytest.raises(ValueError, match="BroadcastReceiver runs on engine ranks, not on src=1"):
        as_rank(fake, 1, lambda: BroadcastReceiver(Loader(), src=1))
    sender = as_rank(fake, 1, lambda: BroadcastSender(src=1, device="cpu"))
    assert sender.src == 1 and sender.device == torch.device("cpu") and sender.tamper is None
    assert sender.last_mode is None and sender._layout is None
    receiver = as_rank(fake, 0, lambda: BroadcastReceiver(Loader(), src=1))
    assert receiver.device == torch.device("cpu") and receiver.tamper is None
    assert receiver.last_mode is None and receiver._layout is None and receiver.timings == {}
    # the defaults: src 0, the default group, the device its backend says (gloo: the CPU)
    sender, receiver = (
        as_rank(fake, 0, BroadcastSender),
        as_rank(fake, 1, lambda: BroadcastReceiver(Loader())),
    )
    assert (sender.src, sender.group, sender.device) == (0, None, torch.device("cpu"))
    assert (receiver.src, receiver.group, receiver.device) == (0, None, torch.device("cpu"))
    # a device given wins over the backend's
    meta = torch.device("meta")
    assert as_rank(fake, 0, lambda: BroadcastSender(device=meta)).device == meta
    assert as_rank(fake, 1, lambda: BroadcastReceiver(Loader(), device="meta")).device == meta


def test_comm_device(fake):
    assert broadcast.comm_device(None, "cpu") == torch.device("cpu")
    assert broadcast.comm_device(None, torch.device("meta")) == torch.device("meta")
    assert broadcast.comm_device(None, None) == torch.device("cpu")  # gloo


def layout_of(step, **kw):
    return wire.PayloadLayout.of([json.loads(wire.pack_bucket(b)[0]) for b in buckets(step, **kw)])


def agree(fake, layouts: dict):
    return fake.run(**{f"r{r}": (lambda lay=lay: broadcast.agree_on_layout(lay, None, torch.device("cpu")))
                       for r, lay in layouts.items()})  # fmt: skip


def test_the_ranks_agree_on_a_layout_only_when_every_rank_holds_it(monkeypatch):
    fake = use(monkeypatch, FakeDist(ranks=(0, 1, 2)))
    a, b = layout_of(1), layout_of(1, plan="e" * 64)
    assert agree(fake, {0: a, 1: a, 2: a}) == {0: True, 1: True, 2: True}
    assert agree(fake, {0: a, 1: a, 2: b}) == {0: False, 1: False, 2: False}
    assert agree(fake, {0: a, 1: None, 2: a}) == {0: False, 1: False, 2: False}
    assert agree(fake, {0: None, 1: None, 2: None}) == {0: False, 1: False, 2: False}
    # what each rank contributes: (5, the id as two little-endian int64)
    fake.log.clear()
    seen = []
    fake.edit = lambda rank, t: seen.append((rank, t.tolist()))
    agree(fake, {0: a, 1: None, 2: a})
    ident = [
        int.from_bytes(a.id[:8], "little", signed=True),
        int.from_bytes(a.id[8:], "little", signed=True),
    ]
    assert sorted(seen) == [(0, [5, *ident]), (1, [5, 0, 0]), (2, [5, *ident])]
    # an id whose halves have their top bit set: two negative int64, as on every rank
    high = wire.PayloadLayout(bytes([0xFF] * 8 + [0] * 7 + [0x80]), PLAN, ())
    seen.clear()
    assert agree(fake, {0: high, 1: high, 2: high}) == {0: True, 1: True, 2: True}
    assert sorted(seen) == [(r, [5, -1, -(2**63)]) for r in (0, 1, 2)]


def test_ranks_of_another_wire_version_all_refuse_at_the_agreement(monkeypatch):
    fake = use(monkeypatch, FakeDist(ranks=(0, 1, 2)))

    def version_4_on_rank_1(rank, t):
        if rank == 1:
            t[0] = 4

    fake.edit = version_4_on_rank_1
    a = layout_of(1)
    out = agree(fake, {0: a, 1: a, 2: a})
    for r in (0, 1, 2):
        assert isinstance(out[r], ValueError), r
        assert "the ranks speak sync wire versions [4, 5]: run one mxrl version" in str(out[r])
    fake.edit = lambda rank, t: t.__setitem__(0, 6)  # every rank another version than 5
    out = agree(fake, {0: a, 1: a, 2: a})
    assert all("versions [6]" in str(out[r]) for r in (0, 1, 2))


def test_gather_status_names_each_rank_with_its_outcome(monkeypatch):
    group = object()
    fake = use(monkeypatch, FakeDist(ranks=(2, 5, 9), group=group))
    out = fake.run(
        r2=lambda: broadcast.gather_status(0, 0, group, torch.device("cpu")),
        r5=lambda: broadcast.gather_status(1, 4, group, torch.device("cpu")),
        r9=lambda: broadcast.gather_status(0, 2**40, group, torch.device("cpu")),
    )
    assert out[2] == out[5] == out[9] == [(2, 0, 0), (5, 1, 4), (9, 0, 2**40)]
    fake2 = use(monkeypatch, FakeDist(ranks=(0, 1)))
    out = fake2.run(
        r0=lambda: broadcast.gather_status(0, 0, None, torch.device("cpu")),
        r1=lambda: broadcast.gather_status(1, 3, None, torch.device("cpu")),
    )
    assert out[0] == out[1] == [(0, 0, 0), (1, 1, 3)]
    assert fake2.ops(0) == [("gather", 2)]


def test_the_senders_finish_waits_for_all_but_keep(fake):
    sender = as_rank(fake, 0, lambda: BroadcastSender(src=0))
    from collections import deque

    from tests.sync.fake_dist import Work

    works = [Work(fake) for _ in range(3)]
    fake.pending.extend(works)
    inflight = deque((w, None) for w in works)
    sender._finish(inflight, keep=1)
    assert [w.done for w in works] == [True, True, False] and len(inflight) == 1
    sender._finish(inflight, keep=1)
    assert len(inflight) == 1
    sender._finish(inflight)
    assert works[2].done and not inflight


def test_the_checksums_of_a_bucket_run_at_once_on_the_cpu(fake):
    receiver = as_rank(fake, 1, lambda: BroadcastReceiver(Loader(), src=0))
    v = values(1)
    records = [record("a", v["a"]), record("m", v["m"])]
    pending = receiver._check(records, torch.empty(0, dtype=torch.uint8), None)
    assert pending.wait() == [r.hash for r in records]


def test_verified_refuses_a_bucket_whose_checksums_differ():
    v = values(1)
    good = Bucket(0, PLAN, (record("a", v["a"]),), False)
    bad = Bucket(1, PLAN, (WeightRecord("f", v["f"], "0" * 64), record("n", v["n"])), True, 2)

    class Done:
        def __init__(self, sums):
            self.sums = sums

        def wait(self):
            return self.sums

    sums = [[good.records[0].hash], [checksum("f", v["f"]), bad.records[1].hash]]
    with pytest.raises(ValueError, match="f: checksum mismatch"):
        broadcast_receive._verified([(good, Done(sums[0])), (bad, Done(sums[1]))])
    fixed = dataclasses.replace(bad, records=(record("f", v["f"]), bad.records[1]))
    out = broadcast_receive._verified([(good, Done(sums[0])), (fixed, Done(sums[1]))])
    assert [[r.name for r in b.records] for b in out] == [["a"], ["f", "n"]]
    assert [(b.index, b.last, b.num_buckets) for b in out] == [(0, False, None), (1, True, 2)]
    assert all(type(r) is VerifiedRecord for b in out for r in b.records)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_both_modes_on_cuda_give_the_cpu_bytes(monkeypatch, backend):
    """Both ends on one GPU (the stand-in's ranks are threads of one process): the export packed
    and the checksums queued on side streams, the payloads, metas and records on the device
    (NCCL: its current device; gloo: device= given), the bytes those built on the CPU."""
    cuda = torch.device("cuda", torch.cuda.current_device())
    fake = use(monkeypatch, FakeDist(backend=backend, device=cuda))
    sender, receivers, engines = ends(fake, device=None if backend == "nccl" else cuda)
    assert sender.device == receivers[1].device == cuda
    for step, mode in ((1, "per-bucket"), (2, "scheduled")):
        out = exchange(fake, sender, receivers, Update(buckets(step)))
        assert sender.last_mode == receivers[1].last_mode == mode
        assert out[0].version == out[1].version == step + 1
        got = engines[1].loaded[2]
        assert all(t.device == cuda for r in got for t in stored_tensors(r.value).values())
        assert bytes_of(got) == sent(step)
    receivers[1].tamper = flip_in_bucket_2
    out = exchange(fake, sender, receivers, Update(buckets(3)))
    assert "f: checksum mismatch" in str(out[1]) and "engine rank(s) [1] refused" in str(out[0])
    receivers[1].tamper = None
    monkeypatch.setattr(wire, "META_BYTES", 256)  # headers and trailers on their own
    sender._layout = receivers[1]._layout = None
    for step, mode in ((5, "per-bucket"), (6, "scheduled")):
        out = exchange(fake, sender, receivers, Update(buckets(step)))
        assert sender.last_mode == mode and bytes_of(engines[1].loaded[2]) == sent(step)
    monkeypatch.setattr(wire, "META_BYTES", META)
    out = exchange(fake, sender, receivers, Update(buckets(4), fail_after=2))  # zeros, abort
    assert "export failed" in str(out[0]) and "aborted" in str(out[1])
    assert fake.ops(0) == [("gather", 3), ("bcast", B0), ("bcast", B2), ("bcast", META)]


def test_an_update_of_one_bucket(fake):
    sender, receivers, engines = ends(fake)
    a = record("a", values(1)["a"])
    for step, mode in ((4, "per-bucket"), (5, "scheduled")):
        only = [Bucket(0, PLAN, (a,), True, 1, step, event(step))]
        out = exchange(fake, sender, receivers, Update(only))
        assert sender.last_mode == receivers[1].last_mode == mode
        assert out[1] == SyncReport(out[1].version, 1, 6, out[1].seconds, event(step))
        assert engines[1].loaded[1] == step
        assert bytes_of(engines[1].loaded[2]) == bytes_of([a])


def test_a_stale_bucket_is_named_against_the_first_buckets_step(fake):
    sender, receivers, engines = ends(fake)
    b = buckets(2)
    b[1] = dataclasses.replace(b[1], step=1)
    out = exchange(fake, sender, receivers, Update(b))
    assert "bucket 1 comes from the export of step 1, the update from step 2" in str(out[1])
    assert "engine rank(s) [1] refused" in str(out[0]) and engines[1].loaded is None


@pytest.mark.parametrize("scheduled", [False, True])
def test_a_failure_while_staging_a_bucket_is_the_updates_error_and_every_receive_is_queued(
    fake, monkeypatch, scheduled
):
    """The checksums of bucket 0 cannot start (here: out of memory): the receiver still
    queues every receive to the last (the collectives in step), then refuses with that error,
    and so does every rank."""
    sender, receivers, engines = ends(fake)
    if scheduled:
        exchange(fake, sender, receivers, Update(buckets(1)))
    real, calls = broadcast_receive.PendingChecksums, []

    def out_of_memory(names, values):
        calls.append(list(names))
        if len(calls) == 1:
            raise RuntimeError("CUDA out of memory (stand-in)")
        return real(names, values)

    monkeypatch.setattr(broadcast_receive, "PendingChecksums", out_of_memory)
    out = exchange(fake, sender, receivers, Update(buckets(2)))
    assert isinstance(out[1], RuntimeError) and str(out[1]) == "CUDA out of memory (stand-in)"
    assert "engine rank(s) [1] refused weight update step 2" in str(out[0])
    assert calls == [["a", "m"]]  # nothing staged after the error
    assert fake.ops(1) == (SCHEDULED_RECEIVER if scheduled else PER_BUCKET_RECEIVER)
    assert fake.leftover == 0 and engines[1].calls == int(scheduled)


@pytest.mark.gpu
def test_a_receiver_on_another_gpu_than_the_current_one_checksums_what_arrived(monkeypatch):
    """device= cuda:1 while cuda:0 is current: the checksums wait for cuda:1's stream, where the
    receives land, and the broadcasts for the side stream the export and packing ran on (both
    delayed here, so that reading before them would see other bytes)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    torch.cuda.set_device(0)
    other = torch.device("cuda", 1)
    fake = use(monkeypatch, FakeDist(device=other, delay_cycles=50_000_000))
    sender, receivers, engines = ends(fake, device=other)
    for step, mode in ((1, "per-bucket"), (2, "scheduled")):
        out = exchange(fake, sender, receivers, Update(buckets(step), sleep_cycles=50_000_000))
        assert not isinstance(out[1], BaseException), out[1]
        assert receivers[1].last_mode == mode and out[1].version == step + 1
        assert bytes_of(engines[1].loaded[2]) == sent(step)


def four_buckets(step: int) -> list[Bucket]:
    """Four non-empty buckets: payloads of 64 (a, m), 32 (f), 48 (n) and 16 (b) bytes."""
    v = values(step)
    b = torch.tensor([float(step), 3.0], dtype=torch.float32)
    groups = [[("a", v["a"]), ("m", v["m"])], [("f", v["f"])], [("n", v["n"])], [("b", b)]]
    return [
        Bucket(k, PLAN, tuple(record(n, x) for n, x in g), k == 3, 4 if k == 3 else None, step,
               event(step) if k == 3 else None)
        for k, g in enumerate(groups)
    ]  # fmt: skip


def test_the_sender_keeps_at_most_two_payloads_alive(fake):
    """One in transfer, one being built: before each payload's broadcast the sender has waited
    for all but the last one sent (the log's pending count), and for all of them at the end."""
    sender, receivers, engines = ends(fake)
    exchange(fake, sender, receivers, Update(four_buckets(1)))
    assert fake.ops(0) == [
        ("gather", 3), ("bcast", META), ("bcast", 64), ("bcast", META), ("bcast", 32),
        ("bcast", META), ("bcast", 48), ("bcast", META), ("bcast", 16), ("gather", 2),
    ]  # fmt: skip
    assert [p for r, _, _, p in fake.log if r == 0] == [0, 0, 0, 1, 1, 1, 1, 1, 1, 0]
    exchange(fake, sender, receivers, Update(four_buckets(2)))
    assert fake.ops(0) == [("gather", 3), ("bcast", 64), ("bcast", 32), ("bcast", 48),
                           ("bcast", 16), ("bcast", META), ("gather", 2)]  # fmt: skip
    assert [p for r, _, _, p in fake.log if r == 0] == [0, 0, 1, 1, 1, 0, 0]
    assert fake.pending == [] and sender.last_mode == "scheduled"
    assert bytes_of(engines[1].loaded[2]) == bytes_of(r for b in four_buckets(2) for r in b.records)
