"""Speed and memory, always as ratios against a peer measured in the same run: the engine against
`transformers.generate` and llama.cpp (`engine`, `peers`), a served endpoint under load (`serve`),
and the KV cache's bytes and decode speed per family (`kv`, `kv_decode`)."""
