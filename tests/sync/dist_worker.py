"""The ranks of the sync test (spawned by test_distributed.py): rank 0 trains and sends, every
other rank runs an Engine and receives (two or three ranks: one or two engine ranks). Each writes
what it saw to `rank{r}.json` in `out`, one entry per case of `CASES`. gloo: every rank on the
CPU; nccl: rank r on cuda:r, compared with exports made on the CPU.

The cases run in order on every rank and cover both modes of the wire (mxrl.sync.broadcast):
the first update goes bucket by bucket, the next ones scheduled once both ends know the layout.
The engine ranks count the checksum work of the first two receives (every call of
`field_digests`, which every checksum goes through). The last two cases run with a small meta on
every rank (`SMALL_META`), so that some headers (and the scheduled trailer) travel inline and the
others as a broadcast of their own.

Then, with two ranks, the forged updates of tests/sync/attacks.py reach a second engine holding
every stored layout (helpers.MIXED), through a sender of its own (`MIXED_CASES`): each attack
bucket by bucket (the forge does not say its plan) and, where the layout is unchanged, also
scheduled; a stale and a replayed step. The engine rank records whether its bytes, hashes,
version and step stayed (`attacks.engine_state`)."""

import copy
import faulthandler
import json
import math
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from mxrl.engine import Engine
from mxrl.recipe import resolve
from mxrl.sync import BroadcastReceiver, BroadcastSender, wire
from mxrl.weights import digest, export, export_weights, stored_tensors
from tests.sync.attacks import ATTACKS, engine_state
from tests.sync.helpers import MIXED, hashes, tiny

PRESET = "nvfp4-dequantized"
BUCKET_BYTES = 48 * 1024
SMALL_META = 1536  # headers of 1.4-2.7 KB: some inline, some on their own
DEFAULT_META = wire.META_BYTES
# (case, the seed of the weights an engine holds after it: None for a refused update)
CASES = [
    ("good", 1),  # the first update: bucket by bucket
    ("scheduled", 2),  # the layout is known on both ends
    ("corrupted_scheduled", None),
    ("corrupted", None),  # a new sender, without the layout: bucket by bucket
    ("corrupted_on_the_last_rank", None),  # only the last engine rank receives a flipped byte
    ("malformed_trailer", None),  # a scheduled update's trailer without its step
    ("mismatch", None),  # another plan
    ("aborted_scheduled", None),
    ("aborted", None),  # an update that does not say its plan: bucket by bucket
    ("relaid", None),  # the export's layout is not the agreed one: the sender aborts
    ("nan_master", None),  # a master of the last bucket holds NaN: refused at the first one
    ("small_meta", 1),  # bucket by bucket again: the sender forgot the layout
    ("small_meta_scheduled", 2),
]
COUNTED = ("good", "scheduled")


class CountDigests:
    """Wraps digest.field_digests: how often it ran, over how many fields."""

    def __init__(self) -> None:
        self.calls = self.fields = 0
        self.wrapped = digest.field_digests

    def __call__(self, fields, backend=None):
        self.calls += 1
        self.fields += len(fields)
        return self.wrapped(fields, backend)


def flip_first_byte_of_bucket_1(index: int, payload: torch.Tensor) -> None:
    if index == 1:
        payload[0] ^= 0x01  # the first byte of the bucket's first tensor: data, not padding


class FailsMidway:
    """An update whose export breaks after its first bucket; `keyed`: it says its plan, bucket
    size and bf16 dtype, as an Export does (so it can go scheduled)."""

    step = 3

    def __init__(self, update, keyed: bool) -> None:
        self.update = update
        if keyed:
            self.plan_hash, self.bucket_bytes = update.plan_hash, update.bucket_bytes
            self.bf16_dtype = update.bf16_dtype

    def __iter__(self):
        buckets = iter(self.update)
        yield next(buckets)
        raise RuntimeError("export failed after bucket 0")


class Relabelled:
    """An export in half-size buckets that claims the usual bucket size: a layout that is not
    the one the ends agreed on, under the same key."""

    def __init__(self, update) -> None:
        self.update, self.step = update, update.step
        self.plan_hash, self.bucket_bytes = update.plan_hash, BUCKET_BYTES
        self.bf16_dtype = update.bf16_dtype

    def __iter__(self):
        return iter(self.update)


