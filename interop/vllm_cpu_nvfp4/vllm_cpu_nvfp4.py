"""Register vLLM's own `EmulationNvFp4LinearKernel` for the CPU platform.

Why: vLLM 0.32's `init_nvfp4_linear_kernel` picks NVFP4 linear kernels from
`_POSSIBLE_NVFP4_KERNELS[platform]`, which lists CUDA and ROCm only, so on the CPU build every
compressed-tensors NVFP4 W4A4 (or mixed NVFP4/FP8) checkpoint fails to load with "Failed to find
a kernel that can implement the NVFP4 linear layer". The emulation kernel (dequantize the FP4
weight, fake-quantize the activation, matmul) is pure torch and runs on CPU unchanged.

Scope: this adds one entry to the CPU list and nothing else. It returns at once on any other
platform, so on GPUs (CUDA/ROCm/XPU) kernel choice is exactly vLLM's. Weight-only NVFP4 (W4A16)
still goes to Marlin (vLLM forces it before consulting the list) and stays unsupported on CPU.
vLLM loads general plugins in every process (API server, engine core, workers), possibly more
than once: `register` is idempotent.
"""


def register() -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.model_executor.kernels import linear
    from vllm.platforms.interface import PlatformEnum

    kernel = linear.EmulationNvFp4LinearKernel
    if kernel not in linear._POSSIBLE_NVFP4_KERNELS.get(PlatformEnum.CPU, []):
        linear.register_linear_kernel(kernel, PlatformEnum.CPU, kernel_type="nvfp4")
