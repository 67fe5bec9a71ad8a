"""The decision-tie rule of fast parity (issue #37, item 9), on a random MLA + DSA + MoE model whose
greedy text is not fixed beyond rounding: weights normal(0, 0.08), the issue's shape."""

import shutil
from pathlib import Path

import pytest
import tiny_models
import torch
import transformers
from safetensors.torch import load_file, save_file

from onboard.adapt import measure
from onboard.adapt.parity import GreedyComparison
from onboard.models import inspect_checkpoint


@pytest.fixture(scope="module")
def chaotic_dsa(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("chaotic_dsa")
    tokenizer = tiny_models.build_tokenizer(out)
    config = transformers.DeepseekV32Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32,
        qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=8, num_experts_per_tok=2,
        n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=1, norm_topk_prob=True,
        index_topk=8, index_head_dim=32, index_n_heads=2, tie_word_embeddings=False, max_position_embeddings=4096,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if not name.endswith("norm.weight"):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.08)
    model.to(torch.bfloat16).save_pretrained(out)
    return out


@pytest.fixture
def judged_by_decisions(monkeypatch) -> None:
    """A top-1 token rule (the 512-token vocabulary puts most tokens in the top 5), so that every
    greedy divergence is judged by the decision-tie rule."""
    monkeypatch.setattr(measure, "TOP", 1)


def test_fast_numerics_part_from_transformers_only_at_decision_ties(chaotic_dsa, judged_by_decisions) -> None:
    fast = measure.measure_parity(inspect_checkpoint(chaotic_dsa), num_prompts=2)["fast"]
    assert fast["logprobs_close"], fast
    assert fast["near_tie_prompts"] == 0


def test_a_kernel_that_computes_something_else_is_no_decision_tie(
    chaotic_dsa, judged_by_decisions, tmp_path, monkeypatch
) -> None:
    """Fast numerics served from weights with one o_proj scaled by 0.95: transformers' own text parts
    from itself under a one-ulp input move, yet the rule rejects what fast decodes."""
    wrong = tmp_path / "wrong"
    shutil.copytree(chaotic_dsa, wrong)
    weights = load_file(wrong / "model.safetensors")
    name = "model.layers.1.self_attn.o_proj.weight"
    weights[name] = (weights[name].float() * 0.95).to(torch.bfloat16)
    save_file(weights, wrong / "model.safetensors", metadata={"format": "pt"})
    engine = measure._engine
    monkeypatch.setattr(
        measure, "_engine", lambda ck, dtype, device, numerics="exact": engine(
            inspect_checkpoint(wrong) if numerics == "fast" else ck, dtype, device, numerics
        ),
    )  # fmt: skip
    fast = measure.measure_parity(inspect_checkpoint(chaotic_dsa), num_prompts=2)["fast"]
    assert not fast["logprobs_close"], fast
    assert fast["moved_floor_fraction"] > measure.FLOOR_FRACTION


def test_the_rule_needs_the_text_unfixed_and_fast_within_the_floor() -> None:
    parted = GreedyComparison(False, 5, False)
    close = {"mean_abs_logprob_diff": 0.01}
    assert measure._decision_tie(parted, close, 3, 0.3)
    assert measure._decision_tie(parted, close, 5, 0.3)
    assert not measure._decision_tie(parted, close, 6, 0.3)  # transformers' text holds past fast's divergence
    assert not measure._decision_tie(parted, close, None, 0.3)  # no moved run parts
    assert not measure._decision_tie(parted, {"mean_abs_logprob_diff": 0.09}, 3, 0.3)  # beyond a quarter of the floor
