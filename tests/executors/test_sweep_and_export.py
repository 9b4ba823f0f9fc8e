"""``sweep`` runs every grid cell as its own run and prints a results table; ``export`` copies a run's final
model out (and pushes it to the Hub through huggingface_hub, recorded here by a fake ``HfApi``)."""

from __future__ import annotations

import json
from pathlib import Path

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


def test_export_copies_the_final_model_and_pushes_it_to_the_hub(swept, tmp_path, monkeypatch):
    _, store = swept
    pushed = {}

    class RecordingHfApi:
        def __init__(self, token):
            pushed["token"] = token

        def create_repo(self, repo_id, exist_ok):
            pushed["repo"] = (repo_id, exist_ok)

        def upload_folder(self, repo_id, folder_path, commit_message):
            pushed["upload"] = (repo_id, sorted(p.name for p in Path(folder_path).iterdir()))

            class Commit:
                commit_url = f"https://huggingface.co/{repo_id}/commit/abc"

            return Commit()

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "HfApi", RecordingHfApi)
    monkeypatch.setenv("HF_TOKEN", "hf_push_token")
    out = tmp_path / "model"
    result = CliRunner().invoke(
        app, ["export", str(store / "grid-c0"), str(out), "--push-to-hub", "me/tiny-diloco"]
    )
    assert result.exit_code == 0, result.output
    AutoModelForCausalLM.from_pretrained(out)
    assert pushed["token"] == "hf_push_token" and pushed["repo"] == ("me/tiny-diloco", True)
    assert pushed["upload"][0] == "me/tiny-diloco" and "model.safetensors" in pushed["upload"][1]
    assert "pushed: https://huggingface.co/me/tiny-diloco/commit/abc" in " ".join(result.output.split())

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
