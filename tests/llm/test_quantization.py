"""Weight-only quantization (`quantized_linear.py`, the loader's `quantization`): the
quantized SmolLM2 agrees with its bfloat16 self, the parameter is checked, and the
conversion cache keeps the quantized form."""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path

import gguf
import httpx
import numpy as np
import pytest
import torch
import yaml

from lockgate.config import ModelConfig
from lockgate.errors import ConfigError
from lockgate.llm.attention import AttentionMetadata
from lockgate.llm.cpu import native_bfloat16
from lockgate.llm.engine_config import EngineConfig
from lockgate.llm.int8_linear import Int8Linear
from lockgate.llm.loader import Checkpoint, load_checkpoint, load_gguf
from lockgate.llm.models import LlamaForCausalLM, allocate_kv_cache, build_llama
from lockgate.llm.models.int8_activations import Int8MLP, quantize_activations
from lockgate.llm.quantized_linear import (
    DENSE_FROM_TOKENS_FLOAT32,
    QuantizedLinear,
    quantize_int4,
    quantize_int8,
)
from lockgate.llm.startup import engine_config_from
from lockgate.llm.tokenizer import ChatTokenizer
from tests.conftest import start_server
from tests.llm.conftest import PagedLoop, one_torch_thread
from tests.llm.test_loader import (
    FFN,
    HEADS,
    HIDDEN,
    KV_HEADS,
    LAYERS,
    TOKENS,
    gguf_name,
    permute_like_llama_cpp,
    tiny_weights,
)

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Water boils at a temperature of",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "To make a cup of tea, first",
    "Photosynthesis is the process by which",
    "The quick brown fox",
]
NEW_TOKENS = 24
TEXT = (
    "The river rises in the hills to the north and runs south through farmland for most of "
    "its length. In spring, melting snow swells it until it floods the low meadows, which is "
    "why the old villages were built on higher ground. Farmers have long relied on the "
    "floods to enrich the soil, and the town market still opens on the first dry week of the "
    "year. Today a railway bridge crosses the river near the town, and a small museum by the "
    "station tells the story of the mills that once lined its banks. The mills ground wheat "
    "and barley for the whole valley, and at their busiest more than a hundred people worked "
    "in them. When the railway arrived, flour from larger mills in the city became cheaper, "
    "and one by one the small mills closed. Some of the buildings were turned into houses, "
    "one became a school, and the largest is now a hotel whose restaurant looks out over the "
    "weir. Every summer the town holds a festival on the river, with boat races in the "
    "morning and music on the meadows until late in the evening."
)


# -- helpers ----------------------------------------------------------------------------


def all_logits(
    model: LlamaForCausalLM, sequences: list[list[int]], block_size: int = 16
) -> list[torch.Tensor]:
    """Float32 logits at every position of each sequence ([T_i, V] each), in one prefill."""
    lens = [len(ids) for ids in sequences]
    return list(model.compute_logits(all_hidden(model, sequences, block_size)).split(lens))


