"""`mxrl runs list|show|compare|note`: the run record's commands (mxrl/cli.py dispatches here;
docs/runs.md)."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(commands: argparse._SubParsersAction) -> None:
    """`mxrl runs list|show|compare|note` (the run record, docs/runs.md)."""
    runs = commands.add_parser("runs", help="list, show, compare and annotate run records")
    actions = runs.add_subparsers(dest="runs_command", required=True, metavar="ACTION")
    root_help = "folder holding the runs (default: runs)"
    ls = actions.add_parser("list", help="the runs under --root, newest first")
    show = actions.add_parser("show", help="one run: config, env, last metrics, events, notes")
    show.add_argument("run", metavar="ID", help="run id under --root (or its prefix), or a path")
    compare = actions.add_parser("compare", help="plots and a markdown table of several runs")
    compare.add_argument("runs", metavar="ID", nargs="+", help="run ids under --root, or paths")
    compare.add_argument("--out", required=True, type=Path, metavar="DIR", help="output folder")
    note = actions.add_parser("note", help="append a note to a run's notes.md")
    note.add_argument("run", metavar="ID", help="run id under --root, or a path")
    note.add_argument("text", help="the note")
    for sub in (ls, show, compare, note):
        sub.add_argument("--root", type=Path, default=Path("runs"), help=root_help)


def run(args: argparse.Namespace) -> int:
    from mxrl.runs import compare, find_runs, format_list, format_show, resolve_run

    if args.runs_command == "list":
        records = find_runs(args.root)
        print(format_list(records) if records else f"no runs under {args.root}")
    elif args.runs_command == "show":
        print(format_show(resolve_run(args.run, args.root)), end="")
    elif args.runs_command == "compare":
        records = [resolve_run(ref, args.root) for ref in args.runs]
        try:
            result = compare(records, args.out)
        except OSError as e:
            raise ValueError(f"cannot write to {str(args.out)!r}: {e}") from None
        print(result.table)
        print()
        for path in (*result.figures.values(), result.markdown):
            print(f"wrote {path}")
        if result.skipped:
            print(f"not plotted (no data): {', '.join(result.skipped)}")
    elif args.runs_command == "note":
        record = resolve_run(args.run, args.root)
        record.note(args.text)
        print(f"noted in {record.path / 'notes.md'}")
    else:
        raise AssertionError(f"unhandled runs action {args.runs_command}")
    return 0
