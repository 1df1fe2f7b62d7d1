# The two commands of README.md: `make serve` (the service) and `make test` (CI's command).
PY ?= python3
PORT ?= 8000

.PHONY: setup serve test check demo lint

setup:
	bash scripts/setup.sh

serve: setup
	moe-gemm-server --host 127.0.0.1 --port $(PORT)

check: setup
	moe-gemm check

test: setup
	moe-gemm check
	$(PY) -m pytest -q

demo: setup
	moe-gemm demo

lint:
	ruff check moe_gemm server client tests benchmarks scripts
