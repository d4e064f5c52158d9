"""Exact-byte tests, counted both ways: as a CPU counts (exact bytes) and as CUDA's caching allocator does (every
storage in whole 512-byte blocks, ``memory.cuda_rounding``). A test that takes the ``counting`` fixture runs once in
each mode, so its claims must compare like with like: bytes the tracker measured against ``memory.block_bytes`` of the
same tensors, or against ``counted(n)`` for a storage of ``n`` bytes.

    from counting import counted, counting  # noqa: F401 (counting is a fixture)
"""
from __future__ import annotations

import pytest

from course_utils import memory


@pytest.fixture(params=["exact", "cuda-blocks"])
def counting(request):
    with memory.cuda_rounding(request.param == "cuda-blocks"):
        yield request.param


def counted(*storage_bytes: int, device: str = "cpu") -> int:
    """The tracker's count of storages of these sizes on ``device``, in the mode now in force."""
    block = memory.CUDA_BLOCK_BYTES
    return sum(-(-n // block) * block if memory.rounding_to_blocks(device) else n for n in storage_bytes)
