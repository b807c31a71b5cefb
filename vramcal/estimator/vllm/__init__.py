"""vLLM as a second engine: what ``vllm serve`` will log at startup -- weights, the activation peak of its
profiling run, non-torch and CUDA-graph memory, the available KV memory, blocks, "GPU KV cache size: N
tokens", the maximum concurrency, whether ``--max-model-len`` fits -- per GPU of ``tp x pp``, before
launching it (docs/vllm.md).

Modules: :mod:`.versions` (what differs between vLLM versions, as data), :mod:`.arch` (what vLLM reads
from a config), :mod:`.shapes` (the model's parameters and their parallel roles: the one torch step),
:mod:`.quant`, :mod:`.mxfp4` and :mod:`.layout` (weights per rank; MXFP4 experts by kernel backend),
:mod:`.kv` (page sizes, blocks, tokens), :mod:`.mamba` (hybrid models' state pages and the page unification),
:mod:`.budget` (activation, non-torch, CUDA graphs), :mod:`.messages` (vLLM's lines and errors),
:mod:`.engine` (putting them together), :mod:`.fit` (the largest length, the utilization needed),
:mod:`.logparse` (reading a startup log back), :mod:`.result` (the typed result). vLLM itself is never
imported here.
"""
