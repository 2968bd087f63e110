"""Side CUDA streams, one cache for the whole package.

``side_stream(device, index)`` returns the same stream for the same ``(device, index)`` every time,
so concurrent work does not create a stream per call. Index 0 is the shared expert's overlap stream
(``moe/layer.py``); the weight-gradient loop over several streams uses indices 1 and up
(``ops/wgrad/cublas_loop.py``), so the two never queue behind each other.
"""

from __future__ import annotations

import torch

__all__ = ["side_stream"]

_STREAMS: dict[tuple[torch.device, int], torch.cuda.Stream] = {}


def side_stream(device: torch.device, index: int = 0) -> torch.cuda.Stream:
    """The ``index``-th side stream of the CUDA ``device`` (created on first use, then reused)."""
    key = (torch.device(device), index)
    if key not in _STREAMS:
        _STREAMS[key] = torch.cuda.Stream(key[0])
    return _STREAMS[key]
