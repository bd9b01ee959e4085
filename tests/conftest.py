import os
import sys

import pytest

# tests import helper modules (loops.py) that live beside them
sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(scope="session")
def ray_cluster():
    """One private local Ray cluster for the whole test session (no dashboard)."""
    import logging
    import warnings

    import ray

    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    with warnings.catch_warnings():  # Ray's processes are fork+exec'd: JAX's fork warning does not apply
        warnings.filterwarnings("ignore", message="os.fork", category=RuntimeWarning)
        ray.init(address="local", num_cpus=4, include_dashboard=False,
                 logging_level=logging.ERROR, log_to_driver=False)
    yield
    ray.shutdown()
