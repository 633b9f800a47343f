"""Paged KV cache, layer by layer: the finished code behind the course notebooks.

The core bookkeeping (Block, Sequence, BlockManager, Scheduler) imports no torch. The
engine (LLM, LLMEngine, ModelRunner) is imported lazily, on first use.
"""
from course_pkg.block import Block
from course_pkg.block_manager import BlockManager, NoFreeBlocksError, compute_hash, salt_hash
from course_pkg.sampling_params import SamplingParams
from course_pkg.sequence import Sequence, SequenceStatus

__all__ = [
    "Block", "BlockManager", "NoFreeBlocksError", "compute_hash", "salt_hash",
    "SamplingParams", "Sequence", "SequenceStatus",
]  # Scheduler, LLM and LLMEngine are imported on first access (see __getattr__).

_LAZY = {
    "Scheduler": "course_pkg.scheduler",
    "LLM": "course_pkg.engine",
    "LLMEngine": "course_pkg.engine",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'course_pkg' has no attribute {name!r}")
