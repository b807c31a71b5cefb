"""Ground truth for the tests: what a really loaded model and a really filled cache hold.

The counting is the probe child's own (``vramcal.probes.child``): the same code measures in the field
and in the tests, and the tests check it against estimates built by entirely separate code.
"""

from vramcal.probes.child import cache_bytes, held_weight_storages

held_tensors = held_weight_storages

__all__ = ["cache_bytes", "held_tensors"]
