"""The ModelRunner: owns the KV cache tensor and turns a scheduled step into one forward pass.

The BlockManager hands out block *numbers*; this is where they become memory. At start-up
the runner allocates **one** tensor for the whole cache,
``[2 (K, V), num_layers, num_blocks, block_size, num_kv_heads, head_dim]``, sized from a
memory budget, and never allocates KV memory again: a block id is an index into it. (A hybrid
model of chapter 16 has ``group_size`` layers there instead of ``num_layers``: the j-th layer of
every KV cache group shares the j-th tensor, and a block id belongs to one group at a time.)

For every step it builds the flat batch the model runs (see ``course_pkg.models``):

* ``input_ids`` / ``positions``: for each scheduled sequence, its tokens
  ``[num_cached_tokens, num_cached_tokens + num_scheduled_tokens)`` -- a whole prompt, a chunk
  of one, the part a prefix-cache hit did not cover, or the newest token when decoding;
* ``slot_mapping``: where each of those tokens' K/V is written. Token ``t`` of a sequence goes
  to block ``block_table[t // block_size]`` at offset ``t % block_size``, slot
  ``block_id * block_size + offset``;
* ``block_tables`` (padded with -1), ``context_lens`` (cached + new tokens) and
  ``cu_seqlens_q``, which the attention reads the cache with.

Only sequences whose step reaches their last token produce logits and a sampled token; a
chunk in the middle of a prompt only fills the cache. ``execute_model`` performs one
``SchedulerOutput``: the block copies, then the forward pass, then sampling.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import torch

from course_pkg.engine.outputs import ModelRunnerOutput
from course_pkg.engine.sampler import Sampler
from course_pkg.models import AttentionMetadata
from course_pkg.models.attention import BACKENDS
from course_pkg.sequence import Sequence
from course_pkg.validation import check_choice, check_positive_int

#: KV cache budget on a CPU when neither a block count nor a byte budget is given.
DEFAULT_CPU_KV_CACHE_BYTES = 256 * 2**20


def _top_logprobs(logits: torch.Tensor, k: int) -> list[tuple[int, float]]:
    """The ``k`` most likely next tokens of one row of logits, with their log-probabilities
    (float32 ``log_softmax``, as Hugging Face's beam search scores them), best first."""
    values, tokens = torch.log_softmax(logits.float(), dim=-1).topk(min(k, logits.shape[-1]))
    return list(zip(tokens.tolist(), values.tolist()))


def resolve_backend(attention_backend: str, device: torch.device) -> str:
    """``auto`` means the Triton kernels on CUDA and the pure-torch path elsewhere."""
    if attention_backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return check_choice("attention_backend", attention_backend, BACKENDS)


def kv_block_bytes(config, block_size: int, dtype: torch.dtype, num_layers: int | None = None) -> int:
    """Bytes of one KV block of a model with ``config``: K and V, every layer (or ``num_layers``:
    a hybrid model's ``group_size``), ``block_size`` tokens."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    itemsize = torch.empty((), dtype=dtype).element_size()
    num_layers = config.num_hidden_layers if num_layers is None else num_layers
    return 2 * num_layers * block_size * config.num_key_value_heads * head_dim * itemsize


@dataclass
class _OpenStep:
    """The runner's part of an open step: where the sampler's generators stood when it began,
    and the K/V slots written since, ``{block id: first offset written}``."""

    sampler_state: tuple
    written: dict[int, int] = field(default_factory=dict)


class ModelRunner:
    """Runs the model over the paged KV cache and samples; knows nothing of scheduling."""

    def __init__(self, model, config, *, block_size: int, attention_backend: str, seed: int,
                 num_kvcache_blocks: int | None = None, kv_cache_memory_bytes: int | None = None,
                 gpu_memory_utilization: float | None = None, max_num_batched_tokens: int | None = None,
                 max_model_len: int | None = None, num_cpu_blocks: int = 0, num_offload_blocks: int = 0,
                 disk_tier=None, proposer=None, kv_cache_config=None):
        """The engine passes every setting from its ``EngineConfig`` (no default is decided here).

        The pool holds ``num_kvcache_blocks`` blocks, or what ``kv_cache_memory_bytes`` allows,
        or on CUDA what ``gpu_memory_utilization`` of the GPU leaves after a warm-up pass over
        ``max_num_batched_tokens`` tokens (both required then), or on a CPU a fixed budget.
        ``proposer``: the speculative proposer of chapter 14 (None: no speculation).
        ``num_cpu_blocks``: the CPU pool that preemption swaps to (chapter 09);
        ``num_offload_blocks``: the tier of chapter 15, another host tensor of the same layout;
        ``disk_tier``: the disk tier's directory behind it (an ``offload.disk.DiskTier``), or None.
        ``kv_cache_config``: a hybrid model's groups (``kv_cache_spec.KVCacheConfig``, chapter 16),
        or None: one group of every layer.
        """
        param = next(model.parameters())
        self.model = model
        self.config = config
        self.device = param.device
        self.dtype = param.dtype
        self.block_size = block_size
        self.attention_backend = resolve_backend(attention_backend, self.device)
        self.num_layers = config.num_hidden_layers
        # Which KV cache group each layer's table is, and which of the cache's layer slots holds it.
        self.kv_cache_config = kv_cache_config
        self.num_groups = 1 if kv_cache_config is None else len(kv_cache_config.kv_cache_groups)
        if kv_cache_config is None:
            self.layer_groups, layer_slots = [0] * self.num_layers, list(range(self.num_layers))
        else:
            self.layer_groups, layer_slots = zip(*map(kv_cache_config.group_and_slot, range(self.num_layers)))
        self.num_layer_slots = max(layer_slots) + 1
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.vocab_size = config.vocab_size
        self.sampler = Sampler(seed, self.device)
        if num_kvcache_blocks is None:
            num_kvcache_blocks = self._blocks_from_budget(kv_cache_memory_bytes, gpu_memory_utilization,
                                                          max_num_batched_tokens, max_model_len)
        check_positive_int("num_kvcache_blocks", num_kvcache_blocks)
        self.num_kvcache_blocks = num_kvcache_blocks
        self.kv_cache = torch.zeros(2, self.num_layer_slots, num_kvcache_blocks, block_size, self.num_kv_heads,
                                    self.head_dim, dtype=self.dtype, device=self.device)
        # Per layer, (k_cache, v_cache): views into the one tensor, no copies.
        self.kv_caches = [(self.kv_cache[0, i], self.kv_cache[1, i]) for i in layer_slots]
        self.cpu_kv_cache = self._allocate_cpu_cache(num_cpu_blocks)
        self.offload_kv_cache = self._allocate_cpu_cache(num_offload_blocks)
        self.disk_tier = disk_tier
        # Speculative decoding (chapter 14): a NgramProposer or an EarlyExitProposer, or None.
        self.proposer = proposer
        # The open step's part of the transaction (begin_step .. end_step or abort_step), or None.
        self._step: _OpenStep | None = None

    # ---------------------------------------------------------------- swapping (chapter 09)

    def _allocate_cpu_cache(self, num_cpu_blocks: int) -> torch.Tensor | None:
        """The host tensor that swapped-out blocks are copied to: the device cache's layout with
        ``num_cpu_blocks`` blocks. Pinned on CUDA: only page-locked memory copies at full bus
        speed (and asynchronously)."""
        if not num_cpu_blocks:
            return None
        shape = (2, self.num_layer_slots, num_cpu_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        return torch.zeros(shape, dtype=self.dtype, device="cpu", pin_memory=self.device.type == "cuda")

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copy device blocks to CPU blocks: ``pairs`` of (device block, CPU block), all layers, K and V.

        A step's swap-outs run before anything else writes into the device cache: the scheduler
        frees a victim's blocks at once, and the same step may hand them out again.
        """
        self._to_host(pairs, self.cpu_kv_cache)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copy CPU blocks back into device blocks: ``pairs`` of (CPU block, device block)."""
        self._from_host(pairs, self.cpu_kv_cache)

    # ---------------------------------------------------------------- the tier (chapter 15)

    def store_to_tier(self, pairs: list[tuple[int, int]]) -> None:
        """Copy device blocks into tier slots: ``pairs`` of (device block, tier slot). Run first in
        a step: a stored block may be handed out again in it and written by its forward pass."""
        self._to_host(pairs, self.offload_kv_cache)

    def load_from_tier(self, pairs: list[tuple[int, int]]) -> None:
        """Copy tier slots into fresh device blocks: ``pairs`` of (tier slot, device block)."""
        self._from_host(pairs, self.offload_kv_cache)

    def store_on_disk(self, blocks: list[tuple[int, int, bytes]]) -> None:
        """Write device blocks to the disk tier: ``(device block, hash, prefix digest)`` each, one
        file per block (``DiskTier.write``: whole or absent)."""
        for block_id, block_hash, digest in blocks:
            data = self.kv_cache[:, :, block_id].contiguous().cpu()
            self.disk_tier.write(block_hash, digest, data.view(torch.uint8).numpy().tobytes())

    def load_from_disk(self, blocks: list[tuple[bytes, int]]) -> None:
        """Copy blocks read from the disk tier (checked there) into fresh device blocks:
        ``(bytes, device block)`` each."""
        shape = self.kv_cache[:, :, 0].shape
        self._note_written((d, 0) for _, d in blocks)
        for payload, block_id in blocks:
            data = torch.frombuffer(bytearray(payload), dtype=self.dtype).view(shape)
            self.kv_cache[:, :, block_id] = data.to(self.device)

    def _to_host(self, pairs: list[tuple[int, int]], host: torch.Tensor) -> None:
        if not pairs:
            return
        src = torch.tensor([d for d, _ in pairs], dtype=torch.long, device=self.device)
        dst = torch.tensor([c for _, c in pairs], dtype=torch.long)
        host.index_copy_(2, dst, self.kv_cache.index_select(2, src).to("cpu"))

    def _from_host(self, pairs: list[tuple[int, int]], host: torch.Tensor) -> None:
        if not pairs:
            return
        src = torch.tensor([c for c, _ in pairs], dtype=torch.long)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.long, device=self.device)
        self._note_written((d, 0) for _, d in pairs)
        blocks = host.index_select(2, src)
        if self.device.type == "cuda":
            blocks = blocks.pin_memory()
        self.kv_cache.index_copy_(2, dst, blocks.to(self.device, non_blocking=True))

    # ---------------------------------------------------------------- sizing the cache

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers (a hybrid model's: a group's): K and V, ``block_size`` tokens each."""
        return kv_block_bytes(self.config, self.block_size, self.dtype, self.num_layer_slots)

    @property
    def kv_cache_bytes(self) -> int:
        return self.kv_cache.numel() * self.kv_cache.element_size()

    def _blocks_from_budget(self, kv_cache_memory_bytes, gpu_memory_utilization,
                            max_num_batched_tokens, max_model_len) -> int:
        if kv_cache_memory_bytes is not None:
            budget, source = kv_cache_memory_bytes, f"kv_cache_memory_bytes={kv_cache_memory_bytes}"
        elif self.device.type == "cuda":
            budget = self._cuda_budget(gpu_memory_utilization, max_num_batched_tokens, max_model_len)
            source = f"gpu_memory_utilization={gpu_memory_utilization}"
        else:
            budget, source = DEFAULT_CPU_KV_CACHE_BYTES, f"the default CPU budget of {DEFAULT_CPU_KV_CACHE_BYTES} bytes"
        num_blocks = int(budget // self.block_bytes)
        if num_blocks < 1:
            raise ValueError(f"{source} leaves room for no KV block ({self.block_bytes} bytes each)")
        return num_blocks

    def _cuda_budget(self, utilization: float, max_num_batched_tokens: int, max_model_len) -> int:
        """What ``utilization`` of the GPU leaves for the cache after weights and activations.

        A warm-up forward pass over a full token budget measures the activations' peak; the
        cache gets ``total * utilization`` minus what is in use now and minus that peak.
        """
        if utilization is None or max_num_batched_tokens is None:
            raise ValueError("sizing the KV cache from GPU memory needs gpu_memory_utilization and "
                             "max_num_batched_tokens (or pass num_kvcache_blocks or kv_cache_memory_bytes)")
        if not 0 < utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization!r}")
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self.warmup(max_num_batched_tokens, max_model_len)
        free, total = torch.cuda.mem_get_info(self.device)
        stats = torch.cuda.memory_stats(self.device)
        activation_peak = stats["allocated_bytes.all.peak"] - stats["allocated_bytes.all.current"]
        return int(total * utilization - (total - free) - activation_peak)

    @torch.inference_mode()
    def warmup(self, num_tokens: int, max_model_len: int | None = None) -> None:
        """One forward pass over ``num_tokens`` prompt tokens, without a cache."""
        seq_len = min(num_tokens, max_model_len or num_tokens)
        lens = [seq_len] * (num_tokens // seq_len) + ([num_tokens % seq_len] if num_tokens % seq_len else [])
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        positions = torch.cat([torch.arange(n) for n in lens]).to(self.device)
        attn = AttentionMetadata(
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.long, device=self.device),
            block_tables=torch.full((len(lens), 1), -1, dtype=torch.int32, device=self.device),
            context_lens=torch.tensor(lens, dtype=torch.int32, device=self.device),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=self.device),
            max_q_len=max(lens), max_context_len=max(lens), backend=self.attention_backend)
        hidden = self.model(ids, positions, attn, None)
        self.model.compute_logits(hidden[torch.tensor(cu[1:], device=self.device) - 1])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def check_usable(self) -> None:
        """Raise if this runner can take no more work (a closed tensor-parallel runner can't)."""

    # ---------------------------------------------------------------- one step

    def begin_step(self, seqs) -> None:
        """The runner's part of a step's transaction: note where the sampler's generators stand
        for the step's sequences (``SchedulerOutput.seqs``), and start counting the K/V slots
        the step writes. (One assignment: a step is open here, or it is not.)"""
        self._step = _OpenStep(self.sampler.get_state(seqs))

    def end_step(self) -> None:
        """The step committed: forget how to undo it."""
        self._step = None

    def written_slots(self) -> dict[int, int]:
        """The K/V slots the open step has written so far, ``{block id: first offset written}``
        -- memory no undo gives back (``Scheduler.unschedule`` deals with it). Empty when no
        step is open."""
        return dict(self._step.written) if self._step is not None else {}

    def abort_step(self) -> None:
        """The step is undone: put the generators back, so the redone step draws the same. May
        run again (it puts back the same states) until it has closed the step."""
        if self._step is not None:
            self.sampler.set_state(self._step.sampler_state)
            self._step = None

    @property
    def step_is_open(self) -> bool:
        return self._step is not None

    def _note_written(self, slots) -> None:
        """``(block id, offset)`` pairs about to be written (write-ahead: noted before the write)."""
        if self._step is None:
            return
        written = self._step.written
        for block_id, offset in slots:
            if offset < written.get(block_id, offset + 1):
                written[block_id] = offset

    @torch.inference_mode()
    def execute_model(self, scheduler_output) -> ModelRunnerOutput:
        """Perform one step as the scheduler decided it: its block copies, every read of a
        block before any write into it (a block freed by a preemption in this step may already
        be a copy's destination), then the forward pass and the sampling."""
        out = scheduler_output
        self.store_to_tier(list(out.blocks_to_store))   # the last step's blocks, before anything writes
        self.store_on_disk(list(out.blocks_to_store_on_disk))
        self.swap_out(list(out.blocks_to_swap_out))
        self.copy_blocks(list(out.blocks_to_copy))   # copy-on-write, before the forward pass
        self.swap_in(list(out.blocks_to_swap_in))
        self.load_from_tier(list(out.blocks_to_load))
        self.load_from_disk(list(out.blocks_to_load_from_disk))
        if any(out.num_lookahead_tokens):
            return self.execute_speculative(out)
        return self.run_with_logprobs(list(out.seqs), list(out.num_samples), list(out.num_logprobs) or None)

    # ---------------------------------------------------------------- speculative decoding (chapter 14)

    def execute_speculative(self, out) -> ModelRunnerOutput:
        """A step with lookahead slots: propose drafts into them, verify every draft in the one
        forward pass of the step, keep the accepted ones.

        Per speculating sequence the pass computes its last token and its drafts ``d_1..d_j``
        (``j`` at most its lookahead slots), so the logits after each of them come out of one
        pass; the acceptance rule (``spec_decode.greedy_accept`` or ``rejection_sample``) turns
        those ``j + 1`` rows into the 1 to ``j + 1`` tokens the step yields. The other sequences
        of the batch (prompt chunks, decodes without drafts) are computed and sampled as usual.
        """
        from course_pkg.engine.spec_decode import greedy_accept, rejection_sample
        from course_pkg.engine.sampler import GREEDY_BELOW

        seqs = list(out.seqs)
        drafts, draft_probs = self.propose(seqs, list(out.num_lookahead_tokens), out.scheduled_spec_decode_tokens)
        logits, sample_seqs = self._forward(seqs, drafts)
        logits = logits.float() if logits is not None else None
        rows, row = {}, 0
        for seq in sample_seqs:   # each sampled sequence's logits rows: 1, or 1 + its drafts
            n = 1 + len(drafts.get(seq.seq_id, ()))
            rows[seq.seq_id] = (row, row + n)
            row += n
        plain = [s for s in sample_seqs if not drafts.get(s.seq_id)]
        counts = {s.seq_id: n for s, n in zip(seqs, out.num_samples)}
        by_seq = {}
        if plain:
            plain_rows = torch.tensor([rows[s.seq_id][0] for s in plain], device=logits.device)
            tokens, logprobs = self.sampler.sample(logits[plain_rows], plain, [counts[s.seq_id] for s in plain])
            by_seq.update((s.seq_id, (t, lp)) for s, t, lp in zip(plain, tokens, logprobs))
        for seq in sample_seqs:
            d = drafts.get(seq.seq_id)
            if not d:
                continue
            a, b = rows[seq.seq_id]
            seq_logits = logits[a:b]
            if seq.temperature < GREEDY_BELOW:
                tokens = greedy_accept(d, seq_logits.argmax(dim=-1).tolist())
            else:
                target = self.sampler.probs(seq_logits, seq)
                tokens = rejection_sample(d, draft_probs.get(seq.seq_id), target,
                                          self.sampler.generator_for(seq))
            lp = torch.log_softmax(seq_logits[:len(tokens)], dim=-1)
            by_seq[seq.seq_id] = (tokens, lp[torch.arange(len(tokens)), torch.tensor(tokens)].tolist())
        results = [by_seq.get(seq.seq_id, ([], [])) for seq in seqs]
        return ModelRunnerOutput(sampled_token_ids=[t for t, _ in results], logprobs=[lp for _, lp in results],
                                 draft_token_ids=[list(drafts.get(seq.seq_id, ())) for seq in seqs])

    def propose(self, seqs: list[Sequence], num_lookahead_tokens: list[int], scheduled_spec_decode_tokens=()):
        """The drafts of this step: ``({seq.seq_id: drafts}, {seq.seq_id: q rows})`` for the sequences
        with lookahead slots, at most that many drafts each (``q``: the draft distributions of an
        early-exit draft that sampled; absent for greedy and n-gram drafts). Drafts the
        scheduler proposed already (``scheduled_spec_decode_tokens``, n-gram) are those."""
        from course_pkg.engine.spec_decode import NgramProposer

        spec = [(s, n) for s, n in zip(seqs, num_lookahead_tokens) if n]
        if scheduled_spec_decode_tokens:
            return {s.seq_id: list(d) for s, d in zip(seqs, scheduled_spec_decode_tokens) if d}, {}
        if isinstance(self.proposer, NgramProposer):
            return {s.seq_id: self.proposer.propose(s.token_ids, n) for s, n in spec}, {}
        if self.proposer is None:
            raise RuntimeError("the step has lookahead slots but this model runner has no proposer")
        return self._propose_early_exit(spec)

    @torch.inference_mode()
    def _propose_early_exit(self, spec):
        """``EarlyExitProposer``: one pass of the first layers per draft position, all
        speculating sequences together (those with fewer slots drop out)."""
        from course_pkg.engine.sampler import GREEDY_BELOW

        num_layers = self.proposer.num_layers
        model = self.model.model
        drafts = {s.seq_id: [] for s, _ in spec}
        probs = {s.seq_id: [] for s, _ in spec if s.temperature >= GREEDY_BELOW}
        bs = self.block_size
        for i in range(max(n for _, n in spec)):
            active = [s for s, n in spec if n > i]
            ids = [(s.token_ids[-1] if i == 0 else drafts[s.seq_id][-1]) for s in active]
            positions = [s.num_tokens - 1 + i for s in active]
            slots = [s.block_table[p // bs] * bs + p % bs for s, p in zip(active, positions)]
            self._note_written((slot // bs, slot % bs) for slot in slots)
            width = max(len(s.block_table) for s in active)
            tensor = partial(torch.tensor, device=self.device)
            attn = AttentionMetadata(
                slot_mapping=tensor(slots, dtype=torch.long),
                block_tables=tensor([s.block_table + [-1] * (width - len(s.block_table)) for s in active],
                                    dtype=torch.int32),
                context_lens=tensor([p + 1 for p in positions], dtype=torch.int32),
                cu_seqlens_q=tensor(list(range(len(active) + 1)), dtype=torch.int32),
                max_q_len=1, max_context_len=max(positions) + 1, backend=self.attention_backend)
            input_ids, pos = tensor(ids, dtype=torch.long), tensor(positions, dtype=torch.long)
            x = model.embed_tokens(input_ids)
            cos, sin = model.rotary.cos_sin(pos, x.dtype)
            for layer, kv_cache in zip(model.layers[:num_layers], self.kv_caches):
                x = layer(x, cos, sin, attn, kv_cache)
            logits = self.model.compute_logits(model.norm(x)).float()
            for j, s in enumerate(active):
                if s.temperature < GREEDY_BELOW:
                    drafts[s.seq_id].append(int(logits[j].argmax()))
                    continue
                q = self.sampler.probs(logits[j:j + 1], s)[0]
                noise = torch.empty_like(q).exponential_(generator=self.sampler.generator_for(s))
                drafts[s.seq_id].append(int((q / noise.clamp_min_(1e-30)).argmax()))
                probs[s.seq_id].append(q)
        return drafts, {key: torch.stack(rows) for key, rows in probs.items() if rows}

    def prepare(self, seqs: list[Sequence], draft_token_ids: dict[int, list[int]] | None = None):
        """The flat batch of one step: ``(input_ids, positions, attn, logits_rows, sample_seqs)``.

        ``logits_rows[j]`` is the row of the last token of ``sample_seqs[j]`` -- the sequences
        whose step reaches their last token and so need a sampled token.

        ``draft_token_ids`` (speculative decoding): per speculating sequence (by ``id``), its
        drafts. Such a sequence computes its last token and then its drafts, in the lookahead
        slots after it, and has ``1 + len(drafts)`` logits rows, one after each of them.
        """
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mappings: list[list[int]] = [[] for _ in range(self.num_groups)]   # one per KV cache group
        cu_seqlens_q = [0]
        context_lens: list[int] = []
        logits_rows: list[int] = []
        sample_seqs: list[Sequence] = []
        all_tables: list[list[list[int]]] = []   # per sequence, its table in every group
        for seq in seqs:
            start = seq.num_cached_tokens
            drafts = draft_token_ids.get(seq.seq_id) if draft_token_ids else None
            if drafts is not None:   # speculative: the last token, then the drafts
                token_ids, end = seq.token_ids + drafts, seq.num_tokens + len(drafts)
                if start != seq.num_tokens - 1:
                    raise ValueError(f"sequence {seq.seq_id} speculates, but it is not decoding")
            else:
                token_ids, end = seq.token_ids, start + seq.num_scheduled_tokens
                if not 0 <= start < end <= seq.num_tokens:
                    raise ValueError(f"sequence {seq.seq_id}: cannot compute tokens [{start}, {end}) "
                                     f"of {seq.num_tokens}")
            tables = self._block_tables(seq)
            all_tables.append(tables)
            if min(len(table) for table in tables) * bs < end:
                raise ValueError(f"sequence {seq.seq_id}: {len(seq.block_table)} blocks cannot hold "
                                 f"{end} tokens of block_size {bs}")
            input_ids.extend(token_ids[start:end])
            positions.extend(range(start, end))
            # Slots block by block: a run of consecutive slots inside each physical block.
            written = self._step.written if self._step is not None else {}   # (see _note_written)
            for table, slot_mapping in zip(tables, slot_mappings):
                for i in range(start // bs, (end - 1) // bs + 1):
                    first = max(start, i * bs)
                    last = min(end, (i + 1) * bs)
                    block_id = table[i]
                    base = block_id * bs - i * bs
                    slot_mapping.extend(range(base + first, base + last))
                    if first - i * bs < written.get(block_id, bs):
                        written[block_id] = first - i * bs
            cu_seqlens_q.append(cu_seqlens_q[-1] + end - start)
            context_lens.append(end)
            if drafts:
                logits_rows.extend(range(cu_seqlens_q[-1] - 1 - len(drafts), cu_seqlens_q[-1]))
                sample_seqs.append(seq)
            elif end == seq.num_tokens:
                logits_rows.append(cu_seqlens_q[-1] - 1)
                sample_seqs.append(seq)
        to = dict(device=self.device, non_blocking=True)
        pin = self.device.type == "cuda"

        def tensor(data, dtype):
            return torch.tensor(data, dtype=dtype, pin_memory=pin).to(**to)

        context_lens_t, cu_seqlens_q_t = tensor(context_lens, torch.int32), tensor(cu_seqlens_q, torch.int32)
        metadata = []   # one per KV cache group: its own slots and block tables
        for g, slot_mapping in enumerate(slot_mappings):
            tables = [seq_tables[g] for seq_tables in all_tables]
            max_blocks = max(len(table) for table in tables)
            metadata.append(AttentionMetadata(
                slot_mapping=tensor(slot_mapping, torch.long),
                block_tables=tensor([table + [-1] * (max_blocks - len(table)) for table in tables], torch.int32),
                context_lens=context_lens_t,
                cu_seqlens_q=cu_seqlens_q_t,
                max_q_len=max(b - a for a, b in zip(cu_seqlens_q, cu_seqlens_q[1:])),
                max_context_len=max(context_lens),
                backend=self.attention_backend,
            ))
        # Every layer reads its group's metadata (a model of one group: the one object for all).
        attn = metadata[0] if self.num_groups == 1 else [metadata[g] for g in self.layer_groups]
        return (tensor(input_ids, torch.long), tensor(positions, torch.long), attn,
                tensor(logits_rows, torch.long), sample_seqs)

    def _block_tables(self, seq: Sequence) -> list[list[int]]:
        """``seq``'s block table of every KV cache group (one, unless the model is hybrid)."""
        if self.num_groups == 1:
            return [seq.block_table]
        if len(seq.group_block_tables) != self.num_groups - 1:
            raise ValueError(f"sequence {seq.seq_id} has tables for {1 + len(seq.group_block_tables)} KV cache "
                             f"groups, the model has {self.num_groups}")
        return [seq.block_table, *seq.group_block_tables]

    @torch.inference_mode()
    def run(self, seqs: list[Sequence]) -> list[list[int]]:
        """Compute the scheduled tokens of ``seqs``; per sequence the list of its sampled tokens
        (``seq.num_samples`` of them; none for a sequence that computed only a chunk of its prompt)."""
        return self.run_with_logprobs(seqs).sampled_token_ids

    @torch.inference_mode()
    def run_with_logprobs(self, seqs: list[Sequence], num_samples: list[int] | None = None,
                          num_logprobs: list[int] | None = None) -> ModelRunnerOutput:
        """``run``, plus the log-probabilities of the sampled tokens, in the same shape, as a
        ``ModelRunnerOutput``.

        ``num_samples`` (the scheduler's decision, ``SchedulerOutput.num_samples``; default each
        sequence's own ``num_samples``) says how many tokens to sample per sequence that reaches
        its last token. ``num_logprobs`` (``SchedulerOutput.num_logprobs``, for the beams of a
        beam search) asks, per sequence, for that many of its most likely next tokens with their
        log-probabilities (``top_logprobs``; at most the vocabulary).
        """
        if not seqs:
            return ModelRunnerOutput(sampled_token_ids=[], logprobs=[])
        if num_samples is None:
            num_samples = [seq.num_samples for seq in seqs]
        logits, sample_seqs = self._forward(seqs)
        counts = {seq.seq_id: n for seq, n in zip(seqs, num_samples)}
        tokens, logprobs = (self.sampler.sample(logits, sample_seqs, [counts[s.seq_id] for s in sample_seqs])
                            if sample_seqs else ([], []))
        by_seq = {seq.seq_id: (t, lp) for seq, t, lp in zip(sample_seqs, tokens, logprobs)}
        results = [by_seq.get(seq.seq_id, ([], [])) for seq in seqs]
        top = None
        if num_logprobs is not None:
            wanted = {seq.seq_id: k for seq, k in zip(seqs, num_logprobs)}
            rows = {s.seq_id: _top_logprobs(logits[row], wanted[s.seq_id])
                    for row, s in enumerate(sample_seqs) if wanted[s.seq_id]}
            top = [rows.get(seq.seq_id, []) for seq in seqs]
        return ModelRunnerOutput(sampled_token_ids=[t for t, _ in results], logprobs=[lp for _, lp in results],
                                 top_logprobs=top)

    def _forward(self, seqs: list[Sequence], draft_token_ids: dict[int, list[int]] | None = None):
        input_ids, positions, attn, logits_rows, sample_seqs = self.prepare(seqs, draft_token_ids)
        hidden = self.model(input_ids, positions, attn, self.kv_caches)
        logits = self.model.compute_logits(hidden[logits_rows]) if sample_seqs else None
        return logits, sample_seqs

    @torch.inference_mode()
    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: block ``dst`` receives block ``src``'s K and V, in every layer.

        Done before the step's forward pass, which then writes the new token into ``dst``.
        """
        if not pairs:
            return
        src = torch.tensor([a for a, _ in pairs], device=self.device)
        dst = torch.tensor([b for _, b in pairs], device=self.device)
        self._note_written((b, 0) for _, b in pairs)
        # kv_cache is [2, layers, blocks, block_size, kv_heads, head_dim]: one indexed copy.
        self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]
