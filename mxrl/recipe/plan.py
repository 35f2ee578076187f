"""Plan: every tensor's format, resolved from a recipe against a model's tensors
(`mxrl.recipe.resolver.resolve`).

The plan hash is the precision contract trainer and engine compare before any exchange. It is the
sha256 of canonical JSON (sorted keys, no whitespace, tensors sorted by name) of
`{"schema": PLAN_SCHEMA_VERSION, "tensors": [{name, shape, format, activations, fuse_group,
block}, ...]}` (a tensor with NVFP4's `scale_mode: 4over6` adds `"scale_mode": "4over6"` to its
entry), plus `"kv_cache": "fp8"` for a recipe that quantizes the KV cache — exactly what
decides the bytes a quantizer writes (a plan without either hashes as it always did). It leaves
out rule provenance (two recipes that assign the same formats give the same hash), the recipe
name, and `backward`, which changes how training computes gradients but not one byte of a weight
or an activation.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from mxrl.arch.names import Kind
from mxrl.formats.constants import Format
from mxrl.recipe.audit import format_summary, format_table
from mxrl.recipe.schema import ACTIVATIONS, Backward, KVCacheFormat

logger = logging.getLogger(__name__)

PLAN_SCHEMA_VERSION = 1
NOT_MATMUL = "not a matmul weight"
DEFAULT_RULE = "default"


@dataclass(frozen=True)
class TensorSpec:
    """How one tensor is stored and fed to its GEMM.

    activations: the NVFP4 activation global scale (per_token | per_tensor); None unless nvfp4.
      NVFP4 weights always carry one FP32 global scale per tensor (per expert for 3-D tensors).
    fuse_group: gate and up tensors with the same fuse_group share one NVFP4 global scale. A fused
      `gate_up_proj` tensor is its own group; when None, its gate and up halves get separate
      scales, as the per-expert layout would.
    block: fp8_block weight block (activations use (1, block[1])); None for other formats.
    scale_mode: NVFP4's block-scale rule for the weight and its activation: None (the standard,
      TE's) or "4over6" (docs/formats.md); hashed only when set.
    rule: provenance for audits ("rules[2] {kind: routed_expert}", "default",
      "not a matmul weight"); not part of the hash.
    """

    name: str
    shape: tuple[int, ...]
    kind: Kind
    layer: int | None
    expert: int | None
    role: str
    format: Format
    activations: str | None = None
    fuse_group: str | None = None
    block: tuple[int, int] | None = None
    rule: str = DEFAULT_RULE
    scale_mode: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        object.__setattr__(self, "kind", Kind(self.kind))
        object.__setattr__(self, "format", Format(self.format))
        if self.block is not None:
            object.__setattr__(self, "block", tuple(int(b) for b in self.block))
        nvfp4 = self.format is Format.NVFP4
        if nvfp4 and self.activations not in ACTIVATIONS:
            raise ValueError(
                f"{self.name}: activations must be one of {ACTIVATIONS} for nvfp4, "
                f"got {self.activations!r}"
            )
        if not nvfp4 and (self.activations is not None or self.fuse_group is not None):
            raise ValueError(
                f"{self.name}: activations and fuse_group are nvfp4 fields; this tensor is "
                f"{self.format}, set them to None"
            )
        if (self.format is Format.FP8_BLOCK) != (self.block is not None):
            raise ValueError(f"{self.name}: block is set exactly when format is fp8_block")
        if self.scale_mode not in (None, "4over6") or (self.scale_mode and not nvfp4):
            raise ValueError(
                f"{self.name}: scale_mode is None or '4over6', and '4over6' only for nvfp4; "
                f"got {self.scale_mode!r} for {self.format}"
            )

    def contract(self) -> dict[str, Any]:
        """The hashed fields: what decides the bytes a quantizer writes for this tensor
        (`scale_mode` only when set, so that every plan without it keeps its hash)."""
        out = {
            "name": self.name,
            "shape": list(self.shape),
            "format": self.format.value,
            "activations": self.activations,
            "fuse_group": self.fuse_group,
            "block": list(self.block) if self.block is not None else None,
        }
        if self.scale_mode is not None:
            out["scale_mode"] = self.scale_mode
        return out

    def to_dict(self) -> dict[str, Any]:
        d = self.contract()
        d.update(
            kind=self.kind.value,
            layer=self.layer,
            expert=self.expert,
            role=self.role,
            rule=self.rule,
        )
        return d


@dataclass(frozen=True)
class Plan(Mapping[str, TensorSpec]):
    """tensor name -> TensorSpec, in the model's tensor order, plus the recipe's training mode."""

    recipe_name: str
    backward: Backward
    num_layers: int
    specs: tuple[TensorSpec, ...]
    # what the recipe says but this plan does not do (`check`); not part of the contract
    problems: tuple[str, ...] = field(default=(), compare=False)
    # how attention keys and values are held (part of the contract when fp8)
    kv_cache: KVCacheFormat = KVCacheFormat.COMPUTE
    _index: dict[str, TensorSpec] = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "backward", Backward(self.backward))
        object.__setattr__(self, "kv_cache", KVCacheFormat(self.kv_cache))
        object.__setattr__(self, "specs", tuple(self.specs))
        object.__setattr__(self, "problems", tuple(self.problems))
        index = {s.name: s for s in self.specs}
        if len(index) != len(self.specs):
            counts = Counter(s.name for s in self.specs)
            dupes = sorted(name for name, n in counts.items() if n > 1)
            raise ValueError(f"specs: duplicate tensor names in a plan: {dupes[:5]}")
        object.__setattr__(self, "_index", index)

    def __getitem__(self, name: str) -> TensorSpec:
        return self._index[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._index)

    def __len__(self) -> int:
        return len(self.specs)

    def __contains__(self, name: object) -> bool:
        return name in self._index

    def hash(self) -> str:
        """sha256 hex of the canonical contract JSON (module docstring says what it covers)."""
        return self._contract_hash

    @cached_property
    def _contract_hash(self) -> str:
        contract: dict[str, Any] = {
            "schema": PLAN_SCHEMA_VERSION,
            "tensors": sorted((s.contract() for s in self.specs), key=lambda d: d["name"]),
        }
        if self.kv_cache is not KVCacheFormat.COMPUTE:
            contract["kv_cache"] = self.kv_cache.value
        text = json.dumps(contract, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        return hashlib.sha256(text.encode("ascii")).hexdigest()

    @property
    def quantized(self) -> bool:
        """Whether any tensor of the plan is stored in a low-precision format."""
        return any(s.format is not Format.BF16 for s in self.specs)

    def check(self, strict: bool = True) -> None:
        """Refuse (strict) or loudly warn about a plan that does not do what its recipe says:
        a name glob that matches no tensor, a low-precision rule that assigns none, a recipe
        that quantizes nothing in this model (`problems`, found by `resolve`)."""
        if not self.problems:
            return
        # one line: the CLI prints a refusal as one `mxrl: error:` line
        listed = "; ".join(self.problems)
        message = f"recipe {self.recipe_name!r} does not do what it says on this model: {listed}"
        if strict:
            raise ValueError(
                f"{message}. Fix the recipe's rules (`mxrl recipe show RECIPE --model DIR` prints "
                "the plan), or allow it explicitly (--allow-unmatched; `strict: false` in a "
                "train config)"
            )
        logger.warning("%s (allowed: not strict)", message)

    def summary(self) -> str:
        """The audit's per-format summary (what `convert` and `train` print first)."""
        return format_summary(self)

    def table(self) -> str:
        """The audit: one line per tensor (per expert group for per-expert tensors), a summary."""
        return format_table(self)

    def to_json(self, indent: int | None = None) -> str:
        """Everything (provenance and backward included); `Plan.from_json` inverts it."""
        data = {
            "schema": PLAN_SCHEMA_VERSION,
            "recipe_name": self.recipe_name,
            "backward": self.backward.value,
            "num_layers": self.num_layers,
            "kv_cache": self.kv_cache.value,
            "hash": self.hash(),
            "problems": list(self.problems),
            "tensors": [s.to_dict() for s in self.specs],
        }
        return json.dumps(data, indent=indent, sort_keys=False)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        data = json.loads(text)
        if data.get("schema") != PLAN_SCHEMA_VERSION:
            raise ValueError(
                f"plan schema {data.get('schema')!r} is not {PLAN_SCHEMA_VERSION}; re-resolve the "
                "recipe with this version of mxrl"
            )
        plan = cls(
            recipe_name=data["recipe_name"],
            backward=data["backward"],
            num_layers=int(data["num_layers"]),
            specs=tuple(TensorSpec(**t) for t in data["tensors"]),
            problems=tuple(data.get("problems", ())),
            kv_cache=data.get("kv_cache", KVCacheFormat.COMPUTE),  # older files: the default
        )
        if "hash" in data and data["hash"] != plan.hash():
            raise ValueError(
                f"plan JSON says hash {data['hash']} but its tensors hash to {plan.hash()}: the "
                "file was edited or corrupted; re-resolve it from its recipe"
            )
        return plan
