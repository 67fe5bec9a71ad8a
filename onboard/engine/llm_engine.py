"""The engine: requests in, tokens out, one scheduled step at a time (nano-vllm's LLMEngine).

Its request records are in `request.py`, the speculative step in `spec_step.py`."""

from collections.abc import Sequence as Seq
from pathlib import Path
from typing import Any

import torch

from onboard.engine.block_manager import BlockManager
from onboard.engine.config import EngineConfig
from onboard.engine.grammar import GrammarFactory, GrammarSpec
from onboard.engine.logprobs import token_logprobs
from onboard.engine.model_runner import ModelRunner
from onboard.engine.request import Completion, EngineRequest, RequestOutput
from onboard.engine.sampler import Sampler, SamplingParams
from onboard.engine.scheduler import ScheduledSeq, Scheduler
from onboard.engine.sequence import Sequence, SequenceStatus
from onboard.engine.spec_decode import Speculator
from onboard.engine.spec_step import speculative_step
from onboard.engine.state_cache import StateSlots
from onboard.engine.stop import check_stop, stop_holdback
from onboard.models import inspect_checkpoint, load_tokenizer


class LLMEngine:
    def __init__(
        self,
        path: Path,
        config: EngineConfig | None = None,
        dtype: torch.dtype = torch.bfloat16,
    ):
        self.config = config or EngineConfig()
        self.path = Path(path)
        self.tokenizer = load_tokenizer(inspect_checkpoint(self.path))
        self._runner = ModelRunner(self.path, self.config, dtype=dtype)
        state = self._runner.state
        slots = None if state is None else StateSlots(state.num_slots)
        self._block_manager = BlockManager(self.config.num_blocks, self.config.block_size, state_slots=slots)
        self._scheduler = Scheduler(self.config, self._block_manager)
        self._sampler = Sampler()
        self.eos_ids = self._eos_ids()
        self.grammars = GrammarFactory(self.tokenizer, self._runner.vocab_size, stop_token_ids=sorted(self.eos_ids))
        self.requests: dict[int, EngineRequest] = {}
        self.speculator: Speculator | None = None

    def set_speculator(self, draft, num_speculative_tokens: int) -> None:
        """Decode with a draft from now on (`draft` None: without one), run in the model's dtype: an
        EAGLE-3 head or the checkpoint's own MTP layers (`onboard.speculator.mtp_draft`)."""
        if self.has_unfinished():
            raise RuntimeError("the speculator can only change while no request runs")
        if draft is not None:
            text = self._runner.hf_config.get_text_config()
            vocab, hidden = draft.t2d.shape[0], draft.layer_config.hidden_size
            if (vocab, hidden) != (self._runner.vocab_size, text.hidden_size):
                raise ValueError(
                    f"the speculator was trained for a model with vocabulary {vocab} and hidden size {hidden}; "
                    f"this one has {self._runner.vocab_size} and {text.hidden_size}"
                )
            if max(draft.aux_layer_ids) > text.num_hidden_layers:  # N: the final-normed state
                raise ValueError(
                    f"the speculator reads layers {draft.aux_layer_ids}; the model has {text.num_hidden_layers}"
                )
        self.speculator = Speculator(draft, num_speculative_tokens, self.dtype) if draft is not None else None

    # -- what stages may read -----------------------------------------------------------------

    @property
    def hf_config(self):
        """The served checkpoint's transformers config."""
        return self._runner.hf_config

    @property
    def dtype(self) -> torch.dtype:
        """What the served model computes in."""
        return self._runner.model.dtype

    @property
    def vocab_size(self) -> int:
        return self._runner.vocab_size

    @property
    def kv_layout(self):
        """What the model caches per token (`onboard.engine.kv_cache.KVLayout`)."""
        return self._runner.kv_layout

    def target_tensors(self) -> dict[str, torch.Tensor]:
        """float32 copies of the embedding, the output projection and the final norm (an EAGLE-3
        draft starts from them)."""
        model = self._runner.model
        return {
            "embed_tokens": model.embed_tokens.float(),
            "lm_head": model.lm_head.weight.float(),
            "norm": model.norm.weight.float(),
        }

    def weight_bytes_per_decode_step(self) -> int:
        """Bytes of weights one decode step reads: every parameter and every linear's weight (held
        pre-reordered outside the parameters on CPU), except that an untied embedding table only
        gives one row per token (a tied one is read whole, as the output projection)."""
        from onboard.engine.linear import EngineLinear

        model = self._runner.model
        packed = sum(
            m.out_features * m.in_features * model.dtype.itemsize
            for m in model.modules()
            if isinstance(m, EngineLinear) and m.plain is None
        )
        tied = bool(getattr(self.hf_config, "tie_word_embeddings", False))
        return packed + sum(
            p.numel() * p.element_size() for name, p in model.named_parameters() if tied or "embed" not in name
        )

    @property
    def kernel_report(self) -> list[dict[str, Any]]:
        """Fast numerics' linear kernels, as chosen per weight shape on this machine (`kernels.py`);
        empty in exact numerics."""
        return self._runner.kernel_report

    def stats(self) -> dict[str, Any]:
        """Scheduler and cache counters, as `/metrics` publishes them."""
        bm, scheduler = self._block_manager, self._scheduler
        return {
            "num_running": scheduler.num_running,
            "num_waiting": scheduler.num_waiting,
            "num_free_blocks": bm.num_free_blocks,
            "num_blocks": bm.num_blocks,
            "kv_cache_usage": bm.usage,
            "prefix_cache_hit_rate": bm.hit_rate,
            "prefix_cache_queries": bm.prefix_queries,
            "prefix_cache_hits": bm.prefix_hits,
            "num_preemptions": scheduler.num_preemptions,
            "kv_bytes_per_token": self.kv_layout.bytes_per_token(),
            "prefix_caching": scheduler.prefix_caching,
            **self._state_stats(),
        }

    def _state_stats(self) -> dict[str, Any]:
        """The per-sequence state pool's counters (linear attention), where the model has one."""
        slots = self._block_manager.state_slots
        if slots is None:
            return {}
        layout = self._runner.state_layout
        return {
            "state_bytes_per_sequence": layout.bytes_per_sequence(),
            "state_slots": slots.num_slots,
            "state_slots_used": slots.num_slots - slots.num_free,
        }

    def _eos_ids(self) -> set[int]:
        ids = {self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set()
        generation_eos = getattr(self._runner.hf_config, "eos_token_id", None)
        try:
            from transformers import GenerationConfig

            generation_eos = GenerationConfig.from_pretrained(self.path).eos_token_id
        except OSError:
            pass
        if isinstance(generation_eos, int):
            ids.add(generation_eos)
        elif generation_eos:
            ids.update(generation_eos)
        return ids

    # -- requests -----------------------------------------------------------------------------

    def add_request(
        self, prompt_token_ids: list[int], params: SamplingParams, grammar: GrammarSpec | None = None
    ) -> int:
        """Queue a request; raises ValueError on bad sampling values, grammars or lengths."""
        params.validate(self.config.max_logprobs, self._runner.vocab_size)
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        vocab = min(len(self.tokenizer), self._runner.vocab_size)
        if not all(0 <= t < vocab for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must lie in [0, {vocab})")
        if len(prompt_token_ids) + params.max_tokens > self.config.max_model_len:
            raise ValueError(
                f"prompt ({len(prompt_token_ids)} tokens) plus max_tokens ({params.max_tokens}) exceeds the "
                f"context length {self.config.max_model_len}"
            )
        matcher = self.grammars.matcher(grammar) if grammar is not None else None
        seq = Sequence(prompt_token_ids, self.config.block_size, sampling=params)
        generator = params.make_generator()
        request = EngineRequest(seq, params, generator, matcher)
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = [None]  # nothing scores the first prompt token
        self.requests[seq.seq_id] = request
        self._scheduler.add(seq)
        return seq.seq_id

    def abort(self, request_id: int) -> None:
        if self.requests.pop(request_id, None) is not None:
            self._scheduler.abort(request_id)
            if self.speculator is not None:
                self.speculator.drop(request_id)

    def has_unfinished(self) -> bool:
        return self._scheduler.has_unfinished()

    # -- one step -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        scheduled = self._scheduler.schedule()
        if not scheduled:
            return []
        if self.speculator is not None:
            return speculative_step(self, scheduled)
        result = self._runner.run(scheduled)
        self._score_prompts(scheduled, result.prompt_logits)
        logits = result.logits
        sampling = [item for item in scheduled if item.samples]
        sampled = self._sample(sampling, logits) if sampling else {}
        self._scheduler.postprocess(scheduled, {seq_id: token for seq_id, (token, _) in sampled.items()})
        return [self._advance(self.requests[seq_id], token, logprob) for seq_id, (token, logprob) in sampled.items()]

    def _score_prompts(self, scheduled: list[ScheduledSeq], prompt_logits: dict[int, torch.Tensor]) -> None:
        """Turn this step's prompt-scoring logits into per-position entries right away (no [T, V]
        outlives the step). Row j of a sequence scores the prompt token at position start + 1 + j;
        positions scored before (recomputed after a preemption) are skipped."""
        for item in scheduled:
            rows = prompt_logits.get(item.seq.seq_id)
            request = self.requests.get(item.seq.seq_id)
            if rows is None or request is None or request.prompt_logprobs is None:
                continue
            start = item.seq.num_computed_tokens
            skip = max(0, len(request.prompt_logprobs) - 1 - start)
            targets = item.seq.token_ids[start + 1 + skip : start + 1 + len(rows)]
            request.prompt_logprobs += token_logprobs(rows[skip:], targets, request.params.prompt_logprobs)

    def _sample(self, items: list[ScheduledSeq], logits: torch.Tensor) -> dict[int, tuple[int, dict | None]]:
        requests = [self.requests[item.seq.seq_id] for item in items]
        masks = [r.grammar.allowed_mask(logits.shape[-1]) if r.grammar else None for r in requests]
        histories = [(r.seq.token_ids[: r.seq.num_prompt_tokens], r.seq.completion_token_ids) for r in requests]
        result = self._sampler.sample(
            logits, [r.params for r in requests], histories, [r.generator for r in requests], masks
        )
        return {r.seq.seq_id: (result.token_ids[i], result.logprob_entry(i)) for i, r in enumerate(requests)}

    def _advance(self, request: EngineRequest, token: int, logprob: dict | None) -> RequestOutput:
        seq, params = request.seq, request.params
        if request.grammar is not None and not request.grammar.is_terminated():
            request.grammar.accept(token)
        if logprob is not None:
            request.logprobs.append(logprob)
        completion = seq.completion_token_ids
        is_eos = token in self.eos_ids and not params.ignore_eos
        visible = completion[:-1] if is_eos else completion
        request.text = self.tokenizer.decode(visible, skip_special_tokens=True)
        eos = set() if params.ignore_eos else self.eos_ids
        reason, cut = check_stop(request.text, request.emitted, params, token, eos, len(completion))
        if reason is None and request.grammar is not None and request.grammar.is_terminated():
            reason = "stop"
        text = request.text if cut is None else request.text[:cut]
        # Until the request ends, hold back what a stop string could still claim, and a trailing
        # replacement character the next token may complete into a UTF-8 character.
        ready = len(text) if reason else max(0, len(text.rstrip("\ufffd")) - stop_holdback(params))
        new_text = text[request.emitted : ready]
        request.emitted = max(request.emitted, ready)
        prompt_logprobs, request.prompt_logprobs = request.prompt_logprobs, None  # with the first output
        if reason is not None:
            self._scheduler.finish(seq, reason)
            self.requests.pop(seq.seq_id, None)
            if self.speculator is not None:
                self.speculator.drop(seq.seq_id)
        return RequestOutput(
            request_id=seq.seq_id,
            new_token_ids=[token],
            new_text=new_text,
            finished=reason is not None,
            finish_reason=reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_completion_tokens=len(completion),
            logprobs=[logprob] if logprob is not None else [],
            prompt_logprobs=prompt_logprobs,
        )

    # -- offline use --------------------------------------------------------------------------

    def generate(
        self, prompts: Seq[list[int]], params: SamplingParams | Seq[SamplingParams], grammar: GrammarSpec | None = None
    ) -> list[Completion]:
        """Run prompts to completion (continuous batching inside); results in prompt order."""
        each = list(params) if isinstance(params, Seq) else [params] * len(prompts)
        ids = [self.add_request(list(p), q, grammar) for p, q in zip(prompts, each, strict=True)]
        tokens: dict[int, list[int]] = {i: [] for i in ids}
        texts: dict[int, str] = dict.fromkeys(ids, "")
        logprobs: dict[int, list[dict]] = {i: [] for i in ids}
        prompt_logprobs: dict[int, list[dict | None] | None] = dict.fromkeys(ids)
        reasons: dict[int, str | None] = dict.fromkeys(ids)
        while self.has_unfinished():
            for out in self.step():
                tokens[out.request_id] += out.new_token_ids
                texts[out.request_id] += out.new_text
                logprobs[out.request_id] += out.logprobs
                if out.prompt_logprobs is not None:
                    prompt_logprobs[out.request_id] = out.prompt_logprobs
                if out.finished:
                    reasons[out.request_id] = out.finish_reason
        return [Completion(tokens[i], texts[i], reasons[i], logprobs[i], prompt_logprobs[i]) for i in ids]

    @torch.inference_mode()
    def score(self, token_ids: list[int], trace: dict | None = None) -> torch.Tensor:
        """float32 logits [T, vocab] at every position of one sequence (teacher forcing); `trace`
        (a dict) receives what layers record for parity checks (DSA: the selected keys)."""
        return self._runner.model.compute_logits(self.hidden_states(token_ids, trace=trace)[0])

    @torch.inference_mode()
    def hidden_states(
        self, token_ids: list[int], aux_layers: Seq[int] = (), trace: dict | None = None
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One sequence teacher-forced: the final normed hidden states [T, H] and the inputs of
        decoder layers `aux_layers` (each [T, H]; a hyper-connection family's streams [T, hc, H], as
        transformers' `hidden_states`), as the engine computes them when serving."""
        return self.batched_hidden_states([token_ids], aux_layers, trace)[0]

    @torch.inference_mode()
    def batched_hidden_states(
        self, token_lists: Seq[list[int]], aux_layers: Seq[int] = (), trace: dict | None = None
    ) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
        """`hidden_states` of several sequences in one prefill over the paged cache (allocated
        without prefix reuse, released after it), per sequence in order.  Fast numerics run their
        rows together, so a sequence's states may differ from its lone forward's in GEMM rounding."""
        seqs = [Sequence(list(ids), self.config.block_size) for ids in token_lists]
        allocated = []
        try:
            for seq in seqs:
                if not self._block_manager.can_allocate(seq, reuse_prefix=False):
                    raise ValueError("not enough free KV-cache blocks for these sequences")
                self._block_manager.allocate(seq, reuse_prefix=False)
                allocated.append(seq)
            final, aux = self._runner.forward_hidden([ScheduledSeq(s, len(s)) for s in seqs], tuple(aux_layers), trace)
        finally:
            for seq in allocated:
                self._block_manager.deallocate(seq)
                seq.status = SequenceStatus.FINISHED
        lengths = [len(s) for s in seqs]
        per_layer = [states.split(lengths) for states in aux]
        return [(part, [states[i] for states in per_layer]) for i, part in enumerate(final.split(lengths))]

    def decoder_layer(self, index: int) -> torch.nn.Module:
        """The served model's decoder layer `index` (negative: from the end), its weights as served
        (fused where fast numerics fuse them, dequantized); for reading, not for running alone."""
        return self._runner.model.layers[index]