def all_hidden(
    model: LlamaForCausalLM, sequences: list[list[int]], block_size: int = 16
) -> torch.Tensor:
    """The final hidden states of every position of the sequences laid end to end, [T, H]."""
    lens = [len(ids) for ids in sequences]
    widths = [-(-n // block_size) for n in lens]
    starts = np.cumsum([0, *lens]).tolist()
    first_block = np.cumsum([0, *widths]).tolist()
    cache = allocate_kv_cache(model.config, sum(widths), block_size, model.dtype)
    tables = [
        list(range(b, b + w)) + [0] * (max(widths) - w)
        for b, w in zip(first_block, widths, strict=False)
    ]
    slots = [first_block[i] * block_size + p for i, n in enumerate(lens) for p in range(n)]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_start_loc=torch.tensor(starts),
        seq_lens=torch.tensor(lens),
        block_tables=torch.tensor(tables),
        logits_indices=torch.arange(sum(lens)),
        max_query_len=max(lens),
        max_seq_len=max(lens),
        block_size=block_size,
        query_lens_list=lens,
        seq_lens_list=lens,
    )
    ids = torch.tensor([t for seq in sequences for t in seq])
    positions = torch.tensor([p for n in lens for p in range(n)])
    with torch.inference_mode():
        hidden: torch.Tensor = model(ids, positions, meta, cache)
    return hidden


def greedy(model: LlamaForCausalLM, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy continuations of all prompts, decoded together in one batch."""
    loop = PagedLoop(model, num_blocks=64)
    out: list[list[int]] = [[] for _ in prompts]
    chunks = list(enumerate(prompts))
    for _ in range(new_tokens):
        tokens = loop.step(chunks).argmax(dim=-1).tolist()
        for row, token in zip(out, tokens, strict=True):
            row.append(token)
        chunks = [(i, [token]) for i, token in enumerate(tokens)]
    return out


def teacher_forced_agreement(
    model: LlamaForCausalLM, prompts: list[list[int]], continuations: list[list[int]]
) -> float:
    """Along each prompt's given continuation, the share of positions where the model's top
    token is the continuation's next one."""
    sequences = [p + c for p, c in zip(prompts, continuations, strict=True)]
    matches = total = 0
    for logits, prompt, continuation in zip(
        all_logits(model, sequences), prompts, continuations, strict=True
    ):
        top = logits[len(prompt) - 1 : -1].argmax(dim=-1)
        matches += int((top == torch.tensor(continuation)).sum())
        total += len(continuation)
    return matches / total


def perplexity(model: LlamaForCausalLM, ids: list[int]) -> float:
    (logits,) = all_logits(model, [ids])
    return perplexity_of(logits, ids)


def perplexity_of(logits: torch.Tensor, ids: list[int]) -> float:
    """The perplexity of `ids` from the logits at each of their positions ([T, V])."""
    nll = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]))  # t predicts t+1
    return math.exp(float(nll))


# -- the real model ---------------------------------------------------------------------


# The models are built, and bf16's references computed, on one torch thread (`one_torch_thread`:
# two spinning threads on a loaded 2-core machine are several times slower); the quantized
# models' own steps run on torch's default, their rows shared out over its threads.


@pytest.fixture(scope="module")
def bf16(checkpoint: Checkpoint) -> LlamaForCausalLM:
    with one_torch_thread():
        return build_llama(checkpoint.config, checkpoint.weights, "bfloat16")


@pytest.fixture(scope="module", params=["int4", "int8"])
def quantized(request: pytest.FixtureRequest, gguf_path: Path) -> LlamaForCausalLM:
    # the conversion cache ($LOCKGATE_CACHE_DIR or ~/.cache/lockgate/llm) keeps later runs fast
    ck = load_checkpoint(gguf_path, quantization=request.param)
    with one_torch_thread():
        return build_llama(ck.config, ck.weights, "bfloat16", ck.quantized)


@pytest.fixture(scope="module")
def prompt_ids(tokenizer: ChatTokenizer) -> list[list[int]]:
    return [tokenizer.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def bf16_greedy(bf16: LlamaForCausalLM, prompt_ids: list[list[int]]) -> list[list[int]]:
    with one_torch_thread():
        return greedy(bf16, prompt_ids, NEW_TOKENS)


def test_projections_are_quantized_and_the_head_is_int8_for_few_rows(
    quantized: LlamaForCausalLM,
) -> None:
    layer = quantized.layers[0]
    for proj in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj):
        assert isinstance(proj, QuantizedLinear)
    assert isinstance(layer.mlp.down_proj, QuantizedLinear)
    assert quantized.embed_tokens.weight.dtype == torch.bfloat16  # the lookup stays dense
    head = quantized.logits_head
    assert isinstance(head, QuantizedLinear) and head.kind == "int8"
    assert head.dense is quantized.embed_tokens.weight  # tied: many rows use it, no copy


