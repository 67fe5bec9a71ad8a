"""`onboard bench-quant` on the tiny llama: methods, both halves, every selection and budget, one
held-out split."""

import json
from pathlib import Path

import pytest

from onboard.models import inspect_checkpoint
from onboard.quantize.bench import SELECTIONS, run_bench_quant
from onboard.quantize.groups import fits
from onboard.recipes import Calibration, Eval, Quantize, Recipe, Search

RECIPE = Recipe(
    quantize=Quantize(
        calibration=Calibration(num_samples=4, max_seq_length=64),
        search=Search(tokens=128, steps=3),
        distill_tokens=128,
    ),
    eval=Eval(max_tokens=512, window=64, per_layer_tokens=0),
)
BUDGETS = [5.0, 6.0]
METHODS = ("rtn", "gptq", "awq", "spinquant", "smoothquant+expanded_mse")


@pytest.fixture(scope="module")
def bench(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path) -> dict:
    out = tmp_path_factory.mktemp("bench") / "bench-quant.json"
    run_bench_quant(inspect_checkpoint(tiny_llama), RECIPE, BUDGETS, None, None, out, METHODS)
    return json.loads(out.read_text())


def test_every_method_and_selection_has_a_row(bench: dict) -> None:
    uniform = [r for r in bench["rows"] if r["selection"] == "uniform"]
    assert [r["method"] for r in uniform if r["format"] == "nvfp4"] == list(METHODS)
    best = min((r for r in uniform if r["format"] == "nvfp4"), key=lambda r: r["mean_kld"])
    assert bench["best_method"] == best["method"]
    # each single lever on the weights alone; the activations alone for the levers that move them
    halves = {(r["method"], r["format"]) for r in uniform if r["format"] != "nvfp4"}
    assert {("rtn", "nvfp4a16"), ("gptq", "nvfp4a16"), ("spinquant", "nvfp4a16")} <= halves
    assert {m for m, f in halves if f == "nvfp4_activations"} >= {"rtn", "awq", "spinquant"}
    assert ("gptq", "nvfp4_activations") not in halves
    selections = [row["selection"] for row in bench["rows"]]
    assert set(selections) == {*SELECTIONS, "distilled"}
    assert selections.count("additive") == selections.count("search") == len(BUDGETS)
    chosen = {r["method"] for r in bench["rows"] if r["selection"] not in ("uniform", "distilled")}
    assert chosen == {bench["best_method"]}
    for row in bench["rows"]:
        assert set(row) >= {"method", "budget", "effective_bits", "mean_kld", "top1_agreement", "seconds"}
        assert row["mean_kld"] >= 0 and 0 <= row["top1_agreement"] <= 1


def test_distilled_rows_train_the_scales_of_rtn_and_the_best_method(bench: dict) -> None:
    distilled = {r["method"]: r for r in bench["rows"] if r["selection"] == "distilled"}
    assert set(distilled) == {"rtn", bench["best_method"]}
    for row in distilled.values():
        record = row["distill"]
        assert record["tokens"] == 128
        assert record["calibration_kld_after"] <= record["calibration_kld_before"]


def test_budgets_are_respected_and_fixed_rows_carry_their_own_bits(bench: dict) -> None:
    for row in bench["rows"]:
        if row["selection"] in ("additive", "search"):
            assert row["budget"] in BUDGETS
            assert fits(row["effective_bits"], row["budget"])
        else:
            assert row["budget"] == pytest.approx(row["effective_bits"], abs=1e-4)
    uniform = next(r for r in bench["rows"] if r["method"] == "rtn" and r["format"] == "nvfp4")
    ends = next(r for r in bench["rows"] if r["selection"] == "heuristic_ends_bf16")
    assert uniform["mean_kld"] > 0
    # 2 layers: both ends are all of it, in BF16 from the best method's smoothed (or rotated) model,
    # the reference up to the bf16 rounding of its transformed weights
    assert ends["effective_bits"] == 16.0 and ends["mean_kld"] < 0.01 * uniform["mean_kld"]


def test_search_is_no_worse_than_additive_on_calibration_text(bench: dict) -> None:
    for budget in BUDGETS:
        additive, search = (
            next(r for r in bench["rows"] if r["selection"] == m and r["budget"] == budget)
            for m in ("additive", "search")
        )
        assert search["calibration_kld"] <= additive["calibration_kld"]


def test_a_rerun_keeps_every_row_measured_before(bench: dict, tmp_path: Path, tiny_llama: Path) -> None:
    out = tmp_path / "bench-quant.json"
    out.write_text(json.dumps(bench))
    again = run_bench_quant(inspect_checkpoint(tiny_llama), RECIPE, BUDGETS, None, None, out, METHODS)
    assert again["rows"] == bench["rows"]  # the measured seconds too: nothing was measured again
    assert json.loads(out.read_text()) == bench
    # A run of fewer methods (here: one, whose rows were all measured) keeps the others' rows too.
    fewer = run_bench_quant(inspect_checkpoint(tiny_llama), RECIPE, BUDGETS, None, None, out, (bench["best_method"],))
    assert sorted(map(json.dumps, fewer["rows"])) == sorted(map(json.dumps, bench["rows"]))


def test_rows_of_other_package_versions_are_measured_again(bench: dict, tmp_path: Path, tiny_llama: Path) -> None:
    out = tmp_path / "bench-quant.json"
    older = {**bench, "versions": {**bench["versions"], "llmcompressor": "0.0.1"}}
    older["rows"] = [{**row, "mean_kld": -1.0} for row in bench["rows"]]
    out.write_text(json.dumps(older))
    again = run_bench_quant(inspect_checkpoint(tiny_llama), RECIPE, [5.0], None, None, out, ("rtn",))
    assert again["versions"] == bench["versions"]
    assert again["rows"] and all(row["mean_kld"] >= 0 for row in again["rows"])


def test_calibration_and_heldout_text_are_apart(bench: dict) -> None:
    assert bench["data"] == "builtin:eval" and bench["calibration"] == "builtin:calib"
    assert bench["heldout_tokens"] > 0


def test_heuristics_follow_their_rules() -> None:
    from onboard.quantize.bench import heuristics
    from onboard.quantize.groups import Group

    kinds = ("qkv", "o_proj", "gate_up", "down_proj")
    groups = [
        Group(f"l{i}.{k}", k, i, (f"l{i}.{k}",), (f"l{i}.{k}",), ((16, 16),), "") for i in range(6) for k in kinds
    ]
    rules = heuristics(groups, "nvfp4")
    attn, down, ends = rules["heuristic_attn_fp8"], rules["heuristic_down_fp8"], rules["heuristic_ends_bf16"]
    for g in groups:
        assert attn[g.name] == ("fp8" if g.kind in ("qkv", "o_proj") else "nvfp4")
        assert down[g.name] == ("fp8" if g.kind == "down_proj" else "nvfp4")
        assert ends[g.name] == ("bf16" if g.layer in (0, 1, 4, 5) else "nvfp4")
