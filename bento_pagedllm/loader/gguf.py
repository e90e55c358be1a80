"""Load llama.cpp GGUF checkpoints: config from metadata, float32 weights under transformers' names.

GGUF stores tensors in llama.cpp's layout, which differs from transformers' in three ways that this module
undoes: names (`blk.0.attn_q.weight`), shapes (reversed: ggml lists the fastest-varying dimension first) and a
row permutation of `attn_q` / `attn_k` for llama.cpp's interleaved rotary embedding. Quantised blocks are
expanded with the `gguf` package's own `gguf.quants.dequantize`, so every type it supports works here.

`convert_gguf_to_hf` writes a plain transformers directory (weights, config, tokenizer) so that any HF tool
can read what the engine serves.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import gguf
import numpy as np
import torch
from tqdm.auto import tqdm

from ..config import ModelConfig
from .gguf_rope import llama3_scaling_from_metadata, llama3_scaling_from_rope_freqs

SUPPORTED_ARCHITECTURES = ("llama",)

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# NOTE: tensors that carry configuration, not parameters; read_gguf_config consumes them.
_CONFIG_TENSORS = frozenset({"rope_freqs.weight"})
# Plain integer / double tensors, which gguf.quants.dequantize does not handle.
_PLAIN_TYPES = frozenset(
    {
        gguf.GGMLQuantizationType.I8,
        gguf.GGMLQuantizationType.I16,
        gguf.GGMLQuantizationType.I32,
        gguf.GGMLQuantizationType.I64,
        gguf.GGMLQuantizationType.F64,
    }
)


# ---- reading ---------------------------------------------------------------------------------------------


def _file_key(path: str) -> tuple[str, int, int]:
    """Identity of a file's contents for caching: absolute path, size and modification time."""
    path = os.path.abspath(path)
    st = os.stat(path)
    return path, st.st_size, st.st_mtime_ns


@functools.lru_cache(maxsize=4)
def _cached_reader(path: str, size: int, mtime_ns: int) -> gguf.GGUFReader:
    return gguf.GGUFReader(path, "r")


def _reader(path: str) -> gguf.GGUFReader:
    """A memory-mapped reader, shared between calls on an unchanged file.

    NOTE: parsing the metadata takes seconds (the tokenizer's vocabulary is tens of thousands of fields),
    and config, weights and conversion each need it; the reader is read-only, so sharing it is safe.
    """
    return _cached_reader(*_file_key(path))


def _field(reader: gguf.GGUFReader, key: str) -> Any:
    """A metadata value as a Python object, or None when absent."""
    field = reader.get_field(key)
    return None if field is None else field.contents()


def _float32_value(value: float) -> float:
    """The shortest decimal that rounds to the same float32 (GGUF stores 1e-5 as 9.99999974e-06)."""
    return float(np.format_float_positional(np.float32(value), unique=True, trim="-"))


def read_gguf_config(path: str) -> ModelConfig:
    """The model architecture from a GGUF file's `llama.*` and `tokenizer.ggml.*` metadata."""
    return _config_from_reader(_reader(path))


