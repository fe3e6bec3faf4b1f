"""Which megatron-core is installed, for the version checks in megatron_moe/compat/ (only there)."""

from functools import lru_cache

from packaging.version import Version

# The range pyproject.toml pins and CI tests: 0.16.1 on Python 3.11, the newest 0.19.x on 3.12.
OLDEST_TESTED = Version("0.16.1")
NEXT_UNTESTED = Version("0.20")


@lru_cache(maxsize=None)
def megatron_core_version() -> Version:
    import megatron.core

    return Version(megatron.core.__version__)


def distribution_version() -> Version:
    """The installed megatron-core's version from its package metadata, without importing it
    (for what must happen before ``import megatron.core``)."""
    from importlib.metadata import version

    return Version(version("megatron-core"))


def mcore_at_least(version: str) -> bool:
    """True when the installed megatron-core is ``version`` or newer (pre-releases count as it)."""
    return megatron_core_version().release >= Version(version).release
