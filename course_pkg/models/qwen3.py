"""A Qwen3-architecture decoder that keeps its K/V in the paged cache.

The same network as Hugging Face's ``Qwen3ForCausalLM`` -- RMSNorm, rotary position embeddings
(RoPE), grouped-query attention (GQA) with RMSNorm on each query and key head, a SwiGLU MLP,
tied or untied embeddings -- with the module names of the checkpoint, so a safetensors file
loads by name. What differs is the interface: there is no batch dimension and no padding.

``model(input_ids [N], positions [N], attn, kv_caches) -> hidden [N, hidden_size]`` runs the new
tokens of several sequences laid end to end; ``positions`` gives each token's position in its
own sequence (RoPE needs it), ``attn`` (:class:`AttentionMetadata`) says which sequence each
token belongs to and where its K/V go, and ``kv_caches[layer] = (k_cache, v_cache)`` are that
layer's ``[num_blocks, block_size, num_kv_heads, head_dim]`` tensors. ``model.compute_logits``
turns the hidden states the sampler needs (usually one per sequence) into ``[n, vocab]``.

The arithmetic follows Hugging Face's order of operations (norms in float32, RoPE tables in
float32 cast to the activations' dtype) so that float32 logits agree to rounding error.
"""
from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F

from course_pkg.models.attention import AttentionMetadata, attend


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``, computed in float32 and cast back before the weight."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class RotaryEmbedding:
    """RoPE: rotate each (i, i + dim/2) pair of a head by ``position * inv_freq[i]``.

    A plain object, not a module: ``inv_freq`` is derived from the config, never stored in a
    checkpoint, and is built on the CPU so a model created on the meta device still has it.
    """

    def __init__(self, head_dim: int, rope_theta: float):
        exponent = torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu") / head_dim
        self.inv_freq = 1.0 / (rope_theta ** exponent)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        """``cos``, ``sin`` of shape ``[N, head_dim]`` for the given positions."""
        if self.inv_freq.device != positions.device:      # moved once, on first use
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions[:, None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` is ``[N, heads, head_dim]``; ``cos``/``sin`` are ``[N, head_dim]``."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


LAYER_TYPES = ("full_attention", "sliding_attention")


def sliding_window_of(config, layer_idx: int) -> int | None:
    """Layer ``layer_idx``'s window: ``config.sliding_window`` for a ``"sliding_attention"`` layer
    of ``config.layer_types``, None for a full one (and for a config without layer types)."""
    layer_types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    kind = layer_types[layer_idx]
    if kind not in LAYER_TYPES:
        raise ValueError(f"layer {layer_idx} has layer type {kind!r}; this model knows {LAYER_TYPES}")
    if kind == "full_attention":
        return None
    window = getattr(config, "sliding_window", None)
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"layer {layer_idx} is a sliding_attention layer but sliding_window={window!r} "
                         "(set use_sliding_window and sliding_window in config.json)")
    return window


class Qwen3Attention(nn.Module):
    """Project to Q/K/V, normalise each Q and K head, rotate, store K/V, attend, project back."""

    def __init__(self, config, layer_idx: int = 0):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim ** -0.5
        # A local layer (chapter 16; Hugging Face's layer_types): each query sees its last
        # sliding_window positions only. None: full attention.
        self.sliding_window = sliding_window_of(config, layer_idx)
        bias = bool(getattr(config, "attention_bias", False))
        h = config.hidden_size
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, x, cos, sin, attn: AttentionMetadata, kv_cache) -> torch.Tensor:
        n = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(n, self.num_heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(n, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = attend(q, k, v, kv_cache, attn, self.scale, self.sliding_window)
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim))


class Qwen3MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config):
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"Qwen3 uses hidden_act='silu', the config says {config.hidden_act!r}")
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Qwen3DecoderLayer(nn.Module):
    """Pre-norm residual block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, config, layer_idx: int = 0):
        super().__init__()
        self.self_attn = Qwen3Attention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, attn, kv_cache):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn, kv_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.head_dim, rope_theta(config))

    def forward(self, input_ids, positions, attn, kv_caches):
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        for i, layer in enumerate(self.layers):
            layer_attn = attn[i] if isinstance(attn, list) else attn   # (a hybrid model: per layer, chapter 16)
            x = layer(x, cos, sin, layer_attn, None if kv_caches is None else kv_caches[i])
        return self.norm(x)


def rope_theta(config) -> float:
    """The RoPE base from ``config.rope_parameters`` (transformers 5.x); only plain RoPE."""
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type != "default":
        raise ValueError(f"config.json asks for rope_type {rope_type!r}; this model implements "
                         "only plain RoPE ('default')")
    if "rope_theta" in params:
        return float(params["rope_theta"])
    return float(getattr(config, "rope_theta", 10000.0))


class Qwen3ForCausalLM(nn.Module):
    """The decoder plus the LM head. With ``tie_word_embeddings`` the head *is* the embedding."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = Qwen3Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None) -> torch.Tensor:
        """Hidden states ``[N, hidden_size]`` of a flat batch; writes its K/V into ``kv_caches``.
        ``attn``: one ``AttentionMetadata`` for every layer, or a list of one per layer (a hybrid
        model's KV cache groups each have their own block tables, chapter 16)."""
        if input_ids.dim() != 1 or positions.shape != input_ids.shape:
            raise ValueError(f"input_ids and positions must both be [N]; got "
                             f"{tuple(input_ids.shape)} and {tuple(positions.shape)}")
        if kv_caches is not None and len(kv_caches) != len(self.model.layers):
            raise ValueError(f"kv_caches has {len(kv_caches)} entries for "
                             f"{len(self.model.layers)} layers")
        first = attn
        if isinstance(attn, list):
            if len(attn) != len(self.model.layers):
                raise ValueError(f"attn has {len(attn)} entries for {len(self.model.layers)} layers")
            first = attn[0]   # (the lengths checked below are the same in every entry)
        if first.slot_mapping.shape[0] != input_ids.shape[0]:
            raise ValueError(f"slot_mapping has {first.slot_mapping.shape[0]} entries for "
                             f"{input_ids.shape[0]} tokens")
        if first.backend != "triton" or kv_caches is None:
            # Check the per-sequence lengths before any layer writes the cache (the triton
            # path skips this: reading them would cost a device synchronisation per step).
            total = first.plan()["cu"][-1]
            if total != input_ids.shape[0]:
                raise ValueError(f"cu_seqlens_q ends at {total} but the batch has "
                                 f"{input_ids.shape[0]} tokens")
        return self.model(input_ids, positions, attn, kv_caches)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[n, hidden_size] -> [n, vocab_size]``."""
        return self.lm_head(hidden)
