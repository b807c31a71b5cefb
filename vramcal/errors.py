"""The one error type a user sees: what failed and what to do next, in one line."""


class UserError(Exception):
    """Bad input or an unmet precondition. The CLI prints ``vramcal: <message>`` and exits 2."""

    exit_code = 2


class RecordedFailure(UserError):
    """A run that was recorded, then failed in a way the user must fix (a config the real load refuses,
    weights that cannot be written): not "bad input, nothing written" -- the run is in the records as
    ``error`` -- so the command exits 1, as for any run that did not finish."""

    exit_code = 1


def printable(text: str) -> str:
    """``text`` with control characters (but tabs and line ends) written as escapes: a recorded field (an
    imported model name, a host name, an error) must not move the cursor or clear the screen."""
    return "".join(ch if ch.isprintable() or ch in "\t\n" else repr(ch)[1:-1] for ch in text)
