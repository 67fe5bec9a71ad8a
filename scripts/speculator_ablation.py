#!/usr/bin/env python3
"""Ablation of the speculator's three data/init levers, measured on the same held-out prompts.

    .venv/bin/python scripts/speculator_ablation.py RUN_DIR [--device cuda] [--numerics fast] \
        [--teacher-forced-data FILE ...] [--train-steps N] [--out FILE.json]

RUN_DIR holds an artifact (`onboard quantize`); the drafts are trained on its hidden states and
measured in the engine on the built-in eval split of mixed traffic (`held_out_prompts`, never
trained on), acceptance length at K = --k, greedy, concurrency 1. Variants, each trained for the
same number of optimizer steps (--train-steps; default --epochs epochs of the baseline's data):

  baseline  the target's responses as the recipe's defaults generate them (--num-prompts x
            --responses-per-prompt at --baseline-concurrency) + --stdlib-files teacher-forced
            stdlib modules; random init of the draft layer
  lever1    high-concurrency generation: --scaled-responses-per-prompt responses per prompt (and the
            prompts of any --generation-data) at --concurrency, instead of the baseline's responses
  lever2    teacher-forced text with existing answers: baseline data + the answers of
            --teacher-forced-data (up to --teacher-forced-max-sequences) + stdlib modules up to
            --scaled-stdlib-files
  lever3    baseline data, draft layer initialised from the target's last decoder layer
  all       lever1's responses + lever2's teacher-forced text + lever3's init

Captured parts are shared by the variants that contain them and kept in RUN_DIR/ablation/ (keyed
by their inputs), as are finished variants, so a rerun continues where it stopped. Size it to the
time you have with --num-prompts, --scaled-responses-per-prompt, --teacher-forced-max-sequences,
--train-steps and --eval-prompts. Results: a table on stderr, JSON at --out.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict
from pathlib import Path

from rich import box
from rich.table import Table

from onboard import atomic
from onboard.console import console
from onboard.data.load import load_records
from onboard.engine import LLMEngine
from onboard.errors import OnboardError
from onboard.hashing import code_version, hash_json
from onboard.recipes import SpeculatorSettings
from onboard.speculator.capture import capture_shards, combine_captures
from onboard.speculator.data import TRAFFIC, default_aux_layers, draft_vocabulary, generate_responses, training_prompts
from onboard.speculator.measure import held_out_prompts, measure_acceptance
from onboard.speculator.plan import engine_config
from onboard.speculator.stage import build_draft
from onboard.speculator.teacher import data_files_key, resolve_data_files, teacher_forced_answers, teacher_forced_code
from onboard.speculator.train import TrainSettings, train_draft
from onboard.workspace import RunDir

VARIANTS = {  # name -> (parts, init from the last layer)
    "baseline": (["gen-base", "code-base"], False),
    "lever1": (["gen-scaled", "code-base"], False),
    "lever2": (["gen-base", "code-base", "code-extra", "answers"], False),
    "lever3": (["gen-base", "code-base"], True),
    "all": (["gen-scaled", "code-base", "code-extra", "answers"], True),
}

GENERATION = ["num_prompts", "max_prompt_tokens", "max_new_tokens", "response_temperature"]
PART_ARGS = {  # what each captured part depends on, beyond the artifact, numerics and code
    "gen-base": [*GENERATION, "responses_per_prompt", "baseline_concurrency"],
    "gen-scaled": [*GENERATION, "scaled_responses_per_prompt", "concurrency", "generation_data"],
    "code-base": ["stdlib_files", "max_seq_len"],
    "code-extra": ["stdlib_files", "scaled_stdlib_files", "max_seq_len"],
    "answers": ["teacher_forced_data", "teacher_forced_max_sequences", "max_prompt_tokens", "max_seq_len"],
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("run_dir", type=Path, help="a run directory with an artifact (e.g. runs/interop/w4a4)")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of " + ", ".join(VARIANTS))
    p.add_argument("--device", default="cpu")
    p.add_argument("--numerics", default="fast", choices=["exact", "fast"], help="the engine's, for everything")
    p.add_argument("--num-prompts", type=int, default=400, help="built-in calibration prompts (mixed traffic)")
    p.add_argument("--max-prompt-tokens", type=int, default=256)
    p.add_argument("--max-new-tokens", type=int, default=192)
    p.add_argument("--response-temperature", type=float, default=0.8)
    p.add_argument("--responses-per-prompt", type=int, default=4, help="baseline")
    p.add_argument("--baseline-concurrency", type=int, default=64)
    p.add_argument("--scaled-responses-per-prompt", type=int, default=16, help="lever 1")
    p.add_argument("--concurrency", type=int, default=256, help="lever 1")
    p.add_argument("--generation-data", type=Path, nargs="*", default=[], help="lever 1: more prompts (DATA)")
    p.add_argument("--stdlib-files", type=int, default=24, help="every variant")
    p.add_argument("--scaled-stdlib-files", type=int, default=96, help="lever 2")
    p.add_argument("--teacher-forced-data", type=Path, nargs="*", default=[], help="lever 2: DATA with answers")
    p.add_argument("--teacher-forced-max-sequences", type=int, default=2000, help="lever 2")
    p.add_argument("--max-seq-len", type=int, default=512)
    p.add_argument("--draft-vocab-size", type=int, default=8192)
    p.add_argument("--k", type=int, default=3, help="speculative tokens (trained and measured)")
    p.add_argument("--train-steps", type=int, default=None, help="optimizer steps per variant")
    p.add_argument("--epochs", type=int, default=3, help="without --train-steps: epochs of the baseline's data")
    p.add_argument("--batch-sequences", type=int, default=4)
    p.add_argument("--learning-rate", type=float, default=1e-3)
    p.add_argument("--eval-prompts", type=int, default=24)
    p.add_argument("--eval-max-tokens", type=int, default=96)
    p.add_argument("--out", type=Path, default=None, help="JSON results (default RUN_DIR/ablation/ablation.json)")
    args = p.parse_args(argv)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variant {unknown[0]!r}; known: {', '.join(VARIANTS)}")
    return args


class Ablation:
    def __init__(self, args: argparse.Namespace):

        self.args = args
        run = RunDir(args.run_dir)
        self.artifact_key = run.require("quantize")["key"]
        self.artifact = run.artifact
        self.work = args.run_dir / "ablation"
        settings = SpeculatorSettings(
            max_prompt_tokens=args.max_prompt_tokens,
            max_new_tokens=args.max_new_tokens,
            generation_concurrency=max(args.concurrency, args.baseline_concurrency),
            max_seq_len=args.max_seq_len,
        )
        self.engine = LLMEngine(self.artifact, engine_config(settings, args.device, args.numerics))
        self.tokenizer = self.engine.tokenizer
        self.aux_layers = default_aux_layers(self.engine.hf_config.get_text_config().num_hidden_layers)
        self.answers = resolve_data_files([str(p) for p in args.teacher_forced_data], "--teacher-forced-data")
        generation_data = resolve_data_files([str(p) for p in args.generation_data], "--generation-data")
        self.files = {
            "teacher_forced_data": data_files_key(self.answers),
            "generation_data": data_files_key(generation_data),
        }
        self.common = {"artifact": self.artifact_key, "numerics": args.numerics, "aux": self.aux_layers}
        self.common["code"] = code_version()

    def _sequences(self, name: str) -> list:

        a, tok = self.args, self.tokenizer
        if name in ("gen-base", "gen-scaled"):
            prompts = training_prompts(tok, "mixed", None, a.num_prompts, a.max_prompt_tokens)
            responses, concurrency = a.responses_per_prompt, a.baseline_concurrency
            if name == "gen-scaled":
                for path in a.generation_data:
                    prompts += training_prompts(tok, "mixed", load_records(path), a.num_prompts, a.max_prompt_tokens)
                responses, concurrency = a.scaled_responses_per_prompt, a.concurrency
            temperature = a.response_temperature
            return generate_responses(self.engine, prompts, a.max_new_tokens, responses, temperature, concurrency)
        if name == "code-base":
            return teacher_forced_code(tok, a.stdlib_files, a.max_seq_len)
        if name == "code-extra":
            return teacher_forced_code(tok, a.scaled_stdlib_files, a.max_seq_len)[len(self._sequences("code-base")) :]
        if name == "answers":
            limit = a.teacher_forced_max_sequences
            return teacher_forced_answers(tok, self.answers, limit, a.max_prompt_tokens, a.max_seq_len)
        raise ValueError(name)

    def part(self, name: str) -> dict:
        """A captured part, made once: its directory, sequences, tokens and seconds."""

        inputs = {k: self.files.get(k, getattr(self.args, k)) for k in PART_ARGS[name]}
        key = hash_json({"part": name, **self.common, **inputs})
        out = self.work / "parts" / name
        if (out / "KEY").is_file() and (out / "KEY").read_text() == key:
            return json.loads((out / "part.json").read_text())
        started = time.perf_counter()
        sequences = self._sequences(name)
        partial = out.with_name(name + ".partial")
        atomic.remove(partial)
        index = capture_shards(self.engine, sequences, self.aux_layers, partial)
        info = {"dir": str(out), "sequences": index["num_sequences"], "tokens": index["num_tokens"]}
        info["seconds"] = round(time.perf_counter() - started, 1)
        (partial / "part.json").write_text(json.dumps(info, indent=2) + "\n")
        (partial / "KEY").write_text(key)
        atomic.remove(out)
        partial.rename(out)
        return info

    def variant(self, name: str, steps: int) -> dict:

        a = self.args
        names, from_last_layer = VARIANTS[name]
        parts = [self.part(p) for p in names if p != "answers" or self.answers]
        home = self.work / "variants" / name
        index = combine_captures(home / "data", [Path(p["dir"]) for p in parts])
        train = TrainSettings(
            epochs=10**6, learning_rate=a.learning_rate, batch_sequences=a.batch_sequences,
            max_seq_len=a.max_seq_len, ttt_steps=a.k, max_steps=steps,
        )  # fmt: skip
        measured = {"prompts": a.eval_prompts, "max_tokens": a.eval_max_tokens, "vocab": a.draft_vocab_size}
        parts_key = [(Path(p["dir"]) / "KEY").read_text() for p in parts]
        key = hash_json({"parts": parts_key, "init": from_last_layer, "train": asdict(train), **measured})
        done = home / "result.json"
        if done.is_file() and json.loads(done.read_text()).get("key") == key:
            return json.loads(done.read_text())
        vocab = draft_vocabulary(home / "data", a.draft_vocab_size, self.engine.vocab_size)
        draft = build_draft(self.engine, vocab, self.aux_layers, from_last_layer)
        head = self.engine.target_tensors()["lm_head"]
        started = time.perf_counter()
        history = train_draft(draft, home / "data", head, train, home / "checkpoint", key)
        train_s = time.perf_counter() - started
        prompts = held_out_prompts(self.tokenizer, TRAFFIC["mixed"], None, a.eval_prompts, a.max_prompt_tokens)
        metrics = measure_acceptance(self.engine, draft, a.k, prompts, a.eval_max_tokens)
        result = {
            "key": key,
            "parts": names,
            "init_from_last_layer": from_last_layer,
            "train_sequences": index["num_sequences"],
            "train_tokens": index["num_tokens"],
            "data_seconds": round(sum(p["seconds"] for p in parts), 1),
            "train_seconds": round(train_s, 1),
            "train_steps": history[-1]["steps"],
            "final_loss": history[-1]["loss"],
            **{k: metrics[k] for k in ("acceptance_length", "per_position_acceptance", "speedup", "num_prompts")},
            "by_traffic": metrics["by_traffic"],
        }
        done.write_text(json.dumps(result, indent=2) + "\n")
        return result


def table(results: dict[str, dict], k: int) -> Table:
    title = f"speculator ablation (K = {k}, same held-out prompts, same steps)"
    t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, collapse_padding=True)
    for column in ("variant", "train tokens", "data s", "train s", "acceptance", *(f"pos {i + 1}" for i in range(k))):
        t.add_column(column, justify="left" if column == "variant" else "right")
    for name, r in results.items():
        positions = (f"{p:.0%}" for p in r["per_position_acceptance"])
        row = (f"{r['train_tokens']:,}", f"{r['data_seconds']:.0f}", f"{r['train_seconds']:.0f}")
        t.add_row(name, *row, f"{r['acceptance_length']:.3f}", *positions)
    return t


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ablation = Ablation(args)
    steps = args.train_steps
    if steps is None:
        base = [ablation.part(p) for p in VARIANTS["baseline"][0]]
        steps = args.epochs * math.ceil(sum(p["sequences"] for p in base) / args.batch_sequences)
    console.print(f"ablation: {steps} optimizer steps per variant, numerics {args.numerics}, device {args.device}")
    results = {}
    for name in args.variants:
        console.print(f"[bold]ablation: {name}[/]")
        results[name] = ablation.variant(name, steps)
    console.print(table(results, args.k))
    out = args.out or ablation.work / "ablation.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    summary = {"run_dir": str(args.run_dir), "train_steps": steps, "args": vars(args), "variants": results}
    out.write_text(json.dumps(summary, indent=2, default=str) + "\n")
    console.print(f"ablation: results in {out}")
    return 0


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except OnboardError as err:
        console.print(f"[red]error:[/] {err}")
        raise SystemExit(2) from None
