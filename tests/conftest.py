import os
import sys

import pytest

# tests import helper modules (loops.py) that live beside them
sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(scope="session")
def ray_cluster():
    """One private local Ray cluster for the whole test session (loopback only, no dashboard)."""
    import ray
    from msrl.backends.ray_backend import init_local, shutdown

    init_local(num_cpus=4)
    yield
    if ray.is_initialized():
        shutdown()
