"""The engine's public surface (`onboard/engine/__init__.py`) is what the rest of onboard uses:
hidden states and decoder layers as the model computes and holds them, `StepBench`'s placed
decode steps, `LayerStepper`'s one layer at a time, and no module outside the engine reaching into
its runner, scheduler or block manager, or importing its internals from its submodules."""

import ast
from pathlib import Path

import pytest
import tiny_models
import torch

import onboard
import onboard.engine
from onboard.engine import EngineConfig, LayerStepper, LLMEngine, StepBench, checkpoint_linears
from onboard.models import inspect_checkpoint, load_model

AUX = (0, 1)
CONFIG = EngineConfig(block_size=4, num_blocks=64, max_model_len=128)  # exact numerics


def _token_lists() -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (37, 5, 18)]


@pytest.fixture(scope="module")
def engine(tiny_llama: Path) -> LLMEngine:
    return LLMEngine(tiny_llama, CONFIG)  # bf16, as served


@pytest.fixture(scope="module")
def model(tiny_llama: Path):
    return load_model(inspect_checkpoint(tiny_llama))  # bf16


@torch.inference_mode()
def test_hidden_states_are_the_models_own(engine: LLMEngine, model) -> None:
    """Exact numerics: the final normed states and each aux layer's input are transformers'
    `hidden_states[-1]` and `hidden_states[i]` bit for bit, alone and batched."""
    token_lists = _token_lists()
    batched = engine.batched_hidden_states(token_lists, AUX)
    assert engine.stats()["num_free_blocks"] == CONFIG.num_blocks  # every block handed back
    for ids, (final, aux) in zip(token_lists, batched, strict=True):
        theirs = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
        alone_final, alone_aux = engine.hidden_states(ids, AUX)
        assert final.dtype == torch.bfloat16 and final.shape == (len(ids), engine.hf_config.hidden_size)
        assert torch.equal(final, theirs[-1][0]) and torch.equal(alone_final, final)
        assert len(aux) == len(alone_aux) == len(AUX)
        for layer, mine, alone in zip(AUX, aux, alone_aux, strict=True):
            assert torch.equal(mine, theirs[layer][0]) and torch.equal(alone, mine), layer


def test_batched_hidden_states_refuse_what_the_cache_cannot_hold(engine: LLMEngine) -> None:
    too_many = [[5] * 100] * 3  # 25 blocks each, 64 in all
    with pytest.raises(ValueError, match="not enough free KV-cache blocks"):
        engine.batched_hidden_states(too_many)
    assert engine.stats()["num_free_blocks"] == CONFIG.num_blocks  # the ones allocated, released


def test_decoder_layer_holds_the_checkpoints_weights(engine: LLMEngine, model) -> None:
    layers = model.model.layers
    last = engine.decoder_layer(-1)
    assert last is engine.decoder_layer(len(layers) - 1)
    for index, theirs in enumerate(layers):
        mine = engine.decoder_layer(index)
        assert torch.equal(mine.input_layernorm.weight, theirs.input_layernorm.weight)
        assert torch.equal(mine.self_attn.o_proj.weight, theirs.self_attn.o_proj.weight)
        assert torch.equal(mine.mlp.down_proj.weight, theirs.mlp.down_proj.weight)


