"""Supervised warm-up for the embedded task: a random tiny model never earns a reward, so RL has
nothing to learn from; a few hundred SFT steps bring it to partial accuracy (headroom for RL).
The result is cached under ~/.cache/mxrl (MXRL_CACHE overrides), keyed by everything it depends
on, so `mxrl demo` pays for it once per machine.

The demo's warm-up is also shipped (mxrl/app/data/warmup/, 1.2 MB): SFT sums in an order that
depends on the processor's vectorized kernels, and 600 steps amplify it — measured, the same
warm-up reached 0.37 held-out accuracy on the 2-core AMD CI machine and 0.46 on an H200 host's
CPU, and the demo's RL gains depend on that start (docs/rl.md, "The demo"). With the shipped
weights every machine starts the demo from the same policy; `shipped=False` (`mxrl demo
--local-warmup`) trains it here instead. The shipped file is the CI machine's cached result,
under the same key (tests/app/test_warmup_shipped.py fails when the key moves)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch.nn.utils.rnn import pad_sequence

from mxrl import __version__
from mxrl.app.sources import Task
from mxrl.engine import Engine, SamplingParams
from mxrl.models import CausalLM, build_model

logger = logging.getLogger(__name__)


SHIPPED_DIR = Path(__file__).parent / "data" / "warmup"


def cache_dir() -> Path:
    return Path(os.environ.get("MXRL_CACHE", Path.home() / ".cache" / "mxrl"))


def warmup_key(config: dict, task: Task, steps: int, seed: int, batch_size: int, lr: float) -> str:
    """The warm-up's cache key: a hash of everything its weights depend on (and the version)."""
    key_src = json.dumps(
        {"config": config, "task": task.state_dict() | {"pos": None}, "steps": steps,
         "seed": seed, "batch": batch_size, "lr": lr, "mxrl": __version__},
        sort_keys=True, default=str,
    )  # fmt: skip
    return hashlib.sha256(key_src.encode()).hexdigest()[:16]


def sft(
    model: CausalLM,
    task: Task,
    steps: int,
    batch_size: int = 64,
    lr: float = 3e-3,
    *,
    stop: Callable[[int], bool] | None = None,
    stop_every: int = 0,
) -> list[float]:
    """Cross-entropy on the answer tokens (prompt tokens masked), AdamW; returns the losses.
    stop: asked after every `stop_every`-th step (with the steps done); True ends the SFT there
    (`mxrl ablate` stops its warm-up at a dev-split accuracy)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))
    device = next(model.parameters()).device
    losses = []
    model.train()
    for _ in range(steps):
        examples = task.supervised_examples(batch_size)
        seqs = [torch.tensor(e.tokens) for e in examples]
        masks = [torch.tensor(e.loss_mask, dtype=torch.float32) for e in examples]
        ids = pad_sequence(seqs, batch_first=True).to(device)
        target_mask = pad_sequence(masks, batch_first=True).to(device)
        lengths = torch.tensor([len(s) for s in seqs], device=device)
        attn = (torch.arange(ids.shape[1], device=device)[None] < lengths[:, None]).long()
        logits = model(ids[:, :-1], attention_mask=attn[:, :-1]).float()
        nll = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="none"
        ).view_as(target_mask)
        loss = (nll * target_mask).sum() / target_mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
        if stop is not None and len(losses) % stop_every == 0 and stop(len(losses)):
            break
        model.train()  # the stop check may have put it in eval mode
    # The optimizer dies here: leave no gradients behind for whatever trains the model next.
    opt.zero_grad(set_to_none=True)
    return losses


@torch.no_grad()
def greedy_accuracy(
    model: CausalLM,
    task: Task,
    recipe: str = "bf16",
    problems: Sequence[Any] | None = None,
    **engine_options: Any,
) -> float:
    """Accuracy on the task's fixed eval problems (or `problems`), greedy, through an engine
    (`engine_options`: EngineConfig fields, e.g. its `cache`)."""
    engine = Engine(model, recipe, weight_dtype=torch.float32, **engine_options)
    problems = task.eval_problems() if problems is None else list(problems)
    outs = engine.generate(
        [task.encode_prompt(p) for p in problems],
        SamplingParams(temperature=0.0, max_new_tokens=task.max_new_tokens,
                       stop_token_ids=task.stop_token_ids),
    )  # fmt: skip
    hits = [
        task.reward(task.decode_response(o.tokens), p) for o, p in zip(outs, problems, strict=True)
    ]
    return sum(hits) / len(hits)


def warmed_up_model(
    config: dict,
    task: Task,
    steps: int,
    *,
    seed: int = 0,
    batch_size: int = 64,
    lr: float = 3e-3,
    shipped: bool = True,
) -> tuple[CausalLM, dict]:
    """The SFT-warmed model for (config, task, steps, seed): the shipped one when its key is
    shipped (and `shipped`), else the cache's, else trained here and cached. Returns (model in
    fp32 on CPU, info with loss and accuracy, and `source`: shipped, cache or trained)."""
    key = warmup_key(config, task, steps, seed, batch_size, lr)
    folder = cache_dir() / "warmup"
    weights, meta = folder / f"{key}.safetensors", folder / f"{key}.json"
    sources = [("shipped", SHIPPED_DIR)] if shipped else []
    for source, where in [*sources, ("cache", folder)]:
        w, m = where / f"{key}.safetensors", where / f"{key}.json"
        if not (w.exists() and m.exists()):
            continue
        try:
            model = build_model(config, seed=seed)
            model.load_state_dict(load_file(str(w)))
            info = json.loads(m.read_text()) | {"source": source}
            logger.info("warm-up: %s %s (accuracy %.2f)", source, w, info["accuracy"])
            return model, info
        except (OSError, RuntimeError, ValueError, KeyError) as err:
            logger.warning("warm-up %s %s unreadable (%s): trying the next", source, w, err)
    model = build_model(config, seed=seed)  # not one a failed load half-filled
    fresh = task.fresh()
    losses = sft(model, fresh, steps, batch_size=batch_size, lr=lr)
    info = {"steps": steps, "final_loss": losses[-1], "accuracy": greedy_accuracy(model, fresh)}
    folder.mkdir(parents=True, exist_ok=True)
    tmp = weights.with_suffix(".tmp")
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp))
    tmp.rename(weights)
    meta.write_text(json.dumps(info, indent=2))
    info["source"] = "trained"
    logger.info("warm-up: %d SFT steps, loss %.3f, accuracy %.2f -> %s", steps, losses[-1],
                info["accuracy"], weights)  # fmt: skip
    return model, info
