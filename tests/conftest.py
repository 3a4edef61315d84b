import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture
def repo() -> pathlib.Path:
    return REPO
