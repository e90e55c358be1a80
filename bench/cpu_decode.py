"""CPU decode benchmark: the engine against transformers' `generate` on SmolLM2-135M-Instruct (float32).

Single stream: a 128-token prompt, 64 greedy tokens with eos ignored; decode tokens/s excludes the
first token (time to first token is reported apart). Batch: 8 such requests submitted together, aggregate
generated tokens/s over the whole run (prefill included) for both the engine and transformers' static
batch `generate`. Memory roofline: weight bytes / measured read bandwidth (a large tensor sum).
Median of several runs after a warm-up. Every run draws fresh random prompts (the same ones for both
engines, 8 different ones for the batch), so the engine's prefix cache never serves a prompt it has seen.
Writes JSON to stdout and, with --out, to a file.

    python bench/cpu_decode.py [--threads 2] [--runs 3] [--out bench/results/cpu_decode.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import tempfile
import time
import os

import torch

PROMPT_LEN, NEW_TOKENS, BATCH = 128, 64, 8


def read_bandwidth_gbs() -> float:
    data = torch.ones(128 * 1024 * 1024)  # 512 MiB
    data.sum()
    start = time.perf_counter()
    for _ in range(5):
        data.sum()
    return data.numel() * 4 * 5 / (time.perf_counter() - start) / 1e9


def random_prompt(seed: int) -> list[int]:
    return torch.randint(100, 40000, (PROMPT_LEN,), generator=torch.Generator().manual_seed(seed)).tolist()


def run_prompts(run: int) -> tuple[list[int], list[list[int]]]:
    """Run `run`'s single-stream prompt and its batch of BATCH different prompts (run -1: the warm-up)."""
    base = 1000 * (run + 2)
    return random_prompt(base), [random_prompt(base + 1 + i) for i in range(BATCH)]


def bench_engine(model_dir: str, runs: int) -> dict:
    from bento_pagedllm import LLM, SamplingParams

    llm = LLM(model_dir, dtype="float32", device="cpu")
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    llm.generate(run_prompts(-1)[:1], params)  # warm-up
    decode, ttft, batch = [], [], []
    for run in range(runs):
        prompt, prompts = run_prompts(run)
        out = llm.generate([prompt], params)[0]
        m = out.metrics
        ttft.append(m.first_token_time - m.arrival_time)
        decode.append((NEW_TOKENS - 1) / (m.finished_time - m.first_token_time))
        start = time.perf_counter()
        llm.generate(prompts, params)
        batch.append(BATCH * NEW_TOKENS / (time.perf_counter() - start))
    return {"decode_tok_s": statistics.median(decode), "ttft_s": statistics.median(ttft),
            "batch8_tok_s": statistics.median(batch)}


def bench_transformers(model_dir: str, runs: int) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def generate(prompts: list[list[int]], new_tokens: int) -> float:
        ids = torch.tensor(prompts)  # NOTE: every prompt has PROMPT_LEN tokens: no padding
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        return time.perf_counter() - start

    generate(run_prompts(-1)[:1], 4)
    decode, ttft, batch = [], [], []
    for run in range(runs):
        prompt, prompts = run_prompts(run)
        first = generate([prompt], 1)
        full = generate([prompt], NEW_TOKENS)
        ttft.append(first)
        decode.append((NEW_TOKENS - 1) / (full - first))
        batch.append(BATCH * NEW_TOKENS / generate(prompts, NEW_TOKENS))
    return {"decode_tok_s": statistics.median(decode), "ttft_s": statistics.median(ttft),
            "batch8_tok_s": statistics.median(batch)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--model-dir", default=None, help="a converted SmolLM2 dir (default: convert the GGUF)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = args.model_dir
    if model_dir is None:
        from bento_pagedllm.loader import default_model_path
        from bento_pagedllm.loader.gguf import convert_gguf_to_hf

        model_dir = convert_gguf_to_hf(default_model_path(), os.path.join(tempfile.mkdtemp(), "smollm2"))
    from bento_pagedllm.loader import resolve_model

    config = resolve_model(model_dir).config
    weight_bytes = config.num_parameters() * 4
    bandwidth = read_bandwidth_gbs()
    roofline = bandwidth * 1e9 / weight_bytes
    ours = bench_engine(model_dir, args.runs)
    peer = bench_transformers(model_dir, args.runs)
    result = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "threads": args.threads,
        "model": "SmolLM2-135M-Instruct float32",
        "prompt_tokens": PROMPT_LEN, "new_tokens": NEW_TOKENS, "runs": args.runs,
        "read_bandwidth_gbs": bandwidth, "weight_bytes": weight_bytes, "roofline_tok_s": roofline,
        "engine": ours, "transformers": peer,
        "ratios": {
            "decode_vs_transformers": ours["decode_tok_s"] / peer["decode_tok_s"],
            "decode_vs_roofline": ours["decode_tok_s"] / roofline,
            "transformers_decode_vs_roofline": peer["decode_tok_s"] / roofline,
            "batch8_vs_transformers": ours["batch8_tok_s"] / peer["batch8_tok_s"],
        },
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
