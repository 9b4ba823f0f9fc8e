"""Runs on the accelerator's path: the same run launched on the CPU and on the simulated accelerator
(``accelerator/simulated.py``) ends bit for bit alike.

The simulation changes where tensors live, not what kernels compute, so any difference is a device bug: a
mixed-device operand (round 1's crash on an H100), a host buffer read while a copy into it is in flight, an
operation that moves data where the CPU path does not. LoRA, FSDP ranks, kill and resume, and export run on
the simulated accelerator in their own test modules; the Modal and HF Jobs fakes run every GPU replica there.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console
from safetensors.torch import load_file

from composer_serverless.config import validate_config
from composer_serverless.launch.launcher import launch
from composer_serverless.rendezvous.store import ObjectStore
from composer_serverless.rendezvous.telemetry import read_metrics
from tests.composer_tasks import TINY_CHARS, composer
from tests.conftest import ran_on_the_simulated_accelerator, replicas_on_the_simulated_accelerator

pytestmark = pytest.mark.slow


def _both(tmp_path: Path, raw: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Launch ``raw`` on the CPU and on the simulated accelerator: per place, its summary, final tensors and
    per-round global digests."""
    out = {}
    for place in ("cpu", "accelerator"):
        config = validate_config({**raw, "run_id": place, "store": str(tmp_path)})
        if place == "cpu":
            summary = launch(config, place, Console(file=io.StringIO()))
        else:
            with replicas_on_the_simulated_accelerator():
                summary = launch(config, place, Console(file=io.StringIO()))
        run = ObjectStore(str(tmp_path / place))
        assert summary["rounds_committed"] == raw["diloco"]["rounds"] and summary["replicas_bit_identical"]
        metrics = read_metrics(run)[0]
        digests = {
            row["round"]: row["global_sha256"]
            for row in metrics
            if "global_sha256" in row and "caught_up_from" not in row
        }
        rows = [r for r in metrics if r["round"] > 0 and "train" in r]
        assert rows and all(
            r["time_s"].keys() == {"generate", "forward_backward", "optimizer", "sync"} for r in rows
        )
        # The device's peak memory per round and per step: counted on the (simulated) accelerator, none on
        # the CPU; every step's gradient norm read from the device with the round's figures.
        assert all((r["device_peak_bytes"] or 0) > 0 for r in rows) == (place == "accelerator"), rows
        steps = [s for r in rows for s in r["step_rows"]]
        assert len(steps) == sum(r["steps"] for r in rows) and all(s["grad_norm"] > 0 for s in steps)
        assert all((s["device_peak_bytes"] or 0) > 0 for s in steps) == (place == "accelerator")
        assert all(
            max(s["device_peak_bytes"] or 0 for s in r["step_rows"]) == (r["device_peak_bytes"] or 0)
            for r in rows
        )
        out[place] = {
            "summary": summary,
            "final": load_file(tmp_path / place / "final" / "model.safetensors"),
            "digests": digests,
            "logs": tmp_path / place / "logs",
        }
    assert ran_on_the_simulated_accelerator(out["accelerator"]["logs"])
    assert not ran_on_the_simulated_accelerator(out["cpu"]["logs"])
    return out


def _alike(runs: dict[str, dict[str, Any]]) -> None:
    cpu, accelerator = runs["cpu"], runs["accelerator"]
    assert cpu["digests"] and cpu["digests"] == accelerator["digests"]
    assert cpu["final"].keys() == accelerator["final"].keys()
    assert all(torch.equal(cpu["final"][k], accelerator["final"][k]) for k in cpu["final"])
    assert cpu["summary"]["final_eval_loss"] == accelerator["summary"]["final_eval_loss"]


def test_lm_with_fragments_overlap_and_checkpoints_ends_where_the_cpu_run_does(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    runs = _both(
        tmp_path,
        {
            "model": {"path": str(tiny_model_dir)},
            "data": {"seq_len": 16, "batch_size": 2},
            "train": {"lr": 1e-2, "warmup_steps": 2, "schedule": "cosine"},
            "diloco": {
                "replicas": 2,
                "min_replicas": 2,  # every round averages both, however late one is: the runs compare exactly
                "sync_every": 4,
                "rounds": 3,
                "fragments": 2,
                "fragment_sync_delay": 1,
                "fragment_update_alpha": 0.5,
                "checkpoint_every": 1,
            },
            "eval": {"sequences": 4},
            "executor": {"threads_per_replica": 1},
        },
    )
    _alike(runs)


def test_composer_in_bf16_over_float32_masters_ends_where_the_cpu_run_does(tmp_path: Path) -> None:
    """All three channels (rollouts sampled on the device, rewards on the host, SDPO hints, DPO pairs), bf16
    compute over float32 masters. Both runs sample with the paged engine, ``auto``'s choice on a GPU, so the
    device's rollouts are held to the same engine's on the CPU."""
    settings = composer(group_size=4, prompts_per_step=2, max_new_tokens=4, pairs_per_step=2)
    settings["rollout"]["engine"] = "paged"
    runs = _both(
        tmp_path,
        {
            "model": {
                "dtype": "bfloat16",
                "tiny": TINY_CHARS,
            },
            "train": {"objective": "composer", "lr": 1e-3},
            "diloco": {"replicas": 2, "min_replicas": 2, "sync_every": 2, "rounds": 2},
            "eval": {"sequences": 7},
            "composer": settings,
            "executor": {"threads_per_replica": 1},
        },
    )
    _alike(runs)
    final = runs["accelerator"]["final"]
    assert {t.dtype for t in final.values()} == {torch.float32}  # the masters are what is exported
