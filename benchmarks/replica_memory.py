"""Accelerator memory of a replica per model parameter, by phase and placement: full fp32, bf16 compute over
float32 masters, and LoRA, each with and without gradient checkpointing; and which Qwen2.5 shapes fit.

    python benchmarks/replica_memory.py --out bench-out/replica_memory.json [--layers 2] [--shape-100m]

The model is a Llama built from its config with random weights (by default 2 x 768, MLP 3072, the demo's BPE
vocabulary of 2048; ``--shape-100m``: 12 layers, about 115M parameters; ``--model``: a saved one) and loaded
as a published checkpoint; a copy of it at another depth (``--deeper-layers``, by default twice as deep: its
config with only the depth changed) is measured the same way, for the activations' split. Each (mode,
checkpointing) runs in a fresh process, which trains one replica per depth and batch size (1 and 2
sequences of 2048 tokens, smallest first), one after the other: the real ``Replica``, its torchft DiLoCo (whatever
fragment class the project gives it), optimizers and store exchange; 1 replica, lm objective, H = 2 inner
steps, 2 rounds on the demo corpus. It runs on the accelerator: CUDA when torch sees one (its allocator's
counters, ``torch.cuda.max_memory_allocated``), else the simulated accelerator (``accelerator/simulated.py``:
the replica's CUDA path, every device storage counted exactly, without an allocator's rounding, caching or
fragmentation). Device figures are over the device's allocation before the model was loaded. The measured
windows are round 2's, in steady state (the inner optimizer's moments and DiLoCo's outer state exist by
then, as in every later round):

* **inner**: round 2's first step, which does not sync, in three phases: each forward (to its
  ``backward()`` call), each backward with the gradients' clipping (to the optimizer's pre-hook), and the
  optimizer step; the device peak of each (``torch.cuda.reset_peak_memory_stats`` between them).
  ``device_bytes_per_param_inner`` is the largest, at the largest batch; ``..._between_steps`` what the
  device holds when the step starts (weights, the optimizer's moments, DiLoCo's state if it keeps any there).
* **sync**: what DiLoCo's fragment runs in the syncing step's post-hook, ``prepare_sync`` and
  ``perform_sync`` (pseudo-gradient, exchange, outer step), wrapped on the fragment objects DiLoCo holds at
  run time: peak reset right before, read right after. The trainer's own post-hook frees the inner
  gradients before DiLoCo's runs.
* **state and activations**: ``activation_bytes_per_token`` ``a`` is the larger slope over the batch's
  tokens (least squares over the batch sizes) of the forward's peak (what it keeps for the backward) and of
  the backward's (that, and the backward's own transients such as the logits' gradient). The state is the
  least ``s`` with every measured phase peak at most ``s + a * tokens``: the optimizer step's peak, or a
  forward's or backward's peak less ``a`` times its tokens, whichever is largest. So the inner peak
  measured is at least the state, and ``state + a * tokens`` bounds the inner step's from above, loosely by
  up to the gradients' bytes. The batches are large enough that the activations, not the gradients, make
  each backward's peak (near its start; with checkpointing, while a layer is recomputed): at a few hundred
  tokens the backward's peak is at its end instead, all gradients made and activations freed, and the
  slope misses what the backward holds (with checkpointing, more than half of it).
* **activations by depth**: ``a`` at the two depths, ``a(L) = fixed + L * per_layer``, gives
  ``activation_bytes_per_token_per_layer`` and ``..._fixed``; the first over the hidden width
  (``..._per_layer_per_hidden``: a decoder layer's activations grow about linearly with its width at a fixed
  MLP ratio), the second over the vocabulary (``..._fixed_per_vocab``: it is mostly the head's logits, their
  float32 copies and the loss's). With checkpointing, the per-layer part is what a checkpointed layer keeps,
  its input, and the fixed part holds the layer the backward recomputes besides the head's: the fits table
  takes that layer from the same mode's row without checkpointing (``fits.assumptions``). The per-layer
  part is the larger of the forward's and the backward's growth per layer: checkpointed full and bf16
  fine-tunes reach their backward's peak at its end, when the layers' inputs are gone, and only the
  forward shows them. By default measured at 2048 tokens a sequence, the fits table's; attention is
  PyTorch's SDPA, which on a CPU dispatches to its flash-attention kernel (no sequence x sequence scores
  kept), as SDPA's kernels do on a GPU. The deeper copy's own figures are under ``deeper``.
* **host**: the process's resident memory (VmHWM, reset through /proc/self/clear_refs when the sync starts,
  read when it ends) over its resident memory before the model was loaded (CUDA's context already
  created), less, on the simulated accelerator, whose device storages are host memory too, the device
  peak of the same window: exact when the two peaks coincide, else a lower bound of the host memory at the
  resident peak. It counts all the replica holds on the host, pinned or not: DiLoCo's copy of the global
  parameters, its outer state where it keeps it there, the exchange's payloads, the data and tokenizer. A
  process's first replica also pays the libraries' one-time costs (lazy imports, caches, thread arenas;
  about 40 MB), so the figure is taken from the replicas after it (``warm`` runs; every run's is under
  ``runs``). glibc serves every allocation above 64 KiB with mmap (``MALLOC_MMAP_THRESHOLD_``), so tensors
  an earlier replica freed left the resident set and cannot hide a later one's. Linux only (/proc).

Writes JSON: ``results`` (one row per mode and checkpointing, every figure over the model's parameter
count, each batch size's raw peaks under ``runs``) and ``fits``: for each Qwen2.5 shape (0.5B to 72B, the
published configs, parameters counted from them), each row and two token budgets a rank (``--fit-tokens``,
8 x 2048, and ``--fit-tokens-small``, one 2048-token sequence: ``train.micro_batch_size`` chooses), whether
the replica fits one 80 GB GPU and 8 x 80 GB with FSDP (state and sync divided over the ranks, each rank's
activations not): ``state * N / ranks + activation(shape) * tokens`` and ``sync * N / ranks`` both at most
80 GB, with ``activation(shape)`` extrapolated from the split above to the shape's width, depth, MLP ratio
and vocabulary; and the largest shape that fits. Derived from the measured figures and the assumptions
stated in ``fits.assumptions``, nothing else: no target shape is run.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from process_memory import hwm_bytes, reset_hwm, rss_bytes

MODES: dict[str, dict[str, Any]] = {
    "full fp32": {},
    "bf16 compute, fp32 masters": {"dtype": "bfloat16"},
    "LoRA r=8, bf16 base": {"dtype": "bfloat16", "lora": {"r": 8}},
}
SHAPE_100M = {"layers": 12, "hidden": 768, "intermediate": 3072, "heads": 12}
GPU_BYTES = 80e9
FSDP_RANKS = 8
LORA_R = 8  # MODES' LoRA rank, on every linear layer of the decoder ("all-linear": the head excluded)
# The fits table's target shapes: the Qwen2.5 family's published configs (q/k/v with biases, o_proj without).
QWEN25: dict[str, dict[str, Any]] = {
    name: {
        "hidden": hidden, "intermediate": intermediate, "layers": layers, "heads": heads, "kv_heads": kv_heads,
        "vocab": vocab, "tied": tied, "attention_bias": True,
    }
    for name, hidden, intermediate, layers, heads, kv_heads, vocab, tied in (
        ("Qwen2.5-0.5B", 896, 4864, 24, 14, 2, 151936, True),
        ("Qwen2.5-1.5B", 1536, 8960, 28, 12, 2, 151936, True),
        ("Qwen2.5-3B", 2048, 11008, 36, 16, 2, 151936, True),
        ("Qwen2.5-7B", 3584, 18944, 28, 28, 4, 152064, False),
        ("Qwen2.5-14B", 5120, 13824, 48, 40, 8, 152064, False),
        ("Qwen2.5-32B", 5120, 27648, 64, 40, 8, 152064, False),
        ("Qwen2.5-72B", 8192, 29568, 80, 64, 8, 152064, False),
    )
}  # fmt: skip
SYNC_EVERY, ROUNDS = 2, 2
PASSES = ("forward", "backward")
CHECKPOINTING = {"both": (False, True), "off": (False,), "on": (True,)}
# The activation split's figures the fits table scales.
FIXED = "activation_bytes_per_token_fixed_per_vocab"
PER_LAYER = "activation_bytes_per_token_per_layer_per_hidden"


def build_model(out: Path, shape: dict[str, int]) -> Path:
    from composer_serverless.config import TinyModelConfig
    from composer_serverless.data.corpus import stdlib_corpus, training_text
    from composer_serverless.models.loading import build_tiny

    config = TinyModelConfig(
        hidden_size=shape["hidden"],
        intermediate_size=shape["intermediate"],
        num_layers=shape["layers"],
        num_heads=shape["heads"],
    )
    return build_tiny(config, training_text(stdlib_corpus(5.0), 4_000_000, seed=0), out, seed=0)


def deeper_model(model_dir: Path, layers: int, out: Path) -> Path:
    """A copy of ``model_dir``'s model and tokenizer with ``layers`` decoder layers: its config with only the
    depth changed, random weights (seed 0). The activation split's second depth."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(str(model_dir))
    config.num_hidden_layers = layers
    # Per-layer attention kinds, where a model has them.
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = (config.layer_types * layers)[:layers]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(str(model_dir)).save_pretrained(out)
    return out


