"""Triton kernels for compressed MoE layouts (installed as ``moecompress.kernels``).

Empty for now: kernels arrive with the layouts they serve. Importing ``moecompress`` never imports
this package or triton.
"""
