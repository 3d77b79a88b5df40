"""Progress on a long step: a bar on a terminal, one line per phase otherwise.

Building a manifest, making a tiny model and running the doctor take tens
of seconds; silence that long reads as a hang. On a terminal each phase
gets a tqdm bar that clears itself when the phase ends; in a log (a pipe,
a file, CI) each phase is one line and the end is one line with the time
it took, so logs stay short and greppable.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from types import TracebackType
from typing import TextIO

from tqdm import tqdm

__all__ = ["Progress"]


class Progress:
    """The progress of one task (`with Progress("manifest build") as p:`)."""

    def __init__(
        self,
        task: str,
        *,
        stream: TextIO | None = None,
        emit: Callable[[str], None] | None = None,
    ) -> None:
        """`stream` (default stderr) gets the bar on a terminal; `emit`
        (default: a line on `stream`) gets the lines otherwise."""
        self.task = task
        self._stream = stream or sys.stderr
        self._interactive = emit is None and self._stream.isatty()
        self._emit = emit or (lambda line: print(line, file=self._stream, flush=True))
        self._bar: tqdm[None] | None = None
        self._began = time.monotonic()

    def phase(self, name: str, total: int | None = None) -> None:
        """Start a phase; `total` steps of it will be `advance`d."""
        self._end_bar()
        if self._interactive:
            self._bar = tqdm(
                total=total, desc=f"{self.task}: {name}", file=self._stream, leave=False
            )
        else:
            self._emit(f"{self.task}: {name}" + (f" ({total})" if total else ""))

    def advance(self, steps: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(steps)

    def close(self) -> None:
        self._end_bar()
        self._emit(f"{self.task}: done in {time.monotonic() - self._began:.1f} s")

    def _end_bar(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if kind is None:
            self.close()
        else:
            self._end_bar()
