"""`export_speculator` writes what the `speculators` library itself loads and runs identically.

The config is compared with the one speculators' own pydantic classes build, and the export is
loaded with `Eagle3DraftModel.from_pretrained` (the verifier embedding coming from the tiny
checkpoint) and run side by side with our draft.  speculators is a dev-only dependency
(`make setup` installs it with --no-deps); without it these tests are skipped.
"""

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file

from onboard.speculator.draft import Eagle3Draft, draft_layer_config
from onboard.speculator.export import export_speculator, load_speculator

speculators_eagle3 = pytest.importorskip(
    "speculators.models.eagle3",
    reason="speculators is not installed (dev-only: `pip install --no-deps speculators==0.9.0`, see Makefile)",
)
from speculators.config import SpeculatorsConfig, VerifierConfig  # noqa: E402
from speculators.proposals.greedy import GreedyTokenProposalConfig  # noqa: E402

Eagle3DraftModel = speculators_eagle3.Eagle3DraftModel
Eagle3SpeculatorConfig = speculators_eagle3.Eagle3SpeculatorConfig

DRAFT_VOCAB = 128
AUX_LAYERS = [0, 1, 2]  # the tiny llama has 2 layers; speculators accepts ids in [0, num_layers]
K = 3
SEQ = 12


def _seeded_draft(verifier: Path, seed: int = 0) -> Eagle3Draft:
    layer_config = draft_layer_config(transformers.AutoConfig.from_pretrained(verifier))
    draft = Eagle3Draft(layer_config, DRAFT_VOCAB, AUX_LAYERS)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(draft.named_parameters(), key=lambda kv: kv[0]):
            if name == "embed_tokens.weight":
                continue
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else 0.15 * noise)
        embed = load_file(verifier / "model.safetensors")["model.embed_tokens.weight"]
        draft.embed_tokens.weight.copy_(embed.float())
    vocab = torch.randperm(layer_config.vocab_size, generator=gen)[:DRAFT_VOCAB].sort().values
    draft.set_vocab(vocab)
    return draft.eval()


@pytest.fixture
def exported(tiny_llama: Path, tmp_path: Path) -> tuple[Eagle3Draft, Path]:
    draft = _seeded_draft(tiny_llama)
    out = tmp_path / "speculator"
    export_speculator(draft, out, tiny_llama, K)
    return draft, out


def _load_speculators(out: Path) -> "Eagle3DraftModel":
    config = Eagle3SpeculatorConfig.from_pretrained(out)
    config.transformer_layer_config._attn_implementation = "eager"  # flex attention is GPU-only
    model = Eagle3DraftModel.from_pretrained(out, config=config, dtype=torch.float32)
    return model.eval()


def test_config_matches_speculators_own(exported: tuple[Eagle3Draft, Path], tiny_llama: Path) -> None:
    draft, out = exported
    text = (out / "config.json").read_text(encoding="utf-8")
    written = json.loads(text)

    expected = Eagle3SpeculatorConfig(
        transformer_layer_config=draft_layer_config(transformers.AutoConfig.from_pretrained(tiny_llama)),
        draft_vocab_size=DRAFT_VOCAB,
        norm_before_residual=False,
        fc_norm=True,
        eagle_aux_hidden_state_layer_ids=AUX_LAYERS,
        dtype="float32",
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=K)],
            default_proposal_method="greedy",
            verifier=VerifierConfig.from_pretrained(str(tiny_llama)),
        ),
    )
    assert written == json.loads(expected.to_json_string())
    assert text == expected.to_json_string()  # byte for byte, as PretrainedConfig writes it

    assert written["speculators_model_type"] == "eagle3"
    assert written["architectures"] == ["Eagle3Speculator"]
    assert written["draft_vocab_size"] == DRAFT_VOCAB
    assert written["eagle_aux_hidden_state_layer_ids"] == AUX_LAYERS
    assert written["norm_before_residual"] is False
    spec = written["speculators_config"]
    assert spec["default_proposal_method"] == "greedy"
    assert [(m["proposal_type"], m["speculative_tokens"]) for m in spec["proposal_methods"]] == [("greedy", K)]
    assert spec["verifier"] == {"name_or_path": str(tiny_llama), "architectures": ["LlamaForCausalLM"]}
    assert written["transformer_layer_config"]["head_dim"] == draft.layer_config.head_dim

    # And speculators reads it back as the same config.
    loaded = Eagle3SpeculatorConfig.from_pretrained(out)
    assert loaded.to_json_string() == expected.to_json_string()


