"""benchmarks/rescore.py: a goodput run's globals scored again, on the run's own held-out sequences exactly as
the benchmark scored them, on more of them differently, and compared with ``goodput.at_equal_tokens``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import safetensors.torch
from bench_scripts import load_script

from composer_serverless.models.loading import load_pretrained
from composer_serverless.rendezvous import decoupled as store_versions
from composer_serverless.rendezvous import layout
from composer_serverless.rendezvous.decoupled import Version
from tests.rendezvous.harness import create, make_config

goodput = load_script("goodput")
rescore = load_script("rescore")


def _out(tmp_path: Path, tiny_model_dir: Path) -> tuple[Path, dict[int, float], float]:
    """A goodput ``--out`` by hand: one store holding lock-step's ``final/`` (the initial weights times 0.95)
    and decoupled's versions 1-3 (plus 0.01, times 0.9, times 0.95: version 3 is lock-step's final), and a
    results.json whose evals are the benchmark's own scores of them. Returns it, those scores and the
    benchmark's score of the final."""
    out = tmp_path / "out"
    config = make_config(str(out / "runs"), "both", tiny_model_dir)
    run = create(config)
    model, _ = load_pretrained(tiny_model_dir, "float32")
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    globals_ = {
        1: {n: t + 0.01 for n, t in initial.items()},
        2: {n: t * 0.9 for n, t in initial.items()},
        3: {n: t * 0.95 for n, t in initial.items()},
    }
    records = [Version(v, "hand-made") for v in range(4)]
    for record in records:
        assert store_versions.commit(run, record, globals_.get(record.version, initial), None, None)
    final_dir = out / "runs" / "both" / layout.FINAL
    final_dir.mkdir(parents=True)
    safetensors.torch.save_file(globals_[3], str(final_dir / "model.safetensors"))
    scored = goodput.score_versions(run, config, records)
    evals = [[v, 100.0 * v, 10.0 * v, scored[v]] for v in (1, 2, 3)]
    both = {
        "lock-step": {"run_id": "both", "evals": [[4, 300.0, 100.0, scored[3]]], "wall_s": 101.0},
        "decoupled": {"run_id": "both", "evals": evals, "wall_s": 31.0},
    }
    (out / "results.json").write_text(json.dumps({"seed": 0, "results": {"d": both}}))
    return out, scored, scored[3]


def _split(out: Path, seed: int = 0) -> tuple[Path, Path]:
    """``out`` as two ``--out`` directories, as ``--modes decoupled`` and ``--modes lock-step`` write them:
    each results.json holding one mode (for ``seed``), each runs/ the same store."""
    both = json.loads((out / "results.json").read_text())["results"]["d"]
    split = []
    for mode in ("decoupled", "lock-step"):
        part = out.parent / f"{mode}-s{seed}"
        part.mkdir()
        (part / "runs").symlink_to(out / "runs", target_is_directory=True)
        (part / "results.json").write_text(json.dumps({"seed": seed, "results": {"d": {mode: both[mode]}}}))
        split.append(part)
    return split[0], split[1]


def test_the_runs_own_sequences_give_the_benchmarks_scores_and_more_give_others(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    out, scored, final = _out(tmp_path, tiny_model_dir)
    same = rescore.rescore(out, sequences=2, from_version=2)  # make_config's eval.sequences
    assert [e[0] for e in same["decoupled"]["evals"]] == [2, 3]
    assert [e[3] for e in same["decoupled"]["evals"]] == pytest.approx([scored[2], scored[3]], rel=1e-6)
    assert same["lock_step"]["final"] == pytest.approx([4, 300.0, 100.0, final], rel=1e-6)
    # reached at the first version scoring at most lock-step's final (version 3 holds it), at 10 s a version
    first = next(v for v in (2, 3) if scored[v] <= final)
    reached = same["compared"]["to_lock_step_final_loss"]
    assert (reached["version"], reached["ratio"]) == (first, pytest.approx(first / 10))

    more = rescore.rescore(out, sequences=6, from_version=1)
    assert [e[0] for e in more["decoupled"]["evals"]] == [1, 2, 3]
    assert more["decoupled"]["evals"][1][3] != pytest.approx(scored[2], rel=1e-4)  # other sequences scored
    assert more["decoupled"]["evals"][2][3] == pytest.approx(more["lock_step"]["final"][3], rel=1e-6)


def test_a_decoupled_only_out_is_compared_with_the_lock_step_out_of_its_seed(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    out, _, _ = _out(tmp_path, tiny_model_dir)
    together = rescore.rescore(out, sequences=6, from_version=1)
    decoupled, lock_step = _split(out)
    _, other_seed = _split(out, seed=1)
    written = tmp_path / "r.json"
    candidates = ["--lock-step", str(other_seed), "--lock-step", str(lock_step)]
    assert rescore.main([str(decoupled), *candidates, "--sequences", "6", "--json", str(written)]) == 0
    (row,) = json.loads(written.read_text())["runs"]
    assert row["lock_step_out"] == str(lock_step)
    assert row["lock_step"] == together["lock_step"]
    assert row["decoupled"]["evals"] == together["decoupled"]["evals"]
    assert row["compared"] == together["compared"]


def test_a_decoupled_only_out_without_its_lock_step_run_exits_2_before_scoring(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, _, _ = _out(tmp_path, tiny_model_dir)
    decoupled, lock_step = _split(out)
    _, other_seed = _split(out, seed=1)
    written = tmp_path / "r.json"
    with pytest.raises(SystemExit) as exited:
        rescore.main([str(decoupled), "--lock-step", str(other_seed), "--json", str(written)])
    assert exited.value.code == 2
    assert (
        "holds no lock-step run and 0 --lock-step directories hold one of its scenario (d) and seed (0)"
        in capsys.readouterr().err
    )
    with pytest.raises(SystemExit) as exited:  # a lock-step-only OUT given where decoupled runs go
        rescore.main([str(out), str(lock_step), "--json", str(written)])
    assert exited.value.code == 2
    assert f"{lock_step} holds no decoupled run to score (it holds lock-step)" in capsys.readouterr().err
    assert not written.exists()


def test_bad_arguments_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        rescore.main([str(tmp_path), "--json", str(tmp_path / "r.json")])
    assert exited.value.code == 2
    assert "is not a goodput.py --out with its runs" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        rescore.main([str(tmp_path), "--sequences", "0", "--json", str(tmp_path / "r.json")])
    assert exited.value.code == 2
