"""Engine model code vs transformers: prefill logits, chunked prefill + batched greedy decode, RoPE scaling.

The engine models run over a hand-built paged KV cache (a shuffled free list of blocks, so a
sequence's blocks are not contiguous) with hand-built `ForwardBatch`es; transformers runs each
prompt alone in the same dtype (bf16).
"""

import importlib.util
import json
import random
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from onboard.engine.attention import AttentionMetadata, attention_backend
from onboard.engine.batch import ForwardBatch
from onboard.engine.context import StepContext
from onboard.engine.kv_cache import KVCache, KVLayout
from onboard.engine.linear import EngineLinear
from onboard.engine.models import (
    MODEL_REGISTRY,
    LlamaModel,
    Qwen3MoeModel,
    UnsupportedArchitecture,
    model_class,
    supported_architectures,
)
from onboard.engine.weights import NotFusable

DTYPE = torch.bfloat16
BLOCK_SIZE = 4
# One-step prefill runs the same ops on the same shapes as transformers: exact on CPU so far.
MAX_LOGIT_DIFF = 1e-2
# Batched decode (one padded SDPA call for sequences of different lengths) and chunked prefill
# (an explicit mask instead of `is_causal`) change SDPA's reduction order, and GEMMs over a
# different number of rows may sum in another order: logits then differ by a few bf16 ulps
# (1 ulp = 0.0625 for logits in [8, 16); seen so far: <= 0.12).  Greedy tokens must match
# transformers except at a near-tie, where transformers' own top-2 margin is within that noise.
DECODE_LOGIT_DIFF = 0.25

HAVE_CHECKPOINT_WEIGHTS = importlib.util.find_spec("onboard.engine.weights") is not None


# ---------------------------------------------------------------------------------------------
# Weight sources
# ---------------------------------------------------------------------------------------------


class PlainWeights:
    """Serves an unquantized safetensors checkpoint (stand-in for `weights.CheckpointWeights`)."""

    def __init__(self, path: Path, dtype: torch.dtype, device: str = "cpu", fuse: bool = True):
        self.tensors: dict[str, torch.Tensor] = {}
        for file in sorted(Path(path).glob("*.safetensors")):
            self.tensors.update({k: v.to(dtype=dtype, device=device) for k, v in load_file(file).items()})
        self.fuse = fuse

    def has(self, name: str) -> bool:
        return name in self.tensors

    def tensor(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def linear(self, prefix: str) -> EngineLinear:
        return EngineLinear(self.tensors[f"{prefix}.weight"], self.tensors.get(f"{prefix}.bias"))

    def fused_linear(self, prefixes) -> EngineLinear:
        if not self.fuse:
            raise NotFusable(f"fusion disabled for {prefixes}")
        biases = [self.tensors.get(f"{p}.bias") for p in prefixes]
        if any(b is None for b in biases) and not all(b is None for b in biases):
            raise NotFusable(f"some of {prefixes} have a bias")
        weight = torch.cat([self.tensors[f"{p}.weight"] for p in prefixes])
        bias = None if biases[0] is None else torch.cat(biases)
        return EngineLinear(weight, bias)


def weight_source(kind: str, path: Path):
    if kind == "plain":
        return PlainWeights(path, DTYPE)
    if kind == "unfused":
        return PlainWeights(path, DTYPE, fuse=False)
    if kind == "checkpoint":
        if not HAVE_CHECKPOINT_WEIGHTS:
            pytest.skip("onboard/engine/weights.py is not there yet")
        from onboard.engine.weights import CheckpointWeights

        return CheckpointWeights(path, DTYPE, torch.device("cpu"))
    raise ValueError(kind)


def load_engine(path: Path, kind: str = "plain") -> tuple[LlamaModel, transformers.PretrainedConfig]:
    config = transformers.AutoConfig.from_pretrained(path)
    model = model_class(config)(config, weight_source(kind, path))
    return model, config


def load_hf(path: Path) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=DTYPE).eval()


BACKEND = attention_backend("cpu")


def new_cache(model: LlamaModel, num_blocks: int = 64) -> KVCache:
    return KVCache(model.kv_layout, num_blocks, BLOCK_SIZE, "cpu")


