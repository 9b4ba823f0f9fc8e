"""Architecture families through the whole replica loop: 2 replicas x 2 rounds of torchft DiLoCo over a store,
under the lm and the composer objective, in float32 and in bf16. Each family is a tiny random model built from
its config and loaded as a published checkpoint. GPT-2, OPT and Bloom keep their published dropout in the
checkpoint (the run turns it off); ERNIE-4.5-MoE keeps its router in float32 when loaded in bf16, so its
replicas exchange mixed dtypes.

The two replicas run as threads of this process (``run_replica``, the worker's body): the families' code is
what is under test here, and threads spare two interpreter start-ups per run.
"""

from __future__ import annotations

import math
import threading
import time
from pathlib import Path

import pytest

from composer_serverless.config import validate_config
from composer_serverless.launch.report import summarise
from composer_serverless.rendezvous import layout
from composer_serverless.rendezvous.store import ObjectStore
from composer_serverless.replicas.trainer import run_replica
from tests.archs import FAMILIES, build
from tests.composer_tasks import composer
from tests.rendezvous.harness import create

pytestmark = pytest.mark.slow

COMPOSER = composer(group_size=2, prompts_per_step=2, max_new_tokens=3, pairs_per_step=2)


@pytest.fixture(scope="session")
def family_dir(tmp_path_factory, tiny_model_dir):
    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in built:
            built[family] = build(family, tiny_model_dir, tmp_path_factory.mktemp(family))
        return built[family]

    return get


def train(tmp_path: Path, model_dir: Path, **options) -> dict:
    """Two replicas of a fresh run, as threads; the run's summary, from the store."""
    objective = options.pop("objective", "lm")
    raw = {
        "run_id": "arch",
        "store": f"file://{tmp_path}/runs",
        "model": {"path": str(model_dir), **options},
        "data": {"seq_len": 16, "batch_size": 2},
        "train": {"objective": objective, "lr": 3e-3},
        "diloco": {"replicas": 2, "sync_every": 2, "rounds": 2, "sync_timeout_s": 120},
        "eval": {"sequences": 4},
        **({"composer": COMPOSER} if objective == "composer" else {}),
    }
    config = validate_config(raw)
    run = create(config)
    errors: list[BaseException] = []

    def replica(rank: int) -> None:
        try:
            run_replica(ObjectStore(run.url), rank)
        except BaseException as e:  # reported by the test
            errors.append(e)

    threads = [threading.Thread(target=replica, args=(rank,)) for rank in range(2)]
    threads[0].start()
    # The second replica loads after the first recorded its initial weights: both seed the one global RNG.
    deadline = time.monotonic() + 120
    while not run.exists(layout.INITIAL_WEIGHTS) and not errors and time.monotonic() < deadline:
        time.sleep(0.02)
    threads[1].start()
    for thread in threads:
        thread.join(timeout=300)
    assert not errors, errors
    return summarise(run, config, 0.0)


@pytest.mark.parametrize("family", FAMILIES)
def test_lm_float32(tmp_path: Path, family_dir, family: str) -> None:
    summary = train(tmp_path, family_dir(family))
    assert summary["rounds_committed"] == 2 and summary["replicas_bit_identical"]
    assert summary["final_eval_loss"] < summary["initial_eval_loss"], summary["eval_loss_by_round"]


@pytest.mark.parametrize("family", FAMILIES)
def test_lm_bf16_compute_over_float32_masters(tmp_path: Path, family_dir, family: str) -> None:
    summary = train(tmp_path, family_dir(family), dtype="bfloat16")
    assert summary["rounds_committed"] == 2 and summary["replicas_bit_identical"]
    assert summary["final_eval_loss"] < summary["initial_eval_loss"], summary["eval_loss_by_round"]


@pytest.mark.parametrize("family", ["ernie4_5_moe", "llama", "opt"])
def test_lm_pure_bf16_with_mixed_parameter_dtypes(tmp_path: Path, family_dir, family: str) -> None:
    summary = train(tmp_path, family_dir(family), dtype="bfloat16", master_dtype="bfloat16")
    assert summary["rounds_committed"] == 2 and summary["replicas_bit_identical"]
    assert summary["final_eval_loss"] < summary["initial_eval_loss"], summary["eval_loss_by_round"]


@pytest.mark.parametrize("family", FAMILIES)
def test_composer(tmp_path: Path, family_dir, family: str) -> None:
    summary = train(tmp_path, family_dir(family), objective="composer")
    assert summary["rounds_committed"] == 2 and summary["replicas_bit_identical"]
    for channel in ("grpo/loss", "sdpo/loss", "replay/loss"):
        values = summary["train_by_round"][channel].values()
        assert values and all(math.isfinite(v) for v in values), (channel, summary["train_by_round"][channel])


@pytest.mark.parametrize("family", ["llama", "qwen2_moe", "gpt2", "ernie4_5_moe"])
def test_composer_bf16_compute_over_float32_masters(tmp_path: Path, family_dir, family: str) -> None:
    summary = train(tmp_path, family_dir(family), objective="composer", dtype="bfloat16")
    assert summary["rounds_committed"] == 2 and summary["replicas_bit_identical"]
    assert all(math.isfinite(v) for v in summary["train_by_round"]["loss/total"].values())


def test_a_mixed_dtype_fragment_puts_its_float32_parameters_first(family_dir) -> None:
    """torchft packs a fragment into buckets of its first tensor's dtype: float32 first, nothing is rounded."""
    import torch

    from composer_serverless.models.loading import load_pretrained
    from composer_serverless.replicas.diloco import split_fragments

    model, _ = load_pretrained(family_dir("ernie4_5_moe"), "bfloat16")
    (fragment,) = split_fragments(model, 1)
    dtypes = [p.dtype for p in fragment.parameters()]
    assert {torch.float32, torch.bfloat16} == set(dtypes)
    assert dtypes == sorted(dtypes, key=lambda d: d != torch.float32)  # every float32 before any bfloat16
