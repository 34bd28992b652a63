"""Ctrl-C stops a run between two steps (dpbench/run/interrupts.py): noted while training, raised
by the loop's check, never lost inside a checkpoint save's asyncio loop."""

import asyncio
import os
import signal

import pytest

from dpbench.run import interrupts


@pytest.fixture(autouse=True)
def default_sigint():
    """Each test starts from Python's default Ctrl-C handling, as a run started from a
    terminal does (a test process may hold another), and leaves the process as it was."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


async def _a_save_that_swallows_its_cancellation():
    """What orbax's save does: an asyncio task that turns a cancellation into a normal return
    (orbax/_src/asyncio_utils.py), here with Ctrl-C pressed in the middle of it."""
    try:
        os.kill(os.getpid(), signal.SIGINT)
        await asyncio.sleep(0.2)
    except asyncio.CancelledError:
        return None


def test_ctrl_c_during_training_is_raised_at_the_next_check_and_twice_at_once():
    with interrupts.between_steps() as ctrl_c:
        signal.raise_signal(signal.SIGINT)  # no KeyboardInterrupt here: inside a step
        with pytest.raises(KeyboardInterrupt):
            ctrl_c.check()
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)  # pressed again: at once
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_ctrl_c_inside_a_checkpoint_saves_asyncio_loop_is_not_lost():
    """The cause of a run that went on to its end after Ctrl-C: asyncio's runner installs its
    own SIGINT handler, which cancels the save, which swallows the cancellation (the twin
    below, Python's default handling). Noted by between_steps, the check raises it."""
    with interrupts.between_steps() as ctrl_c:
        asyncio.run(_a_save_that_swallows_its_cancellation())
        with pytest.raises(KeyboardInterrupt):
            ctrl_c.check()
    try:  # the twin, Python's default handling: the Ctrl-C is lost
        asyncio.run(_a_save_that_swallows_its_cancellation())
        lost = True
    except KeyboardInterrupt:
        lost = False
    assert lost, "asyncio no longer loses this Ctrl-C: the cause documented here changed"


def test_an_ignored_sigint_stays_ignored():
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with interrupts.between_steps() as ctrl_c:
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        signal.raise_signal(signal.SIGINT)
        ctrl_c.check()  # nothing was noted
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
