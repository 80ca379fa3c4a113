"""Weight formats and the matmuls that read them.

A stage keeps a checkpoint's weights in the form the file stores them (GGUF blocks stay packed);
each weight type has one plain reference dequantize and one or more fast kernels that consume the
packed form directly, tested against the reference. Nothing here knows of stages, requests or
processes.
"""
