"""GPU single-stream decode: the engine, transformers' generate (static cache; eager and compiled) and
the memory roofline, in one run on one GPU. Random (dummy) bfloat16 weights.

A 128-token prompt, 256 greedy tokens with eos ignored. Time to first token and decode tokens/s
(first token excluded) are the median of --runs runs after a warm-up. The roofline is weight bytes /
the bandwidth of a large on-device copy (bytes read + written per second).

    python bench/single_stream.py --models llama2-7b llama3-8b smollm2-135m --peers eager,compile \
        --out bench/results/single_stream.json

With `--tensor-parallel-size N` the engine splits the model over GPUs 0..N-1 and the roofline is the
aggregate one (weight bytes / (N x one GPU's copy bandwidth)); the transformers peers stay on one GPU
(use `--peers none` for shapes that do not fit one), e.g. the 70B shape on 4 GPUs:

    python bench/single_stream.py --models llama2-70b --tensor-parallel-size 4 --peers none \
        --out bench/results/single_stream_tp4.json
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import tempfile
import time

import torch

from timeline import idle_fraction

SHAPES = {
    "llama2-7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
                      rms_norm_eps=1e-5, rope_theta=10000.0),
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                      rms_norm_eps=1e-5, rope_theta=500000.0),
    "llama2-70b": dict(vocab_size=32000, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                       num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=4096,
                       rms_norm_eps=1e-5, rope_theta=10000.0),
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                         rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True),
    # NOTE: not a model: one small layer over the workload's vocabulary, so that on the CPU the engine's
    # host work (scheduling, inputs, outputs) is most of a step (bench/serve.py's host.by_seqs)
    "host-probe": dict(vocab_size=32000, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                       rms_norm_eps=1e-5, rope_theta=10000.0),
}
PROMPT, NEW = 128, 256


def single_stream_prompt() -> list[int]:
    """The benchmark's prompt: PROMPT random token ids, the same in every run and for every peer."""
    return torch.randint(100, 30000, (PROMPT,), generator=torch.Generator().manual_seed(0)).tolist()


def copy_bandwidth() -> float:
    """Bytes read + written per second by a 4 GiB device-to-device copy."""
    src = torch.empty(1 << 30, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / 10
    del src, dst
    return 2 * (1 << 32) / seconds


def config_dir(shape: dict) -> str:
    path = tempfile.mkdtemp()
    cfg = dict(shape, architectures=["LlamaForCausalLM"], model_type="llama", torch_dtype="bfloat16",
               bos_token_id=1, eos_token_id=2, tie_word_embeddings=shape.get("tie_word_embeddings", False))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


def bench_engine(path: str, prompt: list[int], runs: int, profile_path: str | None = None,
                 tensor_parallel_size: int = 1, peer_all_reduce: bool = True, **engine_options) -> dict:
    """engine_options: further EngineArgs; those left out keep the engine's defaults."""
    from bento_pagedllm import LLM, SamplingParams

    torch.cuda.synchronize()
    start = time.perf_counter()
    llm = LLM(path, load_format="dummy", dtype="bfloat16", device="cuda", tensor_parallel_size=tensor_parallel_size,
              peer_all_reduce=peer_all_reduce, **engine_options)
    torch.cuda.synchronize()
    startup = time.perf_counter() - start
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    llm.generate([prompt], params)
    ttft, decode = [], []
    for _ in range(runs):
        m = llm.generate([prompt], params)[0].metrics
        ttft.append(m.first_token_time - m.arrival_time)
        decode.append((NEW - 1) / (m.finished_time - m.first_token_time))
    graphs = llm.engine.runner.graphs
    mixed = llm.engine.runner.mixed_graphs
    result = {"startup_s": startup, "graph_capture_s": graphs.capture_seconds if graphs else None,
              "mixed_graph_capture_s": mixed.capture_seconds if mixed else None,
              "ttft_s": statistics.median(ttft), "decode_tok_s": statistics.median(decode),
              "async_scheduling": llm.engine.configs.async_scheduling,
              "fused_gemv_rows": llm.engine.configs.fused_gemv_rows,
              "dependent_launch": llm.engine.configs.dependent_launch,
              "measured_tiles": llm.engine.configs.measured_tiles}
    if torch.cuda.is_available():  # the projections' tile configurations this process's autotuner chose
        from bento_pagedllm.kernels import gemv

        result["tuned_configs"] = gemv.tuned_configs()
    # where a step's time goes: the device's busy time per step and its idle time between steps
    llm.engine.runner.timeline = []
    llm.generate([prompt], params)
    result["gpu_timeline"] = idle_fraction(llm.engine.runner.timeline)
    llm.engine.runner.timeline = None
    if profile_path:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            llm.generate([prompt], SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
        with open(profile_path, "w") as f:
            f.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40))
        prof.export_chrome_trace(profile_path.replace(".txt", ".trace.json"))  # the steps' timeline, gaps included
    llm.engine.shutdown()  # the tensor-parallel workers, if any
    del llm, graphs, mixed  # NOTE: every reference: the graphs hold the runner (and its KV cache)
    gc.collect()  # NOTE: the engine holds cycles (scheduler callbacks); free its KV cache before the next model
    torch.cuda.empty_cache()
    return result


