"""Where a restored cache's working copy is built: on the model's device and stream
(app/cache/blocks.py, working_streams), selected by the device; the GPU path is tested by
what it selects, the CPU path for real."""

from __future__ import annotations

import mlx.core as mx
import pytest

from app.cache import blocks


def test_a_gpu_model_builds_its_working_copy_on_the_gpus_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = mx.Device(mx.gpu, 0)
    asked = []
    monkeypatch.setattr(blocks.mx, "default_device", lambda: gpu)
    monkeypatch.setattr(blocks.mx, "default_stream", lambda device: asked.append(device) or f"stream of {device}")
    assert blocks.working_streams() == (f"stream of {gpu}",)
    assert asked == [gpu]  # never a CPU stream under a GPU model (8.4 s of an 11.1 s restore on an H200)


def test_on_the_cpu_the_layers_alternate_between_two_cpu_streams() -> None:
    streams = blocks.working_streams()
    assert len(streams) == 2 and streams[0] != streams[1]
    assert all(stream.device == mx.cpu for stream in streams)
