"""Third-party chatter off the user's stderr.

Importing bitsandbytes on a CPU with AVX-512 logs "Failed to load CPU gemm_4bit_forward from
kernels-community ..."; transformers, torch and accelerate log advice and deprecations that are about
their own APIs, not about the user's request. None of it is something a vramcal user can act on, and
a one-line error must stay one line. :func:`quiet_third_party` sends those loggers' warnings and those
libraries' Python warnings nowhere; ``--debug`` leaves everything as it is.

It changes only logging levels, warning filters and ``TRANSFORMERS_VERBOSITY`` (which transformers
reads when it first configures its logger; a value the user set is kept).
"""

from __future__ import annotations

import logging
import os
import warnings

THIRD_PARTY = ("bitsandbytes", "transformers", "accelerate", "torch", "huggingface_hub", "safetensors")


def quiet_third_party() -> None:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    for name in THIRD_PARTY:
        logging.getLogger(name).setLevel(logging.ERROR)
    pattern = r"(" + "|".join(THIRD_PARTY) + r")(\..*)?$"
    warnings.filterwarnings("ignore", category=UserWarning, module=pattern)
    # warnings a library issues with stacklevel pointing at its caller name the caller's module; the
    # deprecations and future changes of those libraries are still not the user's business
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