def test_weights_are_the_whole_draft_state(exported: tuple[Eagle3Draft, Path]) -> None:
    draft, out = exported
    state = draft.state_dict()
    with safe_open(out / "model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}
        names = set(f.keys())
        assert names == set(state)
        assert {"d2t", "t2d"} <= names
        for name in names:
            tensor = f.get_tensor(name)
            assert tensor.dtype == state[name].dtype
            assert torch.equal(tensor, state[name]), name

    # Exactly the keys speculators' model has, less the verifier head and norm it never saves.
    model = _load_speculators(out)
    assert names == set(model.state_dict()) - set(Eagle3DraftModel._keys_to_ignore_on_save)


def test_speculators_loads_and_runs_it_identically(exported: tuple[Eagle3Draft, Path], tiny_llama: Path) -> None:
    draft, out = exported
    model = _load_speculators(out)
    assert torch.equal(model.d2t, draft.d2t)
    assert torch.equal(model.t2d, draft.t2d)
    verifier_embed = load_file(tiny_llama / "model.safetensors")["model.embed_tokens.weight"]
    assert torch.equal(model.embed_tokens.weight, verifier_embed.float())  # the target's, exported
    for name, tensor in draft.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name

    gen = torch.Generator().manual_seed(1)
    hidden = draft.layer_config.hidden_size
    aux = torch.randn(1, SEQ, len(AUX_LAYERS) * hidden, generator=gen)
    input_ids = torch.randint(0, draft.layer_config.vocab_size, (1, SEQ), generator=gen)
    positions = torch.arange(1, SEQ + 1)[None]

    with torch.no_grad():
        # Step 0 through speculators' submodules in its forward's order vs our inference step.
        causal = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
        ours = draft.step(input_ids, draft.project(aux), positions, causal[None, None], transformers.DynamicCache())
        assert model.fc_norm is not None  # exported as `fc_norm: true`, speculators' per-layer norms
        normed = torch.cat([norm(c) for norm, c in zip(model.fc_norm, aux.chunk(len(AUX_LAYERS), -1), strict=True)], -1)
        states = torch.cat([model.embed_tokens(input_ids), model.fc(normed)], dim=-1)
        out_state = model.layers[0](
            states,
            attention_mask=torch.zeros(SEQ, SEQ).masked_fill(~causal, float("-inf"))[None, None],
            position_ids=positions,
            past_key_values=transformers.DynamicCache(),
            cache_position=torch.arange(SEQ),
            position_embeddings=model.rotary_emb(states, positions),
        )
        theirs = model.lm_head(model.norm(out_state))
        torch.testing.assert_close(ours.hidden, out_state, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours.logits, theirs, rtol=1e-5, atol=1e-5)

        # The full training-time-test forward: capture every step's logits at lm_head.
        captured: list[torch.Tensor] = []
        hook = model.lm_head.register_forward_hook(lambda _m, _i, output: captured.append(output))
        try:
            tokens = model(aux, input_ids, document_ids=torch.zeros(1, SEQ, dtype=torch.long), ttt_steps=K)
        finally:
            hook.remove()
        unrolled = draft.unroll(aux, input_ids, torch.ones(1, SEQ, dtype=torch.bool), K)
    assert len(captured) == len(unrolled) == K
    for step, (mine, spec) in enumerate(zip(unrolled, captured, strict=True)):
        torch.testing.assert_close(mine, spec, rtol=1e-5, atol=1e-5, msg=lambda m, s=step: f"ttt step {s}: {m}")
        assert torch.equal(mine.argmax(-1), tokens[step])


def test_export_is_deterministic_and_replaces_atomically(
    exported: tuple[Eagle3Draft, Path], tiny_llama: Path, tmp_path: Path
) -> None:
    draft, out = exported
    first = {p.name: p.read_bytes() for p in out.iterdir()}
    assert sorted(first) == ["config.json", "model.safetensors"]

    again = tmp_path / "again"
    export_speculator(_seeded_draft(tiny_llama), again, tiny_llama, K)
    assert {p.name: p.read_bytes() for p in again.iterdir()} == first

    # Re-exporting over an existing directory replaces it whole and leaves no staging behind.
    (out / "stale.txt").write_text("old")
    export_speculator(draft, out, tiny_llama, K)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again", "speculator"]


def test_load_speculator_inverts_export(exported: tuple[Eagle3Draft, Path]) -> None:
    draft, out = exported
    loaded = load_speculator(out)
    assert loaded.aux_layer_ids == draft.aux_layer_ids and loaded.draft_vocab_size == draft.draft_vocab_size
    assert (loaded.fc_norm is None) == (draft.fc_norm is None)
    mine, theirs = draft.state_dict(), loaded.state_dict()
    assert mine.keys() == theirs.keys()
    for name, tensor in mine.items():
        assert torch.equal(tensor, theirs[name]), name
