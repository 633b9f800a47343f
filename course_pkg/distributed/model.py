"""One rank's share of the Qwen3 model, read straight from the checkpoint's slices.

A rank's model is the chapter-06 ``Qwen3ForCausalLM`` built from a *shard config* -- the same
config with the query heads, the KV heads and the MLP width divided by ``k`` -- with its
projections, embedding and head replaced by the parallel layers of
:mod:`course_pkg.distributed.layers`. Everything else (RMSNorms, RoPE, the attention over the
paged cache) is the unchanged single-device code: a rank simply runs a narrower model, and
the two all-reduces per layer make its residual stream the whole model's.

Each rank reads only its own slice of every tensor: ``safe_open(...).get_slice(name)[a:b]``
reads those bytes of the file and nothing else, so no rank ever holds the whole model.
"""
from __future__ import annotations

import copy
from pathlib import Path

import torch
from safetensors import safe_open

from course_pkg.distributed.group import TensorParallelGroup
from course_pkg.distributed.layers import (ColumnParallelLinear, ParallelLMHead, RowParallelLinear,
                                           VocabParallelEmbedding)
from course_pkg.models.loader import check_headers, read_headers
from course_pkg.models.qwen3 import Qwen3ForCausalLM


def shard_config(config, world_size: int):
    """The config of one rank's model: ``1/world_size`` of the heads and of the MLP width.

    ``hidden_size``, ``head_dim`` and ``vocab_size`` are unchanged (the residual stream is
    whole on every rank; the vocabulary layers split themselves).
    """
    shard = copy.deepcopy(config)
    shard.num_attention_heads = config.num_attention_heads // world_size
    shard.num_key_value_heads = config.num_key_value_heads // world_size
    shard.intermediate_size = config.intermediate_size // world_size
    return shard


def build_shard_model(config, group: TensorParallelGroup) -> Qwen3ForCausalLM:
    """The rank's model on the meta device (no memory yet), parallel layers in place."""
    k = group.world_size
    shard = shard_config(config, k)
    h, d = config.hidden_size, config.head_dim
    bias = bool(getattr(config, "attention_bias", False))
    with torch.device("meta"):
        model = Qwen3ForCausalLM(shard)
        model.model.embed_tokens = VocabParallelEmbedding(config.vocab_size, h, group)
        for i, layer in enumerate(model.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            attn.q_proj = ColumnParallelLinear(h, config.num_attention_heads * d, group, bias)
            attn.k_proj = ColumnParallelLinear(h, config.num_key_value_heads * d, group, bias)
            attn.v_proj = ColumnParallelLinear(h, config.num_key_value_heads * d, group, bias)
            attn.o_proj = RowParallelLinear(config.num_attention_heads * d, h, group, bias,
                                            label=f"layers.{i}.self_attn.o_proj")
            mlp.gate_proj = ColumnParallelLinear(h, config.intermediate_size, group)
            mlp.up_proj = ColumnParallelLinear(h, config.intermediate_size, group)
            mlp.down_proj = RowParallelLinear(config.intermediate_size, h, group, label=f"layers.{i}.mlp.down_proj")
        model.lm_head = ParallelLMHead(config.vocab_size, h, group)
        model.tie_weights()
    return model


def _read_slice(handle, name: str, dim: int | None, rank: int, world_size: int) -> torch.Tensor:
    sl = handle.get_slice(name)
    if dim is None:
        return sl[:]
    size = sl.get_shape()[dim]
    lo, hi = rank * size // world_size, (rank + 1) * size // world_size
    return sl[lo:hi] if dim == 0 else sl[:, lo:hi]


def check_checkpoint(path, config) -> dict:
    """The folder's safetensors headers, checked against the *whole* model (names, shapes,
    dtypes) as :func:`course_pkg.models.load_model` checks them -- reading no tensor data, so
    rank 0 can refuse a broken folder before any process starts."""
    headers = read_headers(path)
    with torch.device("meta"):
        check_headers(headers, Qwen3ForCausalLM(config), path)
    return headers


def load_shard_model(path, config, group: TensorParallelGroup, dtype: torch.dtype, device) -> Qwen3ForCausalLM:
    """Build the rank's model on ``device`` and fill it with its slices of the checkpoint.

    The checkpoint is checked first (:func:`check_checkpoint`): missing, unexpected,
    duplicated, misshapen or non-float tensors raise ``ValueError`` naming them.
    """
    path = Path(path)
    headers = check_checkpoint(path, config)
    model = build_shard_model(config, group).to(dtype=dtype)
    model.to_empty(device=device)
    model.tie_weights()                          # to_empty replaced the parameters
    params = dict(model.named_parameters())      # a tied head appears once, as embed_tokens
    files: dict[Path, list[str]] = {}
    for name, header in headers.items():
        if name in params:                       # not a tied checkpoint's spare lm_head copy
            files.setdefault(header.file, []).append(name)
    with torch.no_grad():
        for file, names in files.items():
            with safe_open(str(file), framework="pt", device="cpu") as handle:
                for name in names:
                    owner, _, leaf = name.rpartition(".")
                    dim = getattr(model.get_submodule(owner), "shard_dims", {}).get(leaf)
                    tensor = _read_slice(handle, name, dim, group.rank, group.world_size)
                    if tensor.shape != params[name].shape:
                        raise ValueError(f"{file}: rank {group.rank}'s slice of {name} has shape "
                                         f"{tuple(tensor.shape)}, the shard config implies "
                                         f"{tuple(params[name].shape)}")
                    params[name].copy_(tensor)
    return model.eval()


def parameter_bytes(model) -> int:
    """Bytes of the model's parameters (a tied weight counted once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())
