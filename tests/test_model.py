"""The Llama model over the paged cache against transformers' LlamaForCausalLM, on small random configs."""

import pytest
import torch
from transformers import LlamaConfig
from transformers import LlamaForCausalLM as HFLlama

from bento_pagedllm.config import EngineArgs, ModelConfig
from bento_pagedllm.engine import build_model
from bento_pagedllm.model_runner import ModelRunner
from bento_pagedllm.scheduler import ScheduledSequence, StepPlan

from conftest import LLAMA3_ROPE

# Real configs (from the models' config.json files), shrunk only where noted in the small variants below.
LLAMA2_7B = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
                 rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                 rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
                 rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
TINYLLAMA = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                 num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048,
                 rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                    rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True)


@pytest.mark.parametrize("cfg, params", [
    (LLAMA2_7B, 6.74e9), (LLAMA3_8B, 8.03e9), (TINYLLAMA, 1.10e9), (SMOLLM2_135M, 134.5e6),
])
def test_real_configs_parse_with_the_right_size(cfg, params):
    config = ModelConfig.from_hf_config(cfg)
    assert config.head_dim == cfg["hidden_size"] // cfg["num_attention_heads"]
    assert abs(config.num_parameters() - params) / params < 0.01
    assert (config.rope_scaling is not None) == ("rope_scaling" in cfg)
    assert ModelConfig.from_hf_config(config.to_hf_config()) == config


@pytest.mark.parametrize("changes, message", [
    ({"architectures": ["Qwen2ForCausalLM"]}, "unsupported architecture 'Qwen2ForCausalLM'"),
    ({"attention_bias": True}, "attention_bias is set"),
    ({"mlp_bias": True}, "mlp_bias is set"),
    ({"architectures": ["MistralForCausalLM"], "sliding_window": 1024}, "sliding_window 1024 is shorter"),
])
def test_configs_the_engine_would_compute_wrong_are_refused(changes, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_config({**LLAMA3_8B, **changes})
    # Mistral's layers are Llama's while its window does not bind (or it has none)
    for window in (None, LLAMA3_8B["max_position_embeddings"]):
        mistral = ModelConfig.from_hf_config({**LLAMA3_8B, "architectures": ["MistralForCausalLM"],
                                              "sliding_window": window})
        assert mistral.architecture == "MistralForCausalLM"


def test_a_checkpoint_tensor_with_no_place_is_refused(tmp_path):
    """A layer's tensor the model has no parameter for (here a bias) fails the load instead of being dropped."""
    hf, runner = build_pair(SMALL_CONFIGS["llama3"], tmp_path)
    weights = [(name, t) for name, t in hf.state_dict().items()]
    bias = torch.zeros(SMALL_CONFIGS["llama3"]["hidden_size"])
    with pytest.raises(ValueError, match="model.layers.0.self_attn.q_proj.bias: a tensor the Llama"):
        runner.model.load_weights(weights + [("model.layers.0.self_attn.q_proj.bias", bias)])
    runner.model.load_weights(weights + [("model.layers.0.self_attn.rotary_emb.inv_freq", bias)])  # computed here


def small(cfg, **changes):
    """The same architecture family at test size: head counts and ratios kept, widths shrunk."""
    out = dict(cfg, vocab_size=256, num_hidden_layers=2, max_position_embeddings=512, **changes)
    if "rope_scaling" in out:
        out["rope_scaling"] = dict(LLAMA3_ROPE)
    return out


SMALL_CONFIGS = {
    "llama2": small(LLAMA2_7B, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=4),
    "llama3": small(LLAMA3_8B, hidden_size=64, intermediate_size=112, num_attention_heads=8, num_key_value_heads=2),
    "tinyllama": small(TINYLLAMA, hidden_size=128, intermediate_size=176, num_attention_heads=16,
                       num_key_value_heads=2),
    "smollm2": small(SMOLLM2_135M, hidden_size=72, intermediate_size=96, num_attention_heads=9,
                     num_key_value_heads=3),
}


def build_pair(cfg: dict, tmp_path):
    torch.manual_seed(0)
    hf = HFLlama(LlamaConfig(**cfg)).float().eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.1) if p.dim() == 2 else p.uniform_(0.5, 1.5)
    hf.save_pretrained(tmp_path)
    configs = EngineArgs(model=str(tmp_path), dtype="float32", device="cpu", num_kv_blocks=64).create_configs(
        ModelConfig.from_hf_config(cfg), str(tmp_path))
    from bento_pagedllm.loader import resolve_model

    model = build_model(configs, resolve_model(str(tmp_path)))
    return hf, ModelRunner(configs, model)


