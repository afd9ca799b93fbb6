"""Settings every test starts from."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True, scope="session")
def _no_converted_model_cache() -> Iterator[None]:
    """Tests read models from their files and leave the user's cache alone.

    Session-scoped so that module-scoped engines are covered too; the tests of
    the cache itself turn it back on, in a temporary folder.
    """
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVSERVE_WEIGHT_CACHE", "0")
        yield