def bench_transformers(path: str, prompt: list[int], runs: int, compiled: bool) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("cuda"):  # NOTE: random init on the GPU: a minute on the CPU for a 7B model
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.bfloat16).eval()
    # NOTE: with a static cache, generate compiles the decoding forward itself (its CompileConfig:
    # inductor, fullgraph, CUDA graphs); `disable_compile` gives the eager path
    ids = torch.tensor([prompt], device="cuda")

    def generate(new: int) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0,
                       cache_implementation="static", disable_compile=not compiled)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    start = time.perf_counter()
    generate(NEW)  # warm-up (and compilation)
    generate(1)
    warmup = time.perf_counter() - start
    result = time_generate(generate, runs)
    del model
    torch.cuda.empty_cache()
    return {"warmup_s": warmup, **result}


def time_generate(generate, runs: int) -> dict:
    """A peer timed from outside: `generate(n)` returns the seconds to generate n tokens; time to first token
    is a 1-token call, decode tokens/s 255 over (a 256-token call minus that), medians of `runs`."""
    ttft, decode = [], []
    for _ in range(runs):
        first = generate(1)
        full = generate(NEW)
        ttft.append(first)
        decode.append((NEW - 1) / (full - first))
    return {"ttft_s": statistics.median(ttft), "decode_tok_s": statistics.median(decode)}


