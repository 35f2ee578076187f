"""The GRPO loop of `mxrl.rl.trainer`, on several processes (docs/scale.md): `torchrun ... mxrl train`
with a `placement` section.

One step, every rank in lockstep:

1. rollout: each rollout rank generates its share of the step's prompt groups on its own
   engine (`mxrl.parallel.rollout.share`); the completions, with their logprobs and routing
   records, are gathered to every rank in request order;
2. train: each train rank computes the trainer logprobs and the loss of its share of the groups
   on its FSDP2 shard of the model; the loss uses the whole batch's token count and is scaled
   by the number of train ranks, so FSDP2's averaged gradient is the single-process batch's
   gradient (DAPO token-mean); clipping, spike detection and the optimizer step see the global
   gradient norm;
3. sync: the train ranks export the sharded master weights (`mxrl.parallel.sharded_export`, bytes
   identical to a single-process export); colocated, every rank loads its own engine in
   process; split, train rank 0 broadcasts the buckets to the rollout ranks
   (`mxrl.sync.DistributedSender`), which verify and load them.

Rank 0 (a train rank) writes the run record: the same metrics as the single-process loop, the
step's times as the maximum over ranks (the step waits for the slowest) plus each rank's own
(`time/rank{r}/...`), the sync events with the engine digest every serving rank agreed on.
Checkpoints go through torch.distributed.checkpoint (`mxrl.parallel.checkpoint`).
"""

from __future__ import annotations

import logging
import math
import random
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.utils.rnn import pad_sequence

from mxrl.engine import Engine, SamplingParams
from mxrl.models import CausalLM
from mxrl.nn import apply_plan
from mxrl.parallel import Layout, parallelize, sharded_export
from mxrl.parallel import checkpoint as dcp_checkpoint
from mxrl.parallel.parallelize import attach_cache_reset, clear_quantized_caches, full, local
from mxrl.parallel.rollout import gather_in_order, gather_objects, share
from mxrl.recipe import Plan, resolve
from mxrl.rl.config import GRPOConfig
from mxrl.rl.grpo import group_advantages, policy_loss
from mxrl.rl.logprobs import sequence_logprobs
from mxrl.rl.metrics import Progress, engine_digest, step_metrics
from mxrl.rl.mismatch import mismatch_metrics
from mxrl.rl.optim import adamw
from mxrl.rl.resume import CHECKPOINT_DIR, apply_optimizer_settings
from mxrl.rl.sources import PromptSource
from mxrl.rl.stability import GradSpikeDetector, _group_of, top_growth
from mxrl.rl.trainer import _seed
from mxrl.runs import FINISHED, RunRecord
from mxrl.sync import DistributedReceiver, DistributedSender, InProcessTransport

logger = logging.getLogger(__name__)


