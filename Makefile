# The two commands a newcomer types: `make demo` (the main job) and `make test`.
# Each creates the virtual environment it needs on first use.
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test lint bench clean FORCE

$(VENV)/.installed: pyproject.toml .ci/bootstrap $(VENV)/.package-files
	VENV=$(VENV) bash .ci/bootstrap

# The strict editable install links each file of the package folders (pyproject.toml's
# package-dir) once, so a module added or removed since (a git pull) is seen only after a
# reinstall. This list of those files (modules and package data) is made on every make but
# rewritten only when it differs, so the install above is redone then and only then; an
# edit to a file changes nothing. (+: under make -n too, which would otherwise plan a
# reinstall each time.)
PACKAGE_DIRS := core backends actors scheduler host configs wit examples
PACKAGE_FILE_MATCH := \( -name '*.py' -o -name py.typed -o -name '*.toml' -o -name '*.c' \
	-o -name '*.h' -o -name Makefile -o -name '*.wit' -o -name '*.witx' \)
$(VENV)/.package-files: FORCE
	+@mkdir -p $(VENV) && find $(PACKAGE_DIRS) -name __pycache__ -prune -o -type f \
		$(PACKAGE_FILE_MATCH) -print | LC_ALL=C sort > $@.new
	+@if cmp -s $@.new $@; then rm $@.new; else mv $@.new $@; fi

demo: $(VENV)/.installed
	$(BIN)/wasinn demo

# On CI (CI=true) a missing toolchain or backend fails the run instead of skipping tests.
comma := ,
CI_REQUIRE := $(if $(CI),wasm$(comma)onnxruntime$(comma)openvino$(comma)torch,)

lint: $(VENV)/.installed
	$(BIN)/ruff check .
	$(BIN)/mypy -p wasinn
	$(BIN)/mypy --strict tests/typed_usage.py

test: lint
	WASINN_REQUIRE=$${WASINN_REQUIRE:-$(CI_REQUIRE)} $(BIN)/pytest

bench: $(VENV)/.installed
	for b in benchmarks/*.py; do $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .ruff_cache .pytest_cache
