"""The RMSNorm kernels (csrc/norm_rope.cc: RmsNorm, AddRmsNorm) against numpy in float64, in
float32 and float16, for sizes with and without a tail past the last 16 values, on one and two
threads (rows * size past the threshold for splitting rows), and per-head norms read from the
front of wider rows (Qwen3's q/k norms over a fused q|k|v row)."""

import numpy as np
import pytest
from ms_cells import call_aot

from vllm_mindspore.ops import kernels

EPS = 1e-6
TOLERANCE = {"float32": 1e-5, "float16": 2e-3}


def rms_norm(x, weight):
    x = x.astype(np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS) * weight


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    kernels.set_num_threads(request.param)
    yield request.param
    kernels.set_num_threads(1)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("tokens, size", [(5, 37), (300, 512)])
def test_add_rms_norm_matches_numpy(threads, dtype, tokens, size):
    g = np.random.default_rng(size)
    x = g.standard_normal((tokens, size)).astype(dtype)
    residual = g.standard_normal((tokens, size)).astype(dtype)
    weight = (1 + 0.1 * g.standard_normal(size)).astype(dtype)
    y, total = np.empty_like(x), np.empty_like(x)
    eps = np.array([EPS], np.float32)
    assert call_aot(kernels.library_path(), "AddRmsNorm",
                    [x, residual, weight, eps, y, total]) == 0
    want_total = x.astype(np.float64) + residual
    tol = TOLERANCE[dtype]
    np.testing.assert_allclose(total, want_total, rtol=tol, atol=tol)
    np.testing.assert_allclose(y, rms_norm(want_total, weight), rtol=tol, atol=tol)

    assert call_aot(kernels.library_path(), "RmsNorm", [x, weight, eps, y]) == 0
    np.testing.assert_allclose(y, rms_norm(x, weight), rtol=tol, atol=tol)


def test_per_head_norm_reads_the_front_of_wider_rows(threads):
    """y [T, heads, D] from the first heads * D values of each row of x [T, W]."""
    g = np.random.default_rng(0)
    tokens, heads, head_dim, width = 7, 4, 24, 4 * 24 + 40
    x = g.standard_normal((tokens, width)).astype(np.float32)
    weight = (1 + 0.1 * g.standard_normal(head_dim)).astype(np.float32)
    y = np.empty((tokens, heads, head_dim), np.float32)
    assert call_aot(kernels.library_path(), "RmsNorm",
                    [x, weight, np.array([EPS], np.float32), y]) == 0
    want = rms_norm(x[:, :heads * head_dim].reshape(tokens, heads, head_dim), weight)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
