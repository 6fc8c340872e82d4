"""Typed settings from a file, the environment and command-line flags.

Sources, lowest precedence first: ``flowloop.toml`` (or ``[tool.flowloop]`` in
``pyproject.toml``) in the working directory, or the file named by ``--config`` /
``$FLOWLOOP_CONFIG``; then ``FLOWLOOP_*`` environment variables (nested keys with ``__``:
``FLOWLOOP_WORKFLOWS__ORDER__MAX_CONCURRENCY=4``; lists as JSON); then flags. Validated
with pydantic-settings; an invalid value is one :class:`~flowloop.errors.ConfigError`
line naming the key, the problem and where the value came from.

A file can also override, by name and without touching code, a workflow's concurrency, a
step's timeout and retry, and a loop's schedule, timeout, retry and ``max_failures``::

    db = "postgresql+psycopg://flowloop@db/flowloop"
    concurrency = 32
    log_format = "json"
    metrics_port = 9464
    ui_token = "a-long-random-string"   # flowloop ui --allow-actions (else printed at start)

    [[alerts]]
    type = "webhook"
    url = "https://hooks.example.com/flowloop"
    level = "critical"

    [workflows.order]
    max_concurrency = 4

    [workflows.order.steps.charge]
    timeout = "30s"
    retry = { attempts = 5, backoff = "exponential", base = "2s", cap = "1m" }

    [loops.poll_feed]
    every = "5m"
    max_failures = 3
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import math
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Final, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from flowloop.configfile import ENV_PREFIX, find_config_file, read_config_file
from flowloop.errors import ConfigError, FlowloopError
from flowloop.retry import MAX_DURATION_SECONDS

if TYPE_CHECKING:
    # Loaded when used: every command loads the settings, and these import the engine,
    # the store and prometheus_client (issue 13, cold start).
    from flowloop.alerts import Alerts, AlertSink
    from flowloop.definition import Workflow
    from flowloop.loops import Loop

log = logging.getLogger("flowloop.config")

# flowloop.executor's and flowloop.metrics' defaults, spelled here so loading the settings
# imports neither (tests/acceptance/test_cli_cold_start.py keeps them equal).
DEFAULT_MAX_CONCURRENCY: Final = 16
DEFAULT_LEASE_SECONDS: Final = 30.0
DEFAULT_METRICS_HOST: Final = "127.0.0.1"

DEFAULT_GRACE_SECONDS: Final = 30.0

_UNITS: Final = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_DURATION: Final = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d|w)?\s*$")


def _finite(result: float, value: object) -> float:
    if not math.isfinite(result) or result > MAX_DURATION_SECONDS:
        shown = value if not isinstance(value, str) or len(value) <= 24 else f"{value[:21]}..."
        raise ValueError(f"{shown!r} is not a finite duration of at most 10 years")
    return result


def parse_duration(value: object) -> float:
    """``30``, ``"30s"``, ``"500ms"``, ``"5m"``, ``"2h"``, ``"7d"``, ``"1w"`` → seconds."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a duration")
    if isinstance(value, (int, float)):
        return _finite(float(value), value)
    if isinstance(value, str):
        match = _DURATION.match(value)
        if match:
            return _finite(float(match.group(1)) * _UNITS[match.group(2) or "s"], value)
    raise ValueError(f"{value!r} is not a duration (use seconds or e.g. 500ms, 30s, 5m, 2h, 7d)")


def _duration_or_none(value: object) -> object:
    return None if value is None else parse_duration(value)


def _lower(value: object) -> object:
    return value.lower() if isinstance(value, str) else value


