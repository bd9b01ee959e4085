"""Backends: executors for compiled fragments (found by name through the ``msrl.backends`` entry points)."""
