"""The one error type a user sees: what failed and what to do next, in one line."""


class UserError(Exception):
    """Bad input or an unmet precondition. The CLI prints ``vramcal: <message>`` and exits 2."""

    exit_code = 2
