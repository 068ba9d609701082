"""Triton kernels for compressed MoE layouts (installed as ``moecompress.kernels``).

One file per kernel, each with its ``@triton.jit`` function(s), its launcher and the plain-PyTorch
reference it is tested against (``docs/kernels.md``): ``moe_align`` (K1 routing metadata),
``grouped_gemm`` (K2 dense/ragged experts, fused SwiGLU), ``combine`` (K5 weighted top-k sum),
``dispatch`` (``prepare_triton``: a bank's layouts -> a prepared kernel path), ``_launch`` (launch-time
checks). Importing this package imports nothing: triton is imported only inside the launchers, so
``import moecompress`` never needs it.
"""
