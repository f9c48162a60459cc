"""A parser for the protobuf text format, enough for Triton's `config.pbtxt`.

It knows no schema: it returns a tree of `Message`s whose fields map a name to the list
of every value given for it (a repeated key and a `[a, b]` list both append). Scalars are
`str` (quoted strings, escapes decoded), `Ident` (bare identifiers such as enum values),
`bool` (`true`/`false`), `int` and `float`.

Grammar, as protobuf's own text parser reads it:

    message := field*
    field   := name [":"] ( "{" message "}" | "<" message ">" | "[" items "]" | scalar ) [";" | ","]
    items   := (value ("," value)*)?
    scalar  := string+ | number | identifier      (adjacent strings concatenate)

`#` starts a comment that runs to the end of the line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field


class Ident(str):
    """A bare identifier value, such as the enum value `TYPE_FP32`."""

    __slots__ = ()


Scalar = str | int | float | bool


class PbtxtSyntaxError(ValueError):
    """The text is not valid protobuf text format. `line` and `column` count from 1."""

    def __init__(self, message: str, line: int, column: int) -> None:
        super().__init__(f"line {line}, column {column}: {message}")
        self.line = line
        self.column = column
        self.problem = message


@dataclass(slots=True)
class Message:
    """One message: field name -> every value given for it, in order."""

    fields: dict[str, list[Value]] = field(default_factory=dict)
    line: int = 1  # where the message starts, for error messages

    def add(self, name: str, value: Value) -> None:
        self.fields.setdefault(name, []).append(value)

    def names(self) -> list[str]:
        return list(self.fields)

    def values(self, name: str) -> list[Value]:
        return self.fields.get(name, [])

    def get(self, name: str, default: Value | None = None) -> Value | None:
        """The last value given for `name` (protobuf's rule for singular fields)."""
        values = self.fields.get(name)
        return values[-1] if values else default

    def __contains__(self, name: object) -> bool:
        return name in self.fields


Value = Scalar | Message


@dataclass(frozen=True, slots=True)
class _Token:
    kind: str  # "string" | "number" | "ident" | "punct" | "eof"
    text: str
    line: int
    column: int


_TOKEN = re.compile(
    r"""
    (?P<space>[ \t\r\n]+|\#[^\n]*)
    | (?P<string>"(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*')
    | (?P<number>[-+]?(?:0[xX][0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)[fF]?
        |[-+](?:inf|infinity|nan)\b)
    | (?P<ident>[A-Za-z_][A-Za-z0-9_.]*)
    | (?P<punct>[{}<>\[\]:,;])
    """,
    re.VERBOSE | re.IGNORECASE,
)

_ESCAPES = {
    "n": "\n",
    "t": "\t",
    "r": "\r",
    "a": "\a",
    "b": "\b",
    "f": "\f",
    "v": "\v",
    "\\": "\\",
    "'": "'",
    '"': '"',
    "?": "?",
}
_ESCAPE = re.compile(r"\\(?:([0-7]{1,3})|x([0-9a-fA-F]{1,2})|u([0-9a-fA-F]{4})|(.))", re.DOTALL)


def _tokenize(text: str) -> list[_Token]:
    tokens: list[_Token] = []
    pos, line, line_start = 0, 1, 0
    while pos < len(text):
        match = _TOKEN.match(text, pos)
        if match is None:
            raise PbtxtSyntaxError(
                f"unexpected character {text[pos]!r}", line, pos - line_start + 1
            )
        kind = match.lastgroup or ""
        if kind != "space":
            tokens.append(_Token(kind, match.group(), line, pos - line_start + 1))
        newlines = match.group().count("\n")
        if newlines:
            line += newlines
            line_start = match.start() + match.group().rindex("\n") + 1
        pos = match.end()
    tokens.append(_Token("eof", "", line, pos - line_start + 1))
    return tokens


def _unescape(quoted: str, token: _Token) -> str:
    """Decode C-style escapes. Octal and hex escapes are bytes, read as UTF-8."""
    body = quoted[1:-1]
    out = bytearray()
    pos = 0
    for match in _ESCAPE.finditer(body):
        out += body[pos : match.start()].encode("utf-8")
        out += _escaped_bytes(match, token)
        pos = match.end()
    out += body[pos:].encode("utf-8")
    return out.decode("utf-8", errors="replace")


def _escaped_bytes(match: re.Match[str], token: _Token) -> bytes:
    octal, hexa, uni, char = match.groups()
    if octal is not None:
        return bytes([int(octal, 8) & 0xFF])
    if hexa is not None:
        return bytes([int(hexa, 16)])
    if uni is not None:
        return chr(int(uni, 16)).encode("utf-8", errors="replace")
    if char in _ESCAPES:
        return _ESCAPES[char].encode("utf-8")
    raise PbtxtSyntaxError(f"unknown escape '\\{char}'", token.line, token.column)


def _number(text: str) -> int | float:
    lowered = text.lower()
    sign = -1 if lowered.startswith("-") else 1
    body = lowered.lstrip("+-")
    if body.startswith("0x"):
        return sign * int(body, 16)
    if body in ("inf", "infinity"):
        return sign * float("inf")
    if body == "nan":
        return float("nan")
    if body.endswith("f"):
        return float(lowered[:-1])
    if any(c in body for c in ".e"):
        return float(lowered)
    return int(lowered, 10)


class _Parser:
    def __init__(self, text: str) -> None:
        self.tokens = _tokenize(text)
        self.pos = 0

    def peek(self) -> _Token:
        return self.tokens[self.pos]

    def next(self) -> _Token:
        token = self.tokens[self.pos]
        self.pos += 1
        return token

    def fail(self, message: str, token: _Token | None = None) -> PbtxtSyntaxError:
        token = token or self.peek()
        return PbtxtSyntaxError(message, token.line, token.column)

    def accept(self, text: str) -> bool:
        token = self.peek()
        if token.kind == "punct" and token.text == text:
            self.pos += 1
            return True
        return False

    def expect(self, text: str) -> None:
        if not self.accept(text):
            found = self.peek().text or "end of file"
            raise self.fail(f"expected '{text}', found '{found}'")

    def message(self, close: str | None, line: int) -> Message:
        """Fields up to `close` (or the end of the text when `close` is None)."""
        message = Message(line=line)
        while True:
            token = self.peek()
            if close is None and token.kind == "eof":
                return message
            if close is not None and self.accept(close):
                return message
            if token.kind != "ident":
                found = token.text or "end of file"
                raise self.fail(f"expected a field name, found '{found}'")
            self.next()
            self.field_value(message, token.text)
            if not self.accept(";"):
                self.accept(",")

    def field_value(self, message: Message, name: str) -> None:
        colon = self.accept(":")
        if self.accept("["):
            for value in self.list_items():
                message.add(name, value)
            return
        opener = self.peek()
        if self.accept("{") or self.accept("<"):
            message.add(name, self.message("}" if opener.text == "{" else ">", opener.line))
            return
        if not colon:
            raise self.fail(f"expected ':' or '{{' after field '{name}'")
        message.add(name, self.scalar())

    def list_items(self) -> list[Value]:
        items: list[Value] = []
        if self.accept("]"):
            return items
        while True:
            opener = self.peek()
            if self.accept("{") or self.accept("<"):
                items.append(self.message("}" if opener.text == "{" else ">", opener.line))
            else:
                items.append(self.scalar())
            if self.accept("]"):
                return items
            self.expect(",")

    def scalar(self) -> Scalar:
        token = self.next()
        if token.kind == "string":
            parts = [_unescape(token.text, token)]
            while self.peek().kind == "string":  # "a" "b" is "ab"
                following = self.next()
                parts.append(_unescape(following.text, following))
            return "".join(parts)
        if token.kind == "number":
            return _number(token.text)
        if token.kind == "ident":
            return _identifier(token.text)
        raise self.fail(f"expected a value, found '{token.text or 'end of file'}'", token)


def _identifier(text: str) -> Scalar:
    if text in ("true", "True", "t"):
        return True
    if text in ("false", "False", "f"):
        return False
    lowered = text.lower()
    if lowered in ("inf", "infinity", "nan"):
        return _number(lowered)
    return Ident(text)


def parse(text: str) -> Message:
    """Parse protobuf text format into a `Message` tree. Raises PbtxtSyntaxError."""
    return _Parser(text).message(None, 1)
