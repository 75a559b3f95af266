"""A framework an adapter needs, imported, or an ImportError naming the package and the pip
command that installs it (both sides)."""

from __future__ import annotations

import importlib
import warnings
from types import ModuleType

__all__ = ["require"]


def require(module: str, package: str, tested: str) -> ModuleType:
    """`import module`, or an ImportError that names `package` (its pip name), the release
    tplab is tested with and `pip install 'tplab[frameworks]'`. The framework's own
    import-time warnings (Megatron: "Transformer Engine and Apex are not installed") are
    kept out of the notebook."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"this tplab.frameworks adapter needs the package {package} (import {module} "
            f"failed: {e}). Install it with pip install 'tplab[frameworks]' (or pip install "
            f"{package}=={tested} torch==<your torch> to keep your torch); tested with "
            f"{package} {tested}, docs/FRAMEWORKS.md") from e
