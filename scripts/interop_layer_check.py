#!/usr/bin/env python3
"""One NVFP4 (W4A4) linear of a compressed-tensors artifact, three ways, against the format.

    .venv/bin/python scripts/interop_layer_check.py ARTIFACT_DIR LAYER [--tokens 64] [--seed 0]
    e.g. .venv/bin/python scripts/interop_layer_check.py runs/interop/w4a4/artifact \
             model.layers.0.mlp.down_proj

Reference ("format"): the layer's stored tensors read with safetensors and decoded as
compressed-tensors 0.19 defines NVFP4 (`NVFP4PackedCompressor`, `calculate_qparams`,
`_quantize_dequantize`), written out here independently, every step in float32:
  weight  W = E2M1(nibble) * fp8(weight_scale) / weight_global_scale        (low nibble = even column)
  input   per 16 columns: s = fp8_e4m3(clamp(input_global_scale * amax/6, +-448)), s == 0 -> 0.125
          q = E2M1 nearest, ties to even (clamp(x / (s / input_global_scale), +-6))
          x_dq = q * s / input_global_scale
  y = x_dq @ W.T   (float32)
Compared with: (a) onboard's engine linear (`CheckpointWeights.linear`, run here in .venv);
(b) vLLM's served path on CPU, `CompressedTensorsW4A4Fp4` -> `EmulationNvFp4LinearKernel` ->
`run_nvfp4_emulations` (run in .venv-vllm through a subprocess: this file with --vllm-half,
tensors exchanged by .safetensors files in a temp dir); (c) compressed-tensors' own runtime
functions (`compute_dynamic_scales_and_zp` + `fake_quantize`, `dequantize`) as a second reference.
The activation is a fixed seeded bf16 tensor scaled so its absmax is 0.9 x the calibrated range
(448 * 6 / input_global_scale), per-channel magnitudes varied so blocks differ.
Each side's dequantized activation and weight are compared with the reference's (rounded to bf16,
as both sides keep them in bf16) to name the step that differs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parent.parent
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
GROUP = 16


# ------------------------------------------------------------------------------ reference
def unpack(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [out, in/2] -> float32 [out, in]: low nibble is column 2j, high nibble 2j+1; bit 3 sign."""
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2).long()
    mag = E2M1[codes & 0x07]
    return torch.where((codes & 0x08) != 0, -mag, mag)


