"""Watch the KV cache while the engine serves requests: blocks held, step by step (chapter 08).

Two numbers per step tell how much sharing saves:

* ``blocks`` -- distinct physical blocks in use (what the pool really spends);
* ``entries`` -- block-table entries of the live sequences (what they would spend if no block
  were shared: every entry its own block).

``watch_generate`` serves requests with ``step()`` and records both after every step;
``watch_beam_search`` does the same for ``beam_search``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class Watched:
    """What a served batch held, step by step, and what it cost."""

    outputs: list
    blocks: list[int] = field(default_factory=list)
    entries: list[int] = field(default_factory=list)
    computed_tokens: int = 0          # tokens the forward passes computed (prefill and decode)
    copies: int = 0                   # copy-on-write copies made
    seconds: float = 0.0

    @property
    def peak_blocks(self) -> int:
        return max(self.blocks, default=0)

    @property
    def block_steps(self) -> int:
        """Blocks held, summed over the steps: the memory-time the run occupied."""
        return sum(self.blocks)

    @property
    def mean_blocks(self) -> float:
        return sum(self.blocks) / len(self.blocks) if self.blocks else 0.0

    @property
    def peak_entries(self) -> int:
        return max(self.entries, default=0)


def _live_seqs(scheduler):
    return [s for s in list(scheduler.running) + list(scheduler.waiting) if s.block_table]


def watch_generate(llm, prompts, sampling_params) -> Watched:
    """Serve ``prompts`` (each with its ``SamplingParams``) to the end with ``llm.step()``."""
    if not isinstance(sampling_params, (list, tuple)):
        sampling_params = [sampling_params] * len(prompts)
    ids = [llm.add_request(p, sp) for p, sp in zip(prompts, sampling_params)]
    watched = Watched(outputs=[])
    outputs = {}
    start = time.perf_counter()
    while llm.has_unfinished_requests():
        for out in llm.step():
            outputs[out.request_id] = out
        step = llm.last_step
        watched.computed_tokens += step.num_tokens
        watched.copies += len(step.copies)
        watched.blocks.append(len(llm.block_manager.used_block_ids))
        watched.entries.append(sum(len(s.block_table) for s in _live_seqs(llm.scheduler)))
    watched.seconds = time.perf_counter() - start
    watched.outputs = [outputs[i] for i in ids]
    return watched


def watch_beam_search(llm, prompt, params) -> Watched:
    """Run ``llm.beam_search`` for one prompt, recording blocks and entries after every step."""
    watched = Watched(outputs=[])

    def on_step(step, beams):
        watched.copies += len(step.copies)
        if beams:   # (after the last step no beam is left, and nothing is held)
            watched.blocks.append(len({b for beam in beams for b in beam.block_table}))
            watched.entries.append(sum(len(beam.block_table) for beam in beams))

    start = time.perf_counter()
    watched.outputs = llm.beam_search([prompt], params, on_step=on_step)
    watched.seconds = time.perf_counter() - start
    return watched
