"""``export --round`` of any kept checkpoint (in a dtype, of an authenticated run, of a run that died before its
``final/``), the model card, and pushes to a loopback fake of the Hub (``fake_hub.py``): by ``export
--push-to-hub`` and by the launcher at the end of a run with ``[output] push_to_hub``.

One tiny run serves every test: 1 replica, 3 rounds, a checkpoint every round and 3 kept, authenticated, its
final model pushed by the launcher. It runs through the real CLI in a subprocess whose ``HF_ENDPOINT`` is the
fake (huggingface_hub reads it when imported); the tests in this process pass the fake's URL as
``export``'s ``endpoint`` instead. The client runs with ``HF_HUB_DISABLE_XET=1``: the fake serves the LFS
transfer, not Xet's.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from composer_serverless.cli import app
from composer_serverless.config import RunConfig, load_config
from composer_serverless.executors.base import BackendError
from composer_serverless.executors.opening import open_created
from composer_serverless.outputs.export import Source, choose, export
from composer_serverless.rendezvous.run_keys import key_path
from composer_serverless.rendezvous.runkey import ENV, RunKey
from tests.executors.conftest import REPO, cli, write_config
from tests.executors.fake_hub import FakeHub

pytestmark = pytest.mark.slow

TOKEN = "hf_fake_push_token_0123456789"
REPO_ID = "tester/tiny-diloco"


@pytest.fixture(scope="module")
def hub() -> FakeHub:
    fake = FakeHub(TOKEN, "tester", orgs=("team",)).start()
    yield fake
    fake.stop()


@pytest.fixture(scope="module")
def env(hub: FakeHub, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    home = tmp_path_factory.mktemp("user")
    environ = {k: v for k, v in os.environ.items() if k != ENV}
    return {
        **environ,
        "HF_ENDPOINT": hub.url,
        "HF_TOKEN": TOKEN,
        "HF_HUB_DISABLE_XET": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_DISABLE_UPDATE_CHECK": "1",
        "HF_HOME": str(home / "hf-home"),
        "XDG_CONFIG_HOME": str(home / "config"),
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "COLUMNS": "200",
    }


@pytest.fixture(scope="module")
def finished(env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """The launcher's output and the run's directory."""
    tmp = tmp_path_factory.mktemp("export")
    config = write_config(
        tmp / "run.toml",
        f"""
        run_id = "rounds"
        store = "{tmp / "store"}"
        [diloco]
        replicas = 1
        sync_every = 2
        rounds = 3
        checkpoint_every = 1
        keep_checkpoints = 3
        authenticate = true
        [executor]
        threads_per_replica = 1
        [output]
        push_to_hub = "{REPO_ID}"
        """,
    )
    result = cli("launch", str(config), env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout, tmp / "store" / "rounds"


@pytest.fixture
def user(env: dict[str, str], hub: FakeHub, monkeypatch: pytest.MonkeyPatch) -> FakeHub:
    """This process as the user's shell of ``env``: their token and saved run keys, Xet off."""
    import huggingface_hub.constants

    for name in ("HF_TOKEN", "XDG_CONFIG_HOME"):
        monkeypatch.setenv(name, env[name])
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_XET", True)
    hub.role = "write"
    return hub


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "model.safetensors")


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_launcher_pushes_the_final_model_private_with_its_card(finished, hub, env, tmp_path) -> None:
    """[output] push_to_hub: once the report is written, the final model goes to a private repo in one
    commit, its weights through LFS byte for byte, with a card whose config launches the same run again and
    which holds no secret (the run key)."""
    output, run = finished
    assert f"pushed the final model to {REPO_ID}" in output
    repo = hub.repos[REPO_ID]
    assert repo.private is True and len(repo.commits) == 1
    final = run / "final"
    assert {name: repo.files[name] for name in os.listdir(final)} == {
        name: (final / name).read_bytes() for name in os.listdir(final)
    }
    assert "model.safetensors" in repo.lfs and hub.requests_to("PUT", "/__lfs/")
    card = repo.files["README.md"].decode()
    data = ModelCard(card).data
    assert data.library_name == "transformers" and "diloco" in data.tags and data.base_model is None
    assert "round 3 of 3 (the run's final model)" in card
    for row in (
        "| replicas (M) | 1 |",
        "| inner steps per round (H, sync_every) | 2 |",
        "| exchange codec | fp32 |",
    ):
        assert row in card
    assert (
        "| held-out loss at round 3 (this model) |" in card
        and "composer-serverless launch config.toml" in card
    )
    toml = re.search(r"```toml\n(.*?)```", card, re.S)
    assert toml is not None
    (tmp_path / "config.toml").write_text(toml.group(1))
    again = load_config(tmp_path / "config.toml").model_dump()
    created = RunConfig.model_validate_json((run / "run.json").read_text()).model_dump()
    for config in (again, created):
        config.pop("run_id")
        config["code"].pop("root")
    assert again == created
    secret = RunKey.from_hex(key_path(str(run), env).read_text()).hex()
    assert all(secret.encode() not in data for data in repo.files.values())


