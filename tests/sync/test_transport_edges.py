"""The in-process transport (mxrl/sync/transport.py) on a stand-in engine: the bucket checks of
`checked_records` (one plan hash and step, indices 0..n-1, num_buckets on the last, nothing after
it, a last bucket) raised inside the consumer as it reads, the tally it keeps (records, bytes,
the event), and what `apply_update` and `InProcessTransport.send` hand the engine and report,
timed by a fake clock. Expectations worked out by hand; the real engine's loads are
test_transport.py's and test_tampering.py's."""

import itertools

import pytest
import torch

import mxrl.sync.transport as transport
from mxrl.sync import InProcessTransport, SyncReport, apply_update
from mxrl.sync.transport import checked_records
from mxrl.weights import Bucket, Export, QuantizationEvent, WeightRecord

PLAN = "a" * 20 + "b" * 44


def rec(name: str, numel: int, dtype=torch.float32) -> WeightRecord:
    return WeightRecord(name, torch.zeros(numel, dtype=dtype), "h-" + name)


def event(step=3, num_bytes=0) -> QuantizationEvent:
    return QuantizationEvent(step, PLAN, 4, num_bytes, 0.5, {"layer.0": 20.0})


def update(step=3, plan=PLAN, ev=None):
    """Three buckets: 4 + 6 bytes, none, 16 bytes (the last, with the event)."""
    ev = event(step, 26) if ev is None else ev
    return [
        Bucket(0, plan, (rec("x", 1), rec("y", 3, torch.bfloat16)), False, None, step),
        Bucket(1, plan, (), False, None, step),
        Bucket(2, plan, (rec("z", 2, torch.float64),), True, 3, step, ev),
    ]


def names(records) -> list[str]:
    return [r.name for r in records]


def test_checked_records_yields_every_record_in_order_and_tallies_them():
    tally = transport._Tally()
    assert (tally.num_tensors, tally.num_bytes, tally.event) == (0, 0, None)
    buckets = update()
    assert names(checked_records(buckets, PLAN, 3, tally)) == ["x", "y", "z"]
    assert (tally.num_tensors, tally.num_bytes, tally.event) == (3, 4 + 6 + 16, buckets[2].event)
    assert names(checked_records(update(), PLAN, 3)) == ["x", "y", "z"]  # without a tally


def test_the_tally_follows_the_records_read_and_takes_the_event_after_its_bucket():
    tally = transport._Tally()
    records = checked_records(update(), PLAN, 3, tally)
    next(records)
    assert (tally.num_tensors, tally.num_bytes) == (1, 4)
    next(records)
    next(records)
    assert (tally.num_tensors, tally.num_bytes, tally.event) == (3, 26, None)
    assert next(records, None) is None
    assert tally.event == event(3, 26)


def test_the_event_of_a_later_bucket_replaces_an_earlier_one():
    first, second = event(3, 1), event(3, 2)
    buckets = update(ev=second)
    buckets[0] = Bucket(0, PLAN, buckets[0].records, False, None, 3, first)
    tally = transport._Tally()
    list(checked_records(buckets, PLAN, 3, tally))
    assert tally.event is second
    list(checked_records(buckets, PLAN, 3))  # the events without a tally


def test_a_one_bucket_update_and_a_last_bucket_without_num_buckets():
    only = Bucket(0, PLAN, (rec("x", 1),), True, 1, 5)
    assert names(checked_records([only], PLAN, 5)) == ["x"]
    only = Bucket(0, PLAN, (rec("x", 1),), True, None, 5)
    assert names(checked_records([only], PLAN, 5)) == ["x"]


def consume_until_refused(buckets, plan=PLAN, step=3, match=""):
    """The names read before the refusal, which is raised inside the consumer."""
    read = []
    with pytest.raises(ValueError, match=match):
        for r in checked_records(buckets, plan, step):
            read.append(r.name)
    return read


