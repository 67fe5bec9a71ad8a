"""`onboard bench PATH --endpoint URL [--endpoint URL2 ...]`: servers under load, side by side.

A concurrency sweep over one or more OpenAI-compatible servers (`onboard.endpoint.load`): the
same chat prompts, rendered by PATH's tokenizer and sent as token ids, to every server; one table
row per endpoint and concurrency, and the figures as JSON with --out.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from onboard.console import console
from onboard.endpoint import Endpoint, EndpointSpec
from onboard.endpoint.load import requests_per_level, sweep
from onboard.errors import OnboardError

CONCURRENCY = "1,4,16"
MAX_TOKENS = 64
MAX_PROMPT_TOKENS = 256  # longer prompts are skipped, as `onboard bench` does in-process


def endpoint_specs(urls: Sequence[str], served_models: Sequence[str] | None, api_key: str | None) -> list[EndpointSpec]:
    """`--endpoint` URLs paired with `--served-model` names by order (one name: for all)."""
    names = list(served_models or [])
    if len(names) > 1 and len(names) != len(urls):
        raise OnboardError(
            f"{len(urls)} --endpoint and {len(names)} --served-model: give one --served-model for all, "
            "or one per --endpoint in the same order"
        )
    if len(names) <= 1:
        names = [names[0] if names else None] * len(urls)
    return [EndpointSpec(url, name, api_key) for url, name in zip(urls, names, strict=True)]


def load_prompts(tokenizer: Any, data: Path | None, count: int) -> list[list[int]]:
    """Up to `count` chat prompts as token ids: DATA's, or the built-in eval split's."""
    from onboard.data import builtin_records, chat_prompts, load_records

    records = load_records(data) if data else builtin_records("eval", stdlib_files=0)
    prompts = chat_prompts(records, tokenizer, max_tokens=MAX_PROMPT_TOKENS, fit="skip", limit=count)
    return [p.token_ids for p in prompts]


def run_serve_bench(
    model_dir: Path,
    specs: Sequence[EndpointSpec],
    data: Path | None,
    concurrencies: Sequence[int],
    max_tokens: int = MAX_TOKENS,
    num_requests: int | None = None,
) -> dict[str, Any]:
    from onboard.models import inspect_checkpoint, load_tokenizer

    tokenizer = load_tokenizer(inspect_checkpoint(model_dir))
    needed = 1 + sum(requests_per_level(c, num_requests) for c in concurrencies)
    prompts = load_prompts(tokenizer, data, needed)
    # No retries: a retried request would report the latency of its last attempt as the request's.
    endpoints = [Endpoint(spec, retries=0) for spec in specs]
    console.print(
        f"bench: {len(endpoints)} endpoint(s) at concurrency {', '.join(map(str, concurrencies))}, "
        f"{len(prompts)} distinct prompts, {max_tokens} tokens each ..."
    )
    try:
        measured = sweep(endpoints, prompts, concurrencies, max_tokens, num_requests)
    finally:
        for endpoint in endpoints:
            endpoint.close()
    for level in measured["levels"]:
        if level["num_failed"]:
            console.print(
                f"[yellow]warning[/]: {level['num_failed']} request(s) to {level['endpoint']} failed at "
                f"concurrency {level['concurrency']}: {level['first_error']}"
            )
    return {
        "api": "/v1/completions, streamed, chat-templated token-id prompts",
        "tokenizer": str(model_dir),
        "data": str(data) if data else "builtin:eval",
        "num_distinct_prompts": len(prompts),
        "mean_prompt_tokens": sum(map(len, prompts)) / len(prompts),
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "concurrency": list(concurrencies),
        "endpoints": [
            {"url": s.base, "served_model": e.model, "slug": s.slug} for s, e in zip(specs, endpoints, strict=True)
        ],
        **measured,
    }


def _ms(value: float) -> str:
    return f"{value:.2f}" if value < 10 else f"{value:.1f}" if value < 100 else f"{value:.0f}"


def _cell(dist: dict[str, float | None]) -> str:
    values = [dist.get(k) for k in ("p50", "p90", "p99")]
    return "-" if any(v is None for v in values) else "/".join(_ms(v) for v in values)  # type: ignore[arg-type]


def _label(level: dict[str, Any], models_differ: bool) -> str:
    where = level["endpoint"].split("://", 1)[-1]
    return f"{where} {level['served_model']}" if models_differ else where


def serve_bench_table(result: dict[str, Any]) -> Table:
    models = {level["served_model"] for level in result["levels"]}
    table = Table(
        title=f"servers under load ({', '.join(sorted(models))}): {result['max_tokens']} tokens per request "
        f"(ignore_eos), {result['num_distinct_prompts']} prompts of {result['mean_prompt_tokens']:.0f} tokens "
        "on average; latencies in ms, p50/p90/p99",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
    )
    for name, justify in (
        ("endpoint", "left"),
        ("conc.", "right"),
        ("requests", "right"),
        ("out tok/s", "right"),
        ("req/s", "right"),
        ("TTFT", "right"),
        ("ITL", "right"),
        ("TPOT", "right"),
        ("e2e", "right"),
    ):
        table.add_column(name, justify=justify, overflow="fold")  # type: ignore[arg-type]
    for level in result["levels"]:
        failed = f" ({level['num_failed']} failed)" if level["num_failed"] else ""
        table.add_row(
            _label(level, len(models) > 1),
            str(level["concurrency"]),
            f"{level['num_requests']}{failed}",
            f"{level['output_tokens_per_s']:.1f}",
            f"{level['requests_per_s']:.2f}",
            _cell(level["ttft_ms"]),
            _cell(level["itl_ms"]),
            _cell(level["tpot_ms"]),
            _cell(level["e2e_ms"]),
        )
    if any(level["tokens_from"] == "chunks" for level in result["levels"]):
        table.caption = "output tokens counted as chunks where the server sent no usage"
    return table


def print_table(result: dict[str, Any]) -> None:
    """The table on the console; written out 160 columns wide when the console is no terminal (a
    log, a pipe), where rich would otherwise fold it into 80."""
    table = serve_bench_table(result)
    if console.is_terminal:
        console.print(table)
    else:
        Console(stderr=True, width=160).print(table)