def forward(model, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
    """The model's hidden states for one step, on the exact CPU backend."""
    ctx = StepContext(cache, BACKEND, BACKEND.build_metadata(batch), batch.positions)
    return model(batch, ctx).hidden


# ---------------------------------------------------------------------------------------------
# A minimal scheduler: block allocation and ForwardBatch building
# ---------------------------------------------------------------------------------------------


class BlockAllocator:
    """Hands out blocks from a shuffled free list, so block tables are scattered over the cache."""

    def __init__(self, num_blocks: int, seed: int = 0):
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)

    def ensure(self, table: list[int], num_tokens: int) -> None:
        while len(table) * BLOCK_SIZE < num_tokens:
            table.append(self.free.pop())


class Seq:
    def __init__(self, tokens: list[int]):
        self.tokens = list(tokens)
        self.num_prompt = len(tokens)
        self.num_computed = 0
        self.table: list[int] = []


def make_batch(work: list[tuple[Seq, int]], allocator: BlockAllocator) -> ForwardBatch:
    """One step: `(seq, num_new_tokens)` per scheduled sequence, starting at its `num_computed`."""
    ids, positions, slots, query_lens, context_lens, tables, last_rows = [], [], [], [], [], [], []
    for seq, n in work:
        start, end = seq.num_computed, seq.num_computed + n
        allocator.ensure(seq.table, end)
        ids += seq.tokens[start:end]
        positions += list(range(start, end))
        slots += [seq.table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, end)]
        query_lens.append(n)
        context_lens.append(end)
        tables.append(list(seq.table))
        last_rows.append(len(ids) - 1)
    return ForwardBatch(
        input_ids=torch.tensor(ids),
        positions=torch.tensor(positions),
        slot_mapping=torch.tensor(slots),
        query_lens=query_lens,
        context_lens=context_lens,
        block_tables=tables,
        logits_indices=torch.tensor(last_rows),
        block_size=BLOCK_SIZE,
    )


def engine_generate(
    model: LlamaModel, prompts: list[list[int]], chunk: int, max_new: int
) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
    """Greedy decoding with chunked prefill: each step a sequence takes up to `chunk` prompt tokens
    or, once its prompt is in, its next token; sequences of different lengths mix prefill and decode."""
    cache = new_cache(model)
    allocator = BlockAllocator(cache.num_blocks)
    seqs = [Seq(p) for p in prompts]
    sampled: list[list[torch.Tensor]] = [[] for _ in prompts]
    while any(len(s.tokens) - s.num_prompt < max_new for s in seqs):
        work = []
        for s in seqs:
            if len(s.tokens) - s.num_prompt >= max_new:
                continue
            if s.num_computed < s.num_prompt:
                work.append((s, min(chunk, s.num_prompt - s.num_computed)))
            else:
                work.append((s, 1))
        batch = make_batch(work, allocator)
        logits = model.compute_logits(forward(model, batch, cache)[batch.logits_indices])
        for (s, n), row in zip(work, logits, strict=True):
            s.num_computed += n
            if s.num_computed == len(s.tokens):  # the step reached the end of what it knows: sample
                s.tokens.append(int(row.argmax()))
                sampled[seqs.index(s)].append(row)
    return [s.tokens[s.num_prompt :] for s in seqs], sampled


@torch.no_grad()
def hf_generate(
    hf: transformers.PreTrainedModel, prompt: list[int], max_new: int
) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy decoding with transformers' own KV cache (no EOS stop); tokens and their logits."""
    cache = transformers.DynamicCache(config=hf.config)
    ids = torch.tensor([prompt])
    out, rows = [], []
    for _ in range(max_new):
        rows.append(hf(input_ids=ids, past_key_values=cache, use_cache=True).logits[0, -1].float())
        out.append(int(rows[-1].argmax()))
        ids = torch.tensor([[out[-1]]])
    return out, rows


@torch.no_grad()
def hf_logits(hf: transformers.PreTrainedModel, prompt: list[int]) -> torch.Tensor:
    return hf(input_ids=torch.tensor([prompt])).logits[0].float()