def test_the_int8_head_of_few_rows_agrees_with_the_dense_head(
    tokenizer: ChatTokenizer, gguf_path: Path
) -> None:
    """A decode step of few rows computes logits with the int8 head, a step of many with
    the weight itself. Along a real text, in float32: top-1 agreement and perplexity of the
    int8 head's logits against the dense head's (measured: 0.962 and a ratio of 0.9986; the
    flips are near-ties, broken by bfloat16's rounding of the kernel's inputs). A wrong scale
    or a transposed weight gives agreement near 0 and perplexity many times higher."""
    ck = load_checkpoint(gguf_path, quantization="int4")
    model = build_llama(ck.config, ck.weights, "float32", ck.quantized)
    ids = tokenizer.encode(TEXT)
    hidden = all_hidden(model, [ids])  # [T, H]
    head = model.logits_head
    assert isinstance(head, QuantizedLinear)
    dense = torch.nn.functional.linear(hidden, model.embed_tokens.weight)
    rows = head.dense_from - 1
    with torch.inference_mode():
        int8 = torch.cat([head(chunk) for chunk in hidden.split(rows)])
    agree = float((int8.argmax(dim=-1) == dense.argmax(dim=-1)).float().mean())
    targets = torch.tensor(ids[1:])
    nll = [float(torch.nn.functional.cross_entropy(x[:-1], targets)) for x in (dense, int8)]
    ratio = math.exp(nll[1]) / math.exp(nll[0])
    print(f"int8 head: top-1 agreement {agree:.3f}, perplexity ratio {ratio:.4f}")
    assert agree >= 0.90
    assert abs(ratio - 1) <= 0.01


def test_greedy_tokens_agree_with_bf16(
    quantized: LlamaForCausalLM,
    bf16: LlamaForCausalLM,
    prompt_ids: list[list[int]],
    bf16_greedy: list[list[int]],
) -> None:
    """Teacher-forced: along bf16's own greedy continuation, the quantized model's top token
    at each position. (Free-running continuations drift apart after a first near-tie, so
    their position-by-position match says little; it is printed for reference.) int4 is the
    GGUF's own Q4_1 values, so it differs from bf16 only by bf16 rounding of scales and
    zeros; int8 is requantized per row from those values. A flip needs a near-tie between
    the top two logits, which in 192 positions of a 135M model happens a few times: 0.90
    leaves room for those and fails on any real error (a wrong nibble order or a wrong
    scale gives agreement near 0)."""
    rate = teacher_forced_agreement(quantized, prompt_ids, bf16_greedy)
    print(f"teacher-forced top-1 agreement with bf16: {rate:.3f}")
    assert rate >= 0.90, f"top-1 agreement with bf16 {rate:.3f}"


@pytest.fixture(scope="module")
def bf16_perplexity(bf16: LlamaForCausalLM, tokenizer: ChatTokenizer) -> float:
    """bf16's perplexity over TEXT: the reference of both quantizations."""
    with one_torch_thread():
        return perplexity(bf16, tokenizer.encode(TEXT))


def test_perplexity_within_2_percent_of_bf16(
    quantized: LlamaForCausalLM, bf16_perplexity: float, tokenizer: ChatTokenizer
) -> None:
    ids = tokenizer.encode(TEXT)
    reference, ours = bf16_perplexity, perplexity(quantized, ids)
    print(f"perplexity over {len(ids)} tokens: bf16 {reference:.3f}, quantized {ours:.3f}")
    assert reference < 50, "the reference itself is off"  # a sane text for a sane model
    assert abs(ours / reference - 1) <= 0.02


@pytest.fixture(scope="module")
def int8_activations(gguf_path: Path) -> LlamaForCausalLM:
    ck = load_checkpoint(gguf_path, quantization="int4")
    with one_torch_thread():
        model = build_llama(ck.config, ck.weights, "bfloat16", ck.quantized)
        assert quantize_activations(model) == 3 * ck.config.num_hidden_layers
    return model


@pytest.fixture(scope="module")
def int8_activations_text_logits(
    int8_activations: LlamaForCausalLM, tokenizer: ChatTokenizer
) -> torch.Tensor:
    """`int8_activations`' logits at every position of TEXT (one prefill of a few hundred
    tokens, on one torch thread): its perplexity, and the fused MLP's side of the comparison
    with the unfused one."""
    with one_torch_thread():
        (logits,) = all_logits(int8_activations, [tokenizer.encode(TEXT)])
    return logits


