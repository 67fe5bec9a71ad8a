"""Options and checks the `onboard` commands share: how the command line reads a flag, nothing more."""

from pathlib import Path
from typing import Annotated

import typer

SchemeOpt = Annotated[
    str | None, typer.Option(help="nvfp4 | nvfp4a16 | fp8 | auto (per-group formats under --bits-budget)")
]
BudgetOpt = Annotated[float | None, typer.Option(help="auto: effective bits per quantizable weight, at most")]
BaseOpt = Annotated[str | None, typer.Option(help="auto: nvfp4 (upgrades to FP8, BF16) | nvfp4a16 (FP8 W8A16, BF16)")]
MethodOpt = Annotated[
    str | None,
    typer.Option(
        help="how weights are rounded, parts joined by +: rtn, gptq, autoround; observers mse, expanded_mse, "
        "imatrix, expanded_imatrix; spinquant (R1/R2 fused); smoothquant, awq; options as field=value "
        "(gptq_dampening=0.1). auto: measured on calibration text"
    ),
]
DistillOpt = Annotated[
    int | None,
    typer.Option(help="train the NVFP4 block scales on KL to the unquantized model over N calibration tokens"),
]
StepsOpt = Annotated[int | None, typer.Option(help="auto: candidate selections measured after the additive one")]
SearchTokOpt = Annotated[int | None, typer.Option(help="auto: calibration tokens each candidate is scored on")]
RecipeOpt = Annotated[Path | None, typer.Option(help="recipes/NAME.yaml (default: matched by architecture)")]
PickleOpt = Annotated[bool, typer.Option("--allow-pickle", help="load pickle (.bin) weights: can run code")]
RemoteOpt = Annotated[bool, typer.Option("--trust-remote-code", help="run the checkpoint's own Python code")]
CalibOpt = Annotated[Path | None, typer.Option(help="calibration DATA (default: the project's prompts)")]
SamplesOpt = Annotated[int | None, typer.Option(help="calibration samples (default: the recipe's)")]
SeqLenOpt = Annotated[int | None, typer.Option(help="calibration sequence length (default: the recipe's)")]
DataOpt = Annotated[Path | None, typer.Option(help="held-out DATA (default: the project's eval split)")]
JunitOpt = Annotated[Path | None, typer.Option(help="also write the gate's checks as JUnit XML here")]
DeviceOpt = Annotated[str, typer.Option(help="torch device the engine runs on (cpu, cuda, cuda:1, ...)")]
NumericsOpt = Annotated[
    str, typer.Option(help="fast (serving kernels, judged by the near-tie rule) | exact (bitwise transformers)")
]
DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
DtypeOpt = Annotated[str, typer.Option(help="bf16 | fp32: the dtype both sides compute in (fp32: plain checkpoints)")]
MaxTokOpt = Annotated[int | None, typer.Option(help="held-out tokens to score (default: the recipe's)")]
EndpointOpt = Annotated[
    str | None, typer.Option(help="check this OpenAI-compatible server (vLLM, SGLang, onboard serve) instead")
]
ServedModelOpt = Annotated[str | None, typer.Option(help="with --endpoint: the model id (default: the only one)")]
MaxMemoryOpt = Annotated[
    str | None,
    typer.Option(
        help="memory budget, e.g. 6GB or 6GiB (default: 80 % of the machine's); a stage over it streams one "
        "decoder layer at a time, or refuses in one line"
    ),
]
ApiKeyOpt = Annotated[str | None, typer.Option(help="with --endpoint: sent as `Authorization: Bearer KEY`")]


def memory_budget(max_memory: str | None) -> int:
    """`--max-memory` in bytes (the default budget when not given), or a one-line refusal."""
    from onboard.budget import resolve_budget

    return resolve_budget(max_memory)


def torch_dtype(name: str):
    """`--dtype` as a torch dtype, or a one-line refusal."""
    import torch

    from onboard.errors import OnboardError

    if name not in DTYPES:
        raise OnboardError(f"--dtype must be one of {', '.join(DTYPES)}, not {name!r}")
    return getattr(torch, DTYPES[name])


def check_numerics(numerics: str) -> str:
    """`--numerics` as the engine knows it, or a one-line refusal."""
    from onboard.engine import NUMERICS
    from onboard.errors import OnboardError

    if numerics not in NUMERICS:
        raise OnboardError(f"--numerics must be one of {', '.join(NUMERICS)}, not {numerics!r}")
    return numerics


def check_device(device: str) -> str:
    """`--device` parsed by torch and present on this machine, or a one-line refusal."""
    import torch

    from onboard.errors import OnboardError

    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError) as err:
        raise OnboardError(f"--device {device!r}: {str(err).splitlines()[0]}") from None
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise OnboardError(f"--device {device}: no CUDA device on this machine")
    if parsed.type not in ("cpu", "cuda"):
        raise OnboardError(f"--device {device}: the engine runs on cpu or cuda")
    return device


def endpoint_spec(url: str | None, served_model: str | None, api_key: str | None):
    """`--endpoint` and its companions as an EndpointSpec (None without --endpoint)."""
    from onboard.errors import OnboardError

    if url is None:
        if served_model or api_key:
            raise OnboardError("--served-model and --api-key need --endpoint")
        return None
    from onboard.endpoint import EndpointSpec

    return EndpointSpec(url, served_model, api_key)
