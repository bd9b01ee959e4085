import os
import sys

import pytest

# tests import helper modules (loops.py) that live beside them
sys.path.insert(0, os.path.dirname(__file__))


_MADE_CACHE: list[str] = []


def pytest_configure(config):
    """One JAX persistent compilation cache for the whole session, shared by the xdist workers (they inherit the
    controller's environment) and the processes tests start: the same small programs (PPO on CartPole, ...) are
    compiled by dozens of tests, and an executable loaded from the cache computes exactly what a fresh compile
    does. Set before anything compiles (JAX decides once per process whether it uses the cache)."""
    import tempfile

    from msrl.runner import enable_compile_cache

    if "MSRL_TEST_COMPILE_CACHE" not in os.environ:
        os.environ["MSRL_TEST_COMPILE_CACHE"] = tempfile.mkdtemp(prefix="msrl-test-jax-cache-")
        _MADE_CACHE.append(os.environ["MSRL_TEST_COMPILE_CACHE"])
    os.environ["MSRL_COMPILE_CACHE"] = os.environ["MSRL_TEST_COMPILE_CACHE"]
    enable_compile_cache(os.environ["MSRL_COMPILE_CACHE"])


def pytest_unconfigure(config):
    import shutil

    for path in _MADE_CACHE:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def ray_cluster():
    """One private local Ray cluster for the whole test session (loopback only, no dashboard)."""
    import ray
    from msrl.backends.ray_backend import init_local, shutdown

    init_local(num_cpus=4)
    yield
    if ray.is_initialized():
        shutdown()
