"""``state.json``'s encoding: a ``NodeState`` -> plain JSON values (``Daemon._write_state``, ``gpuwatchd ps``).

Pure; one walk over the state, the dataclass field names of each type looked up once.
"""

from __future__ import annotations

import dataclasses
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
        name: [{"labels": list(k), "value": v} for k, v in series.items()]
        for name, series in state.counters.items()
    }
    return data
