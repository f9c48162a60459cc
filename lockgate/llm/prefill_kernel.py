"""Prefill attention that reads the paged KV cache in place: a C kernel, built once per machine.

A prompt (or a chunk of one) attends causally over its own keys and those of its context.
Through SDPA a whole prompt runs its fused causal kernel, about 32 GFLOP/s on one core of
this CPU in bfloat16, and a chunk after a context first gathers the cache blocks into a copy
and builds a boolean mask, which takes SDPA's slower masked path. `prefill_attention.c`
reads the keys and values where they lie (this step's are written to the cache before
attention runs), so both go through one path: tiles of 16 query rows and their group of
query heads share every key and value row read, with an online softmax in float32. At head
sizes 64 and 128 on a CPU with AVX-512 the products run in vector instructions: AVX-512 BF16
for a bfloat16 cache where the CPU has it, float32 FMAs otherwise (a float32 cache, or a
bfloat16 one widened as it is read); elsewhere a portable float32 loop.

Built like the decode kernel (`native.py`: flags, cache, the OpenMP of torch's runtime); its
work items are (segment, KV head, tile of query rows), the longest first, over the calling
thread's team (torch's intra-op thread count).

The `prefill_attention` engine parameter chooses: `auto` (the default) uses the kernel where
its AVX-512 tiles run (head size 64 or 128, a CPU with AVX-512) and SDPA elsewhere, since
the portable loop is slower than SDPA's; `kernel` always uses it (or fails the model's load
where it cannot be built); `sdpa` never builds it. Whether a model is the kernel's is
decided once, when it loads (`prefill_kernel`).
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

SOURCE = Path(__file__).with_name("prefill_attention.c")
MAX_GROUP = 32  # query heads per KV head (prefill_attention.c)
MAX_HEAD_DIM = 256
VECTORISED_HEAD_DIMS = (64, 128)  # head sizes with AVX-512 tiles


@dataclass(frozen=True, slots=True)
class PrefillKernel:
    """The loaded kernel. Call it with a step's prefill segments; it writes their rows of
    `out`."""

    path: Path
    function: ctypes._CFuncPtr  # type: ignore[name-defined]
    vectorised: int  # this build's tiles: 0 portable, 1 AVX-512 float32, 2 and AVX-512 BF16

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
            and d % 2 == 0
        )

    def vectorises(self, k_cache: torch.Tensor) -> bool:
        """Whether these caches take the AVX-512 tiles (else the portable loop)."""
        return self.vectorised > 0 and k_cache.shape[3] in VECTORISED_HEAD_DIMS

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        segments: PrefillSegments,
        out: torch.Tensor,
    ) -> None:
        """q [T, nh, d] (rows may be strided); caches [blocks, block_size, kvh, d]; out
        [T, nh * d], of which the segments' rows are written. Softmax scale 1/sqrt(d), as
        SDPA's."""
        t, nh, d = q.shape
        _, block_size, kvh, _ = k_cache.shape
        dtype = k_cache.dtype
        query = q if q.dtype == dtype and q.stride()[1:] == (d, 1) else q.to(dtype).contiguous()
        direct = out.dtype == dtype and out.stride() == (nh * d, 1)
        target = out if direct else torch.empty(t, nh * d, dtype=dtype)
        tables = segments.block_tables
        status = self.function(
            query.data_ptr(),
            query.stride(0),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            int(dtype == torch.bfloat16),
            tables.data_ptr(),
            tables.shape[1],
            segments.starts.data_ptr(),
            segments.query_lens.data_ptr(),
            segments.context_lens.data_ptr(),
            tables.shape[0],
            t,
            k_cache.shape[0],
            nh,
            kvh,
            d,
            block_size,
            d**-0.5,
            torch.get_num_threads(),
            target.data_ptr(),
            target.stride(0),
        )
        if status != 0:  # -1: a segment or block outside q, its table or the cache; -2: memory
            raise RuntimeError(
                f"prefill attention kernel refused the step ({status}): q {tuple(q.shape)}, "
                f"cache {tuple(k_cache.shape)}, query lengths {segments.query_lens.tolist()[:8]}"
            )
        if not direct:
            for start, length in zip(
                segments.starts.tolist(), segments.query_lens.tolist(), strict=True
            ):
                out[start : start + length] = target[start : start + length]


@dataclass(frozen=True, slots=True)
class PrefillSegments:
    """A step's prefill segments for the kernel, int64 and contiguous: starts [P] (first row
    in T), query_lens [P], context_lens [P] (tokens cached before the segment) and
    block_tables [P, width] (blocks holding positions 0..context + query length - 1)."""

    starts: torch.Tensor
    query_lens: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor

    @classmethod
    def of(
        cls, starts: list[int], query_lens: list[int], contexts: list[int], tables: torch.Tensor
    ) -> PrefillSegments:
        def vector(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64)

        tables = tables.to(torch.int64).contiguous()
        return cls(vector(starts), vector(query_lens), vector(contexts), tables)


def prefill_kernel(
    mode: str, num_heads: int, k_cache: torch.Tensor, v_cache: torch.Tensor
) -> PrefillKernel | None:
    """The kernel for `mode` (see the module's text) and a model of `num_heads` query heads
    over these caches (one layer's): None to use SDPA."""

    def unsupported(kernel: PrefillKernel) -> str | None:
        if kernel.supports(num_heads, k_cache, v_cache):
            return None
        return (
            f"{num_heads} query heads over {k_cache.shape[2]} KV heads of "
            f"{k_cache.shape[3]} in {k_cache.dtype} are not the kernel's (at most "
            f"{MAX_GROUP} query heads per KV head, an even head size up to "
            f"{MAX_HEAD_DIM}, float32 or bfloat16)"
        )

    kernel = chosen_kernel("prefill_attention", mode, load_kernel, unsupported, _warn_once)
    if kernel is not None and mode == "auto" and not kernel.vectorises(k_cache):
        log.info("prefill attention: SDPA (the kernel's portable loop is no faster here)")
        return None
    return kernel


@functools.cache
def _warn_once(reason: str) -> None:
    log.warning("prefill attention: %s; using SDPA", reason)


@functools.cache
def load_kernel() -> PrefillKernel:
    """Build the kernel if this machine has no copy yet, and load it (once per process)."""
    library, path = load_library(SOURCE)
    function = library.paged_prefill_attention
    pointer, i64 = ctypes.c_void_p, ctypes.c_int64
    function.argtypes = [
        pointer, i64, pointer, pointer, ctypes.c_int, pointer, i64, pointer, pointer, pointer,
        i64, i64, i64, i64, i64, i64, i64, ctypes.c_float, ctypes.c_int, pointer, i64,
    ]  # fmt: skip
    function.restype = ctypes.c_int
    vectorised = library.prefill_attention_vectorised
    vectorised.restype = ctypes.c_int
    return PrefillKernel(path, function, vectorised())
