"""What the training pass's autograd keeps per token, tensor by tensor, on a Qwen3-30B-A3B-shaped
slice (the memory estimate's activation count, mxrl/rl/memory_terms.py, checks against it):

    python benchmarks/activations.py --layers 1 --recipe bf16     # on a GPU

Every tensor saved for the backward during the trainer's logprob pass (fp32 master, bf16
autocast, the plan applied) is recorded once by storage; those whose bytes grow with the tokens
are listed in bytes per token (the parameters' own entries, e.g. the experts' fp32 weights, are
listed too: they do not grow with the batch, read them as such)."""

from __future__ import annotations

import argparse
import collections
import sys

import torch
from common import ensure_repo_on_path

ensure_repo_on_path()

from engine_decode import model_config  # noqa: E402

from mxrl.models import build_model  # noqa: E402
from mxrl.nn import apply_plan  # noqa: E402
from mxrl.recipe import resolve  # noqa: E402
from mxrl.rl.logprobs import sequence_logprobs  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--recipe", default="bf16")
    p.add_argument("--sequences", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=256)
    args = p.parse_args(argv)
    cfg = model_config(layers=args.layers, vocab=32000, tiny=False)
    torch.manual_seed(0)
    model = build_model(cfg, device="cuda")
    plan = resolve(args.recipe, {n: q.shape for n, q in model.named_parameters()})
    apply_plan(model, plan, backend="triton")
    model.set_training_options(compute_dtype=torch.bfloat16)
    model.train()
    seen: dict[int, tuple] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.device.type == "cuda":
            key = t.untyped_storage().data_ptr()
            dtype = str(t.dtype).replace("torch.", "")
            seen.setdefault(key, (tuple(t.shape), dtype, t.untyped_storage().nbytes()))
        return t

    b, n = args.sequences, args.new_tokens
    prompts = [[1] * 8] * b
    completions = [[(7 * i + j) % 31999 + 1 for j in range(n)] for i in range(b)]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        sequence_logprobs(model, prompts, completions).sum()
    tokens = b * (8 + n - 1)
    rows: collections.Counter = collections.Counter()
    for shape, dtype, nbytes in seen.values():
        rows[(shape, dtype)] += nbytes
    for (shape, dtype), nbytes in sorted(rows.items(), key=lambda x: -x[1]):
        if nbytes >= tokens:
            print(f"{nbytes / tokens:10.1f} B/token  {shape} {dtype}")
    print(f"{tokens} tokens, {args.layers} layer(s), {args.recipe}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
