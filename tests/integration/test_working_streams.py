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


@pytest.mark.parametrize("bits", blocks.BYTE_BITS)
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_a_cpu_dequantizes_by_bytes_in_float32(bits: int, group_size: int) -> None:
    """On the CPU ``_dequantize`` unpacks the words' bytes itself: MLX's own affine
    dequantization, computed in float32 from the float16 scales and biases (``mx.dequantize``
    given them as float32), bit for bit; the value order, the masks and the groups are MLX's."""
    mx.random.seed(bits * 1000 + group_size)
    x = mx.random.normal((2, 3, 37, 256)) * 4 + mx.random.uniform(-2, 2, (2, 3, 37, 1))
    w, scales, biases = mx.quantize(x, group_size=group_size, bits=bits)
    scales, biases = scales.astype(blocks.SCALE_DTYPE), biases.astype(blocks.SCALE_DTYPE)
    expected = mx.dequantize(w, scales.astype(mx.float32), biases.astype(mx.float32), group_size=group_size,
                             bits=bits, dtype=mx.float32)
    got = blocks._dequantize(w, scales, biases, bits, group_size, mx.float32)  # noqa: SLF001
    assert got.dtype == mx.float32 and got.shape == x.shape
    assert mx.array_equal(got, expected).item()
    # What MLX computes from the float16 scales rounds the product and the sum to float16: the
    # two differ by those roundings at most (half a float16 step of each, a step 2^-10 of a value).
    rounded = mx.dequantize(w, scales, biases, group_size=group_size, bits=bits, dtype=mx.float32)
    product = got - mx.repeat(biases.astype(mx.float32), group_size, axis=-1)
    step = (mx.abs(product) + mx.abs(got)) * 2.0 ** -10 + 2.0 ** -24
    assert (mx.abs(got - rounded) <= step).all().item()
    assert mx.array_equal(blocks._dequantize(w, scales, biases, bits, group_size, mx.float16),  # noqa: SLF001
                          expected.astype(mx.float16)).item()


def test_widths_that_straddle_bytes_are_left_to_mlx() -> None:
    """5- and 6-bit keys (``k5c``, ``k6v4``) pack values across bytes: ``mx.dequantize`` decodes them."""
    x = mx.random.normal((1, 2, 16, 64))
    for bits in (5, 6):
        w, scales, biases = mx.quantize(x, group_size=64, bits=bits)
        scales, biases = scales.astype(blocks.SCALE_DTYPE), biases.astype(blocks.SCALE_DTYPE)
        assert mx.array_equal(blocks._dequantize(w, scales, biases, bits, 64, mx.float32),  # noqa: SLF001
                              mx.dequantize(w, scales, biases, group_size=64, bits=bits, dtype=mx.float32)).item()
