"""YAML for the configuration files (``config/schema.py``, ``web/web_config.py``): PyYAML's safe
loader, except that a mapping naming one key twice is refused, naming the key and both lines,
instead of the last one silently winning (a second ``basic_auth_users`` entry of one name
would replace the first hash). exporter-toolkit reads its web-config with yaml.v2's
``UnmarshalStrict``, which refuses the same. Keys a ``<<`` merge brings in may be overridden, as
YAML intends. Cost: one set per mapping. Privilege: none.
Shell equivalent: ``gpuwatchd check`` / ``gpuwatchd web-config check FILE``.
"""

from __future__ import annotations

from typing import Any

import yaml


class DuplicateKey(yaml.YAMLError):
    def __init__(self, key: Any, first: int, second: int) -> None:
        super().__init__(f"key {key!r:.80} appears twice in one mapping (lines {first} and {second})")


class _Loader(yaml.SafeLoader):
    pass


def _mapping(loader: _Loader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: dict[Any, Any] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = loader.construct_object(key_node, deep=True)
        try:
            first = seen.get(key)
        except TypeError:  # an unhashable key: construct_mapping names it
            continue
        if first is not None:
            raise DuplicateKey(key, first.line + 1, key_node.start_mark.line + 1)
        seen[key] = key_node.start_mark
    return loader.construct_mapping(node, deep=True)


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)


def load(text: str) -> Any:
    """``yaml.safe_load``, refusing duplicate keys (raises ``yaml.YAMLError``)."""
    return yaml.load(text, Loader=_Loader)  # a SafeLoader subclass
