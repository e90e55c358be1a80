"""Load transformers-format checkpoint directories: `config.json` plus `*.safetensors` files.

The engine reads weights straight from safetensors (memory-mapped, one tensor at a time) rather than through
`transformers.AutoModel`, so a model is never materialised twice.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator

import torch
from safetensors import safe_open

from ..config import ModelConfig

# NOTE: older checkpoints saved the rotary embedding's `inv_freq` buffer; it is recomputed from the config.
_SKIPPED_SUFFIXES = ("rotary_emb.inv_freq",)


def read_hf_config(model_dir: str) -> ModelConfig:
    """The architecture from `model_dir/config.json`."""
    with open(os.path.join(model_dir, "config.json")) as f:
        return ModelConfig.from_hf_config(json.load(f))


# generation_config.json's sampling fields -> the OpenAI request field they default, and transformers' own
# default for each (a value equal to it recommends nothing: vLLM's `--generation-config auto` reads it so)
_SAMPLING_FIELDS = {"temperature": ("temperature", 1.0), "top_p": ("top_p", 1.0), "top_k": ("top_k", 50),
                    "min_p": ("min_p", None), "repetition_penalty": ("repetition_penalty", 1.0),
                    "max_new_tokens": ("max_tokens", None)}


def read_sampling_defaults(model_dir: str) -> dict[str, float | int]:
    """The sampling parameters the model's authors recommend in `model_dir/generation_config.json` (e.g.
    Llama-3-Instruct's temperature 0.6 and top_p 0.9), as request field -> value; empty without the file.
    NOTE: `do_sample` is not read: like vLLM, a recommended temperature applies whatever it says."""
    path = os.path.join(model_dir, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        config = json.load(f)
    defaults: dict[str, float | int] = {}
    for key, (field, transformers_default) in _SAMPLING_FIELDS.items():
        value = config.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value != transformers_default:
            defaults[field] = value
    return defaults


def safetensors_files(model_dir: str) -> list[str]:
    """Every `*.safetensors` file in `model_dir`, sorted.

    NOTE: a sharded checkpoint (`model.safetensors.index.json` + `model-0000k-of-0000n.safetensors`) needs no
    index lookup: each parameter lives in exactly one shard, so reading every shard yields each once.
    """
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    return files


def iter_hf_weights(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(transformers name, tensor)` for every parameter of a transformers checkpoint directory,
    in the dtype it was saved in."""
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                if name.endswith(_SKIPPED_SUFFIXES):
                    continue
                yield name, f.get_tensor(name)
