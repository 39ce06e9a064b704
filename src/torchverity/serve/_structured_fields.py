"""RFC 8941 structured-field dictionaries, as the digest fields use them: keys, integers,
decimals, tokens, byte sequences and inner lists, with parameters.
"""

from __future__ import annotations

import base64
import binascii
import re
from typing import Any


class FieldSyntaxError(ValueError):
    """The field is not a valid Structured-Field dictionary."""


_KEY = re.compile(r"[a-z*][a-z0-9_\-.*]*")


_TOKEN = re.compile(r"[A-Za-z*][!#$%&'*+\-.^_`|~0-9A-Za-z:/]*")


_NUMBER = re.compile(r"-?[0-9]{1,15}(\.[0-9]{1,3})?")


_BYTES = re.compile(r":([A-Za-z0-9+/=]*):")


class _Parser:
    """A small RFC 8941 dictionary parser: enough for digest fields, strict on syntax."""

    def __init__(self, text: str) -> None:
        if any(ord(c) > 0x7E or (ord(c) < 0x20 and c != "\t") for c in text):
            raise FieldSyntaxError("field contains characters outside visible ASCII")
        self.text = text.strip(" \t")
        self.pos = 0

    def dictionary(self) -> dict[str, Any]:
        members: dict[str, Any] = {}
        if not self.text:
            return members
        while True:
            key = self._match(_KEY, "a lowercase key")
            if self._peek("="):
                self.pos += 1
                value = self._inner_list() if self._peek("(") else self._bare_item()
            else:
                value = True
            self._params()
            members[key] = value  # later duplicates win (RFC 8941 4.2.2)
            self._skip_ows()
            if self.pos >= len(self.text):
                return members
            if not self._peek(","):
                raise FieldSyntaxError(f"expected ',' at position {self.pos}")
            self.pos += 1
            self._skip_ows()
            if self.pos >= len(self.text):
                raise FieldSyntaxError("trailing ','")

    def _bare_item(self) -> Any:
        if self._peek(":"):
            encoded = self._match(_BYTES, "a byte sequence")[1:-1]
            try:
                return base64.b64decode(encoded, validate=True)
            except binascii.Error:
                raise FieldSyntaxError("byte sequence is not valid base64") from None
        if self._peek('"'):
            return self._string()
        if self._peek("?"):
            flag = self._match(re.compile(r"\?[01]"), "a boolean")
            return flag == "?1"
        if self.pos < len(self.text) and self.text[self.pos] in "-0123456789":
            number = self._match(_NUMBER, "a number")
            return float(number) if "." in number else int(number)
        return self._match(_TOKEN, "an item")

    def _inner_list(self) -> list[Any]:
        self.pos += 1
        items: list[Any] = []
        while True:
            while self._peek(" "):
                self.pos += 1
            if self._peek(")"):
                self.pos += 1
                return items
            items.append(self._bare_item())
            self._params()
            if not (self._peek(" ") or self._peek(")")):
                raise FieldSyntaxError("malformed inner list")

    def _string(self) -> str:
        out: list[str] = []
        self.pos += 1
        while self.pos < len(self.text):
            char = self.text[self.pos]
            self.pos += 1
            if char == "\\":
                if self.pos >= len(self.text) or self.text[self.pos] not in '"\\':
                    raise FieldSyntaxError("bad escape in string")
                out.append(self.text[self.pos])
                self.pos += 1
            elif char == '"':
                return "".join(out)
            else:
                out.append(char)
        raise FieldSyntaxError("unterminated string")

    def _params(self) -> None:
        # Parameters are allowed by the syntax; digest fields define none, so they are skipped.
        while self._peek(";"):
            self.pos += 1
            self._skip_ows()
            self._match(_KEY, "a parameter key")
            if self._peek("="):
                self.pos += 1
                self._bare_item()

    def _match(self, pattern: re.Pattern[str], what: str) -> str:
        m = pattern.match(self.text, self.pos)
        if not m:
            raise FieldSyntaxError(f"expected {what} at position {self.pos}")
        self.pos = m.end()
        return m.group(0)

    def _peek(self, char: str) -> bool:
        return self.text.startswith(char, self.pos)

    def _skip_ows(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos] in " \t":
            self.pos += 1


def parse_dictionary(text: str) -> dict[str, Any]:
    """Parse a Structured-Field dictionary; raise :class:`FieldSyntaxError` if malformed."""
    return _Parser(text).dictionary()
