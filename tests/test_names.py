"""One home per name: the naming contracts of ``gpuwatchd/`` (issue 26, docs/architecture.md).

An ``ast`` walk over every module (function-level imports included). Contracts:

1. No re-export shim: no module hands on a name another module defines (``from a import X as X``,
   or an imported name listed in ``__all__``); package ``__init__`` files are the public faces and
   may.
2. No module imports another module's ``_private`` name: a helper two modules use is public.
3. Every module-level logger is ``logging.getLogger(__name__)``, so a log line names the module
   that wrote it.
4. Every name is imported from the module that defines it: for each ``from gpuwatchd.X import N``
   (function-level imports included) in ``gpuwatchd/``, ``tests/``, ``bench/`` and ``tools/``, ``X``
   binds ``N`` at module level itself (``def``, ``class``, an assignment, an annotated one), or
   ``X`` is a package and ``N`` its submodule, or ``N`` is in the ``__all__`` of a package
   ``__init__`` (the public face: ``gpuwatchd``'s lazily loaded API). A name ``X`` only imported
   is another module's: take it from there.

The same checks as ``../shared/tools/layers.py``, kept in the suite so that a regression fails
here; each is tested on a small package with one violation of each kind.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
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
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
            ):
                names = {e.value for e in getattr(node.value, "elts", ()) if isinstance(e, ast.Constant)}
                out += [f"{module}: re-exports {n} in __all__" for n in sorted(names & imported) if not face]
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "getLogger"
                and node.args
                and not (isinstance(node.args[0], ast.Name) and node.args[0].id == "__name__")
            ):
                out.append(f"{module}: a logger not named __name__ (line {node.lineno})")
    return out


def _bound(body: list[ast.stmt]) -> Iterator[str]:
    """The names a module's top level binds itself (not by importing them), compound statements
    at module level (``if``, ``try``, ``with``, ``for``) included, function and class bodies not."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node.name
            continue
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign, ast.For, ast.AsyncFor)):
            targets = [node.target]
        for t in targets:
            for n in ast.walk(t):
                if isinstance(n, ast.Name):
                    yield n.id
        for field in ("body", "orelse", "finalbody"):
            yield from _bound(getattr(node, field, []))
        for h in getattr(node, "handlers", []):
            yield from _bound(h.body)


def _public_face(tree: ast.Module) -> set[str]:
    """``__all__`` of a package ``__init__``: the names it offers on purpose."""
    out: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            out |= {e.value for e in getattr(node.value, "elts", ()) if isinstance(e, ast.Constant)}
    return out


def misplaced_imports(root: Path, others: tuple[Path, ...] = ()) -> list[str]:
    """``from <root>.X import N`` where ``X`` does not define ``N`` (contract 4), in the modules of
    ``root`` and in every ``*.py`` under ``others``."""
    mods = modules(root)
    defined: dict[str, set[str]] = {}
    for m, path in mods.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        defined[m] = set(_bound(tree.body))
        if path.name == "__init__.py":
            defined[m] |= _public_face(tree)
    importers = [(m, path) for m, path in mods.items()]
    importers += [(str(path.relative_to(d.parent)), path) for d in others for path in sorted(d.rglob("*.py"))]
    out = []
    for m, path in importers:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ImportFrom):
                continue
            base = _base(m, path, node) if path.is_relative_to(root) else node.module or ""
            if base.split(".")[0] != root.name:
                continue
            for a in node.names:
                if a.name == "*" or a.name in defined.get(base, ()) or f"{base}.{a.name}" in mods:
                    continue
                home = sorted(d for d, names in defined.items() if a.name in names)
                out.append(
                    f"{m}:{node.lineno}: {a.name} from {base}"
                    + (f" (defined in {', '.join(home)})" if home else " (defined nowhere)")
                )
    return out


def test_every_name_is_imported_from_its_module() -> None:
    extra = tuple(PKG.parent / d for d in ("tests", "bench", "tools"))
    assert misplaced_imports(PKG, extra) == []


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


def test_the_import_home_checker_catches_a_name_taken_from_a_user(tmp_path: Path) -> None:
    """A name imported from a module that only imports it (module level, in a function, relative,
    from a test beside the package) is reported with its home; definitions of every kind, a
    submodule and the ``__all__`` of a package's face are not."""
    root = tmp_path / "gpuwatchd"
    files = {
        "__init__.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from gpuwatchd.b import api\n"
        "__all__ = ['api']\n",
        "model/__init__.py": "",
        "model/stall.py": "class StallVerdict: ...\n",
        "b.py": (
            "import os\nfrom gpuwatchd.model.stall import StallVerdict\nX, (Y, *Z) = 1, (2, 3)\n"
            "A: int = 1\ndef api(): ...\ntry:\n    T = os.sep\nexcept ImportError:\n    T = ''\n"
            "if T:\n    class K: ...\nfor I in (): ...\n"
        ),
        "pkg/__init__.py": "from gpuwatchd.b import X\n",
        "pkg/mod.py": "",
        "c.py": (
            "from gpuwatchd.b import X, Y, Z, A, api, T, K, I\nfrom gpuwatchd import api, model\n"
            "from gpuwatchd.pkg import mod\nfrom gpuwatchd.b import StallVerdict\n"
            "def f():\n    from gpuwatchd.b import os\n    from gpuwatchd.pkg import X\n"
        ),
        "d.py": "from .b import StallVerdict\nfrom .model.stall import StallVerdict as V\n",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_x.py").write_text("import os\nfrom gpuwatchd.b import StallVerdict, Missing\n")
    assert misplaced_imports(root, (tests,)) == [
        "gpuwatchd.c:4: StallVerdict from gpuwatchd.b (defined in gpuwatchd.model.stall)",
        "gpuwatchd.c:6: os from gpuwatchd.b (defined nowhere)",
        "gpuwatchd.c:7: X from gpuwatchd.pkg (defined in gpuwatchd.b)",
        "gpuwatchd.d:1: StallVerdict from gpuwatchd.b (defined in gpuwatchd.model.stall)",
        "tests/test_x.py:2: StallVerdict from gpuwatchd.b (defined in gpuwatchd.model.stall)",
        "tests/test_x.py:2: Missing from gpuwatchd.b (defined nowhere)",
    ]
