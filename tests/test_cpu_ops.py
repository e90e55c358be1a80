"""The CPU's native fused operators (kernels/cpu_ops.cpp) against their pure-torch references.

Random inputs of several shapes: GQA ratios 1 to 8, block sizes 16 and 32, contexts from 1 to 2,000
tokens, ragged batches, block tables that are random permutations of the cache (a kernel that ignores
the table cannot pass by luck), padding slots, and q/k/v as the strided views the model passes.
"""

from __future__ import annotations

import pytest
import torch

from bento_pagedllm.attention import AttentionMetadata, NativeCpuAttentionBackend, TorchAttentionBackend
from bento_pagedllm.kernels import cpu_ops
from bento_pagedllm.models.ops import NativeCpuOps, TorchOps
from bento_pagedllm.sampling_params import SamplingParams

if not cpu_ops.load():  # pragma: no cover - the machines this project tests on have a compiler
    pytest.skip("the native CPU operators could not be built (no C++ compiler?)", allow_module_level=True)

NATIVE, REFERENCE = NativeCpuOps(), TorchOps()


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("hidden", [64, 576, 1000])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_matches_the_reference(rows, hidden, with_residual):
    g = generator(rows * hidden)
    x = torch.randn(rows, hidden, generator=g) * 3
    residual = torch.randn(rows, hidden, generator=g) if with_residual else None
    weight = torch.rand(hidden, generator=g) + 0.5
    out, total = NATIVE.add_rms_norm(x, residual, weight, 1e-5)
    ref_out, ref_total = REFERENCE.add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(total, ref_total)  # the add is exact
    torch.testing.assert_close(out, ref_out, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("num_tokens", [1, 5])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 8, 32), (16, 2, 128)])
def test_rotary_and_store_kv_is_bit_identical_to_the_reference(num_tokens, heads, kv_heads, head_dim):
    g = generator(num_tokens * heads + head_dim)
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    # the model's q, k, v: strided column views of one fused projection
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, generator=g)
    q, k, v = (t.view(num_tokens, -1, head_dim) for t in qkv.split([q_size, kv_size, kv_size], dim=-1))
    angles = torch.rand(64, head_dim // 2, generator=g) * 100
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)  # [positions, head_dim]
    positions = torch.randint(0, 64, (num_tokens,), generator=g)
    slots = torch.randperm(6 * 16, generator=g)[:num_tokens]
    if num_tokens > 1:
        slots[-1] = -1  # a padding token stores nothing
    caches = {}
    for name, ops in (("native", NATIVE), ("reference", REFERENCE)):
        kv_cache = (torch.zeros(6, 16, kv_heads, head_dim), torch.zeros(6, 16, kv_heads, head_dim))
        context = ops.rotary_context(positions, cos, sin, torch.float32)
        caches[name] = (ops.rotary_and_store_kv(q, k, v, kv_cache, context, slots), *kv_cache)
    for native, reference in zip(caches["native"], caches["reference"]):
        assert torch.equal(native.reshape(reference.shape), reference)
    assert caches["native"][1].abs().sum() > 0


@pytest.mark.parametrize("num_tokens,width", [(1, 1536), (4, 100)])
def test_silu_and_mul_matches_the_reference(num_tokens, width):
    x = torch.randn(num_tokens, 2 * width, generator=generator(width)) * 4
    torch.testing.assert_close(NATIVE.silu_and_mul(x), REFERENCE.silu_and_mul(x), rtol=1e-6, atol=1e-6)


