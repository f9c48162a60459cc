"""The in-place decode attention kernel: against SDPA over the same blocks, in float32 and
bfloat16 caches, at the head sizes it specialises and others; how it is built, cached and
chosen, and what happens where it cannot be built."""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lockgate.errors import ConfigError
from lockgate.llm import decode_kernel, native
from lockgate.llm.decode_kernel import KernelUnavailable, load_kernel
from lockgate.llm.engine_config import EngineConfig

needs_compiler = pytest.mark.skipif(
    shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler (apt-get install gcc)"
)


# a model's query heads and one layer's caches: 9 heads over 3 KV heads of 64, float32
MODEL = (9, torch.zeros(4, 16, 3, 64), torch.zeros(4, 16, 3, 64))


def reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
) -> torch.Tensor:
    """Each sequence's blocks gathered and attended in float64."""
    s, nh, d = q.shape
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    out = []
    for i in range(s):
        n = int(lens[i])
        blocks = tables[i, : -(-n // bs)]
        keys = k_cache[blocks].reshape(-1, kvh, d)[:n].double().transpose(0, 1)  # [kvh, n, d]
        values = v_cache[blocks].reshape(-1, kvh, d)[:n].double().transpose(0, 1)
        query = q[i].double().view(kvh, nh // kvh, d)
        out.append(F.scaled_dot_product_attention(query, keys, values).reshape(nh * d))
    return torch.stack(out)


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("nh", "kvh", "d"), [(9, 3, 64), (8, 8, 128), (4, 1, 40)])
def test_the_kernel_agrees_with_sdpa_over_gathered_blocks(
    dtype: torch.dtype, nh: int, kvh: int, d: int
) -> None:
    gen = torch.Generator().manual_seed(nh * d)
    blocks, bs = 64, 16
    k_cache = torch.randn(blocks, bs, kvh, d, generator=gen).to(dtype)
    v_cache = torch.randn(blocks, bs, kvh, d, generator=gen).to(dtype)
    lens = torch.tensor([1, 15, 16, 17, 100, 130])
    width = 9  # blocks a table holds: 144 positions
    tables = torch.randperm(blocks, generator=gen)[: len(lens) * width].view(len(lens), width)
    q = torch.randn(len(lens), nh, d, generator=gen).to(dtype)
    out = load_kernel()(q, k_cache, v_cache, tables, lens)
    assert out.shape == (len(lens), nh * d) and out.dtype == dtype
    expected = reference(q, k_cache, v_cache, tables, lens)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2  # bfloat16: the output's rounding
    torch.testing.assert_close(out.double(), expected, atol=tolerance, rtol=tolerance)


@needs_compiler
def test_a_table_or_length_outside_the_cache_is_refused_not_read() -> None:
    kernel = load_kernel()
    cache = torch.zeros(4, 16, 1, 64)
    q = torch.zeros(1, 2, 64)
    with pytest.raises(RuntimeError, match="refused the batch"):  # block 4 of 4
        kernel(q, cache, cache, torch.tensor([[0, 4]]), torch.tensor([20]))
    with pytest.raises(RuntimeError, match="refused the batch"):  # longer than its table
        kernel(q, cache, cache, torch.tensor([[0, 1]]), torch.tensor([33]))
    with pytest.raises(RuntimeError, match="refused the batch"):
        kernel(q, cache, cache, torch.tensor([[-1, 1]]), torch.tensor([3]))
    # the unused end of a table is not read: a padding entry there is no error
    out = kernel(q, cache, cache, torch.tensor([[2, 99]]), torch.tensor([16]))
    assert torch.equal(out, torch.zeros(1, 128))


@needs_compiler
def test_shapes_outside_the_kernel_are_not_its() -> None:
    kernel = load_kernel()
    cache = torch.zeros(2, 4, 2, 64)
    assert kernel.supports(4, cache, cache)
    assert not kernel.supports(3, cache, cache)  # heads not a multiple
    wide = torch.zeros(2, 4, 2, 512)
    assert not kernel.supports(4, wide, wide)  # head size
    assert not kernel.supports(4, cache.half(), cache.half())  # dtype
    assert not kernel.supports(4, cache, cache.bfloat16())  # values differ
    assert kernel.supports(4, cache, cache.clone())


@needs_compiler
def test_loading_the_kernel_leaves_the_processs_float_modes_alone() -> None:
    """Built without -ffast-math, whose start-up code would set flush-to-zero for every
    float computation of the process."""
    load_kernel()
    assert np.float32(1e-38) / np.float32(10) > 0  # a subnormal result, flushed to 0 by FTZ


@needs_compiler
def test_a_model_the_kernel_does_not_take_attends_through_sdpa_or_fails_its_load(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Decided once, at load: 40 query heads over 1 KV head is more than it groups."""
    cache = torch.zeros(4, 16, 1, 64)
    assert decode_kernel.decode_kernel("auto", *MODEL) is load_kernel()
    with caplog.at_level(logging.WARNING, logger="lockgate.llm"):
        assert decode_kernel.decode_kernel("auto", 40, cache, cache) is None
    assert "not the kernel's" in caplog.text
    with pytest.raises(KernelUnavailable, match="40 query heads over 1 KV heads"):
        decode_kernel.decode_kernel("kernel", 40, cache, cache)


@pytest.fixture
def fresh_kernel(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """No kernel loaded in this process, and an empty cache directory."""
    monkeypatch.setenv("LOCKGATE_CACHE_DIR", str(tmp_path))
    load_kernel.cache_clear()
    yield tmp_path
    load_kernel.cache_clear()


@needs_compiler
def test_a_first_load_builds_the_kernel_into_the_cache_and_a_second_reuses_it(
    fresh_kernel: Path,
) -> None:
    kernel = load_kernel()
    built = list((fresh_kernel / "kernels").glob("decode_attention-*.so"))
    assert built == [kernel.path]
    stamp = kernel.path.stat().st_mtime_ns
    load_kernel.cache_clear()
    assert load_kernel().path == kernel.path and kernel.path.stat().st_mtime_ns == stamp
    assert list((fresh_kernel / "kernels").iterdir()) == [kernel.path]  # no temporary left


def test_without_a_compiler_auto_falls_back_to_sdpa_and_kernel_refuses(
    fresh_kernel: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CC", str(fresh_kernel / "no-such-cc"))
    with caplog.at_level(logging.WARNING, logger="lockgate.llm"):
        assert decode_kernel.decode_kernel("auto", *MODEL) is None
    assert "no C compiler" in caplog.text and "using SDPA" in caplog.text
    with pytest.raises(KernelUnavailable, match="no C compiler"):
        decode_kernel.decode_kernel("kernel", *MODEL)


def test_a_compiler_that_fails_is_reported(fresh_kernel: Path) -> None:
    compiler = fresh_kernel / "broken-cc"
    compiler.write_text("#!/bin/sh\necho 'cc: fatal error: out of luck' >&2\nexit 1\n")
    compiler.chmod(0o755)
    with pytest.raises(KernelUnavailable, match="out of luck"):
        native.build(str(compiler), decode_kernel.SOURCE, fresh_kernel / "kernels" / "x.so")
    assert not list((fresh_kernel / "kernels").iterdir())  # the temporary is removed


@needs_compiler
def test_a_cache_that_cannot_be_written_leaves_sdpa(
    fresh_kernel: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocked = fresh_kernel / "file"
    blocked.write_text("not a directory")
    monkeypatch.setenv("LOCKGATE_CACHE_DIR", str(blocked))
    with pytest.raises(KernelUnavailable, match="cannot write the kernel"):
        source = decode_kernel.SOURCE
        native.build("cc", source, native.library_path(source, "cc"))
    assert decode_kernel.decode_kernel("auto", *MODEL) is None


def test_sdpa_never_builds_and_a_wrong_mode_is_a_config_error(fresh_kernel: Path) -> None:
    assert decode_kernel.decode_kernel("sdpa", *MODEL) is None
    assert not (fresh_kernel / "kernels").exists()
    with pytest.raises(ConfigError, match="decode_attention"):
        EngineConfig(decode_attention="fast")
