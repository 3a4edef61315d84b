import pathlib

import pytest

from offload import native

REPO = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture
def repo() -> pathlib.Path:
    return REPO


@pytest.fixture(params=native.supported_variants())
def variant(request):
    """Run the test once per kernel variant this CPU can execute (portable included)."""
    before = native.active_variant()
    native.select_variant(request.param)
    yield request.param
    native.select_variant(before)
