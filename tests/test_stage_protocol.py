"""The stage protocol (`onboard/stage.py`): every row of the pipeline's table has the same pair,
and a new stage is a module plus a row (the worked example of docs/adding-a-stage.md runs)."""

import inspect
import json
import re
import sys
from pathlib import Path

import pytest
from build_once import copy_of

from onboard import pipeline, workspace
from onboard.recipes import Calibration, Quantize

ROOT = Path(__file__).resolve().parents[1]
CALIB = Calibration(num_samples=2, max_seq_length=64)


@pytest.mark.parametrize("name", list(pipeline.STAGE_MODULES))
def test_every_stage_module_has_plan_and_run(name: str) -> None:
    module = pipeline.stage_module(name)
    assert list(inspect.signature(module.plan).parameters) == ["ctx"]
    assert list(inspect.signature(module.run).parameters) == ["run_dir", "ctx"]


def test_stages_are_the_table_then_the_verdict() -> None:
    assert (*pipeline.STAGE_MODULES, "report", "gate") == pipeline.STAGES


def test_the_plans_are_printed_in_table_order_whatever_the_order_asked(tiny_llama: Path) -> None:
    ctx = pipeline.stage_context(tiny_llama, None, {})
    plans = pipeline.run_plan(ctx, ["smoke", "quantize", "report"])
    assert [plan.stage for plan in plans] == ["quantize", "smoke"]


def test_stages_that_run_the_engine_refuse_in_their_plan_a_family_it_lacks(tiny_llama: Path, tmp_path: Path) -> None:
    """Before any stage runs: speculator, adapt and smoke name what the engine lacks; quantize and
    eval, which need no engine, plan as usual."""
    import tiny_models

    from onboard.errors import OnboardError
    from onboard.stage import engine_refusal

    ctx = pipeline.stage_context(tiny_models.build_engine_lacks(tmp_path / "llama4"), None, {})
    assert "chunked attention" in engine_refusal(ctx.checkpoint)
    assert engine_refusal(pipeline.stage_context(tiny_llama, None, {}).checkpoint) is None
    for name in ("speculator", "adapt", "smoke"):
        with pytest.raises(OnboardError, match=f"^{name}: the serving engine does not support"):
            pipeline.stage_module(name).plan(ctx)
    assert [pipeline.stage_module(name).plan(ctx).stage for name in ("quantize", "eval")] == ["quantize", "eval"]


def test_skip_adapt_plans_transformers_only_where_the_engine_lacks_the_family(tiny_llama: Path, tmp_path: Path) -> None:
    """--skip-adapt: adapt is skipped for any family; smoke and the speculator keep the engine where
    it serves the family, and otherwise go through transformers (smoke) or are skipped."""
    import tiny_models

    lacking = tiny_models.build_engine_lacks(tmp_path / "llama4")
    paths = {}
    for name, model in (("served", tiny_llama), ("lacking", lacking)):
        ctx = pipeline.stage_context(model, None, {}, skip_adapt=True)
        paths[name] = {plan.stage: plan.path for plan in pipeline.run_plan(ctx, list(pipeline.STAGES))}
    in_memory = {"quantize": "in-memory", "eval": "in-memory"}
    assert paths["served"] == {**in_memory, "speculator": "in-memory", "adapt": "skipped", "smoke": "in-memory"}
    assert paths["lacking"] == {**in_memory, "speculator": "skipped", "adapt": "skipped", "smoke": "transformers"}


def _example_stage() -> str:
    """The first Python block of docs/adding-a-stage.md: the example stage's whole module."""
    text = (ROOT / "docs" / "adding-a-stage.md").read_text()
    return re.findall(r"```python\n(.*?)```", text, re.DOTALL)[0]


def test_the_example_stage_runs_in_the_pipeline(
    tiny_llama: Path, quantized_run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The documented stage, added as the page says (a layout constant, a table row), plans, runs,
    writes its result through the staging area and is resumed on a second run."""
    package = tmp_path / "example"
    (package / "example_tokenizer").mkdir(parents=True)
    (package / "example_tokenizer" / "stage.py").write_text(_example_stage())
    monkeypatch.syspath_prepend(str(package))
    monkeypatch.setattr(workspace, "TOKENIZER", "tokenizer/tokenizer.json", raising=False)
    monkeypatch.setitem(pipeline.STAGE_MODULES, "tokenizer", "example_tokenizer.stage")
    monkeypatch.setattr(pipeline, "STAGES", (*pipeline.STAGE_MODULES, "report", "gate"))
    out = copy_of(quantized_run(tiny_llama, Quantize(calibration=CALIB)), tmp_path / "run")
    ctx = pipeline.stage_context(tiny_llama, None, {})
    try:
        assert pipeline.run_pipeline(ctx, out, ["tokenizer"]) == 0
        result = json.loads((out / "tokenizer" / "tokenizer.json").read_text())
        assert result["num_texts"] > 0 and result["differ"] == []
        entry = json.loads((out / "manifest.json").read_text())["stages"]["tokenizer"]
        assert entry["status"] == "done" and entry["metrics"]["num_differ"] == 0
        assert pipeline.run_pipeline(ctx, out, ["tokenizer"]) == 0  # resumed: the entry is the same
        assert json.loads((out / "manifest.json").read_text())["stages"]["tokenizer"] == entry
    finally:
        sys.modules.pop("example_tokenizer.stage", None)
        sys.modules.pop("example_tokenizer", None)
