"""Load a Hugging Face Qwen3 checkpoint folder into our model, safely and offline.

A checkpoint folder is what ``save_pretrained`` writes (transformers 5.x):

* ``config.json`` -- a ``Qwen3Config``: RoPE settings in ``rope_parameters``, the dtype as ``dtype``;
* ``*.safetensors`` -- the weights, by module name. With ``tie_word_embeddings`` there is no
  ``lm_head.weight``: the head reuses ``model.embed_tokens.weight``;
* tokenizer files (``tokenizer.json``, ``tokenizer_config.json``) -- read by ``AutoTokenizer``.

Only safetensors are read (a pickle file can run code when loaded) and no remote code is
ever trusted. The model is built on the meta device -- no time spent on random init that the
checkpoint overwrites -- then materialised on the target device and filled by name.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from course_pkg.models.qwen3 import Qwen3ForCausalLM

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def default_model_path() -> Path:
    """The tiny Qwen3 checkpoint shipped with the package (trained by tools/train_tiny_model.py)."""
    return Path(__file__).resolve().parent / "tiny"


def load_config(path):
    """The folder's ``Qwen3Config``, after checking it really is a Qwen3 checkpoint."""
    from transformers import Qwen3Config

    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face checkpoint folder")
    model_type = json.loads(config_file.read_text()).get("model_type")
    if model_type != "qwen3":
        raise ValueError(f"{config_file}: model_type is {model_type!r}; this loader reads 'qwen3' only")
    return Qwen3Config.from_pretrained(str(path), local_files_only=True)


def load_weights(path) -> dict[str, torch.Tensor]:
    """Every tensor of every ``*.safetensors`` file in the folder (shards included), on the CPU."""
    path = Path(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        others = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
        hint = f" (found {', '.join(others)}: pickle files are never loaded)" if others else ""
        raise FileNotFoundError(f"{path} has no *.safetensors weights{hint}")
    weights = {}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                weights[name] = f.get_tensor(name)
    return weights


def load_tokenizer(path):
    """``AutoTokenizer`` from the folder, offline; ``None`` if the folder has no tokenizer files."""
    path = Path(path)
    if not any((path / name).is_file() for name in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def load_model(path=None, dtype: torch.dtype = torch.float32, device="cpu"):
    """``(model, hf_config, tokenizer)`` from a checkpoint folder (the tiny default if ``None``).

    The model is in eval mode, on ``device``, with every parameter in ``dtype``. The config is
    the Hugging Face ``Qwen3Config``: the engine sizes its KV cache from ``num_hidden_layers``,
    ``num_key_value_heads``, ``head_dim``. Missing or unexpected weights raise ``ValueError``
    naming them; nothing is silently left at random values.
    """
    path = default_model_path() if path is None else Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint folder {path} does not exist")
    config = load_config(path)
    weights = load_weights(path)
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config).to(dtype=dtype)
    model.to_empty(device=device)
    model.tie_weights()          # to_empty replaces parameters; the tie must be made again

    expected = dict(model.named_parameters())   # a tied head appears once, as embed_tokens
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)     # some tied checkpoints still carry a copy
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{path}: weights do not match the config; missing {missing}, "
                         f"unexpected {unexpected}")
    with torch.no_grad():
        for name, param in expected.items():
            tensor = weights[name]
            if tensor.shape != param.shape:
                raise ValueError(f"{path}: {name} has shape {tuple(tensor.shape)}, "
                                 f"the config implies {tuple(param.shape)}")
            param.copy_(tensor)
    model.eval()
    return model, config, load_tokenizer(path)
