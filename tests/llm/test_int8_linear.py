"""Int8 activations (`int8_linear.py`, `int8_rows.c`): each row of x rounded to int8 with a
scale of its own, the weight per output row, the int32 products scaled back; against a
reference of the same rounding in torch, and against the float product. `swiglu_rows`:
SiLU(gate) * up of the products, rounded to int8 rows again."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from lockgate.llm.int8_linear import Int8Linear, swiglu_rows

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


def swiglu_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up of the int8 products of x and the fused gate/up weight w [2I, K], by
    torch's ops in x's dtype (the products scaled back in float64, then rounded to it)."""
    w_scale = (w.abs().amax(dim=1) / 127).clamp_min(1e-12)
    qw = torch.round(w / w_scale[:, None]).clamp(-127, 127)
    xf = x.float()
    x_scale = (xf.abs().amax(dim=1) / 127).clamp_min(1e-12)
    qx = torch.round(xf * (1 / x_scale)[:, None]).clamp(-127, 127)
    products = (qx.long() @ qw.long().t()).double() * x_scale.double()[:, None] * w_scale.double()
    gate, up = products.to(x.dtype).chunk(2, dim=-1)
    return torch.nn.functional.silu(gate).mul_(up).double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# the last two are large enough for the rows to be shared over threads
@pytest.mark.parametrize(
    ("m", "k", "i"), [(1, 64, 32), (5, 40, 24), (37, 576, 1536), (300, 96, 64)]
)
def test_swiglu_rows_rounds_silu_gate_times_up(dtype: torch.dtype, m: int, k: int, i: int) -> None:
    """The int8 rows of what the unfused path computes (scale back to x's dtype, SiLU, the
    product, quantize): each value the nearest level of its row, but where SiLU's last bit
    (another exp) moves a bfloat16 value over a rounding boundary."""
    gen = torch.Generator().manual_seed(m + k + i)
    w = torch.randn(2 * i, k, generator=gen) * 0.05
    x = (3 * torch.randn(m, k, generator=gen)).to(dtype)
    gate_up = Int8Linear(w)
    rows = swiglu_rows(gate_up, gate_up.quantize(x), dtype)
    assert rows.values.dtype == torch.int8 and rows.values.shape == (m, i)
    h = swiglu_reference(x, w)
    scales = h.abs().amax(dim=1) / 127
    torch.testing.assert_close(
        rows.scales.double(), scales, rtol=1e-5 if dtype == torch.float32 else 2**-7, atol=0
    )
    off = (rows.values.double() - h / rows.scales.double()[:, None]).abs()
    assert float(off.max()) <= (0.5 + 1e-3 if dtype == torch.float32 else 1.5)
    assert float((off > 0.5 + 1e-3).double().mean()) < 1e-3
    assert int(rows.values.abs().max()) == 127
    swapped = swiglu_reference(x, torch.cat(w.chunk(2)[::-1]))  # up and gate the other way
    got = rows.values.double() * rows.scales.double()[:, None]
    assert float((got - swapped).norm() / swapped.norm()) > 0.5


def test_swiglu_rows_of_zeros_and_nan() -> None:
    """A row of zeros gives zeros with the least scale; a row holding a NaN gives a NaN scale
    (its down projection comes out NaN, as a float one would); the others are untouched."""
    w = torch.randn(48, 32)
    x = torch.randn(3, 32)
    x[0] = 0
    x[1, 5] = float("nan")
    gate_up = Int8Linear(w)
    rows = swiglu_rows(gate_up, gate_up.quantize(x), torch.float32)
    assert torch.equal(rows.values[:2], torch.zeros(2, 24, dtype=torch.int8))
    assert float(rows.scales[0]) == pytest.approx(1e-12) and rows.scales[1].isnan()
    assert float(rows.scales[2]) > 0 and int(rows.values[2].abs().max()) == 127
