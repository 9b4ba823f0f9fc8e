"""The composer objective end to end inside one process, and the launcher's preflight of its inputs."""

import json
import math
from collections import Counter

import pytest
import torch

from composer_serverless.accelerator.simulated import simulated
from composer_serverless.config import ConfigError, validate_config
from composer_serverless.data.records import PromptRecord
from composer_serverless.launch.launcher import prepare
from composer_serverless.objectives.composer import stratified
from composer_serverless.objectives.inputs import check_composer
from composer_serverless.objectives.objective import evaluate, make_objective, step_loss
from composer_serverless.objectives.shares import combine
from composer_serverless.replicas.meter import read_step
from tests.replicas.conftest import tiny_model

TRAIN = [{"prompt": f"add {a} {b}=", "answer": str(a + b), "task": "add"} for a in range(3) for b in range(3)]
HELDOUT = [
    {"prompt": "first 123=", "answer": "1", "task": "first"},
    {"prompt": "add 4 4=", "answer": "8", "task": "add"},
    {"prompt": "first 987=", "answer": "9", "task": "first"},
]
PAIRS = [{"prompt": f"add {a} 1=", "chosen": str(a + 1), "rejected": str(a)} for a in range(4)]


@pytest.fixture
def raw(jsonl):
    def make(**composer):
        return {
            "model": {
                "tiny": {"tokenizer": "chars", "hidden_size": 32, "intermediate_size": 64, "num_heads": 4}
            },
            "train": {"objective": "composer"},
            "diloco": {"replicas": 2, "sync_every": 2, "rounds": 1},
            "eval": {"sequences": 3},
            "composer": {
                "alpha": 1.0,
                "beta": 1.0,
                "data": {
                    "prompts": jsonl("train.jsonl", TRAIN),
                    "heldout": jsonl("heldout.jsonl", HELDOUT),
                    "pairs": jsonl("pairs.jsonl", PAIRS),
                },
                "rewards": [{"fn": "exact_match"}, {"fn": "format", "pattern": "[0-9].*", "weight": 0.5}],
                "rollout": {"group_size": 4, "prompts_per_step": 2, "max_new_tokens": 3},
                **composer,
            },
        }

    return make


def test_a_step_has_all_three_channels_and_the_position_is_json(raw, model, tokenizer):
    config = validate_config(raw())
    objective = make_objective(config, tokenizer, 1, model=model)
    loss, metrics = step_loss(objective, model)
    loss.backward()
    # Scalars: floats, or 0-dim tensors the trainer reads in one transfer with the loss.
    assert all(
        isinstance(v, float) or (isinstance(v, torch.Tensor) and v.dim() == 0) for v in metrics.values()
    )
    assert metrics["sdpo/loss"] > 0 and metrics["replay/loss"] > 0 and "grpo/loss" in metrics
    assert metrics["loss/total"] == pytest.approx(loss.item())
    assert {"rollout/reward_mean", "rollout/reward/exact_match", "rollout/reward/format"} <= metrics.keys()
    state = json.loads(json.dumps(objective.state_dict()))
    # Rank 1 holds 4 prompts and 2 pairs: 2 prompts and 8 pairs (the default per step) were drawn.
    assert state == {"prompts": {"epoch": 0, "index": 2}, "pairs": {"epoch": 3, "index": 2}}
    again = make_objective(config, tokenizer, 1, model=model)
    again.load_state_dict(state)
    assert again.state_dict() == state


def test_evaluation_reports_the_reward_overall_per_task_and_per_reward(raw, model, tokenizer):
    objective = make_objective(validate_config(raw()), tokenizer, 0, model=model)
    evaluation = evaluate(objective, model)
    assert {
        "eval/reward",
        "eval/exact_match",
        "eval/format",
        "eval/task/add/reward",
        "eval/task/first/reward",
    } <= (evaluation.keys())
    assert evaluation["eval/reward"] == pytest.approx(
        evaluation["eval/exact_match"] + 0.5 * evaluation["eval/format"]
    )
    assert model.training


def test_simpo_and_a_kl_term_need_other_references(raw, model, tokenizer):
    config = validate_config(raw(replay={"kind": "simpo"}, grpo={"kl": 0.1}))
    objective = make_objective(config, tokenizer, 0, model=model)
    _, metrics = step_loss(objective, model)
    assert "grpo/kl" in metrics and metrics["replay/loss"] > 0


def test_held_out_prompts_are_taken_across_tasks_in_turn():
    records = [PromptRecord(prompt=str(i), columns={"task": t}) for i, t in enumerate("aaabbc")]
    assert [r.prompt for r in stratified(records, 4)] == ["0", "3", "5", "1"]
    assert len(stratified(records, 100)) == 6


