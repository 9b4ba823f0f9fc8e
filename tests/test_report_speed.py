"""The report's speed figures, from the step rows the trackers also show: hand-computed."""

from composer_serverless.launch.report import speed, throughput


def _step(tokens: float, generate: float, forward_backward: float, sync: float, peak: int | None, **extra):
    step = generate + forward_backward + sync
    return {
        "tokens": tokens,
        "time_s": {
            "generate": generate,
            "forward_backward": forward_backward,
            "optimizer": 0.0,
            "sync": sync,
            "step": step,
        },
        "device_peak_bytes": peak,
        **extra,
    }


def test_throughput_per_replica_and_the_time_split() -> None:
    metrics = {
        # Replica 0: 300 tokens in 6 s of steps (50/s); 60 generated in 3 s of generation (20/s).
        0: [{"round": 1, "step_rows": [_step(100, 1, 0.5, 0.5, 2**30, **{"rollout/tokens": 20.0})] * 3}],
        # Replica 1: 200 tokens in 1 s (200/s); 10 generated in 0.5 s (20/s).
        1: [{"round": 1, "step_rows": [_step(200, 0.5, 0.5, 0.0, 3 * 2**30, **{"rollout/tokens": 10.0})]}],
    }
    figures = throughput(metrics)
    assert figures == {
        "train_tokens_per_s": 125.0,  # (50 + 200) / 2
        "generate_tokens_per_s": 20.0,
        # 7 s of steps: generation 3.5 s, forward-backward 2 s, sync 1.5 s.
        "time_split": {"generate": 0.5, "forward_backward": 2 / 7, "optimizer": 0.0, "sync": 1.5 / 7},
        "device_peak_gib": 3.0,
    }
    assert speed({"throughput": figures}) == (
        "speed: 125 trained tokens/s per replica; 20 generated tokens/s; a step's time: generate 50%, "
        "forward-backward 29%, sync 21%; peak device memory 3.0 GiB"
    )


def test_rows_without_steps_give_no_speed() -> None:
    assert throughput({0: [{"round": 1, "caught_up_from": 0}]}) is None
    assert speed({"throughput": None}) is None


def test_a_decoupled_row_carrying_several_contributions_counts_every_ones_steps() -> None:
    """A learner that sent twice before its next adoption: its row holds the last round's steps and the
    earlier one's (``earlier_step_rows``); the speed is over both."""
    earlier = [_step(100, 1, 0.5, 0.5, 2**30)] * 2  # 200 tokens in 4 s
    last = [_step(400, 0.5, 0.5, 0.0, 2**31)]  # 400 tokens in 1 s
    row = {"round": 2, "contributions": [3, 4], "earlier_step_rows": [earlier], "step_rows": last}
    figures = throughput({0: [row]})
    assert figures is not None
    assert figures["train_tokens_per_s"] == 120.0 and figures["device_peak_gib"] == 2.0  # 600 tokens in 5 s
