import os
import subprocess
import sys

import pytest

# tests import helpers (spawn.py) from this folder
sys.path.insert(0, os.path.dirname(__file__))

# `make test-fast`: the unit tests that start no process. A test that starts one is marked
# `spawns` (left out of the fast loop); one that starts a process unmarked fails there, naming it.
FAST = os.environ.get("THINWIRE_TEST_FAST") == "1"
if FAST:  # the standard library's own one-off probe (`uname -p`, for a summary's platform), cached from here on
    import platform

    platform.platform()


def pytest_configure(config):
    config.addinivalue_line("markers", "spawns: starts a process (a rank, the CLI): left out of `make test-fast`")


class SpawnedInFastLoop(AssertionError):
    pass


def _refuse(what):
    def start(*args, **kwargs):
        raise SpawnedInFastLoop(f"{what} in `make test-fast`: mark the test @pytest.mark.spawns")
    return start


@pytest.fixture(autouse=True)
def _no_processes_in_the_fast_loop(request, monkeypatch):
    if FAST and request.node.get_closest_marker("spawns") is None:
        import multiprocessing.context

        monkeypatch.setattr(subprocess.Popen, "__init__", _refuse("a subprocess started"))
        for ctx in ("SpawnProcess", "ForkProcess", "ForkServerProcess"):
            monkeypatch.setattr(getattr(multiprocessing.context, ctx), "start", _refuse("a process spawned"))
    yield
