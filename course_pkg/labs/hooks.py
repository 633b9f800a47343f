"""The private members of the package that the labs rely on -- the one place to adapt.

The graders use only public calls and public state. But a stub must leave out exactly the
body a chapter teaches, and some of those bodies are private steps of a public call (the
prefix lookup inside ``can_allocate``/``allocate``, the stale-entry guard inside the block
hand-out), so some stubs, mutants and solution listings name private members. They are all
listed here; ``tests/test_labs.py`` checks that each still exists and that no lab module
names a private member of the package that is not listed.

One more private piece of state is kept in step here, for the student: ``keep_private_guards``.
"""
from __future__ import annotations

from course_pkg.block_manager import BlockManager

#: (owner path, member) -> where the labs use it
PRIVATE_MEMBERS: dict[tuple[str, str], str] = {
    ("course_pkg.block_manager:BlockManager", "_match_prefix"):
        "stubs.StudentPrefixBlockManager, StudentAllocateBlockManager (docstring); "
        "mutants.LastBlockHitBlockManager; solution of prefix_caching",
    ("course_pkg.block_manager:BlockManager", "_confirms_hit"):
        "stubs.StudentPrefixBlockManager (docstring), StudentSaltBlockManager; mutants NoTokenCheckBlockManager, "
        "LastBlockHitBlockManager, UncheckedSaltBlockManager, SaltOnlyIfGivenBlockManager; "
        "foils.TokenCheckBlockManager (a mutant); solutions of prefix_caching and cache_salt",
    ("course_pkg.block_manager:BlockManager", "_prefix_id_for"):
        "stubs.StudentPrefixBlockManager (docstring); solution of prefix_caching",
    ("course_pkg.block_manager:BlockManager", "_maybe_evict_cached_block"):
        "stubs.StudentGuardBlockManager; mutants.UnconditionalEvictBlockManager; solution of stale_entry_guard",
    ("course_pkg.block_manager:BlockManager", "_allocate_block"):
        "stub docstrings (append, allocate); mutants ModuloOneBlockManager, NoRoomCheckBlockManager; "
        "solution of stale_entry_guard",
    ("course_pkg.block_manager:BlockManager", "_blocks_to_append"): "solution of append",
    ("course_pkg.block_manager:BlockManager", "_num_new_blocks"): "mutants.RevivalUncheckedBlockManager",
    ("course_pkg.block_manager:BlockManager", "_holders"): "keep_private_guards (below)",
    ("course_pkg.block_manager:BlockManager", "_needs_copy_on_write"):
        "mutants NoCopyOnWriteBlockManager, CopyExclusiveBlockManager; solution of fork_cow",
    ("course_pkg.scheduler:Scheduler", "_schedule_decodes"):
        "stubs.StudentScheduler; mutants DecodeFirstScheduler, PromptsFirstMixedScheduler, "
        "BudgetIgnoredMixedScheduler (policies); solution of scheduler",
    ("course_pkg.scheduler:Scheduler", "_schedule_prompts"):
        "stubs.StudentMixedScheduler; mutants (all three of lab mixed, DecodeFirstScheduler); solution of mixed",
    ("course_pkg.scheduler:Scheduler", "_choose_victim"): "mutants.PreemptOldestScheduler; solution of scheduler",
    ("course_pkg.scheduler:Scheduler", "_schedule_tokens"): "stubs (docstrings: how to schedule a sequence)",
    ("course_pkg.scheduler:Scheduler", "_admit"): "stubs.StudentMixedScheduler (docstring: how to admit a prompt)",
    ("course_pkg.scheduler:Scheduler", "_release_victim"): "stubs.StudentScheduler (docstring: how to preempt)",
    ("course_pkg.block_manager:BlockManager", "_release_to_head"):
        "stubs.StudentRollbackBlockManager (docstring); mutants.TailReleaseRollbackBlockManager",
    ("course_pkg.block_manager:BlockManager", "_num_verified_blocks"): "mutants of lab rollback (the blocks kept)",
    ("course_pkg.block_manager:BlockManager", "_deallocate_block"): "mutants.TailReleaseRollbackBlockManager",
    ("course_pkg.hybrid_block_manager:SlidingWindowManager", "_release"):
        "stubs.StudentSlidingWindowManager (docstring); mutants.OldestFirstSlidingWindowManager; "
        "solution of sliding_window",
    ("course_pkg.radix_tree:RadixCache", "_is_evictable_leaf"):
        "mutants InnerEvictingRadixCache, HeldEvictingRadixCache",
    ("course_pkg.engine.async_llm:AsyncLLM", "_process"): "streaming_labs (stub, mutants); solution of output_processor",
    ("course_pkg.engine.async_llm:AsyncLLM", "_make_output"):
        "streaming_labs (stub, mutants); solution of output_processor",
    ("course_pkg.engine.async_llm", "_find_stop"): "streaming_labs.StudentAsyncLLM (docstring: a helper the stub offers)",
    ("course_pkg.engine.async_llm", "_Delta"): "streaming_labs (mutants), graders.streaming (the engine's deltas)",
    ("course_pkg.kernels.triton_kernels", "_store_kvcache_kernel"): "solution of store_kvcache",
    ("course_pkg.kernels.triton_kernels", "_block_and_offset"): "solution of paged_attention",
    ("course_pkg.kernels.triton_kernels", "_online_softmax_step"): "solution of paged_attention",
    ("course_pkg.kernels.triton_kernels", "_paged_attention_kernel"): "solution of paged_attention",
    ("course_pkg.offload.manager:ARCOffloadingManager", "_eviction_order"):
        "stubs.StudentARCOffloadingManager; mutants.EvictsLoadingARC; solution of arc_tier",
    ("course_pkg.offload.manager:ARCOffloadingManager", "_find"):
        "stubs.StudentARCOffloadingManager (docstring); mutants.LookupPastMissARC",
    ("course_pkg.offload.manager:ARCOffloadingManager", "_add"): "stubs.StudentARCOffloadingManager (docstring)",
    ("course_pkg.offload.manager:ARCOffloadingManager", "_drop"): "stubs.StudentARCOffloadingManager (docstring)",
}


