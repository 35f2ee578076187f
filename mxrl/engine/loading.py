"""Verified weight loading for the engine: every record checked against the plan (each field's
dtype, shape and layout; the NVFP4 global scales' values) and its checksum before any live byte
changes, then copied into the buffers the engine already holds (same shapes, dtypes and storage,
so captured CUDA graphs stay valid); new buffers only on a first load or a changed layout.
`Engine` takes these methods from `WeightLoading`.

Steps: every update a transport applies carries the training step it was exported at, and the
engine takes only a step greater than the last one it loaded (`weights_step`; None until the
first update: an engine built from master weights or a checkpoint takes any step). So a stale
update (an older export arriving after a newer one) or a replayed one is refused. A resume
re-sends the checkpoint's weights at the checkpoint's step to an engine built for the resumed
run, which has no step yet, so it is accepted and the run goes on from there; an engine that has
served later steps refuses it (roll back by building a fresh engine). Loads that are no update
(`step=None`: construction, a quantized checkpoint, a caller's own records) are not part of the
sequence and leave `weights_step` alone.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable

import torch
from torch import nn

from mxrl.arch.names import keeps_fp32
from mxrl.formats import QTensor
from mxrl.nn.experts import EXPERT_PARAMS
from mxrl.nn.paths.rollout import RolloutExperts, RolloutLinear
from mxrl.weights import (
    GlobalScaleCheck,
    PendingChecksums,
    VerifiedRecord,
    WeightRecord,
    WeightValue,
    check_record,
    checksums,
    stored_tensors,
    verified_records,
)

logger = logging.getLogger(__name__)

TIED_EMBEDDING = "model.embed_tokens.weight"
# Staging ahead (while the device computes the update's checksums) holds every staged value at
# once; values whose staging derives new tensors (operands of an emulated GEMM, a copy from
# another device) are staged ahead only up to this many new bytes, the rest one by one as they
# are written, each freed before the next is derived.
STAGE_AHEAD_BYTES = 256 * 2**20
_EXPERT_ROLE = {param: role for role, param in EXPERT_PARAMS.items()}  # gate_up_proj -> gate_up


class WeightLoading:
    """The weights half of `Engine` (it provides net, plan, config, device, compute_dtype,
    weight_dtype, weights, hashes, weights_version, weights_step, _blocks and
    _invalidate_graphs)."""

    def _target(self, name: str) -> tuple[nn.Module, str]:
        """The module holding `name` and the attribute, looked up once per net: the engine
        builds its modules once (`Engine._build`) and loads only set their attributes, so a
        name's module is the same until `self.net` is another net (then looked up again)."""
        cache = self.__dict__.get("_targets")
        if cache is None or cache[0] is not self.net:
            cache = self.__dict__["_targets"] = (self.net, {})
        found = cache[1].get(name)
        if found is None:
            owner, _, attr = name.rpartition(".")
            found = cache[1][name] = (self.net.get_submodule(owner), attr)
        return found

    def _check(self, record: WeightRecord) -> None:
        """A record against the plan: a known name, then every field (kind, format, shape,
        axis, each field's dtype and shape: `mxrl.weights.check_record`); raises ValueError."""
        spec = self.plan.get(record.name)
        if spec is None:
            raise ValueError(f"{record.name!r} is not in the engine's plan: unknown tensor")
        check_record(record, spec, self.weight_dtype)

    def _check_step(self, step: int | None) -> None:
        """An update's step must pass the last one this engine loaded (stale or replayed
        updates are refused); None: a load outside the update sequence (module docstring)."""
        if step is None:
            return
        if not isinstance(step, int) or isinstance(step, bool):
            raise TypeError(f"step must be an int, got {step!r}")
        if self.weights_step is not None and step <= self.weights_step:
            what = "replayed" if step == self.weights_step else "stale"
            raise ValueError(
                f"weight update of step {step} refused: the engine holds the weights of step "
                f"{self.weights_step} and takes only a later step (a {what} update); it keeps "
                "its previous weights"
            )

    def _stage(self, name: str, value: WeightValue) -> tuple:
        """(value on the engine's device, what its module holds for it): new tensors, nothing
        installed yet. The same structure as `_installed` gives for the live weights."""
        device = _with_index(self.device)  # where .to(self.device) puts a tensor
        if any(t.device != device for t in stored_tensors(value).values()):
            value = value.to(self.device)  # (a QTensor's .to builds a new one even in place)
        module, attr = self._target(name)
        if isinstance(module, RolloutLinear) and attr == "weight":
            return value, module.materialize(value)
        if isinstance(module, RolloutExperts):
            return value, module.materialize(_EXPERT_ROLE[attr], value)
        # the fp32 tensors (DeepSeek's router bias) stay fp32 (mxrl.arch.names.keeps_fp32)
        return value, value.to(torch.float32 if keeps_fp32(name) else self.compute_dtype)

    def _installed(self, name: str) -> tuple | None:
        """What the forward reads for `name` now (None before the first load)."""
        if name not in self.weights:
            return None
        module, attr = self._target(name)
        if isinstance(module, RolloutLinear) and attr == "weight":
            held = {k: getattr(module, k) for k in ("w", "weight")}
        elif isinstance(module, RolloutExperts):
            held = module.values[_EXPERT_ROLE[attr]]
        else:
            held = getattr(module, attr)
        return self.weights[name], held

    def _install(self, name: str, staged: tuple) -> None:
        """Point the module at new tensors (a load that could not be done in place)."""
        value, held = staged
        module, attr = self._target(name)
        if isinstance(module, RolloutLinear) and attr == "weight":
            for key, v in held.items():
                setattr(module, key, v)
        elif isinstance(module, RolloutExperts):
            module.values[_EXPERT_ROLE[attr]] = held
        elif isinstance(module, RolloutLinear):
            setattr(module, attr, held)
        else:
            setattr(module, attr, nn.Parameter(held, requires_grad=False))
            if name == TIED_EMBEDDING and self.config.tie_word_embeddings:
                self.net.lm_head.weight = held
        self.weights[name] = value

    def _verify(
        self, records: Iterable[WeightRecord], plan_hash: str, step: int | None, partial: bool
    ) -> tuple[dict[str, WeightRecord], _Verification]:
        """Phase 1 of `load_weights`, nothing written: the records by name once the plan hash,
        the step, every record against the plan and the update's completeness have been checked
        (raises ValueError otherwise), and the checks of their bytes, queued on the device: the
        checksums and the global scales (`_Verification.result()` raises)."""
        if plan_hash != self.plan.hash():
            raise ValueError(
                f"plan hash mismatch: the weights were exported under plan {plan_hash[:16]}, the "
                f"engine runs plan {self.plan.hash()[:16]} ({self.plan.recipe_name}); trainer and "
                "engine must resolve the same recipe for the same model. Nothing was loaded."
            )
        self._check_step(step)
        received: dict[str, WeightRecord] = {}
        for record in records:
            if record.name in received:
                raise ValueError(f"{record.name} was sent twice in one update")
            received[record.name] = record
        # each checksum once: records verified in this process already (VerifiedRecord, e.g.
        # by BroadcastReceiver as their bucket arrived) are not computed again. Queued before
        # the records are checked against the plan (on the host, while the device computes
        # them: records that are not even a name and a tensor are checked first), and not
        # waited for: the caller stages the update meanwhile.
        todo = [r for r in received.values() if not isinstance(r, VerifiedRecord)]
        sums = _queued_checksums(todo) if all(map(_hashable, todo)) else None
        for record in received.values():
            self._check(record)
        if not partial:
            missing = [n for n in self.plan if n not in received]
            if missing:
                raise ValueError(
                    f"incomplete update: {len(missing)} tensor(s) missing, e.g. {missing[:3]}; "
                    "the engine keeps its previous weights"
                )
        sums = sums or _queued_checksums(todo)
        return received, _Verification(todo, sums, GlobalScaleCheck(received.values(), self.plan))

    def _stage_ahead(self, received: dict[str, WeightRecord], live: dict) -> dict[str, tuple]:
        """Every record whose layout changed, and the others in order while the new tensors
        their staging derives stay within STAGE_AHEAD_BYTES (`load_weights`)."""
        ahead: dict[str, tuple] = {}
        fresh = 0
        for name, record in received.items():
            if fresh <= STAGE_AHEAD_BYTES or not _same_value_layout(live[name], record.value):
                ahead[name] = staged = self._stage(name, record.value)
                fresh += _fresh_bytes(staged, record.value)
        return ahead

    def load_weights(
        self,
        records: Iterable[WeightRecord],
        plan_hash: str,
        *,
        step: int | None = None,
        partial: bool = False,
        before_write: Callable[[], None] | None = None,
    ) -> int:
        """Verify, then load, a set of exported weights; returns the new weights_version.

        All or nothing: the plan hash; the step (an update's `step` must be greater than the
        last one loaded, `weights_step`: a stale or replayed update is refused; None loads
        outside that sequence and leaves `weights_step` as it is); every record (a known name,
        each field's dtype, shape and layout as the plan says, its checksum over its name and
        bytes recomputed on the device holding it, once: a `VerifiedRecord` was checksummed in
        this process already and is not computed again); the NVFP4 global scales (finite,
        positive, one per gate/up fuse pair; one host read); and, unless `partial`, the
        presence of every tensor of the plan are checked before any byte of the live weights is
        written; any failure raises ValueError naming the tensor, and the previous weights,
        hashes, `weights_version` and `weights_step` stay. Then each tensor is copied into the
        buffers the engine already holds (same shapes, dtypes and storage: captured CUDA graphs
        stay valid); only a first load, or a layout that changed, installs new buffers (and
        drops the captured graphs).

        before_write: called once everything is checked and staged, right before the first live
        byte is written; if it raises, nothing is written (a distributed receiver agrees there
        with the other engine ranks that every one of them can load).
        """
        received, verification = self._verify(records, plan_hash, step, partial)
        # staged while the device computes the checksums, before any live byte is written:
        # what cannot be loaded in place, and what can as far as STAGE_AHEAD_BYTES allows
        live = {name: self._installed(name) for name in received}
        ahead = self._stage_ahead(received, live)
        copies = {name: _copies(live[name], new) for name, new in ahead.items()}
        replaced = {name: ahead[name] for name, pairs in copies.items() if pairs is None}
        verification.result()  # the one wait: checksums, then the NVFP4 global scales
        if before_write is not None:
            before_write()
        with torch.no_grad():  # into the live buffers; only memory can fail from here
            # the staged-ahead values, launched back to back
            _copy_leaves([pair for pairs in copies.values() if pairs for pair in pairs])
            for name, record in received.items():
                if name in ahead:
                    continue
                new = self._stage(name, record.value)  # derived now, freed before the next
                pairs = _copies(live[name], new)
                if pairs is None:
                    replaced[name] = new
                else:
                    _copy_leaves(pairs)
        for name, staged in replaced.items():
            self._install(name, staged)
        for name, record in received.items():
            self.hashes[name] = record.hash
        if replaced:
            self._invalidate_graphs()
        self.reset_prefix_cache()  # cached prefixes hold keys/values of the old weights
        self.weights_version += 1
        if step is not None:
            self.weights_step = step
        logger.info(
            "engine: loaded %d tensors (%d in place, version %d)",
            len(received), len(received) - len(replaced), self.weights_version,
        )  # fmt: skip
        return self.weights_version

    def records(self) -> Iterable[WeightRecord]:
        """The weights the engine holds, as records (for checks and checkpoints); the values are
        the live tensors, which the next load overwrites in place."""
        names = list(self.weights)
        values = [self.weights[n] for n in names]
        for name, value, sum_ in zip(names, values, checksums(names, values), strict=True):
            yield WeightRecord(name, value, sum_)


