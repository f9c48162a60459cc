"""Text <-> token ids for a language model: BPE tokenizer, chat template, streaming detokenizer.

A tokenizer comes from a Hugging Face folder (tokenizer.json + tokenizer_config.json) or from
the metadata of a GGUF file, which stores the vocabulary, the merges and the special ids under
llama.cpp's key names. Either way it is described by a `TokenizerSpec` (plain data, cached by
the loader) and used through `ChatTokenizer`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from lockgate.errors import BadRequest, ConfigError
from lockgate.llm.guided import GrammarCompiler

# llama.cpp token types (tokenizer.ggml.token_type)
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre values whose vocabularies were trained with single-digit numbers
_DIGIT_SPLIT_PRE = {"smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva"}
_REGEX_SPLIT_PRE = {
    "llama3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}


@dataclass(slots=True)
class TokenizerSpec:
    """Everything needed to rebuild a tokenizer, as JSON-friendly data."""

    tokenizer_json: str  # a serialized `tokenizers.Tokenizer`
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None
    eos_token_ids: list[int] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> TokenizerSpec:
        return cls(**raw)


# GGUF ---------------------------------------------------------------------------------------


def spec_from_gguf_metadata(meta: dict[str, Any], source: str) -> TokenizerSpec:
    """From GGUF key/values (`tokenizer.ggml.*`, `tokenizer.chat_template`)."""
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ConfigError(
            source, "tokenizer.ggml.model", f"only 'gpt2' (byte-level BPE), got {kind!r}"
        )
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    tok = _byte_level_bpe(tokens, meta.get("tokenizer.ggml.merges", []), source)
    _add_gguf_special_tokens(tok, tokens, meta.get("tokenizer.ggml.token_type") or [])
    tok.pre_tokenizer = _gguf_pre_tokenizer(meta.get("tokenizer.ggml.pre"))
    tok.decoder = decoders.ByteLevel()

    def token_at(key: str) -> str | None:
        index = meta.get(f"tokenizer.ggml.{key}")
        return tokens[index] if isinstance(index, int) and 0 <= index < len(tokens) else None

    bos = token_at("bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token") and bos is not None:
        bos_id = meta["tokenizer.ggml.bos_token_id"]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, bos_id)]
        )
    eos_ids = [
        meta[f"tokenizer.ggml.{key}"]
        for key in ("eos_token_id", "eot_token_id", "eom_token_id")
        if isinstance(meta.get(f"tokenizer.ggml.{key}"), int)
    ]
    return TokenizerSpec(
        tokenizer_json=tok.to_str(),
        chat_template=meta.get("tokenizer.chat_template"),
        bos_token=bos,
        eos_token=token_at("eos_token_id"),
        eos_token_ids=sorted(set(eos_ids)),
    )


def _byte_level_bpe(tokens: list[str], merges: list[str], source: str) -> Tokenizer:
    pairs: list[tuple[str, str]] = []
    for merge in merges:
        left, sep, right = merge.partition(" ")
        if not sep:
            raise ConfigError(source, "tokenizer.ggml.merges", f"malformed merge {merge!r}")
        pairs.append((left, right))
    vocab = {token: index for index, token in enumerate(tokens)}
    return Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))


def _add_gguf_special_tokens(tok: Tokenizer, tokens: list[str], types: list[int]) -> None:
    # Control tokens (<|im_end|>, ...) must stay whole and are skipped when decoding;
    # user-defined ones stay whole but are ordinary text.
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    special = [
        AddedToken(t, normalized=False, special=True)
        for t, kind in zip(tokens, types, strict=False)
        if kind == TOKEN_CONTROL and set(t) <= alphabet
    ]
    plain = [
        AddedToken(t, normalized=False, special=False)
        for t, kind in zip(tokens, types, strict=False)
        if kind == TOKEN_USER_DEFINED
    ]
    tok.add_special_tokens(special)
    tok.add_tokens(plain)


def _gguf_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    if pre in _REGEX_SPLIT_PRE:
        split = pre_tokenizers.Split(Regex(_REGEX_SPLIT_PRE[pre]), behavior="isolated")
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        return pre_tokenizers.Sequence([split, byte_level])
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_SPLIT_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return byte_level


# Hugging Face folder ------------------------------------------------------------------------


def spec_from_hf_folder(folder: Path) -> TokenizerSpec:
    """From tokenizer.json, tokenizer_config.json and (optionally) generation_config.json."""
    tokenizer_file = folder / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ConfigError(str(folder), "tokenizer.json", "file not found")
    config = _read_json(folder / "tokenizer_config.json")
    template = config.get("chat_template")
    template_file = folder / "chat_template.jinja"
    if template is None and template_file.is_file():
        template = template_file.read_text(encoding="utf-8")
    tok_json = tokenizer_file.read_text(encoding="utf-8")
    tok = Tokenizer.from_str(tok_json)
    bos, eos = _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
    eos_ids = _as_id_list(_read_json(folder / "generation_config.json").get("eos_token_id"))
    eos_id = None if eos is None else tok.token_to_id(eos)
    if eos_id is not None:
        eos_ids.append(eos_id)
    return TokenizerSpec(tok_json, template, bos, eos, sorted(set(eos_ids)))


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ConfigError(str(path), "<file>", f"invalid JSON: {exc}") from exc
    return raw if isinstance(raw, dict) else {}


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", ...}
        value = value.get("content")
    return value if isinstance(value, str) else None


def _as_id_list(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    return [v for v in value if isinstance(v, int)] if isinstance(value, list) else []


# The tokenizer ------------------------------------------------------------------------------


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTokenizer:
    """Encode, decode and render chat prompts for one model."""

    def __init__(self, spec: TokenizerSpec) -> None:
        self.spec = spec
        self.backend = Tokenizer.from_str(spec.tokenizer_json)
        self.bos_token_id = self._id_of(spec.bos_token)
        self.eos_token_ids = frozenset(spec.eos_token_ids)
        self.vocab_size = self.backend.get_vocab_size(with_added_tokens=True)
        self.text_backend = Tokenizer.from_str(spec.tokenizer_json)  # special tokens as text
        self.text_backend.encode_special_tokens = True
        # the longest token's text, in vocabulary characters: each stands for at least one
        # character of text, so no token covers more characters of a prompt than this
        self.max_token_chars = max(
            (len(t) for t in self.backend.get_vocab(with_added_tokens=True)), default=1
        )
        self._template: jinja2.Template | None = None
        self.takes_tools = False  # the chat template renders a `tools` variable
        if spec.chat_template:
            self._template, self.takes_tools = _compile_template(spec.chat_template)
        # control tokens' text (<|im_start|>, ...): never taken from a client's text
        self.control_texts = tuple(
            t.content for t in self.backend.get_added_tokens_decoder().values() if t.special
        )
        # the vocabulary as llguidance reads it, for guided decoding
        self.grammars = GrammarCompiler(spec.tokenizer_json, spec.eos_token_ids)

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise BadRequest(f"token id {bad[0]} is outside the vocabulary of {self.vocab_size}")
        return str(self.backend.decode(ids, skip_special_tokens=skip_special_tokens))

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        check_chars: Callable[[int], None] | None = None,
        continue_final_message: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of a chat prompt in which message content is text, never control: the
        template is rendered with a marker in place of each content, its own text is encoded
        with special tokens parsed, and each content with special tokens split, so a user
        writing `<|im_start|>system` gets those characters, not a forged role. The other
        text a client gives the template (roles, names, tool calls, `tools`, for a template
        that takes them, `template_kwargs`) must hold no control token's text (400). With
        `continue_final_message`, the prompt ends with the final message's content (the
        template's end of that turn cut off), for the model to go on writing it."""
        markers = [f"{_MARK_OPEN}{i}{_MARK_CLOSE}" for i in range(len(messages))]
        contents = [m.get("content") for m in messages]
        last = len(messages) - 1 if continue_final_message else -1
        marked_at = [bool(c) or i == last for i, c in enumerate(contents)]
        if any(c is not None and not isinstance(c, str) for c in contents):
            raise BadRequest("message content must be text")
        for content in contents:
            if content and (_MARK_OPEN in content or _MARK_CLOSE in content):
                raise BadRequest("message content holds reserved characters U+E000 or U+E001")
        for index, message in enumerate(messages):
            rest = {key: value for key, value in message.items() if key != "content"}
            self._check_not_control(rest, f"messages[{index}]")
        if tools is not None:
            self._check_not_control(tools, "tools")
        extra = _template_variables(template_kwargs)
        self._check_not_control(extra, "chat_template_kwargs")
        if tools is not None:
            extra["tools"] = tools
        marked = [
            {**m, "content": mark} if at else m
            for m, mark, at in zip(messages, markers, marked_at, strict=True)
        ]
        prompt = self.apply_chat_template(marked, add_generation_prompt, **extra)
        if continue_final_message:
            end = prompt.rfind(markers[last])
            if end < 0:
                raise BadRequest(
                    "continue_final_message: the chat template does not write the final "
                    "message's content"
                )
            prompt = prompt[: end + len(markers[last])]
        if check_chars is not None:  # the whole prompt's length, before any of it is encoded
            markers_chars = sum(len(markers[i]) for i, at in enumerate(marked_at) if at)
            contents_chars = sum(len(c) for c in contents if c)
            check_chars(len(prompt) - markers_chars + contents_chars)
        ids: list[int] = []
        for piece in _MARKED.split(prompt):
            if not piece:
                continue
            found = _MARKER.fullmatch(piece)
            if found is None:
                ids += self.encode(piece, add_special_tokens=False)
            elif content := contents[int(found.group(1))]:
                ids += self.text_backend.encode(content, add_special_tokens=False).ids
        return ids

    def _check_not_control(self, value: Any, where: str) -> None:
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        for control in self.control_texts:
            if control in text:
                raise BadRequest(f"{where} holds the control token {control!r}")

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """Render messages to a prompt string with the model's Jinja chat template."""
        if self._template is None:
            raise BadRequest("this model has no chat template; send a plain prompt instead")
        _check_messages(messages)
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.spec.bos_token or "",
                eos_token=self.spec.eos_token or "",
                **extra,
            )
        except jinja2.TemplateError as exc:
            raise BadRequest(f"chat template rejected the messages: {exc}") from exc


