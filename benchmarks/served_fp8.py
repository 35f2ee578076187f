"""mxrl's block-FP8 served checkpoint in transformers' own FP8 path, against mxrl's engine.

    python benchmarks/served_fp8.py --kernel-src DIR --out results.json   # H200, 4-layer slice
    python benchmarks/served_fp8.py --tiny --dequantize                  # CPU: the logic only

One model (Qwen3-30B-A3B's layer shapes, `--layers` layers, seeded random init, fp32 master),
one plan (`fp8-block`), one export: `mxrl.weights.served` writes it as an HF fine-grained FP8
checkpoint, transformers loads it with `from_pretrained(device_map="cuda")` (its `FP8Linear` /
`FP8Experts` modules: activations quantized 1x128 at run time, FP8 GEMMs on the file's codes and
`weight_scale_inv`), and both run the same prompts. The last token's logits are compared:

- `tf_fp8` vs `mxrl_fp8`: the two FP8 implementations of one checkpoint;
- `tf_bf16` vs `mxrl_bf16`: the two implementations on the bf16 weights (the noise floor of two
  bf16 forwards that order their sums differently);
- `mxrl_fp8` vs `mxrl_bf16`: what block FP8 itself changes.

- `tf_fp8_corrupt` vs `mxrl_fp8`: the same export with layer 0's `weight_scale_inv` shifted by
  one block along K (the layout slip a converter makes): what a wrong byte layout looks like.

The bound checked (`within_bound`): the mean KL between the two FP8 implementations of the same
bytes is at most half the mean KL between FP8 and bf16 (what block FP8 itself changes), while the
corrupted export's exceeds the whole of it. Max |logit| is recorded, not bounded: two bf16
forwards that sum in different orders already differ by about as much (`bf16_tf_vs_mxrl`).

transformers 5 fetches its FP8 GEMM kernel (`kernels-community/finegrained-fp8`) from the
Hugging Face hub, which the benchmark machine cannot reach: `--kernel-src` names a directory
holding that kernel's Python package (`finegrained_fp8/`, from the kernels-community repository,
with a `_ops.py` naming its torch.library namespace), installed where transformers keeps the
hub-loaded kernel. `--dequantize` instead loads the export dequantized (the CPU path).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import ensure_repo_on_path
from engine_decode import model_config

ensure_repo_on_path()

from mxrl.engine import Engine  # noqa: E402
from mxrl.models import build_model  # noqa: E402
from mxrl.recipe import resolve  # noqa: E402
from mxrl.weights import export  # noqa: E402
from mxrl.weights.served import write_served_checkpoint  # noqa: E402

TINY_128 = {  # --tiny: 128-multiples, so fp8-block takes every Linear
    "hidden_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 128,
    "rope_theta": 10_000.0,
    "rms_norm_eps": 1e-6,
}


def install_kernel(src: Path) -> str:
    """Put the finegrained-fp8 kernel package found in `src` where transformers keeps the one it
    would fetch from the hub; returns the transformers module's name for the record."""
    import transformers.integrations.finegrained_fp8 as tf_fp8

    sys.path.insert(0, str(src))
    import finegrained_fp8 as kernel

    tf_fp8._FINEGRAINED_FP8 = tf_fp8.FineGrainedFP8(
        matmul=kernel.matmul_2d,
        batched_matmul=kernel.matmul_batched,
        grouped_matmul=kernel.matmul_grouped,
    )
    return str(Path(kernel.__file__).parent)


