"""The test suite's folders never shadow installed packages: tests/kernels is `tests.kernels`,
and transformers (5.25 and later import the Hugging Face `kernels` package) still imports."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_tests_folder_is_not_on_sys_path():
    on_path = {Path(p or os.getcwd()).resolve() for p in sys.path}
    assert TESTS not in on_path


def test_top_level_kernels_is_not_the_test_package():
    spec = importlib.util.find_spec("kernels")
    if spec is None:
        return  # not installed here: nothing to shadow
    origin = Path(spec.origin or next(iter(spec.submodule_search_locations))).resolve()
    assert TESTS not in origin.parents, origin


def test_transformers_activations_import():
    if importlib.util.find_spec("transformers") is None:
        return
    from transformers.activations import ACT2FN

    assert "silu" in ACT2FN
