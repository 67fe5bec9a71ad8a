"""The parts of scripts/gpu_check.py (the entry point, its flags and `main`):

* settings: shapes, phases and their budgets, the settings;
* context: the report, the phase runner, the models on the device (`CheckContext`);
* model: the random-weight model of a real shape and the `build` phase;
* parity: exact parity of the engine against transformers (`parity_bf16`, `parity_fp32`);
* quantize: onboard's quantize stage on the random model, the artifacts' loads, `distill`;
* artifact_parity: `parity_fp8` and `parity_nvfp4`;
* spec: the random EAGLE-3 draft, `spec_exact` and `spec_fast`;
* throughput: `throughput`;
* check: `GpuCheck`, every phase family, the run and its verdict;
* report: the console tables.
"""
