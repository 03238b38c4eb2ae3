"""Marks every test under tests/integration as `integration` (select with -m), runs the
README's blocks first, and says how `make test` may split the suite over two pytest-xdist
workers (`--dist loadgroup`): every integration test on one worker, in this order (they share
one Ray cluster, and the README's `ray stop` stops every Ray on the machine), each unit module
whole on either (its module-scoped fixtures run once)."""

import pytest


def pytest_collection_modifyitems(items):
    for item in items:
        if "/integration/" in str(item.fspath):
            item.add_marker(pytest.mark.integration)
            item.add_marker(pytest.mark.xdist_group("integration"))
        else:
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
    # The README's blocks start and stop Ray clusters of their own, and `ray stop` (which the
    # README shows) stops every Ray on the machine: they run before the session's cluster
    # exists. The sort is stable, so everything else keeps its order.
    items.sort(key=lambda item: "test_readme_run" not in item.nodeid)
