"""The configuration files: ``schema`` (the YAML config -> frozen dataclasses, ``load_config``),
``checks`` (the value checkers it and the /metrics web-config are built on) and ``strict_yaml``
(PyYAML's safe loader, refusing a key named twice in one mapping).
"""