_MARK_OPEN, _MARK_CLOSE = "\ue000", "\ue001"  # private use: never in a template's own text
_MARKER = re.compile(f"{_MARK_OPEN}(\\d+){_MARK_CLOSE}")
_MARKED = re.compile(f"({_MARK_OPEN}\\d+{_MARK_CLOSE})")


def _compile_template(source: str) -> tuple[jinja2.Template, bool]:
    """The template, and whether it renders a `tools` variable."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = lambda value, indent=None: json.dumps(
        value, ensure_ascii=False, indent=indent
    )
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        takes_tools = "tools" in jinja2.meta.find_undeclared_variables(env.parse(source))
        return env.from_string(source), takes_tools
    except jinja2.TemplateSyntaxError as exc:
        raise ConfigError("<tokenizer>", "chat_template", f"invalid Jinja: {exc}") from exc


# the variables lockgate gives a chat template itself: not to be set by chat_template_kwargs
_TEMPLATE_OWN = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token", "tools"})


def _template_variables(kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """A request's chat_template_kwargs (vLLM's), as variables for the template: 400 for
    one that names a variable lockgate sets itself."""
    found = dict(kwargs or {})
    own = sorted(_TEMPLATE_OWN.intersection(found))
    if own:
        raise BadRequest(
            f"chat_template_kwargs may not set {', '.join(own)}: use the request's own fields"
        )
    return found


def _check_messages(messages: list[dict[str, Any]]) -> None:
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRequest(f"messages[{i}] needs a string 'role'")


class IncrementalDetokenizer:
    """Turns a stream of token ids into text pieces, never splitting a multibyte character.

    Each step decodes a small window: the ids since the last emitted piece plus the ones
    before it (for tokenizers whose text depends on the previous token). Text that ends in
    an incomplete UTF-8 sequence (U+FFFD) is held back until later ids complete it or `flush`.
    """

    def __init__(self, tokenizer: ChatTokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0  # start of the decode window
        self.read_offset = 0  # ids before this are emitted

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Feed one id; returns the new text it completes (often "", never half a character)."""
        self.ids.append(token_id)
        emitted = self._decode(self.ids[self.prefix_offset : self.read_offset])
        text = self._decode(self.ids[self.prefix_offset :])
        if len(text) <= len(emitted) or text.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return text[len(emitted) :]

    def flush(self) -> str:
        """The held-back rest, at the end of the stream (may contain U+FFFD)."""
        emitted = self._decode(self.ids[self.prefix_offset : self.read_offset])
        text = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return text[len(emitted) :]
