"""What the engine lacks for each recent family that transformers knows and the registry does not
serve, by `model_type` (from each family's transformers modeling code): `onboard run` names it in
its refusal before any stage runs. `docs/adding-an-architecture.md` says how to add a family.

An entry is removed when its family is added to `MODEL_REGISTRY` (a test keeps the two apart).
"""

LACKING: dict[str, str] = {
    "kimi_linear": "MLA whose shared RoPE key is cached but never rotated, a causal-mask MLA layer beside its KDA "
    "layers (layers/kda.py serves KDA) and Moonshot's block_sparse_moe.experts.*.w1/w2/w3 names",
    "deepseek_v4": "compressed sparse attention (CSA/HCA), attention sinks, trailing partial rotary, "
    "hyper-connections, sqrtsoftplus and hash routing, clamped SwiGLU experts and an FP8/FP4 source",
    "nemotron_h": "Mamba2 layers with a per-sequence recurrent state, NoPE attention and relu² experts",
    "olmo_hybrid": "Gated DeltaNet linear attention with a per-sequence recurrent state, post-norm NoPE "
    "attention and full-width q/k norms",
    "mistral4": "a softmax group-limited router without bias and position-dependent query scaling on MLA",
    "kimi_k25": "the VLM wrapper around DeepSeek-V3 and its INT4 source",
    "longcat_flash": "dual MLA sub-layers with a shortcut MoE per block, zero experts and MTP under model.mtp.*",
    "llama4": "chunked attention, NoPE layers with temperature tuning, L2 q/k norms and the VLM wrapper",
    "gemma3": "sandwich norms, zero-centred norms, embedding scaling and the VLM wrapper",
    # the text model alone (`Gemma3ForCausalLM`), as the 1B checkpoint stores it
    "gemma3_text": "sandwich norms, zero-centred norms, embedding scaling and a second RoPE base for local layers",
}
