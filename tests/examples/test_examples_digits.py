"""The README's main job: the digits example trains a real model on real data."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("sklearn")


@pytest.fixture
def one_thread():
    # On a busy 2-core runner, torch's two OpenMP threads spin-wait on each other: 2 epochs of
    # this example took 47.7 s with 2 threads and 1.6 s with 1 (measured under load here).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
def test_digits_example_reaches_97_percent(capsys, one_thread):
    from fitkit.examples import digits

    accuracy = digits.main(["--verbose", "0"])
    assert accuracy >= 0.97
    out = capsys.readouterr().out
    assert out.startswith("test accuracy ") and "trained in" in out
