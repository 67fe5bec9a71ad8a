"""Fast numerics against the near-tie rule over random MLA shapes and seeds, not one fixture's.

    python scripts/mla_sweep.py --tokenizer DEMO_CHECKPOINT [--cases 24] [--prompts 4] [--o-proj-scale 0.99]
        [--out FILE]

Each case is a random-weight DeepSeek-V3 / V3.2 / GLM-5 (`glm_moe_dsa`) checkpoint of a drawn shape
(hidden size, heads, LoRA ranks, head dims, experts, DSA top-k, weight scale), built in memory and
saved to a temporary folder with the given tokenizer; case 0 is issue #37's `deepseek_v32`.  Each
goes through `measure_parity` in bf16, as `onboard adapt` runs it, and in float32 (where fast
numerics decode MLA in the weight-absorbed form): exact numerics (bitwise?) and
fast numerics (top-1 at fast's own decode steps, greedy agreement, the largest |Δ logprob|, and
whether every greedy divergence is a near-tie).

A divergence at a token that is no near-tie is judged by the decision-tie rule (`onboard.adapt.measure`,
`_decision_tie`).  `--o-proj-scale 0.99` also serves each bf16 case's fast numerics from weights with
layer 1's o_proj scaled, what a kernel that computes something else would serve: how many the rules
reject, and how far from the floor fast's log probabilities sit.

A case whose fast numerics fail the rule is measured again with its discrete decisions taken out,
on the same weights: every routed expert chosen (`num_experts_per_tok = n_routed_experts`, every
group) and the indexer choosing every key (`index_topk` above the context).  A failure that the
ablation removes is a decision flipped at a near-tie of its scores (a router's or the indexer's
top-k), not MLA's arithmetic.
"""

import argparse
import json
import random
import shutil
import tempfile
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file, save_file

from onboard.adapt import measure
from onboard.models import inspect_checkpoint

# bf16: fast numerics' kernels (oneDNN's packed bf16 GEMMs where the CPU has them; elsewhere the
# same as exact's); float32: fast MLA's own arithmetic, the weight-absorbed decode, on any CPU.
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
ISSUE_CASE = {  # issue #37, item 9
    "arch": "deepseek_v32", "hidden": 64, "layers": 4, "heads": 4, "q_lora": 48, "kv_lora": 32,
    "rope": 16, "nope": 32, "v": 32, "experts": 8, "top_k": 2, "groups": 2, "top_groups": 1,
    "index_topk": 8, "index_head_dim": 32, "index_heads": 2, "std": 0.08, "seed": 0,
}  # fmt: skip


def drawn_case(rng: random.Random, seed: int) -> dict:
    """A shape the releases' configs allow: the indexer's heads hold the RoPE dims (DeepSeek-V3.2:
    128 for 64) and its queries come from the LoRA-compressed ones (V3.2 and GLM-5 have `q_lora_rank`)."""
    groups, arch, rope = (
        rng.choice([1, 2, 4]),
        rng.choice(["deepseek_v3", "deepseek_v32", "glm_moe_dsa"]),
        rng.choice([16, 32]),
    )
    return {
        "arch": arch,
        "hidden": rng.choice([64, 96, 128]),
        "layers": rng.choice([2, 3, 4]),
        "heads": rng.choice([2, 4, 8]),
        "q_lora": rng.choice([None, 32, 48, 64] if arch == "deepseek_v3" else [32, 48, 64]),
        "kv_lora": rng.choice([16, 32, 64]),
        "rope": rope,
        "nope": rng.choice([16, 32, 64]),
        "v": rng.choice([16, 32]),
        "experts": rng.choice([8, 16]),
        "top_k": rng.choice([2, 4]),
        "groups": groups,
        "top_groups": rng.randint(1, groups),
        "index_topk": rng.choice([4, 8, 16]),
        "index_head_dim": rng.choice([rope + 16, 2 * rope]),
        "index_heads": rng.choice([2, 4]),
        "std": rng.choice([0.02, 0.08, 0.15]),
        "seed": seed,
    }


def config_of(case: dict, vocab: int, ablate: bool) -> transformers.PretrainedConfig:
    kwargs = dict(
        vocab_size=vocab,
        hidden_size=case["hidden"],
        intermediate_size=2 * case["hidden"],
        moe_intermediate_size=case["hidden"] // 2,
        num_hidden_layers=case["layers"],
        num_attention_heads=case["heads"],
        num_key_value_heads=case["heads"],
        q_lora_rank=case["q_lora"],
        kv_lora_rank=case["kv_lora"],
        qk_rope_head_dim=case["rope"],
        qk_nope_head_dim=case["nope"],
        v_head_dim=case["v"],
        n_routed_experts=case["experts"],
        num_experts_per_tok=case["experts"] if ablate else case["top_k"],
        n_group=case["groups"],
        topk_group=case["groups"] if ablate else case["top_groups"],
        n_shared_experts=1,
        first_k_dense_replace=1,
        norm_topk_prob=True,
        tie_word_embeddings=False,
        max_position_embeddings=4096,
    )
    if case["arch"] == "deepseek_v3":
        return transformers.DeepseekV3Config(**kwargs)
    kwargs.update(
        index_topk=4096 if ablate else case["index_topk"],
        index_head_dim=case["index_head_dim"],
        index_n_heads=case["index_heads"],
    )
    if case["arch"] == "deepseek_v32":
        return transformers.DeepseekV32Config(**kwargs)
    return transformers.GlmMoeDsaConfig(**kwargs)