def test_int8_activations_agree_with_bf16(
    int8_activations: LlamaForCausalLM,
    int8_activations_text_logits: torch.Tensor,
    bf16_perplexity: float,
    tokenizer: ChatTokenizer,
    prompt_ids: list[list[int]],
    bf16_greedy: list[list[int]],
) -> None:
    """The output, gate/up and down projections of every layer multiply their large steps
    (these prefills are) with activations rounded to int8 per row: teacher-forced top-1
    agreement with bf16 and perplexity within 2%. Measured: agreement 0.906 (int4 weights
    alone: 0.995), perplexity +1.0% here and +1.1% over 3,866 tokens of three texts; a scale
    per tensor instead of per row gave +83%. Rounding every activation moves more near-ties
    than rounding weights does, so the agreement bound is 0.85: a wrong scale or layout
    gives near 0."""
    mlp = int8_activations.layers[0].mlp
    assert isinstance(mlp, Int8MLP)
    assert isinstance(mlp.plain.down_proj, QuantizedLinear)
    assert isinstance(mlp.plain.down_proj.dense_linear, Int8Linear)
    assert not mlp.plain.down_proj.dense.numel()  # the dense copy is released
    rate = teacher_forced_agreement(int8_activations, prompt_ids, bf16_greedy)
    ours = perplexity_of(int8_activations_text_logits, tokenizer.encode(TEXT))
    print(f"int8 activations: agreement {rate:.3f}, perplexity ratio {ours / bf16_perplexity:.4f}")
    assert rate >= 0.85
    assert abs(ours / bf16_perplexity - 1) <= 0.02


def test_int8_mlp_keeps_the_activations_int8_between_its_projections(
    int8_activations: LlamaForCausalLM,
    int8_activations_text_logits: torch.Tensor,
    tokenizer: ChatTokenizer,
) -> None:
    """A large step's SwiGLU goes from the gate/up products to the down projection's int8
    rows in one pass (`swiglu_rows`), rounding as the unfused ops round: the same output as
    each projection's int8 layer on its own with torch's SiLU between them, but for SiLU's
    last bit (measured: equal here); a small step is the plain MLP's."""
    mlp = int8_activations.layers[3].mlp
    assert isinstance(mlp, Int8MLP) and mlp.from_rows == 8
    gen = torch.Generator().manual_seed(3)
    with one_torch_thread():
        x = (2 * torch.randn(64, int8_activations.config.hidden_size, generator=gen)).bfloat16()
        fused, plain = mlp(x).float(), mlp.plain(x).float()
        assert float((fused - plain).norm() / plain.norm()) < 1e-3
        assert torch.equal(mlp(x[:7]), mlp.plain(x[:7]))
        # the whole model over a text, with every layer's MLP one way and then the other
        ids = tokenizer.encode(TEXT)
        layers = list(int8_activations.layers)
        int8_mlps = [layer.mlp for layer in layers]
        with_int8_mlp = int8_activations_text_logits
        try:
            for layer, int8_mlp in zip(layers, int8_mlps, strict=True):
                layer.mlp = int8_mlp.plain
            unfused = all_logits(int8_activations, [ids])[0]
        finally:
            for layer, int8_mlp in zip(layers, int8_mlps, strict=True):
                layer.mlp = int8_mlp
    agree = float((with_int8_mlp.argmax(-1) == unfused.argmax(-1)).float().mean())
    assert agree >= 0.99
    assert float((with_int8_mlp - unfused).norm() / unfused.norm()) < 1e-2


def test_int8_activations_need_quantized_projections(checkpoint: Checkpoint) -> None:
    dense = build_llama(checkpoint.config, checkpoint.weights, "bfloat16")
    with pytest.raises(ConfigError, match=r"activation_quantization.*need quantized"):
        quantize_activations(dense)
    with pytest.raises(ConfigError, match=r"activation_quantization.*not none"):
        EngineConfig(activation_quantization="int8", quantization="none")
    with pytest.raises(ConfigError, match=r"activation_quantization.*'int4' is not one of"):
        engine_config_from(
            ModelConfig(name="m", backend="llm", parameters={"activation_quantization": "int4"})
        )
    parameters = {"activation_quantization": "int8"}
    config = engine_config_from(ModelConfig(name="m", backend="llm", parameters=parameters))
    assert config.activation_quantization == "int8"


# -- quantized weights ------------------------------------------------------------------


