"""Build a random-weight Qwen3 checkpoint folder offline (for benchmarks and tests).

The folder is written by transformers itself (``Qwen3ForCausalLM.save_pretrained``), so it is
exactly what a real checkpoint looks like and both our loader and ``AutoModelForCausalLM`` read
it. The tiny default model's tokenizer is copied in when it fits the vocabulary, so prompts can
be strings; generated ids beyond the tokenizer's own vocabulary simply decode to nothing.

Weights are drawn with a large ``initializer_range`` (0.4 by default): at the usual 0.02 a
random model's greedy output collapses to one repeated token, which makes an equality test
with another implementation almost meaningless.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

from course_pkg.models.loader import default_model_path

# ~21M parameters: big enough that the matmuls dominate on a CPU, small enough to run there.
BENCHMARK_CONFIG = dict(
    vocab_size=4096, hidden_size=512, intermediate_size=1536, num_hidden_layers=6,
    num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=4096,
    rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
    tie_word_embeddings=True, initializer_range=0.4,
)


def build_random_checkpoint(path, seed: int = 0, copy_tokenizer: bool = True,
                            **config_overrides) -> Path:
    """Write a Qwen3 checkpoint with seeded random weights to ``path``; returns the path.

    ``config_overrides`` replace entries of :data:`BENCHMARK_CONFIG` (any ``Qwen3Config``
    field). The same seed and config give the same weights on the same machine.
    """
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from transformers.utils import logging as hf_logging

    path = Path(path)
    fields = {**BENCHMARK_CONFIG, **config_overrides}
    tokenizer_dir = default_model_path()
    tokenizer = None
    if copy_tokenizer and (tokenizer_dir / "tokenizer.json").is_file():
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
        if len(tokenizer) > fields["vocab_size"]:
            tokenizer = None        # its ids would not fit the model's vocabulary
    if tokenizer is not None:
        fields.setdefault("eos_token_id", tokenizer.eos_token_id)
        fields.setdefault("pad_token_id", tokenizer.pad_token_id)
    else:
        fields.setdefault("eos_token_id", fields["vocab_size"] - 1)
    config = Qwen3Config(**fields)
    config.dtype = torch.float32
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).eval()
    path.mkdir(parents=True, exist_ok=True)
    bar_was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(str(path))
    finally:
        if bar_was_on:
            hf_logging.enable_progress_bar()
    if tokenizer is not None:
        tokenizer.save_pretrained(str(path))
    return path


def copy_default_model(path) -> Path:
    """A writable copy of the shipped tiny model folder (e.g. to modify it in a test)."""
    return Path(shutil.copytree(default_model_path(), path, dirs_exist_ok=True))
