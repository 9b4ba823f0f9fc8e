"""``sweep`` runs every grid cell as its own run and prints a results table; ``export`` copies a run's final
model out with its model card."""

from __future__ import annotations

import json

import pytest
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from composer_serverless.cli import app
from composer_serverless.rendezvous.store import ObjectStore
from tests.executors.conftest import write_config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sweep")
    store = tmp / "store"
    config = write_config(
        tmp / "sweep.toml",
        f"""
        run_id = "grid"
        store = "{store}"
        [diloco]
        replicas = 1
        sync_every = 2
        rounds = 1
        [executor]
        threads_per_replica = 1
        """,
    )
    args = ["sweep", str(config), "--grid", "diloco.outer_lr=0.5,0.9", "--grid", "seed=0"]
    result = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    return result, store


def test_each_cell_is_its_own_run_and_the_table_lists_them(swept):
    result, store = swept
    assert result.exit_code == 0, result.output
    for index, lr in enumerate(("0.5", "0.9")):
        run = ObjectStore(str(store / f"grid-c{index}"))
        assert json.loads(run.get("run.json"))["diloco"]["outer_lr"] == float(lr)
        assert json.loads(run.get("summary.json"))["rounds_committed"] == 1
    table = result.output[result.output.index("sweep results") :]
    for column in ("diloco.outer_lr", "seed", "state", "final held-out loss"):
        assert column in table
    assert table.count("succeeded") == 2 and "grid-c0" in table and "grid-c1" in table


def test_export_copies_the_final_model_with_its_card(swept, tmp_path):
    """The final model as it is in the store, beside its model card; an OUT that is not empty exits 2 (pushes
    and other rounds: ``test_export_and_push.py``)."""
    _, store = swept
    out = tmp_path / "model"
    result = CliRunner().invoke(app, ["export", str(store / "grid-c0"), str(out)])
    assert result.exit_code == 0, result.output
    assert "final model of round 1 copied to" in " ".join(result.output.split())
    AutoModelForCausalLM.from_pretrained(out)
    final = store / "grid-c0" / "final"
    assert all((out / p.name).read_bytes() == p.read_bytes() for p in final.iterdir())
    assert "round 1 of 1 (the run's final model)" in (out / "README.md").read_text()

    again = CliRunner().invoke(app, ["export", str(store / "grid-c0"), str(out)])
    assert again.exit_code == 2 and "exists and is not empty" in again.output


def test_export_in_bfloat16_is_half_the_size_and_matches_float32_within_bf16_rounding(swept, tmp_path):
    """``export --dtype bfloat16`` writes bf16 safetensors (and the tokenizer) that load with
    ``AutoModelForCausalLM``; their logits match the float32 export's within torch.testing's bf16 tolerance
    (1.6e-2) of their scale. An unknown dtype exits 2 and writes nothing."""
    import torch
    from safetensors.torch import load_file

    _, store = swept
    run = str(store / "grid-c0")
    outs = {dtype: tmp_path / dtype for dtype in ("float32", "bfloat16")}
    for dtype, out in outs.items():
        result = CliRunner().invoke(app, ["export", run, str(out), "--dtype", dtype])
        assert result.exit_code == 0, result.output
    weights = {dtype: load_file(out / "model.safetensors") for dtype, out in outs.items()}
    assert {t.dtype for t in weights["bfloat16"].values()} == {torch.bfloat16}
    assert {t.dtype for t in weights["float32"].values()} == {torch.float32}
    sizes = {dtype: (out / "model.safetensors").stat().st_size for dtype, out in outs.items()}
    assert sizes["bfloat16"] < 0.51 * sizes["float32"]
    assert (outs["bfloat16"] / "tokenizer.json").exists()
    tokens = torch.arange(1, 33).reshape(2, 16)
    logits = {}
    for dtype, out in outs.items():
        model = AutoModelForCausalLM.from_pretrained(out).float().eval()
        with torch.no_grad():
            logits[dtype] = model(tokens).logits
    scale = float(logits["float32"].abs().max())
    assert float((logits["bfloat16"] - logits["float32"]).abs().max()) <= 1.6e-2 * scale
    assert not torch.equal(logits["bfloat16"], logits["float32"])  # the weights really were rounded

    wrong = CliRunner().invoke(app, ["export", run, str(tmp_path / "f16"), "--dtype", "float8"])
    assert wrong.exit_code == 2 and "fix: one of float32, bfloat16" in " ".join(wrong.output.split())
    assert not (tmp_path / "f16").exists()


def test_export_takes_trl_dtype_spellings_and_refuses_fp16_before_writing(swept, tmp_path):
    """``--dtype bf16`` is ``--dtype bfloat16`` (the same bytes); ``--dtype fp16`` exits 2 saying why and what
    to use, and writes nothing."""
    _, store = swept
    run = str(store / "grid-c0")
    outs = {dtype: tmp_path / dtype for dtype in ("bf16", "bfloat16")}
    for dtype, out in outs.items():
        result = CliRunner().invoke(app, ["export", run, str(out), "--dtype", dtype])
        assert result.exit_code == 0, result.output
    assert (outs["bf16"] / "model.safetensors").read_bytes() == (
        outs["bfloat16"] / "model.safetensors"
    ).read_bytes()

    refused = CliRunner().invoke(app, ["export", run, str(tmp_path / "f16"), "--dtype", "fp16"])
    assert refused.exit_code == 2
    assert (
        "--dtype 'fp16' (float16) is not supported: training in it needs loss scaling; use 'bf16'"
        in " ".join(refused.output.split())
    )
    assert not (tmp_path / "f16").exists()