def test_rounding_error_is_half_a_step_and_the_kernels_compute_the_dequantized_weight() -> None:
    torch.manual_seed(0)
    w = torch.randn(48, 96) * 0.05  # 48 rows: the int4 kernel pads them to 64
    x = torch.randn(5, 96).bfloat16()
    groups = w.view(48, 3, 32)
    spread = (groups.amax(-1) - groups.amin(-1)).repeat_interleave(32, dim=1)  # [48, 96]
    steps = {
        "int4": spread / 15,  # per group of 32 inputs
        "int8": w.abs().amax(dim=1, keepdim=True).expand(48, 96) / 127,  # per row
    }
    for weight in (quantize_int4(w), quantize_int8(w)):
        error = (weight.dequantize() - w).abs()
        # half a step, and a little for the scale and zero rounded to bfloat16 first
        assert error.le(steps[weight.kind] * 0.5 + spread * 0.01).all(), weight.kind
        assert error.max() > 0  # it did round
        out = QuantizedLinear(weight, torch.bfloat16)(x).float()
        assert out.shape == (5, 48)
        ref = x.float() @ weight.dequantize().t()
        torch.testing.assert_close(out, ref, atol=0.02, rtol=0.02)
        wrong = x.float() @ w.flip(0).t()
        assert not torch.allclose(out, wrong, atol=0.02, rtol=0.02)
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_int4(torch.randn(16, 40))


def test_a_float32_model_runs_the_kernels_in_bfloat16_and_its_dense_copy_in_float32() -> None:
    """A few rows go through the int kernels, cast to bfloat16 and back; prefill-sized inputs
    through the float32 dense copy. Both compute the dequantized weight, in float32 out."""
    torch.manual_seed(0)
    w = torch.randn(48, 96) * 0.05
    for weight in (quantize_int4(w), quantize_int8(w)):
        layer = QuantizedLinear(weight, torch.float32)
        assert layer.dense.dtype == torch.float32
        assert layer.dense_from == DENSE_FROM_TOKENS_FLOAT32  # twice bfloat16's bytes to read
        for rows in (2, layer.dense_from - 1, layer.dense_from + 3):
            x = torch.randn(rows, 96)
            out = layer(x)
            assert out.dtype == torch.float32 and out.shape == (rows, 48)
            ref = x @ weight.dequantize().t()
            tolerance = 0.02 if rows < layer.dense_from else 1e-5  # bfloat16 inputs, or none
            torch.testing.assert_close(out, ref, atol=tolerance, rtol=tolerance)


def test_bfloat16_is_chosen_only_where_the_cpu_multiplies_it(tmp_path: Path) -> None:
    cases = {
        "flags\t\t: fpu sse avx2 avx512f avx512_vnni\n": False,  # AVX-512 without BF16
        "flags\t\t: fpu avx512f avx512_bf16 amx_tile\n": True,
        "flags\t\t: fpu avx512f amx_bf16 amx_tile\n": True,
        "Features\t: fp asimd bf16 i8mm\n": True,  # ARM
        "Features\t: fp asimd\n": False,
    }
    for text, native in cases.items():
        cpuinfo = tmp_path / "cpuinfo"
        cpuinfo.write_text("processor\t: 0\n" + text)
        assert native_bfloat16.__wrapped__(cpuinfo) is native, text
    assert native_bfloat16.__wrapped__(tmp_path / "missing") is True


# -- the quantization parameter ---------------------------------------------------------


def test_a_bad_quantization_value_names_the_field_and_the_choices() -> None:
    config = ModelConfig(name="m", backend="llm", parameters={"quantization": "int3"})
    with pytest.raises(ConfigError, match=r"'quantization'.*'int3' is not one of auto, none"):
        engine_config_from(config)
    float32 = {"quantization": "int4", "dtype": "float32"}  # the kernels run in bfloat16
    assert engine_config_from(ModelConfig(name="m", backend="llm", parameters=float32))
    auto = engine_config_from(ModelConfig(name="m", backend="llm", parameters={}))
    assert (auto.quantization, auto.weight_quantization) == ("auto", "auto")
    assert auto.dtype == ("bfloat16" if native_bfloat16() else "float32")  # dtype auto
    with pytest.raises(ConfigError, match="quantization"):
        load_checkpoint(Path("x.gguf"), quantization="fp8")