class DistributedGRPOTrainer:
    """GRPOTrainer's step on a `Layout`: `record` is rank 0's RunRecord (None elsewhere)."""

    def __init__(
        self,
        cfg: GRPOConfig,
        model: CausalLM,
        source: PromptSource,
        record: RunRecord | None,
        layout: Layout,
    ) -> None:
        self.cfg, self.source, self.record, self.layout = cfg, source, record, layout
        if cfg.prompts_per_step < max(len(layout.train_ranks), len(layout.rollout_ranks)):
            raise ValueError(
                f"rl.prompts_per_step {cfg.prompts_per_step} is smaller than the number of train "
                f"({len(layout.train_ranks)}) or rollout ({len(layout.rollout_ranks)}) ranks: "
                "every rank needs at least one prompt group"
            )
        self.plan: Plan = resolve(cfg.recipe, {n: p.shape for n, p in model.named_parameters()})
        device = str(layout.device)
        self.engine: Engine | None = None
        if layout.serves:  # built from the whole master, before the model is sharded
            self.engine = Engine(
                model, self.plan, device=device, backend=cfg.backend, tile=cfg.engine_tile,
                compute_dtype=cfg.torch_compute_dtype(),
            )  # fmt: skip
        self.model: CausalLM | None = None
        self.opt: torch.optim.Optimizer | None = None
        if layout.trains:
            apply_plan(model, self.plan, backend=cfg.backend)
            self.model = parallelize(model, self.plan, layout.train_mesh)
            self.opt = adamw(
                model.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay
            )
            attach_cache_reset(model, self.opt)
            self.opt.zero_grad(set_to_none=True)  # as GRPOTrainer: the trainer owns the grads
        self.sender = self.receiver = self.transport = None
        if layout.colocated:
            assert self.engine is not None
            self.transport = InProcessTransport(self.engine)
        elif layout.rank == layout.train_ranks[0]:
            self.sender = DistributedSender(layout.sync_group, src=layout.train_ranks[0])
        elif layout.serves:
            assert self.engine is not None
            self.receiver = DistributedReceiver(
                self.engine, layout.sync_group, src=layout.train_ranks[0]
            )
        self.spikes = GradSpikeDetector(
            window=cfg.spike_window, z_threshold=cfg.spike_z, action=cfg.spike_action
        )
        self.prev_layer_norms: dict[str, float] = {}
        self.step = 0
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)

    # --- one step -------------------------------------------------------------------------
    def train_step(self) -> dict[str, float] | None:
        """One step on every rank; the metrics on rank 0 (None elsewhere)."""
        cfg, layout, step = self.cfg, self.layout, self.step + 1
        n = cfg.samples_per_prompt
        t0 = time.perf_counter()
        batch = self.source.next_batch(cfg.prompts_per_step)  # every rank: one data stream
        prompts = [p for p in batch.prompts for _ in range(n)]
        labels = [lab for lab in batch.labels for _ in range(n)]
        mine: list = []
        if layout.serves:
            groups = share(len(batch.prompts), len(layout.rollout_ranks),
                           layout.rollout_ranks.index(layout.rank))  # fmt: skip
            idx = [g * n + j for g in groups for j in range(n)]
            params = [
                SamplingParams(
                    temperature=cfg.temperature,
                    top_p=cfg.top_p,
                    top_k=cfg.top_k,
                    max_new_tokens=cfg.max_new_tokens,
                    stop_token_ids=self.source.stop_token_ids,
                    seed=_seed(cfg.seed, step, i),
                )
                for i in idx
            ]
            assert self.engine is not None
            mine = self.engine.generate([prompts[i] for i in idx], params)
        outs = gather_in_order(mine, layout.rollout_ranks)  # routing records ride along
        t_rollout = time.perf_counter() - t0

        t1 = time.perf_counter()
        rewards = torch.tensor(
            [self.source.reward(o.tokens, lab) for o, lab in zip(outs, labels, strict=True)],
            dtype=torch.float32,
        )
        mask = pad_sequence([torch.ones(len(o.tokens)) for o in outs], batch_first=True)
        train = None
        if layout.trains:
            train = self._train(prompts, outs, rewards, mask)
        t_train = time.perf_counter() - t1

        t2 = time.perf_counter()
        report = self._sync(step)
        deep = bool(cfg.verify_every) and step % cfg.verify_every == 0
        ok = self._verify_sync() if deep else True
        digests = gather_objects(
            engine_digest(self.engine.hashes.items()) if self.engine is not None else None
        )
        served = {d for d in digests if d is not None}
        t_sync = time.perf_counter() - t2
        times = gather_objects((t_rollout, t_train, t_sync))
        self.step = step
        if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
            self.save_checkpoint(engine_digest=min(served))
        if not layout.is_writer:
            return None
        assert train is not None and report is not None and self.record is not None
        if len(served) != 1:
            logger.error("step %d: engine ranks hold different weights: %s", step, served)
        if report.event is not None:
            self.record.log_quantization(report.event)
        self.record.log_sync_verified(
            step, report.version, self.plan.hash(), ok and len(served) == 1,
            engine_digest=min(served), deep=deep,
        )  # fmt: skip
        slowest = tuple(max(t[i] for t in times) for i in range(3))
        metrics = step_metrics(
            outs, rewards, mask, train["mismatch"], train["stats"], train["grad_norm"],
            train["decision"], slowest, time.perf_counter() - t0, report.version,
        )  # fmt: skip
        for r, (tr, tt, ts) in enumerate(times):
            metrics |= {f"time/rank{r}/rollout_s": tr, f"time/rank{r}/train_s": tt,
                        f"time/rank{r}/sync_s": ts}  # fmt: skip
        self.record.log_metrics(step, metrics)
        return metrics

    def _train(self, prompts, outs, rewards, mask) -> dict[str, Any]:
        """This train rank's share of the loss, backward, the global norm, the optimizer step."""
        cfg, layout = self.cfg, self.layout
        assert self.model is not None and self.opt is not None
        n, group = cfg.samples_per_prompt, layout.train_group
        num_train = len(layout.train_ranks)
        adv = group_advantages(rewards, n, std_normalize=cfg.std_normalize)
        groups = share(len(outs) // n, num_train, layout.train_ranks.index(layout.rank))
        idx = [g * n + j for g in groups for j in range(n)]
        self.model.train()
        logp = sequence_logprobs(
            self.model, [prompts[i] for i in idx], [outs[i].tokens for i in idx], cfg.temperature,
            top_k=cfg.top_k, top_p=cfg.top_p,
        )  # fmt: skip
        m = pad_sequence([torch.ones(len(outs[i].tokens)) for i in idx], batch_first=True)
        rollout = pad_sequence([outs[i].logprobs for i in idx], batch_first=True).to(logp.device)
        old = logp.detach()
        # the mismatch metrics over the whole batch, as on one process: every rank's old logp
        rows = [old[k, : len(outs[i].tokens)].cpu() for k, i in enumerate(idx)]
        all_rows = gather_in_order(rows, layout.train_ranks, group=group)
        full_old = pad_sequence(all_rows, batch_first=True)
        full_rollout = pad_sequence([o.logprobs for o in outs], batch_first=True)
        mm = mismatch_metrics(full_rollout, full_old, mask).as_dict()
        # one train rank: exactly the single-process loss; more: the batch's token count as
        # the denominator and FSDP2's average undone, so the gradient is the whole batch's
        denominator = None if num_train == 1 else float(mask.sum())
        loss, stats = policy_loss(
            logp, old, adv[idx].to(logp.device), m.to(logp.device),
            eps_low=cfg.eps_low, eps_high=cfg.eps_high, rollout_logp=rollout,
            correction=cfg.correction, tis_cap=cfg.tis_cap, denominator=denominator,
        )  # fmt: skip
        if num_train > 1:
            loss = loss * num_train
            stats = _token_weighted(stats, float(m.sum()), group, layout.device)
        loss.backward()
        grad_norm = float(
            full(torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip))
        )
        decision = self.spikes.update(grad_norm)
        layer_norms = _layer_grad_norms(self.model, group)
        if decision.spike and self.record is not None:
            growth = top_growth(layer_norms, self.prev_layer_norms)
            self.record.log_spike(self.step + 1, grad_norm, decision.z, growth,
                                  skipped=decision.skip)  # fmt: skip
        if not decision.skip:
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.prev_layer_norms = layer_norms
        return {"mismatch": mm, "stats": stats, "grad_norm": grad_norm,
                "decision": decision.as_dict()}  # fmt: skip

    def _export(self, step: int, *, sqnr: bool = True):
        assert self.model is not None and self.layout.train_group is not None
        return sharded_export(self.model, self.plan, self.layout.train_group, step=step, sqnr=sqnr)

    def _sync(self, step: int):
        """The weights of `step` into every engine; the SyncReport on rank 0 (and on every
        colocated rank), None elsewhere."""
        layout = self.layout
        if layout.colocated:
            assert self.transport is not None
            return self.transport.send(self._export(step))
        if self.sender is not None:
            return self.sender.send(self._export(step))
        if self.receiver is not None:
            self.receiver.receive()
            return None
        for _ in self._export(step):  # the other train ranks: their part of the collectives
            pass
        return None

    def _verify_sync(self) -> bool:
        """The deep check: a fresh export of the sharded masters, hashed, equals what every
        engine holds (collective over all ranks)."""
        fresh = None
        if self.layout.trains:
            fresh = {r.name: r.hash for r in self._export(self.step + 1, sqnr=False).records()}
        box = [fresh]
        dist.broadcast_object_list(box, src=self.layout.train_ranks[0])
        ok = True
        if self.engine is not None:
            ok = all(box[0].get(r.name) == r.hash for r in self.engine.records())
        return all(gather_objects(ok))

    def run(self) -> list[dict[str, float]]:
        history = []
        if self.record is None:
            while self.step < self.cfg.steps:
                self.train_step()
            return history
        progress = Progress(self.step, self.cfg.steps)
        with self.record.guard(lambda: self.step):
            while self.step < self.cfg.steps:
                m = self.train_step()
                assert m is not None
                history.append(m)
                progress.log(self.step, m)
            self.record.finish(self.step, status=FINISHED)
        return history

    # --- checkpoints ----------------------------------------------------------------------
    def save_checkpoint(self, *, engine_digest: str) -> Path | None:
        """A DCP checkpoint of the train ranks (rollout ranks hold nothing the run needs)."""
        layout = self.layout
        if not layout.trains:
            return None
        assert self.model is not None and self.opt is not None and layout.train_group is not None
        folder = Path(self._run_dir()) / CHECKPOINT_DIR
        state = {
            "step": self.step,
            "source": self.source.state_dict(),
            "spikes": self.spikes.state_dict(),
            "prev_layer_norms": self.prev_layer_norms,
            "engine_version": self._engine_version(),
            "engine_digest": engine_digest,
            "plan_hash": self.plan.hash(),
            "config": asdict(self.cfg),
            "placement": asdict(layout.placement),
        }
        return dcp_checkpoint.save(
            folder, self.step, self.model, self.opt, layout.train_group,
            trainer_state=state, rank_state=self._rng_state(),
        )  # fmt: skip

    def _engine_version(self) -> int:
        # every engine loads once at build and once a step (the loop's numbering)
        return self.step + 1

    def _run_dir(self) -> str:
        """The run directory, from rank 0 (the others have no RunRecord)."""
        box = [str(self.record.path) if self.record is not None else None]
        dist.broadcast_object_list(box, src=self.layout.train_ranks[0],
                                   group=self.layout.train_group)  # fmt: skip
        return box[0]

    def load_checkpoint(self, path: str | Path) -> int:
        """Continue from a DCP checkpoint (every rank): shards, data stream, detector, RNGs, and
        the weights re-sent to every engine, which end at the checkpoint's weights version."""
        path = Path(path)
        state = dcp_checkpoint.trainer_state(path)
        if state["plan_hash"] != self.plan.hash():
            raise ValueError(
                f"checkpoint {path} was trained under plan {state['plan_hash'][:12]}, this run "
                f"resolves {self.plan.hash()[:12]}: resume with the same recipe and model"
            )
        if self.layout.trains:
            assert self.model is not None and self.opt is not None
            rng = dcp_checkpoint.load(path, self.model, self.opt, self.layout.train_group)
            apply_optimizer_settings(self.opt, self.cfg)  # this config's lr, as GRPOTrainer
            clear_quantized_caches(self.model)
            self._set_rng_state(rng)
        self.source.load_state_dict(state["source"])
        self.spikes.load_state_dict(state["spikes"])
        self.prev_layer_norms = state["prev_layer_norms"]
        self.step = int(state["step"])
        self._sync(self.step)
        digest = None
        if self.engine is not None:
            self.engine.weights_version = int(state["engine_version"])
            digest = engine_digest(self.engine.hashes.items())
            if digest != state["engine_digest"]:
                logger.warning(
                    "checkpoint %s: the re-sent weights give engine digest %s, the run served %s",
                    path, digest[:12], state["engine_digest"][:12],
                )  # fmt: skip
        gather_objects(digest)  # every rank leaves the resume together
        return self.step

    def _rng_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
        if self.layout.device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state(self.layout.device)
        return state

    def _set_rng_state(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["torch"].cpu())
        random.setstate(state["python"])
        if "cuda" in state and self.layout.device.type == "cuda":
            torch.cuda.set_rng_state(state["cuda"].cpu(), self.layout.device)


