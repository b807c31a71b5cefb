"""A Ctrl-C is never lost.

Python turns SIGINT into ``KeyboardInterrupt`` wherever the main thread happens to be, and some places
swallow it: a C extension's initialisation that clears the error of an import it tried (torch's numpy
probe does), a ``__del__`` or weakref callback ("Exception ignored in ..."), a library's bare
``except:``. The command then goes on and answers as if nothing had happened (seen once in CI: an
estimate interrupted while torch was imported printed its answer and exited 0).

:func:`sigint_noted` notes every SIGINT before it raises as usual. Code that sees a failure can ask
whether an interrupt caused it (a Ctrl-C inside an import leaves a module half made, and the import
error that follows is the interrupt, not a missing library); and a body that ends normally although a
SIGINT was noted inside it raises ``KeyboardInterrupt`` on leaving, so the interrupt still ends the
command. Main thread only: elsewhere Python installs no signal handlers.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def sigint_noted() -> Iterator[Callable[[], bool]]:
    """Note each SIGINT while the body runs; yields ``interrupted()`` (whether one was noted). The
    handler that was installed still runs (so it raises ``KeyboardInterrupt`` as usual, or does what an
    outer :func:`sigint_noted` or a probe installed). After a noted SIGINT the body cannot end as if
    nothing had happened: ending normally raises ``KeyboardInterrupt``, and so does an ordinary exception
    (an import the Ctrl-C tore apart fails next; transformers reports "Could not import module ..." for
    it); a ``KeyboardInterrupt`` of the body's own (a probe's ``ProbeInterrupted``) passes unchanged.

    An ignored SIGINT (``nohup``, ``cmd &`` in a script, a supervisor) stays ignored: nothing is installed,
    so children started in the body inherit it ignored too."""
    old = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or old == signal.SIG_IGN:
        yield lambda: False
        return
    seen: list[int] = []

    def note(signum, frame):
        seen.append(signum)
        if callable(old):
            old(signum, frame)
        else:  # SIG_DFL, or a handler not installed from Python: stop as usual
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, note)
    try:
        yield lambda: bool(seen)
    except Exception:
        if seen:  # the failure came after the interrupt (and most likely of it): it is the interrupt
            raise KeyboardInterrupt from None
        raise
    finally:
        signal.signal(signal.SIGINT, old)
    if seen:  # the body went on although interrupted: something swallowed the KeyboardInterrupt
        raise KeyboardInterrupt
