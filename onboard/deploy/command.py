"""The engine's command line, as argv, as one shell line and as a script."""

import json
import shlex
from dataclasses import dataclass
from pathlib import Path

from onboard.deploy.artifact import Speculator
from onboard.errors import OnboardError

ENGINES = ("onboard", "vllm", "sglang")
API_KEY_ENV = "ONBOARD_API_KEY"


def check_engine_name(engine: str) -> str:
    if engine not in ENGINES:
        raise OnboardError(f"--engine must be one of {', '.join(ENGINES)}, not {engine!r}")
    return engine


@dataclass(frozen=True)
class Deployment:
    """Everything the command line is made of."""

    engine: str
    model_dir: Path
    python: str
    host: str
    port: int
    served_model_name: str
    api_key: str | None = None
    tensor_parallel: int | None = None
    max_model_len: int | None = None
    speculator: Speculator | None = None
    max_logprobs: int | None = None  # vLLM's --max-logprobs (-1: no limit)
    quantization: str | None = None  # as read from config.json, for the script's header


def command(dep: Deployment) -> list[str]:
    """The engine's argv (the API key in it as given)."""
    model = str(dep.model_dir.resolve())
    if dep.engine == "vllm":
        argv = [dep.python, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
        tp, context = "--tensor-parallel-size", "--max-model-len"
    elif dep.engine == "sglang":
        argv = [dep.python, "-m", "sglang.launch_server", "--model-path", model]
        tp, context = "--tp-size", "--context-length"
    else:
        raise OnboardError(f"no production command for engine {dep.engine!r}")
    argv += ["--host", dep.host, "--port", str(dep.port), "--served-model-name", dep.served_model_name]
    if dep.tensor_parallel is not None:
        argv += [tp, str(dep.tensor_parallel)]
    if dep.max_model_len is not None:
        argv += [context, str(dep.max_model_len)]
    if dep.max_logprobs is not None and dep.engine == "vllm":
        argv += ["--max-logprobs", str(dep.max_logprobs)]
    if dep.api_key is not None:
        argv += ["--api-key", dep.api_key]
    spec = dep.speculator
    if spec is not None and dep.engine == "vllm":
        config = {"method": spec.method, **({"model": str(spec.path)} if spec.path else {})}
        argv += ["--speculative-config", json.dumps({**config, "num_speculative_tokens": spec.num_tokens})]
    elif spec is not None:
        # SGLang runs a checkpoint's MTP (NextN) layers as its EAGLE algorithm, drafting from the model itself.
        if spec.path is None:
            argv += ["--speculative-algorithm", "EAGLE"]
        else:
            argv += ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(spec.path)]
        argv += [
            "--speculative-num-steps",
            str(spec.num_tokens),
            "--speculative-eagle-topk",
            "1",
            "--speculative-num-draft-tokens",
            str(spec.num_tokens + 1),
        ]
    return argv


def shell_line(argv: list[str]) -> str:
    """`shlex.join(argv)`, with the value of --api-key read from $ONBOARD_API_KEY instead."""
    words = []
    for i, arg in enumerate(argv):
        if i > 0 and argv[i - 1] == "--api-key":
            words.append(f'"${API_KEY_ENV}"')
        else:
            words.append(shlex.quote(arg))
    return " ".join(words)


def script_text(dep: Deployment, argv: list[str]) -> str:
    lines = ["#!/bin/sh", f"# written by `onboard serve --engine {dep.engine}`: {dep.model_dir.resolve()}"]
    lines.append(f"# quantization: {dep.quantization or 'none (unquantized checkpoint)'}")
    if dep.speculator is not None:
        kind = "the checkpoint's MTP layers" if dep.speculator.method == "mtp" else "EAGLE-3"
        lines.append(f"# speculator: {kind}, {dep.speculator.num_tokens} tokens per step")
    if dep.api_key is not None:
        lines.append(f': "${{{API_KEY_ENV}:?set {API_KEY_ENV} to the API key}}"')
    lines.append(f"exec {shell_line(argv)}")
    return "\n".join(lines) + "\n"