def test_each_refusal_comes_when_its_bucket_is_read():
    b = update()
    other_plan = "c" * 16 + "d" * 48
    assert consume_until_refused(b, plan=other_plan, match=(
        f"bucket 0 was exported under plan {'a' * 16}, the update under {'c' * 16};"
    )) == []  # fmt: skip
    assert consume_until_refused(b, step=4, match="bucket 0 comes from the export of step 3, "
                                 "the update from step 4") == []  # fmt: skip
    stale = [b[0], Bucket(1, PLAN, (), False, None, 2), b[2]]
    assert consume_until_refused(stale, match="export of step 2.*stale") == ["x", "y"]
    replan = [b[0], b[1], Bucket(2, "e" * 64, b[2].records, True, 3, 3)]
    assert consume_until_refused(replan, match="bucket 2 was exported under plan e") == ["x", "y"]
    lost = [b[0], b[2]]
    assert consume_until_refused(lost, match="bucket 2 arrived where bucket 1 was due") == [
        "x", "y",
    ]  # fmt: skip
    assert consume_until_refused(b[1:], match="bucket 1 arrived where bucket 0 was due") == []
    twice = [b[0], b[0], b[1], b[2]]
    assert consume_until_refused(twice, match="bucket 0 arrived where bucket 1") == ["x", "y"]


@pytest.mark.parametrize("num_buckets", [1, 2, 4, 0])
def test_a_last_bucket_must_count_itself_and_the_ones_before(num_buckets):
    b = update()
    wrong = [b[0], b[1], Bucket(2, PLAN, b[2].records, True, num_buckets, 3)]
    assert consume_until_refused(wrong, match=f"bucket 2 says the update has {num_buckets} "
                                 "buckets, but it is the last one") == ["x", "y"]  # fmt: skip


def test_nothing_after_the_last_bucket_and_no_update_without_one():
    b = update()
    after = [*b, Bucket(3, PLAN, (rec("w", 1),), True, 4, 3)]
    assert consume_until_refused(after, match="bucket 3 arrived after the last bucket") == [
        "x", "y", "z",
    ]  # fmt: skip
    early = [Bucket(0, PLAN, (rec("x", 1),), True, 1, 3), *b[1:]]
    assert consume_until_refused(early, match="bucket 1 arrived after the last") == ["x"]
    assert consume_until_refused(b[:2], match=r"incomplete update: 2 bucket\(s\) arrived and "
                                 "none was marked last") == ["x", "y"]  # fmt: skip
    assert consume_until_refused([], match=r"incomplete update: 0 bucket\(s\)") == []


class Clock:
    """time.perf_counter stand-in: each call returns the next of `times`."""

    def __init__(self, *times: float) -> None:
        self.times = iter(times)

    def perf_counter(self) -> float:
        return next(self.times)


class StandIn:
    """What apply_update needs of an Engine: load_weights, which reads every record (so the
    bucket checks raise inside it) and returns the weights_version after the load."""

    def __init__(self, version: int = 7) -> None:
        self.version = version
        self.calls: list[tuple] = []

    def load_weights(self, records, plan_hash, *, step, before_write=None):
        read = []
        self.calls.append((read, plan_hash, step, before_write))
        for r in records:
            read.append(r.name)
        if before_write is not None:
            before_write()
        return self.version


def test_apply_update_loads_the_checked_records_in_one_call_and_reports_them(monkeypatch):
    monkeypatch.setattr(transport, "time", Clock(10.0, 12.5))
    engine, hooked = StandIn(version=9), []
    report = apply_update(engine, update(step=3), PLAN, 3, before_write=lambda: hooked.append(1))
    assert len(engine.calls) == 1
    read, plan_hash, step, _ = engine.calls[0]
    assert (read, plan_hash, step, hooked) == (["x", "y", "z"], PLAN, 3, [1])
    assert report == SyncReport(9, 3, 26, 2.5, event(3, 26))


def test_apply_update_times_from_the_callers_start(monkeypatch):
    monkeypatch.setattr(transport, "time", Clock(12.5))
    engine = StandIn()
    report = apply_update(engine, update(), PLAN, 3, started=4.0)
    assert report.seconds == 8.5 and engine.calls[0][3] is None
    monkeypatch.setattr(transport, "time", Clock(1.0, 1.0))
    assert apply_update(StandIn(), update(), PLAN, 3, started=0.0).seconds == 1.0