def random_prompts(lengths: list[int], vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def prefill_parity(path: Path, lengths: list[int], kind: str = "plain", seed: int = 0) -> float:
    """Prefill all prompts in ONE step; compare every position's logits with transformers."""
    model, config = load_engine(path, kind)
    hf = load_hf(path)
    prompts = random_prompts(lengths, config.vocab_size, seed)
    cache = new_cache(model)
    seqs = [Seq(p) for p in prompts]
    batch = make_batch([(s, len(s.tokens)) for s in seqs], BlockAllocator(cache.num_blocks))
    hidden = forward(model, batch, cache)
    assert hidden.shape == (sum(lengths), config.hidden_size) and hidden.dtype == DTYPE
    logits = model.compute_logits(hidden)
    assert logits.dtype == torch.float32
    worst = 0.0
    start = 0
    for prompt in prompts:
        ours = logits[start : start + len(prompt)]
        ref = hf_logits(hf, prompt)
        start += len(prompt)
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))
        worst = max(worst, (ours - ref).abs().max().item())
    # The last-position logits through `logits_indices` are the same rows (the lm_head GEMM over
    # fewer rows may round a few logits differently).
    last = model.compute_logits(hidden[batch.logits_indices])
    assert (last - logits[batch.logits_indices]).abs().max().item() <= DECODE_LOGIT_DIFF
    print(f"\n{path.name} [{kind}] prefill max |logit diff| = {worst:.3g}")
    assert worst <= MAX_LOGIT_DIFF
    return worst


def decode_parity(path: Path, lengths: list[int], chunk: int, max_new: int = 8, kind: str = "plain") -> None:
    """Chunked prefill + batched greedy decode vs transformers' greedy decode of each prompt alone."""
    model, config = load_engine(path, kind)
    hf = load_hf(path)
    prompts = random_prompts(lengths, config.vocab_size, seed=1)
    ours, our_logits = engine_generate(model, prompts, chunk=chunk, max_new=max_new)
    worst, near_ties, compared = 0.0, 0, 0
    for prompt, mine, mine_logits in zip(prompts, ours, our_logits, strict=True):
        ref, ref_logits = hf_generate(hf, prompt, max_new)
        for i, (a, b) in enumerate(zip(mine, ref, strict=True)):
            worst = max(worst, (mine_logits[i] - ref_logits[i]).abs().max().item())
            compared += 1
            if a != b:  # only acceptable at a near-tie of transformers' own logits; stop comparing there
                margin = (ref_logits[i][b] - ref_logits[i][a]).item()
                assert margin <= DECODE_LOGIT_DIFF, f"token {i} of {prompt}: {mine} vs {ref} (margin {margin})"
                near_ties += 1
                break
    print(f"\n{path.name} [{kind}] decode: max |logit diff| = {worst:.3g}, {near_ties} near-tie divergences")
    assert worst <= DECODE_LOGIT_DIFF
    assert near_ties <= 1 and compared >= len(prompts) * max_new - max_new


# ---------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------

FAMILIES = ["tiny_llama", "tiny_qwen3", "tiny_qwen3_moe"]


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_logits_match_transformers(family, request):
    prefill_parity(request.getfixturevalue(family), [5, 13, 1, 9])


@pytest.mark.parametrize("kind", ["unfused", "checkpoint"])
@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_other_weight_sources(family, kind, request):
    prefill_parity(request.getfixturevalue(family), [7, 3], kind=kind)


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_and_batched_decode_match_generate(family, request):
    # chunk 6: 11 -> 6+5, 7 -> 6+1, 14 -> 6+6+2; steps mix prefill chunks with decodes.
    decode_parity(request.getfixturevalue(family), [11, 7, 14], chunk=6)


def test_prompt_in_two_halves_then_decode(tiny_llama):
    decode_parity(tiny_llama, [10, 4, 17], chunk=9)


@pytest.mark.parametrize("family", FAMILIES)
def test_single_sequence_decode(family, request):
    # Batch-1 decode: one-row steps (single-row GEMMs; the decode view over consecutive blocks is
    # not used here since the test allocator scatters blocks).
    decode_parity(request.getfixturevalue(family), [13], chunk=13, max_new=10)


ROPE_VARIANTS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "longrope": {
        "rope_type": "longrope",
        "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 4.0],
        "long_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0],
        "original_max_position_embeddings": 128,
    },
}


