# The two commands a newcomer types: `make demo` (the main job) and `make test`.
# Each creates the virtual environment it needs on first use.
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test lint bench clean

$(VENV)/.installed: pyproject.toml .ci/bootstrap
	VENV=$(VENV) bash .ci/bootstrap

demo: $(VENV)/.installed
	$(BIN)/wasinn demo

# On CI (CI=true) a missing toolchain or backend fails the run instead of skipping tests.
comma := ,
CI_REQUIRE := $(if $(CI),wasm$(comma)onnxruntime$(comma)openvino$(comma)torch,)

lint: $(VENV)/.installed
	$(BIN)/ruff check .
	$(BIN)/mypy -p wasinn

test: lint
	WASINN_REQUIRE=$${WASINN_REQUIRE:-$(CI_REQUIRE)} $(BIN)/pytest

bench: $(VENV)/.installed
	for b in benchmarks/*.py; do $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .ruff_cache .pytest_cache
