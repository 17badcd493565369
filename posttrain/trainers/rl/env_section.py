"""`env:` of `posttrain grpo` and `posttrain ppo`: train on multi-turn episodes with an environment and its tools (docs/agents.md).

Without an `env:` section a run is the single-turn one, unchanged. With it, every rollout sample is an episode
(posttrain.rollout.episodes): the environment opens it from the data row, the model's turns are parsed for
tool calls and answered with observations until the environment ends it or a limit truncates it. Each model
turn samples at most `rollout.max_tokens` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from posttrain.envs.latency import with_latency
from posttrain.envs.tool_calls import ToolCallParser
from posttrain.errors import PosttrainError
from posttrain.rollout.chat_tokens import ChatTokens
from posttrain.rollout.episode_batch import EpisodeOptions
from posttrain.rollout.episodes import EpisodeLimits
from posttrain.trainers.rl.sections import need


@dataclass
class EnvSection:
    name: str = ""  # a built-in environment (calculator, guess_number) or path/to/file.py:Class
    tools: list[str] = field(default_factory=list)  # tools to give it beyond its own (built-in names)
    options: dict[str, Any] = field(default_factory=dict)  # keyword options of the environment
    # How tool calls are read from a model turn: a posttrain.envs.tool_calls name or path.py:function. The chat
    # template that renders tools and tool messages is the model's: `model.chat_template` (chatml_tools).
    parser: str = "hermes"
    max_turns: int = 4  # model turns per episode; a turn past it ends the episode truncated
    max_episode_tokens: int = 512  # tokens after the opening prompt (model + observations)
    # One tool call, given to the environment as its `tool_timeout_s` option (calculator, tools); null: its default.
    tool_timeout_s: float | None = None
    step_timeout_s: float = 60.0  # one whole environment call (reset, step, episode_reward): the rollout's bound
    # Seconds every answered turn waits (a sleep, no CPU), as a remote tool, sandbox or judge would answer; 0: none.
    # Each waiting episode holds a worker (posttrain.envs.latency): `workers: null` sizes them for it.
    tool_latency_s: float = 0.0
    truncated_reward: Literal["zero", "unscorable"] = "zero"  # a truncated episode's reward: 0, or left out (NaN)
    # Per-step rewards an environment returns: ignore them (outcome only); sum: add their sum to the episode's
    # outcome reward before the group's advantage is taken; per_turn: (token-level advantages: ppo's GAE,
    # reinforce_pp) each on the last model token of the turn that earned it, so the returns credit turn by turn.
    turn_rewards: Literal["ignore", "sum", "per_turn"] = "ignore"
    # Threads running environment calls while the engine decodes. null: DEFAULT_WORKERS, or with tool_latency_s one
    # per episode the rollout can hold at once (`auto_workers`), so that no episode's wait queues behind another's.
    workers: int | None = None

    def validate(self) -> None:
        need(bool(self.name), "name must name an environment (a built-in or path/to/file.py:Class)")
        for name in ("max_turns", "max_episode_tokens"):
            need(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        need(self.workers is None or self.workers >= 1, f"workers must be >= 1 or null, got {self.workers}")
        need(
            self.turn_rewards in ("ignore", "sum", "per_turn"),
            f"turn_rewards must be ignore, sum or per_turn, got {self.turn_rewards!r}",
        )
        for name in ("tool_timeout_s", "step_timeout_s"):
            value = getattr(self, name)
            need(value is None or value > 0, f"{name} must be > 0, got {value}")
        need(self.tool_latency_s >= 0, f"tool_latency_s must be >= 0, got {self.tool_latency_s}")
        need(
            self.tool_latency_s < self.step_timeout_s,
            f"tool_latency_s ({self.tool_latency_s}) must be below step_timeout_s ({self.step_timeout_s}): "
            "every answered turn would time out",
        )


DEFAULT_WORKERS = 4  # environment threads when its calls return at once: enough to overlap a few steps' work
MAX_AUTO_WORKERS = 512  # threads that mostly sleep are cheap, but not free


def auto_workers(env: EnvSection, episodes_in_flight: int) -> int:
    """`env.workers`, or when null: DEFAULT_WORKERS, or with `tool_latency_s` one per episode in flight (each
    waiting episode holds a worker; fewer would queue the waits behind each other)."""
    if env.workers is not None:
        return env.workers
    if env.tool_latency_s == 0:
        return DEFAULT_WORKERS
    return min(max(DEFAULT_WORKERS, episodes_in_flight), MAX_AUTO_WORKERS)


def rollout_in_flight(rollout: Any, eval_size: int) -> int:
    """The most episodes an RL run holds at once: a step's, times the steps an async rollout runs ahead
    (at most `max_staleness`), or a held-out evaluation's."""
    batch = rollout.prompts_per_step * rollout.samples_per_prompt
    ahead = rollout.max_staleness if rollout.mode == "async" else 0
    return max(batch * (1 + ahead), eval_size)


def rl_episode_options(cfg: Any, env: EnvSection, tokenizer: Any, **env_args: Any) -> EpisodeOptions:
    """`episode_options` of an RL run's config: its rollout's token limits, sized for the episodes the run holds
    at once (a step's, the steps async runs ahead, or the held-out evaluation's). `env_args`: `make_env` /
    `parser` given in Python."""
    limits = (cfg.rollout.max_tokens, cfg.rollout.max_prompt_tokens)
    in_flight = rollout_in_flight(cfg.rollout, cfg.data.eval_size)
    return episode_options(env, tokenizer, *limits, **env_args, episodes_in_flight=in_flight)


def load_environment(env: EnvSection) -> tuple[Any, ToolCallParser]:
    """The section's environment factory and tool-call parser (posttrain.envs)."""
    from posttrain.envs.loading import load_environment_factory
    from posttrain.envs.tool_calls import get_tool_call_parser

    options = dict(env.options)
    if env.tool_timeout_s is not None:
        options["tool_timeout_s"] = env.tool_timeout_s
    return load_environment_factory(env.name, tools=env.tools, options=options), get_tool_call_parser(env.parser)


def episode_options(
    env: EnvSection,
    tokenizer: Any,
    max_tokens: int,
    max_prompt_tokens: int,
    make_env: Any = None,
    parser: ToolCallParser | None = None,
    episodes_in_flight: int = 0,
) -> EpisodeOptions:
    """Everything the rollout needs to play the section's episodes. `make_env` / `parser`: given in Python (a
    test's scripted environment), else loaded from the section. `episodes_in_flight`: the most episodes played at
    once (sizes `workers: null`). One environment is made here to read its tools' schemas, which every episode's
    prompt renders."""
    if make_env is None or parser is None:
        loaded_env, loaded_parser = load_environment(env)
        make_env, parser = make_env or loaded_env, parser or loaded_parser
    make_env = with_latency(make_env, env.tool_latency_s)  # given or loaded alike
    try:
        schemas = [tool.schema for tool in make_env().tools]
    except PosttrainError:
        raise
    except Exception as error:
        raise PosttrainError(f"env.name={env.name!r}: the environment cannot be made ({error})") from error
    chat = ChatTokens(tokenizer, schemas)
    limits = EpisodeLimits(env.max_turns, max_tokens, env.max_episode_tokens, max_prompt_tokens, env.step_timeout_s)
    workers = auto_workers(env, episodes_in_flight)
    return EpisodeOptions(make_env, parser, chat, limits, workers, env.truncated_reward, env.turn_rewards)
