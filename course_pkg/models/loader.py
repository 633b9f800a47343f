"""Load a Hugging Face Qwen3 checkpoint folder into our model, safely and offline.

A checkpoint folder is what ``save_pretrained`` writes (transformers 5.x):

* ``config.json`` -- a ``Qwen3Config``: RoPE settings in ``rope_parameters``, the dtype as ``dtype``;
* ``*.safetensors`` -- the weights, by module name. With ``tie_word_embeddings`` there is no
  ``lm_head.weight``: the head reuses ``model.embed_tokens.weight``;
* tokenizer files (``tokenizer.json``, ``tokenizer_config.json``) -- read by ``AutoTokenizer``.

Only safetensors are read (a pickle file can run code when loaded) and no remote code is
ever trusted. Every check runs before any memory is spent on the model: the config is read
and checked, the safetensors *headers* (names, shapes, dtypes; no data) are compared with
the parameters of the model built on the meta device, and only then is the model
materialised on the target device and filled, one tensor at a time, by name. A broken
folder therefore fails with a ``ValueError`` naming the file or the tensor, not deep inside
the allocator or a forward pass.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from course_pkg.models.qwen3 import Qwen3ForCausalLM
from course_pkg.validation import check_positive_int

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")

# The sizes the model is built from; each must be a whole number >= 1 (transformers checks
# only that they are integers, so a 0 or a negative count would fail much later).
_CONFIG_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "head_dim")


def default_model_path() -> Path:
    """The tiny Qwen3 checkpoint shipped with the package (trained by tools/train_tiny_model.py)."""
    return Path(__file__).resolve().parent / "tiny"


def hybrid_model_path() -> Path:
    """Its hybrid twin (chapter 16): layers 0 and 2 local with a window of 32, layers 1 and 3
    global, trained from scratch that way (tools/train_tiny_model.py --hybrid)."""
    return Path(__file__).resolve().parent / "tiny_hybrid"


def load_config(path):
    """The folder's ``Qwen3Config``, after checking it is a Qwen3 config this model can build.

    Raises ``ValueError`` naming ``config.json`` when it is not valid JSON, not a JSON object,
    not ``model_type: qwen3``, or has sizes the model cannot have: a count below 1, or query
    heads that are not a multiple of the KV heads (grouped-query attention shares each KV
    head among ``num_attention_heads // num_key_value_heads`` query heads).
    """
    from huggingface_hub.errors import StrictDataclassError
    from transformers import Qwen3Config

    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face checkpoint folder")
    try:
        fields = json.loads(config_file.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{config_file} is not valid JSON: {e}") from None
    if not isinstance(fields, dict):
        raise ValueError(f"{config_file} holds a JSON {type(fields).__name__}; a config.json "
                         "must hold a JSON object of config fields")
    model_type = fields.get("model_type")
    if model_type != "qwen3":
        raise ValueError(f"{config_file}: model_type is {model_type!r}; this loader reads 'qwen3' only")
    try:
        config = Qwen3Config.from_pretrained(str(path), local_files_only=True)
    except StrictDataclassError as e:        # a field of the wrong type, e.g. a string size
        raise ValueError(f"{config_file}: {e}") from None
    for name in _CONFIG_SIZES:
        try:
            check_positive_int(name, getattr(config, name))
        except ValueError as e:
            raise ValueError(f"{config_file}: {e}") from None
    if config.num_attention_heads % config.num_key_value_heads:
        raise ValueError(f"{config_file}: num_attention_heads ({config.num_attention_heads}) is not "
                         f"a multiple of num_key_value_heads ({config.num_key_value_heads}); "
                         "grouped-query attention gives every KV head the same number of query heads")
    return config


@dataclass(frozen=True)
class TensorHeader:
    """What a safetensors header says about one tensor: where it is, its shape, its dtype."""

    file: Path
    shape: tuple[int, ...]
    dtype: str              # safetensors' name: "F32", "BF16", "I64", "BOOL", ...

    @property
    def is_floating_point(self) -> bool:
        return self.dtype.startswith(("F", "BF"))      # F8_*, F16, F32, F64, BF16


def read_headers(path) -> dict[str, TensorHeader]:
    """Name -> :class:`TensorHeader` over every ``*.safetensors`` file of the folder.

    Reads the headers only (no tensor data), so it is cheap whatever the checkpoint's size.
    Raises ``FileNotFoundError`` if there is no safetensors file (pickle files are never
    read), ``ValueError`` for a file that is not safetensors, and ``ValueError`` naming both
    files when two files hold a tensor of the same name: which copy would win is an accident
    of file order, so a stray extra file must not silently override the weights.
    """
    path = Path(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        others = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
        hint = f" (found {', '.join(others)}: pickle files are never loaded)" if others else ""
        raise FileNotFoundError(f"{path} has no *.safetensors weights{hint}")
    headers: dict[str, TensorHeader] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    if name in headers:
                        raise ValueError(f"tensor {name!r} is in both {headers[name].file} and {file}; "
                                         "each tensor must be stored once (remove the stray file)")
                    piece = f.get_slice(name)
                    headers[name] = TensorHeader(file, tuple(piece.get_shape()), piece.get_dtype())
        except SafetensorError as e:
            raise ValueError(f"{file} is not a readable safetensors file: {e}") from None
    return headers


def load_weights(path) -> dict[str, torch.Tensor]:
    """Every tensor of every ``*.safetensors`` file in the folder (shards included), on the CPU.

    The headers are read first (:func:`read_headers`), so a tensor stored in two files is
    refused before any data is loaded.
    """
    weights = {}
    for file, names in _by_file(read_headers(path)).items():
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in names:
                weights[name] = f.get_tensor(name)
    return weights


def _by_file(headers: dict[str, TensorHeader]) -> dict[Path, list[str]]:
    files: dict[Path, list[str]] = {}
    for name, header in headers.items():
        files.setdefault(header.file, []).append(name)
    return files


def check_headers(headers: dict[str, TensorHeader], model: torch.nn.Module, path) -> None:
    """Raise ``ValueError`` unless the checkpoint holds exactly the model's parameters, each a
    floating-point tensor of the parameter's shape.

    ``model`` may live on the meta device: only names and shapes are read. An integer tensor
    is refused rather than cast, since a cast would turn it into weights no one trained.
    """
    expected = dict(model.named_parameters())   # a tied head appears once, as embed_tokens
    stored = dict(headers)
    if model.config.tie_word_embeddings:
        stored.pop("lm_head.weight", None)      # some tied checkpoints still carry a copy
    missing = sorted(set(expected) - set(stored))
    unexpected = sorted(set(stored) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{path}: weights do not match the config; missing {missing}, "
                         f"unexpected {unexpected}")
    for name, param in expected.items():
        header = stored[name]
        if not header.is_floating_point:
            raise ValueError(f"{header.file}: {name} has dtype {header.dtype}; the model's "
                             f"parameter is floating point and is never cast from another kind")
        if header.shape != tuple(param.shape):
            raise ValueError(f"{header.file}: {name} has shape {header.shape}, "
                             f"the config implies {tuple(param.shape)}")


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
    ``num_key_value_heads``, ``head_dim``. A folder that does not fit the config -- missing,
    unexpected, duplicated, misshapen or non-float weights -- raises ``ValueError`` naming
    the tensor or the file before the model takes any memory; nothing is silently left at
    random values or cast.
    """
    path = default_model_path() if path is None else Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint folder {path} does not exist")
    config = load_config(path)
    headers = read_headers(path)
    with torch.device("meta"):   # shapes without storage: checked before anything is allocated
        model = Qwen3ForCausalLM(config).to(dtype=dtype)
    check_headers(headers, model, path)
    model.to_empty(device=device)
    model.tie_weights()          # to_empty replaces parameters; the tie must be made again

    params = dict(model.named_parameters())
    with torch.no_grad():
        for file, names in _by_file(headers).items():
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in names:
                    if name in params:          # not a tied checkpoint's spare lm_head copy
                        params[name].copy_(f.get_tensor(name))
    model.eval()
    return model, config, load_tokenizer(path)
