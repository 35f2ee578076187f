"""The `mxrl` command.

    mxrl recipe list
    mxrl recipe show PRESET_OR_FILE [--model CONFIG_JSON_OR_DIR] [--expert-layout per_expert]
                     [--json]
    mxrl demo [--out DIR] [--all] [--seeds N] [--steps N] [--workers N] [--local-warmup] [--plan-only]
              [--tensorboard]
    mxrl ablate [--out DIR] [--recipes A,B] [--seeds N] [--steps N] [--lr LR] [--workers N]
                [--correction tis|mis] [--baseline DIR] [--report-only] [--tiny]
    mxrl train --config FILE [--tensorboard]
    mxrl convert --recipe RECIPE --model HF_DIR --out DIR [--to mxrl|hf] [--shard-size 2GB]
                 [--overwrite] [--allow-unmatched]
    mxrl --version

User errors (a bad recipe, a bad config, a bad path) print one `mxrl: error:` line on stderr
and exit with code 2, before anything is written; a bug still shows its traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from mxrl import __version__

DEMO_PRESET = "nvfp4-dequantized"
EXIT_USAGE = 2
TENSORBOARD_HELP = ("also write each run's metrics, events and plan audit as TensorBoard files "
                    "under runs/<id>/tensorboard/ (needs the tensorboard package)")  # fmt: skip


class UserError(Exception):
    """An error the user can fix; printed without a traceback."""


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mxrl",
        description="Low-precision (MXFP8, NVFP4, block FP8) RL for mixture-of-experts LMs.",
    )
    parser.add_argument("--version", action="version", version=f"mxrl {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    recipe = commands.add_parser("recipe", help="inspect precision recipes and their plans")
    recipe_commands = recipe.add_subparsers(dest="recipe_command", required=True, metavar="ACTION")
    recipe_commands.add_parser("list", help="the built-in presets")
    show = recipe_commands.add_parser(
        "show", help="resolve a recipe on a model: audit table and plan hash"
    )
    show.add_argument("recipe", metavar="PRESET_OR_FILE", help="preset name or recipe YAML path")
    show.add_argument(
        "--model",
        metavar="CONFIG_JSON_OR_DIR",
        help="HF config.json (or its folder); default: the built-in tiny-moe model",
    )
    show.add_argument(
        "--expert-layout",
        choices=("fused", "per_expert"),
        default="fused",
        help="routed expert tensor names: fused 3-D (default: what mxrl's models hold, so the "
        "plan hash is the one convert and train use) or per expert (published checkpoints)",
    )
    show.add_argument("--json", action="store_true", help="print the plan as JSON")

    demo = commands.add_parser(
        "demo", help="GRPO on the embedded task under bf16, mxfp8 and nvfp4; writes a report"
    )
    demo.add_argument("--out", metavar="DIR", type=Path, default=None,
                      help="where runs/ and report.md go (default: ./demo); with --plan-only, "
                           "where plan.json and audit.txt go (default: nowhere)")  # fmt: skip
    demo.add_argument("--all", action="store_true", help="the six article presets")
    demo.add_argument("--seeds", type=int, default=3, help="seeds per recipe (default 3)")
    demo.add_argument("--steps", type=int, default=None, help="GRPO steps per run (default 140)")
    demo.add_argument("--local-warmup", action="store_true",
                      help="train the SFT warm-up on this machine instead of loading the shipped one "
                           "(its end point depends on the processor)")  # fmt: skip
    demo.add_argument("--workers", type=int, default=None,
                      help="runs trained at once, one process each (default: one per CPU core; "
                           "on a GPU they share it)")  # fmt: skip
    demo.add_argument("--plan-only", action="store_true",
                      help="only print the nvfp4-dequantized plan of the tiny model (and write "
                           "it to --out)")  # fmt: skip
    demo.add_argument("--tensorboard", action="store_true", help=TENSORBOARD_HELP)

    from mxrl.app import ablate_cli  # argparse only, as runs' below

    ablate_cli.add_parser(commands)
    train = commands.add_parser("train", help="a GRPO run from a YAML config (mxrl/app/train.py)")
    train.add_argument("--config", required=True, type=Path, metavar="FILE")
    train.add_argument("--tensorboard", action="store_true",
                       help=TENSORBOARD_HELP + " (as log.tensorboard: true in the config)")  # fmt: skip

    _add_convert_parser(commands)
    from mxrl.runs import cli as runs_cli  # argparse only: the record loads when a command runs

    runs_cli.add_parser(commands)
    return parser


def _add_convert_parser(commands: argparse._SubParsersAction) -> None:
    convert = commands.add_parser(
        "convert", help="HF checkpoint -> quantized checkpoint (the bytes the engine holds)"
    )
    convert.add_argument(
        "--recipe", help="preset name or recipe YAML path (default for a run: the run's own)"
    )
    convert.add_argument(
        "--model",
        required=True,
        metavar="HF_DIR|RUN_DIR",
        help="an HF checkpoint directory, or a run folder (runs/<id>): its newest checkpoint's "
        "policy, checked against the engine the run rolled out with",
    )
    convert.add_argument("--out", required=True, metavar="DIR", type=Path, help="output directory")
    convert.add_argument(
        "--shard-size", default="2GB", help="bytes per safetensors shard (default 2GB; or 500MiB)"
    )
    convert.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    convert.add_argument(
        "--to",
        choices=("mxrl", "hf"),
        default="mxrl",
        help="mxrl: mxrl's quantized checkpoint (default); hf: a served checkpoint that "
        "transformers, vLLM and SGLang load (HF fine-grained FP8 or compressed-tensors, the "
        "same codes and scales; docs/checkpoints.md)",
    )
    convert.add_argument(
        "--allow-unmatched",
        action="store_true",
        help="convert even if a recipe rule matches no tensor or the recipe quantizes nothing",
    )


def _cmd_recipe_list() -> int:
    from mxrl.recipe import list_presets, load_recipe

    recipes = [load_recipe(name) for name in list_presets()]
    width = max(len(r.name) for r in recipes)
    bwidth = max(len(r.backward.value) for r in recipes)
    print(f"{'preset':<{width}}  {'backward':<{bwidth}}  description")
    for r in recipes:
        print(f"{r.name:<{width}}  {r.backward.value:<{bwidth}}  {r.description}")
    return 0


def _resolve_on(recipe: str, model: str | None, expert_layout: str):
    from mxrl.arch import builtin_config, tensors_from_hf_config
    from mxrl.recipe import resolve

    if model is None:
        config, label = builtin_config("tiny-moe"), "built-in tiny-moe (pass --model for another)"
    else:
        config, label = model, model
    tensors = tensors_from_hf_config(config, expert_layout=expert_layout)
    return resolve(recipe, tensors), label


def _cmd_recipe_show(args: argparse.Namespace) -> int:
    plan, label = _resolve_on(args.recipe, args.model, args.expert_layout)
    _warn_problems(plan)
    if args.json:
        print(plan.to_json(indent=2))
        return 0
    print(f"recipe: {plan.recipe_name} (backward: {plan.backward.value})")
    print(f"model: {label}, expert layout {args.expert_layout}")
    print()
    print(plan.table())
    print(f"plan hash: {plan.hash()}")
    if plan.problems:
        print(f"\nWARNING: {len(plan.problems)} problem(s), see above; convert and train refuse it")
    return 0


def _warn_problems(plan) -> None:
    """A plan that does not do what its recipe says, on stderr before anything else."""
    for problem in plan.problems:
        print(f"mxrl: warning: {problem}", file=sys.stderr)


def _cmd_demo(args: argparse.Namespace) -> int:
    if args.plan_only:
        return _demo_plan_only(args.out)
    from mxrl.app.demo import ARTICLE_RECIPES, DEMO_RECIPES, run_demo

    if args.seeds < 1:
        raise UserError(f"--seeds must be >= 1, got {args.seeds}")
    if args.workers is not None and args.workers < 1:
        raise UserError(f"--workers must be >= 1, got {args.workers}")
    if args.steps is not None and args.steps < 1:
        raise UserError(f"--steps must be >= 1, got {args.steps}")
    if args.tensorboard:
        from mxrl.runs.tensorboard import require_tensorboard

        require_tensorboard("--tensorboard")  # before --out is created
    out = args.out if args.out is not None else Path("demo")
    _writable_dir(out, "--out")
    _progress_logging()
    recipes = ARTICLE_RECIPES if args.all else DEMO_RECIPES
    report = run_demo(
        out,
        recipes=recipes,
        seeds=args.seeds,
        steps=args.steps,
        workers=args.workers,
        local_warmup=args.local_warmup,
        tensorboard=args.tensorboard,
    )
    print(f"mxrl demo: report at {report}")
    return 0


def _cmd_ablate(args: argparse.Namespace) -> int:
    from mxrl.app import ablate_cli

    recipes = ablate_cli.checked(args)  # arguments and the GPU: before --out is created
    _writable_dir(args.out, "--out")
    _progress_logging()
    print(f"mxrl ablate: report at {ablate_cli.run(args, recipes)}")
    return 0


def _demo_plan_only(out: Path | None) -> int:
    """The demo's plan of the tiny model, printed; with `out`, plan.json and audit.txt there."""
    if out is not None:
        _writable_dir(out, "--out")  # before the recipe room (and torch) is imported
    plan, _ = _resolve_on(DEMO_PRESET, None, "fused")
    print(f"mxrl demo: the {DEMO_PRESET} plan of the built-in tiny-moe model\n")
    audit = f"{plan.table()}\nplan hash: {plan.hash()}\n"
    print(audit, end="")
    if out is not None:
        (out / "plan.json").write_text(plan.to_json(indent=2) + "\n")
        (out / "audit.txt").write_text(audit)
        print(f"wrote {out / 'plan.json'} and {out / 'audit.txt'}")
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from mxrl.app.preflight import preflight
    from mxrl.rl.config import TrainConfig

    _progress_logging()
    config = TrainConfig.load(args.config)  # the schema: before torch is imported
    if args.tensorboard:
        config = replace(config, log=replace(config.log, tensorboard=True))
    checked = preflight(config)  # paths, device, plan, resume: before the trainer's imports
    from mxrl.app.train import run_train

    record = run_train(config, checked)
    if record is not None:  # under torchrun, rank 0 holds the run record
        print(f"mxrl train: run record at {record.path}")
    return 0


