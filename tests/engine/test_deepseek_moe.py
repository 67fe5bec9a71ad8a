"""The engine's DeepSeek MoE block vs transformers' `DeepseekV3MoE` / `DeepseekV32MoE` / `GlmMoeDsaMoE`.

Layer 1 of each tiny DeepSeek-style checkpoint is an MoE layer (8 routed experts in 2 groups,
top-2 of 1 group, one shared expert).  Both sides get the same random `[37, 64]` input: the output
must be bit-identical in bf16 on CPU (the block reproduces transformers' ops and their order) and
the routing must be the transformers router's.
"""

import functools
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from onboard.engine.layers.deepseek_moe import DeepseekMoE, route
from onboard.engine.weights import CheckpointWeights

ARCHS = ("deepseek_v3", "deepseek_v32", "glm_moe_dsa")
PREFIX = "model.layers.1.mlp"
TOKENS = 37
HIDDEN = 64

ROUTERS = {
    "deepseek_v3": (
        transformers.DeepseekV3Config,
        transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter,
    ),
    "deepseek_v32": (
        transformers.DeepseekV32Config,
        transformers.models.deepseek_v32.modeling_deepseek_v32.DeepseekV32TopkRouter,
    ),
    "glm_moe_dsa": (
        transformers.GlmMoeDsaConfig,
        transformers.models.glm_moe_dsa.modeling_glm_moe_dsa.GlmMoeDsaTopkRouter,
    ),
}


@pytest.fixture(params=ARCHS)
def checkpoint(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(f"tiny_{request.param}")


@functools.cache
def hf_moe(path: Path, dtype: torch.dtype, experts_implementation: str | None = None) -> torch.nn.Module:
    kwargs = {} if experts_implementation is None else {"experts_implementation": experts_implementation}
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs).eval()
    return model.model.layers[1].mlp


def engine_moe(path: Path, dtype: torch.dtype, experts_implementation: str | None = None) -> DeepseekMoE:
    config = transformers.AutoConfig.from_pretrained(path)
    return DeepseekMoE(config, CheckpointWeights(path, dtype=dtype), PREFIX, experts_implementation)


def random_input(dtype: torch.dtype, seed: int = 0, tokens: int = TOKENS) -> torch.Tensor:
    return torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(seed)).to(dtype)


