"""A bfloat16 layer's RMSNorms and RoPE in one pass each (`layer_ops.py`, `layer_ops.c`):
torch's results, and a model using them gives the plain model's logits."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from lockgate.llm.layer_ops import LayerOps
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


def differing(a: torch.Tensor, b: torch.Tensor) -> float:
    """The share of elements that differ (by a bfloat16 rounding at most: checked too)."""
    torch.testing.assert_close(a.float(), b.float(), rtol=2**-7, atol=2**-7)
    return float((a != b).float().mean())


# 1,536 rows are shared over threads (layer_ops.c's PARALLEL_FROM)
@pytest.mark.parametrize("rows", [1, 5, 1536])
def test_norms_are_torchs(ops: LayerOps, rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    x = (3 * torch.randn(rows, 576, generator=gen)).to(BF16)
    y = torch.randn(rows, 576, generator=gen).to(BF16)
    weight = (torch.rand(576, generator=gen) + 0.5).to(BF16)
    # the same value but for the order of a row's sum of squares: a rare last-bit difference
    assert differing(ops.rms_norm(x, weight, 1e-5), F.rms_norm(x, (576,), weight, 1e-5)) < 1e-3
    h, normed = ops.add_rms_norm(x, y, weight, 1e-5)
    assert torch.equal(h, x + y)
    assert differing(normed, F.rms_norm(x + y, (576,), weight, 1e-5)) < 1e-3
    assert not torch.equal(normed, F.rms_norm(x, (576,), weight, 1e-5))


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


def test_a_float32_model_keeps_torchs_ops(model: LlamaForCausalLM, ops: LayerOps) -> None:
    assert not model.use_layer_ops(ops)
    assert all(layer.ops is None for layer in model.layers)


def test_model_with_layer_ops_is_as_close_to_float32_as_the_plain_model(
    model: LlamaForCausalLM, checkpoint: Checkpoint, ops: LayerOps
) -> None:
    """bfloat16 logits are about 1% off float32's, and rounding differences in any one op
    move them by as much: each row of the model using the ops is as close to float32's as
    the plain bfloat16 model's, and picks the same greedy tokens."""
    config = checkpoint.config
    fused = build_llama(config, checkpoint.weights, "bfloat16")
    assert fused.use_layer_ops(ops)
    models = [model, build_llama(config, checkpoint.weights, "bfloat16")]  # float32, bfloat16
    prompts = [list(range(100, 140)), list(range(300, 317))]
    logits = []
    tokens: list[int] = []  # the decode step feeds each model float32's greedy tokens
    for m in [*models, fused]:
        loop = PagedLoop(m, num_blocks=16)
        first = loop.step([(0, prompts[0]), (1, prompts[1])]).float()  # batched prefill
        tokens = tokens or first.argmax(-1).tolist()
        logits.append(torch.cat([first, loop.step([(0, [tokens[0]]), (1, [tokens[1]])])]))
    exact, plain, with_ops = (x.float() for x in logits)
    for row in range(exact.shape[0]):
        plain_error = float((plain[row] - exact[row]).norm() / exact[row].norm())
        ops_error = float((with_ops[row] - exact[row]).norm() / exact[row].norm())
        assert ops_error <= 1.5 * plain_error + 0.005
    assert torch.equal(with_ops.argmax(-1), plain.argmax(-1))
