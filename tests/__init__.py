"""The test suite as one package, so that pytest names tests/kernels `tests.kernels` and puts
the repository root, not tests/, on sys.path: a top-level `kernels` would shadow the Hugging
Face `kernels` package that transformers imports (tests/test_imports.py keeps this true)."""
