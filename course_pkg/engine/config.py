"""``EngineConfig``: every engine argument in one place, with its default, checked once.

Nano-vLLM keeps its engine arguments in one ``Config`` dataclass, vLLM in ``EngineArgs``; this
is the course's. ``LLMEngine(model, **kwargs)`` builds one, and everything below reads its
settings from it, so each default is decided here and nowhere else. ``__post_init__`` checks
each field (the error names it) and the rules between fields; the rules that need the
checkpoint's own config (``max_model_len`` against its context length) are checked by
``check_against_model`` once it is loaded. A refused config changes nothing: it is checked
before the model loads.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from course_pkg.block_manager import FREE_QUEUES
from course_pkg.engine.spec_decode import SpeculativeConfig
from course_pkg.models.attention import BACKENDS
from course_pkg.offload.connector import KVTransferConfig
from course_pkg.policies import ADMISSION_POLICIES, check_preemption_mode
from course_pkg.scheduler import check_same_step_prefix_hits
from course_pkg.validation import SEED_LIMIT, check_bool, check_choice, check_int, check_positive_int, check_real

ATTENTION_BACKENDS = ("auto", *BACKENDS)   # "auto": Triton on CUDA, torch elsewhere
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class EngineConfig:
    """The engine's settings (names as in vLLM's ``EngineArgs``).

    ``model``: a Hugging Face checkpoint folder, or None for the tiny model shipped with the
    package. The KV cache holds ``num_kvcache_blocks`` blocks when given, else what
    ``kv_cache_memory_bytes`` allows (a CPU default of 256 MiB), or on a GPU what
    ``gpu_memory_utilization`` leaves. ``scheduling``, ``preemption_mode`` (with
    ``num_cpu_blocks``) and ``same_step_prefix_hits`` are chapter 09's; ``tensor_parallel_size``
    chapter 10's. ``free_queue``: the BlockManager's free queue ("linked", O(1) revival; the
    BlockManager alone starts from chapter 02's "deque"). ``speculative_config`` is chapter 14's
    (``spec_decode.SpeculativeConfig``: vLLM's keys for ``ngram``, the course's own for
    ``early_exit``; kept here checked, as that object). ``kv_transfer_config`` is chapter 15's
    tier behind the device pool (``offload.connector.KVTransferConfig``: vLLM's keys for its
    ``OffloadingConnector``; kept checked, as that object). ``disable_hybrid_kv_cache_manager``
    (vLLM's flag, chapter 16): a model with sliding-window layers keeps every layer's cache whole,
    in one KV cache group, instead of one group per attention type that gives back the blocks
    that left a window.
    """

    model: str | Path | None = None
    block_size: int = 16
    num_kvcache_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None
    attention_backend: str = "auto"
    device: str | torch.device | None = None
    dtype: torch.dtype | None = None
    seed: int = 0
    free_queue: str = "linked"
    tensor_parallel_size: int = 1
    scheduling: str = "prefill_first"
    preemption_mode: str = "recompute"
    num_cpu_blocks: int | None = None
    same_step_prefix_hits: bool = False
    speculative_config: dict | SpeculativeConfig | None = None
    kv_transfer_config: dict | KVTransferConfig | None = None
    disable_hybrid_kv_cache_manager: bool = False

    def __post_init__(self):
        if self.model is not None:
            if not isinstance(self.model, (str, Path)):
                raise TypeError(f"model must be a checkpoint folder (a str or Path) or None, "
                                f"got {type(self.model).__name__}")
            if Path(self.model).is_file():
                raise ValueError(f"model={str(self.model)!r} is a file; pass the checkpoint folder that holds "
                                 f"config.json and the *.safetensors files")
        check_positive_int("block_size", self.block_size)
        if self.num_kvcache_blocks is not None:
            check_positive_int("num_kvcache_blocks", self.num_kvcache_blocks)
        if self.kv_cache_memory_bytes is not None:
            check_positive_int("kv_cache_memory_bytes", self.kv_cache_memory_bytes)
        check_real("gpu_memory_utilization", self.gpu_memory_utilization, minimum=0.0, maximum=1.0,
                   min_inclusive=False)
        check_bool("enable_prefix_caching", self.enable_prefix_caching)
        check_positive_int("max_num_seqs", self.max_num_seqs)
        check_positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        if self.max_model_len is not None:
            check_int("max_model_len", self.max_model_len, minimum=2)
        check_choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        if self.device is not None:
            if not isinstance(self.device, (str, torch.device)):
                raise TypeError(f"device must be a str, a torch.device or None, got {type(self.device).__name__}")
            try:
                torch.device(self.device)
            except (RuntimeError, ValueError):
                raise ValueError(f"device={self.device!r} is not a torch device (e.g. 'cpu', 'cuda', 'cuda:1')") from None
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of torch.float32, torch.float16, torch.bfloat16 or None, "
                             f"got {self.dtype!r}")
        check_int("seed", self.seed, minimum=0, maximum=SEED_LIMIT - 1)
        check_choice("free_queue", self.free_queue, FREE_QUEUES)
        check_positive_int("tensor_parallel_size", self.tensor_parallel_size)
        check_choice("scheduling", self.scheduling, tuple(ADMISSION_POLICIES))
        check_bool("same_step_prefix_hits", self.same_step_prefix_hits)
        check_bool("disable_hybrid_kv_cache_manager", self.disable_hybrid_kv_cache_manager)
        if self.speculative_config is not None:
            object.__setattr__(self, "speculative_config", SpeculativeConfig.from_dict(self.speculative_config))
        if self.kv_transfer_config is not None:
            object.__setattr__(self, "kv_transfer_config", KVTransferConfig.from_dict(self.kv_transfer_config))
        # The rules between fields.
        if self.kv_transfer_config is not None:
            self.kv_transfer_config.check_pool(self.block_size, self.enable_prefix_caching)   # the Scheduler's
            if self.tensor_parallel_size > 1:
                raise ValueError("kv_transfer_config is not supported with tensor_parallel_size > 1 (every rank "
                                 "would have to move its shard of each block); use one of them")
        if self.speculative_config is not None and self.tensor_parallel_size > 1:
            raise ValueError("speculative_config is not supported with tensor_parallel_size > 1 (the ranks would "
                             "have to verify drafts together); use one of them")
        check_preemption_mode(self.preemption_mode, self.num_cpu_blocks)   # the policies' own rule
        if self.preemption_mode == "swap" and self.tensor_parallel_size > 1:
            raise ValueError("preemption_mode='swap' is not supported with tensor_parallel_size > 1 "
                             "(every rank would have to swap its shard of the cache); use 'recompute'")
        check_same_step_prefix_hits(self.same_step_prefix_hits, self.enable_prefix_caching)   # the Scheduler's
        if self.num_kvcache_blocks is not None and self.kv_cache_memory_bytes is not None:
            raise ValueError("give the KV cache's size once: num_kvcache_blocks or kv_cache_memory_bytes, not both")

    @property
    def torch_device(self) -> torch.device:
        """``device``, or CUDA when there is one, else the CPU."""
        if self.device is not None:
            return torch.device(self.device)
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")

    @property
    def torch_dtype(self) -> torch.dtype:
        """``dtype``, or bfloat16 on CUDA and float32 elsewhere."""
        if self.dtype is not None:
            return self.dtype
        return torch.bfloat16 if self.torch_device.type == "cuda" else torch.float32

    def check_against_model(self, model_config) -> tuple[int, SpeculativeConfig | None]:
        """Check the rules that need the checkpoint's config; return the ``max_model_len`` to use
        (the model's context length when none was given) and the speculative config with its
        model-dependent defaults filled in."""
        limit = model_config.max_position_embeddings
        max_model_len = limit if self.max_model_len is None else check_int(
            "max_model_len", self.max_model_len, minimum=2, maximum=limit)
        spec = self.speculative_config
        if spec is not None:
            spec = spec.check_against_model(model_config)
        return max_model_len, spec
