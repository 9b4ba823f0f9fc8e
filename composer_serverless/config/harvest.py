"""The ``[harvest]`` table: N OpenAI-compatible teachers asked about each state of a student's trace, their
agreement, the spending cap, where the states come from and where the pairs go.

One table serves both ways of harvesting: ``composer-serverless harvest CONFIG`` reads it from any TOML file
(a run's config or a file holding only ``[harvest]``), and in a run's config ``live = true`` makes the
launcher harvest the replicas' rollouts between rounds. Keys never appear here: a teacher names the
environment variable that holds its key (``api_key_env``), read when a request is sent.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from composer_serverless.config.base import StrictModel

TEACHER_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,31}$")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
# How API keys begin (OpenAI and Anthropic sk-, Hugging Face hf_, Google AIza, Groq gsk_, xAI xai-): a value
# like one in api_key_env is a key pasted where its variable's name belongs. So is a long run of mixed-case
# letters and digits, which no one names a variable with.
KEY_PREFIX = re.compile(r"^(sk-|sk_|hf_|AIza|gsk_|xai-|pplx-)")


def _key_shaped(value: str) -> bool:
    mixed = any(c.islower() for c in value) and any(c.isdigit() for c in value)
    return bool(KEY_PREFIX.match(value)) or (len(value) >= 32 and mixed)


LOOPBACK_HOSTS = frozenset({"localhost"})


def _is_loopback(host: str) -> bool:
    if host.lower() in LOOPBACK_HOSTS:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class TeacherConfig(StrictModel):
    """One OpenAI-compatible chat endpoint (``POST {base_url}/chat/completions``) and what it costs."""

    name: str = Field(description="short name, unique among the teachers (1-32 of a-z, 0-9, '_', '-')")
    base_url: str = Field(
        description="the API root the OpenAI client would take, e.g. https://api.openai.com/v1 or "
        "http://127.0.0.1:8000/v1; requests go to {base_url}/chat/completions"
    )
    model: str = Field(min_length=1, description="the model name sent in every request")
    api_key_env: str | None = Field(
        None,
        description="NAME of the environment variable holding the API key (sent as a Bearer token), read "
        "when each request is sent; unset for a server that needs none",
    )
    usd_per_m_input: float = Field(ge=0, le=10_000, description="USD per million input (prompt) tokens")
    usd_per_m_output: float = Field(
        ge=0, le=10_000, description="USD per million output (completion) tokens, reasoning tokens included"
    )
    concurrency: int = Field(8, ge=1, le=512, description="requests in flight to this teacher at most")
    max_tokens: int = Field(
        256, ge=1, le=1_000_000, description="output tokens per answer at most; bounds each request's cost"
    )
    max_tokens_field: Literal["max_tokens", "max_completion_tokens"] = Field(
        "max_tokens",
        description="the request field that carries max_tokens: 'max_tokens' (most servers) or "
        "'max_completion_tokens' (OpenAI's reasoning models refuse the other)",
    )
    temperature: float | None = Field(
        0.0, ge=0, le=2, description="sampling temperature sent; unset to send none (the server's default)"
    )
    extra_input_tokens: int = Field(
        0,
        ge=0,
        le=1_000_000,
        description="input tokens the server adds to every request beyond what the request carries (a system "
        "prompt of its own), added to the cost bound",
    )

    @field_validator("name")
    @classmethod
    def _valid_name(cls, name: str) -> str:
        if not TEACHER_NAME.match(name):
            raise ValueError(f"{name!r} is not a teacher name: use 1-32 of a-z, 0-9, '_' and '-'")
        return name

    @field_validator("base_url")
    @classmethod
    def _valid_base_url(cls, url: str) -> str:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{url!r} is not an http(s) URL, e.g. https://api.openai.com/v1")
        if parts.username or parts.password:
            raise ValueError(
                f"{parts.scheme}://...@{parts.hostname}: credentials in the URL would be written wherever the "
                "URL is (configs, plans, logs); put the key in an environment variable named by api_key_env"
            )
        if parts.query or parts.fragment:
            raise ValueError(f"{url!r}: the base URL takes no query or fragment")
        return url.rstrip("/")

    @field_validator("api_key_env")
    @classmethod
    def _a_name_not_a_key(cls, name: str | None) -> str | None:
        if name is None:
            return None
        if _key_shaped(name) or not ENV_NAME.match(name):
            # The value itself is never repeated: it may be the key.
            raise ValueError(
                "api_key_env must be the NAME of an environment variable (e.g. OPENAI_API_KEY), not a key; "
                "this value looks like a key or is not a variable name. Remove it from the file"
            )
        return name

    @model_validator(mode="after")
    def _no_key_in_clear_text(self) -> TeacherConfig:
        parts = urlsplit(self.base_url)
        if self.api_key_env and parts.scheme == "http" and not _is_loopback(parts.hostname or ""):
            raise ValueError(
                f"teacher {self.name!r}: {self.base_url} is plain http to another machine, so the key in "
                f"{self.api_key_env} would cross the network unencrypted; use https://"
            )
        return self

    @property
    def identity(self) -> tuple[str, str]:
        """What answers are cached under: the endpoint and the model (not the name, not the price)."""
        return self.base_url, self.model


class NormaliseConfig(StrictModel):
    """How an answer is turned into the text compared between teachers and with the student."""

    final_answer: str | None = Field(
        None,
        description="a regular expression (Python re); the answer is its last match in the text (its first "
        "group, if it has one). A teacher whose text does not match abstains; the student's text is then "
        "compared whole. Unset: the whole text",
    )
    strip: bool = Field(True, description="remove leading and trailing whitespace")
    collapse_whitespace: bool = Field(True, description="turn every run of whitespace into one space")
    casefold: bool = Field(False, description="compare case-insensitively (Unicode casefold)")
    trim_chars: str = Field(
        "", description="characters removed from both ends after extraction, e.g. '.' for 'is 7.'"
    )

    @field_validator("final_answer")
    @classmethod
    def _valid_regex(cls, pattern: str | None) -> str | None:
        if pattern is None:
            return None
        try:
            compiled = re.compile(pattern)
        except re.error as e:
            raise ValueError(f"{pattern!r} is not a valid regular expression: {e}") from None
        if compiled.groups > 1:
            raise ValueError(f"{pattern!r} has {compiled.groups} groups; use at most one (the answer)")
        return pattern


class HarvestConfig(StrictModel):
    """Preference pairs from N teachers: for each state (a prompt and the student's answer to it) every
    teacher is asked the prompt; the answer at least ``threshold`` of them agree on is chosen, and the
    student's answer, where it differs, is rejected."""

    teachers: list[TeacherConfig] = Field(
        min_length=1, description="the endpoints asked ([[harvest.teachers]])"
    )
    threshold: int = Field(
        2, ge=1, description="teachers that must give the same (normalised) answer for it to be chosen"
    )
    max_usd: float = Field(
        gt=0,
        le=1_000_000,
        description="hard cap on what the harvest may spend (a live harvest: over the whole run); no request "
        "is sent that could take the spend past it",
    )
    traces: str | None = Field(
        None,
        description="states from a trace file: JSONL or Parquet rows {prompt, student, id?, reward?, task?} "
        "(a path, fsspec URL or glob)",
    )
    run: str | None = Field(
        None, description="states from a run instead: its URL; the rollouts of its latest recorded round"
    )
    output: str | None = Field(
        None, description="where the pairs go: a .jsonl path or fsspec URL (not for a live harvest)"
    )
    cache: str | None = Field(
        None,
        description="a store URL for the answer cache; unset: the run's own (harvest/cache/ in the run of "
        "`run`, or of a live harvest)",
    )
    system: str | None = Field(None, description="a system message sent before each prompt")
    template: str = Field("{prompt}", description="the user message; {prompt} is the state's prompt")
    normalise: NormaliseConfig = Field(NormaliseConfig(), description="how answers are compared")
    max_states: int | None = Field(
        None,
        ge=1,
        description="distinct prompts asked per harvest at most: a run's lowest-reward ones first, a trace "
        "file's first ones; unset: all",
    )
    timeout_s: float = Field(120.0, gt=0, le=3600, description="seconds one request may take in all")
    connect_timeout_s: float = Field(10.0, gt=0, le=600, description="seconds to open a connection")
    retries: int = Field(
        4, ge=0, le=20, description="retries of a request after a 408, 409, 429, 5xx, timeout or bad answer"
    )
    max_retry_after_s: float = Field(
        120.0,
        gt=0,
        le=3600,
        description="longest Retry-After honoured; a server asking for a longer wait is not retried",
    )
    live: bool = Field(
        False,
        description="in a run's config: the launcher harvests the replicas' rollouts between rounds and the "
        "replay channel takes the pairs on a fixed schedule (live_lag)",
    )
    live_lag: int = Field(
        1,
        ge=0,
        le=10_000,
        description="with live: the pairs made of round k's rollouts are taken by every replica at the end of "
        "round k + live_lag and replayed from the round after; rounds after rounds - live_lag - 1 are not "
        "harvested. A harvest has live_lag rounds of training to finish in before any replica waits for it",
    )
    live_wait_s: float = Field(
        600.0,
        ge=0,
        le=86_400,
        description="with live: seconds a replica waits at most, at a round boundary, for the harvest it takes "
        "there; if it has not come, every replica takes nothing there. 0: never wait (then which rounds "
        "replay which pairs depends on how fast the teachers answer)",
    )

    @field_validator("template")
    @classmethod
    def _template_has_prompt(cls, template: str) -> str:
        try:
            template.format(prompt="")
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(f"template {template!r} may use only {{prompt}}: {e!r}") from None
        if "{prompt}" not in template:
            raise ValueError(f"template {template!r} must contain {{prompt}}")
        return template

    @field_validator("output")
    @classmethod
    def _jsonl_output(cls, output: str | None) -> str | None:
        if output is not None and not output.endswith(".jsonl"):
            raise ValueError(f"{output!r}: pairs are written as JSON lines; name a file ending in .jsonl")
        return output

    @model_validator(mode="after")
    def _consistent(self) -> HarvestConfig:
        names = [t.name for t in self.teachers]
        if len(set(names)) != len(names):
            raise ValueError(f"teacher names must be unique, got {names}")
        identities = [t.identity for t in self.teachers]
        if len(set(identities)) != len(identities):
            raise ValueError(
                "two teachers have the same base_url and model: one teacher asked twice would vote twice"
            )
        if self.threshold > len(self.teachers):
            raise ValueError(
                f"threshold ({self.threshold}) exceeds the {len(self.teachers)} teachers: no answer could win"
            )
        if self.traces is not None and self.run is not None:
            raise ValueError("set traces or run, not both: the states come from one place")
        if self.live and (self.traces or self.run or self.output):
            raise ValueError(
                "a live harvest reads the run's own rollouts and writes into the run: unset traces, run and "
                "output"
            )
        return self
