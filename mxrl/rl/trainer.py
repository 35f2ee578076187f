"""Synchronous GRPO (docs/design.md §3, §4.7, §8): rollout on the engine, rewards, group
advantages, the trainer's logprobs and the mismatch metrics, the clipped loss (TIS/MIS
optional), backward in the recipe's mode, spike detection, the optimizer step, then a verified
weight sync.

One trainer for every placement. What differs sits behind two seams: the actor
(`mxrl.rl.actor`: where the master weights live, how they are exported and saved) and the
rollout (`mxrl.rl.rollout`: where rollouts run, how weights reach them). The step is written
once, in its distributed form; on one process every collective of `OneRank` is an identity, so
it computes the values of the single-process loop to the bit (tests/rl/test_loop.py's golden
run). On a placement (`torchrun ... mxrl train` with a `placement` section, docs/scale.md) every
rank runs the same step in lockstep: each rollout rank generates its share of the prompt groups,
each train rank computes the loss of its share on its FSDP2 shard, in micro-batches of at most
`max_tokens_per_micro_batch` padded tokens (`mxrl.rl.micro_batch`; the batch's token count is
then the denominator, and with more than one train rank the loss is scaled by their number, so
FSDP2's averaged gradient is the whole batch's: DAPO token-mean), the norms are global, and
rank 0 writes the record: the step's times the slowest rank's, plus each rank's own
(`time/rank{r}/...`), the sync events with the engine digest every serving rank agreed on.

Every step appends one line of metrics to the run record and its events (quantization, sync
with the engine's digest, spikes); checkpoints hold everything a resumed run, in a fresh process,
needs to continue byte for byte as an uninterrupted one with the same seed would have: master
weights, optimizer, data stream, spike detector, the global RNGs and the engine's weights version
(tests/rl/test_resume.py kills a `mxrl train` run with SIGKILL and compares).
"""

from __future__ import annotations

import logging
import random
import time
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.nn.utils.rnn import pad_sequence

from mxrl.engine import Completion, SamplingParams
from mxrl.models import CausalLM
from mxrl.rl import micro_batch
from mxrl.rl.config import GRPOConfig, plain
from mxrl.rl.grpo import group_advantages, policy_loss
from mxrl.rl.logprobs import sequence_logprobs
from mxrl.rl.metrics import GC_PAUSES, Progress, frozen_heap, memory_peak, settle, step_metrics
from mxrl.rl.mismatch import mismatch_metrics
from mxrl.rl.resolve import Resolved, resolve_train
from mxrl.rl.resume import CHECKPOINT_DIR, read_state
from mxrl.rl.rollout import request_seed
from mxrl.rl.seams import build_seams
from mxrl.rl.source import PromptSource
from mxrl.rl.stability import GradSpikeDetector, layer_grad_norms, top_growth
from mxrl.runs import FINISHED, RunRecord
from mxrl.weights.event import SqnrSample

if TYPE_CHECKING:
    from mxrl.parallel import Layout

# mxrl.parallel is imported where a placement uses it (rl/actor.py says why)

logger = logging.getLogger(__name__)


