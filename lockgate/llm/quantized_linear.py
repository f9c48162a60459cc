"""Weight-only quantized Linear layers: int8 per output channel, int4 in groups of 32.

A `QuantizedWeight` holds one [out, in] weight in a layout of its own, independent of any
kernel: int8 values with one scale per output row, or int4 values packed two to a byte with a
scale and a zero per group of 32 inputs. The loader builds it (from GGUF blocks, or from a
dense weight by round-to-nearest), the conversion cache stores it, and `QuantizedLinear`
packs it once, at load, for torch's CPU kernels:

- int8: `aten._weight_int8pack_mm(x, q [N, K] int8, scales [N])`, w = q * scale[n];
- int4: `aten._weight_int4pack_mm_for_cpu(x, packed, 32, scale_zeros [K/32, N, 2])`,
  w = (q - 8) * scale + zero, q in 0..15, per group of 32 inputs.

Both kernels take their scales in the activation dtype and are fast only in bfloat16 (in
float32 they are tens of times slower than a dense matmul), so they always run in bfloat16:
in a float32 model, the few rows they take are cast to bfloat16 and back. Scales made here
are rounded to bfloat16 before the values are rounded, so the kernel's dequantization is the
one the values were chosen for.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

INT4_GROUP = 32  # inputs per int4 group (GGUF Q4_0 / Q4_1 blocks are 32 wide too)
KINDS = ("int8", "int4")
_N_MULTIPLE = 16  # the int4 CPU packer needs the output rows in multiples of 16
_TINY = 1e-12


@dataclass(slots=True)
class QuantizedWeight:
    """One weight [N, K], quantized. `qweight`:

    - int8: int8 [N, K]; `scales` float32 [N]; `zeros` None;
    - int4: uint8 [N, K/2], input 2j in the low nibble and 2j+1 in the high one;
      `scales`, `zeros` float32 [N, K/32].
    """

    kind: str
    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None = None

    @property
    def out_features(self) -> int:
        return int(self.qweight.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.qweight.shape[1]) * (2 if self.kind == "int4" else 1)

    @classmethod
    def int4(cls, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> QuantizedWeight:
        """From values q [N, K] in 0..15 and per-group scales, zeros [N, K/32]."""
        q = q.to(torch.uint8)
        packed = q[:, 0::2] | (q[:, 1::2] << 4)
        return cls("int4", packed.contiguous(), scales.float(), zeros.float())

    def int4_values(self) -> torch.Tensor:
        """int4: the values q [N, K] in 0..15, as uint8."""
        low, high = self.qweight & 0x0F, self.qweight >> 4
        return torch.stack((low, high), dim=-1).reshape(self.out_features, self.in_features)

    def dequantize(self) -> torch.Tensor:
        """The weight it stands for, float32 [N, K]."""
        if self.kind == "int8":
            return self.qweight.float() * self.scales[:, None]
        assert self.zeros is not None
        q = self.int4_values().float().view(self.out_features, -1, INT4_GROUP)  # [N, K/32, 32]
        w = (q - 8) * self.scales[..., None] + self.zeros[..., None]
        return w.reshape(self.out_features, self.in_features)

    def rows(self, index: torch.Tensor) -> QuantizedWeight:
        """The output rows `index`, in that order (groups run along inputs, so rows move whole)."""
        zeros = None if self.zeros is None else self.zeros[index].contiguous()
        return QuantizedWeight(
            self.kind, self.qweight[index].contiguous(), self.scales[index].contiguous(), zeros
        )

    @staticmethod
    def cat(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """Stacked along the outputs, as Q/K/V or gate/up are fused: all of one kind."""
        kind = parts[0].kind
        if any(p.kind != kind for p in parts):
            raise ValueError(f"cannot fuse {[p.kind for p in parts]} weights")
        zeros = None
        if kind == "int4":
            zeros = torch.cat([p.zeros for p in parts if p.zeros is not None])
        return QuantizedWeight(
            kind,
            torch.cat([p.qweight for p in parts]),
            torch.cat([p.scales for p in parts]),
            zeros,
        )

    def tensors(self, name: str) -> dict[str, torch.Tensor]:
        """Named tensors for a safetensors file: `name.qweight`, `name.scales`, `name.zeros`."""
        out = {f"{name}.qweight": self.qweight, f"{name}.scales": self.scales}
        if self.zeros is not None:
            out[f"{name}.zeros"] = self.zeros
        return out

    @classmethod
    def from_tensors(
        cls, kind: str, name: str, tensors: dict[str, torch.Tensor]
    ) -> QuantizedWeight:
        """Inverse of `tensors`; a KeyError or ValueError when something is missing or wrong."""
        if kind not in KINDS:
            raise ValueError(f"{name}: unknown quantization {kind!r}")
        weight = cls(kind, tensors[f"{name}.qweight"], tensors[f"{name}.scales"])
        if kind == "int4":
            weight.zeros = tensors[f"{name}.zeros"]
        weight.check(name)
        return weight

    def check(self, name: str) -> None:
        n, width = self.qweight.shape
        if self.kind == "int8":
            ok = self.qweight.dtype == torch.int8 and tuple(self.scales.shape) == (n,)
        else:
            groups = (n, 2 * width // INT4_GROUP)
            ok = (
                self.qweight.dtype == torch.uint8
                and (2 * width) % INT4_GROUP == 0
                and self.zeros is not None
                and tuple(self.scales.shape) == groups == tuple(self.zeros.shape)
            )
        if not ok:
            raise ValueError(f"{name}: malformed {self.kind} weight")


def quantize_int8(weight: torch.Tensor) -> QuantizedWeight:
    """Symmetric, one scale per output row: scale = max |w| / 127. weight: [N, K]."""
    w = weight.float()
    scales = (w.abs().amax(dim=1) / 127).clamp_min(_TINY).bfloat16().float()  # [N]
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return QuantizedWeight("int8", q, scales)


def can_quantize_int4(weight: torch.Tensor) -> bool:
    return weight.dim() == 2 and weight.shape[1] % INT4_GROUP == 0


def quantize_int4(weight: torch.Tensor) -> QuantizedWeight:
    """Asymmetric round-to-nearest in groups of 32 inputs: each group's [min, max] spread
    over 16 levels. weight: [N, K], K a multiple of 32."""
    if not can_quantize_int4(weight):
        raise ValueError(f"int4 needs [N, K] with K a multiple of {INT4_GROUP}")
    n, k = weight.shape
    w = weight.float().view(n, k // INT4_GROUP, INT4_GROUP)  # [N, G, 32]
    low, high = w.amin(dim=-1), w.amax(dim=-1)  # [N, G]
    scales = ((high - low) / 15).clamp_min(_TINY).bfloat16().float()
    zeros = (low + 8 * scales).bfloat16().float()  # the value of q = 8
    q = torch.round((w - zeros[..., None]) / scales[..., None] + 8).clamp(0, 15)
    return QuantizedWeight.int4(q.view(n, k), scales, zeros)


DENSE_FROM_TOKENS = 8  # rows of x from which a bfloat16 dense copy is faster than the kernels
DENSE_FROM_TOKENS_FLOAT32 = 16  # the same for a float32 copy, which reads twice the bytes
KERNEL_DTYPE = torch.bfloat16  # the weight-only kernels' activations and scales


class QuantizedLinear(nn.Module):
    """A bias-free Linear over a `QuantizedWeight`, packed once for torch's CPU kernel.

    The weight-only kernels read a quarter (int4) or half (int8) of the bytes, which is what
    a decode step of a few rows waits on; from `dense_from` rows up (prefill, large decode
    batches: `DENSE_FROM_TOKENS` in bfloat16, `DENSE_FROM_TOKENS_FLOAT32` in float32) the
    work is compute, where they are up to 2.5x slower than a dense matmul. So the layer also
    keeps the weight it stands for, dequantized once to `dtype`, and uses it for those: the
    same weights, at the cost of a dense copy in memory. The kernels run in bfloat16 whatever
    `dtype` is; in float32 (a CPU without native bfloat16, `llm/cpu.py`) the dense copy is
    float32, where prefill and large batches run fastest.

    x: [T, in] in `dtype` -> [T, out] in `dtype`."""

    dense: torch.Tensor

    def __init__(
        self, weight: QuantizedWeight, dtype: torch.dtype, dense: torch.Tensor | None = None
    ) -> None:
        """`dense`: the weight to use from `dense_from` rows when the model holds it
        already (a tied logits head: the embedding), instead of a dequantized copy."""
        super().__init__()
        self.kind = weight.kind
        self.in_features, self.out_features = weight.in_features, weight.out_features
        if dense is None:
            dense = weight.dequantize().to(dtype)
        self.register_buffer("dense", dense, persistent=False)
        # the dense copy in another layout (oneDNN's packed bfloat16, `models/packing.py`),
        # which then runs the rows from `dense_from` up; `dense` is released
        self.dense_linear: nn.Module | None = None
        self.dense_from = (
            DENSE_FROM_TOKENS_FLOAT32 if dense.dtype == torch.float32 else DENSE_FROM_TOKENS
        )
        if weight.kind == "int8":
            self.register_buffer("qweight", weight.qweight.contiguous(), persistent=False)
            self.register_buffer("scales", weight.scales.to(KERNEL_DTYPE), persistent=False)
        else:
            self._pack_int4(weight, KERNEL_DTYPE)

    def _pack_int4(self, weight: QuantizedWeight, dtype: torch.dtype) -> None:
        assert weight.zeros is not None
        q = weight.int4_values().to(torch.int32)  # [N, K]
        scales, zeros = weight.scales, weight.zeros  # [N, K/32]
        pad = -self.out_features % _N_MULTIPLE  # rows of zeros: q 8, scale 0, zero 0
        if pad:
            q = torch.cat([q, torch.full((pad, q.shape[1]), 8, dtype=torch.int32)])
            scales = torch.cat([scales, scales.new_zeros(pad, scales.shape[1])])
            zeros = torch.cat([zeros, zeros.new_zeros(pad, zeros.shape[1])])
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1)
        scale_zeros = torch.stack((scales.t(), zeros.t()), dim=-1)  # [K/32, N, 2]
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("scale_zeros", scale_zeros.to(dtype).contiguous(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] >= self.dense_from:
            if self.dense_linear is not None:
                return self.dense_linear(x)
            return torch.nn.functional.linear(x, self.dense)
        dtype = x.dtype
        x = x.to(KERNEL_DTYPE).contiguous()
        if self.kind == "int8":
            out = torch.ops.aten._weight_int8pack_mm(x, self.qweight, self.scales)
        else:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x, self.packed, INT4_GROUP, self.scale_zeros
            )
            if out.shape[1] != self.out_features:
                out = out[:, : self.out_features]
        return out.to(dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.kind}"
