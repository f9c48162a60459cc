"""Int8 activations (`int8_linear.py`, `int8_rows.c`): each row of x rounded to int8 with a
scale of its own, the weight per output row, the int32 products scaled back; against a
reference of the same rounding in torch, and against the float product."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from lockgate.llm.int8_linear import Int8Linear

pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler (apt-get install gcc)"
)


def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The same rounding, in float64 and int64: what Int8Linear computes, in float32."""
    x, w = x.float(), w.float()
    w_scale = (w.abs().amax(dim=1) / 127).clamp_min(1e-12)
    qw = torch.round(w / w_scale[:, None]).clamp(-127, 127)
    x_scale = (x.abs().amax(dim=1) / 127).clamp_min(1e-12)
    qx = torch.round(x * (1 / x_scale)[:, None]).clamp(-127, 127)
    products = qx.long() @ qw.long().t()
    return (products.double() * x_scale.double()[:, None] * w_scale.double()[None, :]).float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# the last two are large enough for the rows to be shared over threads (int8_rows.c)
@pytest.mark.parametrize(
    ("m", "k", "n"), [(1, 64, 32), (3, 40, 13), (37, 576, 960), (64, 1024, 96), (200, 576, 3072)]
)
def test_it_computes_the_rounded_product(dtype: torch.dtype, m: int, k: int, n: int) -> None:
    gen = torch.Generator().manual_seed(m * k + n)
    w = torch.randn(n, k, generator=gen) * 0.05
    x = torch.randn(m, k, generator=gen).to(dtype)
    out = Int8Linear(w)(x)
    assert out.dtype == dtype and out.shape == (m, n)
    ref = reference(x, w)
    # float32: the same integers, scaled in another order; bfloat16: rounded once more
    tolerance = 1e-5 if dtype == torch.float32 else 2**-8
    torch.testing.assert_close(out.float(), ref, rtol=tolerance, atol=tolerance * ref.abs().max())
    exact = x.float() @ w.t()
    error = float((out.float() - exact).norm() / exact.norm())
    assert 0 < error < 0.03  # it rounded, by about 1%
    transposed = x.float() @ w.flip(1).t()  # a wrong layout is far off
    assert float((out.float() - transposed).norm() / transposed.norm()) > 0.5


def test_rows_of_zeros_tiny_values_nan_and_infinity() -> None:
    """Zeros and values too small to matter give zeros, never NaN; a row holding a NaN or an
    infinity gives NaN, as a float matmul would; the other rows are not touched."""
    w = torch.randn(16, 32)
    x = torch.randn(6, 32)
    x[0] = 0
    x[1] = 1e-38
    x[2, 3] = float("nan")
    x[3, 7] = float("inf")
    x[4, 0] = float("-inf")
    out = Int8Linear(w)(x)
    assert torch.equal(out[0], torch.zeros(16)) and torch.equal(out[1], torch.zeros(16))
    assert out[2:5].isnan().all()
    torch.testing.assert_close(out[5], reference(x[5:], w)[0], rtol=1e-5, atol=1e-5)


def test_a_wrong_input_is_refused() -> None:
    layer = Int8Linear(torch.randn(8, 16))
    with pytest.raises(ValueError, match="in 16"):
        layer(torch.randn(2, 15))
    with pytest.raises(ValueError, match="float16"):
        layer(torch.randn(2, 16).half())
    with pytest.raises(ValueError, match=r"\(2, 3, 16\)"):
        layer(torch.randn(2, 3, 16))
