"""Each service's install declares what the service imports (issue 36): `pip install .[trainer]` alone must run
the trainer. Read from the source: follow every import each service's entry module can reach through the
repository (inside functions too: engines and endpoints are imported when configured), and every third-party
distribution reached must be declared in pyproject.toml's base dependencies, in that service's extra, or in one
of the extras a user adds by choice (vLLM, Megatron-Core, NIXL, MLflow). An import guarded by `except
ImportError` is a fallback, not a need. Which distribution provides an import comes from the installed packages'
own metadata, not from a table here."""

from __future__ import annotations

from importlib.metadata import packages_distributions

import pytest

from service_imports import CHOSEN, ENTRIES, declared, normal, third_party_imports


@pytest.mark.parametrize("service", sorted(ENTRIES))
def test_every_import_a_service_loads_is_declared_by_its_extra(service):
    entry, extras = ENTRIES[service]
    allowed, providers = declared(extras + CHOSEN), packages_distributions()
    # A package not installed here (an optional one) is taken to be the distribution of its own name.
    provided = {name: providers.get(name, [name]) for name in third_party_imports(entry)}
    undeclared = {name: dists for name, dists in sorted(provided.items())
                  if not allowed & {normal(d) for d in dists}}
    assert not undeclared, f"{entry} imports {undeclared}, which neither the base dependencies nor {extras} declare"


def test_the_walk_reaches_the_libraries_each_service_is_built_on():
    """The check above passes vacuously if the walk finds nothing: it must find what each service is made of."""
    assert {"grpc", "nats", "redis"} <= third_party_imports("services.replay.main")
    assert {"torch", "transformers"} <= third_party_imports("services.trainer.main")
    assert "torch" not in third_party_imports("services.controller.main")