def e2m1_round(v: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 value, ties to the even code (code & 1 == 0: 0, 1, 2, 4), for |v| <= 6."""
    a = v.abs().unsqueeze(-1)
    dist = (a - E2M1).abs()
    best = dist.min(dim=-1, keepdim=True).values
    tie_pen = (torch.arange(8) % 2).to(v.dtype) * 1e-3  # prefer even codes among equal distances
    idx = torch.where(dist == best, tie_pen, torch.full_like(dist, 1e9)).argmin(dim=-1)
    return torch.copysign(E2M1[idx], v) * (v != 0)


def ref_weight(packed, wscale, wgs) -> torch.Tensor:
    vals = unpack(packed).unflatten(-1, (-1, GROUP))
    return (vals * (wscale.to(torch.float32) / wgs.to(torch.float32)).unsqueeze(-1)).flatten(-2)


def ref_act(x: torch.Tensor, igs: torch.Tensor, amax_in_bf16: bool = False):
    """Returns (x_dq float32, fp8 block scales float32). amax_in_bf16: amax/6 rounded to bf16 first
    (what compressed-tensors' runtime does for a bf16 input: the division happens in x.dtype)."""
    g = igs.to(torch.float32).reshape(())
    blocks = x.to(torch.float32).unflatten(-1, (-1, GROUP))
    amax = blocks.abs().amax(-1, keepdim=True)
    local = (amax.to(torch.bfloat16) / 6).to(torch.float32) if amax_in_bf16 else amax / 6
    s = (g * local).clamp(-448, 448).to(torch.float8_e4m3fn).to(torch.float32)
    s = torch.where(s == 0, torch.tensor(0.125), s)
    eff = s / g
    q = e2m1_round((blocks / eff).clamp(-6, 6))
    return (q * eff).flatten(-2), s.squeeze(-1)


# ------------------------------------------------------------------------------ helpers
def read_layer(artifact: Path, layer: str) -> dict[str, torch.Tensor]:
    names = ["weight_packed", "weight_scale", "weight_global_scale", "input_global_scale"]
    out = {}
    for f in sorted(artifact.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for n in names:
                if f"{layer}.{n}" in h.keys():  # noqa: SIM118 (a safe_open handle is not a mapping)
                    out[n] = h.get_tensor(f"{layer}.{n}")
    missing = [n for n in names if n not in out]
    if missing:
        raise SystemExit(f"{layer}: not an NVFP4 W4A4 linear in {artifact} (missing {missing})")
    return out


def make_input(tokens: int, in_features: int, igs: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, in_features, generator=g)
    x = x * torch.exp(torch.randn(in_features, generator=g))  # channels of varied magnitude
    target = 0.9 * 448 * 6 / float(igs.reshape(-1)[0])  # absmax within the calibrated range
    return (x * (target / x.abs().max())).to(torch.bfloat16)


def err(a: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    d = a.double() - ref.double()
    return float(d.abs().max()), float(d.norm() / ref.double().norm())


def neq(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((a.to(torch.float32) != b.to(torch.float32)).sum())


# ------------------------------------------------------------------------------ the three sides
def onboard_side(artifact: Path, layer: str, x: torch.Tensor) -> dict[str, torch.Tensor]:
    sys.path.insert(0, str(ROOT))
    from onboard.engine import CheckpointWeights

    with CheckpointWeights(artifact) as cw:
        lin = cw.linear(layer)
        if lin.fmt != "nvfp4" or lin.act_quant is None:
            raise SystemExit(f"{layer}: onboard serves it as {lin.fmt}, not NVFP4 W4A4")
        with torch.no_grad():
            return {"x_dq": lin.act_quant(x), "w_dq": lin.weight.clone(), "y": lin(x)}


def ct_side(artifact: Path, layer: str, t: dict[str, torch.Tensor], x: torch.Tensor) -> dict[str, torch.Tensor]:
    """compressed-tensors' own runtime functions with the artifact's QuantizationArgs."""
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.lifecycle.forward import dequantize, fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    qc = json.loads((artifact / "config.json").read_text())["quantization_config"]
    scheme = None
    for group in qc["config_groups"].values():
        args = {k: group.get(k) for k in ("weights", "input_activations")}
        if (args["weights"] or {}).get("num_bits") == 4 and args["input_activations"]:
            scheme = QuantizationScheme(targets=group["targets"], **args)
            break
    if scheme is None:
        raise SystemExit("no NVFP4 W4A4 config group in the artifact")
    m, n = t["weight_packed"].shape
    vals = unpack_fp4_from_uint8(t["weight_packed"], m, n * 2)
    w = dequantize(
        x_q=vals,
        scale=t["weight_scale"].to(vals.dtype),
        args=scheme.weights,
        global_scale=t["weight_global_scale"],
        dtype=vals.dtype,
    )
    ia, igs = scheme.input_activations, t["input_global_scale"]
    scale, zp = compute_dynamic_scales_and_zp(value=x, args=ia, module=None, global_scale=igs)
    x_dq = fake_quantize(x=x, scale=scale, zero_point=zp, args=ia, global_scale=igs)
    return {"x_dq": x_dq, "w_dq": w, "y": torch.nn.functional.linear(x_dq, w)}


def vllm_half(inp: str, out: str) -> None:
    """Runs in .venv-vllm: vLLM's own scheme + kernel on the stored tensors."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    import vllm
    from vllm.model_executor import parameter as vparam
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import CompressedTensorsW4A4Fp4
    from vllm.model_executor.layers.quantization.utils import nvfp4_emulation_utils as emu
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # the interop plugin: EmulationNvFp4LinearKernel for the CPU platform
    # One unsharded layer outside a server: no tensor-parallel group to ask (rank 0 of 1).
    vparam.get_tensor_model_parallel_rank = lambda: 0
    vparam.get_tensor_model_parallel_world_size = lambda: 1
    t = load_file(inp)
    x = t.pop("x")
    out_f, in_f = t["weight_packed"].shape[0], t["weight_packed"].shape[1] * 2
    scheme = CompressedTensorsW4A4Fp4(use_a16=False)
    layer = torch.nn.Module()
    scheme.create_weights(
        layer,
        output_partition_sizes=[out_f],
        input_size_per_partition=in_f,
        params_dtype=torch.bfloat16,
        weight_loader=None,
        input_size=in_f,
        output_size=out_f,
    )
    for name, value in t.items():
        getattr(layer, name).data.copy_(value.reshape(getattr(layer, name).shape))
    scheme.process_weights_after_loading(layer)
    with torch.no_grad():
        y = scheme.apply_weights(layer, x)
        # the kernel's two steps, called the way run_nvfp4_emulations calls them
        x_dq = emu.ref_nvfp4_quant_dequant(x, layer.input_global_scale_inv, GROUP)
        w_dq = emu.dequantize_to_dtype(
            layer.weight.data.view(torch.uint8),
            layer.weight_scale.data,
            layer.weight_global_scale,
            x.dtype,
            GROUP,
            swizzle=False,
        )
    save_file(
        {
            "y": y.contiguous(),
            "x_dq": x_dq.contiguous(),
            "w_dq": w_dq.contiguous(),
            "wgs_used": layer.weight_global_scale.reshape(1).float(),
            "igs_used": layer.input_global_scale_inv.reshape(1).float(),
        },
        out,
    )
    info = {"vllm": vllm.__version__, "kernel": type(scheme.kernel).__name__}
    try:
        import compressed_tensors

        info["compressed_tensors"] = compressed_tensors.__version__
    except ImportError:
        pass
    Path(out).with_suffix(".json").write_text(json.dumps(info))


def vllm_side(python: str, t: dict[str, torch.Tensor], x: torch.Tensor) -> tuple[dict, dict]:
    with tempfile.TemporaryDirectory() as d:
        inp, out = Path(d) / "in.safetensors", Path(d) / "out.safetensors"
        save_file({**{k: v.contiguous() for k, v in t.items()}, "x": x.contiguous()}, str(inp))
        env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind")}
        proc = subprocess.run(
            [python, __file__, "--vllm-half", str(inp), str(out)], env=env, capture_output=True, text=True
        )
        if proc.returncode:
            raise SystemExit(f"vLLM half failed ({python}):\n{proc.stderr[-4000:]}")
        return load_file(str(out)), json.loads(out.with_suffix(".json").read_text())


def fused_scales(artifact: Path) -> list[str]:
    """Fused vLLM partitions (q/k/v, gate/up) whose stored global scales differ: vLLM serves the
    whole fused layer with the max of each (CompressedTensorsW4A4Fp4.process_weights_after_loading)."""
    scal = {}
    for f in sorted(artifact.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():  # noqa: SIM118
                if k.endswith(("weight_global_scale", "input_global_scale")):
                    scal[k] = float(h.get_tensor(k).reshape(-1)[0])
    rows = []
    groups = {"self_attn": ("q_proj", "k_proj", "v_proj"), "mlp": ("gate_proj", "up_proj")}
    layers = sorted({k.split(".self_attn.")[0].split(".mlp.")[0] for k in scal})
    for lay in layers:
        for blk, parts in groups.items():
            for kind in ("weight_global_scale", "input_global_scale"):
                vals = [scal.get(f"{lay}.{blk}.{p}.{kind}") for p in parts]
                if None in vals:
                    continue
                if len(set(vals)) > 1:
                    rows.append(
                        f"{lay}.{blk} {kind}: "
                        + ", ".join(f"{p}={v:g}" for p, v in zip(parts, vals, strict=True))
                        + f" (vLLM uses {max(vals):g} for all)"
                    )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("artifact", type=Path)
    ap.add_argument("layer")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm/bin/python"))
    ap.add_argument("--json", type=Path, help="also write the numbers here")
    ns = ap.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 1)))

    t = read_layer(ns.artifact, ns.layer)
    out_f, in_f = t["weight_packed"].shape[0], t["weight_packed"].shape[1] * 2
    x = make_input(ns.tokens, in_f, t["input_global_scale"], ns.seed)
    wgs, igs = float(t["weight_global_scale"].reshape(-1)[0]), float(t["input_global_scale"].reshape(-1)[0])

    w_ref = ref_weight(t["weight_packed"], t["weight_scale"], t["weight_global_scale"])
    x_ref, s_ref = ref_act(x, t["input_global_scale"])
    x_ref16, s_ref16 = ref_act(x, t["input_global_scale"], amax_in_bf16=True)
    y_ref = x_ref @ w_ref.T

    sides = {
        "onboard": onboard_side(ns.artifact, ns.layer, x),
        "compressed-tensors runtime": ct_side(ns.artifact, ns.layer, t, x),
    }
    v, vinfo = vllm_side(ns.vllm_python, t, x)
    sides[f"vLLM {vinfo['kernel']}"] = v

    print(
        f"{ns.layer} [{out_f}x{in_f}] of {ns.artifact}: weight_global_scale {wgs:g}, "
        f"input_global_scale {igs:g}; x bf16 [{ns.tokens}x{in_f}] seed {ns.seed}, absmax {float(x.abs().max()):.4g}"
    )
    print(
        f"vLLM side: vllm {vinfo['vllm']}, compressed-tensors {vinfo.get('compressed_tensors')}; "
        f"globals after process_weights_after_loading: weight x{float(v['wgs_used'][0]):.6g} "
        f"(= 1/{1 / float(v['wgs_used'][0]):g}), input {float(v['igs_used'][0]):g}"
    )
    flipped = s_ref != s_ref16
    ratio = (s_ref16[flipped] / s_ref[flipped]) if flipped.any() else torch.ones(1)
    print(
        f"reference: blocks whose fp8 scale changes if amax/6 is rounded to bf16 first: "
        f"{int(flipped.sum())} of {s_ref.numel()} (scale ratio bf16/fp32 {float(ratio.min()):.4g}.."
        f"{float(ratio.max()):.4g}); y_ref absmax {float(y_ref.abs().max()):.4g}, "
        f"rms {float(y_ref.pow(2).mean().sqrt()):.4g}"
    )
    n_x, n_w = x_ref.numel(), w_ref.numel()
    print()
    hdr = (
        f"{'side':34} {'y max|d|':>10} {'y rel':>9} {'x_dq!=ref':>10} {'x_dq!=ref(bf16 amax)':>21} "
        f"{'w_dq!=ref':>10} {'y vs own fp32 mm':>17}"
    )
    print(hdr)
    print("-" * len(hdr))
    results = {}
    for name, s in sides.items():
        ymax, yrel = err(s["y"], y_ref)
        own = s["x_dq"].float() @ s["w_dq"].float().T
        mm_max, _ = err(s["y"], own)
        row = {
            "y_max_abs": ymax,
            "y_rel": yrel,
            "x_dq_differs": neq(s["x_dq"], x_ref.to(torch.bfloat16)),
            "x_dq_differs_bf16amax": neq(s["x_dq"], x_ref16.to(torch.bfloat16)),
            "w_dq_differs": neq(s["w_dq"], w_ref.to(torch.bfloat16)),
            "y_vs_own_fp32_matmul_max_abs": mm_max,
        }
        results[name] = row
        print(
            f"{name:34} {ymax:10.3e} {yrel:9.2e} {row['x_dq_differs']:>10} {row['x_dq_differs_bf16amax']:>21} "
            f"{row['w_dq_differs']:>10} {mm_max:17.3e}"
        )
    y_ref_bf = x_ref.to(torch.bfloat16).float() @ w_ref.to(torch.bfloat16).float().T
    bmax, brel = err(y_ref_bf, y_ref)
    print(f"{'(reference, x_dq/w_dq in bf16)':34} {bmax:10.3e} {brel:9.2e}")
    print(f"(elements: x_dq {n_x}, w_dq {n_w}; '!=ref' counts elements unequal to the reference rounded to bf16)")
    names = list(sides)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            print(
                f"{a} vs {b}: y max|d| {err(sides[a]['y'], sides[b]['y'].float())[0]:.3e}, "
                f"x_dq unequal {neq(sides[a]['x_dq'], sides[b]['x_dq'])}, "
                f"w_dq unequal {neq(sides[a]['w_dq'], sides[b]['w_dq'])}"
            )
    rows = fused_scales(ns.artifact)
    print(f"\nfused partitions with differing global scales: {len(rows)}")
    for r in rows:
        print("  " + r)
    if ns.json:
        ns.json.write_text(json.dumps({"layer": ns.layer, "results": results, "fused_scale_mismatch": rows}, indent=1))


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--vllm-half":
        vllm_half(sys.argv[2], sys.argv[3])
    else:
        main()