def test_a_round_exports_in_bf16_matching_float32_and_the_last_round_is_the_final_model(
    finished, user, tmp_path
) -> None:
    """``--round 2`` (an authenticated run: its states read with the saved key) in float32 and bfloat16: bf16
    safetensors that load and compute what the float32 export does within bf16 rounding; round 2 is not the
    final model, while round 3, rebuilt from its checkpoint, is ``final/`` bit for bit."""
    _, run = finished
    outs = {name: tmp_path / name for name in ("r2", "r2-bf16", "r3", "final")}
    args = {
        "r2": ["--round", "2"],
        "r2-bf16": ["--round", "2", "--dtype", "bfloat16"],
        "r3": ["--round", "3"],
    }
    for name, out in outs.items():
        result = CliRunner().invoke(app, ["export", str(run), str(out), *args.get(name, [])])
        assert result.exit_code == 0, result.output
        what = "final model of round 3" if name == "final" else f"checkpoint of round {name[1]}"
        assert what in " ".join(result.output.split())
    weights = {name: _weights(out) for name, out in outs.items()}
    assert {t.dtype for t in weights["r2-bf16"].values()} == {torch.bfloat16}
    assert {t.dtype for t in weights["r2"].values()} == {torch.float32}
    assert _equal(weights["r3"], weights["final"]) and _equal(weights["final"], _weights(run / "final"))
    assert not _equal(weights["r2"], weights["final"])
    tokens = torch.arange(1, 33).reshape(2, 16)
    with torch.no_grad():
        full = AutoModelForCausalLM.from_pretrained(outs["r2"]).eval()(tokens).logits
        half = AutoModelForCausalLM.from_pretrained(outs["r2-bf16"]).float().eval()(tokens).logits
    assert float((half - full).abs().max()) <= 1.6e-2 * float(full.abs().max())
    card = (outs["r2"] / "README.md").read_text()
    assert (
        "round 2 of 3 (its checkpoint of round 2)" in card
        and "| held-out loss at round 2 (this model) |" in card
    )
    assert (outs["r2-bf16"] / "tokenizer.json").exists()


