"""The SDPO teacher's hint: what the model would have liked to know, inserted into its prompt.

Following the SDPO reference code (lasgroup/SDPO, `RayPPOTrainer._maybe_build_self_distillation_batch`), a
rollout's hint is built from, in order:

- the record's own `hint`, if the data carries one;
- a solution: the first completion of the same group whose reward reached `success_threshold`, never the row's
  own (a success teaches its siblings; SDPO's `dont_reprompt_on_self_success`);
- otherwise the reward feedback on the row's completion (the expected answer, the first failing test); with a
  solution present the feedback is left out, as SDPO's `environment_feedback_only_without_solution` does.

A row with none of these gets no hint, and SDPO does not train on it. The teacher's prompt is `template` with
the hint and the original prompt filled in (for a conversation, the last user turn's content); the teacher
then scores the student's own completion.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from composer_serverless.config import HintConfig
from composer_serverless.data.chat import Rendered
from composer_serverless.data.records import Prompt, PromptRecord


class HintBuilder:
    """Turns records, completions and reward feedback into teacher prompts (None where there is no hint)."""

    def __init__(
        self,
        config: HintConfig,
        render: Callable[[Prompt], Rendered] = lambda prompt: Rendered(str(prompt), templated=False),
    ) -> None:
        self._config = config
        self._render = render  # the teacher's prompt as the model reads it (rendered as the student's is)

    def hint(self, record: PromptRecord, feedback: str | None, solution: str | None) -> str | None:
        """The hint text for one rollout, or None."""
        parts = [record.hint] if record.hint else []
        if solution is not None:
            parts.append(self._config.solution.format(solution=solution))
        elif feedback:
            parts.append(self._config.feedback.format(feedback=feedback))
        return "\n".join(parts) if parts else None

    def teacher_prompt(self, record: PromptRecord, hint: str) -> Rendered:
        if isinstance(record.prompt, str):
            return self._render(self._config.template.format(hint=hint, prompt=record.prompt))
        messages = [dict(m) for m in record.prompt]
        users = [i for i, m in enumerate(messages) if m["role"] == "user"]
        if users:
            last = messages[users[-1]]
            last["content"] = self._config.template.format(hint=hint, prompt=last["content"])
        else:
            messages.append({"role": "user", "content": self._config.template.format(hint=hint, prompt="")})
        return self._render(tuple(messages))

    def group_hints(
        self,
        records: Sequence[PromptRecord],
        completions: Sequence[str],
        rewards: Sequence[float],
        feedback: Sequence[str | None],
        group_size: int,
    ) -> list[Rendered | None]:
        """Teacher prompts for rows laid out as groups of ``group_size`` consecutive completions of a record.

        Args:
            records: one record per row (repeated across its group).
            completions: the sampled completion of each row.
            rewards: each row's total reward.
            feedback: each row's reward feedback.
            group_size: G.

        Returns:
            Per row, the teacher's prompt, or None when the row has no hint.
        """
        rows = len(records)
        if not (len(completions) == len(rewards) == len(feedback) == rows) or rows % group_size:
            raise ValueError(f"{rows} rows do not form groups of {group_size} with one value each")
        prompts: list[Rendered | None] = []
        for start in range(0, rows, group_size):
            group = range(start, start + group_size)
            successes = [i for i in group if rewards[i] >= self._config.success_threshold]
            for i in group:
                solution = None
                if self._config.use_solutions:
                    solution = next((completions[j] for j in successes if j != i), None)
                hint = self.hint(records[i], feedback[i], solution)
                prompts.append(None if hint is None else self.teacher_prompt(records[i], hint))
        return prompts
