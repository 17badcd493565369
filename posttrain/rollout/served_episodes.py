"""Episodes collected through `posttrain serve` by an outside harness (a verifiers environment, an agent loop over
an OpenAI client), as token samples a GRPO update trains on (posttrain.trainers.episode_grpo).

    samples = samples_from_steps(steps, reward=1.0, group="example-3")   # one episode's model calls
    samples = samples_from_verifiers(results["outputs"])                 # verifiers' evaluate()/generate() outputs

A harness sees an episode as a list of model calls ("steps"). Each call the server answered with
`return_token_ids` and `logprobs` gives its prompt's token ids, the sampled tokens and each one's logprob (the
engine's log softmax(z / T) of what was drawn). A step whose prompt begins with the previous sample's prompt
and completion continues that sample: the tokens in between (the environment's reply and the chat template's
markup around it) join the completion with mask 0, so the loss never lands on them; a step whose prompt does
not (the harness rewrote its history, or the template re-tokenised the last reply) starts a new sample. Every
sample of an episode carries the episode's reward and its group (the prompt the GRPO group shares).

Forced tool-call prefills (`tool_choice`) are part of the server's prompt_token_ids, never of token_ids, so
they land on the mask-0 side here too.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from posttrain.errors import PosttrainError


@dataclass
class TokenSample:
    """One training sequence: `prompt_ids` then `completion_ids`, with per completion token a mask (1: sampled by
    the model, trained; 0: observation) and the logprob it was sampled with (0.0 on observations)."""

    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    completion_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    reward: float = 0.0
    group: Hashable = 0

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.completion_ids

    @property
    def num_model_tokens(self) -> int:
        return sum(self.completion_mask)


def samples_from_steps(steps: Sequence[Mapping[str, Any]], reward: float, group: Hashable) -> list[TokenSample]:
    """One episode's model calls, in order, each a mapping with `prompt_ids`, `completion_ids` and
    `completion_logprobs` (a server reply's prompt_token_ids, choices[0].token_ids and logprobs), as samples."""
    samples: list[TokenSample] = []
    for number, step in enumerate(steps):
        prompt, sampled, logprobs = _step_tokens(step, number)
        last = samples[-1] if samples else None
        if last is not None and prompt[: len(last.ids)] == last.ids:
            between = prompt[len(last.ids) :]
        else:
            last = TokenSample(prompt_ids=prompt, reward=float(reward), group=group)
            samples.append(last)
            between = []
        last.completion_ids += between + sampled
        last.completion_mask += [0] * len(between) + [1] * len(sampled)
        last.logprobs += [0.0] * len(between) + logprobs
    return samples


def samples_from_verifiers(outputs: Sequence[Mapping[str, Any]]) -> list[TokenSample]:
    """verifiers (0.1.x) rollout outputs, collected with `state_columns=["trajectory"]` and sampling_args asking for
    `logprobs` and `extra_body={"return_token_ids": True}`: each output's trajectory steps, grouped by its
    `example_id`, with its `reward`."""
    samples: list[TokenSample] = []
    for index, output in enumerate(outputs):
        trajectory = output.get("trajectory")
        if not trajectory:
            raise PosttrainError(
                f"verifiers output {index} has no trajectory: collect with state_columns=['trajectory']"
            )
        steps = []
        for number, step in enumerate(trajectory):
            tokens = step.get("tokens")
            if not tokens:
                raise PosttrainError(
                    f"verifiers output {index}, step {number} has no tokens: sample with logprobs=True and "
                    "extra_body={'return_token_ids': True}"
                )
            steps.append(tokens)
        samples += samples_from_steps(steps, float(output["reward"]), output["example_id"])
    return samples


def _step_tokens(step: Mapping[str, Any], number: int) -> tuple[list[int], list[int], list[float]]:
    missing = [key for key in ("prompt_ids", "completion_ids", "completion_logprobs") if step.get(key) is None]
    if missing:
        raise PosttrainError(f"step {number} lacks {', '.join(missing)}")
    prompt, sampled, logprobs = (
        list(step["prompt_ids"]),
        list(step["completion_ids"]),
        list(step["completion_logprobs"]),
    )
    if len(logprobs) != len(sampled):
        raise PosttrainError(
            f"step {number} has {len(sampled)} completion ids but {len(logprobs)} logprobs (one per sampled token)"
        )
    return prompt, sampled, [float(x) for x in logprobs]
