"""``make gpu-check`` on a machine without CUDA: lines it cannot run here are skipped with the reason, and the
JSON and the table are written. (Its launches are the suite's end-to-end runs; the whole check is run by hand.)"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from tests.benchmarks.bench_scripts import BENCHMARKS, load_script


def _gpu_check(out: Path, only: str, *, timeout: int) -> subprocess.CompletedProcess[str]:
    """``make gpu-check`` with ``--only``, as a user runs it."""
    return subprocess.run(
        [sys.executable, str(BENCHMARKS / "gpu_check.py"), "--out", str(out), "--only", only],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_lines_it_cannot_run_are_skipped_with_the_reason(tmp_path: Path) -> None:
    done = _gpu_check(tmp_path, "export", timeout=300)
    assert done.returncode == 0, done.stderr
    (written,) = tmp_path.glob("*.json")
    result = json.loads(written.read_text())
    assert result["cuda"] is False and "simulated accelerator" in result["device"]
    # When and from what it was measured, which a dry run's estimate cites (executors/measured.py).
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", result["date"]) and re.fullmatch(
        r"[0-9a-f]{7,}(\+dirty)?", result["commit"]
    )
    (row,) = result["lines"]
    assert (
        row["line"] == "export" and row["skipped"] == "the lm-chat line did not leave a final model to export"
    )
    assert "| export |" in written.with_suffix(".md").read_text()


def test_the_exchange_line_needs_sixteen_cores(tmp_path: Path, monkeypatch) -> None:
    gpu_check = load_script("gpu_check")
    monkeypatch.setattr(gpu_check.os, "cpu_count", lambda: 2)
    row = gpu_check.Check(tmp_path, {}, cuda=False).allreduce_link()
    assert row == {"skipped": "needs 16 cores for proxy, moto and 8 replicas; this machine has 2"}


def test_an_unknown_line_is_refused_with_the_known_ones(tmp_path: Path) -> None:
    done = _gpu_check(tmp_path, "demo,warp-drive", timeout=60)
    assert (
        done.returncode == 2
        and "unknown lines ['warp-drive']" in done.stderr
        and "kill-resume" in done.stderr
    )
    assert not list(tmp_path.iterdir())


def test_a_line_records_its_workload_as_a_plan_is_matched_by_it(tmp_path: Path) -> None:
    from composer_serverless.config import validate_config
    from composer_serverless.executors.measured import workload

    gpu_check = load_script("gpu_check")
    config = validate_config(
        {"model": {"tiny": {}}, "data": {"seq_len": 64}, "diloco": {"sync_every": 1, "rounds": 1}}
    )
    (tmp_path / "run.json").write_text(config.resolved_json())
    recorded = gpu_check._workload(tmp_path)
    assert recorded == workload(config) and recorded["seq_len"] == 64 and recorded["objective"] == "lm"