def keep_private_guards(impl):
    """``impl`` (a BlockManager class) with the package's private ownership record kept in step.

    The package's BlockManager records which sequences it allocated (``_holders``), so that
    ``can_append``, ``hash_blocks`` and ``deallocate`` refuse any other sequence. A student's
    ``allocate``, ``deallocate`` or ``fork``, written from the chapter, does not know that record; this
    subclass updates it after each of the student's calls that succeeded, and changes nothing
    else (the student's own checks and results are what the grader sees). Anything that is
    not a BlockManager subclass overriding those calls is returned as it is.
    """
    if not (isinstance(impl, type) and issubclass(impl, BlockManager)):
        return impl
    overrides = {name for name in ("allocate", "deallocate", "fork")
                 if getattr(impl, name, None) is not getattr(BlockManager, name, None)}
    if not overrides:
        return impl

    class Guarded(impl):
        def allocate(self, seq, num_cached_blocks=0):
            impl.allocate(self, seq, num_cached_blocks)
            holders = getattr(self, "_holders", None)
            if "allocate" in overrides and holders is not None and seq.block_table:
                holders[seq.seq_id] = seq

        def deallocate(self, seq):
            impl.deallocate(self, seq)
            holders = getattr(self, "_holders", None)
            if "deallocate" in overrides and holders is not None and not seq.block_table:
                holders.pop(seq.seq_id, None)

        if "fork" in overrides:
            def fork(self, parent, child):
                impl.fork(self, parent, child)
                holders = getattr(self, "_holders", None)
                if holders is not None and child.block_table:
                    holders[child.seq_id] = child

    Guarded.__name__, Guarded.__qualname__ = impl.__name__, impl.__qualname__
    return Guarded
