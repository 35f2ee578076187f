"""The rollout engine: the trainer's model code, weights held as the plan says, batched
generation with a KV cache, and verified weight loading shared by construction and live sync.

    engine = Engine(model, "nvfp4-dequantized")
    outs = engine.generate([[1, 2, 3], [4, 5]], SamplingParams(temperature=1.0, seed=0))
    engine.load_weights(export_weights(model.named_parameters(), engine.plan), engine.plan.hash())
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from torch import nn

from mxrl.engine.checkpoint import read_quantized_checkpoint
from mxrl.engine.modules import RolloutExperts, RolloutLinear
from mxrl.engine.params import Completion, SamplingParams
from mxrl.engine.runner import RequestCache, forward_step
from mxrl.engine.sampler import sample
from mxrl.engine.weights import WeightRecord, content_hash, export_weights
from mxrl.formats import QTensor
from mxrl.formats.constants import Format
from mxrl.kernels import Backend, select_backend
from mxrl.models import CausalLM, ModelConfig
from mxrl.nn.experts import GroupedExperts
from mxrl.recipe import Plan, Recipe, resolve

logger = logging.getLogger(__name__)


class Engine:
    """Rollout engine for an mxrl model (see module docstring).

    model: the trainer's CausalLM (master weights); only its config and its weights (exported
      once, through `export_weights`) are used. recipe: preset name, YAML path, Recipe or a
      resolved Plan. tile: tokens per fixed-shape tile (batch invariance, see engine/modules.py).
      backend: the activation quantizer ("reference" | "triton"), chosen once for `device`
      (default: triton on CUDA when available); every backend writes the same bytes.
    """

    def __init__(
        self,
        model: CausalLM,
        recipe: Recipe | Plan | str | Path,
        *,
        device: torch.device | str | None = None,
        compute_dtype: torch.dtype = torch.float32,
        weight_dtype: torch.dtype = torch.bfloat16,
        tile: int = 32,
        backend: Backend | str | None = None,
    ) -> None:
        shapes = {n: p.shape for n, p in model.named_parameters()}
        plan = recipe if isinstance(recipe, Plan) else resolve(recipe, shapes)
        self._setup(
            model.config,
            plan,
            torch.device(device) if device is not None else _device_of(model),
            compute_dtype,
            weight_dtype,
            tile,
            backend,
        )
        records = export_weights(model.named_parameters(), self.plan, bf16_dtype=weight_dtype)
        self.load_weights(records, self.plan.hash())

    @classmethod
    def from_records(
        cls,
        config: ModelConfig,
        plan: Plan,
        records: Iterable[WeightRecord],
        *,
        device: torch.device | str = "cpu",
        compute_dtype: torch.dtype = torch.float32,
        weight_dtype: torch.dtype = torch.bfloat16,
        tile: int = 32,
        backend: Backend | str | None = None,
    ) -> Engine:
        """An engine that never saw master weights: a config, a plan and exported records
        (a converted checkpoint, a first sync), verified by `load_weights`."""
        engine = cls.__new__(cls)
        engine._setup(
            config, plan, torch.device(device), compute_dtype, weight_dtype, tile, backend
        )
        engine.load_weights(records, plan.hash())
        return engine

    @classmethod
    def from_checkpoint(cls, path: str | Path, **kwargs) -> Engine:
        """Load a quantized checkpoint written by `mxrl convert` (plan, manifest hashes, shard
        sha256s all checked); kwargs as `from_records`."""
        plan, config, records = read_quantized_checkpoint(path)
        return cls.from_records(ModelConfig.from_hf(config), plan, records, **kwargs)

    def _setup(self, config, plan, device, compute_dtype, weight_dtype, tile, backend) -> None:
        self.config, self.plan, self.device = config, plan, device
        self.backend = select_backend(backend, device)  # chosen once for the engine's device
        self.compute_dtype, self.weight_dtype, self.tile = compute_dtype, weight_dtype, tile
        self.net = self._build()
        self.weights: dict[str, QTensor | torch.Tensor] = {}
        self.weights_version = 0

    # --- weights -------------------------------------------------------------------------------
    def _build(self) -> CausalLM:
        with torch.device("meta"):
            net = CausalLM(self.config, dtype=self.compute_dtype)
        for name, module in list(net.named_modules()):
            if isinstance(module, GroupedExperts):
                specs = {
                    "gate_up": self.plan[f"{name}.gate_up_proj"],
                    "down": self.plan[f"{name}.down_proj"],
                }
                new = RolloutExperts(module, specs, self.compute_dtype, self.tile, self.backend)
            elif isinstance(module, nn.Linear):
                new = RolloutLinear(self.plan[f"{name}.weight"], self.compute_dtype, self.backend)
            else:
                continue
            parent, _, child = name.rpartition(".")
            setattr(net.get_submodule(parent) if parent else net, child, new)
        return net.eval()

    def _target(self, name: str) -> tuple[nn.Module, str]:
        owner, _, attr = name.rpartition(".")
        return self.net.get_submodule(owner), attr

    def _stage(self, record: WeightRecord):
        spec = self.plan.get(record.name)
        if spec is None:
            raise ValueError(f"{record.name!r} is not in the engine's plan: unknown tensor")
        value = record.value
        quantized = spec.format is not Format.BF16
        if isinstance(value, QTensor) != quantized or (
            quantized and (value.fmt != spec.format or tuple(value.shape) != spec.shape)
        ):
            got = (
                f"QTensor {value.fmt} {tuple(value.shape)}"
                if isinstance(value, QTensor)
                else (f"tensor {value.dtype} {tuple(value.shape)}")
            )
            raise ValueError(f"{record.name}: the plan says {spec.format} {spec.shape}, got {got}")
        if not quantized and (tuple(value.shape) != spec.shape or value.dtype != self.weight_dtype):
            raise ValueError(
                f"{record.name}: {value.dtype} {tuple(value.shape)}, the engine holds "
                f"{self.weight_dtype} {spec.shape} (export with bf16_dtype={self.weight_dtype})"
            )
        if content_hash(value) != record.hash:
            raise ValueError(
                f"{record.name}: content hash mismatch (corrupted in transit or on disk); "
                "the engine keeps its previous weights"
            )
        value = value.to(self.device)
        module, attr = self._target(record.name)
        if isinstance(module, RolloutLinear) and attr == "weight":
            return value, ("linear", module.materialize(value))
        if isinstance(module, RolloutExperts):
            which = "gate_up" if attr == "gate_up_proj" else "down"
            return value, ("experts", (which, module.materialize(which, value)))
        return value, ("tensor", value.to(self.compute_dtype))

    def load_weights(
        self, records: Iterable[WeightRecord], plan_hash: str, *, partial: bool = False
    ) -> int:
        """Verify, then swap in, a set of exported weights; returns the new weights_version.

        Checks the plan hash, then every record (known name, format and shape per the plan,
        content hash); unless `partial`, every tensor of the plan must be present. Any failure
        raises ValueError before anything is swapped: the previous weights stay whole.
        """
        if plan_hash != self.plan.hash():
            raise ValueError(
                f"plan hash mismatch: the weights were exported under plan {plan_hash[:16]}, the "
                f"engine runs plan {self.plan.hash()[:16]} ({self.plan.recipe_name}); trainer and "
                "engine must resolve the same recipe for the same model. Nothing was loaded."
            )
        staged = {}
        for record in records:
            if record.name in staged:
                raise ValueError(f"{record.name} was sent twice in one update")
            staged[record.name] = self._stage(record)
        if not partial:
            missing = [n for n in self.plan if n not in staged]
            if missing:
                raise ValueError(
                    f"incomplete update: {len(missing)} tensor(s) missing, e.g. {missing[:3]}; "
                    "the engine keeps its previous weights"
                )
        for name, (value, (kind, payload)) in staged.items():  # commit: nothing can fail here
            module, attr = self._target(name)
            if kind == "linear":
                for key, v in payload.items():
                    setattr(module, key, v)
            elif kind == "experts":
                module.values[payload[0]] = payload[1]
            elif isinstance(module, RolloutLinear):
                setattr(module, attr, payload)
            else:
                setattr(module, attr, nn.Parameter(payload, requires_grad=False))
            self.weights[name] = value
        self.weights_version += 1
        logger.info("engine: loaded %d tensors (version %d)", len(staged), self.weights_version)
        return self.weights_version

    def records(self) -> Iterable[WeightRecord]:
        """The weights the engine holds, as records (for checks and checkpoints)."""
        for name, value in self.weights.items():
            yield WeightRecord(name, value, content_hash(value))

    # --- generation ----------------------------------------------------------------------------
    @torch.no_grad()
    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[Completion]:
        """One Completion per prompt (token-id lists). See SamplingParams for seeds."""
        per_req = _per_request(params, len(prompts))
        vocab = self.config.vocab_size
        for i, p in enumerate(prompts):
            if not p or any(not 0 <= int(t) < vocab for t in p):
                raise ValueError(f"prompt {i} is empty or holds ids outside [0, {vocab})")
        gens = [_generator(p.seed) for p in per_req]
        outs = [Completion(prompt=[int(t) for t in p]) for p in prompts]
        caches = [
            RequestCache.allocate(
                self.net, len(p) + sp.max_new_tokens, self.device, self.compute_dtype
            )
            for p, sp in zip(prompts, per_req, strict=True)
        ]
        routing: list[list[torch.Tensor]] = [[] for _ in prompts]
        logprobs: list[list[float]] = [[] for _ in prompts]
        active = list(range(len(prompts)))
        feed = [torch.tensor(o.prompt, device=self.device) for o in outs]
        while active:
            logits, routed = forward_step(
                self.net, [feed[i] for i in active], [caches[i] for i in active], self.tile
            )
            tokens, lps = sample(logits, [per_req[i] for i in active], [gens[i] for i in active])
            still = []
            for j, i in enumerate(active):
                routing[i].append(routed[j])
                outs[i].tokens.append(tokens[j])
                logprobs[i].append(lps[j])
                if tokens[j] in per_req[i].stop_token_ids:
                    outs[i].finish_reason = "stop"
                elif len(outs[i].tokens) < per_req[i].max_new_tokens:
                    still.append(i)
                    feed[i] = torch.tensor([tokens[j]], device=self.device)
            active = still
        for i, o in enumerate(outs):
            o.logprobs = torch.tensor(logprobs[i], dtype=torch.float32)
            if self.config.moe_layers:
                o.routed_experts = torch.cat(routing[i], dim=1)
        return outs


def _per_request(params, n: int) -> list[SamplingParams]:
    if isinstance(params, SamplingParams):
        if params.seed is None:
            return [params] * n
        from dataclasses import replace

        return [replace(params, seed=params.seed + i) for i in range(n)]
    params = list(params)
    if len(params) != n:
        raise ValueError(f"{len(params)} SamplingParams for {n} prompts")
    return params


def _generator(seed: int | None) -> torch.Generator:
    g = torch.Generator()
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g


def _device_of(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")
