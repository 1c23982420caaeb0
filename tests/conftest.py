import pytest
import torch


def pytest_collection_modifyitems(config, items):
    # ``@pytest.mark.cuda`` means "needs a real CUDA device": such a test is
    # skipped, with its reason, where there is none.  (Tests on a logical
    # "cuda" device need no GPU and carry no marker.)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)
    yield