Duration = Annotated[float, BeforeValidator(_duration_or_none)]
PositiveDuration = Annotated[float, BeforeValidator(_duration_or_none), Field(gt=0)]
NonNegativeDuration = Annotated[float, BeforeValidator(_duration_or_none), Field(ge=0)]
LogLevel = Annotated[
    Literal["debug", "info", "warning", "error", "critical"], BeforeValidator(_lower)
]
AlertLevel = Annotated[Literal["warning", "critical"], BeforeValidator(_lower)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RetrySettings(_Strict):
    """Fields of :class:`~flowloop.retry.Retry` to override (the exception classes stay)."""

    attempts: int | None = Field(default=None, ge=1)
    backoff: Literal["fixed", "linear", "exponential"] | None = None
    base: NonNegativeDuration | None = None
    cap: NonNegativeDuration | None = None
    jitter: float | None = Field(default=None, ge=0, le=1)

    def apply(self, retry: Any) -> Any:
        changes = self.model_dump(exclude_none=True)
        return dataclasses.replace(retry, **changes) if changes else retry


class StepSettings(_Strict):
    timeout: PositiveDuration | None = None
    retry: RetrySettings | None = None


class WorkflowSettings(_Strict):
    max_concurrency: int | None = Field(default=None, ge=1)
    steps: dict[str, StepSettings] = Field(default_factory=dict)


class LoopSettings(_Strict):
    every: PositiveDuration | None = None
    cron: str | None = None
    mode: Literal["fixed_rate", "fixed_delay"] | None = None
    timeout: PositiveDuration | None = None
    retry: RetrySettings | None = None
    jitter: NonNegativeDuration | None = None
    misfire_grace: NonNegativeDuration | None = None
    max_failures: int | None = Field(default=None, ge=1)


class LogSinkSettings(_Strict):
    type: Literal["log"]
    level: AlertLevel = "warning"


class CommandSinkSettings(_Strict):
    type: Literal["command"]
    command: str | list[str]
    timeout: PositiveDuration = 10.0
    level: AlertLevel = "warning"


class WebhookSinkSettings(_Strict):
    type: Literal["webhook"]
    url: Annotated[str, Field(pattern=r"^https?://\S+$")]
    timeout: PositiveDuration = 5.0
    headers: dict[str, str] = Field(default_factory=dict)
    level: AlertLevel = "warning"


class PythonSinkSettings(_Strict):
    type: Literal["python"]
    callable: Annotated[str, Field(pattern=r"^[\w.]+:[\w.]+$")]
    level: AlertLevel = "warning"


SinkSettings = Annotated[
    LogSinkSettings | CommandSinkSettings | WebhookSinkSettings | PythonSinkSettings,
    Field(discriminator="type"),
]


class Settings(BaseSettings):
    """Everything a ``flowloop.toml`` (or ``FLOWLOOP_*`` variable, or flag) can set."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter="__",
        extra="forbid",
        case_sensitive=False,
        # An empty variable is an unset one (as click's envvars treat it): a deployment
        # with FLOWLOOP_UI_TOKEN= left blank must not break every command.
        env_ignore_empty=True,
    )

    db: str | None = None
    """Database URL or SQLite file (default ./flowloop.db)."""
    concurrency: int = Field(default=DEFAULT_MAX_CONCURRENCY, ge=1)
    """A worker's steps and loop iterations at once."""
    lease: PositiveDuration = DEFAULT_LEASE_SECONDS
    grace: NonNegativeDuration = DEFAULT_GRACE_SECONDS
    log_format: Literal["text", "json"] = "text"
    log_level: LogLevel | None = None
    """None: ``info`` for the worker, ``warning`` for other commands."""
    metrics_port: int | None = Field(default=None, ge=0, le=65535)
    metrics_host: str = DEFAULT_METRICS_HOST
    ui_token: str | None = Field(default=None, min_length=1)
    """The dashboard's action token (``flowloop ui --allow-actions``); None: a new one is
    made and printed at each start. ``$FLOWLOOP_UI_TOKEN`` wins over the file."""
    alerts: list[SinkSettings] = Field(default_factory=list)
    """Alert sinks; none configured means alerts go to the log."""
    workflows: dict[str, WorkflowSettings] = Field(default_factory=dict)
    loops: dict[str, LoopSettings] = Field(default_factory=dict)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # First wins: flags (init arguments), then the environment, then the file.
        return init_settings, env_settings, _FileSource(settings_cls, cls._file_values)

    _file_values: ClassVar[Mapping[str, Any]] = {}
    """What the configuration file says (set on a subclass by :func:`load_settings`)."""

    # -- building what the settings describe ----------------------------------------------

    def alert_sinks(self) -> list[AlertSink]:
        from flowloop.alerts import at_least, command_sink, import_sink, log_sink, webhook_sink

        sinks: list[AlertSink] = []
        for spec in self.alerts:
            sink: AlertSink
            if isinstance(spec, LogSinkSettings):
                sink = log_sink
            elif isinstance(spec, CommandSinkSettings):
                sink = command_sink(spec.command, timeout=spec.timeout)
            elif isinstance(spec, WebhookSinkSettings):
                sink = webhook_sink(spec.url, timeout=spec.timeout, headers=spec.headers)
            else:
                sink = import_sink(spec.callable)
            sinks.append(sink if spec.level == "warning" else at_least(spec.level, sink))
        return sinks or [log_sink]

    def make_alerts(self) -> Alerts:
        """The worker's alerts: the configured sinks, delivered off the event loop."""
        from flowloop.alerts import Alerts

        return Alerts(self.alert_sinks(), background=True)


class _FileSource(PydanticBaseSettingsSource):
    """The values read from the configuration file (already parsed and located)."""

    def __init__(self, settings_cls: type[BaseSettings], values: Mapping[str, Any]) -> None:
        super().__init__(settings_cls)
        self.values = dict(values)

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return self.values.get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(self.values)


def load_settings(
    flags: Mapping[str, Any] | None = None,
    *,
    config_file: str | os.PathLike[str] | None = None,
    cwd: Path | None = None,
) -> Settings:
    """Settings from the file, ``FLOWLOOP_*`` variables and ``flags`` (``None`` values are
    flags not given). Raises ConfigError: one line naming the key and the problem."""
    given = {key: value for key, value in (flags or {}).items() if value is not None}
    found = find_config_file(config_file, cwd)
    values: dict[str, Any] = read_config_file(*found) if found else {}
    source_name = str(found[0]) + (f" [{found[1]}]" if found and found[1] else "") if found else ""
    # pydantic-settings builds its sources from the class: a subclass carries the file.
    loaded: type[Settings] = type("LoadedSettings", (Settings,), {"_file_values": values})
    try:
        return loaded(**given)
    except ValidationError as error:
        raise ConfigError(describe(error, given, source_name)) from None


def describe(error: ValidationError, flags: Mapping[str, Any], file: str) -> str:
    """A pydantic error as one line: where the value came from, the key, the problem."""
    problems = error.errors()
    first = problems[0]
    loc = [str(part) for part in first["loc"]]
    # Discriminated unions put the tag in the path (alerts.0.webhook.url): drop it.
    if len(loc) >= 3 and loc[0] == "alerts" and loc[2] in ("log", "command", "webhook", "python"):
        del loc[2]
    key = ".".join(loc) or "(top level)"
    message = first["msg"]
    if first["type"] == "extra_forbidden":
        known = _known_keys(loc[:-1])
        close = difflib.get_close_matches(loc[-1], known, n=1)
        message = "unknown key" + (
            f" (did you mean {close[0]!r}?)"
            if close
            else f" (known: {', '.join(sorted(known))})"
            if known
            else ""
        )
    elif first["type"] == "union_tag_invalid":
        ctx = first.get("ctx", {})
        message = f"type {ctx.get('tag')!r} is not one of {ctx.get('expected_tags')}"
    elif first["type"] == "value_error":
        message = str(first.get("ctx", {}).get("error", message))
    elif "input" in first and not isinstance(first["input"], (dict, list)):
        message += f" (got {first['input']!r})"
    origin = _origin(loc[0] if loc else "", flags, file)
    more = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
    return f"invalid configuration: {key}: {message}{origin}{more}"


_SINKS: Final = (LogSinkSettings, CommandSinkSettings, WebhookSinkSettings, PythonSinkSettings)


def _known_keys(path: Sequence[str]) -> list[str]:
    """The keys allowed at ``path`` (for "did you mean")."""
    parts = list(path)
    models: list[type[BaseModel]]
    if not parts:
        models = [Settings]
    elif parts[-1] == "retry":
        models = [RetrySettings]
    elif parts[0] == "alerts":
        models = list(_SINKS)
    elif parts[0] == "loops" and len(parts) == 2:
        models = [LoopSettings]
    elif parts[0] == "workflows" and len(parts) == 2:
        models = [WorkflowSettings]
    elif parts[0] == "workflows" and len(parts) == 4 and parts[2] == "steps":
        models = [StepSettings]
    else:
        return []
    names = {name for model in models for name in model.model_fields}
    return sorted(names)


def _origin(top: str, flags: Mapping[str, Any], file: str) -> str:
    if top in flags:
        return f" [from --{top.replace('_', '-')}]"
    prefix = (ENV_PREFIX + top).upper()
    for name in os.environ:
        upper = name.upper()
        if upper == prefix or upper.startswith(prefix + "__"):
            return f" [from ${name}]"
    return f" [from {file}]" if file else ""


# -- overrides by name -------------------------------------------------------------------------


def apply_overrides(
    settings: Settings, workflows: Mapping[str, Workflow], loops: Mapping[str, Loop]
) -> dict[str, Loop]:
    """Apply ``[workflows.NAME]`` and ``[loops.NAME]`` overrides to loaded definitions.

    Workflows are changed in place (concurrency, step timeouts and retries: settings that
    are not part of the fingerprint, so stored runs stay compatible); loops are rebuilt,
    so every loop argument is validated again. Returns the loops to run.

    A step the workflow does not have is a ConfigError; a workflow or loop that is not
    loaded here is skipped with a log line (one file may serve several workers)."""
    for name, override in settings.workflows.items():
        workflow = _by_name(workflows, name)
        if workflow is None:
            _not_loaded("workflow", name, workflows)
            continue
        if override.max_concurrency is not None:
            workflow.max_concurrency = override.max_concurrency
        for state, step in override.steps.items():
            _override_step(workflow, name, state, step)
    result = dict(loops)
    for name, loop_override in settings.loops.items():
        loop = _by_name(loops, name)
        if loop is None:
            _not_loaded("loop", name, loops)
            continue
        result[loop.name] = _override_loop(loop, loop_override)
    return result


def _not_loaded(kind: str, name: str, loaded: Mapping[str, Any]) -> None:
    """An override of a workflow or loop not loaded here: an info line (one file may serve
    several workers), a warning when a loaded one has a close name — a misspelt section
    (``[workflows.jbo]``) was skipped without a word while a misspelt step was refused."""
    import difflib

    close = difflib.get_close_matches(name.lower(), [n.lower() for n in loaded], n=1, cutoff=0.75)
    if close and name.lower().startswith(close[0]):
        close = []  # (`orders` beside `order`, `sync_v2` beside `sync`: another's, not a typo)
    if close:
        meant = next(n for n in loaded if n.lower() == close[0])
        log.warning(
            "config: no %s %r is loaded here (did you mean %r?); its overrides are skipped",
            kind,
            name,
            meant,
        )
    else:
        log.info("config: %s %r is not loaded here; its overrides are skipped", kind, name)


def _by_name(items: Mapping[str, Any], name: str) -> Any:
    # Environment variables come lower-cased: match names without regard to case.
    if name in items:
        return items[name]
    matches = [value for key, value in items.items() if key.lower() == name.lower()]
    return matches[0] if len(matches) == 1 else None


def _override_step(workflow: Workflow, name: str, state: str, step: StepSettings) -> None:
    steps = workflow.steps
    spec = _by_name(steps, state)
    if spec is None:
        raise ConfigError(
            f"invalid configuration: workflows.{name}.steps.{state}: workflow {workflow.name!r} "
            f"has no step {state!r} (steps: {', '.join(steps)})"
        )
    changes: dict[str, Any] = {}
    if step.timeout is not None:
        changes["timeout"] = step.timeout
    if step.retry is not None:
        try:
            changes["retry"] = step.retry.apply(spec.retry)
        except FlowloopError as error:
            raise ConfigError(
                f"invalid configuration: workflows.{name}.steps.{state}.retry: {error}"
            ) from None
    if changes:
        workflow.tune_step(spec.name, **changes)


def _override_loop(loop: Loop, override: LoopSettings) -> Loop:
    from flowloop.loops import Loop

    every, cron = loop.every, loop.cron
    if override.every is not None:
        every, cron = override.every, None
    if override.cron is not None:
        every, cron = None, override.cron
    retry = loop.retry
    try:
        if override.retry is not None:
            retry = override.retry.apply(loop.retry)
        return Loop(
            loop.name,
            loop.fn,
            every=every,
            cron=cron,
            tz=loop.tz if cron is not None else None,  # (a cron loop keeps its zone)
            mode=override.mode or ("fixed_rate" if cron is not None else loop.mode),
            workflow=loop.workflow,
            context=loop.context,
            timeout=override.timeout if override.timeout is not None else loop.timeout,
            retry=retry,
            jitter=override.jitter if override.jitter is not None else loop.jitter,
            misfire_grace=(
                override.misfire_grace if override.misfire_grace is not None else loop.misfire_grace
            ),
            coalesce=loop.coalesce,
            max_failures=(
                override.max_failures if override.max_failures is not None else loop.max_failures
            ),
            start_at=loop.start_at,
            end_at=loop.end_at,
        )
    except FlowloopError as error:
        raise ConfigError(f"invalid configuration: loops.{loop.name}: {error}") from None
