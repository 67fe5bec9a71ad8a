"""Exact numerics stay bitwise transformers' whatever kernels the machine picks.

A parity proof that holds only where two kernels happen to round alike proves nothing on the
user's machine.  Each setting runs in its own process (oneDNN reads its ISA cap once):

* `ONEDNN_MAX_CPU_ISA=AVX512_CORE`: no bf16 instructions, so oneDNN's bf16 products take other
  kernels, some of which sum a row in another order by row count, as its AMX kernels do (the
  code before exact called transformers' own ops failed here on tiny DeepSeek-V3, as on AMX);
* `ONEDNN_MAX_CPU_ISA=AVX2`: no AVX-512 at all;
* oneDNN off for the whole process: PyTorch's own kernels on both sides.

A cap above what the CPU has is no cap, so on a smaller CPU a setting repeats the default.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.isa  # processes of their own under other kernels: `make test-isa` runs them

# `make test-isa` runs every parity test again under a cap below the CPU's (`cpu_bf16.cap_below_native`).
SETTINGS = {
    "avx2": ({"ONEDNN_MAX_CPU_ISA": "AVX2"}, "on"),
    "onednn_off": ({}, "off"),
}

SCRIPT = """
import json, sys, torch
if sys.argv[1] == "off":
    torch.backends.mkldnn.enabled = False
from onboard.adapt.measure import measure_parity
from onboard.models import inspect_checkpoint
for path in sys.argv[2:]:
    r = measure_parity(inspect_checkpoint(path), torch.bfloat16, num_prompts=2)
    fast = r["fast"]
    print(json.dumps({
        "path": path, "rule": r["rule"], "max_abs_logit_diff": r["max_abs_logit_diff"],
        "greedy_match_rate": r["greedy_match_rate"], "decode_top1": fast["exact_top1_agreement"],
        "decode_logprob_diff": fast["exact_max_abs_logprob_diff"], "fast_near_ties": fast["logprobs_close"],
    }))
"""


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_exact_parity_is_bitwise_under_every_kernel_setting(
    setting: str, tiny_llama: Path, tiny_deepseek_v3: Path, onboard_cache: Path
) -> None:
    env_extra, onednn = SETTINGS[setting]
    env = {**os.environ, **env_extra, "ONBOARD_CACHE": str(onboard_cache)}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, onednn, str(tiny_llama), str(tiny_deepseek_v3)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(results) == 2
    for result in results:
        assert result["rule"] == "bitwise", result
        assert result["max_abs_logit_diff"] == 0.0 and result["greedy_match_rate"] == 1.0, result
        assert result["decode_top1"] == 1.0 and result["decode_logprob_diff"] == 0.0, result
        assert result["fast_near_ties"], result
