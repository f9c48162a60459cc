"""Int8 activations for a model's large steps: a pass over an already-built model.

With `activation_quantization: int8`, the projections listed in `PROJECTIONS` multiply their
large steps (prefill, and decode batches from `QuantizedLinear.dense_from` rows) in int8,
their activations quantized per row on each step (`int8_linear.py`), in place of the
dense copy of their weight; small steps keep the weight-only int4/int8 kernels. So it needs
quantized projections (`quantization` auto on a quantized GGUF, int8 or int4).

The attention's Q/K/V projection keeps the dense copy: its input, the first norm's output,
has a few channels far above the rest, and rounding it per row cost SmolLM2-135M +1.8%
perplexity on its own, against +0.6% (gate/up), +0.9% (down) and none (output) for the
others (3,866 tokens of text, chunks of 256).

Between gate/up and down the activations stay int8 on large steps (`Int8MLP`): the gate/up
products go to SiLU(gate) * up and to the down projection's int8 rows in one pass
(`swiglu_rows`, rounding as the separate ops round), where the unfused path writes both
halves in x's dtype, runs SiLU and the product, and rounds the result to int8 again, each a
pass over [T, intermediate].
"""

from __future__ import annotations

import torch
from torch import nn

from lockgate.errors import ConfigError
from lockgate.llm.int8_linear import Int8Linear, swiglu_rows
from lockgate.llm.models.llama import LlamaForCausalLM, LlamaMLP
from lockgate.llm.quantized_linear import QuantizedLinear

PROJECTIONS = ("self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


class Int8MLP(nn.Module):
    """A SwiGLU MLP whose large steps stay int8 from its input to the down projection's
    products; smaller steps go through `plain` (the weight-only kernels). x: [T, H] -> [T, H]."""

    def __init__(self, plain: LlamaMLP, gate_up: Int8Linear, down: Int8Linear, from_rows: int):
        super().__init__()
        self.plain = plain
        self.gate_up, self.down = gate_up, down
        self.from_rows = from_rows  # rows of x from which the int8 path runs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] < self.from_rows:
            return self.plain(x)
        hidden = swiglu_rows(self.gate_up, self.gate_up.quantize(x), x.dtype)  # [T, I] int8 rows
        return self.down.scale_back(self.down.products(hidden), hidden.scales, x.dtype)


def quantize_activations(model: LlamaForCausalLM) -> int:
    """Give each listed projection of each decoder layer an `Int8Linear` for its large steps,
    releasing its dense copy, and each layer an `Int8MLP`. Returns how many projections; a
    ConfigError when one is not quantized. Run it before `pack_linear_weights` (which then
    leaves those alone)."""
    count = 0
    for index, layer in enumerate(model.layers):
        for name in PROJECTIONS:
            projection: nn.Module = layer.get_submodule(name)
            if not isinstance(projection, QuantizedLinear) or not projection.dense.numel():
                raise ConfigError(
                    "<model>",
                    "parameters.activation_quantization",
                    f"int8 activations need quantized projections (quantization auto on a "
                    f"quantized GGUF, int8 or int4): layers.{index}.{name} is "
                    f"{type(projection).__name__}",
                )
            projection.dense_linear = Int8Linear(projection.dense)
            projection.dense = projection.dense.new_empty(0)
            count += 1
        mlp = layer.mlp
        assert isinstance(mlp, LlamaMLP)
        gate_up, down = mlp.gate_up_proj, mlp.down_proj
        assert isinstance(gate_up, QuantizedLinear) and isinstance(down, QuantizedLinear)
        assert isinstance(gate_up.dense_linear, Int8Linear)
        assert isinstance(down.dense_linear, Int8Linear)
        from_rows = max(gate_up.dense_from, down.dense_from)
        layer.mlp = Int8MLP(mlp, gate_up.dense_linear, down.dense_linear, from_rows)
    return count