def build(case: dict, tokenizer: Path, out: Path, ablate: bool = False) -> Path:
    """The case's checkpoint: every weight normal(0, std) from the case's seed in name order (norms 1,
    router biases normal(0, 0.1)), saved in bf16.  The ablation changes the config only."""
    vocab = len(transformers.AutoTokenizer.from_pretrained(tokenizer))
    config = config_of(case, vocab, ablate)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(case["seed"])
    with torch.no_grad():
        for name, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if not name.endswith("norm.weight"):
                param.copy_(torch.randn(param.shape, generator=gen) * case["std"])
        for name, buffer in sorted(model.named_buffers(), key=lambda kv: kv[0]):
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=gen) * 0.1)
    model.to(torch.bfloat16).save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (tokenizer / name).is_file():
            shutil.copy(tokenizer / name, out / name)
    return out


def wrong_o_proj(path: Path, scale: float) -> Path:
    """A copy of the checkpoint with layer 1's o_proj scaled: what a kernel that computes something
    else serves, to measure what the decision-tie rule rejects."""
    out = path.with_name(path.name + "-wrong")
    shutil.copytree(path, out)
    (shard,) = out.glob("*.safetensors")
    weights = load_file(shard)
    name = "model.layers.1.self_attn.o_proj.weight"
    weights[name] = (weights[name].float() * scale).to(weights[name].dtype)
    save_file(weights, shard, metadata={"format": "pt"})
    return out


def measured(path: Path, prompts: int, dtype: torch.dtype, o_proj_scale: float | None = None) -> dict:
    engine = measure._engine
    if o_proj_scale is not None:  # fast numerics served from the wrong weights, judged against the right ones
        wrong = inspect_checkpoint(wrong_o_proj(path, o_proj_scale))
        measure._engine = lambda ck, dtype, device, numerics="exact": engine(
            wrong if numerics == "fast" else ck, dtype, device, numerics
        )
    try:
        result = measure.measure_parity(inspect_checkpoint(path), dtype, num_prompts=prompts)
    finally:
        measure._engine = engine
    fast = result["fast"]
    return {
        "exact_bitwise": result["max_abs_logit_diff"] == 0 and result["greedy_match_rate"] == 1,
        "exact_max_abs_logit_diff": result["max_abs_logit_diff"],
        "fast_top1": round(fast["top1_agreement"], 4),
        "fast_greedy": round(fast["greedy_match_rate"], 4),
        "fast_max_abs_logprob_diff": fast["max_abs_logprob_diff"],
        "fast_near_ties_only": fast["logprobs_close"],
        "fast_decision_ties": fast["decision_tie_prompts"],
        "fast_moved_floor_fraction": fast["moved_floor_fraction"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", type=Path, required=True, help="a checkpoint whose tokenizer to use")
    parser.add_argument("--cases", type=int, default=24, help="drawn cases beside issue #37's")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("mla_sweep.json"))
    parser.add_argument(
        "--o-proj-scale", type=float, help="also serve bf16 fast numerics from layer 1's o_proj scaled by this"
    )
    args = parser.parse_args()
    torch.manual_seed(0)
    rng = random.Random(args.seed)
    cases = [ISSUE_CASE] + [drawn_case(rng, args.seed * 1000 + i + 1) for i in range(args.cases)]
    rows = []
    for i, case in enumerate(cases):
        for name, dtype in DTYPES.items():
            with tempfile.TemporaryDirectory() as tmp:
                row = {"case": i, "dtype": name, **case}
                path = build(case, args.tokenizer, Path(tmp) / "ck")
                row.update(measured(path, args.prompts, dtype))
                if args.o_proj_scale is not None and name == "bf16":
                    row["wrong_kernel"] = measured(path, args.prompts, dtype, args.o_proj_scale)
            if not row["fast_near_ties_only"]:
                with tempfile.TemporaryDirectory() as tmp:
                    ablated = measured(build(case, args.tokenizer, Path(tmp) / "ck", ablate=True), args.prompts, dtype)
                row["without_decisions"] = ablated
            rows.append(row)
            print(json.dumps(row), flush=True)
    summary = {}
    for name in DTYPES:
        mine = [r for r in rows if r["dtype"] == name]
        failing = [r for r in mine if not r["fast_near_ties_only"]]
        summary[name] = {
            "cases": len(mine),
            "exact_bitwise": sum(r["exact_bitwise"] for r in mine),
            "fast_near_ties_only": len(mine) - len(failing),
            "fast_top1_min": min(r["fast_top1"] for r in mine),
            "fast_greedy_mean": round(sum(r["fast_greedy"] for r in mine) / len(mine), 4),
            "fast_max_abs_logprob_diff": max(r["fast_max_abs_logprob_diff"] for r in mine),
            "failing_fixed_without_decisions": sum(r["without_decisions"]["fast_near_ties_only"] for r in failing),
            "fast_decision_tie_prompts": sum(r["fast_decision_ties"] for r in mine),
            "fast_moved_floor_fraction_max": max((r["fast_moved_floor_fraction"] or 0.0) for r in mine),
        }
        wrong = [r["wrong_kernel"] for r in mine if "wrong_kernel" in r]
        if wrong:
            summary[name]["wrong_kernel"] = {
                "o_proj_scale": args.o_proj_scale,
                "rejected": sum(not w["fast_near_ties_only"] for w in wrong),
                "moved_floor_fraction_min": min((w["fast_moved_floor_fraction"] or 0.0) for w in wrong),
            }
    args.out.write_text(json.dumps({"summary": summary, "rows": rows}, indent=1) + "\n")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