def sender_cases(trained, trained_more, shapes) -> dict:
    """What rank 0 does in each case (send, and say how it went), and a list holding the
    sender the last case used."""
    plan = resolve(PRESET, shapes)
    sender = BroadcastSender(src=0)
    used = [sender]  # the sender of the last case (its last_mode says how the case went)

    def x(model, step, bucket_bytes=BUCKET_BYTES, p=plan):
        return export(model, p, bucket_bytes=bucket_bytes, step=step)

    def send(s, update):
        used[0] = s
        report = s.send(update)
        return {"version": report.version, "num_bytes": report.num_bytes, "mode": s.last_mode}

    def tampered(update):
        sender.tamper = flip_first_byte_of_bucket_1
        try:
            return send(sender, update)
        finally:
            sender.tamper = None

    def without_step(update):
        send_meta = sender._send_meta

        def drop_step(flags, header, payload_len):
            if b'"hashes"' in header:  # the trailer: valid JSON, valid sha256, no step
                trailer = json.loads(header)
                del trailer["step"]
                header = json.dumps(trailer).encode()
            send_meta(flags, header, payload_len)

        sender._send_meta = drop_step
        try:
            return send(sender, update)
        finally:
            del sender._send_meta

    def small_meta(update):
        wire.META_BYTES = SMALL_META
        return send(sender, update)

    good = x(trained, 1)
    diverged = copy.deepcopy(trained)
    with torch.no_grad():
        list(diverged.parameters())[-1].view(-1)[-1] = math.nan
    return {
        "good": lambda: {**send(sender, good), "event": good.event.to_dict()},
        "scheduled": lambda: send(sender, x(trained_more, 2)),
        "corrupted_scheduled": lambda: tampered(x(trained, 3)),
        "corrupted": lambda: send(
            BroadcastSender(src=0, tamper=flip_first_byte_of_bucket_1), x(trained, 3)
        ),
        "corrupted_on_the_last_rank": lambda: send(sender, x(trained, 3)),
        "malformed_trailer": lambda: without_step(x(trained, 3)),
        "mismatch": lambda: send(sender, x(trained, 3, p=resolve("mxfp8", shapes))),
        "aborted_scheduled": lambda: send(sender, FailsMidway(x(trained, 3), keyed=True)),
        "aborted": lambda: send(sender, FailsMidway(x(trained, 3), keyed=False)),
        "relaid": lambda: send(sender, Relabelled(x(trained, 3, BUCKET_BYTES // 2))),
        "nan_master": lambda: send(sender, x(diverged, 3)),
        "small_meta": lambda: small_meta(x(trained, 4)),
        "small_meta_scheduled": lambda: send(sender, x(trained_more, 5)),
    }, used


# (case, the step it sends, accepted?) of the MIXED phase: the forges go bucket by bucket
# ("attack:ID"), those that keep every field's shape also scheduled ("scheduled:ID")
SAME_LAYOUT = ("swap_nvfp4_experts", "swap_bf16", "nan_global_scale", "unshared_gate_up")
MIXED_CASES = [
    ("mixed_good", 1, True),  # bucket by bucket: the sender learns the layout
    ("mixed_scheduled", 2, True),
    ("stale", 1, False),  # an older step's export after a newer one
    ("replayed", 2, False),
    *((f"attack:{a[0]}", 3, False) for a in ATTACKS),
    *((f"scheduled:{a}", 3, False) for a in SAME_LAYOUT),
    ("mixed_after", 3, True),  # the step the refused ones carried: not consumed
]


class Forged:
    """An export whose buckets pass through an attack; `keyed`: it says its plan, bucket size
    and bf16 dtype (so it goes scheduled when the layout is agreed)."""

    def __init__(self, update, forge, keyed: bool) -> None:
        self.update, self.forge, self.step = update, forge, update.step
        if keyed:
            self.plan_hash, self.bucket_bytes = update.plan_hash, update.bucket_bytes
            self.bf16_dtype = update.bf16_dtype

    def __iter__(self):
        return iter(self.forge(list(self.update)))


def mixed_sender(trained, trained_more, shapes) -> dict:
    """rank 0's action per MIXED case: what it sent and how it went."""
    plan = resolve(MIXED, shapes)
    sender = BroadcastSender(src=0)
    forges = {a[0]: a[1] for a in ATTACKS}

    def update(case, step):
        model = trained_more if case in ("mixed_scheduled", "replayed") else trained
        honest = export(model, plan, bucket_bytes=BUCKET_BYTES, step=step)
        kind, _, attack = case.partition(":")
        if kind in ("attack", "scheduled"):
            return Forged(honest, forges[attack], keyed=kind == "scheduled")
        return honest

    def act(case, step):
        try:
            report = sender.send(update(case, step))
            return {"version": report.version, "mode": sender.last_mode}
        except ValueError as e:
            return {"refused": str(e), "mode": sender.last_mode}

    return {case: (lambda c=case, s=step: act(c, s)) for case, step, _ in MIXED_CASES}


def mixed_engine_cases(device) -> dict:
    """The engine rank's side of the MIXED phase: per case, what it saw."""
    engine = Engine(tiny(seed=0), MIXED, device=device)
    receiver = BroadcastReceiver(engine, src=0)
    seen = {}
    for case, _, _ in MIXED_CASES:
        before = engine_state(engine)
        try:
            receiver.receive()
            got = {"accepted": True}
        except ValueError as e:
            got = {"refused": str(e)}
        got.update(mode=receiver.last_mode, unchanged=engine_state(engine) == before,
                   version=engine.weights_version, step=engine.weights_step)  # fmt: skip
        seen[case] = got
    return seen


def run(rank: int, port: int, out: str, backend: str = "gloo", world_size: int = 2) -> None:
    faulthandler.enable(all_threads=True)  # a native abort shows every thread's Python stack
    torch.set_num_threads(1)
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=60),
    )
    trained, trained_more = tiny(seed=1).to(device), tiny(seed=2).to(device)
    shapes = {n: p.shape for n, p in trained.named_parameters()}
    seen: dict = {}
    if rank == 0:
        actions, used = sender_cases(trained, trained_more, shapes)
        for case, _ in CASES:
            try:
                seen[case] = actions[case]()
            except (ValueError, RuntimeError) as e:
                seen[case] = {"refused": str(e), "mode": used[0].last_mode}
    else:
        engine = Engine(tiny(seed=0), PRESET, device=device)
        receiver = BroadcastReceiver(engine, src=0)
        local = {
            seed: hashes(export_weights(tiny(seed=seed).named_parameters(), engine.plan))
            for seed in (1, 2)
        }  # exported on the CPU
        fields = sum(len(stored_tensors(v)) for v in engine.weights.values())
        num_buckets = sum(1 for _ in export(tiny(seed=1), engine.plan, bucket_bytes=BUCKET_BYTES))
        for case, seed in CASES:
            if case == "small_meta":
                wire.META_BYTES = SMALL_META
            held = hashes(engine.records())
            last_rank = rank == world_size - 1
            if case == "corrupted_on_the_last_rank" and last_rank:
                receiver.tamper = flip_first_byte_of_bucket_1
            count = digest.field_digests = CountDigests()  # the receive's checksums only
            try:
                report, error = receiver.receive(), None
            except ValueError as e:
                report, error = None, e
            finally:
                digest.field_digests = count.wrapped
                receiver.tamper = None
            if report is not None:
                got = {
                    "version": report.version,
                    "num_bytes": report.num_bytes,
                    "equal_to_local_export": seed is not None
                    and hashes(engine.records()) == local[seed],
                    "event": report.event.to_dict(),
                }
            else:
                got = {
                    "refused": str(error),
                    "version": engine.weights_version,
                    "equal_to_previous": hashes(engine.records()) == held,
                }
            got["mode"] = receiver.last_mode
            if case in COUNTED:
                got.update(digest_calls=count.calls, digested_fields=count.fields)
                got.update(fields=fields, num_buckets=num_buckets)
            got["device"] = str(next(iter(engine.weights.values())).device)
            seen[case] = got
    if world_size == 2:
        wire.META_BYTES = DEFAULT_META
        if rank == 0:
            for case, act in mixed_sender(trained, trained_more, shapes).items():
                seen[case] = act()
        else:
            seen.update(mixed_engine_cases(device))
    dist.barrier()
    dist.destroy_process_group()
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(seen))
