"""`onboard speculator RUN_DIR --endpoint URL`: the acceptance of the speculator a server runs,
on the held-out prompts the in-process measurement uses, read from the server's counters.

Nothing is trained: the server decodes with whatever draft it was started with (this run's
`artifact/speculator`, or another). Results go to `RUN_DIR/endpoints/NAME/speculator/metrics.json`;
every run measures again, since the deployment may have changed.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

from rich.table import Table

from onboard import atomic
from onboard.console import console
from onboard.endpoint import Endpoint, EndpointSpec
from onboard.endpoint.acceptance import measure_endpoint_acceptance
from onboard.hashing import fingerprint
from onboard.recipes import SpeculatorSettings
from onboard.workspace import SPECULATOR_METRICS, RunDir, Stage, at_endpoint, folder


def endpoint_table(metrics: dict[str, Any]) -> Table:
    k = metrics.get("num_speculative_tokens") or len(metrics["per_position_acceptance"])
    table = Table(
        title=f"speculator served by {metrics['endpoint']} ({metrics['served_model']}), K = {k}, greedy, "
        f"concurrency {metrics['concurrency']}, from its /metrics counters",
        title_justify="left",
    )
    table.add_column("traffic")
    table.add_column("prompts", justify="right")
    table.add_column("drafts", justify="right")
    table.add_column("acceptance length", justify="right")
    for i in range(len(metrics["per_position_acceptance"])):
        table.add_column(f"pos {i + 1}", justify="right")
    for name, row in [*metrics["by_traffic"].items(), ("all", metrics)]:
        table.add_row(
            name,
            str(row["num_prompts"]),
            str(row["num_drafts"]),
            f"{row['acceptance_length']:.2f}",
            *(f"{p:.0%}" for p in row["per_position_acceptance"]),
        )
    return table


def measure_endpoint(
    run: RunDir, settings: SpeculatorSettings, data: Path | None, endpoint: Endpoint, concurrency: int = 1
) -> dict[str, Any]:
    """The acceptance of the speculator `endpoint` runs on the stage's held-out prompts: DATA's last
    rows, or the eval split (never trained on); `metrics.json`'s contents."""
    from onboard.models import inspect_checkpoint, load_tokenizer
    from onboard.speculator.data import TRAFFIC, split_data
    from onboard.speculator.export import speculative_tokens
    from onboard.speculator.measure import held_out_prompts

    tokenizer = load_tokenizer(inspect_checkpoint(run.artifact))
    _, eval_records = split_data(data, settings.eval_prompts) if data else (None, None)
    prompts = held_out_prompts(
        tokenizer,
        TRAFFIC[settings.traffic],
        eval_records or None,
        settings.eval_prompts,
        settings.max_prompt_tokens,
    )
    spec = endpoint.spec
    console.print(f"speculator: {len(prompts)} held-out prompts on {spec.base} ({endpoint.model}) ...")
    metrics = measure_endpoint_acceptance(endpoint, prompts, settings.eval_max_tokens, concurrency)
    own = run.artifact / "speculator"
    if metrics["num_speculative_tokens"] is None and (own / "config.json").is_file():
        metrics["num_speculative_tokens"] = speculative_tokens(own)  # the server did not say; the run's
    metrics.update(
        endpoint=spec.base,
        served_model=endpoint.model,
        data=str(data) if data else "builtin:eval",
        traffic=settings.traffic,
    )
    return metrics


def run_endpoint_speculator(
    run: RunDir, settings: SpeculatorSettings, data: Path | None, spec: EndpointSpec, concurrency: int = 1
) -> dict[str, Any]:
    run.require("quantize")
    endpoint = Endpoint(spec)
    result_file = at_endpoint(spec.slug, SPECULATOR_METRICS)

    def body(stage: Stage) -> dict[str, Any]:
        metrics = measure_endpoint(run, settings, data, endpoint, concurrency)
        atomic.write_json(stage.path(result_file), metrics)
        return {key: metrics[key] for key in ("acceptance_length", "num_speculative_tokens", "num_drafts")}

    inputs = {
        "endpoint": spec.base,
        "served_model": endpoint.model,
        "settings": settings.model_dump(include={"traffic", "eval_prompts", "max_prompt_tokens", "eval_max_tokens"}),
        "data": fingerprint(data) if data else "builtin:eval",
        "concurrency": concurrency,
        "measured": uuid.uuid4().hex,  # never "cached": the server's deployment may have changed since
    }
    try:
        entry = run.run_stage(
            f"speculator@{spec.slug}", inputs, outputs=[at_endpoint(spec.slug, folder(SPECULATOR_METRICS))], body=body
        )
    finally:
        endpoint.close()
    console.print(endpoint_table(json.loads(run.path(result_file).read_text())))
    return entry
