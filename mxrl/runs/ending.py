"""How a run ends (`RunRecord` takes these methods from `RunEnding`): `finish` writes the
`end` event with the run's status; `guard` records one for every way out of a block (an
exception, Ctrl-C, SIGTERM). docs/runs.md has the event's fields.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import traceback
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mxrl.runs.record import RunRecord

END = "end"

# how a run ended (the END event's status)
FINISHED, FAILED, INTERRUPTED = "finished", "failed", "interrupted"


class RunInterrupted(BaseException):
    """SIGTERM inside `RunRecord.guard` (a BaseException, like KeyboardInterrupt, so that no
    `except Exception` on the way swallows it)."""

    def __init__(self, signal_name: str) -> None:
        super().__init__(f"interrupted by {signal_name}")
        self.signal_name = signal_name


class RunEnding:
    """How `RunRecord` ends (it provides log_event, sinks and _ended)."""

    def finish(self, step: int | None, status: str = FINISHED, **fields: Any) -> dict[str, Any]:
        """The run ended: status "finished", "failed" (with `error`) or "interrupted" (with
        `signal`); `mxrl runs list` shows it. Written once per process (`guard`); closes the
        sinks."""
        self._ended = True
        event = self.log_event(END, step, status=str(status), **fields)
        sinks, self.sinks = self.sinks, []
        for sink in sinks:
            sink.close()
        return event

    @contextlib.contextmanager
    def guard(self, step: Callable[[], int | None]) -> Iterator[RunRecord]:
        """Every way out of the block ends in a recorded state: an exception is recorded as
        `failed` (its type, message and traceback tail, at `step()`), Ctrl-C and SIGTERM as
        `interrupted`; then it propagates. SIGTERM raises `RunInterrupted` inside the block
        (main thread only). A block that already recorded an end (an inner guard, or
        `finish`) is left as it is. SIGKILL cannot be caught: such a run has no end event and
        `mxrl runs list` shows it `unfinished` once its process is gone."""
        previous = None
        if threading.current_thread() is threading.main_thread():

            def on_sigterm(signum, frame):
                raise RunInterrupted("SIGTERM")

            previous = signal.signal(signal.SIGTERM, on_sigterm)
        try:
            yield self
        except (KeyboardInterrupt, RunInterrupted) as e:
            if not self._ended:
                name = e.signal_name if isinstance(e, RunInterrupted) else "SIGINT"
                self.finish(_safe_step(step), INTERRUPTED, signal=name)
            raise
        except Exception as e:
            if not self._ended:
                tail = traceback.format_exception(type(e), e, e.__traceback__)[-12:]
                self.finish(
                    _safe_step(step),
                    FAILED,
                    error=f"{type(e).__name__}: {e}"[:2000],
                    traceback="".join(tail)[-4000:],
                )
            raise
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)


def _safe_step(step: Callable[[], int | None]) -> int | None:
    try:
        return step()
    except Exception:  # the step counter of a half-built run: record the end without it
        return None
