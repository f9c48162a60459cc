"""The elementwise steps of a bfloat16 decoder layer in one pass each: RMSNorm (with the
residual add before it), and RoPE (with the KV cache stores after it).

In torch each is several ops, each a pass over [T, hidden] that allocates its result (RoPE:
eight, RMSNorm: six). A C helper (`layer_ops.c`, built by `native.py`) does each in one
pass, rounding to bfloat16 where torch's ops round and adding a row's squares in the order
torch's sum kernel does, so its results are torch's bit for bit. That order depends on the
width of the float vectors torch's sum kernel was built for (8 lanes on x86, where torch's
sum has no AVX-512 build): the helper is loaded with the width whose sums of squares are
torch's on a check at load.
On one core at 1,536 rows they take 0.23 ms (RMSNorm), 0.37 ms (add and RMSNorm) and
0.56 ms (RoPE of 12 heads) against torch's 0.54, 0.76 and 0.96 ms; at one row, 4 to 5 us
against 15 to 17 us. (SiLU stays torch's: its vectorised exp is five times faster than this
helper's, and rounds differently.)

`LayerOps.load()` is None where the helper cannot be had (no compiler) or where no width
gives torch's sums: the model then runs torch's ops. Tensors are bfloat16, rows contiguous.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from lockgate.llm.native import KernelUnavailable, load_library

SOURCE = Path(__file__).with_name("layer_ops.c")
log = logging.getLogger("lockgate.llm")
LANES = (8, 16, 4)  # widths of torch's float vectors (Vectorized<float>::size()), tried in turn
CHECK_WIDTHS = (64, 576, 4096 + 40)  # row widths of the check at load (a tail of 40 values)
CHECK_ROWS = 64
# the widest row torch sums on one thread: from 32,768 values (its GRAIN_SIZE) a lone row's
# sum is split over threads, in an order of its own
MAX_WIDTH = 32_767


@dataclass(frozen=True, slots=True)
class LayerOps:
    """The loaded helper's functions (`layer_ops.c`)."""

    library: ctypes.CDLL
    lanes: int  # torch's float vector width, which sets the order of a row's sum of squares

    @staticmethod
    @functools.cache
    def load() -> LayerOps | None:
        """Built if this machine has no copy yet, loaded and checked once per process; None
        (logged) where it cannot be had or does not give torch's results."""
        try:
            library, _ = load_library(SOURCE)
        except KernelUnavailable as exc:
            log.warning("layer ops: torch's ops instead of the native helper: %s", exc)
            return None
        pointer, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
        library.rms_norm.argtypes = [pointer, i64, i64, pointer, f32, i32, pointer, i32]
        library.add_rms_norm.argtypes = [
            pointer, pointer, i64, i64, pointer, f32, i32, pointer, pointer, i32
        ]  # fmt: skip
        library.rope.argtypes = [pointer, i64, i64, i64, i64, pointer, pointer, i32]
        library.rope_write_kv.argtypes = [
            pointer, i64, i64, i64, i64, i64, pointer, pointer, pointer, pointer, pointer, i32
        ]  # fmt: skip
        library.sum_squares.argtypes = [pointer, i64, i64, i32, pointer]
        for name in ("rms_norm", "add_rms_norm", "rope", "rope_write_kv", "sum_squares"):
            getattr(library, name).restype = None
        for lanes in LANES:
            ops = LayerOps(library, lanes)
            if ops.sums_like_torch():
                return ops
        log.warning("layer ops: torch's ops, the helper cannot add squares in torch's order here")
        return None

    def sums_like_torch(self) -> bool:
        """Whether the rows' sums of squares are torch's (`x.float().pow(2).sum(-1)`, the sum
        in torch's RMSNorm) to the bit, for random rows of a few widths."""
        gen = torch.Generator().manual_seed(0)
        for width in CHECK_WIDTHS:
            x = (4 * torch.randn(CHECK_ROWS, width, generator=gen)).to(torch.bfloat16)
            sums = torch.empty(CHECK_ROWS, dtype=torch.float32)
            self.library.sum_squares(x.data_ptr(), CHECK_ROWS, width, self.lanes, sums.data_ptr())
            if not torch.equal(sums, x.float().pow(2).sum(-1)):
                return False
        return True

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x: [T, H] -> x * rsqrt(mean(x^2) + eps) * weight, [T, H]."""
        x = x.contiguous()
        out = torch.empty_like(x)
        m, k = x.shape
        self.library.rms_norm(
            x.data_ptr(), m, k, weight.data_ptr(), eps, self.lanes, out.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
        return out

    def add_rms_norm(
        self, x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x, y: [T, H] -> (h = x + y, rms_norm(h)), both [T, H]."""
        x, y = x.contiguous(), y.contiguous()
        h, out = torch.empty_like(x), torch.empty_like(x)
        m, k = x.shape
        self.library.add_rms_norm(
            x.data_ptr(), y.data_ptr(), m, k, weight.data_ptr(), eps, self.lanes, h.data_ptr(),
            out.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        return h, out

    def rope(self, x: torch.Tensor, heads: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """In place on x [T, width] (rows may be strided, elements not): the first `heads`
        heads of head_dim d of each row, rotated by cos, sin [T, d / 2] (contiguous)."""
        if x.stride(1) != 1:
            raise ValueError("rope: x's rows must be contiguous")
        m, d = x.shape[0], 2 * cos.shape[-1]
        self.library.rope(
            x.data_ptr(), m, heads, x.stride(0), d, cos.data_ptr(), sin.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip

    def rope_write_kv(
        self,
        qkv: torch.Tensor,
        q_heads: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slots: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> None:
        """RoPE in place on the Q and K heads of qkv [T, (q_heads + 2 kvh) d] (rows may be
        strided, elements not), then each row's K and V heads stored at its slot ([T] int64)
        of k_cache, v_cache [num_blocks, block_size, kvh, d] (contiguous): `write_kv`'s
        stores, in the same pass."""
        kv_heads, d = k_cache.shape[2], k_cache.shape[3]
        if qkv.stride(1) != 1 or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError("rope_write_kv: qkv's rows and the caches must be contiguous")
        if qkv.shape[1] != (q_heads + 2 * kv_heads) * d or slots.dtype != torch.int64:
            raise ValueError(f"rope_write_kv: qkv {tuple(qkv.shape)}, slots {slots.dtype}")
        slots = slots.contiguous()
        self.library.rope_write_kv(
            qkv.data_ptr(), qkv.shape[0], q_heads, kv_heads, qkv.stride(0), d, cos.data_ptr(),
            sin.data_ptr(), slots.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
