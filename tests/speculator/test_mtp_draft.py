"""A checkpoint's own MTP layers as the engine's draft, on tiny models of each MTP family
(DeepSeek-V3, DeepSeek-V3.2, GLM-5; Qwen3.5's module and GLM-5.3-Flash's layer): its proposals
are transformers' `MtpModel`'s on the same states (on models of the release's depth, which
`MtpModel.from_pretrained` finds the layers by), and speculative greedy decoding with it is plain
greedy decoding (float32: the engine's lossless rule for MLA families), chained beyond the one
layer as vLLM chains it."""

from pathlib import Path

import pytest
import tiny_models
import torch
import transformers
from transformers.modeling_layers import MtpModel

from onboard.engine.config import EngineConfig
from onboard.engine.llm_engine import LLMEngine
from onboard.engine.sampler import SamplingParams
from onboard.errors import OnboardError
from onboard.speculator.drafts import load_draft
from onboard.speculator.mtp_draft import load_mtp_draft, mtp_config

ARCHS = ["deepseek_v3", "deepseek_v32", "glm_moe_dsa"]
# Glue that transformers has no model of (`qwen_mtp_draft.py`, `glm_mtp_draft.py`).
GLUE = ["tiny_qwen3_5", "tiny_qwen3_5_moe", "tiny_glm5_next"]
FAMILIES = [*(f"tiny_mtp_{arch}" for arch in ARCHS), *GLUE]
ENGINE = EngineConfig(block_size=4, num_blocks=512, max_model_len=256, enable_prefix_caching=False)


def prompts(lengths: tuple[int, ...], seed: int = 7) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=gen).tolist() for n in lengths]


class _FirstOutput(torch.nn.Module):
    """GLM-5's decoder layer returns (state, top-k indices); transformers 5.17's `MtpLayer` hands
    the pair to its norm. The reference gets the state, nothing else changed."""

    def __init__(self, block: torch.nn.Module):
        super().__init__()
        self.block = block

    def forward(self, *args, **kwargs):
        out = self.block(*args, **kwargs)
        return out[0] if isinstance(out, tuple) else out


def reference_mtp(path: Path) -> tuple[transformers.PreTrainedModel, MtpModel]:
    """transformers' main model and its `MtpModel`, loaded by `MtpModel.from_pretrained` (V3.2 and
    GLM-5 configs name the count `num_nextn_predict_layers`, which transformers does not read)."""
    main = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    main.config = mtp_config(main.config)
    mtp = MtpModel.from_pretrained(main, device_map={"": "cpu"}).eval()
    mtp.layers[0].mtp_block = _FirstOutput(mtp.layers[0].mtp_block)
    return main, mtp


@pytest.fixture(scope="module")
def release_depth(tmp_path_factory: pytest.TempPathFactory):
    def build(arch: str) -> Path:
        return tiny_models.build_mtp_model(tmp_path_factory.mktemp(f"release_{arch}"), arch, release_depth=True)

    return build


