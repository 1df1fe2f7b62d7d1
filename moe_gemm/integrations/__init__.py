"""Optional integrations with other libraries; each is imported only when asked for.

transformers (pip install "moe-gemm[transformers]"): `moe_gemm.integrations.transformers`
registers "moe_gemm" as a transformers experts implementation, so that
`model.set_experts_implementation("moe_gemm")` or
`from_pretrained(..., experts_implementation="moe_gemm")` runs every MoE layer of a model on
moe_gemm's grouped GEMMs.

Importing transformers' MoE machinery takes seconds, so `import moe_gemm` must not do it.
`register_transformers_lazily()` instead registers at once if transformers' MoE module is
already imported, and otherwise installs a one-shot import hook that registers right after
transformers imports it (which happens before any model is built). Either way the user never
has to call anything after `import moe_gemm`.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import threading
import warnings
from types import ModuleType
from typing import Any

__all__ = ["register_transformers", "register_transformers_lazily"]

TRANSFORMERS_MOE_MODULE = "transformers.integrations.moe"
# transformers' FP8 experts have a registry of their own, in a module that imports the MoE
# module first: registering there from the MoE module's hook would meet it half-initialized.
TRANSFORMERS_FP8_MODULE = "transformers.integrations.finegrained_fp8"
_lock = threading.Lock()
_hooks: dict[str, _PostImportHook] = {}  # module name -> its pending hook


def register_transformers() -> bool:
    """Register "moe_gemm" in transformers' ExpertsInterface now (idempotent).

    Returns:
        True if registered, False if transformers (>= 5, with ExpertsInterface) is not
        installed.
    """
    if not _transformers_installed():
        return False
    try:
        from moe_gemm.integrations.transformers import register
    except ImportError:
        return False
    register()
    return True


def register_transformers_lazily() -> None:
    """Register "moe_gemm" with transformers as soon as transformers loads its MoE module.

    Costs nothing when transformers is absent or never imported. Safe to call many times.
    """
    if TRANSFORMERS_MOE_MODULE in sys.modules:
        _register_quietly()
        return
    if not _transformers_installed():
        return
    _hook_after(TRANSFORMERS_MOE_MODULE, _register_quietly)
    register_fp8_lazily()


def register_fp8_lazily() -> None:
    """Register "moe_gemm" in transformers' FP8 experts registry now if its module is loaded,
    else right after transformers loads it (a half-loaded module registers from the hook
    installed before it began loading)."""
    module = sys.modules.get(TRANSFORMERS_FP8_MODULE)
    if module is not None:
        if hasattr(module, "FP8ExpertsInterface"):
            _register_fp8_quietly()
        return
    if _transformers_installed():
        _hook_after(TRANSFORMERS_FP8_MODULE, _register_fp8_quietly)


def _hook_after(module: str, callback: Any) -> None:
    """Run `callback` right after `module` is next imported (one pending hook per module)."""
    with _lock:
        if module not in _hooks:
            _hooks[module] = hook = _PostImportHook(module, callback)
            sys.meta_path.insert(0, hook)


def _transformers_installed() -> bool:
    try:
        return importlib.util.find_spec("transformers") is not None
    except (ImportError, ValueError):  # a broken or stubbed-out installation
        return False


def _register_fp8() -> None:
    from moe_gemm.integrations.transformers_fp8 import register_fp8

    register_fp8()


def _register_quietly() -> None:
    _quietly(register_transformers, "experts implementation")


def _register_fp8_quietly() -> None:
    _quietly(_register_fp8, "FP8 experts implementation")


def _quietly(register: Any, what: str) -> None:
    # Runs inside transformers' import: a failure here must never break that import.
    try:
        register()
    except Exception as exc:  # noqa: BLE001
        warnings.warn(f"moe_gemm could not register its transformers {what}: {exc!r}",
                      RuntimeWarning, stacklevel=3)


class _PostImportHook(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps the real loader of one module to run a callback after it."""

    def __init__(self, fullname: str, callback: Any) -> None:
        self.fullname = fullname
        self.callback = callback
        self._busy = False

    def find_spec(
        self, fullname: str, path: Any = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.fullname or self._busy:
            return None
        self._busy = True  # the lookup below runs the meta path again, this finder included
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._busy = False
        if spec is None or spec.loader is None:
            return None
        spec.loader = _CallbackLoader(spec.loader, self)
        return spec

    def fired(self) -> None:
        with _lock:
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            if _hooks.get(self.fullname) is self:
                del _hooks[self.fullname]
        self.callback()


class _CallbackLoader(importlib.abc.Loader):
    def __init__(self, loader: Any, hook: _PostImportHook) -> None:
        self._loader = loader
        self._hook = hook

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        # Put the real loader back first so the module looks untouched to anyone inspecting it.
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        self._hook.fired()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)
