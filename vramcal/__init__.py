"""vramcal: predict, measure and calibrate the GPU memory of quantized language models.

The four units of the design card are subpackages:

- :mod:`vramcal.estimator` -- arithmetic of memory, from a model's config alone;
- :mod:`vramcal.probes`    -- touching the device (NVML sampler, the load-and-generate child);
- :mod:`vramcal.records`   -- persistence (SQLite, or PostgreSQL for a fleet);
- :mod:`vramcal.calibrate` -- the loop: reconcile, record, correct, check, fit, memos.

The command line (:mod:`vramcal.cli`, :mod:`vramcal.present`) sits on top; nothing imports it.

Data flows one way: config -> estimate -> probe -> reconcile -> record -> corrected estimate.
"""

__version__ = "0.1.0"