@pytest.mark.parametrize("arch", ARCHS)
@torch.inference_mode()
def test_proposals_equal_transformers_mtp_model(arch: str, release_depth) -> None:
    """Row i reads the target's final state at i and token i+1 and predicts token i+2. The engine's
    states, fed to the draft a prefill chunk then one row at a time through its cache, give
    transformers' `MtpLayer` logits over the whole sequence at once (causal mask, no cache)."""
    path = release_depth(arch)
    engine = LLMEngine(path, ENGINE, dtype=torch.float32)
    target = engine.target_tensors()
    draft = load_mtp_draft(path, target["embed_tokens"], target["lm_head"], torch.float32)
    main, reference = reference_mtp(path)
    (ids,) = prompts((40,))  # longer than the DSA indexer's top-16: the selection is sparse
    n = main.config.num_hidden_layers
    _, (states,) = engine.hidden_states(ids, [n])
    theirs = main(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
    assert torch.equal(states, theirs)  # the engine's state N is transformers' last hidden state

    length = len(ids) - 1
    tokens, positions = torch.tensor([ids[1:]]), torch.arange(1, len(ids))[None]
    embeds = reference.embed_tokens(tokens)
    causal = torch.full((length, length), torch.finfo(torch.float32).min).triu(1)[None, None]
    layer_out = reference.layers[0](
        embeds,
        states[None, :-1],
        position_embeddings=reference.rotary_emb(embeds, position_ids=positions),
        attention_mask=causal,
        position_ids=positions,
        past_key_values=None,
    )
    want = reference._project_to_logits(layer_out)[0].float()

    cache, split = draft.new_cache(), 25
    chunk = torch.ones(split, split, dtype=torch.bool).tril()[None, None]
    first = draft.step(tokens[:, :split], states[None, :split], positions[:, :split], chunk, cache)
    rows = [first.logits[0]]
    for i in range(split, length):
        rows.append(
            draft.step(tokens[:, i : i + 1], states[None, i : i + 1], positions[:, i : i + 1], None, cache).logits[0]
        )
    got = torch.cat(rows)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("family", FAMILIES)
def test_speculative_greedy_with_mtp_equals_plain_greedy(family: str, k: int, request) -> None:
    """K = 3 chains the one MTP layer three times (vLLM's reuse); every step proposes K tokens
    where room allows, and the KV blocks and the draft's states are all handed back."""
    path = request.getfixturevalue(family)
    engine = LLMEngine(path, ENGINE, dtype=torch.float32)
    work = prompts((30, 9, 17))
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    want = [c.token_ids for c in engine.generate(work, params)]
    draft, default_k = load_draft(Path("mtp"), path, engine)
    assert default_k == 1
    engine.set_speculator(draft, k)
    got = [c.token_ids for c in engine.generate(work, params)]
    assert got == want
    stats = engine.speculator.stats
    assert stats.num_drafts > 0 and len(stats.accepted_per_position) == k
    assert stats.num_draft_tokens > (k - 1) * stats.num_drafts  # chained past the one layer
    assert not engine.has_unfinished() and engine.speculator.states == {}
    assert engine.stats()["num_free_blocks"] == ENGINE.num_blocks


def test_a_checkpoint_without_mtp_layers_is_refused(tiny_deepseek_v3: Path) -> None:
    """tiny_deepseek_v3's config declares transformers' default of one MTP layer but holds none."""
    engine = LLMEngine(tiny_deepseek_v3, ENGINE, dtype=torch.float32)
    with pytest.raises(OnboardError, match="has no MTP layers"):
        load_draft(Path("mtp"), tiny_deepseek_v3, engine)


@pytest.mark.parametrize("family", GLUE)
def test_mtp_glue_goes_back_in_its_checkpoint_names(family: str, request) -> None:
    """What `--draft mtp` writes back after fine-tuning: every stored tensor of the MTP layer, in
    its name, dtype and bytes (experts one by one again), and nothing else: GLM-5.3-Flash's copies
    of the embedding and the head are the served model's, and stay as stored."""
    from onboard.models.mtp import mtp_entries

    path = request.getfixturevalue(family)
    engine = LLMEngine(path, ENGINE)
    draft, _ = load_draft(Path("mtp"), path, engine)
    state = draft.checkpoint_state()
    stored = {n: e for n, e in mtp_entries(path).items() if not n.endswith(("embed_tokens.weight", "head.weight"))}
    assert set(state) == set(stored)
    for name, entry in stored.items():
        assert state[name].contiguous().view(torch.uint8).numpy().tobytes() == entry.read(), name


@pytest.mark.parametrize("family", ["tiny_qwen3_5", "tiny_glm5_next"])
def test_mtp_glue_caches_as_it_computes_whole(family: str, request) -> None:
    """Row by row over its own KV cache (GLM-5.3-Flash's: its indexer's pooled keys too), the
    layer proposes what it proposes over the whole sequence at once."""
    path = request.getfixturevalue(family)
    engine = LLMEngine(path, ENGINE, dtype=torch.float32)
    draft, _ = load_draft(Path("mtp"), path, engine)
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(3, 512, (1, 24), generator=gen)
    states = torch.randn(1, 24, tiny_models.HIDDEN_SIZE, generator=gen)
    positions = torch.arange(1, 25)[None]
    causal = torch.ones(24, 24, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        whole = draft.step(tokens, states, positions, causal, draft.new_cache()).logits[0]
        cache = draft.new_cache()
        rows = [
            draft.step(tokens[:, i : i + 1], states[:, i : i + 1], positions[:, i : i + 1], None, cache).logits[0]
            for i in range(24)
        ]
    torch.testing.assert_close(torch.cat(rows), whole, rtol=0, atol=1e-5)


def test_glm5_next_mtp_trains_on_padded_batches_as_on_each_sequence(tiny_glm5_next: Path) -> None:
    """The training unroll over a right-padded batch gives each sequence's real rows what it gives
    that sequence alone, at every depth (padding is never attended, and stays finite); a mask the
    pooled-key indexer cannot take, training-time test's block mask, is refused."""
    from onboard.speculator.draft import ttt_unroll

    engine = LLMEngine(tiny_glm5_next, ENGINE, dtype=torch.float32)
    draft, _ = load_draft(Path("mtp"), tiny_glm5_next, engine)
    gen = torch.Generator().manual_seed(5)
    aux = torch.randn(2, 20, tiny_models.HIDDEN_SIZE, generator=gen)
    ids = torch.randint(3, 512, (2, 20), generator=gen)
    valid = torch.ones(2, 20, dtype=torch.bool)
    valid[1, 12:] = False
    with torch.no_grad():
        batch = draft.unroll(aux, ids, valid, 3)
        alone = draft.unroll(aux[1:, :12], ids[1:, :12], valid[1:, :12], 3)
        for s in range(3):
            assert torch.isfinite(batch[s]).all()
            torch.testing.assert_close(batch[s][1, : 12 - s], alone[s][0, : 12 - s], rtol=0, atol=1e-5)
        with pytest.raises(ValueError, match="causal masks over right-padded keys"):
            ttt_unroll(draft, aux, ids, valid, 2)
