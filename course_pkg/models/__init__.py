"""The model side of the engine: a Qwen3 decoder on the paged KV cache, and its loader.

Public interface (what the ModelRunner codes against)::

    from course_pkg.models import load_model, default_model_path, AttentionMetadata

    model, config, tokenizer = load_model(default_model_path(), dtype=torch.float32, device="cpu")
    hidden = model(input_ids, positions, attn, kv_caches)   # [N] tokens -> [N, hidden_size]
    logits = model.compute_logits(hidden[last_rows])        # -> [n, vocab_size]

* ``load_model(path=None, dtype, device) -> (model, config, tokenizer)`` reads a Hugging Face
  checkpoint folder (config.json, *.safetensors, tokenizer files); ``None`` means the tiny
  default model shipped in ``course_pkg/models/tiny``. ``config`` is the transformers
  ``Qwen3Config`` (``num_hidden_layers``, ``num_key_value_heads``, ``head_dim``, ``hidden_size``,
  ``vocab_size``, ``eos_token_id``, ``max_position_embeddings``, ``dtype``); ``tokenizer`` is
  ``None`` for a folder without tokenizer files.
* ``input_ids``/``positions`` are ``[N]`` long tensors: the new tokens of several sequences end
  to end, each with its position inside its own sequence.
* ``attn``: :class:`AttentionMetadata` (slot_mapping, block_tables, context_lens, cu_seqlens_q,
  max_q_len, max_context_len, backend) in the layout of :mod:`course_pkg.kernels.reference`.
* ``kv_caches[layer] = (k_cache, v_cache)``, each ``[num_blocks, block_size, num_kv_heads,
  head_dim]``. Every layer stores this step's K/V there, then attends over the cache.
* ``build_random_checkpoint(path, **overrides)`` writes a seeded random CPU-sized (~21M
  parameters) Qwen3 folder for benchmarks.
"""
import os

import torch

if not torch.cuda.is_available():
    # Without a GPU the Triton backend runs under Triton's interpreter, which must be chosen
    # before anything imports triton -- and building any module on the meta device (as the
    # loader does) or importing transformers imports it, through torch._dynamo.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from course_pkg.models.attention import AttentionMetadata  # noqa: E402
from course_pkg.models.checkpoint import BENCHMARK_CONFIG, build_random_checkpoint, copy_default_model  # noqa: E402
from course_pkg.models.loader import default_model_path, hybrid_model_path, load_config, load_model, load_tokenizer, load_weights  # noqa: E402
from course_pkg.models.qwen3 import Qwen3ForCausalLM  # noqa: E402

__all__ = [
    "AttentionMetadata", "BENCHMARK_CONFIG", "Qwen3ForCausalLM", "build_random_checkpoint",
    "copy_default_model", "default_model_path", "hybrid_model_path", "load_config", "load_model", "load_tokenizer",
    "load_weights",
]