def by_expert(weights: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's (expert, weight) pairs in ascending expert order: the selection as a set."""
    order = indices.argsort(dim=-1)
    return indices.gather(1, order), weights.gather(1, order)


# ---------------------------------------------------------------------------------------------
# Parity with transformers
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_output_matches_transformers(checkpoint: Path, dtype: torch.dtype) -> None:
    ref, ours = hf_moe(checkpoint, dtype), engine_moe(checkpoint, dtype)
    assert ref.config._experts_implementation == ours.experts_implementation == "grouped_mm"
    x = random_input(dtype)
    with torch.no_grad():
        expected = ref(x)
    actual = ours(x)
    assert actual.dtype == expected.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(actual, expected, atol=1e-5, rtol=0)
    else:
        assert torch.equal(actual, expected), (actual.float() - expected.float()).abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_routing_matches_transformers(checkpoint: Path, dtype: torch.dtype) -> None:
    ref, ours = hf_moe(checkpoint, dtype), engine_moe(checkpoint, dtype)
    x = random_input(dtype, seed=1)
    with torch.no_grad():
        _, ref_weights, ref_indices = ref.gate(x)
    weights, indices = ours.route(x)
    assert weights.dtype == ref_weights.dtype == torch.float32
    assert weights.shape == indices.shape == (TOKENS, ours.top_k)
    ref_sorted, ours_sorted = by_expert(ref_weights, ref_indices), by_expert(weights, indices)
    assert torch.equal(ours_sorted[0], ref_sorted[0])  # the same experts per token
    assert torch.equal(ours_sorted[1], ref_sorted[1])  # with the same float32 weights
    # ... and in the same slot order: the float32 sum over the k slots follows it.
    assert torch.equal(indices, ref_indices) and torch.equal(weights, ref_weights)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_eager_experts_match_transformers_eager(checkpoint: Path, dtype: torch.dtype) -> None:
    """`experts_implementation="eager"` (also the index_add order of llmcompressor's linearized
    experts) casts each weighted expert output to the compute dtype and accumulates in it.  Exact in
    float32 too: each expert's rows go through the GEMM in the eager loop's order (in another order
    float32 rows came out ~1e-6 off here)."""
    ref = hf_moe(checkpoint, dtype, "eager")
    assert ref.config._experts_implementation == "eager"
    x = random_input(dtype, seed=2)
    with torch.no_grad():
        expected = ref(x)
    assert torch.equal(engine_moe(checkpoint, dtype, "eager")(x), expected)
    if dtype == torch.bfloat16:
        # The two accumulations give different numbers: the default one must not be the eager one.
        assert not torch.equal(engine_moe(checkpoint, dtype)(x), expected)


def test_only_experts_with_tokens_run(checkpoint: Path) -> None:
    ours = engine_moe(checkpoint, torch.bfloat16)
    calls: list[int] = []
    for e, expert in enumerate(ours.experts):

        def counted(x: torch.Tensor, e: int = e, forward=expert.forward) -> torch.Tensor:
            calls.append(e)
            return forward(x)

        expert.forward = counted
    x = random_input(torch.bfloat16, seed=3, tokens=3)
    ours(x)
    _, indices = ours.route(x)
    assert calls == sorted(set(indices.flatten().tolist()))
    assert len(calls) < ours.num_experts


def test_router_read_as_transformers_holds_it(checkpoint: Path, tmp_path: Path) -> None:
    """A checkpoint with the router and its bias stored in float32, off the bf16 grid, served in bf16:
    transformers casts the router weight to bf16 but keeps `e_score_correction_bias` in float32
    (`_keep_in_fp32_modules_strict`); the engine must read both the same way."""
    path = tmp_path / "fp32_router"
    shutil.copytree(checkpoint, path)
    tensors = load_file(path / "model.safetensors")
    gen = torch.Generator().manual_seed(4)
    for name in (f"{PREFIX}.gate.weight", f"{PREFIX}.gate.e_score_correction_bias"):
        value = tensors[name].float()
        tensors[name] = value + torch.rand(value.shape, generator=gen) * 1e-3  # not bf16-representable
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    stored_bias = tensors[f"{PREFIX}.gate.e_score_correction_bias"]
    assert not torch.equal(stored_bias.bfloat16().float(), stored_bias)

    dtype = torch.bfloat16
    ref, ours = hf_moe(path, dtype), engine_moe(path, dtype)
    assert torch.equal(ours.e_score_correction_bias, stored_bias)
    assert torch.equal(ref.gate.e_score_correction_bias, stored_bias)
    assert torch.equal(ours.gate_weight, ref.gate.weight.float())
    x = random_input(dtype, seed=5)
    with torch.no_grad():
        _, ref_weights, ref_indices = ref.gate(x)
        expected = ref(x)
    weights, indices = ours.route(x)
    assert torch.equal(indices, ref_indices) and torch.equal(weights, ref_weights)
    assert torch.equal(ours(x), expected)


# ---------------------------------------------------------------------------------------------
# Routing properties
# ---------------------------------------------------------------------------------------------

EXPERTS, GROUPS, TOPK_GROUP, TOP_K, ROUTER_HIDDEN = 16, 4, 2, 4, 32


def random_router(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(256, ROUTER_HIDDEN, generator=gen)
    weight = torch.randn(EXPERTS, ROUTER_HIDDEN, generator=gen) * 0.3
    bias = torch.randn(EXPERTS, generator=gen) * 0.1
    return x, weight, bias


def route_random(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, topk_group: int = TOPK_GROUP):
    return route(
        x,
        weight,
        bias,
        top_k=TOP_K,
        n_group=GROUPS,
        topk_group=topk_group,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
    )


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("arch", ARCHS)
def test_group_limited_routing(arch: str, seed: int) -> None:
    x, weight, bias = random_router(seed)
    weights, indices = route_random(x, weight, bias)

    # Every token's experts lie in at most `topk_group` groups, and those are the groups with the
    # highest group score (sum of the group's 2 best biased scores).
    scores = torch.sigmoid(x @ weight.T) + bias
    group_scores = scores.view(-1, GROUPS, EXPERTS // GROUPS).topk(2, dim=-1)[0].sum(dim=-1)
    best_groups = group_scores.topk(TOPK_GROUP, dim=-1)[1]
    groups = indices // (EXPERTS // GROUPS)
    for token in range(x.shape[0]):
        used = set(groups[token].tolist())
        assert len(used) <= TOPK_GROUP
        assert used <= set(best_groups[token].tolist())

    # The restriction binds: without it, some tokens would take experts from more groups.
    _, unrestricted = route_random(x, weight, bias, topk_group=GROUPS)
    spread = [len(set((row // (EXPERTS // GROUPS)).tolist())) for row in unrestricted]
    assert max(spread) > TOPK_GROUP
    assert not torch.equal(indices.sort(dim=-1)[0], unrestricted.sort(dim=-1)[0])

    # And it is what the transformers router of this family computes.
    config_class, router_class = ROUTERS[arch]
    config = config_class(
        hidden_size=ROUTER_HIDDEN,
        n_routed_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        n_group=GROUPS,
        topk_group=TOPK_GROUP,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
    )
    router = router_class(config)
    with torch.no_grad():
        router.weight.copy_(weight)
        router.e_score_correction_bias.copy_(bias)
        _, ref_weights, ref_indices = router(x)
    assert torch.equal(indices, ref_indices) and torch.equal(weights, ref_weights)


def test_correction_bias_changes_the_choice_not_the_weights(checkpoint: Path) -> None:
    ours = engine_moe(checkpoint, torch.float32)
    x = random_input(torch.float32, seed=6, tokens=256)
    kwargs = dict(
        top_k=ours.top_k,
        n_group=ours.n_group,
        topk_group=ours.topk_group,
        norm_topk_prob=ours.norm_topk_prob,
        routed_scaling_factor=ours.routed_scaling_factor,
    )
    unbiased_scores = torch.sigmoid(x @ ours.gate_weight.T)

    def expected_weights(indices: torch.Tensor) -> torch.Tensor:
        chosen = unbiased_scores.gather(1, indices)
        return chosen / (chosen.sum(dim=-1, keepdim=True) + 1e-20) * ours.routed_scaling_factor

    weights, indices = route(x, ours.gate_weight, ours.e_score_correction_bias, **kwargs)
    plain_weights, plain_indices = route(x, ours.gate_weight, torch.zeros_like(ours.e_score_correction_bias), **kwargs)
    # The checkpoint's (random) bias changes which experts some tokens get ...
    assert not torch.equal(by_expert(weights, indices)[0], by_expert(plain_weights, plain_indices)[0])
    # ... but the weights of the chosen experts always come from the un-biased sigmoid scores.
    torch.testing.assert_close(weights, expected_weights(indices), atol=1e-6, rtol=0)
    torch.testing.assert_close(plain_weights, expected_weights(plain_indices), atol=1e-6, rtol=0)

    # A large bias on one expert wins it every token, yet its weight is still its plain score's share.
    favourite = 5
    bias = torch.zeros_like(ours.e_score_correction_bias)
    bias[favourite] = 10.0
    weights, indices = route(x, ours.gate_weight, bias, **kwargs)
    assert (indices == favourite).any(dim=-1).all()
    torch.testing.assert_close(weights, expected_weights(indices), atol=1e-6, rtol=0)


def test_an_expert_in_exact_numerics_rounds_as_transformers_fused_gate_up(tmp_path: Path) -> None:
    """transformers holds an unquantized checkpoint's experts as one `gate_up_proj` and applies SiLU
    to the gate half of each row in place; float32 SiLU rounds such a strided half otherwise than a
    contiguous tensor (issue #37's MLA sweep: every case of hidden size 96). Exact numerics run
    gate and up as separate products, and must still give the fused expert's bits."""
    import json
    import types

    import torch.nn.functional as F

    from onboard.engine.layers.mlp import LlamaMLP

    gen = torch.Generator().manual_seed(0)
    hidden, inter = 96, 48
    shapes = {"gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}
    stored = {f"e.{name}_proj.weight": torch.randn(*shape, generator=gen) for name, shape in shapes.items()}
    save_file(stored, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": hidden}))
    weights = CheckpointWeights(tmp_path, dtype=torch.float32, fuse_linears=False)  # exact numerics' source
    expert = LlamaMLP(types.SimpleNamespace(hidden_act="silu"), weights, "e", expert=True)
    gate_up = torch.cat([stored["e.gate_proj.weight"], stored["e.up_proj.weight"]])
    for rows in range(1, 33):
        x = torch.randn(rows, hidden, generator=gen)
        gate, up = F.linear(x, gate_up).chunk(2, dim=-1)  # transformers' eager expert, op for op
        assert torch.equal(expert(x), F.linear(F.silu(gate) * up, stored["e.down_proj.weight"])), rows
