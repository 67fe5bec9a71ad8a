"""GLM-5.3-Flash in the engine (KDA over the per-sequence state pool, NoPE MLA with the pooled DSA
indexer and a shared selection, hyper-connection streams, clamped MoE) against transformers'
torch path, in exact numerics: prefill bit for bit in bf16 and float32, the indexer's selected keys
at every position, decode, prefill chunked across KDA's 64-token chunks and across steps,
preemption, rolled-back draft tokens, fast numerics, and every state slot given back."""

from pathlib import Path

import pytest
import torch
import transformers
from state_family import (
    NEW_TOKENS,
    check_fast_numerics,
    check_preemption,
    check_rollback,
    check_slots_given_back,
    drained,
    engine,
    greedy,
    greedy_reference,
    prompts,
)

from onboard.adapt.dsa import compare_selections
from onboard.engine.models import kv_layout_for, model_class
from onboard.engine.weights import CheckpointWeights
from onboard.errors import OnboardError
from onboard.models.vlm import text_model_config


def load(path: Path, dtype: torch.dtype):
    return transformers.AutoModelForImageTextToText.from_pretrained(path, dtype=dtype).eval()


@pytest.fixture(scope="module")
def hf(tiny_glm5_next: Path):
    return load(tiny_glm5_next, torch.bfloat16)


@pytest.fixture(scope="module")
def reference(hf) -> list[list[int]]:
    return greedy_reference(hf)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_prefill_and_index_sets_are_transformers_bit_for_bit(tiny_glm5_next: Path, hf, dtype) -> None:
    """Logits equal, and the pooled indexer's selected keys transformers' at every position of
    every prompt (sparse from 12 keys on: two pools of four and the visible tail)."""
    model = hf if dtype == torch.bfloat16 else load(tiny_glm5_next, dtype)
    llm = engine(tiny_glm5_next, dtype)
    sparse = 0
    for prompt in prompts():
        with torch.no_grad():
            want = model(torch.tensor([prompt])).logits[0].float()
        trace: dict = {}
        assert torch.equal(llm.score(prompt, trace=trace), want), len(prompt)
        sets = compare_selections(model, prompt, trace)
        assert sets["equal"] == sets["positions"] == len(prompt)
        assert set(trace) == {2}  # the shared layer 3 records nothing of its own
        (selection,) = trace[2]
        (mask,) = selection.prefill
        sparse += 0 if mask is None else int((mask.sum(-1) < torch.arange(1, len(prompt) + 1)).sum())
    assert sparse > 100
    stats = llm.stats()
    assert stats["prefix_caching"] is False  # a cached prefix would need the state at its end
    # two KDA layers: fp32 [4, 16, 16] states and [192, 4] conv windows in the compute dtype
    itemsize = dtype.itemsize
    assert stats["state_bytes_per_sequence"] == 2 * (4 * 16 * 16 * 4 + 192 * 4 * itemsize)
    # the latent row (kv_lora_rank 32, no RoPE key) on both DSA layers, the indexer's key and gate on one
    assert stats["kv_bytes_per_token"] == (2 * 32 + 2 * 32) * itemsize


