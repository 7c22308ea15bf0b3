"""Shared test fixtures."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def one_thread():
    """Run a test with one torch thread: tiny matrices gain nothing from threads and lose a
    lot on a busy 2-core CI machine. Use with ``pytestmark = pytest.mark.usefixtures(...)``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
