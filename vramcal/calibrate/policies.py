"""The orders of adjustment ``check`` can propose (explained in ``vramcal check --help`` and in
:mod:`vramcal.calibrate.check`). A module of its own so the command line can offer the choices without
importing the estimator at start-up."""

POLICIES = ("quality", "context", "throughput")
