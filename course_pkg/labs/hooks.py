"""The private members of the package that the labs rely on -- the one list to adapt.

The graders use only public calls and public state. But a stub must leave out exactly the
body a chapter teaches, and some of those bodies are private steps of a public call (the
prefix lookup inside ``can_allocate``/``allocate``, the stale-entry guard inside the block
hand-out), so some stubs, mutants and solution listings name private members. They are all
here; ``tests/test_labs.py`` checks that each still exists and that no lab module names a
private member of the package that is not listed.
"""
from __future__ import annotations

#: (owner path, member) -> where the labs use it
PRIVATE_MEMBERS: dict[tuple[str, str], str] = {
    ("course_pkg.block_manager:BlockManager", "_match_prefix"):
        "stubs.StudentPrefixBlockManager, StudentAllocateBlockManager (docstring); mutants "
        "NoTokenCheckBlockManager, LastBlockHitBlockManager; solution of prefix_caching",
    ("course_pkg.block_manager:BlockManager", "_maybe_evict_cached_block"):
        "stubs.StudentGuardBlockManager; mutants.UnconditionalEvictBlockManager; solution of stale_entry_guard",
    ("course_pkg.block_manager:BlockManager", "_allocate_block"):
        "stub docstrings (append, allocate); mutants ModuloOneBlockManager, NoRoomCheckBlockManager; "
        "solution of stale_entry_guard",
    ("course_pkg.block_manager:BlockManager", "_blocks_to_append"): "solution of append",
    ("course_pkg.scheduler:Scheduler", "_schedule_prefill"): "mutants.DecodeFirstScheduler; solution of scheduler",
    ("course_pkg.scheduler:Scheduler", "_schedule_decode"):
        "mutants PreemptOldestScheduler (a copy with one change), DecodeFirstScheduler; solution of scheduler",
    ("course_pkg.kernels.triton_kernels", "_store_kvcache_kernel"): "solution of store_kvcache",
    ("course_pkg.kernels.triton_kernels", "_block_and_offset"): "solution of paged_attention",
    ("course_pkg.kernels.triton_kernels", "_online_softmax_step"): "solution of paged_attention",
    ("course_pkg.kernels.triton_kernels", "_paged_attention_kernel"): "solution of paged_attention",
}
