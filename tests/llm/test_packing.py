"""Pre-packed bfloat16 weights: the same results as the plain model, or no change at all."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lockgate.llm.loader import Checkpoint
from lockgate.llm.models.llama import LlamaForCausalLM, build_llama
from lockgate.llm.models.packing import PackedLinear, can_pack, pack_linear_weights
from lockgate.llm.quantized_linear import QuantizedLinear, quantize_int4
from tests.llm.conftest import PagedLoop

needs_onednn_bf16 = pytest.mark.skipif(
    not can_pack(torch.bfloat16), reason="no oneDNN bfloat16 kernels on this CPU"
)


@needs_onednn_bf16
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_packed_linear_equals_linear(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 80, generator=gen).to(torch.bfloat16)
    x = torch.randn(rows, 80, generator=gen).to(torch.bfloat16)
    torch.testing.assert_close(PackedLinear(weight)(x), nn.functional.linear(x, weight))


def test_float32_models_are_not_packed(model: LlamaForCausalLM) -> None:
    assert not can_pack(torch.float32)
    assert model.logits_head is None


@needs_onednn_bf16
def test_packed_model_gives_the_plain_models_logits(checkpoint: Checkpoint) -> None:
    config = checkpoint.config
    plain = build_llama(config, checkpoint.weights, "bfloat16")
    packed = build_llama(config, checkpoint.weights, "bfloat16")
    assert pack_linear_weights(packed) == 4 * config.num_hidden_layers + 1
    assert not any(isinstance(m, nn.Linear) for m in packed.layers.modules())
    prompt = list(range(100, 140))
    logits = []
    token = None  # the decode step feeds both models the plain model's greedy token
    for m in (plain, packed):
        loop = PagedLoop(m, num_blocks=16)
        first = loop.step([(0, prompt)])  # prefill: [1, V]
        token = int(first.argmax()) if token is None else token
        logits.append(torch.cat([first, loop.step([(0, [token])])]))  # + decode
    # bfloat16 kernels for one row and for many accumulate differently (on some CPUs the
    # decode row of either model is about 1% off float32's, and 2% off the other's): each
    # row within 3% of the plain model's, by norm, and the same greedy tokens
    for packed_row, plain_row in zip(logits[1].float(), logits[0].float(), strict=True):
        assert float((packed_row - plain_row).norm() / plain_row.norm()) <= 0.03
    assert torch.equal(logits[1].argmax(-1), logits[0].argmax(-1))


@needs_onednn_bf16
def test_a_quantized_projections_dense_copy_is_packed_in_its_place(
    checkpoint: Checkpoint,
) -> None:
    """Large steps of a quantized projection run on its dense copy: packed for oneDNN like
    the plain Linears, with the same results, and the unpacked copy released."""
    config = checkpoint.config
    weights = dict(checkpoint.weights)
    name = "model.layers.0.mlp.down_proj.weight"
    quantized = {name: quantize_int4(weights.pop(name).float())}
    plain = build_llama(config, weights, "bfloat16", quantized)
    packed = build_llama(config, weights, "bfloat16", quantized)
    pack_linear_weights(packed)
    before, after = plain.layers[0].mlp.down_proj, packed.layers[0].mlp.down_proj
    assert isinstance(after, QuantizedLinear) and isinstance(after.dense_linear, PackedLinear)
    assert after.dense.numel() == 0  # the packed copy took its place
    gen = torch.Generator().manual_seed(7)
    for rows in (1, after.dense_from - 1, after.dense_from, 64):  # the kernel, then dense
        x = torch.randn(rows, after.in_features, generator=gen).to(torch.bfloat16)
        torch.testing.assert_close(after(x), before(x))
