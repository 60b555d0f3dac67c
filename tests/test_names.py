"""One home per name: the naming contracts of ``gpuwatchd/`` (issue 26, docs/architecture.md).

An ``ast`` walk over every module (function-level imports included). Contracts:

1. No re-export shim: no module hands on a name another module defines (``from a import X as X``,
   or an imported name listed in ``__all__``); package ``__init__`` files are the public faces and
   may.
2. No module imports another module's ``_private`` name: a helper two modules use is public.
3. Every module-level logger is ``logging.getLogger(__name__)``, so a log line names the module
   that wrote it.

The same checks as ``../shared/tools/layers.py``, kept in the suite so that a regression fails
here; each is tested on a small package with one violation of each kind.
"""

from __future__ import annotations

import ast
from pathlib import Path

from test_layers import modules

PKG = Path(__file__).resolve().parent.parent / "gpuwatchd"


def _base(module: str, path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    pkg = module if path.name == "__init__.py" else module.rpartition(".")[0]
    parts = pkg.split(".")
    parts = parts[: len(parts) - node.level + 1]
    return ".".join([*parts, node.module] if node.module else parts)


def violations(root: Path) -> list[str]:
    prefix = root.name
    out: list[str] = []
    for module, path in modules(root).items():
        tree = ast.parse(path.read_text())
        face = path.name == "__init__.py"
        imported: set[str] = set()
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            base = _base(module, path, node)
            if base.split(".")[0] != prefix:
                continue
            for a in node.names:
                if a.name.startswith("_") and not a.name.startswith("__") and base != module:
                    out.append(f"{module}: imports {a.name} from {base}")
                if node in tree.body:
                    imported.add(a.asname or a.name)
                    if a.asname == a.name and not face:
                        out.append(f"{module}: re-exports {a.name} from {base}")
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__"
                                                    for t in node.targets):
                names = {e.value for e in getattr(node.value, "elts", ()) if isinstance(e, ast.Constant)}
                out += [f"{module}: re-exports {n} in __all__" for n in sorted(names & imported)
                        if not face]
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    node.func.attr == "getLogger" and node.args and \
                    not (isinstance(node.args[0], ast.Name) and node.args[0].id == "__name__"):
                out.append(f"{module}: a logger not named __name__ (line {node.lineno})")
    return out


def test_no_reexport_no_private_import_loggers_by_module() -> None:
    assert violations(PKG) == []


def test_the_checker_catches_each_kind(tmp_path: Path) -> None:
    root = tmp_path / "gpuwatchd"
    files = {
        "__init__.py": "from gpuwatchd.a import X as X\n",  # the public face may
        "a.py": "X = 1\n_y = 2\n",
        "b.py": "from gpuwatchd.a import X as X\n",
        "c.py": "from gpuwatchd.a import X\n__all__ = ['X']\n",
        "d.py": "from gpuwatchd.a import _y\n",
        "e.py": "import logging\nlog = logging.getLogger('gpuwatchd.a')\n",
        "f.py": "import logging\nlog = logging.getLogger(__name__)\nfrom .a import X\n",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    assert violations(root) == [
        "gpuwatchd.b: re-exports X from gpuwatchd.a",
        "gpuwatchd.c: re-exports X in __all__",
        "gpuwatchd.d: imports _y from gpuwatchd.a",
        "gpuwatchd.e: a logger not named __name__ (line 2)",
    ]
