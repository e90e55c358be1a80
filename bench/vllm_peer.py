"""vLLM beside the engine, on the same GPU in the same call: the peer that issues 4 and 5 name.

vLLM is not a dependency of the project: on the GPU machine it travels as a trimmed package
(`bench/vllm_pack.sh` makes it, `bench/h200_session.sh vllm` unpacks it), so this file runs in its own
process with vLLM on PYTHONPATH. It measures what bench/single_stream.py and bench/serve.py
measure for the engine, on the same inputs, with vLLM's defaults (V1 engine, FlashAttention 3,
torch.compile, full CUDA graphs, prefix caching, chunked prefill), random (`dummy`) bfloat16 weights:

- single stream: the same 128-token prompt, 256 greedy tokens with eos ignored; time to first token is a
  `generate` of one token, decode tokens/s is 255 over (a 256-token `generate` minus that), the median of
  --runs runs after a warm-up (transformers' peer in single_stream.py is timed the same way);
- offline: every request of --requests at once through one `generate`, each with its own `max_tokens`,
  after a warm-up of the workload's first requests (as serve.py warms the engine). Only the whole run's
  time is known, so latencies are end to end.
- async (--async-requests, instead of the two above): vLLM's AsyncLLM in-process with the settings
  `vllm serve` takes (its API server's defaults), each request sent at its arrival time and streamed token
  by token, as serve.py's `--mode async` drives the engine's AsyncLLMEngine (same replay, same report);
  the files run one after another through one engine, each after the same warm-up.

    PYTHONPATH=/tmp/vllm:/tmp/vsite python bench/vllm_peer.py --shape llama2-7b --runs 3 \
        --requests bench/data/requests.jsonl --out vllm_llama2-7b.json
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling bench modules

from serve import load, replay, report, warm_up_requests  # noqa: E402
from single_stream import NEW, SHAPES, config_dir, save, single_stream_prompt, time_generate  # noqa: E402


def greedy(max_tokens: int, stream: bool = False):
    """`stream`: each output carries only the tokens new since the last one (what a streaming client reads)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False, output_kind=kind)


def single_stream(llm, runs: int) -> dict:
    prompt = {"prompt_token_ids": single_stream_prompt()}

    def generate(new: int) -> float:
        start = time.perf_counter()
        out = llm.generate([prompt], greedy(new), use_tqdm=False)
        elapsed = time.perf_counter() - start
        assert len(out[0].outputs[0].token_ids) == new, "eos is ignored: every token is generated"
        return elapsed

    generate(NEW)  # warm-up
    return dict(time_generate(generate, runs), runs=runs)


def offline(llm, requests: list[dict]) -> dict:
    def prompts_and_params(batch):
        return [{"prompt_token_ids": r["prompt_ids"]} for r in batch], [greedy(r["max_tokens"]) for r in batch]

    llm.generate(*prompts_and_params(warm_up_requests(requests)), use_tqdm=False)
    prompts, params = prompts_and_params(requests)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    end = time.perf_counter()
    records = []
    for r, out in zip(requests, outputs):
        generated = len(out.outputs[0].token_ids)
        # NOTE: one `generate` returns every output at its end: each token's time is the run's end
        records.append({"ok": generated == r["max_tokens"], "start": start, "tokens": [end] * generated,
                        "prompt_len": len(r["prompt_ids"])})
    return report(records, end - start, {"peer": "vLLM offline LLM.generate, all requests at t=0",
                                         "latencies": "end to end only (one generate call)"})


def run_async(path: str, files: list[str]) -> tuple[object, dict]:
    """Each file's requests at their arrival times through one AsyncLLM; (the engine, {file: report})."""
    import asyncio

    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=path, load_format="dummy", skip_tokenizer_init=True,
                                                       dtype="bfloat16"),
                                       usage_context=UsageContext.OPENAI_API_SERVER)

    request_ids = itertools.count()  # NOTE: unique across the warm-ups and the files' runs

    async def send(r, record):
        async for out in engine.generate({"prompt_token_ids": r["prompt_ids"]}, greedy(r["max_tokens"], stream=True),
                                         request_id=str(next(request_ids))):
            record["tokens"] += [time.perf_counter()] * len(out.outputs[0].token_ids)
            record["ok"] = out.finished and len(record["tokens"]) == r["max_tokens"]

    async def main():
        reports = {}
        for file in files:
            requests = load(file, None)
            await asyncio.gather(*(send(r, {"tokens": []}) for r in warm_up_requests(requests)))
            records, wall, lag = await replay(requests, send)
            reports[file] = dict(requests_file=file, num_requests=len(requests),
                                 **report(records, wall, {"peer": "vLLM AsyncLLM in-process, streamed, no HTTP",
                                                          "client_loop_lag_ms": lag}))
            print(json.dumps({file: {k: reports[file][k] for k in ("completed", "request_throughput")}}), flush=True)
        return reports

    return engine, asyncio.run(main())


def vllm_settings(llm) -> dict:
    """What vLLM chose for itself (its defaults depend on the GPU and on the entry point)."""
    config = llm.llm_engine.vllm_config if hasattr(llm, "llm_engine") else llm.vllm_config
    settings = {}
    for name, getter in {
        "max_num_seqs": lambda: config.scheduler_config.max_num_seqs,
        "max_num_batched_tokens": lambda: config.scheduler_config.max_num_batched_tokens,
        "enable_prefix_caching": lambda: config.cache_config.enable_prefix_caching,
        "gpu_memory_utilization": lambda: config.cache_config.gpu_memory_utilization,
        "num_gpu_blocks": lambda: config.cache_config.num_gpu_blocks,
        "cudagraph_mode": lambda: str(config.compilation_config.cudagraph_mode),
        "compilation_mode": lambda: str(config.compilation_config.mode),
        "attention_backend": lambda: os.environ.get("VLLM_ATTENTION_BACKEND", "auto"),
    }.items():
        try:
            settings[name] = getter()
        except AttributeError as error:  # NOTE: the names move between vLLM versions: record, don't fail
            settings[name] = f"unknown ({error})"
    return settings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", required=True, choices=sorted(SHAPES))
    parser.add_argument("--runs", type=int, default=3, help="single-stream runs (0: none)")
    parser.add_argument("--requests", default=None, help="also run this workload offline (JSONL, serve.py's)")
    parser.add_argument("--async-requests", nargs="+", default=None,
                        help="instead: these workloads (with arrival times) through vLLM's AsyncLLM, one after another")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # NOTE: flashinfer is not installed there
    import torch
    import vllm
    from vllm import LLM

    def facts(engine) -> dict:
        return {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(), "shape": args.shape,
                "vllm": vllm.__version__, "torch": torch.__version__, "settings": vllm_settings(engine)}

    path = config_dir(SHAPES[args.shape])
    if args.async_requests:
        engine, reports = run_async(path, args.async_requests)
        result = dict(facts(engine), **{"async": reports})
    else:
        started = time.perf_counter()
        llm = LLM(model=path, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16")
        result = dict(facts(llm), startup_s=time.perf_counter() - started)
        if args.runs:
            result["single_stream"] = single_stream(llm, args.runs)
            print(json.dumps({"single_stream": result["single_stream"]}), flush=True)
        if args.requests:
            requests = load(args.requests, None)
            result["offline"] = dict(report_of=args.requests, num_requests=len(requests), **offline(llm, requests))
    print(json.dumps(result, indent=2), flush=True)
    save(result, args.out)
    if args.async_requests:
        engine.shutdown()  # NOTE: after the save: the results stand whatever the shutdown does


if __name__ == "__main__":
    main()
