"""onboard's reference engine in 30 lines: `python examples/engine.py CHECKPOINT_DIR`.

Everything here is `onboard.engine`'s public surface; nothing reaches into its submodules.
"""

import sys

from onboard.engine import EngineConfig, GrammarSpec, LLMEngine, SamplingParams

engine = LLMEngine(sys.argv[1], EngineConfig(numerics="fast", num_blocks=512))
tokenizer = engine.tokenizer
prompts = [tokenizer.encode(text) for text in ("The capital of France is", "def fibonacci(n):")]

# Continuous batching inside: prompts in, completions out, in prompt order.
greedy = SamplingParams(temperature=0.0, max_tokens=16)
for completion in engine.generate(prompts, greedy):
    print(repr(completion.text), completion.finish_reason)

# Seeded sampling with the sampled tokens' log-probabilities, and output held to a JSON schema.
sampled = SamplingParams(temperature=0.8, top_p=0.95, seed=0, max_tokens=16, logprobs=0)
print([(entry["token"], round(entry["logprob"], 3)) for entry in engine.generate(prompts[:1], sampled)[0].logprobs])
schema = GrammarSpec("json_schema", '{"type": "object", "properties": {"ok": {"type": "boolean"}}}')
print(engine.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=24), schema)[0].text)

# Teacher forcing: float32 logits at every position, as eval and the speculator read them.
logits = engine.score(prompts[0])
print(tuple(logits.shape), tokenizer.decode(logits[-1].argmax().item()))
print({key: engine.stats()[key] for key in ("num_blocks", "num_free_blocks", "kv_bytes_per_token")})