def _config_from_reader(reader: gguf.GGUFReader) -> ModelConfig:
    arch = _field(reader, gguf.Keys.General.ARCHITECTURE)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {SUPPORTED_ARCHITECTURES}")

    def key(template: str) -> Any:
        return _field(reader, template.format(arch=arch))

    def required(template: str) -> Any:
        value = key(template)
        if value is None:
            raise ValueError(f"GGUF metadata lacks {template.format(arch=arch)!r}")
        return value

    tensor_names = {t.name for t in reader.tensors}
    vocab_size = key(gguf.Keys.LLM.VOCAB_SIZE)
    if vocab_size is None:
        tokens = reader.get_field(gguf.Keys.Tokenizer.LIST)
        if tokens is None:
            raise ValueError("GGUF metadata has neither a vocab_size nor a token list")
        vocab_size = len(tokens.data)
    head_dim = key(gguf.Keys.Attention.KEY_LENGTH) or key(gguf.Keys.Rope.DIMENSION_COUNT)
    hidden = int(required(gguf.Keys.LLM.EMBEDDING_LENGTH))
    n_heads = int(required(gguf.Keys.Attention.HEAD_COUNT))
    rope_theta = _float32_value(key(gguf.Keys.Rope.FREQ_BASE) or 10000.0)

    scaling = llama3_scaling_from_metadata(key, arch)
    if scaling is None and "rope_freqs.weight" in tensor_names:
        # NOTE: llama.cpp writes Llama-3.1's scaling as this tensor, not as metadata.
        (rope_freqs,) = [t for t in reader.tensors if t.name == "rope_freqs.weight"]
        scaling = llama3_scaling_from_rope_freqs(
            _dequantize(rope_freqs), int(head_dim or hidden // n_heads), rope_theta
        )

    # Instruct models end turns with an end-of-turn (or end-of-message) token rather than end-of-text;
    # both must stop generation, as transformers' `generation_config.json` lists them.
    eos_ids: list[int] = []
    for template in (gguf.Keys.Tokenizer.EOS_ID, gguf.Keys.Tokenizer.EOT_ID, gguf.Keys.Tokenizer.EOM_ID):
        token = key(template)
        if token is not None and int(token) not in eos_ids:
            eos_ids.append(int(token))
    bos = key(gguf.Keys.Tokenizer.BOS_ID)
    eps = key(gguf.Keys.Attention.LAYERNORM_RMS_EPS)

    return ModelConfig(
        vocab_size=int(vocab_size),
        hidden_size=hidden,
        intermediate_size=int(required(gguf.Keys.LLM.FEED_FORWARD_LENGTH)),
        num_hidden_layers=int(required(gguf.Keys.LLM.BLOCK_COUNT)),
        num_attention_heads=n_heads,
        num_key_value_heads=int(key(gguf.Keys.Attention.HEAD_COUNT_KV) or n_heads),
        max_position_embeddings=int(key(gguf.Keys.LLM.CONTEXT_LENGTH) or 2048),
        rms_norm_eps=_float32_value(eps) if eps is not None else 1e-6,
        rope_theta=rope_theta,
        rope_scaling=scaling,
        tie_word_embeddings="output.weight" not in tensor_names,
        head_dim=int(head_dim) if head_dim else None,
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_id=tuple(eos_ids),
    )


# ---- weights ---------------------------------------------------------------------------------------------


def hf_name(gguf_name: str) -> str:
    """The transformers parameter name of a llama GGUF tensor (`blk.3.attn_q.weight` ->
    `model.layers.3.self_attn.q_proj.weight`); KeyError for tensors this engine does not know."""
    if m := _BLOCK_RE.fullmatch(gguf_name):
        layer, kind, suffix = m.groups()
        if kind in _BLOCK_NAMES:
            return f"model.layers.{layer}.{_BLOCK_NAMES[kind]}.{suffix}"
    else:
        base, _, suffix = gguf_name.rpartition(".")
        if base in _GLOBAL_NAMES and suffix in ("weight", "bias"):
            return f"{_GLOBAL_NAMES[base]}.{suffix}"
    raise KeyError(f"unknown GGUF tensor {gguf_name!r}")


def permute_rotary(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's `LlamaModel.permute` (convert_hf_to_gguf.py): within each head, interleave the two
    rotary halves' rows. Kept here as the reference that `unpermute_rotary` inverts."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_rotary(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of `permute_rotary`: back to transformers' half-split rotary layout.

    NOTE: `n_head` is `num_attention_heads` for q and `num_key_value_heads` for k, as in llama.cpp.
    """
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _dequantize(tensor: gguf.ReaderTensor) -> np.ndarray:
    """A GGUF tensor as a float32 array in torch's dimension order ([out, in])."""
    if tensor.tensor_type in _PLAIN_TYPES:
        array = np.asarray(tensor.data).astype(np.float32)
    else:
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
    array = np.ascontiguousarray(array, dtype=np.float32).reshape(shape)
    # NOTE: F32 tensors come back as views of the read-only memory map; torch wants writable memory.
    return array if array.flags.writeable else array.copy()


def iter_gguf_weights(path: str, progress: bool | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(transformers name, float32 tensor)` for every parameter in a llama GGUF file.

    `progress=None` shows a tqdm bar only on a terminal; True / False force it on / off.
    """
    reader = _reader(path)
    config = _config_from_reader(reader)
    heads = {"self_attn.q_proj": config.num_attention_heads, "self_attn.k_proj": config.num_key_value_heads}
    tensors = [t for t in reader.tensors if t.name not in _CONFIG_TENSORS]
    disable = None if progress is None else not progress
    for tensor in tqdm(tensors, desc=f"Loading {os.path.basename(path)}", unit="tensor", disable=disable):
        name = hf_name(tensor.name)
        weight = torch.from_numpy(_dequantize(tensor))
        for proj, n_head in heads.items():
            if f".{proj}." in name:
                weight = unpermute_rotary(weight, n_head)
        yield name, weight


# ---- conversion ------------------------------------------------------------------------------------------


def convert_gguf_to_hf(
    gguf_path: str, out_dir: str, dtype: torch.dtype = torch.float32, overwrite: bool = False
) -> str:
    """Write a self-contained transformers directory for a GGUF file and return `out_dir`.

    It holds `config.json`, `model.safetensors` (no `lm_head` when embeddings are tied), the tokenizer
    converted from the GGUF's own vocabulary (with its chat template) and `generation_config.json`.

    NOTE: the directory appears atomically (built beside `out_dir`, then renamed), so a crash never leaves a
    half-written model. An existing non-empty `out_dir` is replaced only with `overwrite=True`. All weights
    are held in memory at once, which suits the small and medium models this engine serves.
    """
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    out_dir = os.path.abspath(out_dir)
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not overwrite:
        raise FileExistsError(f"{out_dir} exists and is not empty (pass overwrite=True to replace it)")
    config = read_gguf_config(gguf_path)
    os.makedirs(os.path.dirname(out_dir), exist_ok=True)
    tmp = _mkdtemp_beside(out_dir)
    try:
        # Tokenizer first: it is cached, and a GGUF without one fails before the weights are expanded.
        tokenizer_dir = gguf_tokenizer_dir(gguf_path)
        for name in os.listdir(tokenizer_dir):
            shutil.copy2(os.path.join(tokenizer_dir, name), tmp)
        state = {
            name: weight.to(dtype)
            for name, weight in iter_gguf_weights(gguf_path)
            if not (config.tie_word_embeddings and name == "lm_head.weight")
        }
        save_file(state, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        del state
        hf_config = config.to_hf_config() | {"torch_dtype": str(dtype).removeprefix("torch.")}
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(hf_config, f, indent=2)
        eos = list(config.eos_token_id)
        GenerationConfig(
            bos_token_id=config.bos_token_id, eos_token_id=eos[0] if len(eos) == 1 else eos
        ).save_pretrained(tmp)
        _replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _mkdtemp_beside(path: str) -> str:
    """A fresh hidden directory next to `path` (same filesystem, so renaming it onto `path` is atomic)."""
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.tmp-", dir=os.path.dirname(path))
    os.chmod(tmp, 0o755)  # mkdtemp makes it owner-only; the result should read like any other directory
    return tmp


def _replace_dir(src: str, dst: str) -> None:
    """Move directory `src` to `dst`, replacing whatever is at `dst`."""
    if os.path.isdir(dst) and os.listdir(dst):
        trash = tempfile.mkdtemp(prefix=f".{os.path.basename(dst)}.old-", dir=os.path.dirname(dst))
        os.replace(dst, os.path.join(trash, "old"))
        os.replace(src, dst)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(src, dst)  # an empty directory is replaced atomically by rename(2)


# ---- tokenizer -------------------------------------------------------------------------------------------


def _cache_root() -> str:
    """`$BENTO_PAGEDLLM_CACHE`, else `~/.cache/bento_pagedllm`."""
    return os.environ.get("BENTO_PAGEDLLM_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "bento_pagedllm"
    )


def gguf_tokenizer_dir(gguf_path: str) -> str:
    """A directory holding the transformers tokenizer converted from a GGUF file's metadata.

    Conversion (transformers' GGUF tokenizer converter) takes seconds, so the result is cached under
    `<cache root>/tokenizers/<sha256 of abspath, size, mtime>/`: a changed file gets a fresh conversion.

    NOTE: written to a temporary directory and renamed into place, so concurrent processes either see a
    complete tokenizer or none; when two race, the loser's copy is discarded.
    """
    from transformers import AutoTokenizer

    key = "\0".join(str(part) for part in _file_key(gguf_path))
    digest = hashlib.sha256(key.encode()).hexdigest()[:32]
    target = os.path.join(_cache_root(), "tokenizers", digest)
    if os.path.isfile(os.path.join(target, "tokenizer_config.json")):
        return target
    if _reader(gguf_path).get_field(gguf.Keys.Tokenizer.LIST) is None:
        raise ValueError(f"{gguf_path} has no tokenizer in its metadata")
    os.makedirs(os.path.dirname(target), exist_ok=True)
    tmp = _mkdtemp_beside(target)
    try:
        abspath = os.path.abspath(gguf_path)
        folder, name = os.path.split(abspath)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        tokenizer.save_pretrained(tmp)
        try:
            os.replace(tmp, target)
        except OSError:
            if not os.path.isfile(os.path.join(target, "tokenizer_config.json")):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
