"""device.py's helpers: constants made once, and never first inside a CUDA graph capture."""
from __future__ import annotations

import pytest
import torch

from specserve.device import Constants

from .conftest import DEVICE


def test_constants_are_made_once_with_torch_values():
    const = Constants(DEVICE["name"])
    assert torch.equal(const.arange(5).cpu(), torch.arange(5))
    assert torch.equal(const.arange(-1, 4).cpu(), torch.arange(-1, 4))
    assert torch.equal(const.arange(0, 12, 4).cpu(), torch.tensor([0, 4, 8]))
    assert torch.equal(const.full((3,), 7, torch.int32).cpu(), torch.full((3,), 7, dtype=torch.int32))
    assert const.arange(5) is const.arange(5) and const.full((3,), 7, torch.int32) is const.full((3,), 7, torch.int32)
    assert const.full((3,), 7) is not const.full((3,), 7, torch.int32)


@pytest.mark.skipif(DEVICE["name"] != "cuda", reason="CUDA graphs")
def test_a_constant_first_asked_for_inside_a_capture_is_refused():
    const = Constants("cuda")
    made = const.arange(4)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="inside a CUDA graph capture"):
        with torch.cuda.graph(graph):
            assert const.arange(4) is made  # made before: fine
            const.arange(6)
