"""Linear layers that multiply in int8: activations quantized per row, weights per output row.

Prefill and large decode batches are compute-bound on the CPU, and a CPU with VNNI
multiplies int8 about twice as fast as bfloat16 (`torch._int_mm`, through oneDNN: 800 against
430 GFLOP/s at 256 rows on two cores here). `Int8Linear` keeps an int8 copy of its weight
with one scale per output row (w = q * scale[n]); on each call it quantizes each row of x to
int8 with a scale of its own (max |x| / 127: dynamic, symmetric), multiplies in int32 and
scales the products back to x's dtype. The two ends are a C helper (`int8_rows.c`, built by
`native.py`): one pass over x, one over the products. Between two such layers the activations
can stay int8: `swiglu_rows` takes a fused gate/up layer's products to the down projection's
int8 rows in one pass (SiLU(gate) * up, rounded per row; to bfloat16 first where the
separate ops would round).

Rounding the activations costs accuracy where a few input channels carry values far above
the rest: the row's scale follows them and the other channels keep few levels
(`models/int8_activations.py` says which projections are left out for that).

x: [M, K] float32 or bfloat16 -> [M, N] in x's dtype.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from lockgate.llm.native import load_library

SOURCE = Path(__file__).with_name("int8_rows.c")
_TINY = 1e-12


@dataclass(frozen=True, slots=True)
class Int8Rows:
    """The loaded helper: `quantize_rows`, `dequantize_rows` and `swiglu_quantize_rows`
    (`int8_rows.c`)."""

    quantize_rows: ctypes._CFuncPtr  # type: ignore[name-defined]
    dequantize_rows: ctypes._CFuncPtr  # type: ignore[name-defined]
    swiglu_quantize_rows: ctypes._CFuncPtr  # type: ignore[name-defined]


@functools.cache
def load_int8_rows() -> Int8Rows:
    """Build the helper if this machine has no copy yet, and load it (once per process);
    `KernelUnavailable` where it cannot be had."""
    library, _ = load_library(SOURCE)
    pointer, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    quantize = library.quantize_rows
    quantize.argtypes = [pointer, i32, i64, i64, pointer, pointer, i32]
    quantize.restype = None
    dequantize = library.dequantize_rows
    dequantize.argtypes = [pointer, i64, i64, pointer, pointer, i32, pointer, i32]
    dequantize.restype = None
    swiglu = library.swiglu_quantize_rows
    swiglu.argtypes = [pointer, i64, i64, pointer, pointer, i32, pointer, pointer, i32]
    swiglu.restype = i32
    return Int8Rows(quantize, dequantize, swiglu)


@dataclass(frozen=True, slots=True)
class QuantizedRows:
    """Activations rounded to int8 per row: values [M, K] int8, scales [M] float32
    (x = values * scales[m])."""

    values: torch.Tensor
    scales: torch.Tensor


def swiglu_rows(gate_up: Int8Linear, rows: QuantizedRows, dtype: torch.dtype) -> QuantizedRows:
    """SiLU(gate) * up of a fused gate/up layer's input rows, as int8 rows for the next layer,
    in one pass: what `gate_up.scale_back` to `dtype`, `F.silu`, the product and the next
    layer's `quantize` give (rounded to bfloat16 between them as they round, for dtype
    bfloat16), but for SiLU's last bit. [M, K] -> [M, N / 2]."""
    products = gate_up.products(rows)  # [M, 2I] int32: the gate's I outputs, then the up's
    m, width = products.shape[0], gate_up.out_features // 2
    values = torch.empty(m, width, dtype=torch.int8)
    scales = torch.empty(m, dtype=torch.float32)
    status = gate_up.rows.swiglu_quantize_rows(
        products.data_ptr(),
        m,
        width,
        rows.scales.data_ptr(),
        gate_up.scales.data_ptr(),
        int(dtype == torch.bfloat16),
        values.data_ptr(),
        scales.data_ptr(),
        torch.get_num_threads(),
    )
    if status != 0:
        raise MemoryError(f"swiglu_rows: no buffer for a row of {width} values")
    return QuantizedRows(values, scales)


class Int8Linear(nn.Module):
    """A bias-free Linear of weight [N, K] that multiplies in int8 (see the module's text)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.rows = load_int8_rows()
        self.out_features, self.in_features = weight.shape
        w = weight.float()
        scales = (w.abs().amax(dim=1) / 127).clamp_min(_TINY)  # [N]
        q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
        self.qweight_t = q.t()  # [K, N], a view of q [N, K] as torch._int_mm takes it
        self.scales = scales.contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = self.quantize(x)
        return self.scale_back(self.products(rows), rows.scales, x.dtype)

    def quantize(self, x: torch.Tensor) -> QuantizedRows:
        """x [M, K] float32 or bfloat16 -> its rows in int8, each with a scale of its own."""
        if (
            x.dim() != 2
            or x.dtype not in (torch.float32, torch.bfloat16)
            or x.shape[1] != self.in_features
        ):
            raise ValueError(f"Int8Linear: x {tuple(x.shape)} {x.dtype}, in {self.in_features}")
        x = x.contiguous()
        m, k = x.shape
        bf16 = int(x.dtype == torch.bfloat16)
        q = torch.empty(m, k, dtype=torch.int8)
        scales = torch.empty(m, dtype=torch.float32)
        self.rows.quantize_rows(
            x.data_ptr(), bf16, m, k, q.data_ptr(), scales.data_ptr(), torch.get_num_threads()
        )
        return QuantizedRows(q, scales)

    def products(self, rows: QuantizedRows) -> torch.Tensor:
        """[M, K] int8 rows -> their products with the weight, [M, N] int32."""
        return torch._int_mm(rows.values, self.qweight_t)

    def scale_back(
        self, products: torch.Tensor, row_scales: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        """products [M, N] int32 -> products * row_scales[m] * the weight's scales[n], [M, N]
        in dtype (float32 or bfloat16)."""
        m = products.shape[0]
        out = torch.empty(m, self.out_features, dtype=dtype)
        self.rows.dequantize_rows(
            products.data_ptr(),
            m,
            self.out_features,
            row_scales.data_ptr(),
            self.scales.data_ptr(),
            int(dtype == torch.bfloat16),
            out.data_ptr(),
            torch.get_num_threads(),
        )
        return out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"
