import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """One token cache and seed-checkpoint store for the whole session, as a user's cache would be."""
    return tmp_path_factory.mktemp("dpcompare-cache")