def test_aux_states_are_transformers_hidden_states(tiny_glm5_next: Path, hf) -> None:
    """An aux layer's input is its hyper-connection streams `[T, hc, H]`, transformers'
    `hidden_states[i]`; index N the final-normed `[T, H]`, its last entry (what MTP reads)."""
    prompt = prompts()[2]
    final, aux = engine(tiny_glm5_next).hidden_states(prompt, aux_layers=(0, 3, 4))
    with torch.no_grad():
        want = hf(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    assert len(want) == 5 and want[0].shape == (1, len(prompt), 4, 64)
    assert [a.shape for a in aux] == [want[0][0].shape, want[3][0].shape, want[4][0].shape]
    assert all(torch.equal(a, want[i][0]) for a, i in zip(aux, (0, 3, 4), strict=True))
    assert torch.equal(final, want[4][0])


def test_layouts_hold_the_dsa_and_kda_layers_only(tiny_glm5_next: Path) -> None:
    config = text_model_config(transformers.AutoConfig.from_pretrained(tiny_glm5_next))
    layout = kv_layout_for(config)
    assert {t.name: t.layers for t in layout.tensors} == {"latent": (2, 3), "index_k": (2,)}
    state = model_class(config).state_layout_for(config, torch.bfloat16)
    assert {t.name: t.layers for t in state.tensors} == {"conv": (0, 1), "recurrent": (0, 1)}
    # transformers hands a shared layer the selection of the layer just before it: a KDA layer has none
    config.indexer_types = ["full", "full", "shared", "full"]
    with pytest.raises(OnboardError, match="layer 2 shares a DSA selection"):
        model_class(config)(config, CheckpointWeights(tiny_glm5_next))


def chunked_greedy(hf, prompt: list[int], chunk: int) -> tuple[list[int], list[torch.Tensor]]:
    """transformers prefilling `prompt` in `chunk`-token forwards through its cache, then decoding
    greedily: the tokens and each one's log-probabilities."""
    cache, tokens, logprobs = None, [], []
    with torch.no_grad():
        for start in range(0, len(prompt), chunk):
            out = hf(torch.tensor([prompt[start : start + chunk]]), past_key_values=cache, use_cache=True)
            cache = out.past_key_values
        for _ in range(NEW_TOKENS):
            logprobs.append(torch.log_softmax(out.logits[0, -1].float(), dim=-1))
            tokens.append(int(logprobs[-1].argmax()))
            out = hf(torch.tensor([tokens[-1:]]), past_key_values=cache, use_cache=True)
            cache = out.past_key_values
    return tokens, logprobs


def test_decode_and_chunked_prefill_follow_transformers(tiny_glm5_next: Path, hf) -> None:
    """Each prompt prefilled in 48-token steps (the KDA state and the indexer keys carried between
    them) and decoded: what transformers gives prefilling in the same chunks through its cache,
    every log-probability included.  (A chunk boundary rounds the KDA state otherwise, and on this
    model that flips a pool choice a few tokens later: transformers' own whole-prompt continuation
    of the 130-token prompt parts from its chunked one at the 11th token.)"""
    llm = engine(tiny_glm5_next, max_num_batched_tokens=48)
    for prompt in prompts():
        (out,) = llm.generate([prompt], greedy(logprobs=5))
        tokens, logprobs = chunked_greedy(hf, prompt, 48)
        assert out.token_ids == tokens, len(prompt)
        for entry, theirs in zip(out.logprobs, logprobs, strict=True):
            assert [t for t, _ in entry["top"]] == theirs.topk(5).indices.tolist()
            assert [lp for _, lp in entry["top"]] == pytest.approx(theirs.topk(5).values.tolist(), abs=1e-6)
    assert drained(llm)


def test_batched_decode_gives_each_prompts_greedy_tokens(tiny_glm5_next: Path, reference) -> None:
    llm = engine(tiny_glm5_next)
    assert [o.token_ids for o in llm.generate(prompts(), greedy())] == reference
    assert drained(llm)


def test_preempted_sequences_recompute_their_state(tiny_glm5_next: Path, reference) -> None:
    check_preemption(tiny_glm5_next, reference)


def test_rejected_draft_tokens_roll_the_state_back(tiny_glm5_next: Path) -> None:
    """The draft reads the final-normed state (aux layer N, `[T, H]`)."""
    check_rollback(tiny_glm5_next, 3, aux_layers=lambda llm: [llm._runner.hf_config.num_hidden_layers])


def test_fast_numerics_within_the_near_tie_rule_and_batch_invariant(tiny_glm5_next: Path, hf, reference) -> None:
    check_fast_numerics(tiny_glm5_next, hf, reference)


def test_state_slots_are_given_back_after_every_ending(tiny_glm5_next: Path) -> None:
    check_slots_given_back(tiny_glm5_next)
