import pytest

from tests.sync.helpers import PRESETS, tiny


@pytest.fixture
def trainer():
    """The trainer's model after 'training': other weights than the engine's starting ones."""
    return tiny(seed=1)


@pytest.fixture(params=PRESETS)
def preset(request) -> str:
    return request.param
