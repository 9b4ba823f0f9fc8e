"""The composer objective: `L_grpo + alpha * L_sdpo + beta * L_replay` as the inner step of DiLoCo.

Every inner step draws this replica's next prompts, samples G completions each with the current model, scores
them with the configured rewards, turns the feedback into SDPO hints, takes the next preference pairs, and
returns `losses.compose.three_channel_loss` on the lot. Evaluation decodes the held-out prompts greedily (or
samples `eval.samples` completions each) and reports the mean reward, overall and per task, with pass@k when
asked. The data position (two cursors) is the objective's state.

The launcher reads the same inputs before any replica starts (`inputs.py`), so a malformed record or a reward
that does not import is reported with its file and line, or its import path, at launch.

At each round's end (`round_ended`) the objective writes the round's rollouts to the store when they are
recorded (`composer.record_rollouts`, or a live harvest), and with a live harvest takes the pair file the
schedule gives that round (`harvest_schedule.py`: the harvest of round j - live_lag, decided once in the store
for every replica, waited for if it has not come) into its replay set, this replica's share of it (pair i to
replica i mod N). For DPO their reference log-probabilities are computed then, once, by the global model of
that round, the same on every replica: the pairs are the current student's mistakes, and the policy that made
them is the reference iterative DPO takes (Yuan et al. 2024, Self-Rewarding Language Models), where the initial
model would need a second copy kept in memory for the whole run. They are kept in the objective's state with
the last round whose decision it applied, so a resumed replica replays the same pairs with the same references
and goes on with the schedule from there. A replica that caught up past some rounds (it loaded a published
state) takes what their decisions took at its next round's end.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import json
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from composer_serverless.config import ComposerConfig, RunConfig
from composer_serverless.data.chat import render_prompt
from composer_serverless.data.records import (
    Cycle,
    PreferencePair,
    PromptRecord,
    pairs_from_jsonl,
    read_pairs,
    shard_records,
)
from composer_serverless.environments.traces import trace_rows, transcript
from composer_serverless.losses import micro
from composer_serverless.losses.batches import LossBatch, RLBatch
from composer_serverless.losses.compose import LossSettings, three_channel_loss
from composer_serverless.losses.grpo import GRPOSettings
from composer_serverless.losses.logprobs import completion_logprobs
from composer_serverless.losses.replay import ReplaySettings
from composer_serverless.losses.sdpo import SDPOSettings
from composer_serverless.objectives import inputs
from composer_serverless.objectives.engines import make_engine
from composer_serverless.objectives.episode_rollout import episode_settings, run_step_episodes, score_episodes
from composer_serverless.objectives.harvest_schedule import (
    HarvesterWatch,
    Taken,
    decide,
    harvest_taken_at,
    read_taken,
)
from composer_serverless.objectives.hints import HintBuilder
from composer_serverless.objectives.lm import Ranks
from composer_serverless.objectives.pairs import ReplayPairs
from composer_serverless.objectives.pass_at_k import prompt_pass_at_k
from composer_serverless.objectives.rewards import RewardSet, Scored, code_root, mean
from composer_serverless.objectives.rollout import (
    Rollout,
    RolloutSettings,
    eos_token_ids,
    generate,
    rollout,
    whole_weights,
)
from composer_serverless.objectives.shares import EvalPart, share
from composer_serverless.rendezvous import layout
from composer_serverless.rendezvous.store import ObjectStore

logger = logging.getLogger(__name__)

# Held-out prompts decoded per generate call during evaluation.
EVAL_BATCH = 256


def eval_seed(seed: int, part: int, parts: int) -> int:
    """The seed a sampled evaluation of share ``part`` of ``parts`` draws from: the same every round (the
    curve moves with the model, not the sampler) and on every rank of a replica (their passes run together)."""
    return (seed * 1_000_003 + parts * 1_009 + part) % 2**63


def loss_settings(config: ComposerConfig, alpha: float) -> LossSettings:
    """The loss settings a composer config describes, with SDPO's weight ``alpha`` resolved
    (``inputs.sdpo_weight``); GRPO and SDPO use the sampling temperature."""
    temperature = config.rollout.temperature
    return LossSettings(
        alpha=alpha,
        beta=config.beta or 0.0,
        grpo=GRPOSettings(
            loss_type=config.grpo.loss_type,
            eps_low=config.grpo.eps_low,
            eps_high=config.grpo.eps_high,
            kl_beta=config.grpo.kl,
            max_completion_length=config.rollout.max_new_tokens,
            temperature=temperature,
        ),
        sdpo=SDPOSettings(
            beta=config.sdpo.beta,
            temperature=temperature,
            top_k=config.sdpo.top_k,
            token_clip=config.sdpo.token_clip,
        ),
        replay=ReplaySettings(
            kind=config.replay.kind,
            dpo_beta=config.replay.dpo_beta,
            simpo_beta=config.replay.simpo_beta,
            simpo_gamma=config.replay.simpo_gamma,
        ),
        chunk_tokens=config.chunk_tokens,
    )


def same_function_twice(model: nn.Module, tokenizer: Any) -> None:
    """Refuse a model whose training-mode forward is random: SDPO's teacher pass reuses the student's weights,
    and with dropout the two passes would be two different networks.

    Checked by running it twice on the same input, so dropout applied as a function (OPT's, Bloom's), LayerDrop
    and any other training-time randomness are caught, not only ``nn.Dropout`` modules.

    Raises:
        ValueError: the two passes differ.
    """
    ids = torch.tensor([tokenizer("The same input, twice.")["input_ids"][:16] or [0]], device=_device(model))
    was_training = model.training
    model.train()
    with torch.no_grad():
        first, second = (model(input_ids=ids, use_cache=False).logits.float() for _ in range(2))
    model.train(was_training)
    gap = (first - second).abs().max().item()
    if gap > 1e-4:
        raise ValueError(
            f"{type(model).__name__} computes a different function on every training-mode pass (logits differ "
            f"by up to {gap:.3g} on one input: dropout or LayerDrop), so SDPO's teacher and student would be "
            "different networks; set model.dropout = 'off'"
        )


def _state_prompt(record: PromptRecord) -> str:
    """A recorded rollout's prompt, as teachers are asked it: the text, or a conversation's last user turn."""
    if isinstance(record.prompt, str):
        return record.prompt
    return next((m["content"] for m in reversed(record.prompt) if m["role"] == "user"), record.key)


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def stratified(records: Sequence[PromptRecord], count: int) -> list[PromptRecord]:
    """Up to ``count`` records taking one of each task in turn (file order within a task), so any count is
    balanced over the tasks however the file is sorted."""
    by_task: dict[str, list[PromptRecord]] = {}
    for record in records:
        by_task.setdefault(record.task, []).append(record)
    out: list[PromptRecord] = []
    depth = 0
    while len(out) < min(count, len(records)):
        out += [rows[depth] for rows in by_task.values() if depth < len(rows)][: count - len(out)]
        depth += 1
    return out


class ComposerObjective:
    """Three-channel loss on fresh rollouts of this replica's prompt shard, plus replayed preference pairs.

    Args:
        config: the run; `config.composer` is this objective's table.
        model: the replica's model at its initial weights. It is the reference of DPO (missing reference
            log-probs are computed with it here) and of the GRPO KL term (a frozen copy is kept when
            `grpo.kl > 0`), so build the objective before the first step and before restoring a checkpoint.
        tokenizer: the run's tokenizer.
        rank: this replica's rank; it selects the data shard and seeds the data order.
        adapters: the peft wrapper of a LoRA run: the KL term's reference is then the base model with the
            adapters switched off, not a second copy of the model.
        run: the run's store, where rollouts are recorded and harvested pairs are found (None: neither).
    """

    def __init__(
        self,
        config: RunConfig,
        model: nn.Module,
        tokenizer: Any,
        rank: int,
        adapters: Any = None,
        run: ObjectStore | None = None,
        node: Ranks | None = None,
    ) -> None:
        composer = inputs.composer_table(config)
        replicas = config.diloco.replicas
        self._node = node if node is not None and node.size > 1 else None
        self._run = run
        self._rank = rank
        self._replicas = replicas
        self._record = run is not None and (composer.record_rollouts or config.live_harvest)
        self._live = run is not None and config.live_harvest
        self._rounds = config.diloco.rounds
        self._lag = config.harvest.live_lag if config.harvest is not None else 0
        self._wait_s = config.harvest.live_wait_s if config.harvest is not None else 0.0
        self._watch = HarvesterWatch(run) if self._live and run is not None else None
        # The last round boundary whose decision this replica applied (the schedule's position).
        self._taken_through = 0
        self._recorded: dict[tuple[str, str], dict[str, Any]] = {}
        self._episodes_recorded = 0  # episodes recorded this round, as traces
        self._completions: list[dict[str, Any]] = []
        self._completions_kept = config.tracking.completions_per_round
        # The pair files in the replay set: the static file's URL, then each harvested file's key in the run.
        self._pair_files: list[str] = []
        self._harvested: list[dict[str, Any]] = []
        self._tokenizer = tokenizer
        self._rewards = RewardSet(composer.rewards, code_root(config))
        train, heldout = inputs.read_prompt_sets(composer)
        inputs.check_columns(composer, train, heldout)
        alpha = inputs.sdpo_weight(composer, train, feedback=False)  # the launcher resolved 'auto' already
        self._settings = loss_settings(composer, alpha)
        self._prompts = shard_records(train, rank, replicas)
        self._cycle = Cycle(len(self._prompts), seed=config.seed * 7919 + rank)
        self._heldout = stratified(heldout, config.eval.sequences)
        self._eval = config.eval
        self._seed = config.seed
        self._micro_batch_size = config.train.micro_batch_size
        self._rollout = RolloutSettings(
            group_size=composer.rollout.group_size,
            prompts_per_step=composer.rollout.prompts_per_step // self._ranks,
            max_new_tokens=composer.rollout.max_new_tokens,
            temperature=composer.rollout.temperature,
            scale_rewards=composer.grpo.scale_rewards,
            dynamic_sampling=composer.rollout.dynamic_sampling,
            max_draws=composer.rollout.max_draws,
            overlong_buffer=composer.rollout.overlong_buffer,
            overlong_penalty=composer.rollout.overlong_penalty,
            render=functools.partial(
                render_prompt, tokenizer, as_chat=composer.chat_template, system=composer.system_prompt
            ),
            engine=make_engine(
                composer.rollout.engine, next(model.parameters()).device, composer.rollout.engine_memory
            ),
            episodes=episode_settings(composer, code_root(config)),
        )
        for record in [train[0], *[r for r in train if r.conversational][:1]]:
            self._rollout.render(record.prompt)  # a tokenizer without a chat template fails here, not later
        self._hints = HintBuilder(composer.hints, self._rollout.render) if alpha > 0 else None
        if alpha > 0:
            same_function_twice(model, tokenizer)
        self._reference: nn.Module | None = None
        self._reference_mode: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
        if composer.grpo.kl > 0 and adapters is not None:
            self._reference, self._reference_mode = model, adapters.disable_adapter
        elif composer.grpo.kl > 0:
            self._reference = copy.deepcopy(model).eval().requires_grad_(False)
        self._pairs = None
        self._dpo = composer.replay.kind == "dpo"
        if composer.replay_on:
            static: list[PreferencePair] = []
            if composer.data.pairs is not None:  # else a live harvest brings them (the config checks)
                static = shard_records(read_pairs(composer.data.pairs), rank, replicas)
                self._pair_files.append(composer.data.pairs)
            self._pairs = ReplayPairs(
                static,
                tokenizer,
                per_step=composer.replay.pairs_per_step,
                seed=config.seed * 7919 + rank,
                reference=model if self._dpo else None,
                chunk_tokens=composer.chunk_tokens,
                render=self._rollout.render,
            )
        logger.info(
            "composer objective: %d prompts, %d pairs on this replica; %d held-out prompts",
            len(self._prompts),
            0 if self._pairs is None else len(self._pairs),
            len(self._heldout),
        )

    @property
    def _ranks(self) -> int:
        return 1 if self._node is None else self._node.size

    def _share(self, rows: int) -> slice:
        """This rank's equal share of ``rows`` rows of the replica's (all of them on one rank)."""
        local = 0 if self._node is None else self._node.local_rank
        size = rows // self._ranks
        return slice(local * size, (local + 1) * size)

    def _draw(self, count: int) -> list[PromptRecord]:
        """``count`` prompts: this rank's share of the replica's next ``count * ranks`` (every rank draws them
        all, in the same order)."""
        drawn = [self._prompts[i] for i in self._cycle.take(count * self._ranks)]
        return drawn[self._share(len(drawn))]

    def _with_reference(self, rl: RLBatch) -> RLBatch:
        if self._reference is None:
            return rl
        with torch.no_grad(), self._reference_mode():
            ref = completion_logprobs(
                self._reference,
                rl.prompt_ids,
                rl.prompt_mask,
                rl.completion_ids,
                rl.completion_mask,
                temperature=self._settings.grpo.temperature,
                chunk_tokens=self._settings.chunk_tokens,
            )
        return dataclasses.replace(rl, ref_logps=ref)

    def losses(self, model: nn.Module) -> Iterator[tuple[torch.Tensor, dict[str, float | torch.Tensor]]]:
        """Rollouts generated in one batch, trained on in micro-batches (``losses.micro``); the rollout's
        metrics come with the first."""
        with whole_weights(model):  # one gathering of a sharded model, not one per generated token
            rolled = rollout(
                model,
                self._tokenizer,
                self._draw,
                self._rewards,
                self._hints,
                self._rollout,
                always_hint=self._node is not None,
            )
        if self._record and rolled.episodes is not None:
            self._record_traces(rolled)
        elif self._record:
            for record, text, reward in zip(
                rolled.records, rolled.samples.texts, rolled.scored.totals, strict=True
            ):
                # An empty completion is no action to prefer another over (a pair's sides are non-empty).
                if text.strip():
                    self._recorded.setdefault(
                        (record.key, text),
                        {
                            "prompt": _state_prompt(record),
                            "student": text,
                            "reward": reward,
                            "task": record.task,
                        },
                    )
        self._sample_completions(rolled)
        replay = None if self._pairs is None else self._pairs.next(next(model.parameters()).device)
        if replay is not None and self._node is not None:
            replay = micro.rows_of(replay, self._share(replay.prompt_ids.size(0)))
        batch = LossBatch(rl=self._with_reference(rolled.rl), hint=rolled.hint, replay=replay)
        scale = 1.0
        if self._node is not None:
            batch, scale = micro.across_ranks(batch, self._node.sum), float(self._node.size)
        extra: dict[str, float | torch.Tensor] = dict(rolled.metrics)
        for part in micro.split(batch, self._micro_batch_size):
            loss, metrics = three_channel_loss(model, part.batch, self._settings)
            # FSDP averages the ranks' gradients: each rank's share of the replica's loss, times G.
            yield loss * scale, {**micro.weighted(part, metrics, scale), **extra}
            extra = {}

    def evaluate_part(self, model: nn.Module, part: int, parts: int) -> EvalPart:
        """Reward of the completions of a share of the held-out prompts (``eval.samples`` each, greedy or
        sampled at ``eval.temperature``), overall (`eval/reward`) and per task (`eval/task/{task}/reward`),
        and the same for each reward (`eval/{name}`, `eval/task/{task}/{name}`), as sums and counts; with
        ``eval.pass_at``, pass@k beside each (`eval/pass@k`, `eval/{name}/pass@k`, ...), a sum over prompts.

        Sampling draws from its own seed, made of the run's seed and the share, and leaves the process's
        random state as it found it: the lead that scores a late replica's share scores what that replica
        would have, and an evaluation changes nothing the training samples after it."""
        records = share(self._heldout, part, parts)
        if not records:
            return {}
        n = self._eval.samples
        sampled = self._eval.temperature > 0
        device = next(model.parameters()).device
        forked = (
            torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])
            if sampled
            else contextlib.nullcontext()
        )
        texts: list[str] = []
        token_ids: list[list[int]] = []
        truncated: list[bool] = []
        episode_scores: list[float] = []
        per_call = max(1, EVAL_BATCH // n)  # prompts per generate call: at most EVAL_BATCH rows
        with forked:
            if sampled:
                torch.manual_seed(eval_seed(self._seed, part, parts))
            for start in range(0, len(records), per_call):
                chunk = records[start : start + per_call]
                if self._rollout.episodes is not None:  # episodes, each of its own environment
                    rows = [r for r in chunk for _ in range(n)]
                    episodes = run_step_episodes(
                        model,
                        self._tokenizer,
                        rows,
                        self._rollout.episodes,
                        self._rollout.engine,
                        self._eval.temperature if sampled else None,
                        eos_token_ids(model, self._tokenizer),
                    )
                    episode_scores += score_episodes(
                        episodes, rows, self._rewards, self._rollout.episodes
                    ).totals
                    continue
                samples = generate(
                    model,
                    self._tokenizer,
                    [self._rollout.render(r.prompt) for r in chunk],
                    max_new_tokens=self._rollout.max_new_tokens,
                    temperature=self._eval.temperature if sampled else None,
                    repeats=n,
                )
                texts += samples.texts
                token_ids += samples.token_ids
                truncated += samples.truncated.tolist()
        rows = [r for r in records for _ in range(n)]
        if self._rollout.episodes is not None:
            # The episodes' summed rewards (the environment's included), one value per reward: 'reward'.
            scored = Scored(episode_scores, {}, [None] * len(rows))
        else:
            scored = self._rewards.score(texts, rows, token_ids, truncated)
        out: EvalPart = {}
        for name, values in (("reward", scored.totals), *scored.by_reward.items()):
            out[f"eval/{name}"] = mean(values)  # over the rows a reward applies to
            by_task: dict[str, list[float | None]] = {}
            for record, value in zip(rows, values, strict=True):
                by_task.setdefault(record.task, []).append(value)
            out.update({f"eval/task/{task}/{name}": mean(v) for task, v in sorted(by_task.items())})
            out.update(self._pass_at(name, records, values))
        return out

    def _pass_at(self, name: str, records: list[PromptRecord], values: list[float | None]) -> EvalPart:
        """pass@k of each k in ``eval.pass_at`` for the reward ``name`` ('reward': the weighted sum), overall
        and per task: sums over the prompts with at least k scored completions, and their counts."""
        n, threshold = self._eval.samples, self._eval.pass_threshold
        prefix = "" if name == "reward" else f"{name}/"
        out: EvalPart = {}
        for k in self._eval.pass_at:
            estimates = [
                prompt_pass_at_k(values[i * n : (i + 1) * n], k, threshold) for i in range(len(records))
            ]
            out[f"eval/{prefix}pass@{k}"] = mean(estimates)
            by_task: dict[str, list[float | None]] = {}
            for record, estimate in zip(records, estimates, strict=True):
                by_task.setdefault(record.task, []).append(estimate)
            out.update({f"eval/task/{task}/{prefix}pass@{k}": mean(v) for task, v in sorted(by_task.items())})
        return out

    def _record_traces(self, rolled: Rollout) -> None:
        """Each episode as its trace, one row per state (``environments.traces``), numbered in the round's
        order (the ids are made at the round's end, where the round is known)."""
        assert rolled.episodes is not None
        for episode, record, reward in zip(
            rolled.episodes, rolled.records, rolled.scored.totals, strict=True
        ):
            number, self._episodes_recorded = self._episodes_recorded, self._episodes_recorded + 1
            for row in trace_rows(episode, reward, record.task):
                self._recorded[("trace", f"{number}-{row['turn']}")] = {"episode": number, **row}

    def _round_rows(self, round_index: int) -> list[dict[str, Any]]:
        """The round's recorded rows with their ids: a trace's states ``r{rank}-k{round}-e{n}-t{turn}`` of
        episode ``r{rank}-k{round}-e{n}``, a completion's ``r{rank}-k{round}-{n}``."""
        rows = []
        for n, row in enumerate(self._recorded.values()):
            if "episode" in row:
                episode = f"r{self._rank}-k{round_index}-e{row['episode']}"
                rows.append({**row, "id": f"{episode}-t{row['turn']}", "episode": episode})
            else:
                rows.append({"id": f"r{self._rank}-k{round_index}-{n}", **row})
        return rows

    def _sample_completions(self, rolled: Rollout) -> None:
        """Keep the round's first completion of each prompt, up to ``tracking.completions_per_round``: the
        completions table the trackers show (and the round's metrics row holds), chosen without randomness so
        that watching a run never changes it."""
        g = self._rollout.group_size
        for i in range(0, len(rolled.records), g):
            if len(self._completions) >= self._completions_kept:
                return
            self._completions.append(
                {
                    "prompt": _state_prompt(rolled.records[i]),
                    "completion": rolled.samples.texts[i]
                    if rolled.episodes is None
                    else transcript(rolled.episodes[i].messages),
                    "reward": rolled.scored.totals[i],
                    **{
                        f"reward/{name}": values[i]
                        for name, values in rolled.scored.by_reward.items()
                        if values[i] is not None
                    },
                }
            )

    def round_ended(
        self,
        round_index: int,
        global_model: Callable[[], contextlib.AbstractContextManager[nn.Module]],
        waiting: Callable[[str], None],
    ) -> dict[str, Any]:
        """Record the round's rollouts and take the harvested pairs the schedule gives this round (see the
        module); returns the pair files the round replayed (``replay_files``) and, with a live harvest, those
        taken for the next rounds (``replay_files_new``), how long this replica waited for them and what was
        decided (``harvest_wait_s``, ``harvest``)."""
        fields: dict[str, Any] = {}
        if self._completions:
            fields["completions"], self._completions = self._completions, []
        if self._pairs is not None:
            fields["replay_files"] = list(self._pair_files)
        if self._record and self._run is not None:
            rows = self._round_rows(round_index)
            data = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
            self._run.put(layout.rollouts(round_index, self._rank), data.encode())
            self._recorded, self._episodes_recorded = {}, 0
        if self._live and self._pairs is not None:
            fields.update(self._take_harvested(round_index, global_model, waiting))
        return fields

    def _take_harvested(
        self,
        round_index: int,
        global_model: Callable[[], contextlib.AbstractContextManager[nn.Module]],
        waiting: Callable[[str], None],
    ) -> dict[str, Any]:
        """Apply the decisions of every round boundary since the last one applied: this round's, waited for,
        and those of rounds this replica caught up past, read."""
        assert self._run is not None and self._pairs is not None and self._watch is not None
        fields: dict[str, Any] = {}
        files: list[str] = []
        for j in range(self._taken_through + 1, round_index + 1):
            k = harvest_taken_at(j, self._lag, self._rounds)
            if k is None:
                continue
            taken: Taken | None
            if j == round_index:
                taken, waited = decide(self._run, j, k, self._rank, self._wait_s, self._watch, waiting)
                fields.update(taken.row(waited))
            else:
                taken = read_taken(self._run, j, k)
                if taken is None:  # every round a replica passes over was ended, and decided, by another
                    logger.warning("no decision of round %d's end in the store: nothing taken for it", j)
                    continue
            files += taken.files
        self._taken_through = round_index
        if files:
            with global_model() as model:
                for key in files:
                    shard = self._harvested_shard(key)
                    refs = self._pairs.extend(shard, model if self._dpo else None)
                    self._harvested.append(
                        {"file": key.removeprefix(f"{layout.HARVEST_PAIRS}/"), "refs": refs}
                    )
                    self._pair_files.append(key)
                    logger.info("replaying %d harvested pairs of %s from now on", len(shard), key)
        fields["replay_files_new"] = files
        return fields

    def _harvested_shard(self, key: str) -> list[PreferencePair]:
        assert self._run is not None
        pairs = pairs_from_jsonl(self._run.get(key), self._run.url_of(key))
        return pairs[self._rank :: self._replicas]

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"prompts": self._cycle.state_dict()}
        if self._pairs is not None:
            state["pairs"] = self._pairs.state_dict()
        if self._live:
            state["harvested"] = self._harvested
            state["taken_through"] = self._taken_through
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._cycle.load_state_dict(state["prompts"])
        if self._pairs is not None:
            for harvested in state.get("harvested", []):
                if harvested["file"] in {h["file"] for h in self._harvested}:
                    continue
                key = f"{layout.HARVEST_PAIRS}/{harvested['file']}"
                self._pairs.extend(self._harvested_shard(key), None, refs=harvested["refs"])
                self._harvested.append(harvested)
                self._pair_files.append(key)
            self._pairs.load_state_dict(state["pairs"])
        self._taken_through = state.get("taken_through", self._taken_through)
