"""The engine's options, spelled once and checked when built: `EngineConfig` (device, dtypes,
the invariant GEMM tile, kernels, KV cache, CUDA graphs, overlapped decoding) and
`CacheOptions` (the KV cache and the scheduler's limits).

    Engine(model, "mxfp8", EngineConfig(tile=16))  # as Engine(model, "mxfp8", tile=16)
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from mxrl.kernels import Backend, Kernels

DEFAULT_CPU_KV_BYTES = 1 << 30  # the KV cache on the CPU when kv_cache_bytes is unset
# tokens per fixed-shape GEMM tile; on CUDA one launch for a decode step of up to 128
# sequences, where a 128-row tile costs a decode GEMM no more than one row (both read the
# weights once)
DEFAULT_TILE_CPU, DEFAULT_TILE_CUDA = 32, 128
DENSE_GEMMS = ("tiles", "grouped")  # EngineConfig.dense_gemm


@dataclass(frozen=True)
class CacheOptions:
    """The KV cache and the scheduler's limits.

    block_size: tokens per KV block. kv_cache_bytes: the cache's size; None: on CUDA
    `gpu_memory_fraction` of the memory free once the weights are loaded, on the CPU 1 GiB.
    max_num_seqs: sequences per step; max_num_batched_tokens: tokens per step (longer prompts
    are prefilled in chunks).
    """

    block_size: int = 16
    kv_cache_bytes: int | None = None
    gpu_memory_fraction: float = 0.5
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise ValueError(f"kv_cache_bytes must be positive, got {self.kv_cache_bytes}")
        if not 0.0 < self.gpu_memory_fraction <= 1.0:
            raise ValueError(
                f"gpu_memory_fraction must be in (0, 1], got {self.gpu_memory_fraction}"
            )


@dataclass(frozen=True)
class EngineConfig:
    """The engine's options (docs/engine.md).

    device: where the engine runs; None: the model's device (`Engine.from_records`: the CPU).
    compute_dtype: activations and the KV cache. weight_dtype: what the plan's bf16 tensors are
      held in.
    tile: tokens per fixed-shape GEMM tile (batch invariance, nn/paths/rollout.py); None: 32 on
      the CPU, 128 on CUDA. Unset with batch_invariant=False, where every GEMM runs over the
      step's rows at once.
    backend: the run's `Kernels` record (resolved for this kind of device), or a backend
      ("reference" | "triton") resolved once for `device` (`Kernels.resolve`; None: triton on
      CUDA when available); the record says which quantizer, decode GEMMs, attention, row-wise
      kernels and sampler run.
    cache: the KV cache and scheduler limits (`CacheOptions`; None: the defaults).
    cuda_graphs: decode through CUDA graphs where the engine can (engine.py says where).
    overlap: overlapped decoding: while a decode step runs, the next one is queued, fed the
      tokens the running step samples on the device, whenever it is known before those tokens
      are read (`Scheduler.schedule_ahead`); its rows whose request stopped are dropped. The
      same bytes as one step at a time (docs/engine.md). None: on CUDA, where the device runs
      ahead of the host (on the CPU a step is done when its kernels return: nothing to overlap).
    attention_split: keys per split of the Triton paged attention; 0 (the default): one pass
      over each request's keys. A positive multiple of the cache's block size splits them at
      fixed positions, a program per split, merged in order: more programs at long contexts
      and few requests (docs/engine.md, "Attention"), batch-invariant, but not the one-pass
      bytes (another summation order), so a run that needs them keeps 0.
    dense_gemm: "tiles" (the default): every bf16 projection (attention, router, dense MLP,
      lm_head) on fixed tiles of `tile` rows, one cuBLAS launch per tile; "grouped": on a GPU
      of sm90+ in bf16 compute, all of a step's rows in one launch (`torch._grouped_mm` with
      one group, the bf16 experts' kernel): batch-invariant, one launch per projection in
      prefill instead of one per tile; the tiles' bytes only where the libraries' kernels agree
      (they did on an H100, docs/benchmarks.md), so a run that needs them keeps "tiles".
      A block-FP8 projection's prefill likewise takes one cuBLAS blockwise call for all its
      tiles; NVFP4 / MXFP8 projections are not affected (already one launch, by construction).

    A config whose device is known is resolved for it: `backend` holds the `Kernels` record,
    `tile` and `overlap` their values on that device. Build another config for another device:
    `dataclasses.replace(config, device=...)` keeps the resolved values (and refuses the record).
    """

    device: torch.device | str | None = None
    compute_dtype: torch.dtype = torch.float32
    weight_dtype: torch.dtype = torch.bfloat16
    tile: int | None = None
    backend: Kernels | Backend | str | None = None
    cache: CacheOptions = CacheOptions()
    batch_invariant: bool = True
    cuda_graphs: bool = True
    overlap: bool | None = None
    attention_split: int = 0
    dense_gemm: str = "tiles"

    def __post_init__(self) -> None:
        def put(name: str, value: object) -> None:
            object.__setattr__(self, name, value)

        for name in ("compute_dtype", "weight_dtype"):
            if not isinstance(getattr(self, name), torch.dtype):
                raise ValueError(
                    f"{name} must be a torch.dtype (torch.float32, torch.bfloat16), "
                    f"got {getattr(self, name)!r}"
                )
        if self.cache is None:
            put("cache", CacheOptions())
        elif not isinstance(self.cache, CacheOptions):
            raise ValueError(f"cache must be a CacheOptions, got {type(self.cache).__name__}")
        if not self.batch_invariant and self.tile is not None:
            raise ValueError(
                "tile sets the invariant GEMM shape; leave it unset with batch_invariant=False"
            )
        if self.tile is not None and self.tile < 1:
            raise ValueError(f"tile must be >= 1, got {self.tile}")
        split, bs = self.attention_split, self.cache.block_size
        if type(split) is not int or split < 0 or split % bs:
            raise ValueError(
                f"attention_split must be 0 (one pass) or a positive multiple of the KV block "
                f"size {bs} (e.g. {32 * bs}), got {split!r}"
            )
        if self.dense_gemm not in DENSE_GEMMS:
            raise ValueError(f"dense_gemm must be one of {DENSE_GEMMS}, got {self.dense_gemm!r}")
        if self.device is None:
            return  # resolved when the engine knows its device
        device = torch.device(self.device)
        put("device", device)
        put("backend", _kernels_for(self.backend, device))  # chosen once for the device
        if self.batch_invariant and self.tile is None:
            put("tile", DEFAULT_TILE_CUDA if device.type == "cuda" else DEFAULT_TILE_CPU)
        put("overlap", device.type == "cuda" if self.overlap is None else bool(self.overlap))

    @classmethod
    def build(
        cls, options: EngineConfig | None, overrides: dict, device: torch.device | str
    ) -> EngineConfig:
        """`options` (None: the defaults) with `overrides` (field names) set, resolved for its
        device, or for `device` where it names none."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise TypeError(
                f"unknown engine option(s) {unknown}: the options are EngineConfig's fields "
                f"{sorted(known)}"
            )
        if options is not None and not isinstance(options, EngineConfig):
            raise TypeError(f"options must be an EngineConfig, got {type(options).__name__}")
        given = {f.name: getattr(options, f.name) for f in fields(cls)} if options else {}
        merged = {**given, **overrides}
        if merged.get("device") is None:
            merged["device"] = device
        return cls(**merged)

    @property
    def gemm_tile(self) -> int:
        """Rows per GEMM tile as the engine's modules take it: 0 without batch invariance (every
        GEMM over the step's rows at once)."""
        assert self.device is not None, "a config is resolved once its device is known"
        return self.tile if self.batch_invariant else 0


def _kernels_for(backend: Kernels | Backend | str | None, device: torch.device) -> Kernels:
    """The run's record as given (it must be for this kind of device), or one resolved here."""
    if not isinstance(backend, Kernels):
        return Kernels.resolve(backend, device)
    if backend.device.type != device.type:
        raise ValueError(
            f"backend: a Kernels record resolved for {backend.device}, but the engine runs on "
            f"{device}: resolve it for the engine's device (Kernels.resolve(backend, device))"
        )
    return backend
