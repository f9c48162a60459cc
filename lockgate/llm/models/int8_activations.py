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
"""

from __future__ import annotations

from torch import nn

from lockgate.errors import ConfigError
from lockgate.llm.int8_linear import Int8Linear
from lockgate.llm.models.llama import LlamaForCausalLM
from lockgate.llm.quantized_linear import QuantizedLinear

PROJECTIONS = ("self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def quantize_activations(model: LlamaForCausalLM) -> int:
    """Give each listed projection of each decoder layer an `Int8Linear` for its large steps,
    releasing its dense copy. Returns how many; a ConfigError when a projection is not
    quantized. Run it before `pack_linear_weights` (which then leaves those alone)."""
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
    return count
