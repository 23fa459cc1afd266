"""An import-time stand-in for ``torchvision``, put on ``sys.path`` by the tests only.

Two of SGLang 0.5.23's model configs import torchvision at module level, and the
disaggregation code reaches them through the model-config registry; the package index's
torchvision is built against CUDA torch and would replace the CPU torch these tests run.
Nothing here is ever called by the code under test: any attribute is a placeholder that
fails loudly if used.  It has no package metadata, so transformers sees no torchvision.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any


class _Meta(type):
    def __getattr__(cls, name: str) -> Any:  # enum-like members named at import time
        if name.startswith("__"):
            raise AttributeError(name)
        return f"{cls.__name__}.{name}"


class _Unavailable(metaclass=_Meta):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("torchvision is stubbed in these tests: it is never called")


def _attr(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    return type(name, (_Unavailable,), {})


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Any ``torchvision.x.y`` submodule is a module of placeholders."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        m = types.ModuleType(spec.name)
        m.__path__ = []  # type: ignore[attr-defined]
        m.__getattr__ = _attr  # type: ignore[method-assign]
        return m

    def exec_module(self, module: types.ModuleType) -> None:
        pass


sys.meta_path.append(_Finder())
__version__ = "0.0.0+stub"


def __getattr__(name: str) -> Any:
    return _attr(name)