def with_rope(src: Path, dst: Path, params: dict, theta: float = 500.0) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["rope_parameters"] = {"rope_theta": theta, **params}
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


@pytest.mark.parametrize("variant", sorted(ROPE_VARIANTS))
def test_rope_scaling_matches_transformers(variant, tiny_llama, tmp_path):
    path = with_rope(tiny_llama, tmp_path / f"llama_{variant}", ROPE_VARIANTS[variant])
    prefill_parity(path, [21, 6])
    decode_parity(path, [9, 16], chunk=5, max_new=4)


def test_rope_scaling_qwen3_moe(tiny_qwen3_moe, tmp_path):
    path = with_rope(tiny_qwen3_moe, tmp_path / "moe_llama3", ROPE_VARIANTS["llama3"])
    prefill_parity(path, [18, 4])


def _save_random(config: transformers.PretrainedConfig, out: Path, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if not name.endswith("norm.weight"):
                std = 0.35 if "embed" in name or "lm_head" in name else 0.15
                param.copy_(torch.randn(param.shape, generator=gen) * std)
        for name, buffer in sorted(model.named_buffers(), key=lambda kv: kv[0]):
            if name.endswith("e_score_correction_bias"):  # a selection bias that changes the choice
                buffer.copy_(torch.randn(buffer.shape, generator=gen) * 0.1)
    model.to(DTYPE).save_pretrained(out)
    return out


TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def test_qwen2_with_biases(tmp_path):
    path = _save_random(transformers.Qwen2Config(**TINY, tie_word_embeddings=True), tmp_path / "qwen2")
    assert "model.layers.0.self_attn.q_proj.bias" in load_file(path / "model.safetensors")
    prefill_parity(path, [9, 4])
    decode_parity(path, [8, 3], chunk=5, max_new=4)


def test_mistral_sliding_window(tmp_path):
    config = transformers.MistralConfig(**TINY, sliding_window=5, tie_word_embeddings=False)
    path = _save_random(config, tmp_path / "mistral")
    prefill_parity(path, [12, 3])
    decode_parity(path, [9, 13], chunk=4, max_new=6)


# DeepSeek-V3's MoE as the GLM families configure it: 8 experts in 2 groups, top-2, one shared.
DEEPSEEK_MOE = dict(
    moe_intermediate_size=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    n_shared_experts=1,
    tie_word_embeddings=False,
)


def test_glm4_moe_partial_rotary_biases_and_deepseek_moe(tmp_path):
    """GLM-4.5's family: half-rotary GQA with q/k/v biases and q/k norms, one dense layer, then
    DeepSeek's sigmoid-routed, group-limited MoE with a shared expert; prefill bitwise-close and
    chunked decode as transformers."""
    config = transformers.Glm4MoeConfig(
        **TINY,
        head_dim=16,
        partial_rotary_factor=0.5,
        attention_bias=True,
        use_qk_norm=True,
        **DEEPSEEK_MOE,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
    )
    path = _save_random(config, tmp_path / "glm4_moe")
    assert model_class(transformers.AutoConfig.from_pretrained(path)).__name__ == "Glm4MoeModel"
    assert prefill_parity(path, [13, 5]) == 0.0
    decode_parity(path, [9, 12], chunk=5, max_new=4)


def test_minimax_m2_whole_projection_qk_norms_and_a_sigmoid_router(tmp_path):
    """MiniMax-M2's family: RMSNorms over the whole q and k projections, partial rotary, and a
    sigmoid router with a selection bias and no groups over Mixtral-named experts, in every layer."""
    config = transformers.MiniMaxM2Config(
        **{**TINY, "intermediate_size": 32},
        head_dim=16,
        num_local_experts=8,
        num_experts_per_tok=2,
        rope_parameters={"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.5},
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    path = _save_random(config, tmp_path / "minimax_m2")
    stored = load_file(path / "model.safetensors")
    assert stored["model.layers.0.self_attn.q_norm.weight"].shape == (4 * 16,)
    assert "model.layers.1.block_sparse_moe.experts.7.w3.weight" in stored
    assert model_class(transformers.AutoConfig.from_pretrained(path)).__name__ == "MiniMaxM2Model"
    assert prefill_parity(path, [13, 5]) == 0.0
    decode_parity(path, [9, 12], chunk=5, max_new=4)


def test_gpt_oss_sinks_alternating_windows_and_biased_clamped_experts(tmp_path):
    """gpt-oss's family: q/k/v/o biases, a learned sink per head, sliding and full layers
    alternating, YaRN, float32-product norms, and a biased top-k-then-softmax router over clamped
    experts stored as 3-D tensors with biases; prompts longer than the window, decode across it."""
    config = transformers.GptOssConfig(
        **{**TINY, "intermediate_size": 32},
        head_dim=16,
        num_local_experts=8,
        num_experts_per_tok=2,
        sliding_window=6,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    assert config.layer_types == ["sliding_attention", "full_attention"]
    path = _save_random(config, tmp_path / "gpt_oss")
    assert "model.layers.0.self_attn.sinks" in load_file(path / "model.safetensors")
    assert model_class(transformers.AutoConfig.from_pretrained(path)).__name__ == "GptOssModel"
    assert prefill_parity(path, [13, 5]) == 0.0
    decode_parity(path, [9, 12], chunk=5, max_new=6)


def test_registry():
    assert set(supported_architectures()) == set(MODEL_REGISTRY)
    assert model_class(transformers.Qwen3MoeConfig(architectures=["Qwen3MoeForCausalLM"])) is Qwen3MoeModel
    assert model_class(transformers.MistralConfig(architectures=["MistralForCausalLM"])) is LlamaModel
    with pytest.raises(UnsupportedArchitecture) as info:
        model_class(transformers.PretrainedConfig(architectures=["NotAModelForCausalLM"]))
    message = str(info.value)
    assert "NotAModelForCausalLM" in message and "LlamaForCausalLM" in message
    assert "docs/adding-an-architecture.md" in message


def test_what_the_engine_lacks_is_named_for_families_transformers_knows():
    """Each entry is a model_type transformers has, of a family the registry does not serve, and
    the refusal for it names what the engine lacks."""
    from types import SimpleNamespace

    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    from onboard.engine.models import LACKING

    assert set(LACKING) <= set(CONFIG_MAPPING_NAMES)
    for model_type, lacks in LACKING.items():
        # a VLM checkpoint names its wrapper, a text-only one its causal LM
        arch = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.get(model_type) or MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(
            model_type, f"{model_type}ForConditionalGeneration"
        )
        assert arch not in MODEL_REGISTRY, model_type
        with pytest.raises(UnsupportedArchitecture) as info:
            model_class(SimpleNamespace(architectures=[arch], model_type=model_type))
        assert f"({model_type}: the engine lacks {lacks})" in str(info.value)


def test_kv_cache_write_gather():
    cache = KVCache(KVLayout.mha(2, 2, 4, torch.float32), 8, BLOCK_SIZE, "cpu")
    k = torch.randn(6, 2, 4)
    v = torch.randn(6, 2, 4)
    table = [5, 2]
    slots = torch.tensor([table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(6)])
    cache.write(1, slots, k=k, v=v)
    gk, gv = cache.gather("k", 1, table, 6), cache.gather("v", 1, table, 6)
    assert torch.equal(gk, k) and torch.equal(gv, v)
    assert cache.blocks("k", 0).abs().sum() == 0


def _reference_attention(q, k, v, window):
    """q [ql, h, d] at the last ql of len(k) positions; k/v [ctx, kvh, d]; float64 softmax."""
    ql, h, d = q.shape
    ctx, kvh = k.shape[0], k.shape[1]
    k = k.repeat_interleave(h // kvh, dim=1).double()
    v = v.repeat_interleave(h // kvh, dim=1).double()
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * d**-0.5
    q_pos = torch.arange(ql)[:, None] + ctx - ql
    k_pos = torch.arange(ctx)[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).float()


@pytest.mark.parametrize("consecutive", [False, True])
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize(
    "scenario",
    [
        # (prefix already cached, new tokens) per sequence, in batch order
        [(6, 1), (0, 5), (11, 1), (6, 4), (0, 1)],  # mixed: decode rows around prefill rows
        [(6, 1), (2, 1), (12, 1)],  # decode-only, padded to the longest context
        [(9, 1)],  # one sequence
        [(0, 7)],  # one fresh prefill (is_causal path)
        [(5, 3), (0, 6)],  # chunked + fresh prefill
    ],
)
def test_paged_attention_matches_reference(scenario, window, consecutive):
    """paged_attention vs float64 attention over each sequence's full K/V (float32 cache)."""
    torch.manual_seed(0)
    h, kvh, d = 4, 2, 8
    cache = KVCache(KVLayout.mha(1, kvh, d, torch.float32), 32, BLOCK_SIZE, "cpu")
    allocator = BlockAllocator(cache.num_blocks, seed=3)
    if consecutive:  # blocks handed out in order, as the engine's block manager does
        allocator.free.sort(reverse=True)
    full_k, full_v, work = [], [], []
    for cached, new in scenario:
        seq = Seq(list(range(cached + new)))
        k, v = torch.randn(cached + new, kvh, d), torch.randn(cached + new, kvh, d)
        if cached:  # an earlier step wrote the prefix
            prefix = make_batch([(seq, cached)], allocator)
            cache.write(0, prefix.slot_mapping, k=k[:cached], v=v[:cached])
            seq.num_computed = cached
        full_k.append(k)
        full_v.append(v)
        work.append((seq, new))
    batch = make_batch(work, allocator)
    q = torch.randn(batch.input_ids.shape[0], h, d)
    k_new = torch.cat([k[s.num_computed :] for k, (s, _) in zip(full_k, work, strict=True)])
    v_new = torch.cat([v[s.num_computed :] for v, (s, _) in zip(full_v, work, strict=True)])
    meta = AttentionMetadata.build(batch, "cpu")
    assert (meta.decode_block_range is not None) == (consecutive and len(scenario) == 1 and scenario[0][1] == 1)
    out = BACKEND.attend(q, k_new, v_new, 0, cache, meta, d**-0.5, window)
    assert out.shape == q.shape
    start = 0
    for (_seq, new), k, v in zip(work, full_k, full_v, strict=True):
        ref = _reference_attention(q[start : start + new], k, v, window)
        torch.testing.assert_close(out[start : start + new], ref, atol=1e-5, rtol=1e-5)
        start += new


def test_decode_reads_consecutive_blocks_in_place():
    seq = Seq(list(range(9)))
    seq.table = [4, 5, 6]
    seq.num_computed = 8
    meta = AttentionMetadata.build(make_batch([(seq, 1)], BlockAllocator(0)), "cpu")
    assert meta.decode_block_range == (4, 7) and meta.decode_mask is None


def test_bf16_decode_attention_close_to_reference():
    """A bf16 decode batch of sequences with different context lengths."""
    torch.manual_seed(0)
    h, kvh, d = 4, 2, 16
    cache = KVCache(KVLayout.mha(1, kvh, d, DTYPE), 32, BLOCK_SIZE, "cpu")
    allocator = BlockAllocator(cache.num_blocks, seed=5)
    seqs = [Seq(list(range(n))) for n in (9, 3, 14)]
    ks = [torch.randn(len(s.tokens), kvh, d).to(DTYPE) for s in seqs]
    vs = [torch.randn(len(s.tokens), kvh, d).to(DTYPE) for s in seqs]
    for s, k, v in zip(seqs, ks, vs, strict=True):
        cache.write(0, make_batch([(s, len(s.tokens) - 1)], allocator).slot_mapping, k=k[:-1], v=v[:-1])
        s.num_computed = len(s.tokens) - 1
    batch = make_batch([(s, 1) for s in seqs], allocator)
    q = torch.randn(len(seqs), h, d).to(DTYPE)
    meta = AttentionMetadata.build(batch, "cpu")
    out = BACKEND.attend(q, torch.stack([k[-1] for k in ks]), torch.stack([v[-1] for v in vs]), 0, cache, meta, d**-0.5)
    assert out.dtype == DTYPE
    for i, (k, v) in enumerate(zip(ks, vs, strict=True)):
        ref = _reference_attention(q[i : i + 1].float(), k.float(), v.float(), None)
        torch.testing.assert_close(out[i : i + 1].float(), ref, atol=2e-2, rtol=2e-2)