def _token_weighted(
    stats: dict[str, float], tokens: float, group, device: torch.device
) -> dict[str, float]:
    """Each train rank's stats, averaged over the group weighted by its tokens (the batch's)."""
    keys = sorted(k for k, v in stats.items() if isinstance(v, float))
    t = torch.tensor([stats[k] * tokens for k in keys] + [tokens], dtype=torch.float64,
                     device=device)  # fmt: skip
    dist.all_reduce(t, group=group)
    total = float(t[-1]) or 1.0
    return {**stats, **{k: float(v) / total for k, v in zip(keys, t[:-1].tolist(), strict=True)}}


def _layer_grad_norms(model: torch.nn.Module, group) -> dict[str, float]:
    """`mxrl.rl.stability.layer_grad_norms` over sharded gradients: each rank's squared sums
    (the same ops on its shards), all-reduced over the train group."""
    groups: dict[str, list[torch.Tensor]] = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        g = local(p.grad.detach())
        groups.setdefault(_group_of(name), []).append(g.float().pow(2).sum())
    names = list(groups)  # parameter order: the same on every rank (FSDP2 grads all or none)
    if not names:
        return {}
    device = local(next(model.parameters())).device
    sq = torch.stack([torch.stack(groups[k]).sum() for k in names]).to(device)
    if dist.get_world_size(group) > 1:
        dist.all_reduce(sq, group=group)
    return {n: math.sqrt(v) for n, v in zip(names, sq.tolist(), strict=True)}  # as stability