def test_apply_update_checks_the_buckets_against_its_plan_and_step():
    engine = StandIn()
    with pytest.raises(ValueError, match="the update from step 4"):
        apply_update(engine, update(step=3), PLAN, 4)
    with pytest.raises(ValueError, match="the update under eeee"):
        apply_update(engine, update(), "e" * 64, 3)
    assert [c[0] for c in engine.calls] == [[], []]


def test_a_report_without_event_when_no_bucket_carries_one(monkeypatch):
    monkeypatch.setattr(transport, "time", Clock(0.0, 0.0))
    b = update()
    b[2] = Bucket(2, PLAN, b[2].records, True, 3, 3)
    assert apply_update(StandIn(), b, PLAN, 3) == SyncReport(7, 3, 26, 0.0, None)


class Exported(Export):
    """An Export as `send` sees one (plan_hash, step, its buckets once), without a model."""

    def __init__(self, buckets, plan_hash: str, step: int) -> None:
        self.plan_hash, self.step, self._list = plan_hash, step, buckets

    def __iter__(self):
        return iter(self._list)


def test_send_an_export_under_its_own_plan_hash_and_step(monkeypatch):
    monkeypatch.setattr(transport, "time", Clock(1.0, 4.0))
    engine = StandIn(version=2)
    transport_ = InProcessTransport(engine)
    assert transport_.engine is engine
    report = transport_.send(Exported(update(step=3), PLAN, 3))
    assert engine.calls[0][:3] == (["x", "y", "z"], PLAN, 3)
    assert report == SyncReport(2, 3, 26, 3.0, event(3, 26))


def test_send_checks_the_buckets_against_the_exports_plan_hash_and_step():
    with pytest.raises(ValueError, match="the update from step 5"):
        InProcessTransport(StandIn()).send(Exported(update(step=3), PLAN, 5))
    with pytest.raises(ValueError, match="the update under ffff"):
        InProcessTransport(StandIn()).send(Exported(update(), "f" * 64, 3))


def test_send_buckets_takes_the_plan_hash_and_step_of_the_first(monkeypatch):
    monkeypatch.setattr(transport, "time", Clock(2.0, 2.25))
    engine = StandIn(version=5)
    report = InProcessTransport(engine).send(iter(update(step=6)))  # an iterator: read once
    assert engine.calls[0][:3] == (["x", "y", "z"], PLAN, 6)
    assert report == SyncReport(5, 3, 26, 0.25, event(6, 26))


def test_send_buckets_checks_the_rest_against_the_first():
    b = update(step=6)
    with pytest.raises(ValueError, match="bucket 1 comes from the export of step 6, the update "
                       "from step 7"):  # fmt: skip
        InProcessTransport(StandIn()).send([Bucket(0, PLAN, (), False, None, 7), *b[1:]])


def test_send_refuses_an_update_without_buckets():
    engine = StandIn()
    with pytest.raises(ValueError, match="an update without buckets: the engine keeps"):
        InProcessTransport(engine).send([])
    assert engine.calls == []


def test_prepend_puts_the_first_bucket_back_before_the_rest():
    rest = iter([2, 3])
    assert list(transport._prepend(1, rest)) == [1, 2, 3]
    assert list(itertools.islice(transport._prepend(0, iter([])), 5)) == [0]


class Now:
    """time.perf_counter stand-in reading `now`, which the test moves."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


def test_send_times_the_sync_from_its_call_the_first_bucket_included(monkeypatch):
    """The report's seconds are the whole sync as the caller sees it: the first bucket, which
    send reads before the load starts (a lazy export quantizes it then), included."""
    clock = Now()
    monkeypatch.setattr(transport, "time", clock)

    def lazy():
        for k, bucket in enumerate(update()):
            clock.now += 5.0 if k == 0 else 1.0  # producing a bucket takes time
            yield bucket

    report = InProcessTransport(StandIn()).send(lazy())
    assert report.seconds == 7.0  # 5 for the first bucket, 1 for each of the other two
