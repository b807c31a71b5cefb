"""Signals noted through one mechanism, :func:`vramcal.interrupts.noted`: the command's Ctrl-C, the
probe's SIGTERM, a signal held while a probe cleans up."""

from __future__ import annotations

import os
import signal
import time

import pytest

from vramcal import interrupts
from vramcal.interrupts import Terminated, noted
from vramcal.probes.lifecycle import signals_held, sigterm_raises


@pytest.fixture
def python_sigint():
    """SIGINT raises KeyboardInterrupt here, as in a terminal (a suite started in the background of a
    non-interactive shell has it ignored); put back after."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


# ------------------------------------------------------------------------------------ the mechanism

def test_a_held_signal_waits_and_is_asked_for():
    """signals_held: noted, nothing raised, the caller asks; both handlers come back."""
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with signals_held() as late:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0)
    assert late.name == "SIGTERM" and late.signals == [signal.SIGTERM, signal.SIGINT]
    with pytest.raises(Terminated):
        late.check()
    assert {s: signal.getsignal(s) for s in before} == before


def test_the_command_and_the_probe_note_through_one_mechanism(python_sigint):
    """sigint_noted (raise on leaving) and sigterm_raises (the caller asks) are uses of noted(): a swallowed
    SIGINT ends the body as KeyboardInterrupt on leaving; a swallowed SIGTERM is there to ask for."""
    with pytest.raises(KeyboardInterrupt):
        with interrupts.sigint_noted() as interrupted:
            try:
                signal.raise_signal(signal.SIGINT)
            except KeyboardInterrupt:
                pass
            assert interrupted()
    with sigterm_raises() as terminated:
        try:
            signal.raise_signal(signal.SIGTERM)
        except Terminated:
            pass
    assert terminated.name == "SIGTERM"
    with noted(signal.SIGTERM, leaving="raise") as plain:  # nothing noted: nothing raised
        pass
    assert not plain()
