"""What prefix caching saves on a shared-prefix workload, and so what a model with per-sequence
state (Qwen3.5's Gated DeltaNet, for which the engine turns it off) forgoes.

Every request is one shared system prompt plus its own question, greedy, a few new tokens: the
prefill tokens the engine computed and the wall time, with prefix caching on and off, in the same
run.

    .venv/bin/python scripts/prefix_cost.py MODEL [--prefix 512] [--requests 32] [--out FILE.json]
"""

import argparse
import json
import time
from pathlib import Path

import torch

from onboard.engine import EngineConfig, LLMEngine, SamplingParams


def workload(vocab: int, prefix: int, requests: int, suffix: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    shared = torch.randint(3, vocab, (prefix,), generator=gen).tolist()
    return [shared + torch.randint(3, vocab, (suffix,), generator=gen).tolist() for _ in range(requests)]


def measure(model: Path, prompts: list[list[int]], caching: bool, new_tokens: int) -> dict:
    config = EngineConfig(numerics="fast", enable_prefix_caching=caching, max_model_len=4096, num_blocks=4096)
    engine = LLMEngine(model, config)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    engine.generate(prompts[:1], params)  # warm: kernels measured, first allocations made
    before = engine.stats()
    start = time.perf_counter()
    engine.generate(prompts, params)
    seconds = time.perf_counter() - start
    after = engine.stats()
    reused = after["prefix_cache_hits"] - before["prefix_cache_hits"]  # tokens found cached at admission
    total = sum(len(p) for p in prompts)
    return {
        "prefix_caching": after["prefix_caching"],
        "seconds": round(seconds, 2),
        "prompt_tokens": total,
        "prompt_tokens_computed": total - reused,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--prefix", type=int, default=512)
    parser.add_argument("--suffix", type=int, default=32)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.manual_seed(0)
    vocab = json.loads((args.model / "config.json").read_text())
    vocab = (vocab.get("text_config") or vocab)["vocab_size"]
    prompts = workload(vocab, args.prefix, args.requests, args.suffix)
    rows = [measure(args.model, prompts, caching, args.new_tokens) for caching in (True, False)]
    result = {"model": str(args.model), "prefix": args.prefix, "suffix": args.suffix, "rows": rows}
    if rows[0]["prefix_caching"] and not rows[1]["prefix_caching"]:
        result["time_ratio_off_over_on"] = round(rows[1]["seconds"] / rows[0]["seconds"], 2)
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