def metadata(query_lens, seq_lens, block_size, num_blocks, g) -> AttentionMetadata:
    """A step's metadata with each sequence's blocks drawn at random from the whole cache."""
    max_blocks = max(-(-n // block_size) for n in seq_lens)
    tables = torch.stack([torch.randperm(num_blocks, generator=g)[:max_blocks] for _ in seq_lens]).int()
    starts = torch.tensor([0] + list(query_lens)).cumsum(0).int()
    decodes = [i for i, n in enumerate(query_lens) if n == 1]
    return AttentionMetadata(
        slot_mapping=torch.zeros(sum(query_lens), dtype=torch.long),  # unused: the cache is already filled
        query_start_loc=starts, seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=tables,
        query_lens_host=tuple(query_lens), seq_lens_host=tuple(seq_lens),
        decode_indices=torch.tensor(decodes, dtype=torch.long),
        decode_token_indices=starts[:-1][decodes].long(), decode_indices_host=tuple(decodes),
    )


@pytest.mark.parametrize("group,num_kv_heads", [(1, 4), (3, 3), (4, 2), (8, 1)])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("query_lens,seq_lens", [
    ((1,), (1,)),
    ((1,), (300,)),
    ((1, 1, 1, 1), (5, 2000, 33, 16)),  # ragged decodes, one long enough to use the threads
    ((1, 7, 1, 40), (90, 7, 1, 100)),   # decodes mixed with a whole prompt and a prefill chunk
])
def test_attention_matches_the_reference(group, num_kv_heads, block_size, query_lens, seq_lens):
    g = generator(sum(seq_lens) + group + block_size)
    head_dim, num_blocks = 64, 160
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    q = torch.randn(sum(query_lens), group * num_kv_heads, head_dim, generator=g)
    meta = metadata(query_lens, seq_lens, block_size, num_blocks, g)
    scale = head_dim**-0.5
    native = NativeCpuAttentionBackend().forward(q, (k_cache, v_cache), meta, scale)
    reference = TorchAttentionBackend().forward(q, (k_cache, v_cache), meta, scale)
    torch.testing.assert_close(native, reference, rtol=1e-5, atol=1e-5)


def test_bad_inputs_are_refused_not_read_out_of_bounds():
    k_cache = v_cache = torch.zeros(2, 16, 1, 64)
    q = torch.zeros(1, 1, 64)
    with pytest.raises(RuntimeError, match="does not fit"):  # a context longer than its block table
        torch.ops.pagedllm_cpu.decode_attention(q, k_cache, v_cache, torch.zeros(1, 2, dtype=torch.int32),
                                                torch.tensor([33], dtype=torch.int32), 1.0)
    with pytest.raises(RuntimeError, match="outside the cache"):
        torch.ops.pagedllm_cpu.rotary_and_store_kv(q, q, q, k_cache, v_cache, torch.tensor([32]),
                                                   torch.ones(1, 64), torch.zeros(1, 64))
    with pytest.raises(RuntimeError, match="float32"):
        NATIVE.silu_and_mul(torch.zeros(1, 8, dtype=torch.bfloat16))


@pytest.mark.parametrize("native_cpu_ops,dtype", [(True, "float32"), (False, "float32"), (True, "bfloat16")])
def test_the_engine_uses_the_native_operators_in_float32_unless_told_not_to(tiny_llama3_dir, native_cpu_ops, dtype):
    from bento_pagedllm import EngineArgs, LLMEngine, SamplingParams

    engine = LLMEngine(EngineArgs(model=tiny_llama3_dir, dtype=dtype, device="cpu", num_kv_blocks=8,
                                  max_model_len=128, native_cpu_ops=native_cpu_ops))
    native = native_cpu_ops and dtype == "float32"  # NOTE: the native operators are float32 only
    assert isinstance(engine.model.ops, NativeCpuOps) is native
    assert isinstance(engine.model.backend, NativeCpuAttentionBackend) is native
    engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    finished = []
    while engine.has_unfinished_requests():
        finished += [out for out in engine.step() if out.finished]
    assert len(finished[0].outputs[0].token_ids) == 3


def test_one_token_layers_give_the_same_bits_as_the_layer_by_layer_path(tiny_llama3_dir):
    """The native whole-layer call chains the same kernels in the same order as LlamaDecoderLayer.forward."""
    from bento_pagedllm import LLM

    llm = LLM(tiny_llama3_dir, dtype="float32", device="cpu", num_kv_blocks=16, max_model_len=128,
              enable_prefix_caching=False)
    assert llm.engine.model.one_token_weights is not None
    prompt, params = [[7, 8, 9, 10, 11]], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=2)
    fused = llm.generate(prompt, params)[0].outputs[0]
    llm.engine.model.one_token_weights = None
    layered = llm.generate(prompt, params)[0].outputs[0]
    assert fused.token_ids == layered.token_ids
    assert [lp.logprob for lp in fused.logprobs] == [lp.logprob for lp in layered.logprobs]