def test_export_prints_its_line_and_no_progress_bar_of_transformers(finished, env, tmp_path) -> None:
    """A round rebuilt and cast loads and saves the model with transformers, whose progress bars ("Loading
    weights", "Writing model shards") stay off: the command's output is its one line."""
    _, run = finished
    out = tmp_path / "r2"
    result = cli("export", str(run), str(out), "--round", "2", "--dtype", "bfloat16", env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (result.stdout, result.stderr) == (f"checkpoint of round 2 copied to {out}\n", "")
    assert {t.dtype for t in _weights(out).values()} == {torch.bfloat16}


def test_a_round_the_run_does_not_keep_exits_2_naming_those_it_keeps(finished, user, tmp_path) -> None:
    _, run = finished
    result = CliRunner().invoke(app, ["export", str(run), str(tmp_path / "out"), "--round", "7"])
    output = " ".join(result.output.split())
    assert result.exit_code == 2, result.output
    assert (
        "--round 7: the run keeps the checkpoints of rounds 3, 2, 1 (and final/, exported without --round)"
        in output
    )
    assert not (tmp_path / "out").exists()


def test_a_run_that_died_exports_its_newest_checkpoint_and_only_with_its_key(
    finished, user, env, tmp_path, monkeypatch
) -> None:
    """Without final/ (the run died before its end) the default is the newest checkpoint; an authenticated
    run's states need its key: a wrong key, or a state altered in the store, exit 2 before OUT exists."""
    _, finished_run = finished
    run = tmp_path / "store" / "rounds"
    shutil.copytree(finished_run, run)
    shutil.rmtree(run / "final")
    (run / "summary.json").unlink()
    # Another URL: its key is not where the launcher saved the original's; the user exports it.
    key = RunKey.from_hex(key_path(str(finished_run), env).read_text())
    monkeypatch.setenv(ENV, key.hex())
    result = CliRunner().invoke(app, ["export", str(run), str(tmp_path / "newest")])
    assert result.exit_code == 0, result.output
    assert "checkpoint of round 3 copied" in " ".join(result.output.split())
    assert _equal(_weights(tmp_path / "newest"), _weights(finished_run / "final"))
    card = (tmp_path / "newest" / "README.md").read_text()
    assert "round 3 of 3 (its checkpoint of round 3)" in card and "## Results" not in card

    monkeypatch.setenv(ENV, RunKey.generate().hex())
    wrong = CliRunner().invoke(app, ["export", str(run), str(tmp_path / "wrong-key")])
    assert wrong.exit_code == 2 and "not this run's" in " ".join(wrong.output.split())
    monkeypatch.setenv(ENV, key.hex())
    tensors = run / "state" / "2" / "0" / "tensors.safetensors"
    data = bytearray(tensors.read_bytes())
    data[-1] ^= 1  # same size, other bytes: only the MAC tells
    tensors.write_bytes(bytes(data))
    altered = CliRunner().invoke(app, ["export", str(run), str(tmp_path / "altered"), "--round", "2"])
    output = " ".join(altered.output.split())
    assert altered.exit_code == 2 and "does not match its manifest MAC" in output, altered.output
    assert "fix: --round one of the other kept rounds (3, 1)" in output
    assert not (tmp_path / "wrong-key").exists() and not (tmp_path / "altered").exists()


def test_the_final_model_of_an_earlier_end_is_not_the_default(finished) -> None:
    """A resume that takes the finished run further (``--set diloco.rounds=5``) leaves its old ``final/`` until
    round 5: meanwhile the default is the newest checkpoint, not a model labelled round 5 that is round 3."""
    _, run = finished
    store, config = open_created(str(run))
    assert choose(store, config, None) == Source(3, True, (3, 2, 1))
    longer = config.model_copy(update={"diloco": config.diloco.model_copy(update={"rounds": 5})})
    assert choose(store, longer, None) == Source(3, False, (3, 2, 1))


def test_export_pushes_a_round_in_bf16_public_when_asked(finished, hub, env, tmp_path) -> None:
    """The real CLI (its Hub from HF_ENDPOINT): ``--public`` creates the organisation's repo public, and the
    repo receives exactly the exported files, the card among them."""
    _, run = finished
    out = tmp_path / "r2"
    args = [
        "export",
        str(run),
        str(out),
        "--round",
        "2",
        "--dtype",
        "bfloat16",
        "--push-to-hub",
        "team/tiny-r2",
    ]
    result = cli(*args, "--public", env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "checkpoint of round 2 copied" in result.stdout and "pushed: " in result.stdout
    assert result.stderr == ""  # no progress bar, of transformers' loading or of huggingface_hub's upload
    repo = hub.repos["team/tiny-r2"]
    assert repo.private is False and len(repo.commits) == 1
    files = {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert repo.files == files and "README.md" in files
    assert {t.dtype for t in _weights(out).values()} == {torch.bfloat16}


def test_what_the_hub_refuses_is_said_and_nothing_is_half_done(finished, user, tmp_path, monkeypatch) -> None:
    """A bad or read-only token, or a private push into an existing public repo: exit 2 before OUT is
    written. A commit the Hub fails: exit 1, and the repo holds no part of the model."""
    _, run = finished
    hub = user
    monkeypatch.setenv("HF_TOKEN", "hf_not_the_token")
    with pytest.raises(BackendError, match="rejected the token") as bad:
        export(str(run), tmp_path / "bad", push_to_hub="tester/bad-token", endpoint=hub.url)
    assert bad.value.exit_code == 2 and "fix: export HF_TOKEN=" in str(bad.value)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    hub.role = "read"
    with pytest.raises(BackendError, match="read token") as read:
        export(str(run), tmp_path / "read", push_to_hub="tester/read-token", endpoint=hub.url)
    assert read.value.exit_code == 2
    hub.role = "write"
    export(str(run), tmp_path / "public", push_to_hub="tester/was-public", private=False, endpoint=hub.url)
    with pytest.raises(BackendError, match="already exists and is public") as public:
        export(str(run), tmp_path / "private", push_to_hub="tester/was-public", endpoint=hub.url)
    assert public.value.exit_code == 2 and len(hub.repos["tester/was-public"].commits) == 1
    assert not any((tmp_path / name).exists() for name in ("bad", "read", "private"))
    assert not {"tester/bad-token", "tester/read-token"} & set(hub.repos)

    hub.refuse("POST", "/api/models/tester/broken/commit", 500)
    with pytest.raises(BackendError, match=r"the Hub failed \(HTTP 500") as failed:
        export(str(run), tmp_path / "broken", push_to_hub="tester/broken", endpoint=hub.url)
    assert failed.value.exit_code == 1
    assert "a push is one commit: tester/broken holds all of this model or none of it" in str(failed.value)
    assert f"composer-serverless export {run} <new dir> --push-to-hub tester/broken" in str(failed.value)
    assert hub.repos["tester/broken"].files == {} and hub.repos["tester/broken"].commits == []


def test_the_status_that_writes_a_detached_runs_report_pushes_its_model(finished, hub, env) -> None:
    """A run the launcher detached from gets its report from the first `status` that sees it finished; with
    [output] push_to_hub that status also pushes the final model, once."""
    _, run = finished
    (run / "summary.json").unlink()  # as if the launcher had detached before the end
    commits = len(hub.repos[REPO_ID].commits)
    result = cli("status", str(run), env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"pushed the final model to {REPO_ID}" in result.stdout and (run / "summary.json").exists()
    assert len(hub.repos[REPO_ID].commits) == commits + 1
    again = cli("status", str(run), env=env)  # the report exists now: nothing more to finish
    assert again.returncode == 0 and "pushed" not in again.stdout
    assert len(hub.repos[REPO_ID].commits) == commits + 1