class GRPOTrainer:
    """The GRPO loop over an actor and a rollout. `record`: the run record (None on a rank that
    does not write it); `layout`: this process's place in a placement (None: one process).
    Attributes callers read: `model`, `opt` (None on a rank that does not train), `engine`
    (None on a rank that does not serve), `spikes`, `record`, `plan`, `step`."""

    def __init__(
        self,
        cfg: GRPOConfig,
        model: CausalLM,
        source: PromptSource,
        record: RunRecord | None,
        *,
        layout: Layout | None = None,
        micro_batch_tokens: int | None = None,
        kv_cache_bytes: int | None = None,
        resolved: Resolved | None = None,
        hold_bf16_weights: bool | None = None,
    ) -> None:
        self.cfg, self.source, self.record, self.layout = cfg, source, record, layout
        # padded tokens per micro-batch of the training pass: cfg.max_tokens_per_micro_batch,
        # or when it is 0 the caller's, from its memory estimate (None: one micro-batch); the
        # engines' KV cache: the caller's size (None: the engine's default, CacheOptions); the
        # held bf16 copies under rl.hold_bf16_weights auto: the estimate's choice (None: held)
        self.micro_batch_tokens = cfg.max_tokens_per_micro_batch or micro_batch_tokens
        # the run's choices: the caller's (`mxrl train`: the plan it printed), else made here
        resolved = resolved or resolve_train(cfg, model, layout.device if layout else None)
        self.resolved, self.plan = resolved, resolved.plan
        seams = (cfg, model, resolved, layout, kv_cache_bytes, hold_bf16_weights)
        self.actor, self.rollout = build_seams(*seams)
        self.model = self.actor.model if self.actor is not None else None
        self.opt = self.actor.optimizer if self.actor is not None else None
        self.engine = self.rollout.engine
        self.spikes = GradSpikeDetector(
            window=cfg.spike_window, z_threshold=cfg.spike_z, action=cfg.spike_action
        )
        self.prev_layer_norms: dict[str, float] = {}
        self.step = 0
        if cfg.eval_every and not hasattr(source, "eval_batch"):
            raise ValueError(
                f"eval_every={cfg.eval_every} needs a source with a held-out set (eval_batch): "
                "the embedded task has one; set eval_every: 0 for this source"
            )
        if self.opt is not None:
            # The trainer owns the model's gradients from here: a model handed over with
            # gradients left by an earlier phase (the SFT warm-up leaves its last step's) would
            # add them to step 1's, so a cached warm-up and a fresh one would train differently.
            self.opt.zero_grad(set_to_none=True)
        # Nothing in the loop draws from the global RNGs today (sampling uses per-request
        # generators); seeding them makes their state a function of the run, saved in checkpoints.
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)

    # --- one step -------------------------------------------------------------------------
    def train_step(self) -> dict[str, float] | None:
        """One step (on every rank); its metrics where the record is written, None elsewhere."""
        cfg, step = self.cfg, self.step + 1
        n = cfg.samples_per_prompt
        device = self.layout.device if self.layout is not None else cfg.device
        memory_peak(device)  # from here: this step's stages
        gc_paused, t0 = GC_PAUSES.install().seconds, time.perf_counter()
        batch = self.source.next_batch(cfg.prompts_per_step)  # every rank: one data stream
        prompts = [p for p in batch.prompts for _ in range(n)]
        labels = [lab for lab in batch.labels for _ in range(n)]
        params = [self._sampling(step, i) for i in range(len(prompts))]
        outs = self.rollout.generate(prompts, params, n)
        t_rollout = time.perf_counter() - t0
        peaks = {"memory/rollout_peak_gib": memory_peak(device)}

        t1 = time.perf_counter()
        rewards = torch.tensor(
            [self.source.reward(o.tokens, lab) for o, lab in zip(outs, labels, strict=True)],
            dtype=torch.float32,
        )
        mask = pad_sequence([torch.ones(len(o.tokens)) for o in outs], batch_first=True)
        train = self._train(step, prompts, outs, rewards, mask) if self.actor else None
        settle(device)
        t_train = time.perf_counter() - t1
        peaks["memory/train_peak_gib"] = memory_peak(device)

        t2 = time.perf_counter()
        sample = SqnrSample.at_step(step, cfg.sqnr_expert_stride)
        report = self.rollout.update(self.actor.export(step, sqnr=sample) if self.actor else None)
        deep = bool(cfg.verify_every) and step % cfg.verify_every == 0
        ok = self._verify_sync() if deep else True
        served, agreed = self.rollout.digest()
        settle(device)
        t_sync = time.perf_counter() - t2
        times = self._everyone((t_rollout, t_train, t_sync))
        held_out = self._held_out(step)
        metrics = None
        if self.record is not None:
            assert train is not None and report is not None
            if report.event is not None:
                self.record.log_quantization(report.event)
            self.record.log_sync_verified(
                step, report.version, self.plan.hash(), ok and agreed,
                engine_digest=served, deep=deep,
            )  # fmt: skip
            metrics = self._metrics(outs, rewards, mask, train, times, t0, report.version)
            metrics |= peaks | {"time/gc_s": GC_PAUSES.seconds - gc_paused}
            if held_out is not None:
                metrics["eval/accuracy"] = held_out
            self.record.log_metrics(step, metrics)
        self.step = step
        if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
            self.save_checkpoint(engine_digest=served)
        return metrics

    def _sampling(self, step: int, index: int) -> SamplingParams:
        """Request `index` of `step`'s sampling parameters: its seed depends only on (run seed,
        step, index), so a resumed run, or one whose rollouts run elsewhere, samples the same."""
        cfg = self.cfg
        return SamplingParams(
            temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
            max_new_tokens=cfg.max_new_tokens, stop_token_ids=self.source.stop_token_ids,
            seed=request_seed(cfg.seed, step, index),
        )  # fmt: skip

    def _train(
        self,
        step: int,
        prompts: list[list[int]],
        outs: list[Completion],
        rewards: torch.Tensor,
        mask: torch.Tensor,
    ) -> dict[str, Any]:
        """This train rank's share of the loss, backward, the norms over every train rank, the
        spike decision and the optimizer step."""
        cfg, actor = self.cfg, self.actor
        assert actor is not None and self.opt is not None
        ranks, n = actor.ranks, cfg.samples_per_prompt
        adv = group_advantages(rewards, n, std_normalize=cfg.std_normalize)
        idx = [g * n + j for g in ranks.share(len(outs) // n) for j in range(n)]
        actor.model.train()
        lengths = [len(prompts[i]) + len(outs[i].tokens) - 1 for i in idx]  # forward tokens
        batches = micro_batch.plan(lengths, self.micro_batch_tokens, ranks)
        # one micro-batch on one process: the batch's own token count (the loss as it always
        # was); else the whole batch's on every micro-batch, so their gradients add up to it
        whole = len(batches) > 1 or ranks.size > 1
        olds: dict[int, torch.Tensor] = {}  # position in idx -> pi_old of that sequence
        parts: list[tuple[dict[str, float], float]] = []
        for mb in batches:
            sel = [idx[r] for r in mb.rows]
            logp = sequence_logprobs(
                actor.model, [prompts[i] for i in sel], [outs[i].tokens for i in sel],
                cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p,
            )  # fmt: skip
            m = pad_sequence([torch.ones(len(outs[i].tokens)) for i in sel], batch_first=True)
            rollout = pad_sequence([outs[i].logprobs for i in sel], batch_first=True)
            old = logp.detach()  # one update per batch: pi_old is the trainer's current policy
            loss, stats = policy_loss(
                logp, old, adv[sel].to(logp.device), m.to(logp.device),
                eps_low=cfg.eps_low, eps_high=cfg.eps_high,
                rollout_logp=rollout.to(logp.device), correction=cfg.correction,
                tis_cap=cfg.tis_cap, denominator=float(mask.sum()) if whole else None,
            )  # fmt: skip
            # FSDP2 averages the ranks' gradients: undone, the batch's sum
            (loss * (ranks.size * mb.weight) if whole else loss).backward()
            if mb.weight:
                olds |= {r: old[k, : len(outs[idx[r]].tokens)].cpu() for k, r in enumerate(mb.rows)}
                parts.append((stats, float(m.sum())))
        stats = micro_batch.combine(parts, ranks)
        rows = [olds[r] for r in range(len(idx))]  # request order (micro-batches: longest first)
        # the mismatch metrics over the whole batch: every train rank's rows (sequence_logprobs
        # writes zeros past each completion, as pad_sequence pads)
        full_old = pad_sequence(ranks.gather(rows), batch_first=True)
        full_rollout = pad_sequence([o.logprobs for o in outs], batch_first=True)
        mm = mismatch_metrics(full_rollout, full_old, mask).as_dict()
        norm = torch.nn.utils.clip_grad_norm_(actor.model.parameters(), cfg.grad_clip)
        grad_norm = float(ranks.full(norm))
        decision = self.spikes.update(grad_norm)
        layer_norms = layer_grad_norms(actor.model, ranks)
        if decision.spike and self.record is not None:
            growth = top_growth(layer_norms, self.prev_layer_norms)
            self.record.log_spike(step, grad_norm, decision.z, growth, skipped=decision.skip)
        if not decision.skip:
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.prev_layer_norms = layer_norms
        padded = sum(micro_batch.padded_tokens(lengths, mb.rows) for mb in batches)
        forwards = {"train/micro_batches": float(len(batches)),
                    "train/padded_tokens_ratio": padded / max(sum(lengths), 1)}  # fmt: skip
        return {"mismatch": mm, "stats": stats, "grad_norm": grad_norm,
                "decision": decision.as_dict(), "forwards": forwards}  # fmt: skip

    def _metrics(self, outs, rewards, mask, train, times, t0, version) -> dict[str, float]:
        """The step's metrics: its times the slowest rank's (the step waits for it), and each
        rank's own when there is more than one."""
        slowest = tuple(max(t[i] for t in times) for i in range(3))
        metrics = step_metrics(
            outs, rewards, mask, train["mismatch"], train["stats"], train["grad_norm"],
            train["decision"], slowest, time.perf_counter() - t0, version,
        )  # fmt: skip
        metrics |= train["forwards"]  # this rank's
        if len(times) > 1:
            for r, (tr, tt, ts) in enumerate(times):
                metrics |= {f"time/rank{r}/rollout_s": tr, f"time/rank{r}/train_s": tt,
                            f"time/rank{r}/sync_s": ts}  # fmt: skip
        return metrics

    def _held_out(self, step: int) -> float | None:
        """Held-out accuracy after every `eval_every`-th step and after the last (every rank:
        the serving ranks share the eval set)."""
        every = self.cfg.eval_every
        if every and (step % every == 0 or step == self.cfg.steps):
            return self.evaluate()
        return None

    def _everyone(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, by rank (this one's alone on one process)."""
        if self.layout is None:
            return [obj]
        from mxrl.parallel.shares import gather_objects

        return gather_objects(obj)

    @torch.no_grad()
    def evaluate(self) -> float:
        """Held-out accuracy of the policy the engines serve now: greedy decoding of the
        source's fixed eval set (never trained on), mean reward. Every rank: each serving rank
        decodes its share of the set, and every rank gets every completion."""
        batch = self.source.eval_batch()
        params = SamplingParams(
            temperature=0.0, max_new_tokens=self.cfg.max_new_tokens,
            stop_token_ids=self.source.stop_token_ids,
        )  # fmt: skip
        outs = self.rollout.generate(batch.prompts, [params] * len(batch.prompts))
        hits = [
            self.source.reward(o.tokens, lab) for o, lab in zip(outs, batch.labels, strict=True)
        ]
        return sum(hits) / len(hits)

    def _verify_sync(self) -> bool:
        """The deep check (every `verify_every` steps): the bytes every engine holds, hashed
        again, are what a fresh export of the master weights gives."""
        fresh = None
        if self.actor is not None:
            export = self.actor.export(self.step + 1, sqnr=False)
            fresh = {r.name: r.hash for r in export.records()}
        return self.rollout.holds(fresh)

    def run(self) -> list[dict[str, float]]:
        """Train to `cfg.steps` (every rank); the metrics where the record is written. The record
        ends finished, failed (the exception, then raised again) or interrupted (Ctrl-C,
        SIGTERM): `RunRecord.guard`."""
        history: list[dict[str, float]] = []
        progress = Progress(self.step, self.cfg.steps)
        guard = self.record.guard(lambda: self.step) if self.record is not None else nullcontext()
        with guard, frozen_heap():  # the set-up's objects out of every collection's walk
            if self.cfg.eval_every and self.step == 0:  # the starting policy, as step 0
                accuracy = self.evaluate()
                if self.record is not None:
                    self.record.log_metrics(0, {"eval/accuracy": accuracy})
            while self.step < self.cfg.steps:
                m = self.train_step()
                if m is not None:
                    history.append(m)
                    progress.log(self.step, m)
            if self.record is not None:
                self.record.finish(self.step, status=FINISHED)
        return history

    # --- checkpoints ----------------------------------------------------------------------
    def save_checkpoint(self, engine_digest: str | None = None) -> Path | None:
        """The resume state of this step under runs/<id>/checkpoints/, by the actor (a rank
        that does not train holds nothing the run needs: None). `engine_digest`: the one the
        step's sync reported (collective to compute again)."""
        if self.actor is None:
            return None
        if engine_digest is None:
            engine_digest = self.rollout.digest()[0]
        state = {
            "step": self.step,
            "source": self.source.state_dict(),
            "spikes": self.spikes.state_dict(),
            "prev_layer_norms": self.prev_layer_norms,
            "engine_version": self.rollout.weights_version(self.step),
            "engine_digest": engine_digest,
            "plan_hash": self.plan.hash(),
            "config": plain(self.cfg),
            "micro_batch_tokens": self.micro_batch_tokens,
        }
        folder = self.record.path / CHECKPOINT_DIR if self.record is not None else None
        return self.actor.save(folder, self.step, state)

    def load_checkpoint(self, path: str | Path, state: dict[str, Any] | None = None) -> int:
        """Continue from a checkpoint (every rank): restores what `save_checkpoint` wrote and
        re-sends the weights to every engine, which ends at the checkpoint's weights version.
        `state`: the trainer state `mxrl.rl.resume` loaded and checked. The optimizer takes
        this config's lr, betas and weight decay (a resume applies a changed setting). An older
        checkpoint without the RNG and engine keys loads with a warning (RNGs as seeded,
        version step + 1) that it may not continue bitwise."""
        path = Path(path)
        if state is None:
            state = read_state(
                path, distributed=self.layout is not None, map_location=self.cfg.device
            )
        if state["plan_hash"] != self.plan.hash():
            raise ValueError(
                f"checkpoint {path} was trained under plan {state['plan_hash'][:12]}, this run "
                f"resolves {self.plan.hash()[:12]}: resume with the same recipe and model"
            )
        if self.actor is not None:
            self.actor.load(path, state)
        self.source.load_state_dict(state["source"])
        self.spikes.load_state_dict(state["spikes"])
        self.prev_layer_norms = state["prev_layer_norms"]
        if not self.cfg.max_tokens_per_micro_batch and "micro_batch_tokens" in state:
            # a derived budget stays the run's (the memory free now may differ): bitwise resume
            self.micro_batch_tokens = state["micro_batch_tokens"]
        self.step = int(state["step"])
        newer = self.actor.newer_keys if self.actor is not None else ()
        missing = [k for k in (*newer, "engine_version", "engine_digest") if k not in state]
        if missing:
            logger.warning(
                "checkpoint %s predates %s: it resumes, but may not continue bitwise", path, missing
            )
        self.rollout.update(self.actor.export(self.step) if self.actor else None)
        self.rollout.restore_version(int(state.get("engine_version", self.step + 1)))
        served, _ = self.rollout.digest()
        if state.get("engine_digest", served) != served:
            logger.warning(
                "checkpoint %s: the re-sent weights give engine digest %s, the run served %s at "
                "step %d: the export is not reproducible here, so the rollouts will differ",
                path, served[:12], state["engine_digest"][:12], self.step,
            )  # fmt: skip
        return self.step