@pytest.mark.parametrize("numerics", ["exact", "fast"])
def test_step_bench_decodes_at_a_placed_context(numerics: str, tiny_llama: Path) -> None:
    """A decode step over a sequence placed with its KV already in the cache gives the logits its
    prefill gave for the same last token (float32: the forms differ by far less than 1e-4)."""
    bench = StepBench(tiny_llama, CONFIG, dtype=torch.float32)
    assert bench.num_decoder_layers == 2
    first, second = _token_lists()[0], _token_lists()[2]
    blocks = -(-len(first) // CONFIG.block_size)
    prefilled = bench.run([bench.place(first, 0, 0), bench.place(second, blocks, 0)], numerics)
    assert prefilled.shape == (2, tiny_models.VOCAB_SIZE) and prefilled.dtype == torch.float32
    decoded = bench.run([bench.place(first, 0, len(first) - 1), bench.place(second, blocks, len(second) - 1)], numerics)
    torch.testing.assert_close(decoded, prefilled, rtol=0, atol=1e-4)
    assert torch.equal(decoded.argmax(-1), prefilled.argmax(-1))


@torch.inference_mode()
@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_glm_moe_dsa"])
def test_layer_stepper_computes_the_engines_forward(fixture: str, request: pytest.FixtureRequest) -> None:
    """One layer at a time, each built on demand and run over one prefill step, gives the engine's
    layer inputs and logits bit for bit; on GLM-5 (a prompt longer than the indexer's top-k) the
    shared layer reuses the selection the indexer layer before it handed on."""
    path = request.getfixturevalue(fixture)
    engine = LLMEngine(path, CONFIG)
    stepper = LayerStepper(path)  # bf16 on the CPU, as the engine's exact numerics
    ids = _token_lists()[0]
    layers = range(stepper.num_decoder_layers)
    _, inputs = engine.hidden_states(ids, layers)
    hidden, step = stepper.embed(ids), stepper.prefill(len(ids))
    for index in layers:
        assert torch.equal(hidden, inputs[index]), index
        hidden = stepper.run_decoder_layer(stepper.decoder_layer(index), hidden, step)
    assert torch.equal(stepper.compute_logits(stepper.final_norm(hidden)), engine.score(ids))
    if fixture == "tiny_glm_moe_dsa":
        assert len(ids) > stepper.hf_config.index_topk and "shared" in stepper.hf_config.indexer_types


def test_layer_stepper_builds_a_layer_when_asked(tiny_llama: Path, model) -> None:
    stepper = LayerStepper(tiny_llama)
    assert stepper.num_decoder_layers == 2 and stepper.hf_config.num_hidden_layers == 2
    last = stepper.decoder_layer(-1)
    assert last is not stepper.decoder_layer(1)  # built anew each time, none kept
    theirs = model.model.layers[1]
    assert torch.equal(last.self_attn.o_proj.weight, theirs.self_attn.o_proj.weight)
    assert torch.equal(stepper.embed_tokens, model.model.embed_tokens.weight)
    linears = checkpoint_linears(last)
    names = [f"self_attn.{n}_proj" for n in "qkvo"] + [f"mlp.{n}_proj" for n in ("gate", "up", "down")]
    assert sorted(linears) == sorted(f"model.layers.1.{n}" for n in names)  # unfused: exact numerics
    x = torch.randn(3, theirs.self_attn.o_proj.in_features, generator=torch.Generator().manual_seed(0))
    x = x.to(torch.bfloat16)
    assert torch.equal(linears["model.layers.1.self_attn.o_proj"](x), theirs.self_attn.o_proj(x))
    with pytest.raises(IndexError):
        stepper.decoder_layer(2)


# Attribute names that reach inside an engine, and modules only the engine imports.
PRIVATE_ATTRIBUTES = {"_runner", "_block_manager", "_scheduler", "_sampler"}
PRIVATE_MODULES = {f"onboard.engine.{name}" for name in ("model_runner", "scheduler", "block_manager", "sequence")}


def _reaches_inside(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            named_runner = isinstance(node.value, ast.Name) and node.value.id in ("runner", "_runner")
            if node.attr in PRIVATE_ATTRIBUTES or (named_runner and node.attr in {"model", "config"}):
                found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.ImportFrom) and node.module in PRIVATE_MODULES:
            found.append((node.lineno, f"from {node.module} import ..."))
    return found


# Outside the engine, every name comes from `onboard.engine` itself: no submodule, no internal.
_PUBLIC = set(onboard.engine.__all__)


def _imports_internals(tree: ast.AST) -> list[tuple[int, str]]:
    """Imports of an engine submodule, or of a name `onboard.engine` does not export."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, f"import {a.name}") for a in node.names if a.name.startswith("onboard.engine.")]
        elif isinstance(node, ast.ImportFrom) and node.module == "onboard.engine":
            found += [
                (node.lineno, f"from onboard.engine import {a.name}") for a in node.names if a.name not in _PUBLIC
            ]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("onboard.engine."):
            found += [(node.lineno, f"from {node.module} import {a.name}") for a in node.names]
    return found


def test_engine_exports_are_spelled_for_type_checkers() -> None:
    """`__all__` is the lazy table's keys, and each name is also imported under `TYPE_CHECKING`."""
    assert sorted(onboard.engine.__all__) == sorted(onboard.engine._EXPORTS)
    tree = ast.parse(Path(onboard.engine.__file__).read_text())
    eager = {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"
        for child in ast.walk(node)
        if isinstance(child, ast.ImportFrom)
        for alias in child.names
    }
    assert eager == set(onboard.engine.__all__)
    for name in onboard.engine.__all__:
        assert getattr(onboard.engine, name) is not None


def test_the_scan_catches_submodule_imports() -> None:
    def scan(source: str) -> list[tuple[int, str]]:
        tree = ast.parse(source)
        return _reaches_inside(tree) + _imports_internals(tree)

    assert scan("from onboard.engine import LayerStepper, checkpoint_linears\nimport onboard.engine") == []
    assert scan("def f():\n    from onboard.engine.models import model_class") == [
        (2, "from onboard.engine.models import model_class")
    ]
    assert scan("from onboard.engine.step_bench import StepBench") != []  # public, but by its submodule
    assert scan("import onboard.engine.weights") != []
    assert scan("from onboard.engine import weights") != []
    assert scan("from onboard.engine.model_runner import ModelRunner") != []
    assert scan("engine._runner.model") != []


def test_no_module_outside_the_engine_reaches_inside_it() -> None:
    root = Path(onboard.__file__).parent.parent
    files = [*sorted((root / "onboard").rglob("*.py")), *sorted((root / "scripts").rglob("*.py"))]
    files += sorted((root / "examples").rglob("*.py"))
    offences = []
    for path in files:
        relative = path.relative_to(root).as_posix()
        if relative.startswith("onboard/engine/"):
            continue
        tree = ast.parse(path.read_text(), filename=relative)
        for line, code in _reaches_inside(tree) + _imports_internals(tree):
            offences.append(f"{relative}:{line}: {code}")
    assert len(files) > 100
    assert not offences, (
        "outside onboard/engine/, use only the engine's public names (`from onboard.engine import ...`, "
        "listed in onboard/engine/__init__.py), never its runner, scheduler, block manager or submodules; "
        "add a public name where one is missing:\n" + "\n".join(offences)
    )
