"""Tensor parallelism on 2 GPUs (NCCL), with the GPU path's CUDA graphs and async scheduling, against one
GPU. Skipped visibly where fewer than 2 GPUs are visible; run it on the nvidia-h200-x2 machine.

The workload is the CPU test's (`tests/test_tensor_parallel.py`: chunked prefill, preemption, prefix hits,
a seeded n=2 request); in float32 the token ids must be identical and the log-probabilities within 1e-4
(the all-reduce adds the two ranks' partial sums in another order than one GPU's GEMM does).
"""

from __future__ import annotations

import pytest
import torch

from test_tensor_parallel import assert_same, run, save_tiny

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs: run on nvidia-h200-x2")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    """The CPU test's checkpoint with head_dim 16 (the Triton kernels' smallest) instead of 8."""
    return save_tiny(tmp_path_factory.mktemp("tiny_tp_gpu"), hidden_size=128)


def test_tp2_on_two_gpus_matches_one_gpu(tiny_dir):
    llm, reference, _ = run(tiny_dir, device="cuda", dtype="float32")
    assert llm.engine.runner.graphs is not None and llm.engine.configs.async_scheduling
    llm.engine.shutdown()
    del llm
    for peer_all_reduce in (True, False):  # NVLink peer memory for small messages, or NCCL for all
        llm, result, stats = run(tiny_dir, device="cuda", dtype="float32", tensor_parallel_size=2,
                                 peer_all_reduce=peer_all_reduce)
        assert (llm.engine.workers.parallel.peer_all_reduce is not None) is peer_all_reduce
        assert stats["preemptions"] > 0 and stats["prefix_hits"] > 0
        assert llm.engine.runner.kv_cache.shape[-2] == 2  # rank 0 holds 2 of the 4 KV heads
        assert_same(result, reference, logprob_tolerance=1e-4)
        llm.engine.shutdown()
        del llm