def bench_vllm(shape: str, runs: int, requests: str | None, out_dir: str) -> dict:
    """vLLM on the same shape and prompt, in its own process (bench/vllm_peer.py: vLLM is no dependency of
    the project; VLLM_PYTHONPATH, if set, goes first on that process's PYTHONPATH); with `requests`, the
    same process then runs that workload offline. Started after the engine has freed the GPU."""
    import subprocess
    import sys

    out = os.path.join(out_dir, f"vllm_{shape}.json")
    env = dict(os.environ)
    if os.environ.get("VLLM_PYTHONPATH"):
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.environ["VLLM_PYTHONPATH"], env.get("PYTHONPATH")]))
    command = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_peer.py"),
               "--shape", shape, "--runs", str(runs), "--out", out] + (["--requests", requests] if requests else [])
    if subprocess.run(command, env=env).returncode != 0:  # NOTE: the engine's figures are kept either way
        return {"error": f"vllm_peer.py failed: {' '.join(command)}"}
    with open(out) as f:
        result = json.load(f)
    return dict(result.pop("single_stream"), **result)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", nargs="+", default=list(SHAPES))
    parser.add_argument("--peers", default="eager,compile",
                        help="peers to run, comma-separated: eager and compile (transformers), vllm; or none")
    parser.add_argument("--vllm-requests", default=None,
                        help="with the vllm peer: its process also runs this workload offline (serve.py's JSONL)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", default=None)
    parser.add_argument("--profile-dir", default=None, help="write a torch.profiler table per model here")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs the engine splits the model over")
    parser.add_argument("--peer-all-reduce", action="store_true", help="tensor parallelism: small all-reduces through peer memory")
    parser.add_argument("--fused-gemv-rows", type=int, default=None,
                        help="EngineArgs.fused_gemv_rows (default: the engine's); 0: projections through cuBLAS and separate norm/activation kernels")
    parser.add_argument("--no-dependent-launch", action="store_true",
                        help="EngineArgs.dependent_launch=False: decode kernels in plain stream order")
    add_tile_arguments(parser)
    args = parser.parse_args()
    tile_options = apply_tile_arguments(args)
    if args.profile_dir:
        os.makedirs(args.profile_dir, exist_ok=True)
    bandwidth = copy_bandwidth()
    prompt = single_stream_prompt()
    results = {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
               "torch": torch.__version__, "copy_bandwidth_tbs": bandwidth / 1e12,
               "tensor_parallel_size": args.tensor_parallel_size, "peer_all_reduce": args.peer_all_reduce,
               "pinned_tiles": args.pin_tiles, "models": {}}
    for name in args.models:
        path = config_dir(SHAPES[name])
        from bento_pagedllm.config import ModelConfig

        weight_bytes = ModelConfig.from_hf_config(json.load(open(os.path.join(path, "config.json")))).num_parameters() * 2
        # NOTE: N ranks stream their 1/N of the weights in parallel: the aggregate roofline
        entry = {"weight_bytes": weight_bytes, "roofline_tok_s": args.tensor_parallel_size * bandwidth / weight_bytes}
        profile_path = os.path.join(args.profile_dir, f"profile_{name}.txt") if args.profile_dir else None
        options = {} if args.fused_gemv_rows is None else {"fused_gemv_rows": args.fused_gemv_rows}
        if args.no_dependent_launch:
            options["dependent_launch"] = False
        options.update(tile_options)
        entry["engine"] = bench_engine(path, prompt, args.runs, profile_path, args.tensor_parallel_size,
                                       peer_all_reduce=args.peer_all_reduce, **options)
        results["models"][name] = entry
        for peer in [p for p in args.peers.split(",") if p in ("eager", "compile")]:
            save(results, args.out)  # NOTE: what is measured so far survives a time limit
            entry[f"transformers_{peer}"] = bench_transformers(path, prompt, args.runs, compiled=peer == "compile")
            print(json.dumps({name: {peer: entry[f"transformers_{peer}"]}}), flush=True)
        if "vllm" in args.peers.split(","):
            save(results, args.out)
            entry["vllm"] = bench_vllm(name, args.runs, args.vllm_requests,
                                       os.path.dirname(os.path.abspath(args.out)) if args.out else tempfile.mkdtemp())
        ours = entry["engine"]["decode_tok_s"]
        entry["ratios"] = {"engine_vs_roofline": ours / entry["roofline_tok_s"], **{
            f"engine_vs_{k}": ours / v["decode_tok_s"] for k, v in entry.items()
            if (k.startswith("transformers_") or k == "vllm") and "decode_tok_s" in v}}
        if "decode_tok_s" in entry.get("vllm", {}):
            entry["ratios"]["vllm_vs_roofline"] = entry["vllm"]["decode_tok_s"] / entry["roofline_tok_s"]
        print(json.dumps({name: entry}, indent=2), flush=True)
    save(results, args.out)


def add_tile_arguments(parser: argparse.ArgumentParser) -> None:
    """The tile flags of the engine benchmarks (this one, serve.py): which projection tiles the engine runs."""
    parser.add_argument("--no-measured-tiles", action="store_true",
                        help="EngineArgs.measured_tiles=False: autotune every projection, this GPU's tile table unused")
    parser.add_argument("--pin-tiles", default=None,
                        help="kernels/gemv.py's tuned_configs() of an earlier process (or a tile_search.py result): "
                             "launch with those tiles, untimed (this process's kernels: tensor-parallel workers tune their own)")


def apply_tile_arguments(args) -> dict:
    """Pin `--pin-tiles`' table in this process; the EngineArgs the flags ask for. NOTE: with pins of its
    own the engine must not pin its GPU's table over them."""
    if args.pin_tiles:
        from bento_pagedllm.kernels import gemv

        gemv.pin_tiles(gemv.load_tile_table(args.pin_tiles))
    return {"measured_tiles": False} if args.pin_tiles or args.no_measured_tiles else {}


def device_facts(bandwidth: float) -> dict:
    """The machine a kernel benchmark ran on, for its JSON."""
    import triton

    return {"copy_bandwidth_tbs": bandwidth / 1e12, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__}


def save(results: dict, out: str | None) -> None:
    if out:
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        with open(out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
