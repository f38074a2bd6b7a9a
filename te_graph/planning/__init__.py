"""Planning: the schedule from ``order`` and the buffers graphs share. Pure Python (no CUDA
calls), so CPU tests cover every decision."""
