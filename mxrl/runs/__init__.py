"""The run record: config, plan, environment, metrics, events, notes; run comparison reports.

    from mxrl.runs import RunRecord, compare
    rec = RunRecord.create("runs", config=cfg, plan_json=plan.to_json(), backend=backend)
    rec.log_metrics(step, metrics)
    compare(["runs/a", "runs/b"], "reports/ab")

docs/runs.md has the layout, every file's schema and the `mxrl runs` command.
"""

from mxrl.runs.env import capture_env
from mxrl.runs.record import (
    END,
    FAILED,
    FINISHED,
    INTERRUPTED,
    NOTE,
    QUANTIZATION,
    RESUME,
    SKIPPED_ROWS,
    SPIKE,
    SYNC_VERIFIED,
    RunInterrupted,
    RunRecord,
    is_run_dir,
    new_run_id,
)
from mxrl.runs.report import Comparison, compare, comparison_table
from mxrl.runs.summary import METRIC_KEYS, RunSummary, find_runs, resolve_run, summarize
from mxrl.runs.texts import format_list, format_show

__all__ = [
    "END",
    "FAILED",
    "FINISHED",
    "INTERRUPTED",
    "METRIC_KEYS",
    "NOTE",
    "QUANTIZATION",
    "RESUME",
    "SKIPPED_ROWS",
    "SPIKE",
    "SYNC_VERIFIED",
    "Comparison",
    "RunInterrupted",
    "RunRecord",
    "RunSummary",
    "capture_env",
    "compare",
    "comparison_table",
    "find_runs",
    "format_list",
    "format_show",
    "is_run_dir",
    "new_run_id",
    "resolve_run",
    "summarize",
]
