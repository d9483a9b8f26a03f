"""A synthetic day of inference traffic, the shape a KV-cache tier actually sees.

Two traffic classes, as in docs/rules.md §7:
- **chatbot** sessions: one of a few shared system prompts, then turns that each append a user
  message and the model's reply, so every turn's prompt is the previous prompt plus a suffix;
- **agent** loops: a long tool-use system prompt and a task, then steps that each append a tool
  call and its (often long) output.

Requests are spread over a simulated day with a diurnal rate and interleaved across sessions, so
prefix reuse comes from (a) shared system prompts across sessions and (b) each session's own
growing history, just as in production. Everything is a pure function of the seed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from kvstore.errors import InvalidArgument

DAY_S = 86_400.0
VOCAB = 128_000


@dataclass(frozen=True)
class WorkloadConfig:
    seed: int = 7
    chatbot_sessions: int = 40
    agent_sessions: int = 12
    system_prompts: int = 3
    chatbot_system_tokens: tuple[int, int] = (1_500, 4_000)
    chatbot_turns: tuple[int, int] = (2, 7)
    chatbot_user_tokens: tuple[int, int] = (40, 400)
    chatbot_reply_tokens: tuple[int, int] = (100, 600)
    agent_system_tokens: tuple[int, int] = (6_000, 9_000)
    agent_task_tokens: tuple[int, int] = (200, 1_500)
    agent_steps: tuple[int, int] = (4, 12)
    agent_step_tokens: tuple[int, int] = (300, 3_000)
    max_prompt_tokens: int = 65_536

    def __post_init__(self) -> None:
        for name in ("chatbot_sessions", "agent_sessions", "system_prompts"):
            if getattr(self, name) < 0:
                raise InvalidArgument(name, f"must be ≥ 0, got {getattr(self, name)}")
        if self.system_prompts == 0 and self.chatbot_sessions:
            raise InvalidArgument("system_prompts", "chatbot sessions need at least one")
        for name in (
            "chatbot_system_tokens",
            "chatbot_turns",
            "chatbot_user_tokens",
            "chatbot_reply_tokens",
            "agent_system_tokens",
            "agent_task_tokens",
            "agent_steps",
            "agent_step_tokens",
        ):
            low, high = getattr(self, name)
            if not 0 < low <= high:
                raise InvalidArgument(name, f"must be a range 0 < low ≤ high, got {(low, high)}")


@dataclass(frozen=True)
class Request:
    """One prefill request: the full prompt of one turn/step of one session."""

    at_s: float  # simulated time of day
    session: str
    traffic_class: str  # "chatbot" | "agent"
    tokens: np.ndarray = field(repr=False)  # uint32 token ids

    @property
    def prompt_len(self) -> int:
        return int(self.tokens.size)


def _span(rng: np.random.Generator, bounds: tuple[int, int]) -> int:
    return int(rng.integers(bounds[0], bounds[1] + 1))


def _tokens(rng: np.random.Generator, count: int) -> np.ndarray:
    return rng.integers(0, VOCAB, size=count, dtype=np.uint32)


def _diurnal_start(rng: np.random.Generator) -> float:
    # Busier in the (simulated) afternoon: a raised cosine over the day, sampled by rejection.
    while True:
        t = float(rng.uniform(0.0, DAY_S))
        if rng.uniform() < 0.35 + 0.65 * (1 - math.cos(2 * math.pi * t / DAY_S)) / 2:
            return t


def _chatbot_session(
    rng: np.random.Generator, name: str, system: np.ndarray, config: WorkloadConfig
) -> list[Request]:
    prompt = system
    at = _diurnal_start(rng)
    requests = []
    for _turn in range(_span(rng, config.chatbot_turns)):
        prompt = np.concatenate([prompt, _tokens(rng, _span(rng, config.chatbot_user_tokens))])
        if prompt.size > config.max_prompt_tokens:
            break
        requests.append(Request(at, name, "chatbot", prompt))
        prompt = np.concatenate([prompt, _tokens(rng, _span(rng, config.chatbot_reply_tokens))])
        at += float(rng.uniform(20.0, 600.0))  # the user reads and types
    return requests


def _agent_session(
    rng: np.random.Generator, name: str, system: np.ndarray, config: WorkloadConfig
) -> list[Request]:
    prompt = np.concatenate([system, _tokens(rng, _span(rng, config.agent_task_tokens))])
    at = _diurnal_start(rng)
    requests = []
    for _step in range(_span(rng, config.agent_steps)):
        if prompt.size > config.max_prompt_tokens:
            break
        requests.append(Request(at, name, "agent", prompt))
        prompt = np.concatenate([prompt, _tokens(rng, _span(rng, config.agent_step_tokens))])
        at += float(rng.uniform(2.0, 60.0))  # a tool runs, then the agent goes on
    return requests


def synthetic_day(config: WorkloadConfig | None = None) -> list[Request]:
    """All requests of the day, in time order."""
    config = config or WorkloadConfig()
    rng = np.random.default_rng(config.seed)
    systems = [
        _tokens(rng, _span(rng, config.chatbot_system_tokens)) for _ in range(config.system_prompts)
    ]
    agent_system = _tokens(rng, _span(rng, config.agent_system_tokens))
    requests: list[Request] = []
    for index in range(config.chatbot_sessions):
        system = systems[int(rng.integers(0, len(systems)))]
        requests += _chatbot_session(rng, f"chat-{index}", system, config)
    for index in range(config.agent_sessions):
        requests += _agent_session(rng, f"agent-{index}", agent_system, config)
    requests.sort(key=lambda request: (request.at_s, request.session))
    return requests
