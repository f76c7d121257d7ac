"""Build-time settings that a `with` block overrides for the cells built inside it."""

import contextlib
from typing import Generic, TypeVar

T = TypeVar("T")


class ScopedSetting(Generic[T]):
    """A module-wide value, `default` outside any `using` block."""

    def __init__(self, default: T):
        self.value = default

    @contextlib.contextmanager
    def using(self, value: T):
        """`value` inside the block, the previous value after it (also on error)."""
        previous, self.value = self.value, value
        try:
            yield
        finally:
            self.value = previous
