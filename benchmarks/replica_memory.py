"""Peak memory of a replica per model parameter, at the step that syncs: full fp32, bf16 compute over float32
masters, and LoRA, each with and without gradient checkpointing.

    python benchmarks/replica_memory.py --out bench-out/replica_memory.json [--layers 12]

The model is a Llama of about 100M parameters (12 x 768, MLP 3072, the demo's BPE vocabulary) built from its
config with random weights and loaded as a published checkpoint. Each mode runs in a fresh process: one replica
(the real ``Replica``, its torchft DiLoCo, optimizers and store exchange) trains one round of H = 2 inner steps
on the demo corpus, 2 sequences of 128 tokens a step. The measured window is the second inner step, the one
whose optimizer step runs the sync: forward, backward, the inner update, the pseudo-gradient, its exchange
and the outer step. ``peak_bytes`` is the process's peak resident memory in that window (VmHWM, reset just
before it through /proc/self/clear_refs) minus its resident memory before the model was loaded; glibc serves
every allocation above 64 KiB with mmap, so freed tensors leave the resident set at once. Linux only (it reads
/proc); CPU, where a replica's memory is all one kind. On a GPU, torchft keeps its global copy in (pinned) host
memory, so the device holds about 4 bytes per trainable parameter less than measured here.

Writes JSON: ``results`` (one row per mode: mode, gradient_checkpointing, params, trainable_params,
peak_bytes, bytes_per_param) and ``fits_80gb`` (the largest model whose replica fits one 80 GB accelerator,
derived from the measured bytes per parameter, nothing else).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from process_memory import hwm_bytes, reset_hwm, rss_bytes

MODES: dict[str, dict[str, Any]] = {
    "full fp32": {},
    "bf16 compute, fp32 masters": {"dtype": "bfloat16"},
    "LoRA r=8, bf16 base": {"dtype": "bfloat16", "lora": {"r": 8}},
}
GPU_BYTES = 80e9


def build_model(out: Path, layers: int) -> Path:
    from composer_serverless.config import TinyModelConfig
    from composer_serverless.data.corpus import stdlib_corpus, training_text
    from composer_serverless.models import build_tiny

    shape = TinyModelConfig(hidden_size=768, intermediate_size=3072, num_layers=layers, num_heads=12)
    return build_tiny(shape, training_text(stdlib_corpus(5.0), 4_000_000, seed=0), out, seed=0)


def measure(model_dir: Path, mode: dict[str, Any], checkpointing: bool, store: str) -> dict[str, Any]:
    """One replica, one round; the peak of its syncing step (runs in a process of its own)."""
    import torch

    from composer_serverless.config import validate_config
    from composer_serverless.models import load_model
    from composer_serverless.rendezvous.store import ObjectStore
    from composer_serverless.rendezvous.telemetry import Reporter
    from composer_serverless.replicas.trainer import Replica

    config = validate_config(
        {
            "run_id": "memory",
            "store": store,
            "model": {"path": str(model_dir), "gradient_checkpointing": checkpointing, **mode},
            "data": {"seq_len": 128, "batch_size": 2},
            "diloco": {"replicas": 1, "sync_every": 2, "rounds": 1},
            "eval": {"sequences": 2},
        }
    )
    run = ObjectStore(store).child("memory")
    run.put("run.json", config.resolved_json().encode())
    # Garbage held in reference cycles (an earlier measurement's, or an earlier test's in a test process) is
    # freed now, not in the window, where it would lower the peak below the baseline.
    gc.collect()
    baseline = rss_bytes()
    loaded = load_model(config.model, model_dir)
    params = sum(p.numel() for p in loaded.model.parameters())
    trainable = sum(p.numel() for p in loaded.model.parameters() if p.requires_grad)
    window: dict[str, int] = {}

    class Measured(Replica):
        def _inner_step(self) -> torch.Tensor:
            syncing = self.meter.steps + 1 == config.diloco.sync_every
            if syncing:
                reset_hwm()
            loss = super()._inner_step()
            if syncing:
                window["peak"] = hwm_bytes()
            return loss

    replica = Measured(
        run, config, 0, Reporter(run, 0), loaded.model.train(), loaded.tokenizer, adapters=loaded.adapters
    )
    replica.run()
    peak = window["peak"] - baseline
    return {
        "gradient_checkpointing": checkpointing,
        "params": params,
        "trainable_params": trainable,
        "peak_bytes": peak,
        "bytes_per_param": round(peak / params, 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")
    parser.add_argument("--layers", type=int, default=12, help="decoder layers (12: about 100M parameters)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:  # one measurement, in this fresh process
        import torch

        torch.set_num_threads(os.cpu_count() or 1)
        spec = json.loads(args.child)
        print(json.dumps(measure(Path(spec["model"]), spec["mode"], spec["checkpointing"], spec["store"])))
        return 0
    if not Path("/proc/self/clear_refs").exists():
        parser.error("this benchmark reads /proc (Linux)")
    started = time.monotonic()
    results = []
    with tempfile.TemporaryDirectory(prefix="replica-memory-") as scratch:
        model_dir = build_model(Path(scratch) / "model", args.layers)
        for name, mode in MODES.items():
            for checkpointing in (False, True):
                spec = {"model": str(model_dir), "mode": mode, "checkpointing": checkpointing}
                spec["store"] = str(Path(scratch) / f"store-{len(results)}")
                env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(64 * 1024)}
                out = subprocess.run(
                    [sys.executable, __file__, "--out", str(args.out), "--child", json.dumps(spec)],
                    capture_output=True,
                    text=True,
                    env=env,
                    check=False,
                )
                if out.returncode:
                    raise RuntimeError(f"{name} failed:\n{out.stderr[-3000:]}")
                row = {"mode": name, **json.loads(out.stdout.strip().splitlines()[-1])}
                results.append(row)
                print(
                    f"{name:30s} checkpointing={checkpointing!s:5s} {row['bytes_per_param']:6.2f} bytes/param",
                    flush=True,
                )
    fits = {
        row["mode"] + (" + checkpointing" if row["gradient_checkpointing"] else ""): {
            "bytes_per_param": row["bytes_per_param"],
            "largest_params": int(GPU_BYTES / row["bytes_per_param"]),
        }
        for row in results
    }
    report = {
        "command": " ".join(
            ["python", "benchmarks/replica_memory.py", *(sys.argv[1:] if argv is None else argv)]
        ),
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
        },
        "results": results,
        "fits_80gb": fits,
        "wall_s": round(time.monotonic() - started, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    for mode, row in fits.items():
        print(f"{mode:45s} largest model on 80 GB: {row['largest_params'] / 1e9:.2f}B parameters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
