"""Decode attention that reads the paged KV cache in place: a C kernel, built once per machine.

A decoding sequence attends with one query token per head over the keys and values of its
cache blocks. The batched SDPA path (`attention.py`) first gathers every sequence's blocks
into a copy padded to the longest context, then masks the padding; at batch 32 with
contexts of about 300 tokens that gather and the padded SDPA were over a third of a SmolLM2
decode step. `decode_attention.c` reads each key and value row where it lies, once for all
the query heads that share it, with the softmax in float32.

The kernel is compiled from its source the first time a model is loaded and kept on disk
(`native.py`: the build, its flags and its cache). Its OpenMP runs on the calling thread's
team, with torch's intra-op thread count.

The `decode_attention` engine parameter chooses: `auto` (the default) uses the kernel when it
builds and falls back to SDPA with a warning when it cannot (no compiler); `kernel` fails the
model's load instead; `sdpa` never builds it. Key and value caches in float32 and bfloat16
are read as they are; query heads per KV head up to 32 and head sizes up to 256. Whether a
model is the kernel's is decided once, when it loads (`decode_kernel`), never per step.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from lockgate.llm.native import KernelUnavailable as KernelUnavailable  # (re-exported)
from lockgate.llm.native import chosen_kernel, load_library

log = logging.getLogger("lockgate.llm")

SOURCE = Path(__file__).with_name("decode_attention.c")
MAX_GROUP = 32  # query heads per KV head (decode_attention.c)
MAX_HEAD_DIM = 256


@dataclass(frozen=True, slots=True)
class DecodeKernel:
    """The loaded kernel. Call it with one decode batch; it returns [S, nh * d]."""

    path: Path
    function: ctypes._CFuncPtr  # type: ignore[name-defined]

    def supports(self, num_heads: int, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
        """Whether a model of `num_heads` query heads over these caches (one layer's) is the
        kernel's: asked once, when the model loads."""
        nh, d, kvh = num_heads, k_cache.shape[3], k_cache.shape[2]
        return (
            v_cache.dtype == k_cache.dtype
            and v_cache.shape == k_cache.shape
            and v_cache.is_contiguous()
            and k_cache.dtype in (torch.float32, torch.bfloat16)
            and k_cache.is_contiguous()
            and nh % kvh == 0
            and nh // kvh <= MAX_GROUP
            and d <= MAX_HEAD_DIM
        )

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
    ) -> torch.Tensor:
        """q [S, nh, d]; caches [blocks, block_size, kvh, d]; block_tables [S, width] and
        seq_lens [S], int64. Softmax scale 1/sqrt(d), as SDPA's."""
        s, nh, d = q.shape
        _, block_size, kvh, _ = k_cache.shape
        query = q.to(torch.float32).contiguous()
        out = torch.empty_like(query)
        tables = block_tables.to(torch.int64).contiguous()
        lens = seq_lens.to(torch.int64).contiguous()
        status = self.function(
            query.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            int(k_cache.dtype == torch.bfloat16),
            tables.data_ptr(),
            tables.shape[1],
            lens.data_ptr(),
            s,
            k_cache.shape[0],
            nh,
            kvh,
            d,
            block_size,
            d**-0.5,
            torch.get_num_threads(),
            out.data_ptr(),
        )
        if status != 0:  # -1: a length or block outside the table or cache; -2: no memory
            raise RuntimeError(
                f"decode attention kernel refused the batch ({status}): q {tuple(q.shape)}, "
                f"cache {tuple(k_cache.shape)}, lengths {lens.tolist()[:8]}"
            )
        return out.view(s, nh * d).to(q.dtype)


def decode_kernel(
    mode: str, num_heads: int, k_cache: torch.Tensor, v_cache: torch.Tensor
) -> DecodeKernel | None:
    """The kernel for `mode` (see the module's text) and a model of `num_heads` query heads
    over these caches (one layer's): None to use SDPA."""

    def unsupported(kernel: DecodeKernel) -> str | None:
        if kernel.supports(num_heads, k_cache, v_cache):
            return None
        return (
            f"{num_heads} query heads over {k_cache.shape[2]} KV heads of "
            f"{k_cache.shape[3]} in {k_cache.dtype} are not the kernel's (at most "
            f"{MAX_GROUP} query heads per KV head, head size {MAX_HEAD_DIM}, float32 or "
            "bfloat16)"
        )

    return chosen_kernel("decode_attention", mode, load_kernel, unsupported, _warn_once)


@functools.cache
def _warn_once(reason: str) -> None:
    log.warning("decode attention: %s; using SDPA over gathered blocks", reason)


@functools.cache
def load_kernel() -> DecodeKernel:
    """Build the kernel if this machine has no copy yet, and load it (once per process)."""
    library, path = load_library(SOURCE)
    function = library.paged_decode_attention
    pointer, i64 = ctypes.c_void_p, ctypes.c_int64
    function.argtypes = [
        pointer, pointer, pointer, ctypes.c_int, pointer, i64, pointer, i64, i64, i64, i64,
        i64, i64, ctypes.c_float, ctypes.c_int, pointer,
    ]  # fmt: skip
    function.restype = ctypes.c_int
    return DecodeKernel(path, function)