def test_a_bad_quantization_value_fails_that_models_load(gguf_path: Path, tmp_path: Path) -> None:
    from lockgate.demo.smollm2 import build_smollm2

    folder = tmp_path / "repo" / "smollm2"
    folder.mkdir(parents=True)
    build_smollm2(folder, lambda _message: None)
    config = yaml.safe_load((folder / "config.yaml").read_text())
    config["parameters"]["quantization"] = "int3"
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    server = start_server(tmp_path / "repo", tmp_path, wait_ready=False)
    try:
        deadline = time.monotonic() + 60
        entry: dict[str, str] = {}
        while time.monotonic() < deadline:
            response = httpx.post(server.url + "/v2/repository/index", timeout=10)
            index = response.json() if response.status_code == 200 else []
            entry = next((e for e in index if e["name"] == "smollm2"), {})
            if entry.get("state") == "UNAVAILABLE":
                break
            time.sleep(0.1)
        assert entry.get("state") == "UNAVAILABLE", entry
        assert "quantization" in entry["reason"] and "auto, none, int8, int4" in entry["reason"]
    finally:
        server.stop()


# -- the conversion cache ---------------------------------------------------------------

Q = gguf.GGMLQuantizationType
GGUF_TYPES = {  # projection -> how the tiny GGUF stores it; the rest is F32
    "self_attn.q_proj": Q.Q4_1,
    "self_attn.k_proj": Q.Q4_1,
    "self_attn.v_proj": Q.Q4_1,
    "self_attn.o_proj": Q.Q4_0,
    "mlp.gate_proj": Q.Q8_0,
    "mlp.up_proj": Q.Q8_0,
    "mlp.down_proj": Q.F16,
}