def run_chunks(runner: ModelRunner, chunks: list[list[tuple[int, list[int], int]]]):
    """Run steps of (seq_id, token_ids, start_pos) with fixed block tables; return per-token logits."""
    logits = []
    for step in chunks:
        seqs = tuple(
            ScheduledSequence(seq_id=sid, token_ids=tuple(toks), start_pos=start,
                              block_table=tuple(range(sid * 16, sid * 16 + 16)), compute_logits=False)
            for sid, toks, start in step
        )
        plan = StepPlan(seqs=seqs, sampling_rows=(), block_copies=(), num_batched_tokens=0, num_preempted=0)
        host = runner._host_inputs(plan)
        input_ids, positions, meta, _, _ = runner._device_inputs(host, host.pending_sources())
        with torch.inference_mode():
            hidden = runner.model(input_ids, positions, runner.kv_caches, meta)
            logits.append(runner.model.compute_logits(hidden))
    return logits


@pytest.mark.parametrize("name", list(SMALL_CONFIGS))
def test_forward_matches_transformers_for_whole_chunked_and_batched_prompts(name, tmp_path):
    hf, runner = build_pair(SMALL_CONFIGS[name], tmp_path)
    torch.manual_seed(1)
    a = torch.randint(0, 256, (37,)).tolist()
    b = torch.randint(0, 256, (5,)).tolist()
    with torch.no_grad():
        ref_a = hf(torch.tensor([a])).logits[0]
        ref_b = hf(torch.tensor([b])).logits[0]
    # one step holding both prompts whole
    (both,) = run_chunks(runner, [[(0, a, 0), (1, b, 0)]])
    torch.testing.assert_close(both[:37], ref_a, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(both[37:], ref_b, atol=1e-4, rtol=1e-4)
    # chunked prefill of a (cached prefix + new tokens), then a mixed step: a decodes while b prefills
    steps = run_chunks(runner, [[(2, a[:20], 0)], [(2, a[20:36], 20), (3, b[:3], 0)], [(2, a[36:], 36), (3, b[3:], 3)]])
    torch.testing.assert_close(steps[0], ref_a[:20], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(steps[1][:16], ref_a[20:36], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(steps[2][0], ref_a[36], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(steps[2][1:], ref_b[3:], atol=1e-4, rtol=1e-4)


def test_dummy_weights_from_a_config_alone(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps(dict(SMALL_CONFIGS["llama3"], architectures=["LlamaForCausalLM"])))
    from bento_pagedllm import LLM, SamplingParams

    llm = LLM(str(tmp_path), load_format="dummy", num_kv_blocks=16, max_model_len=256)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 5 and out.outputs[0].text == ""  # no tokenizer: ids only
    weights = llm.engine.model.layers[0].qkv_proj.cpu_kernel.weight
    assert 0.015 < weights.std().item() < 0.025  # random, not zeros


@pytest.mark.parametrize("parts", [1, 2, 3])
@pytest.mark.parametrize("num_tokens", [1, 5])
@pytest.mark.parametrize("packed", [True, False])
def test_cpu_linear_matches_a_plain_linear(parts, num_tokens, packed):
    """Every form CpuLinear computes with (column blocks at one token, oneDNN's packed weight or the
    blocks at several) equals F.linear; 3 parts do not divide 64 outputs, so one block serves."""
    from bento_pagedllm.models.cpu_linear import CpuLinear

    torch.manual_seed(0)
    weight, x = torch.randn(64, 48), torch.randn(num_tokens, 48)
    layer = CpuLinear(weight, packed=packed, parts=parts)
    assert layer.parts == (1 if parts == 3 else parts)
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, weight), atol=1e-5, rtol=1e-5)
    assert torch.equal(layer.weight, weight)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_by_roll_equals_transformers_rotate_half_bit_for_bit(dtype):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from bento_pagedllm.models.ops import TorchOps, rotate_roll_apply

    torch.manual_seed(0)
    q, k = torch.randn(5, 9, 64, dtype=dtype), torch.randn(5, 3, 64, dtype=dtype)
    positions = torch.tensor([0, 3, 17, 100, 511])
    angles = positions[:, None].float() * torch.rand(32)[None, :]
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()  # [5, 64]
    ops = TorchOps()
    cos_t, sin_signed = ops.rotary_context(torch.arange(5), cos, sin, dtype)
    # transformers: [batch, heads, tokens, head_dim] with cos/sin [batch, tokens, head_dim]
    ref_q, ref_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                        cos.to(dtype)[None], sin.to(dtype)[None])
    assert torch.equal(rotate_roll_apply(q, cos_t, sin_signed), ref_q[0].transpose(0, 1))
    assert torch.equal(rotate_roll_apply(k, cos_t, sin_signed), ref_k[0].transpose(0, 1))
