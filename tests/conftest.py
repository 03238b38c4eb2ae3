"""Marks every test under tests/integration as `integration` (select with -m), runs the
README's blocks first, and says how `make test` splits the suite over two pytest-xdist workers
(`-n 2`): every integration test on one worker, in this order (they share one Ray cluster, and
the README's `ray stop` stops every Ray on the machine), each unit module whole on the other
(its module-scoped fixtures run once). No unit test starts Ray."""

import importlib.util

import pytest


def pytest_collection_modifyitems(items):
    for item in items:
        if "/integration/" in str(item.fspath):
            item.add_marker(pytest.mark.integration)
    # The README's blocks start and stop Ray clusters of their own, and `ray stop` (which the
    # README shows) stops every Ray on the machine: they run before the session's cluster
    # exists. The sort is stable, so everything else keeps its order.
    items.sort(key=lambda item: "test_readme_run" not in item.nodeid)


if importlib.util.find_spec("xdist") is not None:

    def pytest_xdist_make_scheduler(config, log):
        """xdist's scheduler by scope, with one scope for all the integration tests (pytest 9's
        node ids no longer carry `--dist loadgroup`'s group to the scheduler)."""
        from xdist.scheduler import LoadScopeScheduling

        class IntegrationTogether(LoadScopeScheduling):
            def _split_scope(self, nodeid: str) -> str:
                if nodeid.startswith("tests/integration/"):
                    return "tests/integration"
                return nodeid.split("::", 1)[0]

        return IntegrationTogether(config, log)
