"""One config: ``EngineConfig`` decides every engine setting, and the engine relies on no default below it.

The Scheduler keeps keyword defaults for use on its own (chapters 03-09), the BlockManager its
teaching free queue (the deque of chapters 02-03). These tests spy on what ``LLMEngine`` hands
each component: every parameter is passed explicitly, and a non-default value of every
``EngineConfig`` field reaches the object that uses it.
"""
from __future__ import annotations

import inspect
from collections import deque

import pytest
import torch

import course_pkg.engine.llm_engine as llm_engine
from course_pkg.engine import EngineConfig, LLMEngine


def _spy(monkeypatch, name):
    """Record the keyword arguments ``llm_engine.<name>`` is called with."""
    cls = getattr(llm_engine, name)
    calls = []

    def build(*args, **kwargs):
        calls.append(inspect.signature(cls).bind(*args, **kwargs).arguments)
        return cls(*args, **kwargs)

    monkeypatch.setattr(llm_engine, name, build)
    return calls


def test_the_engine_passes_every_parameter_of_the_components_it_builds(monkeypatch):
    classes = {name: getattr(llm_engine, name) for name in ("Scheduler", "ModelRunner", "BlockManager")}
    spies = {name: _spy(monkeypatch, name) for name in classes}
    LLMEngine(num_kvcache_blocks=32, block_size=4)
    for name, calls in spies.items():
        assert len(calls) == 1, name
        missing = set(inspect.signature(classes[name]).parameters) - set(calls[0])
        # The BlockManager's only unpassed one sizes a statistic, not the engine's behaviour.
        assert missing <= ({"max_recent_requests"} if name == "BlockManager" else set()), (name, missing)


def test_non_default_settings_reach_the_component_that_uses_them():
    defaults = EngineConfig()
    engine = LLMEngine(num_kvcache_blocks=40, block_size=8, free_queue="deque", max_num_seqs=3,
                       max_num_batched_tokens=96, max_model_len=64, enable_prefix_caching=False,
                       scheduling="mixed", preemption_mode="swap", num_cpu_blocks=5, seed=11,
                       attention_backend="reference")
    sched, bm, runner = engine.scheduler, engine.scheduler.block_manager, engine.model_runner
    assert (defaults.free_queue, defaults.max_num_seqs, defaults.max_num_batched_tokens) != ("deque", 3, 96)
    assert isinstance(bm.free_block_ids, deque)            # chapter 02's deque, not the linked list
    assert (sched.max_num_seqs, sched.max_num_batched_tokens, sched.max_model_len) == (3, 96, 64)
    assert (bm.num_blocks, bm.block_size, bm.enable_prefix_caching) == (40, 8, False)
    assert (sched.scheduling, sched.preemption_mode, sched.cpu_pool.num_blocks) == ("mixed", "swap", 5)
    assert (runner.block_size, runner.attention_backend, runner.num_kvcache_blocks) == (8, "reference", 40)
    assert runner.cpu_kv_cache.shape[2] == 5
    assert torch.equal(runner.sampler.generator.get_state(), torch.Generator().manual_seed(11).get_state())


def test_each_rule_between_fields_is_the_lower_layers_own():
    """EngineConfig and a Scheduler built on its own refuse the same combinations with the same words."""
    from course_pkg.scheduler import Scheduler

    for kwargs in (dict(preemption_mode="swap"), dict(num_cpu_blocks=3),
                   dict(same_step_prefix_hits=True, enable_prefix_caching=False)):
        with pytest.raises(ValueError) as engine_error:
            EngineConfig(**kwargs)
        with pytest.raises(ValueError) as scheduler_error:
            Scheduler(8, 4, **kwargs)
        assert str(engine_error.value) == str(scheduler_error.value), kwargs
