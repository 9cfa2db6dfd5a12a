"""Fused kernels (Triton): append into the compressed cache and decode attention over it."""