def _with_prompts(config, prompts: str):
    """``config`` reading its prompts from ``prompts``, unvalidated: the launcher's check is what is tested."""
    data = config.composer.data.model_copy(update={"prompts": prompts})
    return config.model_copy(update={"composer": config.composer.model_copy(update={"data": data})})


def test_the_launchers_check_names_the_malformed_record(raw, jsonl):
    config = validate_config(raw())
    bad = jsonl("bad.jsonl", [TRAIN[0], '{"prompt": "x", "answer": [5]}'])
    broken = _with_prompts(config, bad)
    with pytest.raises(ConfigError, match=rf"{bad}:2: 'answer' must be a string, got \[5\]"):
        check_composer(broken)


def test_the_launchers_check_names_a_reward_that_does_not_import(raw, tmp_path, monkeypatch):
    """In a child process, as the launcher runs it: the user's code never enters the launcher."""
    monkeypatch.chdir(tmp_path)
    config = validate_config(raw(rewards=[{"fn": "no_such_module:score"}]))
    with pytest.raises(ConfigError, match="reward 'no_such_module:score': importing 'no_such_module' failed"):
        prepare(config, "composer.toml")


def test_a_built_in_reward_whose_column_no_record_has_is_refused_with_the_column_map(raw, jsonl):
    config = validate_config(raw())
    plain = jsonl("plain.jsonl", [{"prompt": "add 1 1=", "solution": "2"}] * 4)
    broken = _with_prompts(config, plain)
    with pytest.raises(ConfigError, match=r"reads the 'answer' column, which no record of .*plain.jsonl has"):
        check_composer(broken)


def test_the_launchers_check_refuses_fewer_records_than_replicas(raw):
    config = validate_config(raw())
    crowded = config.model_copy(update={"diloco": config.diloco.model_copy(update={"replicas": 20})})
    with pytest.raises(ConfigError, match="9 records cannot be sharded over 20 replicas"):
        check_composer(crowded)


def test_shares_of_the_evaluation_add_up_to_the_whole(raw, model, tokenizer):
    """Three replicas' shares, combined, give every metric the whole set gives, per task included (a task
    can be missing from a share)."""
    objective = make_objective(validate_config(raw()), tokenizer, 0, model=model)
    whole = evaluate(objective, model)
    combined = combine([objective.evaluate_part(model, p, 3) for p in range(3)])
    assert combined.keys() == whole.keys()
    for name, value in whole.items():
        assert combined[name] == pytest.approx(value, abs=1e-12), name


def test_prompts_are_rendered_with_the_chat_template_when_asked(raw, model, tokenizer, monkeypatch):
    from composer_serverless.objectives import rollout

    tokenizer.chat_template = (
        "{% for m in messages %}T:{{ m['content'] }}.{% endfor %}{% if add_generation_prompt %}A:{% endif %}"
    )
    seen: list[str] = []
    encode = rollout.prompt_token_ids
    monkeypatch.setattr(
        rollout,
        "prompt_token_ids",
        lambda tok, prompts: seen.extend(p.text for p in prompts) or encode(tok, prompts),
    )
    objective = make_objective(validate_config(raw(chat_template=True)), tokenizer, 0, model=model)
    step_loss(objective, model)
    students = [p for p in seen if p.startswith("T:add")]
    assert students and all(p.endswith("=.A:") for p in students)
    # The teacher's hint goes inside the user's turn, before the original prompt.
    teachers = [p for p in seen if not p.startswith("T:add")]
    assert teachers and all(p.startswith("T:") and p.endswith("=.A:") and "add" in p for p in teachers)


def test_the_chat_switch_needs_a_chat_template(raw, model, tokenizer):
    with pytest.raises(ValueError, match="has no chat template"):
        make_objective(validate_config(raw(chat_template=True)), tokenizer, 0, model=model)


def test_a_step_on_the_accelerator_waits_for_it_a_few_times_whatever_the_batch(raw, tokenizer):
    """Outside the rollout engine, a composer step makes the host wait for the device a fixed few times (counted by
    the simulated accelerator), not once per row or metric: 117 times at 64 rows before this was fixed."""
    counts = []
    for prompts in (2, 8):
        config = validate_config(
            raw(rollout={"group_size": 4, "prompts_per_step": prompts, "max_new_tokens": 3})
        )
        with simulated() as sim:
            model = tiny_model(tokenizer).to("cuda")
            objective = make_objective(config, tokenizer, 0, model=model)
            generating: Counter[str] = Counter()
            # auto's engine on the device is the paged one: transformers' generate_batch.
            generate = model.generate_batch

            def counted(*args, generate=generate, generating=generating, sim=sim, **kwargs):
                before = Counter(sim.host_syncs)
                try:
                    return generate(*args, **kwargs)
                finally:
                    generating.update(sim.host_syncs - before)

            model.generate_batch = counted
            before = Counter(sim.host_syncs)
            loss, metrics = step_loss(objective, model)
            loss.backward()
            read_step(loss, metrics)
            counts.append(sum((sim.host_syncs - before - generating).values()))
        assert sum(generating.values()) > 0  # generate itself ran on the device, and was told apart
    # Four times the rows, about as many waits: transformers' SDPA mask asks once or twice more or less,
    # whether or not a batch holds padding (the rollouts decide).
    assert counts[1] <= counts[0] + 2 and max(counts) <= 16, counts


