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


# --- a decoupled run: its rounds are versions, their steps the contributions each merged ------------------


def _adopted(rank: int, version: int, sent: dict[int, list[float]]) -> dict:
    """A learner's row of a version it adopted, carrying the contributions ``sent`` (seq: its steps' losses)
    since its previous adoption, as ``replicas/decoupled.py`` writes it."""
    steps = [[_step(loss, sync=0.0) for loss in losses] for losses in sent.values()]
    row = {"rank": rank, "round": version, "contributions": list(sent)}
    if steps:
        row.update(
            step_rows=steps[-1], bytes_up=1, bytes_down=0, time_s={"sync": 0.0}, blocked_s=0.0, round_s=1.0
        )
    if len(steps) > 1:
        row["earlier_step_rows"] = steps[:-1]
    return row


def _raced() -> dict[int, list[dict]]:
    """Learner 0 sent its second contribution before it saw version 1 (its row of 1 carries both, its row of
    2 none); learner 1 adopted each version before it sent again."""
    return {
        0: [_adopted(0, 1, {0: [1.0, 3.0], 1: [5.0, 7.0]}), _adopted(0, 2, {})],
        1: [_adopted(1, 1, {0: [2.0, 4.0]}), _adopted(1, 2, {1: [6.0, 8.0]})],
    }


def test_a_versions_steps_are_those_of_the_contributions_it_merged_wherever_their_rows_are() -> None:
    rows = _raced()
    assert {seq: [s["loss"] for s in steps] for seq, steps in series.contribution_steps(rows[0]).items()} == {
        0: [1.0, 3.0],
        1: [5.0, 7.0],
    }
    carried = {rank: series.contribution_steps(replica_rows) for rank, replica_rows in rows.items()}
    first = series.merged_step_points(carried, [[0, 0], [1, 0]], 1, sync_every=2)
    second = series.merged_step_points(carried, [[0, 1], [1, 1]], 2, sync_every=2)
    assert [(step, p["train/loss"]) for step, p in first + second] == [(1, 1.5), (2, 3.5), (3, 5.5), (4, 7.5)]
    # Placed by the rows' versions instead, version 1 would mix learner 0's second round with learner 1's
    # first, and version 2 would have learner 1's steps alone.
    by_row = series.step_points(series.round_rows(rows, 1), 1, sync_every=2)
    assert [p["train/loss"] for _, p in by_row] == [3.5, 5.5]
    # A contribution merged twice (a version redone after a rollback past a damaged one) counts where merged.
    assert [p["train/loss"] for _, p in series.merged_step_points(carried, [[0, 1]], 3, sync_every=2)] == [
        5.0,
        7.0,
    ]


def test_a_version_is_ready_once_committed_and_every_contribution_it_merged_has_its_row() -> None:
    rows = _raced()
    del rows[1][1]  # learner 1 has not adopted version 2 yet: its second contribution has no row

    def ready(k: int, merged: list[list[int]] | None, *, ended: bool = False) -> bool:
        carried = {rank: series.contribution_steps(replica_rows) for rank, replica_rows in rows.items()}
        return series.merged_ready(rows, carried, k, merged, ended=ended)

    assert not ready(2, None)  # not committed
    assert not ready(2, [[0, 1], [1, 1]])
    assert ready(2, [[0, 1], [1, 1]], ended=True)
    assert ready(1, [[0, 0], [1, 0]])
    # a learner two versions on: learner 1 died before it adopted again
    rows[0].append(_adopted(0, 4, {2: [9.0, 9.0]}))
    assert ready(2, [[0, 1], [1, 1]])
