"""The environment for a test's subprocess that needs several CPU devices."""
import os


def host_devices_env(n: int, **extra) -> dict:
    """os.environ with `n` host CPU devices; the run's other XLA flags (conftest.py) are kept."""
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={n}".strip()
    return dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu", **extra)
