"""Every lab, by chapter. Adding a lab is one entry here; ``tools/add_lab_sections.py`` then puts
it into its chapter's notebook."""
from __future__ import annotations

from course_pkg.labs.lab import Lab

_G = "course_pkg.labs.graders"
_S = "course_pkg.labs.stubs"
_M = "course_pkg.labs.mutants"
_K = "course_pkg.labs.kernel_labs"
_P = "course_pkg.labs.parallel_labs"
_T = "course_pkg.labs.streaming_labs"

_LABS = [
    Lab("block_reset", "Block.reset: a reused block starts held, empty and unregistered", 1,
        "reset() of fresh and registered blocks by hand; blocks reused inside a BlockManager, lockstep",
        "course_pkg.block:Block", f"{_S}:StudentBlock", f"{_G}.blocks:grade_block_reset",
        {"reset to ref_count 0": f"{_M}:ResetToZeroBlock", "reset keeps the hash": f"{_M}:ResetKeepsHashBlock",
         "reset keeps the tokens": f"{_M}:ResetKeepsTokensBlock"},
        ("course_pkg.block:Block.reset",),
        task="`Block.reset()`"),
    Lab("logical_blocks", "Logical blocks: num_blocks, last_block_num_tokens, block(i)", 1,
        "hand-computed tables for block sizes 1, 7 and 16, full and partial last blocks, growth by decode; "
        "block(i) past either end raises",
        "course_pkg.sequence:Sequence", f"{_S}:StudentSequence", f"{_G}.blocks:grade_logical_blocks",
        {"n // bs + 1 blocks": f"{_M}:FloorPlusOneSequence", "n % bs last-block tokens": f"{_M}:ModuloLastBlockSequence",
         "block(-1) returns []": f"{_M}:NegativeBlockSequence"},
        ("course_pkg.sequence:Sequence.num_blocks", "course_pkg.sequence:Sequence.last_block_num_tokens",
         "course_pkg.sequence:Sequence.block"),
        task="`Sequence.num_blocks`, `last_block_num_tokens` and `block(i)`"),
    Lab("append", "can_append and may_append, for every block size", 2,
        "decode across block boundaries at block sizes 1, 2, 7, 16; the equality case; a full pool; "
        "lockstep block ids and invariants after every call",
        "course_pkg.block_manager:BlockManager", f"{_S}:StudentAppendBlockManager", f"{_G}.manager:grade_append",
        {"len % bs == 1 one-liner": f"{_M}:ModuloOneBlockManager",
         "can_append with >": f"{_M}:StrictCanAppendBlockManager"},
        ("course_pkg.block_manager:BlockManager.can_append", "course_pkg.block_manager:BlockManager._blocks_to_append",
         "course_pkg.block_manager:BlockManager.may_append"),
        task="`BlockManager.can_append` and `may_append`"),
    Lab("allocate", "allocate and deallocate", 2,
        "block tables and free-queue order by hand at block sizes 1, 4, 7; full pools and misuse change "
        "nothing; shared prefixes, ref counts, revival (revived blocks count against the room); "
        "prefix_cache_stats by hand (first admissions and readmissions apart); lockstep and invariants "
        "after every call",
        "course_pkg.block_manager:BlockManager", f"{_S}:StudentAllocateBlockManager", f"{_G}.manager:grade_allocate",
        {"no room check": f"{_M}:NoRoomCheckBlockManager",
         "frees shared blocks": f"{_M}:FreesSharedBlocksBlockManager",
         "keeps the block table": f"{_M}:KeepsTableBlockManager",
         "never counts prefix_cache_stats": f"{_M}:UncountedAllocateBlockManager",
         "readmissions counted as first admissions": f"{_M}:ReadmissionCountedBlockManager",
         "room check ignores revived blocks": f"{_M}:RevivalUncheckedBlockManager"},
        ("course_pkg.block_manager:BlockManager.allocate", "course_pkg.block_manager:BlockManager.deallocate"),
        task="`BlockManager.allocate` and `deallocate`"),
    Lab("release_order", "Reversed release: the free queue as an LRU for prefixes", 3,
        "free-queue order by hand; a prefix surviving new requests; shared blocks; the hit rate under "
        "memory pressure equals the reference's (the real Scheduler)",
        "course_pkg.block_manager:BlockManager", f"{_S}:StudentReleaseBlockManager",
        f"{_G}.manager:grade_release_order",
        {"forward release": "course_pkg.foils:ForwardReleaseBlockManager",
         "release to the head": f"{_M}:ReleaseToHeadBlockManager"},
        ("course_pkg.block_manager:BlockManager.deallocate",),
        task="`BlockManager.deallocate`, releasing so that a sequence's prefix is overwritten last"),
    Lab("free_queue", "A free block queue with O(1) remove", 3,
        "FIFO order by hand and against a deque over 3000 random operations; misuse; the same block ids "
        "inside a BlockManager; gate: the per-call cost of popleft, append and remove at 100k blocks "
        "within 4x of 1k",
        "course_pkg.free_block_queue:FreeBlockQueue", f"{_S}:StudentFreeBlockQueue",
        f"{_G}.free_queue:grade_free_queue",
        {"deque.remove (O(n))": f"{_M}:DequeFreeBlockQueue",
         "remove forgets the back link": f"{_M}:ForgetfulLinkFreeBlockQueue",
         "popleft is list.pop(0) (O(n))": f"{_M}:ListPopFreeBlockQueue",
         "append scans the queue (O(n))": f"{_M}:ScanningAppendFreeBlockQueue"},
        ("course_pkg.free_block_queue:FreeBlockQueue",),
        task="a free block queue: `popleft`, `append`, `remove` in O(1), `len`, iteration"),
    Lab("prefix_caching", "Prefix matching and hash_blocks", 4,
        "hits only on computed blocks; never the prompt's last block; chained hashes; forced collisions "
        "(other tokens, or the same tokens after another prefix); "
        "block sizes 1 and 7; decoded blocks reused; gate: prefill tokens saved on a shared system prompt",
        "course_pkg.block_manager:BlockManager", f"{_S}:StudentPrefixBlockManager",
        f"{_G}.prefix:grade_prefix_caching",
        {"hashes registered at allocation": f"{_M}:RegisterAtAllocationBlockManager",
         "no token check on a hit": f"{_M}:NoTokenCheckBlockManager",
         "tokens checked, not the parent (Nano-vLLM)": "course_pkg.foils:TokenCheckBlockManager",
         "the prompt's last block hit": f"{_M}:LastBlockHitBlockManager",
         "unchained hashes": f"{_M}:UnchainedHashBlockManager",
         "partial last block registered": f"{_M}:PartialBlockRegisteredBlockManager",
         "uncomputed full blocks registered": f"{_M}:UncomputedBlocksRegisteredBlockManager"},
        ("course_pkg.block_manager:compute_hash", "course_pkg.block_manager:BlockManager._match_prefix",
         "course_pkg.block_manager:BlockManager._confirms_hit", "course_pkg.block_manager:BlockManager._prefix_id_for",
         "course_pkg.block_manager:BlockManager.hash_blocks"),
        task="`BlockManager._match_prefix` (the lookup behind `can_allocate`) and `hash_blocks`"),
    Lab("stale_entry_guard", "The stale-entry guard", 4,
        "a stale index entry after its block is reused; same-prefix sequences in one step; multi-turn "
        "chats under memory pressure give the reference's hits",
        "course_pkg.block_manager:BlockManager", f"{_S}:StudentGuardBlockManager",
        f"{_G}.prefix:grade_stale_entry_guard",
        {"no stale-entry guard": "course_pkg.foils:UnguardedBlockManager",
         "unconditional eviction": f"{_M}:UnconditionalEvictBlockManager",
         "the guard's condition inverted": f"{_M}:InvertedGuardBlockManager",
         "drops a newer entry of a higher block id": f"{_M}:NewerIdEvictingBlockManager"},
        ("course_pkg.block_manager:BlockManager._allocate_block",
         "course_pkg.block_manager:BlockManager._maybe_evict_cached_block"),
        task="`BlockManager._maybe_evict_cached_block`, the guard run when a free block gets new content"),
    Lab("store_kvcache", "The store-KV kernel (Triton)", 5,
        "K and V at block slot // bs, offset slot % bs, by hand; padding slots untouched; block sizes 1, 4, 7; "
        "a strided cache; float16",
        "course_pkg.kernels:store_kvcache", f"{_K}:student_store_kvcache_kernel", f"{_K}:grade_store_kvcache",
        {"address ignores the block stride": f"{_K}:store_ignoring_block_stride",
         "key stored into both caches": f"{_K}:store_key_into_both_caches"},
        ("course_pkg.kernels.triton_kernels:_store_kvcache_kernel",),
        task="the store kernel, one Triton program per new token"),
    Lab("paged_attention", "Paged decode attention (Triton)", 5,
        "against the float64 reference: contexts 1-30, block sizes 4 and 7, GQA 1/2/4, large scores; "
        "NaN in every unowned slot; one token's output is its value",
        "course_pkg.kernels:paged_attention", f"{_K}:student_paged_decode_kernel", f"{_K}:grade_paged_attention",
        {"no softmax scale": f"{_K}:decode_without_scale", "off-by-one mask": f"{_K}:decode_off_by_one_mask",
         "round-robin GQA heads": f"{_K}:decode_round_robin_gqa",
         "no online-softmax rescale": f"{_K}:decode_without_rescale"},
        ("course_pkg.kernels.triton_kernels:_block_and_offset",
         "course_pkg.kernels.triton_kernels:_online_softmax_step",
         "course_pkg.kernels.triton_kernels:_paged_attention_kernel"),
        task="a paged decode-attention kernel, one Triton program per (sequence, query head)"),
    Lab("scheduler", "The Scheduler: decodes and preemption", 6,
        "lockstep with the package's Scheduler (batches, token counts, preemptions, queues, block tables) "
        "and hand-computed steps: prefill priority, chunking, the newest preempted first, max_num_seqs, hits; "
        "the real engine with your scheduler gives Hugging Face's greedy tokens",
        "course_pkg.scheduler:Scheduler", f"{_S}:StudentScheduler", f"{_G}.scheduler:grade_scheduler",
        {"preempts the oldest": f"{_M}:PreemptOldestScheduler",
         "preempted to the back of the line": f"{_M}:PreemptToTailScheduler",
         "decode before prefill": f"{_M}:DecodeFirstScheduler",
         "preemptions not counted": f"{_M}:UncountedPreemptScheduler"},
        ("course_pkg.scheduler:Scheduler._schedule_decodes", "course_pkg.scheduler:Scheduler._choose_victim",
         "course_pkg.scheduler:Scheduler.preempt"),
        task="`Scheduler._schedule_decodes` and `preempt`"),
    Lab("fork_cow", "Fork and copy-on-write", 8,
        "forks share every block, the partial last one too; the first write into a shared block copies "
        "it and returns the copy (by hand); full blocks and block size 1 never copy; no free block; "
        "forks of forks; misuse (a child that is not a blockless copy: other tokens, other computed "
        "tokens, blocks of its own); random traces with forks in lockstep",
        "course_pkg.block_manager:BlockManager", f"{_S}:StudentForkBlockManager", f"{_G}.manager:grade_fork_cow",
        {"fork without ref counts": f"{_M}:ForkWithoutRefCountsBlockManager",
         "no copy-on-write": f"{_M}:NoCopyOnWriteBlockManager",
         "copies exclusive blocks too": f"{_M}:CopyExclusiveBlockManager",
         "copy not reported": f"{_M}:SilentCopyBlockManager",
         "fork never checks the child is a copy": f"{_M}:ForkWithoutCopyCheckBlockManager",
         "the child's block hashes not copied": f"{_M}:ForkWithoutHashesBlockManager"},
        ("course_pkg.block_manager:BlockManager.fork", "course_pkg.block_manager:BlockManager._needs_copy_on_write",
         "course_pkg.block_manager:BlockManager.may_append"),
        task="`BlockManager.fork` and `may_append` with copy-on-write"),
    Lab("cpu_pool", "The CPU block pool: swap out and release", 9,
        "swap-outs take free blocks, releases give them back, by hand (in any order: CPU blocks hold no "
        "cache, so which free block a swap-out gets does not matter); can_swap_out at the edge; a refused "
        "swap-out changes nothing; 3000 random operations next to the package's pool, free and held blocks "
        "partitioning the pool; the engine swapping with your pool gives the same tokens",
        "course_pkg.swap:CpuBlockPool", f"{_S}:StudentCpuBlockPool", f"{_G}.swap:grade_cpu_pool",
        {"can_swap_out with <": f"{_M}:StrictCanSwapOutCpuBlockPool",
         "swap_out leaves the blocks free": f"{_M}:PeekingSwapOutCpuBlockPool",
         "no room check": f"{_M}:NoRoomCheckCpuBlockPool",
         "release keeps the entry": f"{_M}:ReleaseKeepsEntryCpuBlockPool"},
        ("course_pkg.swap:CpuBlockPool.can_swap_out", "course_pkg.swap:CpuBlockPool.swap_out",
         "course_pkg.swap:CpuBlockPool.release"),
        task="`CpuBlockPool.can_swap_out`, `swap_out` and `release`"),
    Lab("mixed", "The mixed policy: prompt chunks after the decodes", 9,
        "lockstep with the package's Scheduler(scheduling=\"mixed\") (batches, token counts, queues, block "
        "tables) and hand-computed steps: a decode and a prompt chunk in one step, the budget shared, a long "
        "prompt chunked while others decode; preemption; a long run under memory pressure",
        "course_pkg.scheduler:Scheduler", f"{_S}:StudentMixedScheduler", f"{_G}.scheduler:grade_mixed",
        {"prompts first": f"{_M}:PromptsFirstMixedScheduler",
         "budget not shared": f"{_M}:BudgetIgnoredMixedScheduler",
         "whole prompts only": f"{_M}:WholePromptsOnlyMixedScheduler",
         "same-step prefix hits ignored": f"{_M}:SameStepIgnoredMixedScheduler"},
        ("course_pkg.policies:Mixed.schedule", "course_pkg.scheduler:Scheduler._schedule_prompts"),
        task="`Scheduler._schedule_prompts`, the routine that fills a step with prompt tokens"),
    Lab("radix_cache", "A radix tree of cached blocks, evicting least recently used leaves", 11,
        "match, insert and evict by hand (shared nodes, last use, leaves only, held nodes kept, a full pool); "
        "800 random calls in lockstep with the package's tree; the Mooncake trace's hits request by request",
        "course_pkg.radix_tree:RadixCache", f"{_S}:StudentRadixCache", f"{_G}.radix:grade_radix_cache",
        {"evicts inner nodes": f"{_M}:InnerEvictingRadixCache",
         "evicts held nodes": f"{_M}:HeldEvictingRadixCache",
         "no LRU update on a hit": f"{_M}:NoTouchRadixCache"},
        ("course_pkg.radix_tree:RadixCache.match_prefix", "course_pkg.radix_tree:RadixCache.insert",
         "course_pkg.radix_tree:RadixCache.evict"),
        task="`RadixCache.match_prefix`, `insert` and `evict`"),
    Lab("tensor_parallel", "Column-, row- and vocabulary-parallel layers", 10,
        "on 2, 3 and 4 simulated ranks (threads meeting at each all-reduce): the row-parallel output "
        "equals the whole layer's on every rank, bias added once, one all-reduce; each rank's column slice "
        "with no communication; column then row equals the whole product; the split embedding gives "
        "the whole table's rows bit for bit",
        "course_pkg.labs.parallel_labs:PackageParallelLayers", f"{_P}:StudentParallelLayers",
        f"{_G}.tensor_parallel:grade_tensor_parallel",
        {"bias added on every rank": f"{_P}:BiasOnEveryRankLayers",
         "no all-reduce": f"{_P}:NoAllReduceLayers",
         "column output all-reduced": f"{_P}:ReducedColumnLayers",
         "other ranks' ids not zeroed": f"{_P}:UnmaskedEmbeddingLayers",
         "ids not shifted into the slice": f"{_P}:UnshiftedEmbeddingLayers"},
        ("course_pkg.distributed.layers:ColumnParallelLinear.forward",
         "course_pkg.distributed.layers:RowParallelLinear.forward",
         "course_pkg.distributed.layers:VocabParallelEmbedding.forward"),
        task="the `forward` of `Column`, `Row` and `VocabEmbedding` (subclasses of the package's layers)"),
    Lab("output_processor", "The output processor: a streamed completion from the engine's deltas", 13,
        "streams by hand: DELTA pieces that add up to the text, a character split across tokens never sent "
        "half-decoded, a stop string over three steps cut and never sent, n=2 with one completion stopped "
        "and the engine told, an abort, CUMULATIVE and FINAL_ONLY; 300 random streams (kinds, n, stop strings, "
        "aborts) in lockstep with the package's processor, output by output and command by command",
        "course_pkg.engine.async_llm:AsyncLLM", f"{_T}:StudentAsyncLLM", f"{_G}.streaming:grade_output_processor",
        {"the engine never told to stop a completion": f"{_T}:NoStopCommandAsyncLLM",
         "no stop-string hold-back": f"{_T}:NoStopHoldBackAsyncLLM",
         "half a character handed out": f"{_T}:ReplacementCharacterAsyncLLM",
         "an abort left without a reason": f"{_T}:AbortUnmarkedAsyncLLM",
         "tokens kept after the stop string": f"{_T}:TokensAfterStopAsyncLLM",
         "DELTA resends the whole text": f"{_T}:ResendingDeltaAsyncLLM"},
        ("course_pkg.engine.async_llm:AsyncLLM._process", "course_pkg.engine.async_llm:AsyncLLM._make_output"),
        task="`AsyncLLM._process` and `_make_output`, the output processor"),
    Lab("cache_salt", "The salt in the hash chain, and in the exact check", 12,
        "salt_hash's contract (-1 without a salt; for each salt a distinct int in [0, 2**64), the same every "
        "call); by hand: an unsalted chain is chapter 04's, a salted one starts at the salt's hash, the same "
        "salt shares and another or none shares nothing; forced collisions (every salt's chain starting alike, "
        "a salted chain starting where the unsalted one does); random salted calls in lockstep",
        "course_pkg.block_manager:BlockManager", f"{_S}:StudentSaltBlockManager", f"{_G}.salt:grade_cache_salt",
        {"no salt in the hash": f"{_M}:NoSaltBlockManager",
         "Python's hash()": f"{_M}:BuiltinHashSaltBlockManager",
         "one chain start for every salt": f"{_M}:OneStartSaltBlockManager",
         "the salt not checked on a hit": f"{_M}:UncheckedSaltBlockManager",
         "an unsalted request may hit a salted block": f"{_M}:SaltOnlyIfGivenBlockManager"},
        ("course_pkg.block_manager:salt_hash", "course_pkg.block_manager:BlockManager._confirms_hit"),
        task="`BlockManager.salt_hash` (where a request's hash chain starts) and `_confirms_hit` (the exact "
             "check behind a hash hit, the salt included)"),
    Lab("rollback", "The rollback of a speculative step: give back what holds no verified token", 14,
        "speculative steps by hand (one, some, all and no drafts accepted; block sizes 1, 2, 4): the blocks "
        "kept, the free queue's order, nothing rejected registered; a shared prefix; random steps over "
        "several sequences in lockstep; the engine speculating over your manager gives the tokens of one "
        "that does not",
        "course_pkg.block_manager:BlockManager", f"{_S}:StudentRollbackBlockManager",
        f"{_G}.spec_decode:grade_rollback",
        {"frees a block still holding accepted tokens": f"{_M}:FloorKeepRollbackBlockManager",
         "registers rejected tokens": f"{_M}:RegistersRejectedRollbackBlockManager",
         "forgets to free an emptied block": f"{_M}:LastBlockOnlyRollbackBlockManager",
         "gives blocks back to the tail": f"{_M}:TailReleaseRollbackBlockManager"},
        ("course_pkg.block_manager:BlockManager.free_lookahead_slots",),
        task="`BlockManager.free_lookahead_slots`, the rollback after verification"),
    Lab("arc_tier", "The tier's lookup and ARC: what a use teaches it, what it gives up", 15,
        "lookup's leading run and its counters; touch (T1 to T2, last to first; a ghost moving p within "
        "[0, c]); the eviction order (T1 while above p, never a block being loaded or stored, None when too "
        "few may go) by hand; 800 random calls in lockstep with the package's ARC, the whole state compared "
        "after each; 600 Mooncake requests through a pool and your tier, the hits request by request",
        "course_pkg.offload.manager:ARCOffloadingManager", f"{_S}:StudentARCOffloadingManager",
        f"{_G}.tier:grade_arc_tier",
        {"no ghost lists": f"{_M}:NoGhostsARC", "evicts a block being loaded": f"{_M}:EvictsLoadingARC",
         "lookup past the first miss": f"{_M}:LookupPastMissARC"},
        ("course_pkg.offload.manager:OffloadingManager.lookup", "course_pkg.offload.manager:ARCOffloadingManager.touch",
         "course_pkg.offload.manager:ARCOffloadingManager._eviction_order"),
        task="`lookup` (the tier's, for any policy), `ARCOffloadingManager.touch` and `_eviction_order`"),
    Lab("sliding_window", "A window's blocks: give back what left it, hit on what it reads", 16,
        "first_needed_block by hand (windows 1, 4, 5, 6, 8 and None, block sizes 1, 2, 4); the blocks given back "
        "by hand: table entries, ids newest first, the free queue's order (at the tail, still registered), a "
        "block a fork shares; longest_hit by hand (early blocks missing, the window cached: the hit on the "
        "right; unknown prefixes); a window hit end to end through can_allocate; random requests through two "
        "Schedulers in lockstep with the package's managers, every decision after every step, and every read "
        "of every query checked against a fake K/V",
        "course_pkg.hybrid_block_manager:SlidingWindowManager", f"{_S}:StudentSlidingWindowManager",
        f"{_G}.hybrid:grade_sliding_window",
        {"frees one block too early": f"{_M}:EarlyFreeSlidingWindowManager",
         "window of w + 1 positions": f"{_M}:WideWindowSlidingWindowManager",
         "never frees": f"{_M}:NeverFreesSlidingWindowManager",
         "frees oldest first": f"{_M}:OldestFirstSlidingWindowManager",
         "searches hits from the left": f"{_M}:LeftSearchSlidingWindowManager"},
        ("course_pkg.hybrid_block_manager:SlidingWindowManager.first_needed_block",
         "course_pkg.hybrid_block_manager:SlidingWindowManager.remove_skipped_blocks",
         "course_pkg.hybrid_block_manager:SlidingWindowManager.longest_hit"),
        task="`SlidingWindowManager.first_needed_block`, `remove_skipped_blocks` (the blocks that left the "
             "window, given back) and `longest_hit` (a prefix hit that needs only the window, searched from "
             "the right)"),
    Lab("kv_block_bytes", "Bytes of one KV block", 7,
        "hand-computed sizes (Qwen3-0.6B, Llama-3-8B, odd shapes) and the bytes a ModelRunner allocates per block",
        "course_pkg.labs.arithmetic:kv_block_bytes", f"{_S}:student_kv_block_bytes",
        f"{_G}.arithmetic:grade_kv_block_bytes",
        {"keys only": f"{_M}:kv_block_bytes_keys_only", "one layer": f"{_M}:kv_block_bytes_one_layer",
         "2 bytes per value whatever the dtype": f"{_M}:kv_block_bytes_two_byte_dtype",
         "a float, not an int": f"{_M}:kv_block_bytes_float"},
        task="`kv_block_bytes(block_size, num_layers, num_kv_heads, head_dim, dtype_bytes)`"),
    Lab("fragmentation", "Internal fragmentation", 7,
        "hand-computed empty slots (full, partial and single-token last blocks, block size 1) and the "
        "slots a BlockManager's block tables really leave empty",
        "course_pkg.labs.arithmetic:internal_fragmentation", f"{_S}:student_internal_fragmentation",
        f"{_G}.arithmetic:grade_internal_fragmentation",
        {"n % bs empty slots": f"{_M}:fragmentation_modulo",
         "allocated slots, not empty ones": f"{_M}:fragmentation_allocated_slots",
         "a block for a sequence with no tokens": f"{_M}:fragmentation_one_block_at_least"},
        task="`internal_fragmentation(num_tokens, block_size)`"),
]

LABS: dict[str, Lab] = {lab.name: lab for lab in sorted(_LABS, key=lambda lab: lab.chapter)}


def labs_of_chapter(chapter: int) -> list[Lab]:
    return [lab for lab in LABS.values() if lab.chapter == chapter]
