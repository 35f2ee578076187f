"""The rollout engine: the trainer's model code, weights held as the plan says, continuous
batching over a paged KV cache with prefix sharing, and verified weight loading shared by
construction and live sync.

    engine = Engine(model, "nvfp4-dequantized")
    outs = engine.generate([[1, 2, 3], [4, 5]], SamplingParams(temperature=1.0, seed=0))
    engine.load_weights(export_weights(model.named_parameters(), engine.plan), engine.plan.hash())

Roles: config.py (the engine's options), engine.py (setup, the generate loop), loading.py
(verified loads in place), scheduler.py + block_manager.py (which tokens run, where their KV
lives), runner.py + kv_cache.py (one step through the model's own modules; the cache's size),
graph.py (CUDA-graph decode, `capture_graphs`), modules.py (the fused row-wise swaps: RMSNorm,
RoPE, routers), sampler.py (the batch's tokens and logprobs). The weight holders swapped into the
model (`RolloutLinear`, `RolloutExperts`) are the rollout GEMM path's, mxrl/nn/paths/rollout.py.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from torch import nn

from mxrl.arch import ModelConfig
from mxrl.engine.block_manager import BlockManager
from mxrl.engine.collector import collector_paused
from mxrl.engine.config import EngineConfig
from mxrl.engine.graph import DecodeGraphs, GraphCapture
from mxrl.engine.kv_cache import KVCache, cache_dims
from mxrl.engine.loading import TIED_EMBEDDING, WeightLoading
from mxrl.engine.modules import RolloutRMSNorm, RolloutRope, RolloutSigmoidRouter, RolloutTopK
from mxrl.engine.params import Completion, GenerateStats, SamplingParams, per_request, resolve_seed
from mxrl.engine.runner import Launched, ModelRunner
from mxrl.engine.sampler import SamplingBatch, sample_batch
from mxrl.engine.scheduler import Scheduled, Scheduler
from mxrl.engine.sequence import Sequence as Request
from mxrl.engine.sequence import Status, split_routing
from mxrl.formats import QTensor
from mxrl.kernels import Backend
from mxrl.kernels.rowwise import MAX_ROUTE_EXPERTS
from mxrl.models import CausalLM
from mxrl.models.layers import ApplyRope, RMSNorm, TopKSoftmax
from mxrl.models.mla import SigmoidRouter
from mxrl.nn.experts import EXPERT_PARAMS, GroupedExperts
from mxrl.nn.paths.rollout import RolloutExperts, RolloutLinear
from mxrl.nn.swap import Replacement, SwapRule, swap_modules
from mxrl.recipe import Plan, Recipe, resolve
from mxrl.recipe.schema import KVCacheFormat
from mxrl.weights import WeightRecord, export_weights, read_quantized_checkpoint


class Engine(WeightLoading, GraphCapture):
    """Rollout engine for an mxrl model (see module docstring).

    model: the trainer's CausalLM (master weights); only its config and its weights (exported
      once, through `export_weights`) are used. recipe: preset name, YAML path, Recipe or a
      resolved Plan. options: the engine's options (`EngineConfig`: device, dtypes, tile,
      backend, cache, batch_invariant, cuda_graphs, overlap); overrides: its fields by name
      (`Engine(model, "mxfp8", tile=16)`), set over `options`.
    """

    def __init__(
        self,
        model: CausalLM,
        recipe: Recipe | Plan | str | Path,
        options: EngineConfig | None = None,
        **overrides,
    ) -> None:
        options = EngineConfig.build(options, overrides, _device_of(model))
        shapes = {n: p.shape for n, p in model.named_parameters()}
        plan = recipe if isinstance(recipe, Plan) else resolve(recipe, shapes)
        self._setup(model.config, plan, options)
        records = export_weights(model.named_parameters(), self.plan, bf16_dtype=self.weight_dtype)
        self.load_weights(records, self.plan.hash())

    @classmethod
    def from_records(
        cls,
        config: ModelConfig,
        plan: Plan,
        records: Iterable[WeightRecord],
        options: EngineConfig | None = None,
        **overrides,
    ) -> Engine:
        """An engine that never saw master weights: a config, a plan and exported records
        (a converted checkpoint, a first sync), verified by `load_weights`. The device is the
        CPU unless the options name one."""
        engine = cls.__new__(cls)
        engine._setup(config, plan, EngineConfig.build(options, overrides, "cpu"))
        engine.load_weights(records, plan.hash())
        return engine

    @classmethod
    def from_checkpoint(
        cls, path: str | Path, options: EngineConfig | None = None, **overrides
    ) -> Engine:
        """Load a quantized checkpoint written by `mxrl convert` (plan, manifest hashes, shard
        sha256s all checked); options as `from_records`."""
        plan, config, records = read_quantized_checkpoint(path)
        return cls.from_records(ModelConfig.from_hf(config), plan, records, options, **overrides)

    def _setup(self, config: ModelConfig, plan: Plan, options: EngineConfig) -> None:
        """`options` resolved for its device (`EngineConfig.build`)."""
        self.config, self.plan, self.options = config, plan, options
        self.device, self.overlap = options.device, options.overlap
        self.kernels = options.backend  # the Kernels record, chosen once for the device
        self.backend = self.kernels.quantizer  # every quantizer writes the same bytes
        self.batch_invariant, self.tile = options.batch_invariant, options.gemm_tile
        self.compute_dtype, self.weight_dtype = options.compute_dtype, options.weight_dtype
        self.cache_options = options.cache
        self.net = self._build()
        if options.dense_gemm == "grouped" and self.batch_invariant:
            for module in self.net.modules():
                if isinstance(module, RolloutLinear):
                    module.path.one_group = True
        self.weights: dict[str, QTensor | torch.Tensor] = {}
        self.hashes: dict[str, str] = {}  # content hash of each tensor, verified when it loaded
        self.weights_version = 0
        self.weights_step: int | None = None  # the step of the last update loaded (loading.py)
        # the Triton paged attention on the triton backend, where the cache's shape allows it
        # (any head dims >= 16, MLA's keys and narrower values included: padded in the kernel)
        self._attention_kernel = (
            self.kernels.attention is Backend.TRITON
            and _pow2_at_least_16(self.cache_options.block_size)
            and min(cache_dims(config)[1:]) >= 16
        )
        # the one-launch sampler for rows without top-k / top-p (mxrl.kernels.sampling)
        self.fused_sampler = self.kernels.sampler is Backend.TRITON
        self._kv: KVCache | None = None  # allocated at the first generate (weights loaded)
        self._blocks: BlockManager | None = None
        # decode graphs: CUDA, the Triton attention (reads its metadata from the device)
        # and no op that reads a value back to the host: the routed experts must run grouped
        # (the per-expert loop sizes its tiles from the routing: `RolloutPath.graph_safe`)
        self.cuda_graphs = (
            options.cuda_graphs
            and self.device.type == "cuda"
            and self._attention_kernel
            and all(m.path.graph_safe(m) for m in self._experts())
        )
        self._graphs: DecodeGraphs | None = None

    # --- weights -------------------------------------------------------------------------------
    def _build(self) -> CausalLM:
        with torch.device("meta"):
            net = CausalLM(self.config, dtype=self.compute_dtype)
        swap_modules(net, self._swap_rules())
        if net.lm_head is None:  # tied: the logits GEMM reads the embedding, on tiles too
            spec = self.plan[TIED_EMBEDDING]
            net.lm_head = RolloutLinear(
                spec, self.compute_dtype, self.kernels.rollout_gemm, self.tile
            )
        return net.eval()

    def _swap_rules(self) -> list[SwapRule]:
        """The engine's modules for the model's: weights held as the plan says (experts, router,
        linears); on the triton row-wise backend the fused RMSNorm, RoPE and top-k too."""
        dtype, gemm, tile = self.compute_dtype, self.kernels.rollout_gemm, self.tile

        def experts(name: str, module: GroupedExperts) -> Replacement:
            specs = {role: self.plan[f"{name}.{param}"] for role, param in EXPERT_PARAMS.items()}
            return RolloutExperts(module, specs, dtype, tile, gemm), tuple(specs.values())

        def rms_norm(name: str, module: RMSNorm) -> Replacement:
            with torch.device("meta"):
                return RolloutRMSNorm(module.weight.shape[0], module.eps, dtype=dtype), ()

        def top_k(name: str, module: TopKSoftmax) -> Replacement | None:
            if module.num_experts > MAX_ROUTE_EXPERTS:  # larger routers: the reference
                return None
            return RolloutTopK(module.num_experts, module.top_k, module.norm_topk_prob), ()

        def router(name: str, module: SigmoidRouter) -> Replacement:
            spec = self.plan[f"{name}.weight"]
            return RolloutSigmoidRouter(module, spec, gemm, tile), (spec,)

        def linear(name: str, module: nn.Linear) -> Replacement:
            spec = self.plan[f"{name}.weight"]
            return RolloutLinear(spec, dtype, gemm, tile), (spec,)

        rowwise = []
        if self.kernels.rowwise is Backend.TRITON:
            rowwise = [
                SwapRule(RMSNorm, rms_norm),
                SwapRule(ApplyRope, lambda name, module: (RolloutRope(), ())),
                SwapRule(TopKSoftmax, top_k),
            ]
        return [
            SwapRule(GroupedExperts, experts),
            *rowwise,
            SwapRule(SigmoidRouter, router),
            SwapRule(nn.Linear, linear),
        ]

    # --- generation ----------------------------------------------------------------------------
    def _cache(self) -> tuple[KVCache, BlockManager]:
        """The KV cache (allocated once, sized by `CacheOptions`) and a block manager."""
        scratch = 1 if self.cuda_graphs else 0  # the last block: graph padding rows'
        if self._kv is None:
            self._kv = KVCache.allocate(
                self.config, self.cache_options, self.device, self.compute_dtype, scratch,
                fp8=self.plan.kv_cache is KVCacheFormat.FP8, backend=self.kernels,
            )  # fmt: skip
            self._kv.split_keys = self.options.attention_split
        if self._blocks is None:
            num_blocks = self._kv.k[0].shape[0] - scratch
            self._blocks = BlockManager(num_blocks, self.cache_options.block_size)
        return self._kv, self._blocks

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix: the next `generate` computes each prompt from its first
        token (a benchmark timing prefill on prompts it ran before; loading weights does the
        same, since cached keys and values belong to the old weights). Between `generate`
        calls: the blocks stay allocated, only their registrations go."""
        if self._blocks is not None:
            self._blocks.forget_prefixes()

    def _experts(self) -> list[RolloutExperts]:
        return [m for m in self.net.modules() if isinstance(m, RolloutExperts)]

    def _start(self, seqs: list[Request]) -> tuple[Scheduler, ModelRunner]:
        """A scheduler holding `seqs` (every one checked against the cache before any work)
        and a runner over the engine's KV cache."""
        kv, blocks = self._cache()
        opt = self.cache_options
        scheduler = Scheduler(blocks, opt.max_num_seqs, opt.max_num_batched_tokens)
        for seq in seqs:
            scheduler.add(seq)
        graphs = self._decode_graphs(kv, max((seq.max_len for seq in seqs), default=0))
        self.runner = ModelRunner(self.net, kv, self.device, self._attention_kernel, graphs)
        return scheduler, self.runner

    @torch.no_grad()
    @collector_paused()
    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[Completion]:
        """One Completion per prompt (token-id lists). See SamplingParams for seeds.

        Requests are batched continuously: all are queued, each step runs what fits (docs
        engine.md), finished ones free their KV blocks for the waiting ones. Requests with the
        same prompt share its KV blocks. Outputs do not depend on any of this. The garbage
        collector is off meanwhile (`mxrl.engine.collector`)."""
        per_req = per_request(params, len(prompts))
        vocab = self.config.vocab_size
        for i, (p, sp) in enumerate(zip(prompts, per_req, strict=True)):
            if not p or any(not 0 <= int(t) < vocab for t in p):
                raise ValueError(f"prompt {i} is empty or holds ids outside [0, {vocab})")
            # before anything runs: past max_position_embeddings the model generates silently
            self.config.check_positions(len(p), sp.max_new_tokens, f"request {i}", "max_new_tokens")
        seqs = [
            Request(i, [int(t) for t in p], sp, resolve_seed(sp.seed))
            for i, (p, sp) in enumerate(zip(prompts, per_req, strict=True))
        ]
        scheduler, runner = self._start(seqs)
        blocks = scheduler.blocks
        stats = self.stats = GenerateStats()
        try:
            pending: Launched | None = None  # the step on the device whose tokens are not read
            last_read = time.perf_counter()
            while pending is not None or not scheduler.finished:
                if pending is None:
                    started = time.perf_counter()
                    batch = scheduler.schedule()
                    if not batch:
                        raise RuntimeError(
                            "the scheduler found nothing to run (KV cache exhausted)"
                        )
                    stats.observe(batch, blocks)
                    pending = self._launch(runner, batch, started)
                ahead = scheduler.schedule_ahead(pending.batch) if self.overlap else None
                launched = None
                if ahead is not None:  # the next decode step, queued before this one is read
                    stats.observe(ahead, blocks)
                    fed = pending.live_tokens(ahead)
                    launched = self._launch(runner, ahead, time.perf_counter(), fed)
                tokens, lps = pending.read()  # one sync a step
                now = time.perf_counter()
                if all(s.num_tokens == 1 for s in pending.batch):  # the step is done
                    stats.decode(pending.batch, now - max(pending.started, last_read))
                last_read = now
                self._advance(pending, tokens, lps, scheduler, blocks)
                pending = launched
        except BaseException:  # an error, an interrupt: the blocks go back to the cache
            for seq in list(scheduler.running):
                blocks.release(seq)
            raise
        stats.graph_steps = runner.num_graph_steps
        return [self._completion(seq) for seq in seqs]

    def _launch(
        self,
        runner: ModelRunner,
        batch: list[Scheduled],
        started: float,
        ahead_tokens: torch.Tensor | None = None,
    ) -> Launched:
        """Queue one step on the device: the forward, the sampler, the copies of the tokens,
        logprobs and routing to the host (read by `Launched.read`)."""
        logits, routing = runner.step(batch, ahead_tokens)
        rows = [s for s in batch if s.sample]
        chosen = SamplingBatch.build(
            [s.seq.params for s in rows],
            [s.seq.seed for s in rows],
            # an ahead row's counter counts the token of the step before it, not yet appended
            [s.seq.num_generated + int(s.ahead) for s in rows],
            self.device,
        )
        tokens_t, lps_t = sample_batch(logits, chosen, fused=self.fused_sampler)
        if ahead_tokens is not None:
            self.stats.ahead_steps += 1
        return Launched(batch, rows, tokens_t, lps_t, routing, started)

    def _advance(
        self,
        step: Launched,
        tokens: list[int],
        lps: list[float],
        scheduler: Scheduler,
        blocks: BlockManager,
    ) -> None:
        """The host side of a step whose tokens were read: routing, computed tokens, shared
        blocks, sampled tokens, finished requests. A row whose request finished in the step
        before (an ahead step's row: its token came after a stop) is dropped whole."""
        live = [s.seq.status is not Status.FINISHED for s in step.batch]
        self.stats.ahead_rows_dropped += live.count(False)
        per_seq = split_routing(step.routing_host(), [s.num_tokens for s in step.batch])
        for s, routed, ok in zip(step.batch, per_seq, live, strict=True):
            if not ok:
                continue
            s.seq.record_routing(s.start, routed, blocks)
            s.seq.num_computed += s.num_tokens
            blocks.register(s.seq, s.seq.routing_from)
        for s, token, lp in zip(step.rows, tokens, lps, strict=True):
            seq = s.seq
            if seq.status is Status.FINISHED:
                continue
            seq.tokens.append(token)
            seq.logprobs.append(lp)
            if token in seq.params.stop_token_ids:
                scheduler.finish(seq, "stop")
            elif seq.num_generated >= seq.params.max_new_tokens:
                scheduler.finish(seq, "length")

    @torch.no_grad()
    def next_token_logits(self, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        """fp32 logits [R, V] of the token after each prompt: the prefill `generate` runs,
        without sampling (for checks: the engine's forward against the trainer's)."""
        seqs = [
            Request(i, [int(t) for t in p], SamplingParams(max_new_tokens=1), 0)
            for i, p in enumerate(prompts)
        ]
        scheduler, runner = self._start(seqs)
        out: dict[int, torch.Tensor] = {}
        while not scheduler.finished:
            batch = scheduler.schedule()
            logits, _ = runner.step(batch)
            done = [s.seq for s in batch if s.sample]
            for s in batch:
                s.seq.num_computed += s.num_tokens
            for seq, row in zip(done, logits, strict=True):
                out[seq.index] = row.clone()  # a graph step's logits are overwritten by the next
                scheduler.finish(seq, "length")
        return torch.stack([out[i] for i in range(len(seqs))])

    def _completion(self, seq: Request) -> Completion:
        out = Completion(prompt=seq.prompt, tokens=seq.tokens[len(seq.prompt) :])
        out.logprobs = torch.tensor(seq.logprobs, dtype=torch.float32)
        out.finish_reason = seq.finish_reason
        if self.config.moe_layers:
            out.routed_experts = torch.cat(seq.routing).permute(1, 0, 2).contiguous()
        return out


def _pow2_at_least_16(n: int) -> bool:
    return n >= 16 and n & (n - 1) == 0


def _device_of(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")
