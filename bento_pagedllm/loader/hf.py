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
