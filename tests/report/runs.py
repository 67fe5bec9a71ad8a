"""Hand-made run directories for the report tests: every file a full run writes, with plausible
values, and hostile strings (markup in model outputs) where the report must escape them."""

import json
from pathlib import Path
from typing import Any

HOSTILE = "Sure! <script>alert(1)</script> and <b>bold</b> & more. "
LOOP = "the cat sat on the mat. the cat sat on the mat. the cat sat on the mat."
FAILED_CHECKS = ("mean_kld", "loop_rate_excess")
STAGES = ("quantize", "eval", "speculator", "adapt", "smoke")


def write(run: Path, rel: str, data: dict[str, Any]) -> None:
    path = run / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2))


def manifest(run: Path, stages: tuple[str, ...]) -> dict[str, Any]:
    metrics = {
        "quantize": {
            "scheme": "auto",
            "effective_bits": 5.5,
            "bits_budget": 5.5,
            "search_kld": 0.19,
            "bytes_reference": 269_060_552,
            "bytes_artifact": 116_515_496,
            "quantized_layers": 26,
            "calibration_tokens": 32768,
        },
        "eval": {"mean_kld": 0.41, "top1_agreement": 0.68, "num_tokens": 8233, "effective_bits": 4.5},
        "speculator": {"acceptance_length": 1.9, "speedup": 1.4, "num_speculative_tokens": 3},
        "adapt": {"max_abs_logit_diff": 0.01, "greedy_match_rate": 0.9},
        "smoke": {
            "loop_rate": 0.25,
            "batch_invariant": True,
            "throughput": {"artifact_greedy_tokens_per_s": 45.3, "reference_greedy_tokens_per_s": 13.5},
        },
    }
    entries = {}
    for i, name in enumerate(stages):
        entries[name] = {
            "status": "done",
            "started": f"2026-11-30T07:{10 + 2 * i:02d}:00+00:00",
            "finished": f"2026-11-30T07:{11 + 2 * i:02d}:30+00:00",
            "seconds": 90.0 + 10 * i,
            "metrics": metrics[name],
        }
    return {
        "run_dir": str(run),
        "created": "2026-11-30T07:09:00+00:00",
        "versions": {
            "python": "3.11.7",
            "torch": "2.13.0+cpu",
            "transformers": "5.17.0",
            "llmcompressor": "0.14.0.1",
            "compressed-tensors": "0.19.0",
            "onboard": "0.1.0",
        },
        "recipe": {"name": "llama", "description": "Dense Llama-family decoder", "gate": {"max_mean_kld": 0.3}},
        "stages": entries,
    }


# A SmolLM-sized 4-layer decoder: [out, in] weights per projection.
SHAPES = {
    "self_attn.q_proj": 576 * 576,
    "self_attn.k_proj": 192 * 576,
    "self_attn.v_proj": 192 * 576,
    "self_attn.o_proj": 576 * 576,
    "mlp.gate_proj": 1536 * 576,
    "mlp.up_proj": 1536 * 576,
    "mlp.down_proj": 576 * 1536,
}
# The `scheme: auto` selection over an nvfp4 base: what the additive start and the search kept higher.
ADDITIVE = {"model.layers.0.mlp.down_proj": "fp8", "model.layers.3.self_attn.o_proj": "bf16"}
UPGRADED = {"model.layers.0.self_attn.qkv": "fp8", **ADDITIVE}
BITS = {"nvfp4": 4.5, "fp8": 8.03, "bf16": 16.0}
GROUP_KINDS = {  # group kind: (projections, sensitivity in nvfp4 of layer 0)
    "qkv": (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), 0.021),
    "o_proj": (("self_attn.o_proj",), 0.004),
    "gate_up": (("mlp.gate_proj", "mlp.up_proj"), 0.012),
    "down_proj": (("mlp.down_proj",), 0.035),
}


def group_name(layer: int, kind: str) -> str:
    return f"model.layers.{layer}.{'self_attn' if kind in ('qkv', 'o_proj') else 'mlp'}.{kind}"


def groups() -> list[dict[str, Any]]:
    rows = []
    for layer in range(4):
        for kind, (projections, _) in GROUP_KINDS.items():
            name = group_name(layer, kind)
            rows.append(
                {
                    "name": name,
                    "kind": kind,
                    "layer": layer,
                    "modules": [f"model.layers.{layer}.{p}" for p in projections],
                    "weights": sum(SHAPES[p] for p in projections),
                    "bits": BITS,
                    "format": UPGRADED.get(name, "nvfp4"),
                }
            )
    return rows


