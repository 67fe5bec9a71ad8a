"""Engine settings: where it runs, the paged KV cache, and one scheduling step."""

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineConfig:
    device: str = "cpu"  # torch device the weights, the cache and every step live on
    attention_backend: str | None = None  # None: the device's default (onboard/engine/attention/)
    # "exact": every kernel rounds as transformers does (what `adapt` proves); "fast": kernels that
    # compute the same function with other roundings (MLA decode in the weight-absorbed form).
    numerics: str = "exact"
    # fast numerics only. False lets fast use kernels whose roundings depend on what else is batched
    # (a lone decode row through PyTorch's one-row GEMV, a step's decode rows in one padded attention
    # call): a request's tokens may then change with the load, as in vLLM's default mode.
    batch_invariant: bool = True
    block_size: int = 16  # tokens per KV-cache block
    num_blocks: int = 2048  # KV-cache blocks (all layers share one block table per sequence)
    max_num_seqs: int = 64  # sequences running at once
    max_num_batched_tokens: int = 2048  # token budget of one step (chunked prefill)
    max_model_len: int = 4096  # prompt + completion
    check_invariants_when_idle: bool = True
    # Reusing cached prefix blocks changes how many rows a prefill runs, and CPU GEMM kernels
    # may then sum in another order: exact-parity checks switch it off.
    enable_prefix_caching: bool = True
    # Most top logprobs a request may ask for, per generated or prompt token (vLLM's --max-logprobs);
    # -1: no limit (the whole vocabulary).
    max_logprobs: int = 20

    def __post_init__(self) -> None:
        if self.numerics not in NUMERICS:
            raise ValueError(f"numerics must be one of {', '.join(NUMERICS)}, not {self.numerics!r}")
        if self.numerics == "exact" and not self.batch_invariant:
            raise ValueError("exact numerics is always batch invariant; batch_invariant=False needs fast numerics")
        if isinstance(self.max_logprobs, bool) or not isinstance(self.max_logprobs, int) or self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be an integer >= 0, or -1 for no limit, not {self.max_logprobs!r}")


NUMERICS = ("exact", "fast")
