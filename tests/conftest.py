"""Marks every test under tests/integration as `integration` (select with -m), and runs the
README's blocks first."""

import pytest


def pytest_collection_modifyitems(items):
    for item in items:
        if "/integration/" in str(item.fspath):
            item.add_marker(pytest.mark.integration)
    # The README's blocks start and stop Ray clusters of their own, and `ray stop` (which the
    # README shows) stops every Ray on the machine: they run before the session's cluster
    # exists. The sort is stable, so everything else keeps its order.
    items.sort(key=lambda item: "test_readme_run" not in item.nodeid)