def sensitivity() -> dict[str, Any]:
    measured, fisher = {}, {}
    for layer in range(4):
        for kind, (_, base) in GROUP_KINDS.items():
            name = group_name(layer, kind)
            value = 0.09 if name == "model.layers.3.self_attn.o_proj" else round(base * (1 + 0.5 * layer), 6)
            measured[name] = {"nvfp4": value, "fp8": round(value / 9, 6)}
            fisher[name] = {"nvfp4": round(value * 0.8, 6), "fp8": round(value / 12, 6)}
    fisher["model.layers.1.mlp.gate_up"]["fp8"] = None  # no estimate for one group
    return {"measured": measured, "fisher": fisher, "rank_correlation": {"nvfp4": 0.83, "fp8": None}}


def search() -> list[dict[str, Any]]:
    return [
        {
            "step": 0,
            "move": "additive start",
            "effective_bits": 5.49,
            "mean_kld": 0.2,
            "best_kld": 0.2,
            "accepted": True,
        },
        {
            "step": 1,
            "move": "model.layers.1.mlp.gate_up→fp8, model.layers.0.mlp.down_proj→nvfp4",
            "effective_bits": 5.5,
            "mean_kld": 0.215,
            "best_kld": 0.2,
            "accepted": False,
            "predicted_change": 0.004,
        },
        {
            "step": 2,
            "move": "model.layers.0.self_attn.qkv→fp8",
            "effective_bits": 5.5,
            "mean_kld": 0.19,
            "best_kld": 0.19,
            "accepted": True,
            "predicted_change": -0.01,
        },
        {
            "step": 3,
            "move": "model.layers.2.mlp.down_proj→fp8, model.layers.0.self_attn.qkv→nvfp4",
            "effective_bits": 5.49,
            "mean_kld": 0.197,
            "best_kld": 0.19,
            "accepted": False,
            "predicted_change": 0.002,
        },
    ]


def layer_format(layer: int, proj: str) -> str:
    kind = next(kind for kind, (projections, _) in GROUP_KINDS.items() if proj in projections)
    return UPGRADED.get(group_name(layer, kind), "nvfp4")


def selection() -> dict[str, Any]:
    layers: dict[str, Any] = {
        "model.embed_tokens": {"format": "bf16", "bits": 16.0, "weights": 28_311_552, "quantizable": False}
    }
    for index in range(4):
        for proj, weights in SHAPES.items():
            fmt = layer_format(index, proj)
            layers[f"model.layers.{index}.{proj}"] = {
                "format": fmt,
                "bits": BITS[fmt],
                "weights": weights,
                "quantizable": True,
            }
    layers["lm_head"] = {"format": "bf16", "bits": 16.0, "weights": 28_311_552, "quantizable": False}
    return {
        "scheme": "auto",
        "method": "rtn",
        "effective_bits": 5.5,
        "effective_bits_all_weights": 7.1,
        "ignore": ["lm_head"],
        "layers": layers,
        "pinned": {
            "fp8": [
                "re:^model\\.layers\\.0\\.self_attn\\.(q_proj|k_proj|v_proj)$",
                "re:^model\\.layers\\.0\\.mlp\\.down_proj$",
            ],
            "bf16": ["re:^model\\.layers\\.3\\.self_attn\\.o_proj$"],
        },
        "base": "nvfp4",
        "formats": ["nvfp4", "fp8", "bf16"],
        "bits_budget": 5.5,
        "search_tokens": 2048,
        "search_steps": 32,
        "groups": groups(),
        "sensitivity": sensitivity(),
        "additive": {"upgraded": ADDITIVE, "predicted_kld": 0.18, "measured_kld": 0.2, "effective_bits": 5.49},
        "final": {"upgraded": UPGRADED, "predicted_kld": 0.17, "measured_kld": 0.19, "effective_bits": 5.5},
        "search": search(),
        "artifact_kld": 0.191,
        "seconds": {"sources": 40.1, "sensitivity": 120.5, "fisher": 8.2, "search": 64.0},
    }


def per_layer() -> dict[str, Any]:
    alone = [0.031, 0.12, 0.09, 0.15]
    running = [0.031, 0.16, 0.26, 0.41]
    rows = []
    for layer in range(4):
        formats: dict[str, int] = {}
        for proj in SHAPES:
            fmt = layer_format(layer, proj)
            formats[fmt] = formats.get(fmt, 0) + 1
        rows.append(
            {
                "layer": layer,
                "formats": dict(sorted(formats.items())),
                "alone_kld": alone[layer],
                "running_kld": running[layer],
            }
        )
    return {"tokens": 2048, "full_kld": 0.41, "layers": rows}


