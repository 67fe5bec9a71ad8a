"""One engine step with speculative decoding (spec_decode.py): decoding sequences the draft is
ready for propose tokens, the target verifies them in the same forward as every other sequence,
and the accepted tokens are committed (`LLMEngine.step` calls it when a speculator is set)."""

import torch

from onboard.engine.request import RequestOutput
from onboard.engine.scheduler import ScheduledSeq


@torch.inference_mode()
def speculative_step(engine, scheduled: list[ScheduledSeq]) -> list[RequestOutput]:
    """One step where decoding sequences the draft is ready for verify its proposals too."""
    spec = engine.speculator
    proposals = {}
    for item in scheduled:
        seq = item.seq
        if item.num_new_tokens != 1 or not item.samples or not spec.ready(seq):
            continue
        request = engine.requests[seq.seq_id]
        room = min(
            spec.k,
            request.params.max_tokens - len(seq.completion_token_ids),  # a bonus past it is dropped
            engine.config.max_model_len - len(seq),
        )
        if room <= 0:
            continue
        proposal = spec.propose(seq, room, request.params, request.generator, request.grammar)
        if engine._scheduler.reserve_lookahead(item, proposal.tokens):
            proposals[seq.seq_id] = proposal

    starts = [item.seq.num_computed_tokens for item in scheduled]
    result = engine._runner.run(scheduled, aux_layers=spec.aux_layers)
    engine._score_prompts(scheduled, result.prompt_logits)
    logits, aux = result.logits, result.aux
    # Logits rows, in order: every new token of a verifying sequence, the last of a plain one.
    plain, plain_rows, spec_rows = [], [], {}
    row = 0
    for item in scheduled:
        if item.num_proposals:
            spec_rows[item.seq.seq_id] = slice(row, row + item.num_new_tokens)
            row += item.num_new_tokens
        elif item.samples:
            plain.append(item)
            plain_rows.append(row)
            row += 1
    offsets = [0]
    for item in scheduled:
        offsets.append(offsets[-1] + item.num_new_tokens)
    sampled = engine._sample(plain, logits[torch.tensor(plain_rows, dtype=torch.long)]) if plain else {}
    engine._scheduler.postprocess(
        [item for item in scheduled if item.seq.seq_id not in proposals],
        {seq_id: token for seq_id, (token, _) in sampled.items()},
    )
    outputs = [engine._advance(engine.requests[seq_id], token, lp) for seq_id, (token, lp) in sampled.items()]
    for item in scheduled:
        seq = item.seq
        if seq.seq_id in proposals and not seq.is_finished:
            outputs.append(_commit(engine, item, logits[spec_rows[seq.seq_id]], proposals[seq.seq_id]))

    engine._runner.state_checkpoints.clear()  # a sequence that ended before its verdict left its own
    for item, start, first_row in zip(scheduled, starts, offsets, strict=False):
        seq = item.seq
        if seq.is_finished:
            continue
        count = seq.num_computed_tokens - start  # the positions this step verified or computed
        spec.feed(seq, start, aux[first_row : first_row + count])
    return outputs


def _commit(engine, item: ScheduledSeq, raw: torch.Tensor, proposal) -> RequestOutput:
    """Verify one sequence's proposals, keep the accepted KV, emit the tokens (one output)."""
    seq = item.seq
    request = engine.requests[seq.seq_id]
    base = seq.num_computed_tokens  # position of the last emitted token, computed this step
    del seq.token_ids[base + 1 :]
    history = (seq.token_ids[: seq.num_prompt_tokens], seq.completion_token_ids)
    verdict = engine.speculator.verify(raw, proposal, request.params, history, request.generator)
    seq.num_computed_tokens = base + 1 + verdict.accepted
    if seq.state_slot is not None:  # linear attention: the state after the last accepted token
        engine._runner.keep_state(seq, 1 + verdict.accepted)
    n = len(verdict.tokens)
    entries = [None] * n
    if request.params.logprobs is not None:
        chosen = engine._sampler.logprobs(raw[:n], [request.params] * n, verdict.tokens)
        entries = [chosen.logprob_entry(i) for i in range(n)]
    merged = None
    for token, entry in zip(verdict.tokens, entries, strict=True):
        seq.append_token(token)
        out = engine._advance(request, token, entry)
        if merged is None:
            merged = out
        else:
            merged.new_token_ids += out.new_token_ids
            merged.new_text += out.new_text
            merged.logprobs += out.logprobs
            merged.finished, merged.finish_reason = out.finished, out.finish_reason
            merged.num_completion_tokens = out.num_completion_tokens
        if out.finished:
            break
    if not seq.is_finished:
        engine._scheduler.release_rejected(seq)
    return merged