def test_a_sampled_evaluation_reports_pass_at_k_of_its_samples_and_leaves_the_rng_alone(
    raw, tokenizer, monkeypatch
):
    """eval.samples = 4 at temperature 1 on the simulated accelerator: eval/reward is the mean of the 12
    completions' rewards, pass@k is Chen et al.'s estimator over each prompt's 4 (recomputed here from the
    scored values), per reward and per task too; the same share scores the same twice (the lead may score a
    late replica's share), and the process's random state is as it was."""
    from composer_serverless.objectives.rewards import RewardSet

    config = validate_config(
        raw(rewards=[{"fn": "format", "pattern": ".*[0-9].*"}, {"fn": "exact_match", "weight": 0}])
        | {"eval": {"sequences": 3, "temperature": 1.0, "samples": 4, "pass_at": [1, 2, 4]}}
    )
    scored = []
    score = RewardSet.score
    monkeypatch.setattr(
        RewardSet, "score", lambda self, *a, **k: scored.append(score(self, *a, **k)) or scored[-1]
    )
    with simulated():
        model = tiny_model(tokenizer).to("cuda")
        objective = make_objective(config, tokenizer, 0, model=model)
        cpu, device = torch.get_rng_state(), torch.cuda.get_rng_state()
        evaluation = evaluate(objective, model)
        assert torch.equal(torch.get_rng_state(), cpu) and torch.equal(torch.cuda.get_rng_state(), device)
        assert evaluate(objective, model) == evaluation
    (totals,) = {tuple(s.totals) for s in scored}  # the same completions both times
    assert len(totals) == 12
    groups = [totals[i : i + 4] for i in range(0, 12, 4)]
    assert len(set(scored[0].by_reward["format"])) > 1, "the samples differ, or pass@k would be trivial"
    assert evaluation["eval/reward"] == pytest.approx(sum(totals) / 12)
    for k in (1, 2, 4):
        # 1 - C(4 - c, k) / C(4, k), with c the completions of a prompt that pass (reward >= 1).
        chance = [1 - math.comb(4 - sum(t >= 1 for t in g), k) / math.comb(4, k) for g in groups]
        assert evaluation[f"eval/pass@{k}"] == pytest.approx(sum(chance) / 3)
        assert evaluation[f"eval/format/pass@{k}"] == evaluation[f"eval/pass@{k}"]
    assert evaluation["eval/pass@1"] == pytest.approx(sum(t >= 1 for t in totals) / 12)
    assert evaluation["eval/pass@1"] <= evaluation["eval/pass@2"] <= evaluation["eval/pass@4"]
    # HELDOUT's tasks: 'first' has two prompts (groups 0 and 1 in the stratified order), 'add' one.
    assert {"eval/task/add/pass@2", "eval/task/first/pass@2", "eval/exact_match/pass@4"} <= evaluation.keys()
    assert evaluation["eval/exact_match"] == pytest.approx(sum(scored[0].by_reward["exact_match"]) / 12)


def test_greedy_evaluation_is_unchanged_by_pass_at_1(raw, model, tokenizer, monkeypatch):
    """Greedy decoding (the default) with pass@1: the same figures as without it, and pass@1 is the share of
    prompts whose one completion reaches the threshold."""
    from composer_serverless.objectives.rewards import RewardSet

    plain = evaluate(make_objective(validate_config(raw()), tokenizer, 0, model=model), model)
    config = validate_config(raw() | {"eval": {"sequences": 3, "pass_at": [1], "pass_threshold": 0.5}})
    scored = []
    score = RewardSet.score
    monkeypatch.setattr(
        RewardSet, "score", lambda self, *a, **k: scored.append(score(self, *a, **k)) or scored[-1]
    )
    evaluation = evaluate(make_objective(config, tokenizer, 0, model=model), model)
    assert {k: v for k, v in evaluation.items() if "pass@" not in k} == plain
    (totals,) = [s.totals for s in scored]
    assert len(totals) == 3
    assert evaluation["eval/pass@1"] == pytest.approx(sum(t >= 0.5 for t in totals) / 3)