def _with_index(device: torch.device) -> torch.device:
    """`device` as `Tensor.to` resolves it: a CUDA device without an index is the current one."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _leaves(obj) -> list[torch.Tensor | None]:
    """The tensors of a staged or installed weight, in a fixed order (None where absent)."""
    if obj is None or isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, QTensor):
        return [obj.qdata, obj.scale, obj.global_scale]
    if isinstance(obj, (tuple, list)):
        return [t for item in obj for t in _leaves(item)]
    if isinstance(obj, dict):
        return [t for key in sorted(obj) for t in _leaves(obj[key])]
    if dataclasses.is_dataclass(obj):
        names = _FIELDS.get(type(obj))
        if names is None:
            names = _FIELDS[type(obj)] = tuple(f.name for f in dataclasses.fields(obj))
        return [t for name in names for t in _leaves(getattr(obj, name))]
    raise TypeError(f"no tensors known in {type(obj).__name__}")


_FIELDS: dict[type, tuple[str, ...]] = {}  # a dataclass type's field names, in order


def _same_layout(live, new, *, values_only: bool = False) -> bool:
    """Whether `new` can be copied into `live` tensor for tensor (same shapes, dtypes, devices;
    values_only: compare the held values, the first item of each, only)."""
    if live is None:
        return False
    if values_only:
        live, new = live[0], new[0]
    return _same_leaves(_leaves(live), _leaves(new), values_only=values_only)


def _same_value_layout(live, value) -> bool:
    """The held value against a received one (shapes and dtypes; the devices may differ)."""
    return _same_layout(live, (value, None), values_only=True)


def _same_leaves(a: list, b: list, *, values_only: bool = False) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if (x is None) != (y is None):
            return False
        if x is not None and (x.shape != y.shape or x.dtype != y.dtype):
            return False
        if x is not None and not values_only and x.device != y.device:
            return False
    return True


def _copies(live, new) -> list | None:
    """The (live, staged) tensor pairs that load `new` into `live` in place, or None where it
    cannot be (nothing held yet, or another layout: `_same_layout`). Each side's leaves are
    listed once."""
    if live is None:
        return None
    dsts, srcs = _leaves(live), _leaves(new)
    return list(zip(dsts, srcs, strict=True)) if _same_leaves(dsts, srcs) else None


def _copy_leaves(pairs: list) -> None:
    """Each staged tensor into its live one, (live, staged) pairs (a held value is often its
    own operand: one copy per pair of storages; none where they are one)."""
    done = set()
    for dst, src in pairs:
        if dst is None or (dst.data_ptr(), src.data_ptr()) in done:
            continue
        done.add((dst.data_ptr(), src.data_ptr()))
        if dst.data_ptr() != src.data_ptr():
            dst.copy_(src)


def _fresh_bytes(staged: tuple, value: WeightValue) -> int:
    """Bytes of the storages a staged value holds that the received value does not (what its
    staging derived: an emulated GEMM's operands, a copy on the engine's device)."""
    own = {t.untyped_storage().data_ptr() for t in stored_tensors(value).values()}
    fresh = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for t in _leaves(staged)
        if t is not None and t.untyped_storage().data_ptr() not in own
    }
    return sum(fresh.values())


def _hashable(record: WeightRecord) -> bool:
    """Whether a record's checksum can be computed before it is checked against the plan."""
    return type(record.name) is str and isinstance(record.value, (QTensor, torch.Tensor))


def _queued_checksums(records: list[WeightRecord]) -> PendingChecksums:
    return PendingChecksums([r.name for r in records], [r.value for r in records])


class _Verification:
    """An update's byte checks, queued on the device by `_verify`: the checksums of the records
    not verified yet and the NVFP4 global scales. `result()` waits for both (one host read per
    device for each, the second already done when the first arrives) and raises ValueError as
    they do, checksums first."""

    def __init__(
        self, todo: list[WeightRecord], sums: PendingChecksums, scales: GlobalScaleCheck
    ) -> None:
        self.todo = todo
        self.sums = sums
        self.scales = scales

    def result(self) -> None:
        verified_records(self.todo, self.sums.wait())
        self.scales.result()
