import os
import sys

import pytest

# tests import helper modules (loops.py) that live beside them
sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(scope="session")
def ray_cluster():
    """One private local Ray cluster for the whole test session (loopback only, no dashboard)."""
    import logging
    import warnings

    import ray

    with warnings.catch_warnings():  # Ray's processes are fork+exec'd: JAX's fork warning does not apply
        warnings.filterwarnings("ignore", message="os.fork", category=RuntimeWarning)
        ray.init(address="local", num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1",
                 logging_level=logging.ERROR, log_to_driver=False)
    yield
    ray.shutdown()
