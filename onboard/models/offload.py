"""compressed-tensors' offloading, removed where onboard wants plain tensors."""

import torch


def drop_offload(module: torch.nn.Module) -> None:
    """Plain tensors in place of the offloading compressed-tensors 0.19 leaves after decompressing.

    `decompress_model` goes through `from_accelerate`, which offloads every module to where it lies
    (the CPU): its tensors then sit in a cache that copies them back on every access, and its
    forward moves its inputs there, so a later `.to("cuda")` would leave the model computing on
    the CPU.  Removing the offload changes no bit where it lies."""
    from compressed_tensors.offload import remove_dispatch

    remove_dispatch(module)
