"""A bfloat16 layer's RMSNorms and RoPE in one pass each (`layer_ops.py`, `layer_ops.c`):
torch's results bit for bit, and a model using them gives the plain model's logits."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from lockgate.llm.attention import write_kv
from lockgate.llm.layer_ops import LANES, LayerOps
from lockgate.llm.loader import Checkpoint
from lockgate.llm.models.llama import LlamaForCausalLM, apply_rope, build_llama
from tests.llm.conftest import PagedLoop

pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler (apt-get install gcc)"
)
BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def ops() -> LayerOps:
    loaded = LayerOps.load()
    assert loaded is not None
    return loaded


# 1,536 rows are shared over threads (layer_ops.c's PARALLEL_FROM); 4,136 wide: a long row
# (torch's sum cascades its partial sums) with a tail of 40 values past its vectors
@pytest.mark.parametrize(("rows", "width"), [(1, 576), (5, 576), (1536, 576), (3, 4136)])
def test_norms_are_torchs_bit_for_bit(ops: LayerOps, rows: int, width: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    for scale in (0.01, 3.0, 300.0):
        x = (scale * torch.randn(rows, width, generator=gen)).to(BF16)
        y = torch.randn(rows, width, generator=gen).to(BF16)
        weight = (torch.rand(width, generator=gen) + 0.5).to(BF16)
        assert torch.equal(ops.rms_norm(x, weight, 1e-5), F.rms_norm(x, (width,), weight, 1e-5))
        h, normed = ops.add_rms_norm(x, y, weight, 1e-5)
        assert torch.equal(h, x + y)
        assert torch.equal(normed, F.rms_norm(x + y, (width,), weight, 1e-5))


def test_sums_of_squares_follow_torchs_vector_width(ops: LayerOps) -> None:
    """The helper was loaded with the width of torch's float vectors; another width adds a
    row's squares in another order, which the check at load tells apart."""
    assert ops.sums_like_torch()
    others = [lanes for lanes in LANES if lanes != ops.lanes]
    assert not any(LayerOps(ops.library, lanes).sums_like_torch() for lanes in others)


@pytest.mark.parametrize("rows", [1, 7, 1536])
def test_rope_in_place_is_torchs(ops: LayerOps, rows: int) -> None:
    """Q and K heads of a fused QKV row rotated in place, exactly as `apply_rope`; V and
    the other rows' values untouched."""
    gen = torch.Generator().manual_seed(rows)
    qkv = torch.randn(rows, 960, generator=gen).to(BF16)  # 9 + 3 heads rotated, 3 of V not
    cos, sin = (torch.randn(2, rows, 32, generator=gen)).to(BF16)
    expected = apply_rope(qkv[:, :768].view(rows, 12, 64), cos[:, None], sin[:, None])
    out = qkv.clone()
    ops.rope(out, 12, cos, sin)
    assert torch.equal(out[:, :768].view(rows, 12, 64), expected)
    assert torch.equal(out[:, 768:], qkv[:, 768:])
    with pytest.raises(ValueError, match="contiguous"):
        ops.rope(qkv.t(), 12, cos, sin)


@pytest.mark.parametrize("rows", [1, 9, 1536])
def test_rope_and_kv_stores_are_rope_then_write_kv(ops: LayerOps, rows: int) -> None:
    """One pass: the rotated Q/K and the caches as `apply_rope` then `write_kv` leave them."""
    gen = torch.Generator().manual_seed(rows)
    qkv = torch.randn(rows, 960, generator=gen).to(BF16)  # 9 Q, 3 K, 3 V heads of 64
    cos, sin = (torch.randn(2, rows, 32, generator=gen)).to(BF16)
    slots = torch.randperm(4 * 16, generator=gen)[:rows] if rows < 64 else torch.arange(rows)
    rotated = apply_rope(qkv[:, :768].view(rows, 12, 64), cos[:, None], sin[:, None])
    caches = [torch.zeros(-(-rows // 16) * 4, 16, 3, 64, dtype=BF16) for _ in range(4)]
    write_kv(caches[0], caches[1], rotated[:, 9:], qkv[:, 768:].view(rows, 3, 64), slots)
    out = qkv.clone()
    ops.rope_write_kv(out, 9, cos, sin, slots, caches[2], caches[3])
    assert torch.equal(out[:, :768].view(rows, 12, 64), rotated)
    assert torch.equal(out[:, 768:], qkv[:, 768:])
    assert torch.equal(caches[2], caches[0]) and torch.equal(caches[3], caches[1])
    with pytest.raises(ValueError, match="contiguous"):
        ops.rope_write_kv(out, 9, cos, sin, slots, caches[2].transpose(0, 1), caches[3])


def test_a_float32_model_keeps_torchs_ops(model: LlamaForCausalLM, ops: LayerOps) -> None:
    assert not model.use_layer_ops(ops)
    assert all(layer.ops is None for layer in model.layers)


def test_model_with_layer_ops_gives_the_plain_models_logits(
    checkpoint: Checkpoint, ops: LayerOps
) -> None:
    """A batched prefill and a decode step: the same logits as torch's ops, to the bit."""
    config = checkpoint.config
    fused = build_llama(config, checkpoint.weights, "bfloat16")
    assert fused.use_layer_ops(ops)
    plain = build_llama(config, checkpoint.weights, "bfloat16")
    prompts = [list(range(100, 140)), list(range(300, 317))]
    logits = []
    for m in (plain, fused):
        loop = PagedLoop(m, num_blocks=16)
        first = loop.step([(0, prompts[0]), (1, prompts[1])])  # batched prefill
        tokens = first.argmax(-1).tolist()
        logits.append(torch.cat([first, loop.step([(0, [tokens[0]]), (1, [tokens[1]])])]))
    assert torch.equal(logits[0], logits[1])
