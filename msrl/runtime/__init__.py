"""The run-time side: a session (the public API), the replica driver and its transports."""