def compare(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    """Logits [R, V] of two implementations: max |a - b|, its ratio to max |a|, the mean KL of
    their softmaxes and the share of rows whose argmax agrees."""
    a, b = a.double(), b.double()
    la, lb = a.log_softmax(-1), b.log_softmax(-1)
    kl = (la.exp() * (la - lb)).sum(-1)
    return {
        "max_abs": float((a - b).abs().max()),
        "max_abs_rel": float((a - b).abs().max() / a.abs().max()),
        "mean_kl": float(kl.mean()),
        "max_kl": float(kl.max()),
        "top1_agree": float((a.argmax(-1) == b.argmax(-1)).double().mean()),
    }


def corrupt(path: Path) -> None:
    """Shift every layer-0 `weight_scale_inv` by one block along K, in place."""
    from safetensors.torch import load_file, save_file

    for f in path.glob("*.safetensors"):
        state = load_file(str(f))
        for key, t in state.items():
            if key.startswith("model.layers.0.") and key.endswith("weight_scale_inv"):
                state[key] = t.roll(1, dims=-1).contiguous()
        save_file(state, str(f), metadata={"format": "pt"})


def within_bound(result: dict) -> bool:
    fp8, tf, bad = (
        result[k] for k in ("mxrl_fp8_vs_bf16", "fp8_tf_vs_mxrl", "fp8_corrupt_vs_mxrl")
    )
    return tf["mean_kl"] <= 0.5 * fp8["mean_kl"] < bad["mean_kl"] / 2


def tf_logits(path: Path, prompts: torch.Tensor, device: str, dequantize: bool) -> torch.Tensor:
    import transformers

    kwargs = {}
    if dequantize:
        kwargs["quantization_config"] = transformers.FineGrainedFP8Config(dequantize=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16, device_map=device, **kwargs
    ).eval()
    with torch.no_grad():
        out = model(prompts.to(device)).logits[:, -1].float().cpu()
    del model
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--tiny", action="store_true", help="a 256-wide model (CPU)")
    p.add_argument("--kernel-src", type=Path, help="directory holding finegrained_fp8/")
    p.add_argument("--dequantize", action="store_true", help="transformers dequantizes at load")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    import transformers

    kernel = install_kernel(args.kernel_src) if args.kernel_src else None
    config = model_config(layers=args.layers, vocab=args.vocab, tiny=args.tiny, tiny_layer=TINY_128)
    model = build_model(config, dtype=torch.float32, device=device, seed=0)
    shapes = {n: p.shape for n, p in model.named_parameters()}
    plans = {name: resolve(name, shapes) for name in ("fp8-block", "bf16")}
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, args.vocab, (args.prompts, args.prompt_len), generator=g)
    ids = prompts.tolist()
    logits: dict[str, torch.Tensor] = {}
    seconds: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, plan in plans.items():
            t0 = time.perf_counter()
            out = write_served_checkpoint(
                export(model, plan), plan, model.config.to_hf(dtype="float32"), Path(tmp) / name
            )
            seconds[f"export_{name}"] = time.perf_counter() - t0
            engine = Engine(model, plan, compute_dtype=torch.bfloat16)
            tag = name.replace("-block", "")
            logits[f"mxrl_{tag}"] = engine.next_token_logits(ids).float().cpu()
            del engine
            torch.cuda.empty_cache() if device == "cuda" else None
            t0 = time.perf_counter()
            logits[f"tf_{tag}"] = tf_logits(out, prompts, device, args.dequantize and tag == "fp8")
            seconds[f"tf_load_forward_{name}"] = time.perf_counter() - t0
            if tag == "fp8":
                corrupt(out)
                logits["tf_fp8_corrupt"] = tf_logits(out, prompts, device, args.dequantize)
    result = {
        "benchmark": "served_fp8",
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "fp8_kernel": kernel or ("dequantized at load" if args.dequantize else None),
        "model": f"qwen3_moe, {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
        f"{config.num_experts} experts, vocab {config.vocab_size}, seed 0",
        "prompts": f"{args.prompts} x {args.prompt_len} random tokens (seed 1)",
        "date": time.strftime("%Y-%m-%d"),
        "fp8_tf_vs_mxrl": compare(logits["mxrl_fp8"], logits["tf_fp8"]),
        "bf16_tf_vs_mxrl": compare(logits["mxrl_bf16"], logits["tf_bf16"]),
        "mxrl_fp8_vs_bf16": compare(logits["mxrl_bf16"], logits["mxrl_fp8"]),
        "fp8_corrupt_vs_mxrl": compare(logits["mxrl_fp8"], logits["tf_fp8_corrupt"]),
        "seconds": seconds,
    }
    result["within_bound"] = within_bound(result)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return result


if __name__ == "__main__":
    raise SystemExit(0 if main()["within_bound"] else 1)
