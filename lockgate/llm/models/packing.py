"""Pre-packed bfloat16 weights for oneDNN: a pass over an already-built model.

A bfloat16 `F.linear` on the CPU goes to oneDNN, which reorders the weight into its blocked
layout on every call: for a decode step that re-reads and re-writes all the weights. This
pass reorders each Linear weight (the dense copy of each quantized projection, and the
logits head) once, at load, and calls oneDNN's linear on the packed weight; the results are
the same kernel's. Models in other dtypes, or builds of torch without oneDNN bfloat16, are
left as they are.
"""

from __future__ import annotations

import torch
from torch import nn

from lockgate.llm.models.llama import LlamaForCausalLM
from lockgate.llm.quantized_linear import QuantizedLinear


class PackedLinear(nn.Module):
    """A bias-free Linear whose weight oneDNN has reordered once. x: [T, in] -> [T, out]."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed"


def can_pack(dtype: torch.dtype) -> bool:
    """True where oneDNN has bfloat16 kernels for this CPU and the model is bfloat16."""
    return (
        dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    )


def pack_linear_weights(model: LlamaForCausalLM) -> int:
    """Replace every bias-free Linear of the decoder layers by a PackedLinear, and give the
    model a packed logits head.

    Returns how many were packed; 0 when `can_pack(model.dtype)` is False.
    """
    if not can_pack(model.dtype):
        return 0
    targets = [
        (parent, name, child)
        for parent in model.layers.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear) and child.bias is None
    ]
    for parent, name, child in targets:
        assert isinstance(child, nn.Linear)
        setattr(parent, name, PackedLinear(child.weight))
    # a quantized projection's dense copy runs its large steps (prefill, decode batches of
    # `dense_from` rows or more): packed too, in place of the copy
    quantized = [
        m
        for m in model.layers.modules()
        if isinstance(m, QuantizedLinear) and m.dense.dtype == torch.bfloat16 and m.dense.numel()
    ]
    for layer in quantized:
        layer.dense_linear = PackedLinear(layer.dense)
        layer.dense = layer.dense.new_empty(0)
    head = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    model.logits_head = PackedLinear(head)
    return len(targets) + len(quantized) + 1
