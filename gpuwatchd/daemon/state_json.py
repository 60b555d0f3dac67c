"""``state.json``'s encoding: a ``NodeState`` -> plain JSON values (``gpuwatchd ps``) or text
(``state_json_text``, what ``Daemon._write_state`` writes: after a cycle whose findings, ranks or
counters changed, else every other cycle).

Pure; one walk over the state, the dataclass field names of each type looked up once.
``state_json_text`` lets the json module's C encoder do that walk (it calls back only for
dataclasses, read-only mappings and sets): the same text as ``json.dumps(state_to_json(state))``
at about a third of the CPU, which matters as it runs that often.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from gpuwatchd.model import NodeState

_FIELDS: dict[type, tuple[str, ...]] = {}
_PLAIN = (str, int, float, bool, type(None))


def to_jsonable(obj: Any) -> Any:
    """Dataclasses, mappings (also read-only ones) and tuples -> plain JSON values."""
    cls = type(obj)
    if cls in _PLAIN:
        return obj
    names = _FIELDS.get(cls)
    if names is None and dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        names = _FIELDS[cls] = tuple(f.name for f in dataclasses.fields(obj))
    if names is not None:
        return {n: to_jsonable(getattr(obj, n)) for n in names}
    if isinstance(obj, Mapping):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [to_jsonable(v) for v in obj]
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    return str(obj)


def state_to_json(state: NodeState) -> dict[str, Any]:
    data: dict[str, Any] = to_jsonable(state)
    data["counters"] = {
        name: [{"labels": list(k), "value": v} for k, v in series.items()] for name, series in state.counters.items()
    }
    return data


def _default(obj: Any) -> Any:
    """What the C encoder cannot walk itself, one level of it (it recurses into the result)."""
    cls = type(obj)
    names = _FIELDS.get(cls)
    if names is None and dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        names = _FIELDS[cls] = tuple(f.name for f in dataclasses.fields(obj))
    if names is not None:
        fields = getattr(obj, "__dict__", None)
        if fields is not None and tuple(fields) == names:  # the generated __init__'s order
            return fields  # read by the encoder, never changed
        return {n: getattr(obj, n) for n in names}
    if isinstance(obj, Mapping):
        return {str(k): v for k, v in obj.items()}
    if isinstance(obj, (set, frozenset)):
        return list(obj)
    return str(obj)


def state_json_text(state: NodeState) -> str:
    """``json.dumps(state_to_json(state), separators=(",", ":"), default=str)``, faster."""
    top = {n: getattr(state, n) for n in _fields_of(state)}
    top["counters"] = {
        name: [{"labels": list(k), "value": v} for k, v in series.items()] for name, series in state.counters.items()
    }
    try:  # a state is a tree: no cycle check (a quarter of the encoder's time)
        return json.dumps(top, separators=(",", ":"), default=_default, check_circular=False)
    except (TypeError, ValueError):  # a plain dict with a key the C encoder refuses (a tuple)
        return json.dumps(state_to_json(state), separators=(",", ":"), default=str)


def _fields_of(obj: Any) -> tuple[str, ...]:
    cls = type(obj)
    names = _FIELDS.get(cls)
    if names is None:
        names = _FIELDS[cls] = tuple(f.name for f in dataclasses.fields(obj))
    return names