def kl_stats(scale: float) -> dict[str, Any]:
    return {
        "mean_kld": 0.41 * scale,
        "median_kld": 0.3 * scale,
        "p90_kld": 0.82 * scale,
        "p99_kld": 1.97 * scale,
        "max_kld": 9.0 * scale,
        "top1_agreement": 0.68,
        "rms_delta_p": 0.2,
        "ppl_reference": 17.3,
        "ppl_quantized": 25.5,
        "num_tokens": 2000,
    }


def kl() -> dict[str, Any]:
    edges = [0.0] + [10 ** (e / 4) for e in range(-16, 5)]
    counts = [5, 12, 30, 80, 160, 300, 500, 800, 1100, 1300, 1200, 900, 600, 350, 180, 90, 40, 20, 8, 3, 1]
    return {
        **kl_stats(1.0),
        "num_tokens": 8233,
        "effective_bits": 4.61,
        "by_traffic": {"chat": kl_stats(1.05), "code": kl_stats(1.1), "math": kl_stats(0.9)},
        "histogram": {"edges": edges, "counts": counts},
        "per_layer": per_layer(),
    }


def speculator() -> tuple[dict[str, Any], dict[str, Any]]:
    metrics = {
        "acceptance_length": 1.9,
        "per_position_acceptance": [0.55, 0.3, 0.15],
        "num_speculative_tokens": 3,
        "speedup": 1.4,
        "train_tokens": 38407,
        "data_seconds": 367.1,
        "train_seconds": 928.1,
        "by_traffic": {
            "chat": {"acceptance_length": 1.8, "per_position_acceptance": [0.5, 0.25, 0.12]},
            "code": {"acceptance_length": 2.1, "per_position_acceptance": [0.62, 0.35, 0.2]},
        },
    }
    history = [
        {
            "epoch": e,
            "loss": 20 / e,
            "acceptance_estimate": 1 + 0.12 * e,
            "step_accuracy": [0.1 * e, 0.05 * e],
            "learning_rate": 3e-4 / e,
        }
        for e in range(1, 7)
    ]
    return metrics, {"history": history, "settings": {"epochs": 6, "learning_rate": 0.0003}}


def parity() -> dict[str, Any]:
    same = "The capital of France is Paris."
    return {
        "max_abs_logit_diff": 0.01,
        "mean_kld": 1e-5,
        "top1_agreement": 0.999,
        "greedy_match_rate": 0.5,
        "logprobs_close": True,
        "num_prompts": 2,
        "max_new_tokens": 64,
        "engine_model": "LlamaModel",
        "cases": [
            {
                "prompt_tokens": 12,
                "matched": True,
                "first_divergence": None,
                "near_tie": False,
                "engine_text": same,
                "reference_text": same,
            },
            {
                "prompt_tokens": 30,
                "matched": False,
                "first_divergence": 7,
                "near_tie": True,
                "engine_text": "x < y && <i>engine</i>",
                "reference_text": "x < y || reference",
            },
        ],
        "fast": {
            "numerics": "fast",
            "max_abs_logprob_diff": 0.157,
            "top1_agreement": 0.986,
            "num_decode_positions": 1014,
            "exact_max_abs_logprob_diff": 0.205,
            "exact_top1_agreement": 0.983,
            "greedy_match_rate": 0.375,
            "logprobs_close": True,
        },
    }


def smoke() -> dict[str, Any]:
    rates = {
        "loop_rate": 0.25,
        "reference_loop_rate": 0.05,
        "no_eos_rate": 0.1,
        "reference_no_eos_rate": 0.08,
        "run_on_rate": 0.05,
        "reference_run_on_rate": 0.04,
        "near_duplicate_rate": 0.0,
        "reference_near_duplicate_rate": 0.0,
        "garbage_rate": 0.0,
        "reference_garbage_rate": 0.0,
    }
    detectors = [
        {"name": "token loops", "key": "loop_rate", "artifact": 0.25, "reference": 0.05, "difference": 0.2},
        {"name": "no EOS", "key": "no_eos_rate", "artifact": 0.1, "reference": 0.08, "difference": 0.02},
        {"name": "run-on", "key": "run_on_rate", "artifact": 0.05, "reference": 0.04, "difference": 0.01},
        {"name": "distinct-2", "key": "distinct_2", "artifact": 0.61, "reference": 0.66, "difference": -0.05},
    ]
    loop_text = HOSTILE + LOOP
    return {
        "num_prompts": 20,
        "max_tokens": 128,
        "modes": ["greedy", "sampled"],
        "speculator": True,
        **rates,
        "distinct_2": 0.61,
        "reference_distinct_2": 0.66,
        "mean_entropy": 1.9,
        "reference_mean_entropy": 2.0,
        "entropy_ratio": 0.95,
        "batch_invariant": False,
        "invariance": {
            "prompts": 8,
            "compositions": ["alone", "batch of 8"],
            "diverged": [{"prompt": 3, "composition": "batch of 8", "first_divergence": 17}],
        },
        "detectors": detectors,
        "by_mode": {"greedy": {**rates, "loop_rate": 0.4}, "sampled": {**rates, "loop_rate": 0.1}},
        "cases": [
            {
                "kind": "loop",
                "mode": "greedy",
                "traffic": "chat",
                "prompt": "Tell me about <cats> & dogs",
                "artifact_text": loop_text,
                "reference_text": "Cats are small domesticated carnivores.",
                "artifact_loop": {"start": 14, "period": 8, "span": 24, "char_start": len(HOSTILE)},
                "reference_loop": None,
                "finish_reason": "length",
                "reference_finish_reason": "stop",
            },
            {
                "kind": "garbage",
                "mode": "sampled",
                "traffic": "code",
                "prompt": "def f():",
                "artifact_text": "\ufffd\ufffd return",
                "reference_text": "    return 1",
                "artifact_loop": None,
                "reference_loop": None,
                "finish_reason": "stop",
                "reference_finish_reason": "stop",
            },
        ],
    }


