"""The one loader of environment variables for every frozen config.

``from_env(cls, prefix)`` is the only place kvstore reads configuration from the environment:
each field of the frozen dataclass ``cls`` may be set by ``<prefix><FIELD>`` (upper case), a
nested config field by ``<prefix><FIELD>_<SUBFIELD>``; the value is parsed by the field's type
(ints, floats, ``true``/``false``, comma-separated tuples, ``none``/``auto`` for optional
fields) and a value that does not parse is a ``ConfigError`` naming the variable. The configs
then validate themselves (``__post_init__``) as always.

A leaf: it imports no config, so every config (``GeometryConfig``, ``BlockStoreConfig``,
``SWAConfig``) and the service's root (``kvstore.config``) import it from here.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

from kvstore.errors import ConfigError

C = TypeVar("C")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_NONE = ("", "none", "auto")


def from_env(
    cls: type[C],
    prefix: str,
    environ: Mapping[str, str] | None = None,
    *,
    lower: tuple[str, ...] = (),
) -> C:
    """``cls(**values from the environment)``; fields named in ``lower`` are case-folded
    (names like presets and roles)."""
    env = os.environ if environ is None else environ
    return build(cls, env_values(cls, prefix, env, lower), prefix)


def build(cls: type[C], values: dict[str, Any], prefix: str) -> C:
    """``cls(**values)``; when it refuses a value that came from the environment, the error
    names the variable (the user set ``KVSTORE_PRESET``, not a field called ``preset``)."""
    try:
        return cls(**values)
    except ConfigError as error:
        field_name = error.field.split(".")[-1]
        if field_name in values and not error.field.startswith(prefix):
            variable = prefix + field_name.upper()
            raise ConfigError(variable, f"{error.detail} (field {error.field})") from None
        raise


def env_values(
    cls: type, prefix: str, env: Mapping[str, str], lower: tuple[str, ...] = ()
) -> dict[str, Any]:
    """The fields of dataclass ``cls`` set by variables ``<prefix><FIELD>`` in ``env`` (a
    variable set to the empty string counts as unset)."""
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for item in dataclasses.fields(cls):
        name = prefix + item.name.upper()
        kind = hints[item.name]
        if dataclasses.is_dataclass(kind):  # a nested config: its own fields, one level down
            nested = env_values(kind, name + "_", env)  # type: ignore[arg-type]
            if nested:
                values[item.name] = build(kind, nested, name + "_")  # type: ignore[arg-type]
            continue
        raw = env.get(name)
        if raw is not None and raw.strip():
            text = raw.strip().lower() if item.name in lower else raw
            values[item.name] = parse_value(name, text, kind, item.name)
    return values


def parse_value(name: str, raw: str, kind: Any, field_name: str = "") -> Any:
    """``raw`` (an environment value) as type ``kind``; ``ConfigError(name)`` if it is not,
    saying which config field it sets."""
    text = raw.strip()
    what = f" (field {field_name})" if field_name else ""
    args = typing.get_args(kind)
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        if type(None) in args and text.lower() in _NONE:
            return None
        kind = next(arg for arg in args if arg is not type(None))
        args = typing.get_args(kind)
    if typing.get_origin(kind) is typing.Literal:
        if text not in args:
            raise ConfigError(
                name, f"must be one of {', '.join(map(str, args))}, got {raw!r}{what}"
            )
        return text
    if typing.get_origin(kind) is tuple:
        return tuple(part.strip() for part in text.split(",") if part.strip())
    try:
        if kind is bool:
            if text.lower() in _TRUE + _FALSE:
                return text.lower() in _TRUE
            raise ValueError(text)
        if kind is int:
            return int(text, 10)
        if kind is float:
            return float(text)
    except ValueError:
        raise ConfigError(name, f"cannot parse {raw!r} as {kind.__name__}{what}") from None
    return text
