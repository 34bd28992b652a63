"""Ctrl-C while a run trains stops it between two steps, never inside one.

Why: a KeyboardInterrupt raised wherever the main thread happens to be can be lost. orbax saves a
checkpoint with ``asyncio``, whose runner, finding Python's default SIGINT handler, installs its
own: Ctrl-C then cancels the save's task, orbax's wrapper turns the cancellation into a normal
return, and the run trained on to its end and exited 0 (seen in the suite on a busy 2-core host,
where saves take longest). Inside :func:`between_steps` SIGINT is only noted; the loop calls
``check()`` after each step (and its checkpoint, when one is due), which raises the
KeyboardInterrupt there. A second Ctrl-C raises at once. Outside training (loading, compiling,
calibrating) Ctrl-C acts at once, as Python's default does.
"""

from __future__ import annotations

import contextlib
import signal
import threading


class StepInterrupts:
    """Whether Ctrl-C was pressed since training began."""

    def __init__(self):
        self.requested = False

    def check(self) -> None:
        """Raises KeyboardInterrupt when Ctrl-C was pressed (call it between steps)."""
        if self.requested:
            raise KeyboardInterrupt


@contextlib.contextmanager
def between_steps():
    """SIGINT noted, not raised, until ``check()``; only in the main thread and only where
    SIGINT has Python's default handler (a shell's background job, which ignores SIGINT,
    stays ignoring it)."""
    interrupts = StepInterrupts()
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield interrupts
        return

    def noted(signum, frame):
        if interrupts.requested:  # pressed twice: now
            raise KeyboardInterrupt
        interrupts.requested = True

    signal.signal(signal.SIGINT, noted)
    try:
        yield interrupts
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
