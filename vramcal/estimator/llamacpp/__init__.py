"""The llama.cpp engine: what llama.cpp allocates loading a GGUF, buffer by buffer, per device, for its
flags in its own spellings (docs/llamacpp.md). :mod:`.gguf_file` reads the header, :mod:`.buffers`
prices the model, KV, output and compute buffers, :mod:`.logparse` reads llama.cpp's own lines back."""
