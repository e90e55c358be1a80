"""What beam search costs (`LLM.beam_search`, bento_pagedllm/beam_search.py): the time a search of each width
takes for one prompt against greedy decoding of the same length, on one GPU, random (dummy) weights.

A beam step is one-token requests, one per live beam, so a search of T tokens runs at least T engine steps
with prefills of each beam's last partial block (the prefix cache holds the rest); this shows how far above
greedy decoding's time a step that is such a mixed step, plus the host's round trip, puts it.

    python bench/beam_search.py --shape llama2-7b --widths 1,4,8 --tokens 64 --out beam.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time

import torch

from single_stream import SHAPES, config_dir


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="llama2-7b", choices=sorted(SHAPES))
    parser.add_argument("--widths", default="1,4,8")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    from bento_pagedllm import LLM, BeamSearchParams, SamplingParams

    llm = LLM(config_dir(SHAPES[args.shape]), load_format="dummy", dtype="bfloat16", device="cuda")
    prompt = torch.randint(3, SHAPES[args.shape]["vocab_size"], (args.prompt,),
                           generator=torch.Generator().manual_seed(0)).tolist()

    def timed(run) -> float:
        run()  # warm-up
        times = []
        for _ in range(args.runs):
            torch.cuda.synchronize()
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    greedy = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    greedy_s = timed(lambda: llm.generate([prompt], greedy))
    rows = [{"search": "greedy", "seconds": greedy_s, "ms_per_token": 1e3 * greedy_s / args.tokens}]
    for width in (int(w) for w in args.widths.split(",")):
        params = BeamSearchParams(width=width, max_tokens=args.tokens, ignore_eos=True)
        seconds = timed(lambda: llm.beam_search([prompt], params))
        rows.append({"search": f"beam width {width}", "seconds": seconds, "ms_per_token": 1e3 * seconds / args.tokens,
                     "vs_greedy": seconds / greedy_s})
    for row in rows:
        print(row, flush=True)
    result = {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__, "shape": args.shape, "prompt_tokens": args.prompt,
              "tokens": args.tokens, "runs": args.runs, "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
