"""The ``cadence[hf]`` extra: the packages it installs and the one-line error when one is missing."""

from __future__ import annotations

import importlib
from types import ModuleType

from cadence.errors import ConfigError

__all__ = ["HF_INSTALL", "HF_MODULES", "HFDependencyError", "missing_extra_hint", "require_transformers"]

HF_INSTALL = "pip install 'cadence[hf]'"
"""How to install what the Hugging Face integration needs."""
HF_MODULES = frozenset({"transformers", "datasets", "tokenizers", "huggingface_hub"})
"""The top-level modules the ``hf`` extra brings."""


class HFDependencyError(ConfigError, ImportError):
    """A config needs ``transformers`` (or another package of the ``hf`` extra), not installed (exit 2)."""


def missing_extra_hint(exc: BaseException) -> str:
    """``": pip install 'cadence[hf]'"`` when ``exc`` is an import of a module of the ``hf`` extra
    that failed because the module is missing (or blocked); ``""`` otherwise."""
    name = getattr(exc, "name", None) if isinstance(exc, ImportError) else None
    if name and name.split(".")[0] in HF_MODULES:
        return f" ({HF_INSTALL})"
    return ""


def require_transformers(what: str) -> ModuleType:
    """``transformers``, imported; :class:`HFDependencyError` naming ``what`` needs it and the
    extra to install when it cannot be imported."""
    try:
        return importlib.import_module("transformers")
    except ImportError as exc:
        raise HFDependencyError(f"{what} needs transformers, which cannot be imported ({exc}): {HF_INSTALL}") from None