def _writable_dir(path: Path, flag: str) -> None:
    """Create `path` (and parents) and prove it writable, before any work is done."""
    from mxrl.runs.record import check_writable

    check_writable(path, flag)  # refuses a file in the path before creating anything
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".mxrl-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise UserError(
            f"{flag} {str(path)!r} is not a writable directory ({e.strerror or e}); "
            "pass a folder you can write to"
        ) from None


def _progress_logging() -> None:
    """Step-by-step progress of the loop on stderr, and what the app says on the way (the plan's
    summary, the memory estimate, the warm-up, the dataset's rows); the sync room's per-export
    lines stay quiet."""
    for room in ("mxrl.rl", "mxrl.app"):
        logging.getLogger(room).setLevel(logging.INFO)
    logging.getLogger().handlers[0].setFormatter(logging.Formatter("%(asctime)s %(message)s"))


def _cmd_convert(args: argparse.Namespace) -> int:
    from mxrl.runs.record import check_writable

    check_writable(args.out, "--out")  # a file in the path, an unwritable folder: before work
    if not args.overwrite and args.out.is_dir() and any(args.out.iterdir()):
        raise UserError(
            f"--out {str(args.out)!r} is a folder with files in it; pass --overwrite to replace "
            "it, or a new folder"
        )
    from mxrl.app.policy import convert_run, is_run_dir
    from mxrl.weights.convert import convert_checkpoint, summary_lines

    def announce(plan) -> None:
        print(
            f"mxrl convert: {args.model} under recipe {plan.recipe_name}, plan {plan.hash()[:12]}"
        )
        print(plan.summary(), flush=True)
        _warn_problems(plan)

    if is_run_dir(args.model):
        out = convert_run(
            args.model,
            args.out,
            say=print,
            recipe=args.recipe,
            to=args.to,
            shard_bytes=args.shard_size,
            overwrite=args.overwrite,
            strict=not args.allow_unmatched,
            on_plan=announce,
        )
        print("\n".join(summary_lines(out)))
        return 0
    if args.recipe is None:
        raise UserError(f"--recipe is required for an HF checkpoint ({args.model})")
    out = convert_checkpoint(
        args.model,
        args.recipe,
        args.out,
        shard_bytes=args.shard_size,
        overwrite=args.overwrite,
        strict=not args.allow_unmatched,
        on_plan=announce,
        to=args.to,
        on_fp8_source=lambda report: print(f"mxrl convert: {report.line()}", flush=True),
    )
    print(f"mxrl convert: {args.model} -> {out}" + (" (served checkpoint)" * (args.to == "hf")))
    print("\n".join(summary_lines(out)))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `mxrl` console script; returns the exit code."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    parser = _build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version, usage errors: argparse already printed
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    try:
        if args.command == "recipe" and args.recipe_command == "list":
            return _cmd_recipe_list()
        if args.command == "recipe" and args.recipe_command == "show":
            return _cmd_recipe_show(args)
        if args.command == "demo":
            return _cmd_demo(args)
        if args.command == "ablate":
            return _cmd_ablate(args)
        if args.command == "train":
            return _cmd_train(args)
        if args.command == "convert":
            return _cmd_convert(args)
        if args.command == "runs":
            from mxrl.runs import cli as runs_cli

            return runs_cli.run(args)
    except (ValueError, UserError) as e:
        print(f"mxrl: error: {_one_line(e)}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:  # `mxrl recipe show ... | head`
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - keeps the interpreter's flush quiet
        return 0
    except KeyboardInterrupt:
        print("mxrl: interrupted (Ctrl-C)", file=sys.stderr)
        return 130
    except BaseException as e:
        from mxrl.runs import RunInterrupted

        if not isinstance(e, RunInterrupted):
            raise
        print(f"mxrl: {e}; the run record says so", file=sys.stderr)
        return 128 + 15  # SIGTERM
    raise AssertionError(f"unhandled command {args}")


def _one_line(error: Exception) -> str:
    """The message on one line (an error may list several problems, one per line)."""
    lines = (line.strip().removeprefix("- ") for line in str(error).splitlines())
    return "; ".join(line for line in lines if line)


if __name__ == "__main__":
    sys.exit(main())
