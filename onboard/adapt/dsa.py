"""DSA parity: the engine's selected keys against transformers' indexer, at every position."""

import torch


def reference_selections(model, token_ids: list[int]) -> dict[int, torch.Tensor]:
    """Per layer that runs an indexer, transformers' selection as a `[T, T]` bool matrix (causal part).
    An index of -1 selects nothing (GLM-5.3-Flash's pooled indexer pads its rows with it)."""
    from onboard.evaluate.replay import decoder_layers

    picked: dict[int, torch.Tensor] = {}
    hooks = []
    for i, layer in enumerate(decoder_layers(model)):  # a VLM's text model's too
        indexer = getattr(layer.self_attn, "indexer", None)
        if indexer is None:
            continue

        def hook(_module, _args, output, i=i):
            t = output.shape[1]
            index = output[0].long()
            index = torch.where(index >= 0, index, t)  # into a spare column, dropped
            chosen = torch.zeros(t, t + 1, dtype=torch.bool, device=output.device).scatter_(-1, index, True)[:, :t]
            picked[i] = (chosen & torch.ones_like(chosen).tril()).cpu()

        hooks.append(indexer.register_forward_hook(hook))
    try:
        with torch.inference_mode():
            model(torch.tensor([token_ids], device=model.device))
    finally:
        for handle in hooks:
            handle.remove()
    return picked


def compare_selections(model, token_ids: list[int], trace: dict) -> dict[str, int]:
    """`trace`: what the engine's indexers recorded scoring `token_ids` in one prefill.  A query
    position counts as equal when every indexer layer selected the same keys for it."""
    want = reference_selections(model, token_ids)
    t = len(token_ids)
    equal = torch.ones(t, dtype=torch.bool)
    for layer, reference in want.items():
        (selection,) = trace[layer]
        (mine,) = selection.prefill
        mine = torch.ones(t, t, dtype=torch.bool).tril() if mine is None else mine.cpu()
        equal &= (mine == reference).all(-1)
    return {"positions": t, "equal": int(equal.sum())}
