"""`mxrl ablate`'s arguments (argparse only: nothing heavy is imported until the command runs)
and their checks; `mxrl/cli.py` dispatches, mxrl.app.ablate does the work."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(commands: argparse._SubParsersAction) -> None:
    ablate = commands.add_parser(
        "ablate",
        help="the article's six recipes and NVFP4 4over6 x 3 seeds on a 113M MoE, one GPU (report)",
    )
    ablate.add_argument(
        "--out",
        metavar="DIR",
        type=Path,
        default=Path("ablate"),
        help="where runs/, report.md and the figures go (default: ./ablate)",
    )
    ablate.add_argument(
        "--recipes",
        default=None,
        metavar="A,B",
        help="comma-separated presets (default: the article's six and nvfp4-4over6-hp)",
    )
    ablate.add_argument("--seeds", type=int, default=3, help="seeds per recipe (default 3)")
    ablate.add_argument(
        "--steps",
        type=int,
        default=None,
        help="GRPO steps per run (default: docs/ablation.md's settings)",
    )
    ablate.add_argument(
        "--lr",
        type=float,
        default=None,
        help="GRPO's AdamW learning rate, held for half the run then decayed to a fifth "
        "(default: docs/ablation.md's settings)",
    )
    ablate.add_argument(
        "--workers",
        type=int,
        default=None,
        help="runs at once, one process each (default: all of them; --tiny: 1)",
    )
    ablate.add_argument(
        "--correction",
        choices=("tis", "mis"),
        default=None,
        help="rollout correction in every run (default: none, as the article)",
    )
    ablate.add_argument("--baseline", metavar="DIR", type=Path, default=None,
                        help="an earlier ablation's --out: its BF16 runs are this report's "
                             "baseline (for TIS / MIS reruns of one recipe)")  # fmt: skip
    ablate.add_argument("--report-only", action="store_true",
                        help="write report.md and the figures again from the run records under "
                             "--out/runs (an interrupted call's, say); trains nothing")  # fmt: skip
    ablate.add_argument("--tiny", action="store_true",
                        help="the whole pipeline on the CPU in seconds with the tiny model (a "
                             "test of the code path; its numbers mean nothing)")  # fmt: skip


def checked(args: argparse.Namespace) -> tuple[str, ...]:
    """The recipes to run; ValueError (one `mxrl: error:` line) for a bad argument, and without
    a GPU unless --tiny: all before anything is written."""
    from mxrl.app.ablate import ABLATION_RECIPES, baseline_runs, require_gpu
    from mxrl.recipe import list_presets

    for flag in ("seeds", "steps", "workers"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ValueError(f"--{flag} must be >= 1, got {value}")
    if args.lr is not None and not 0.0 < args.lr < 1.0:  # NaN fails both
        raise ValueError(f"--lr must be in (0, 1), got {args.lr}")
    recipes = ABLATION_RECIPES
    if args.recipes is not None:
        recipes = tuple(name.strip() for name in args.recipes.split(",") if name.strip())
        unknown = [name for name in recipes if name not in list_presets()]
        if len(set(recipes)) != len(recipes):
            raise ValueError(f"--recipes {args.recipes!r} names a preset twice; name each once")
        if unknown or not recipes:
            raise ValueError(
                f"--recipes {args.recipes!r}: unknown preset(s) {unknown}; the presets are "
                f"{', '.join(list_presets())} (mxrl recipe list)"
            )
    if args.report_only and not (args.out / "runs").is_dir():
        raise ValueError(f"--report-only: {str(args.out / 'runs')!r} is not a folder of runs")
    if args.baseline is not None:
        baseline_runs(args.baseline)  # reads only
    if not (args.tiny or args.report_only):
        require_gpu()
    return recipes


def run(args: argparse.Namespace, recipes: tuple[str, ...]) -> Path:
    from mxrl.app.ablate import TINY, rewrite_report, run_ablation

    if args.report_only:
        return rewrite_report(args.out, TINY if args.tiny else None)

    return run_ablation(
        args.out, recipes=recipes, seeds=args.seeds, steps=args.steps, lr=args.lr,
        workers=args.workers,
        correction=args.correction, tiny=args.tiny, baseline=args.baseline,
    )  # fmt: skip