# --- one measurement, in a process of its own ------------------------------------------------------------


def measure(
    model_dirs: list[Path],
    mode: dict[str, Any],
    checkpointing: bool,
    batch_sizes: list[int],
    seq_len: int,
    store: str,
) -> list[list[dict[str, Any]]]:
    """One replica per model and batch size, one after the other in this process, each for two rounds, on CUDA
    if torch sees it, else on the simulated accelerator: round 2's device peaks (inner step by phase, sync)
    and the host memory held at its sync, in bytes; a list of runs per model."""
    import torch

    from composer_serverless.accelerator.simulated import simulated

    measured: list[list[dict[str, Any]]] = []
    for model_dir in model_dirs:
        rows: list[dict[str, Any]] = []
        for batch_size in batch_sizes:
            where = f"{store}/{len(measured)}-{len(rows)}"
            if torch.cuda.is_available():
                torch.empty(1, device="cuda")  # CUDA's context (host memory too) exists before the baseline
                rows.append(_measure(model_dir, mode, checkpointing, batch_size, seq_len, where, None))
            else:
                with simulated() as sim:
                    rows.append(_measure(model_dir, mode, checkpointing, batch_size, seq_len, where, sim))
            rows[-1]["warm"] = bool(measured or len(rows) > 1)  # not the process's first replica
            gc.collect()
            if (
                torch.cuda.is_available()
            ):  # what the allocators cached goes back, device and pinned host memory
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
                getattr(torch._C, "_host_emptyCache", lambda: None)()
        measured.append(rows)
    return measured