def write_quantized_gguf(path: Path) -> dict[str, np.ndarray]:
    """A two-layer llama GGUF whose projections are stored as GGUF_TYPES says. Returns the
    weights as gguf's own dequantization gives them, in Hugging Face names and row order."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(TOKENS)
    writer.add_token_types([3] + [1] * (len(TOKENS) - 1))
    writer.add_token_merges(["a b", "\u0120 ab"])
    writer.add_eos_token_id(0)
    expected = {}
    for name, w in tiny_weights(tied=True).items():
        heads = HEADS if ".q_proj." in name else KV_HEADS if ".k_proj." in name else 0
        order = permute_like_llama_cpp(np.arange(len(w)), heads) if heads else np.arange(len(w))
        kind = next((t for p, t in GGUF_TYPES.items() if f".{p}." in name), Q.F32)
        if kind in (Q.F32, Q.F16):
            data = w[order].astype(np.float16 if kind == Q.F16 else np.float32)
            writer.add_tensor(gguf_name(name), data)
            expected[name] = data.astype(np.float32)[np.argsort(order)]
        else:
            data = gguf.quants.quantize(w[order], kind)
            writer.add_tensor(gguf_name(name), data, raw_dtype=kind)
            expected[name] = gguf.quants.dequantize(data, kind)[np.argsort(order)]
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def dense_copy(ck: Checkpoint) -> dict[str, torch.Tensor]:
    return {**ck.weights, **{n: w.dequantize() for n, w in ck.quantized.items()}}


def test_auto_keeps_the_gguf_blocks_and_the_cache_keeps_them(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path, cache = tmp_path / "tiny.gguf", tmp_path / "cache"
    expected = write_quantized_gguf(path)
    with caplog.at_level(logging.INFO, logger="lockgate.llm"):
        cold = load_gguf(path, cache_dir=cache, quantization="auto")
        warm = load_gguf(path, cache_dir=cache, quantization="auto")
    messages = [r.getMessage() for r in caplog.records]
    assert "parsed and dequantized" in messages[0] and "from cache" in messages[1]
    (entry,) = (e for e in cache.iterdir() if e.name.startswith("gguf-"))
    assert entry.name.endswith("-auto")
    kinds = {n.split(".", 3)[3]: w.kind for n, w in warm.quantized.items()}
    assert kinds == {
        "self_attn.q_proj.weight": "int4",  # Q4_1: the same values
        "self_attn.k_proj.weight": "int4",
        "self_attn.v_proj.weight": "int4",
        "self_attn.o_proj.weight": "int4",  # Q4_0 too
        "mlp.gate_proj.weight": "int8",  # Q8_0, requantized per row
        "mlp.up_proj.weight": "int8",
    }
    assert "model.layers.0.mlp.down_proj.weight" in warm.weights  # F16 stays dense
    for name, weight in cold.quantized.items():
        back = warm.quantized[name]
        assert all(
            torch.equal(a, b)
            for a, b in zip(weight.tensors(name).values(), back.tensors(name).values(), strict=True)
        )
        dense, want = weight.dequantize().numpy(), expected[name]
        if weight.kind == "int4":  # exact, row order (RoPE unpermutation) included
            np.testing.assert_allclose(dense, want, rtol=1e-6, atol=1e-7, err_msg=name)
        else:
            step = np.abs(want).max(axis=1, keepdims=True) / 127
            assert (np.abs(dense - want) <= step * 0.51).all(), name
    for name, tensor in cold.weights.items():
        assert torch.equal(warm.weights[name], tensor)
    # the fused, packed kernels compute what the dequantized weights do
    ours = build_llama(warm.config, warm.weights, "bfloat16", warm.quantized)
    plain = build_llama(warm.config, dense_copy(warm), "bfloat16")
    ids = [[1, 4, 6, 2, 9, 3, 5, 7], [3, 3, 8]]
    for got, want in zip(all_logits(ours, ids), all_logits(plain, ids), strict=True):
        torch.testing.assert_close(got, want, atol=0.05, rtol=0.05)


def test_int4_and_int8_quantize_every_projection_from_any_source(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    write_quantized_gguf(path)
    for kind in ("int4", "int8"):
        ck = load_gguf(path, cache_dir=tmp_path / "cache", quantization=kind)
        assert len(ck.quantized) == 7 * LAYERS
        assert {w.kind for w in ck.quantized.values()} == {kind}
        assert not any(".self_attn." in n or ".mlp." in n for n in ck.weights)
    names = {e.name.rsplit("-", 1)[1] for e in (tmp_path / "cache").iterdir() if "gguf" in e.name}
    assert names == {"int4", "int8"}  # one cache entry per quantization


def test_the_real_models_quantized_copy_is_read_back(
    gguf_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    load_checkpoint(gguf_path, quantization="int4")  # converts, unless cached already
    with caplog.at_level(logging.INFO, logger="lockgate.llm"):
        ck = load_checkpoint(gguf_path, quantization="int4")
    assert "from cache" in caplog.records[-1].getMessage()
    assert len(ck.quantized) == 7 * ck.config.num_hidden_layers
    assert {w.kind for w in ck.quantized.values()} == {"int4"}
    packed = sum(w.qweight.numel() for w in ck.quantized.values())  # two values a byte
    assert packed * 2 == sum(w.in_features * w.out_features for w in ck.quantized.values())


def test_a_bf16_hugging_face_folder_is_quantized_by_int8_and_int4_only(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    weights = {n: torch.from_numpy(w).bfloat16() for n, w in tiny_weights(tied=True).items()}
    folder = tmp_path / "hf"
    folder.mkdir()
    save_file(weights, str(folder / "model.safetensors"))
    (folder / "tokenizer.json").write_text(
        json.dumps({"model": {"type": "BPE", "vocab": {t: i for i, t in enumerate(TOKENS)},
                              "merges": []}}),
        encoding="utf-8",
    )  # fmt: skip
    config = {
        "model_type": "llama",
        "vocab_size": len(TOKENS),
        "hidden_size": HIDDEN,
        "intermediate_size": FFN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "tie_word_embeddings": True,
    }
    (folder / "config.json").write_text(json.dumps(config), encoding="utf-8")
    assert not load_checkpoint(folder, quantization="auto").quantized  # bf16 stays bf16
    for kind in ("int8", "int4"):
        ck = load_checkpoint(folder, quantization=kind)
        assert len(ck.quantized) == 7 * LAYERS and {w.kind for w in ck.quantized.values()} == {kind}
        for name, weight in ck.quantized.items():
            tolerance = {"int8": 0.01, "int4": 0.05}[kind]  # half a step, weights ~ N(0, 0.2²)
            torch.testing.assert_close(
                weight.dequantize(), weights[name].float(), atol=tolerance, rtol=0.0
            )