def gate(passed: bool) -> dict[str, Any]:
    stages = {
        "mean_kld": "eval",
        "top1_agreement": "eval",
        "acceptance_length": "speculator",
        "loop_rate_excess": "smoke",
        "batch_invariant": "smoke",
    }
    checks = [
        {"name": n, "value": 0.5, "threshold": 0.3, "passed": passed or n not in FAILED_CHECKS, "stage": stage}
        for n, stage in stages.items()
    ]
    return {"passed": passed, "complete": True, "missing": [], "checks": checks}


def build_run(run: Path, stages: tuple[str, ...] = STAGES, *, with_gate: bool | None = False) -> Path:
    """A run directory holding the outputs of `stages`; `with_gate` True/False writes a passing /
    failing gate.json, None writes none."""
    run.mkdir(parents=True, exist_ok=True)
    write(run, "manifest.json", manifest(run, stages))
    if "quantize" in stages:
        write(run, "quantize/selection.json", selection())
        write(
            run,
            "artifact/config.json",
            {
                "architectures": ["LlamaForCausalLM"],
                "hidden_size": 576,
                "num_hidden_layers": 4,
                "vocab_size": 49152,
                "model_type": "llama",
            },
        )
    if "eval" in stages:
        write(run, "eval/kl.json", kl())
    if "speculator" in stages:
        metrics, train = speculator()
        write(run, "speculator/metrics.json", metrics)
        write(run, "speculator/train.json", train)
    if "adapt" in stages:
        write(run, "adapt/parity.json", parity())
    if "smoke" in stages:
        write(run, "smoke/smoke.json", smoke())
        write(
            run,
            "bench/bench.json",
            {
                "model": str(run / "artifact"),
                "new_tokens": 64,
                "concurrency": [1, 16, 64],
                "hf_c1_tps": 13.5,
                "hf_c16_tps": 44.0,
                "hf_c64_tps": 61.0,
                "engine_exact_c1_tps": 40.1,
                "engine_exact_c16_tps": 280.0,
                "engine_exact_c64_tps": 410.0,
                "engine_fast_c1_tps": 45.2,
                "engine_fast_c16_tps": 300.5,
                "engine_fast_c64_tps": 455.0,
                "engine_fast_noninvariant_c1_tps": 61.5,
                "engine_fast_noninvariant_c16_tps": 350.0,
                "engine_fast_noninvariant_c64_tps": 520.0,
                "llama_cpp_c1_tps": 111.0,
                "llama_cpp_model": "/cache/demo/downloads/SmolLM2-135M-Instruct.Q4_1.gguf",
                "llama_cpp_skipped": None,
                "fast_over_hf_c1": 45.2 / 13.5,
                "fast_over_hf_c16": 300.5 / 44.0,
                "fast_over_hf_c64": 455.0 / 61.0,
                "fast_noninvariant_over_hf_c1": 61.5 / 13.5,
                "fast_over_llama_cpp_c1": 45.2 / 111.0,
                "prefix_tokens": 2000,
                "prefix_ttft_cold_s": 2.04,
                "prefix_ttft_warm_s": 0.11,
                "memory_bandwidth_gbps": 41.0,
                "bandwidth_fraction_c1": 0.3,
                "bandwidth_fraction_c1_exact": 0.27,
            },
        )
    if with_gate is not None:
        write(run, "gate.json", gate(with_gate))
    return run
