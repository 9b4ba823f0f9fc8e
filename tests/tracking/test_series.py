"""The points the trackers get from the replicas' rows: means over replicas, one axis of global inner steps,
rounds relayed only once complete."""

import pytest

from composer_serverless.tracking import series
from composer_serverless.tracking.trackers import markdown_table


def _step(loss: float, sync: float, peak: int | None = None, **metrics: float) -> dict:
    return {
        "loss": loss,
        "lr": 0.1,
        "grad_norm": 2 * loss,
        "tokens": 100.0,
        "tokens_per_s": None,  # unmeasured: left out, not logged as a number
        "time_s": {
            "generate": 0.0,
            "forward_backward": 1.0,
            "optimizer": 0.5,
            "sync": sync,
            "step": 1.5 + sync,
        },
        "device_peak_bytes": peak,
        **metrics,
    }


def _row(rank: int, k: int, losses: list[float], participants=(0, 1), **extra) -> dict:
    return {
        "rank": rank,
        "round": k,
        "participants": list(participants),
        "step_rows": [_step(loss, sync=0.25 * i, peak=2**30 * (rank + 1)) for i, loss in enumerate(losses)],
        "bytes_up": 1000 * (rank + 1),
        "bytes_down": 500,
        "time_s": {"sync": 0.5 + rank},
        "blocked_s": 1.0,
        "round_s": 4.0,
        **extra,
    }


def test_each_step_is_the_mean_over_replicas_on_the_global_step_axis() -> None:
    rows = [_row(0, 2, [1.0, 3.0, 5.0]), _row(1, 2, [2.0, 4.0, 6.0])]
    points = series.step_points(rows, 2, sync_every=3)
    assert [step for step, _ in points] == [4, 5, 6]  # round 2 of H = 3: steps 4-6
    first = points[0][1]
    assert first["train/loss"] == 1.5 and first["train/grad_norm"] == 3.0 and first["train/lr"] == 0.1
    assert first["time/sync_s"] == 0.0 and points[2][1]["time/sync_s"] == 0.5
    assert first["memory/device_peak_gib"] == 1.5  # (1 + 2) GiB / 2
    assert "train/tokens_per_s" not in first and first["train/tokens"] == 100.0


def test_a_step_only_one_replica_took_is_that_replicas_value() -> None:
    rows = [_row(0, 1, [1.0, 3.0]), _row(1, 1, [2.0])]
    points = dict(series.step_points(rows, 1, sync_every=2))
    assert points[1]["train/loss"] == 1.5 and points[2]["train/loss"] == 3.0


def test_the_round_point_sums_traffic_and_averages_the_rest() -> None:
    rows = [_row(0, 1, [1.0], eval={"eval/loss": 2.5}), _row(1, 1, [2.0])]
    point = series.round_point(rows)
    assert point == {
        "eval/loss": 2.5,
        "round/bytes_up": 3000.0,
        "round/bytes_down": 1000.0,
        "round/sync_s": 1.0,
        "round/blocked_fraction": 0.25,
        "round/quorum": 2.0,
        "round/seconds": 4.0,
    }


def test_the_sparse_codecs_carried_share_is_the_mean_over_the_replicas_that_report_it() -> None:
    rows = [_row(0, 1, [1.0], codec_carried=0.2), _row(1, 1, [2.0], codec_carried=0.3), _row(2, 1, [2.0])]
    assert series.round_point(rows)["round/codec_carried"] == pytest.approx(0.25)
    assert "round/codec_carried" not in series.round_point(rows[2:])


def test_a_round_is_ready_once_every_participant_wrote_its_row() -> None:
    rows = {0: [_row(0, 1, [1.0])], 1: []}
    assert not series.ready(rows, 1, ended=False)
    rows[1].append(_row(1, 1, [2.0]))
    assert series.ready(rows, 1, ended=False)
    assert not series.ready(rows, 2, ended=False)  # nobody wrote round 2 yet
    assert series.ready(rows, 2, ended=True)


def test_a_participant_that_died_before_its_row_holds_the_round_up_until_the_run_is_two_rounds_on() -> None:
    rows = {0: [_row(0, 1, [1.0])]}
    assert not series.ready(rows, 1, ended=False)
    rows[0].append(_row(0, 2, [1.0], participants=(0,)))
    assert not series.ready(rows, 1, ended=False)
    rows[0].append(_row(0, 3, [1.0], participants=(0,)))
    assert series.ready(rows, 1, ended=False)


def test_a_jump_row_is_no_trained_round() -> None:
    rows = {0: [_row(0, 1, [1.0], participants=(0,))], 1: [{"rank": 1, "round": 1, "caught_up_from": 0}]}
    assert [r["rank"] for r in series.round_rows(rows, 1)] == [0]


def test_completions_table_and_its_markdown() -> None:
    completion = {"prompt": "2+2?", "completion": "4 | four\nok", "reward": 1.0}
    rows = [_row(1, 3, [1.0], completions=[completion]), _row(0, 3, [1.0], completions=[])]
    table = series.completions(rows, 3)
    assert table == [[3, 1, "2+2?", "4 | four\nok", 1.0]]
    markdown = markdown_table(series.COMPLETION_COLUMNS, table)
    assert markdown.splitlines() == [
        "| round | replica | prompt | completion | reward |",
        "|---|---|---|---|---|",
        "| 3 | 1 | 2+2? | 4 \\| four<br>ok | 1 |",
    ]


def test_an_empty_mean_is_left_out_of_the_round_point() -> None:
    row = _row(0, 1, [1.0])
    row["round_s"] = 0.0  # no blocked fraction can be computed
    assert "round/blocked_fraction" not in series.round_point([row])


def test_the_initial_evaluation_is_over_once_a_round_was_trained() -> None:
    assert not series.ready({}, 0, ended=False)
    assert series.ready({0: [{"rank": 0, "round": 0, "eval": {"eval/loss": 3.0}}]}, 0, ended=False)
    assert series.ready({0: [_row(0, 1, [1.0])]}, 0, ended=False)  # no initial evaluation was written
