"""Each VLM family's line in `onboard.models.vlm.WRAPPERS` against the modules transformers builds
for it, and the text view of a VLM checkpoint that every stage reads."""

import json
from pathlib import Path

import pytest
import torch
import transformers

from onboard.models.vlm import WRAPPERS, checkpoint_name, text_config, text_name, vision_entries, wrapper_of


@pytest.mark.parametrize("model_type", sorted(WRAPPERS))
def test_the_wrapper_names_where_transformers_keeps_each_part(model_type: str) -> None:
    """Built on the meta device from the family's default config: the text model's decoder under
    `text_prefix`, the vision tower under a kept prefix, and nothing else but the head."""
    config = transformers.AutoConfig.for_model(model_type)
    with torch.device("meta"):
        model = transformers.AutoModelForImageTextToText.from_config(config)
    wrapper = WRAPPERS[model_type]
    names = [name for name, _ in model.named_parameters()]
    assert any(name.startswith(wrapper.text_prefix + "layers.0.") for name in names)
    assert any(name.startswith(wrapper.kept_prefixes) for name in names)
    assert all(name.startswith((wrapper.text_prefix, *wrapper.kept_prefixes, "lm_head.")) for name in names)


def test_a_vlm_checkpoint_is_read_as_its_text_model(tiny_qwen3_5: Path) -> None:
    config = json.loads((tiny_qwen3_5 / "config.json").read_text())
    wrapper = wrapper_of(config)
    text = text_config(config)
    assert text["architectures"] == ["Qwen3_5ForConditionalGeneration"] and text["num_hidden_layers"] == 2
    assert checkpoint_name("model.layers.1.mlp.up_proj", wrapper) == "model.language_model.layers.1.mlp.up_proj"
    assert checkpoint_name("lm_head", wrapper) == "lm_head"
    assert text_name("model.language_model.norm.weight", wrapper) == "model.norm.weight"
    assert text_name("model.visual.merger.linear_fc1.weight", wrapper) is None
    assert vision_entries(tiny_qwen3_5) and all(
        name.startswith("model.visual.") for name in vision_entries(tiny_qwen3_5)
    )
    llama = {"model_type": "llama", "num_hidden_layers": 2}
    assert (
        wrapper_of(llama) is None
        and text_config(llama) is llama
        and checkpoint_name("model.norm", None) == "model.norm"
    )
