"""Load a user's code: a Python file by path, or an object from a spec `path/to/file.py:name` / `module:name`.

Used for reward functions, environment classes, tools and tool-call parsers. A file is imported once per
process under a private module name (registered in sys.modules, so dataclasses and pickling inside it work).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from posttrain.errors import PosttrainError


class FileImportError(Exception):
    """A file that could not be imported; the message says why (without the path: callers name it)."""


def import_file(path: Path, prefix: str) -> ModuleType:
    """The module of the Python file at `path` (resolved), imported once under `<prefix>_<stem>_<hash>`."""
    path = path.resolve()
    module_name = f"{prefix}_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:10]}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None or module_spec.loader is None:
        raise FileImportError("cannot be imported as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as error:
        del sys.modules[module_name]
        raise FileImportError(f"import failed: {type(error).__name__}: {error}") from error
    return module


def is_import_spec(spec: str) -> bool:
    """Whether `spec` reads as `file.py:name` or `module:name` (rather than a built-in's name)."""
    target, sep, name = spec.rpartition(":")
    return bool(sep and target and name)


def load_object(spec: str, what: str, error: type[PosttrainError] = PosttrainError) -> Any:
    """The object `spec` names; `what` ("environment", "tool", ...) starts every error message."""
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name.isidentifier():
        raise error(f"{what} {spec!r}: expected path/to/file.py:name or package.module:name")
    if target.endswith(".py"):
        path = Path(target).expanduser()
        if not path.is_file():
            raise error(f"{what} {spec!r}: file {path} not found")
        try:
            module = import_file(path, "posttrain_user")
        except FileImportError as problem:
            raise error(f"{what} {spec!r}: {path}: {problem}") from None
    else:
        try:
            module = importlib.import_module(target)
        except Exception as problem:  # ImportError, or whatever the module raises while importing
            raise error(f"{what} {spec!r}: cannot import {target}: {type(problem).__name__}: {problem}") from None
    if not hasattr(module, name):
        public = sorted(key for key in vars(module) if not key.startswith("_"))
        raise error(f"{what} {spec!r}: {target} has no {name!r} (it defines: {', '.join(public) or 'nothing public'})")
    return getattr(module, name)