def _measure(
    model_dir: Path,
    mode: dict[str, Any],
    checkpointing: bool,
    batch_size: int,
    seq_len: int,
    store: str,
    sim: Any,
) -> dict[str, Any]:
    import torch

    from composer_serverless.accelerator.device import replica_device
    from composer_serverless.config import validate_config
    from composer_serverless.models.loading import load_model
    from composer_serverless.rendezvous.store import ObjectStore
    from composer_serverless.rendezvous.telemetry import Reporter
    from composer_serverless.replicas.trainer import Replica

    config = validate_config(
        {
            "run_id": "memory",
            "store": store,
            "model": {"path": str(model_dir), "gradient_checkpointing": checkpointing, **mode},
            "data": {"seq_len": seq_len, "batch_size": batch_size},
            "train": {"objective": "lm"},
            "diloco": {"replicas": 1, "sync_every": SYNC_EVERY, "rounds": ROUNDS},
            "eval": {"sequences": 2},
        }
    )
    run = ObjectStore(store).child("memory")
    run.put("run.json", config.resolved_json().encode())
    device = replica_device()
    assert device.type == "cuda", device
    # What the libraries would import lazily while loading and training is imported before the baseline:
    # the host figure is to count what the replica holds, not the libraries' code.
    for module in (
        "transformers.models.llama.modeling_llama",
        "peft",
        "torchft.local_sgd",
        "safetensors.torch",
    ):
        importlib.import_module(module)
    # Garbage held in reference cycles is freed now, not in a window, where it would lower the peaks.
    gc.collect()
    device_baseline = torch.cuda.memory_allocated(device)
    host_baseline = rss_bytes()
    loaded = load_model(config.model, model_dir)
    model = loaded.model.to(device).train()
    params = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    peaks: dict[str, int] = {}

    def device_peak() -> int:
        return torch.cuda.max_memory_allocated(device) - device_baseline

    def sync_started() -> None:
        torch.cuda.reset_peak_memory_stats(device)
        reset_hwm()

    def sync_ended() -> None:
        on_device = device_peak()
        peaks["sync"] = on_device  # the last sync's: round ROUNDS'
        resident = hwm_bytes() - host_baseline
        peaks["host"] = resident - (on_device if sim is not None else 0)

    def lap(phase: str) -> None:  # the device peak since the last lap is ``phase``'s
        peaks[phase] = max(peaks.get(phase, 0), device_peak())
        torch.cuda.reset_peak_memory_stats(device)

    backward = torch.Tensor.backward

    def timed_backward(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        lap("forward")
        backward(tensor, *args, **kwargs)
        lap("backward")

    class Measured(Replica):
        def _inner_step(self) -> torch.Tensor:
            step = self.meter.steps + 1  # of this round
            if self.completed_rounds == 0 and step == 1:
                _watch_syncs(self.inner, sync_started, sync_ended)
            if not (self.completed_rounds == ROUNDS - 1 and step == 1):
                return super()._inner_step()
            # Round 2's first step: forward (each micro-batch's, if the objective makes several), backward
            # (and the gradients' clipping), optimizer step.
            syncs = self.manager.syncs_attempted
            handle = self.inner.register_step_pre_hook(lambda *args: lap("backward"))
            torch.Tensor.backward = timed_backward  # type: ignore[method-assign]
            peaks["between_steps"] = torch.cuda.memory_allocated(device) - device_baseline
            torch.cuda.reset_peak_memory_stats(device)
            try:
                loss = super()._inner_step()
            finally:
                torch.Tensor.backward = backward  # type: ignore[method-assign]
                handle.remove()
            lap("optimizer")
            assert self.manager.syncs_attempted == syncs, "the measured inner step synced"
            return loss

    Measured(run, config, 0, Reporter(run, 0), model, loaded.tokenizer, adapters=loaded.adapters).run()
    missing = {"between_steps", "forward", "backward", "optimizer", "sync", "host"} - peaks.keys()
    assert not missing, f"not measured: {sorted(missing)}"
    return {
        "gradient_checkpointing": checkpointing,
        "params": params,
        "trainable_params": trainable,
        "batch_size": batch_size,
        "tokens": batch_size * seq_len,
        "device_between_steps_bytes": peaks["between_steps"],
        "device_peak_forward_bytes": peaks["forward"],
        "device_peak_backward_bytes": peaks["backward"],
        "device_peak_optimizer_bytes": peaks["optimizer"],
        "device_peak_sync_bytes": peaks["sync"],
        "host_bytes_sync": peaks["host"],
    }


def _watch_syncs(inner: Any, started: Callable[[], None], ended: Callable[[], None]) -> None:
    """Call ``started`` before each fragment's ``prepare_sync`` and ``ended`` after its ``perform_sync``.

    The fragments are found at run time, on the DiLoCo whose post-hook is registered on ``inner`` (its
    ``_fragments``), and wrapped on the instance: whatever class DiLoCo gave them, a subclass that
    overrides the two methods included, its own methods run inside the window."""
    owners = [getattr(hook, "__self__", None) for hook in inner._optimizer_step_post_hooks.values()]
    dilocos = [owner for owner in owners if hasattr(owner, "_fragments")]
    if len(dilocos) != 1:
        raise RuntimeError(f"expected one DiLoCo hooked on the inner optimizer, found {len(dilocos)}")
    for fragment in dilocos[0]._fragments:
        prepare, perform = fragment.prepare_sync, fragment.perform_sync

        def prepare_sync(prepare: Callable[[], None] = prepare) -> None:
            started()
            prepare()

        def perform_sync(perform: Callable[[], bool] = perform) -> bool:
            committed = perform()
            ended()
            return committed

        fragment.prepare_sync, fragment.perform_sync = prepare_sync, perform_sync


# --- the parent: the runs, the fit, the table -------------------------------------------------------------


def fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares ``y = intercept + slope * x`` through ``points`` (x, y); at least two distinct x."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx == 0:
        raise ValueError("the fit needs at least two different token counts")
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx
    return my - slope * mx, slope


def pass_slopes(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Bytes per token of each pass: the least-squares slope over the runs' tokens of its peak."""
    return {
        phase: fit_line([(r["tokens"], r[f"device_peak_{phase}_bytes"]) for r in runs])[1] for phase in PASSES
    }


def activation_slope(runs: list[dict[str, Any]]) -> float:
    """Bytes per token: the larger of the forward's slope and the backward's."""
    return max(pass_slopes(runs).values())


def summarise(mode: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One row from a mode's runs at several batch sizes: per-parameter figures and the activation fit.

    ``activation_bytes_per_token`` is the larger slope over tokens (least squares) of the forward's peak
    (what it keeps for the backward) and the backward's (that and the backward's own transients). The state
    is the least that bounds every measured phase peak with it: the optimizer step's peak (no activations
    left), and each forward's and backward's peak less the activations of its tokens."""
    first = runs[0]
    params = first["params"]
    per_token = activation_slope(runs)
    optimizer = max(r["device_peak_optimizer_bytes"] for r in runs)
    state = max(
        optimizer,
        *(r[f"device_peak_{phase}_bytes"] - per_token * r["tokens"] for r in runs for phase in PASSES),
    )
    largest = max(runs, key=lambda r: r["tokens"])
    inner = max(largest[f"device_peak_{phase}_bytes"] for phase in (*PASSES, "optimizer"))
    return {
        "mode": mode,
        "gradient_checkpointing": first["gradient_checkpointing"],
        "params": params,
        "trainable_params": first["trainable_params"],
        "tokens_per_step": largest["tokens"],
        "device_bytes_per_param_between_steps": round(largest["device_between_steps_bytes"] / params, 3),
        "device_bytes_per_param_inner": round(inner / params, 3),
        "device_bytes_per_param_sync": round(max(r["device_peak_sync_bytes"] for r in runs) / params, 3),
        "device_state_bytes_per_param": round(state / params, 3),
        "device_optimizer_step_bytes_per_param": round(optimizer / params, 3),
        "activation_bytes_per_token": round(per_token, 1),
        # A process's first replica also pays the libraries' one-time costs (lazy imports, caches, thread
        # arenas): the host figure is the later replicas'.
        "host_bytes_per_param": round(max(r["host_bytes_sync"] for r in runs if r["warm"]) / params, 3),
        "runs": [
            {k: v for k, v in r.items() if k not in ("gradient_checkpointing", "params", "trainable_params")}
            for r in runs
        ],
    }


def split_activations(slopes_at: dict[int, dict[str, float]], hidden: int, vocab: int) -> dict[str, float]:
    """``a(L) = fixed + L * per_layer`` from each pass's bytes per token at two depths (``slopes_at``: layers
    -> pass -> bytes per token, unrounded). ``per_layer`` is the larger of the passes' growth per layer, so a
    layer's share is seen in whichever pass shows it: with checkpointing the backward's peak comes at its
    end, when the checkpointed layers' inputs are gone (and the gradients all made), and only the forward's
    shows them. ``fixed`` is ``a`` at the shallower depth less its layers' part; ``a`` at the deeper one is
    then at most ``fixed + L * per_layer``. Each part normalised: the per-layer one by the hidden width (a
    decoder layer's activations grow about linearly with it at a fixed MLP ratio), the fixed one by the
    vocabulary (mostly the head's logits and the loss)."""
    (few, at_few), (many, at_many) = sorted(slopes_at.items())
    per_layer = max((at_many[phase] - at_few[phase]) / (many - few) for phase in PASSES)
    fixed = max(at_few.values()) - few * per_layer
    return {
        "activation_bytes_per_token_per_layer": round(per_layer, 1),
        "activation_bytes_per_token_fixed": round(fixed, 1),
        "activation_bytes_per_token_per_layer_per_hidden": round(per_layer / hidden, 4),
        "activation_bytes_per_token_fixed_per_vocab": round(fixed / vocab, 4),
    }


# --- the fits table: target shapes from their configs -----------------------------------------------------


def shape_params(shape: dict[str, Any]) -> int:
    """Parameters of a Llama/Qwen2-style decoder from its config: the embedding, per layer q/k/v (with biases
    where ``attention_bias``), o_proj, the MLP's gate, up and down projections and two RMSNorms, the final
    norm, and the head unless tied to the embedding."""
    hidden, intermediate, vocab = shape["hidden"], shape["intermediate"], shape["vocab"]
    kv = shape["kv_heads"] * (hidden // shape["heads"])  # the keys' (and values') width
    bias = 1 if shape["attention_bias"] else 0
    attention = (hidden * hidden + bias * hidden) + 2 * (hidden * kv + bias * kv) + hidden * hidden
    layer = attention + 3 * hidden * intermediate + 2 * hidden
    return vocab * hidden * (1 if shape["tied"] else 2) + shape["layers"] * layer + hidden


def lora_params(shape: dict[str, Any], r: int) -> int:
    """LoRA adapters of rank ``r`` on every linear layer of the decoder (q, k, v, o, gate, up, down; not the
    head): ``r * (inputs + outputs)`` each."""
    hidden, intermediate = shape["hidden"], shape["intermediate"]
    kv = shape["kv_heads"] * (hidden // shape["heads"])
    widths = [(hidden, hidden), (hidden, kv), (hidden, kv), (hidden, hidden)] + 3 * [(hidden, intermediate)]
    return shape["layers"] * sum(r * (fan_in + fan_out) for fan_in, fan_out in widths)


def mlp_factor(shape: dict[str, Any], measured: dict[str, Any]) -> float:
    """How much more a layer's activations may grow than its hidden width: the target's MLP ratio over the
    measured one, at least 1 (each activation of a layer is taken to scale with the hidden width or with
    the MLP's, so the larger of the two widths' ratios bounds it)."""
    ratio = shape["intermediate"] / shape["hidden"]
    return max(1.0, ratio / (measured["intermediate"] / measured["hidden"]))


def shape_activation(
    row: dict[str, Any],
    shape: dict[str, Any],
    measured: dict[str, Any],
    unchecked: dict[str, Any] | None = None,
) -> float:
    """Activation bytes per token of ``shape`` in ``row``'s mode. Without checkpointing (``unchecked`` None):
    the fixed part per vocabulary entry times the shape's vocabulary, plus per layer the part per hidden unit
    times its width and MLP factor. With it, ``unchecked`` being the same mode's row without: the head's and
    the loss's part from ``unchecked`` (checkpointing wraps the decoder layers only), plus what a
    checkpointed layer keeps (``row``'s per-layer part, its input) for each layer and once more, plus one
    layer as ``unchecked`` keeps it: the layer the backward recomputes, from its input's copy."""
    scale = shape["hidden"] * mlp_factor(shape, measured)
    if unchecked is None:
        return row[FIXED] * shape["vocab"] + shape["layers"] * row[PER_LAYER] * scale
    layers = (shape["layers"] + 1) * row[PER_LAYER] + unchecked[PER_LAYER]
    return unchecked[FIXED] * shape["vocab"] + layers * scale


SETUPS = (("1 x 80 GB", 1), (f"{FSDP_RANKS} x 80 GB, FSDP", FSDP_RANKS))


def fits_table(results: list[dict[str, Any]], measured: dict[str, Any], budgets: list[int]) -> dict[str, Any]:
    """For each token budget, setup, measured row and Qwen2.5 shape: whether the replica fits one GPU's bytes,
    and per (budget, setup, row) the largest shape that does; and, at the measured shape and both depths, each
    row's measured bytes per token next to what the activation model gives there."""
    shapes = [
        {
            "name": name,
            **shape,
            "params": shape_params(shape),
            "lora_adapter_params": lora_params(shape, LORA_R),
        }
        for name, shape in QWEN25.items()
    ]
    unchecked_rows = {row["mode"]: row for row in results if not row["gradient_checkpointing"]}

    def unchecked(row: dict[str, Any]) -> dict[str, Any] | None:
        return unchecked_rows.get(row["mode"]) if row["gradient_checkpointing"] else None

    check = []
    for row in results:
        for layers, measured_bytes in row["activation_bytes_per_token_by_layers"].items():
            at = {**measured, "layers": int(layers)}
            modelled = round(shape_activation(row, at, measured, unchecked(row)), 1)
            check.append(
                {
                    "mode": row["mode"],
                    "gradient_checkpointing": row["gradient_checkpointing"],
                    "layers": int(layers),
                    "measured": measured_bytes,
                    "modelled": modelled,
                    "bounds": modelled >= measured_bytes - 0.5,  # within the figures' rounding
                }
            )
    rows, largest = [], []
    for tokens in budgets:
        for setup, ranks in SETUPS:
            for row in results:
                best: dict[str, Any] | None = None
                for shape in shapes:
                    counted = shape["params"]
                    if "lora" in MODES[row["mode"]]:  # measured over the base and its adapters together
                        counted += shape["lora_adapter_params"]
                    per_token = shape_activation(row, shape, measured, unchecked(row))
                    inner = row["device_state_bytes_per_param"] * counted / ranks + per_token * tokens
                    sync = row["device_bytes_per_param_sync"] * counted / ranks
                    fits = inner <= GPU_BYTES and sync <= GPU_BYTES
                    rows.append(
                        {
                            "tokens_per_rank": tokens,
                            "setup": setup,
                            "mode": row["mode"],
                            "gradient_checkpointing": row["gradient_checkpointing"],
                            "shape": shape["name"],
                            "params": counted,
                            "activation_bytes_per_token": round(per_token),
                            "inner_bytes": round(inner),
                            "sync_bytes": round(sync),
                            "fits": fits,
                        }
                    )
                    if fits and (best is None or counted > best["params"]):
                        best = rows[-1]
                largest.append(
                    {
                        "tokens_per_rank": tokens,
                        "setup": setup,
                        "mode": row["mode"],
                        "gradient_checkpointing": row["gradient_checkpointing"],
                        "shape": best["shape"] if best else None,
                        "params": best["params"] if best else 0,
                    }
                )
    return {
        "assumptions": {
            "gpu_bytes": GPU_BYTES,
            "fsdp_ranks": FSDP_RANKS,
            "tokens_per_rank": budgets,
            "tokens_per_rank_note": "tokens of one micro-batch on one rank (train.micro_batch_size rows of "
            "seq_len tokens): 8 x 2048 and 1 x 2048 by default",
            "rule": "a shape fits when inner = state * N / ranks + activation * tokens <= gpu_bytes and "
            "sync = sync_per_param * N / ranks <= gpu_bytes, with state = device_state_bytes_per_param and "
            "sync_per_param = device_bytes_per_param_sync of the measured row; each rank holds its share of "
            "the state and all of its own micro-batch's activations, which are freed before the sync (the "
            "measured sync peak holds none). Computed from the rounded figures reported under results",
            "params": "N from each shape's config: embedding, per layer q/k/v with biases (Qwen2), o_proj, "
            "gate/up/down and two RMSNorms, the final norm, the head when untied (equal to the meta-device "
            "count of transformers' Qwen2ForCausalLM)",
            "lora": f"r={LORA_R} adapters on q, k, v, o, gate, up and down of every layer, r * (in + out) "
            "each. The LoRA rows' per-parameter figures were measured over the model's parameters with its "
            "adapters (bf16 base plus float32 adapters, their gradients and AdamW moments), so N there is the "
            "shape's base plus its adapters. The adapters are a smaller share of N at these widths than at "
            "the measured one, so the measured blend overstates their state somewhat",
            "activations": "without checkpointing, activation(shape) = fixed_per_vocab * vocab + layers * "
            "per_layer_per_hidden * hidden * mlp_factor; with it, fixed_per_vocab * vocab of the same mode's "
            "row without checkpointing (checkpointing wraps the decoder layers, not the head and the loss) + "
            "((layers + 1) * per_layer_per_hidden of the checkpointed row (each layer's input it keeps, and "
            "the recomputed layer's copy of its own) + per_layer_per_hidden of the row without (the layer the "
            "backward recomputes)) * hidden * mlp_factor; mlp_factor = max(1, (intermediate / hidden) / "
            "(measured intermediate / measured hidden)). The figures are results' "
            "activation_bytes_per_token_fixed_per_vocab and _per_layer_per_hidden, from each row's bytes per "
            "token measured at two depths of one width (a(L) = fixed + L * per_layer, per_layer the larger of "
            "the forward's and the backward's growth per layer). Assumed: a layer's activations grow linearly "
            "with its widths (the hidden one and the MLP's: the larger of the two ratios bounds them; "
            "grouped-query attention's narrower keys and values and the targets' fewer heads per width only "
            "lower them); the fixed part (the head's logits and their float32 copies, the loss's log-softmax "
            "and the logits' gradients, which the backward holds with the retained logits) grows with the "
            "vocabulary, which overstates its small hidden-sized share (the embedding's output, the final "
            "norm). With checkpointing the sum bounds the backward's peak, where the head's transients, the "
            "layers' inputs and the recomputed layer need not all coincide: activation_check compares the "
            "model with the measurement at the measured shape. A checkpointed row whose mode was not measured "
            "without checkpointing (--checkpointing on) uses its own split instead, its fixed part (the "
            "recomputed layer included) scaled by the vocabulary: an overstatement",
            "caveats": "Extrapolated from a "
            f"{measured['layers']}-layer, {measured['hidden']}-wide model with a {measured['vocab']}-entry "
            "vocabulary (a Llama; the targets are Qwen2) by the linear scaling above; no target shape was "
            "run. Attention: PyTorch's SDPA, which on this CPU dispatched to its flash-attention kernel "
            "(it keeps the output and log-sum-exp, not the sequence x sequence scores, so the bytes per token "
            "do not grow with the sequence's length); on a GPU SDPA's flash, memory-efficient or cuDNN kernels "
            "keep as little, eager attention would keep the scores (O(seq_len) bytes per token) and is not "
            "covered. The CPU's kernels may keep other intermediates than CUDA's. state + activations bounds "
            "the inner step's peak from above by up to the gradients' bytes. Under FSDP the layer being "
            "gathered, the gradients' reduce-scatter buffers and the exchange's buffers are not counted. "
            "Allocated bytes: an allocator's cache and fragmentation are not counted, nor CUDA's context and "
            "kernels (about 0.5-1 GB per GPU)",
        },
        "shapes": shapes,
        "activation_check": check,
        "largest": largest,
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers")
    parser.add_argument("--hidden", type=int, default=768, help="width of the residual stream")
    parser.add_argument("--intermediate", type=int, default=3072, help="width of the MLP")
    parser.add_argument("--heads", type=int, default=12, help="attention heads")
    parser.add_argument(
        "--shape-100m", action="store_true", help="12 x 768, MLP 3072, 12 heads: about 115M parameters"
    )
    parser.add_argument(
        "--model", type=Path, help="a saved Llama (save_pretrained directory) instead of building one: the shape "
        "flags are then ignored"
    )  # fmt: skip
    parser.add_argument(
        "--deeper-layers", type=int, help="the activation split's second depth (default: twice the model's)"
    )
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument(
        "--batch-sizes", default="1,2", help="comma-separated, at least two: the activation fit's points"
    )
    parser.add_argument("--checkpointing", choices=sorted(CHECKPOINTING), default="both")
    parser.add_argument(
        "--fit-tokens",
        type=int,
        default=8 * 2048,
        help="tokens per micro-batch per rank assumed by the fits table (8 x 2048)",
    )
    parser.add_argument(
        "--fit-tokens-small",
        type=int,
        default=2048,
        help="the fits table's second, smaller budget (1 x 2048: a micro-batch of one sequence)",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:  # one measurement, in this fresh process
        import torch

        torch.set_num_threads(os.cpu_count() or 1)
        spec = json.loads(args.child)
        rows = measure(
            [Path(m) for m in spec["models"]], spec["mode"], spec["checkpointing"], spec["batch_sizes"],
            spec["seq_len"],
            spec["store"],
        )  # fmt: skip
        print(json.dumps(rows))
        return 0
    if not Path("/proc/self/clear_refs").exists():
        parser.error("this benchmark reads /proc (Linux)")
    batch_sizes = sorted({int(b) for b in args.batch_sizes.split(",")})
    if len(batch_sizes) < 2:
        parser.error("--batch-sizes needs at least two different sizes (the activation fit)")
    budgets = list(dict.fromkeys((args.fit_tokens, args.fit_tokens_small)))
    import torch

    device = (
        f"cuda: {torch.cuda.get_device_name(0)}"
        if torch.cuda.is_available()
        else "simulated accelerator on CPU"
    )
    started = time.monotonic()
    results = []
    with tempfile.TemporaryDirectory(prefix="replica-memory-") as scratch:
        if args.model is not None:
            model_dir = args.model
        else:
            shape = SHAPE_100M if args.shape_100m else {
                "layers": args.layers, "hidden": args.hidden, "intermediate": args.intermediate, "heads": args.heads
            }  # fmt: skip
            model_dir = build_model(Path(scratch) / "model", shape)
        hf = json.loads((model_dir / "config.json").read_text())
        shape = {
            "layers": hf["num_hidden_layers"],
            "hidden": hf["hidden_size"],
            "intermediate": hf["intermediate_size"],
            "heads": hf["num_attention_heads"],
            "vocab": hf["vocab_size"],
        }
        deeper_layers = args.deeper_layers or 2 * shape["layers"]
        if deeper_layers == shape["layers"]:
            parser.error("--deeper-layers must differ from the model's depth (the activation split)")
        deeper_dir = deeper_model(model_dir, deeper_layers, Path(scratch) / "deeper")
        for name, mode in MODES.items():
            for checkpointing in CHECKPOINTING[args.checkpointing]:
                spec = {
                    "models": [str(model_dir), str(deeper_dir)],
                    "mode": mode,
                    "checkpointing": checkpointing,
                    "batch_sizes": batch_sizes,
                    "seq_len": args.seq_len,
                    "store": str(Path(scratch) / f"store-{len(results)}"),
                }
                measured = dict(
                    zip((shape["layers"], deeper_layers), _child(name, spec, args.out), strict=True)
                )
                row = summarise(name, measured[shape["layers"]])
                deeper = summarise(name, measured[deeper_layers])
                row["activation_bytes_per_token_by_layers"] = {
                    str(layers): round(activation_slope(runs), 1) for layers, runs in sorted(measured.items())
                }
                row.update(
                    split_activations(
                        {layers: pass_slopes(runs) for layers, runs in measured.items()},
                        shape["hidden"],
                        shape["vocab"],
                    )
                )
                row["deeper"] = {
                    "layers": deeper_layers,
                    **{k: v for k, v in deeper.items() if k not in ("mode", "gradient_checkpointing")},
                }
                results.append(row)
                print(
                    f"{name:28s} checkpointing={checkpointing!s:5s} device bytes/param: "
                    f"inner {row['device_bytes_per_param_inner']:6.2f} state {row['device_state_bytes_per_param']:6.2f} "
                    f"sync {row['device_bytes_per_param_sync']:6.2f}; host {row['host_bytes_per_param']:6.2f}; "
                    f"activations {row['activation_bytes_per_token'] / 1024:6.1f} KiB/token = "
                    f"{row['activation_bytes_per_token_fixed'] / 1024:6.1f} + layers x "
                    f"{row['activation_bytes_per_token_per_layer'] / 1024:6.1f}",
                    flush=True,
                )  # fmt: skip
    fits = fits_table(results, shape, budgets)
    report = {
        "command": " ".join(
            ["python", "benchmarks/replica_memory.py", *(sys.argv[1:] if argv is None else argv)]
        ),
        "machine": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
        },
        "device": device,
        "shape": shape,
        "setup": {
            "replicas": 1,
            "sync_every": SYNC_EVERY,
            "rounds": ROUNDS,
            "measured_round": ROUNDS,
            "objective": "lm",
            "seq_len": args.seq_len,
            "batch_sizes": batch_sizes,
            "activation_layers": [shape["layers"], deeper_layers],
        },
        "results": results,
        "fits": fits,
        "wall_s": round(time.monotonic() - started, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    for best in fits["largest"]:
        ckpt = " + checkpointing" if best["gradient_checkpointing"] else ""
        print(
            f"{best['tokens_per_rank']:6d} tokens/rank {best['setup']:16s} {best['mode'] + ckpt:45s} "
            f"largest: {best['shape'] or 'none'}"
        )
    return 0


def _child(name: str, spec: dict[str, Any], out: Path) -> list[list[dict[str, Any]]]:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(64 * 1024)}
    done = subprocess.run(
        [sys.executable, __file__, "--out", str(out), "--child", json.dumps(spec)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if done.returncode:
        raise RuntimeError(f"{name} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    sys.exit(main())
