"""Synchronous GRPO (docs/design.md §3, §8): rollout on the engine, rewards, group advantages, the
trainer's logprobs and the mismatch metrics, the clipped loss (TIS/MIS optional), backward in the
recipe's mode, spike detection, the optimizer step, then a verified weight sync.

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
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch.nn.utils.rnn import pad_sequence

from mxrl.engine import Engine, SamplingParams
from mxrl.models import CausalLM
from mxrl.nn import apply_plan
from mxrl.recipe import Plan, resolve
from mxrl.rl.config import GRPOConfig
from mxrl.rl.grpo import group_advantages, policy_loss
from mxrl.rl.logprobs import sequence_logprobs
from mxrl.rl.metrics import Progress, engine_digest, step_metrics
from mxrl.rl.mismatch import mismatch_metrics
from mxrl.rl.optim import adamw
from mxrl.rl.resume import CHECKPOINT_DIR, apply_optimizer_settings
from mxrl.rl.sources import PromptSource
from mxrl.rl.stability import GradSpikeDetector, layer_grad_norms, top_growth
from mxrl.runs import FINISHED, RunRecord
from mxrl.sync import InProcessTransport
from mxrl.weights import export

logger = logging.getLogger(__name__)


class GRPOTrainer:
    """Owns the trainer model (plan applied), the optimizer, the engine and the sync."""

    def __init__(
        self, cfg: GRPOConfig, model: CausalLM, source: PromptSource, record: RunRecord
    ) -> None:
        self.cfg, self.model, self.source, self.record = cfg, model, source, record
        self.plan: Plan = resolve(cfg.recipe, {n: p.shape for n, p in model.named_parameters()})
        apply_plan(model, self.plan, backend=cfg.backend)
        compute = cfg.torch_compute_dtype()
        if compute != torch.float32:
            model.set_training_options(compute_dtype=compute)
        self.engine = Engine(
            model, self.plan, device=cfg.device, backend=cfg.backend, tile=cfg.engine_tile,
            compute_dtype=compute,
        )  # fmt: skip
        self.transport = InProcessTransport(self.engine)
        self.opt = adamw(
            model.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay
        )
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
        # The trainer owns the model's gradients from here: a model handed over with gradients
        # left by an earlier phase (the SFT warm-up leaves its last step's) would add them to
        # step 1's, so a cached warm-up and a fresh one would train differently.
        self.opt.zero_grad(set_to_none=True)
        # Nothing in the loop draws from the global RNGs today (sampling uses per-request
        # generators); seeding them makes their state a function of the run, saved in checkpoints.
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)

    # --- one step -------------------------------------------------------------------------
    def train_step(self) -> dict[str, float]:
        cfg, step = self.cfg, self.step + 1
        n = cfg.samples_per_prompt
        t0 = time.perf_counter()
        batch = self.source.next_batch(cfg.prompts_per_step)
        prompts = [p for p in batch.prompts for _ in range(n)]
        labels = [lab for lab in batch.labels for _ in range(n)]
        params = [
            SamplingParams(
                temperature=cfg.temperature,
                top_p=cfg.top_p,
                top_k=cfg.top_k,
                max_new_tokens=cfg.max_new_tokens,
                stop_token_ids=self.source.stop_token_ids,
                seed=_seed(cfg.seed, step, i),
            )
            for i in range(len(prompts))
        ]
        outs = self.engine.generate(prompts, params)
        t_rollout = time.perf_counter() - t0

        t1 = time.perf_counter()
        rewards = torch.tensor(
            [self.source.reward(o.tokens, lab) for o, lab in zip(outs, labels, strict=True)],
            dtype=torch.float32,
        )
        adv = group_advantages(rewards, n, std_normalize=cfg.std_normalize)
        self.model.train()
        logp = sequence_logprobs(
            self.model, prompts, [o.tokens for o in outs], cfg.temperature,
            top_k=cfg.top_k, top_p=cfg.top_p,
        )  # fmt: skip
        mask = pad_sequence([torch.ones(len(o.tokens)) for o in outs], batch_first=True)
        rollout = pad_sequence([o.logprobs for o in outs], batch_first=True).to(logp.device)
        old = logp.detach()  # one update per batch: pi_old is the trainer's current policy
        mm = mismatch_metrics(rollout.cpu(), old.cpu(), mask)
        loss, stats = policy_loss(
            logp, old, adv.to(logp.device), mask.to(logp.device),
            eps_low=cfg.eps_low, eps_high=cfg.eps_high, rollout_logp=rollout,
            correction=cfg.correction, tis_cap=cfg.tis_cap,
        )  # fmt: skip
        loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip))
        decision = self.spikes.update(grad_norm)
        layer_norms = layer_grad_norms(self.model)
        if decision.spike:
            growth = top_growth(layer_norms, self.prev_layer_norms)
            self.record.log_spike(step, grad_norm, decision.z, growth, skipped=decision.skip)
        if not decision.skip:
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.prev_layer_norms = layer_norms
        t_train = time.perf_counter() - t1

        t2 = time.perf_counter()
        # the engine verifies every record's hash against its bytes before taking the update
        # (all or nothing): that is the hot path's one verification
        report = self.transport.send(export(self.model, self.plan, step=step))
        deep = bool(cfg.verify_every) and step % cfg.verify_every == 0
        ok = self._verify_sync() if deep else True
        t_sync = time.perf_counter() - t2
        if report.event is not None:
            self.record.log_quantization(report.event)
        self.record.log_sync_verified(
            step, report.version, self.plan.hash(), ok,
            engine_digest=engine_digest(self.engine.hashes.items()), deep=deep,
        )  # fmt: skip

        metrics = step_metrics(
            outs, rewards, mask, mm.as_dict(), stats, grad_norm, decision.as_dict(),
            (t_rollout, t_train, t_sync), time.perf_counter() - t0, report.version,
        )  # fmt: skip
        if cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.steps):
            metrics["eval/accuracy"] = self.evaluate()
        self.record.log_metrics(step, metrics)
        self.step = step
        if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
            self.save_checkpoint()
        return metrics

    @torch.no_grad()
    def evaluate(self) -> float:
        """Held-out accuracy of the policy the engine serves now: greedy decoding of the
        source's fixed eval set (never trained on), mean reward."""
        batch = self.source.eval_batch()
        params = SamplingParams(
            temperature=0.0, max_new_tokens=self.cfg.max_new_tokens,
            stop_token_ids=self.source.stop_token_ids,
        )  # fmt: skip
        outs = self.engine.generate(batch.prompts, params)
        hits = [
            self.source.reward(o.tokens, lab) for o, lab in zip(outs, batch.labels, strict=True)
        ]
        return sum(hits) / len(hits)

    def _verify_sync(self) -> bool:
        """The deep check (every `verify_every` steps): the bytes the engine holds, hashed
        again, are what a fresh export of the master weights gives."""
        fresh = {
            r.name: r.hash for b in export(self.model, self.plan, sqnr=False) for r in b.records
        }
        return all(fresh.get(r.name) == r.hash for r in self.engine.records())

    def run(self) -> list[dict[str, float]]:
        """Train to `cfg.steps`; the record ends finished, failed (the exception, then raised
        again) or interrupted (Ctrl-C, SIGTERM): `RunRecord.guard`."""
        history = []
        progress = Progress(self.step, self.cfg.steps)
        with self.record.guard(lambda: self.step):
            if self.cfg.eval_every and self.step == 0:  # the starting policy, as step 0
                self.record.log_metrics(0, {"eval/accuracy": self.evaluate()})
            while self.step < self.cfg.steps:
                m = self.train_step()
                history.append(m)
                progress.log(self.step, m)
            self.record.finish(self.step, status=FINISHED)
        return history

    # --- checkpoints ----------------------------------------------------------------------
    def save_checkpoint(self) -> Path:
        """runs/<id>/checkpoints/step_NNNNNN.pt, written to a temporary name and renamed, so a
        run killed at any moment leaves only whole checkpoints."""
        folder = self.record.path / CHECKPOINT_DIR
        folder.mkdir(exist_ok=True)
        path = folder / f"step_{self.step:06d}.pt"
        tmp = path.with_suffix(".tmp")
        torch.save(
            {
                "step": self.step,
                "model": self.model.state_dict(),
                "opt": self.opt.state_dict(),
                "source": self.source.state_dict(),
                "spikes": self.spikes.state_dict(),
                "prev_layer_norms": self.prev_layer_norms,
                "rng": self._rng_state(),
                "engine_version": self.engine.weights_version,
                "engine_digest": engine_digest(self.engine.hashes.items()),
                "plan_hash": self.plan.hash(),
                "config": asdict(self.cfg),
            },
            tmp,
        )
        tmp.rename(path)
        return path

    def load_checkpoint(self, path: str | Path, state: dict[str, Any] | None = None) -> int:
        """Continue from a checkpoint: restores everything `save_checkpoint` wrote and re-sends
        the weights to the engine, which ends at the checkpoint's weights version. `state`: the
        checkpoint already loaded (`mxrl.rl.resume` loads it to check it before anything is
        written). The optimizer takes this config's lr, betas and weight decay, not the saved
        ones (a resume applies a changed setting). A checkpoint from before the RNG and engine
        keys loads too (RNGs as seeded at construction, version step + 1: the loop's
        numbering), with a warning that it may not continue bitwise."""
        if state is None:
            state = torch.load(path, map_location=self.cfg.device, weights_only=False)
        if state["plan_hash"] != self.plan.hash():
            raise ValueError(
                f"checkpoint {path} was trained under plan {state['plan_hash'][:12]}, this run "
                f"resolves {self.plan.hash()[:12]}: resume with the same recipe and model"
            )
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["opt"])  # moves the moments to the parameters' device
        apply_optimizer_settings(self.opt, self.cfg)
        self.source.load_state_dict(state["source"])
        self.spikes.load_state_dict(state["spikes"])
        self.prev_layer_norms = state["prev_layer_norms"]
        self.step = int(state["step"])
        missing = [k for k in ("rng", "engine_version", "engine_digest") if k not in state]
        if missing:
            logger.warning(
                "checkpoint %s predates %s: it resumes, but may not continue bitwise", path, missing
            )
        if "rng" in state:
            self._set_rng_state(state["rng"])
        self.transport.send(export(self.model, self.plan, step=self.step))
        # Engine.load_weights counts loads in this process (one when the engine was built, one
        # per sync): here that made 2, the uninterrupted run's engine was at the saved version.
        self.engine.weights_version = int(state.get("engine_version", self.step + 1))
        served = engine_digest(self.engine.hashes.items())
        if state.get("engine_digest", served) != served:
            logger.warning(
                "checkpoint %s: the re-sent weights give engine digest %s, the run served %s at "
                "step %d: the export is not reproducible here, so the rollouts will differ",
                path, served[:12], state["engine_digest"][:12], self.step,
            )  # fmt: skip
        return self.step

    def _rng_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
        device = torch.device(self.cfg.device)
        if device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state(device)
        return state

    def _set_rng_state(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["torch"].cpu())  # torch.load mapped it to cfg.device
        random.setstate(state["python"])
        device = torch.device(self.cfg.device)
        if "cuda" in state and device.type == "cuda":  # a CUDA run resumed on the CPU has none
            torch.cuda.set_rng_state(state["cuda"].cpu(), device)


def _seed(seed: int, step: int, index: int) -> int:
    """A per-request sampling seed that depends only on (run seed, step, request index)."""
    return (seed * 1_000_003 + step * 10_007 + index) % (2**63 - 1)
