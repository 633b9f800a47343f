"""Paged-attention kernels (chapter 05): pure-torch references and Triton kernels.

``store_kvcache`` / ``paged_attention`` (Triton) have the same signatures and semantics as
``store_kvcache_ref`` / ``paged_attention_ref`` (pure torch); ``reference.py`` documents the
KV layout every backend shares.

Importing this package is cheap: the references need only torch. The Triton kernels live in
``course_pkg.kernels.triton_kernels`` and are imported on first access to one of their names
(that import also switches Triton to its CPU interpreter when torch sees no CUDA device).
"""
from course_pkg.kernels.reference import gather_kv, paged_attention_ref, store_kvcache_ref

__all__ = ["gather_kv", "paged_attention_ref", "store_kvcache_ref", "paged_attention", "store_kvcache"]

_TRITON_NAMES = {"store_kvcache", "paged_attention", "launch_paged_attention", "INTERPRET"}


def __getattr__(name):
    if name in _TRITON_NAMES:
        from course_pkg.kernels import triton_kernels
        return getattr(triton_kernels, name)
    raise AttributeError(f"module 'course_pkg.kernels' has no attribute {name!r}")
