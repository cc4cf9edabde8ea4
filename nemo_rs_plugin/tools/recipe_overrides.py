"""Hydra-style overrides applied by ``nemo-rs check`` where NeMo-RL's own loader is absent.

``a.b=value`` changes a key the recipe has, ``+a.b=value`` adds one it does not have,
``++a.b=value`` does either, ``~a.b`` deletes; list entries by index. The rules are Hydra's
struct mode, as NeMo-RL's ``parse_hydra_overrides`` applies them; a problem is one
:class:`OverrideError` line naming the override.

The value is read as Hydra's override parser reads it (NeMo-RL's ``parse_hydra_overrides``
uses it), not as YAML: ``1e-4`` is the float 0.0001 (YAML 1.1 would read a string), ``on`` and
``yes`` are strings, ``1_000`` is 1000, ``'...'`` quotes, ``[...]`` and ``{...}`` nest, a
``${...}`` stays a string for OmegaConf, ``a,b`` is a sweep (refused, as NeMo-RL's loader
refuses it). :func:`parse_override_value` implements Hydra's grammar (hydra-core's
``OverrideParser.g4``) without depending on Hydra; ``tests/tools/test_override_values.py``
compares it with Hydra's own parser. Hydra's functions (``int(...)``, ``choice(...)``) are
left to NeMo-RL's loader: an error here naming where to check.
"""

from __future__ import annotations

import re
from typing import Any, Optional

__all__ = ["OverrideError", "apply_override", "one_line", "override_key", "parse_override_value"]


def one_line(exc: BaseException, strip: str = "") -> str:
    """``Type: message`` on one line (Hydra and pydantic messages span several)."""
    text = str(exc)
    if strip and text.startswith(strip):
        text = text[len(strip) :]
    parts = [line.strip() for line in text.splitlines()]
    parts = [p for p in parts if p and set(p) != {"^"} and not p.startswith("See https://")]
    return f"{type(exc).__name__}: {' '.join(parts)}" if parts else type(exc).__name__


class OverrideError(ValueError):
    """An override that does not fit the recipe; the message names the override."""


def override_key(override: str) -> tuple[str, str, Optional[str]]:
    """``(kind, dotted key, value)`` of ``key=value`` / ``+key=value`` / ``++key=value`` / ``~key``."""
    if override.startswith("~"):
        kind, rest = "~", override[1:]
        key, _, text = rest.partition("=")
        value: Optional[str] = text or None  # ~key deletes whatever is there; ~key=v only if it is v
    else:
        kind = "++" if override.startswith("++") else "+" if override.startswith("+") else ""
        key, sep, value = override[len(kind) :].partition("=")
        if not sep:
            raise OverrideError(f"override {override!r}: expected key=value")
    parts = key.split(".")
    if not key or any(not p.strip() or p != p.strip() for p in parts):
        raise OverrideError(f"override {override!r}: {key!r} is not a dotted key (e.g. loss_fn.ratio_clip_max)")
    return kind, key, value


def _child(node: Any, key: str, where: str, override: str, create: bool, indexes_next: bool) -> Any:
    if isinstance(node, dict):
        if key not in node:
            here = f"{where}.{key}" if where else key
            if indexes_next:  # a.b.0.c with no list at a.b: nothing to index
                raise OverrideError(
                    f"override {override!r}: there is no list at {here} to index; add it whole (+{here}=[...])"
                )
            if not create:
                raise OverrideError(
                    f"override {override!r}: {where or 'the recipe'} has no key {key!r}; to add {here}, "
                    f"write +{override.lstrip('+')}"
                )
            node[key] = {}
        return node[key]
    if isinstance(node, list):
        return node[_index(node, key, where, override)]
    raise OverrideError(
        f"override {override!r}: {where} is a {type(node).__name__} ({node!r}), not a mapping or a list"
    )


def _index(node: list, key: str, where: str, override: str) -> int:
    try:
        i = int(key)
    except ValueError:
        raise OverrideError(f"override {override!r}: {where} is a list; {key!r} is not an index") from None
    if not 0 <= i < len(node):
        raise OverrideError(f"override {override!r}: {where} has {len(node)} entries; index {i} is out of range")
    return i


def apply_override(cfg: dict, override: str, complete: bool = True) -> None:
    """``a.b.c=value`` / ``+a.b=value`` / ``++a.b=value`` (value read as Hydra reads it) / ``~a.b`` (delete), in place.

    Hydra's rules, as NeMo-RL applies them: ``key=value`` changes a key that exists, ``+key=value``
    adds one that does not, ``++`` does either. ``complete`` says the recipe is whole (every file of
    its ``defaults`` found): only then is a missing key known to be missing; otherwise it may
    come from an unresolved parent and ``key=value`` adds it.

    Raises:
        OverrideError: one line naming the override and what does not fit.
    """
    kind, key, value = override_key(override)
    if kind != "~":  # the value is parsed first, as Hydra parses the whole override first
        try:
            parsed = parse_override_value(value or "")
        except OverrideError as exc:
            raise OverrideError(f"override {override!r}: {exc}") from None
    parts = key.split(".")
    node: Any = cfg
    create = kind in ("+", "++") or (kind == "" and not complete)
    for depth, k in enumerate(parts[:-1]):
        node = _child(node, k, ".".join(parts[:depth]), override, create, parts[depth + 1].isdigit())
    where, last = ".".join(parts[:-1]), parts[-1]
    if isinstance(node, dict) and kind == "" and complete and last not in node:
        raise OverrideError(
            f"override {override!r}: {key} is not in the recipe; to add it, write +{override} "
            "(Hydra refuses to change a key that does not exist)"
        )
    if isinstance(node, dict) and kind == "+" and last in node:
        raise OverrideError(
            f"override {override!r}: {key} is already in the recipe; to change it, write "
            f"{override[1:]} (or ++{override[1:]} to add or change)"
        )
    if kind == "~":
        if isinstance(node, dict) and last in node:
            del node[last]
        elif isinstance(node, list):
            del node[_index(node, last, where, override)]
        else:
            raise OverrideError(f"override {override!r}: nothing to delete at {key}")
        return
    if isinstance(node, dict):
        node[last] = parsed
    elif isinstance(node, list):
        node[_index(node, last, where, override)] = parsed
    else:
        raise OverrideError(
            f"override {override!r}: {where} is a {type(node).__name__} ({node!r}), not a mapping or a list"
        )


# ----------------------------------------------------------------------------- Hydra's value grammar
# hydra-core's OverrideLexer/OverrideParser (grammar/OverrideParser.g4), value mode.
_INT_PART = r"(0|[1-9](_?[0-9])*)"
_DIGITS = r"[0-9](_?[0-9])*"
_INT = re.compile(rf"[+-]?{_INT_PART}")
_POINT_FLOAT = rf"({_INT_PART}?\.{_DIGITS}|{_INT_PART}\.)"
_FLOAT = re.compile(rf"[+-]?({_POINT_FLOAT}|({_INT_PART}|{_POINT_FLOAT})[eE][+-]?{_DIGITS}|[Ii][Nn][Ff]|[Nn][Aa][Nn])")
_BOOL = re.compile(r"[Tt][Rr][Uu][Ee]|[Ff][Aa][Ll][Ss][Ee]")
_NULL = re.compile(r"[Nn][Uu][Ll][Ll]")
_ID = re.compile(r"[A-Za-z_][A-Za-z0-9_\-]*")
#: Characters of an unquoted word: Hydra's ID, INT and FLOAT characters and its UNQUOTED_CHAR.
#: A ``$`` that opens no ``${``, a backslash that escapes nothing.
_WORD = re.compile(r"(?:[A-Za-z0-9_/\-+.%*@?|]|\$(?!\{)|\\(?![\\()\[\]{}:=, \t]))+")
_ESCAPED = set("\\()[]{}:=, \t")
_FUNCTIONS = (
    "bool",
    "choice",
    "float",
    "glob",
    "int",
    "interval",
    "json_str",
    "range",
    "shuffle",
    "sort",
    "str",
    "tag",
)


def _tokens(text: str) -> list[tuple[str, str]]:
    """``(kind, text)`` pairs: ws, quoted (its content), interp, esc (the character), word, or a delimiter."""
    out: list[tuple[str, str]] = []
    i = 0
    while i < len(text):
        c = text[i]
        if c in " \t":
            j = i
            while j < len(text) and text[j] in " \t":
                j += 1
            out.append(("ws", text[i:j]))
            i = j
        elif c in "'\"":
            j, chars = i + 1, []
            while j < len(text) and text[j] != c:
                if text[j] == "\\":  # backslashes escape only before the quote: n of them there, n // 2 left
                    k = j
                    while k < len(text) and text[k] == "\\":
                        k += 1
                    if k < len(text) and text[k] == c:
                        chars.append("\\" * ((k - j) // 2) + c * ((k - j) % 2))
                        j = k + (k - j) % 2
                        continue
                    chars.append(text[j:k])
                    j = k
                    continue
                chars.append(text[j])
                j += 1
            if j >= len(text):
                raise OverrideError(f"the value has an unclosed quote at {text[i:]!r}")
            out.append(("quoted", "".join(chars)))
            i = j + 1
        elif text.startswith("${", i):
            j = text.find("}", i)
            if j < 0:
                raise OverrideError(f"the value has an unclosed interpolation at {text[i:]!r}")
            out.append(("interp", text[i : j + 1]))
            i = j + 1
        elif c == "\\" and i + 1 < len(text) and text[i + 1] in _ESCAPED:
            out.append(("esc", text[i + 1]))
            i += 2
        elif c == ":":  # Hydra's COLON holds the whitespace around it (kept inside a string)
            content = len(out) >= 2 and out[-1][0] == "ws" and out[-2][0] in ("word", "esc", "interp", ":")
            before = out.pop()[1] if content else ""
            j = i + 1
            while j < len(text) and text[j] in " \t":
                j += 1
            out.append((":", before + text[i:j]))
            i = j
        elif c in "[]{},()":
            out.append((c, c))
            i += 1
        else:
            m = _WORD.match(text, i)
            if m is None:
                raise OverrideError(
                    f"the value has {c!r}, which Hydra's override grammar does not allow unquoted: quote the value"
                )
            out.append(("word", m.group()))
            i = m.end()
    return out


def _scalar(word: str) -> Any:
    """One unquoted word as Hydra types it: int, float, bool, null, else the string."""
    if _INT.fullmatch(word):
        return int(word.replace("_", ""))
    if _FLOAT.fullmatch(word):
        return float(word.replace("_", ""))
    if _BOOL.fullmatch(word):
        return word.lower() == "true"
    if _NULL.fullmatch(word):
        return None
    return word


class _Parser:
    def __init__(self, text: str):
        self.tokens = _tokens(text)
        self.i = 0

    def peek(self) -> str:
        return self.tokens[self.i][0] if self.i < len(self.tokens) else "end"

    def take(self, kind: str) -> str:
        if self.peek() != kind:
            found = "the end" if self.peek() == "end" else repr(self.tokens[self.i][1])
            raise OverrideError(f"the value does not parse as Hydra parses it: expected {kind!r}, found {found}")
        self.i += 1
        return self.tokens[self.i - 1][1]

    def skip_ws(self) -> None:
        while self.peek() == "ws":
            self.i += 1

    def element(self, stops: str) -> Any:
        """A value, ended by one of ``stops``.

        ``","`` is the top level, where Hydra allows no whitespace after a container or a quoted string.
        """
        self.skip_ws()
        kind = self.peek()
        if kind == "[":
            value: Any = self.container("[", "]", self.list_items)
        elif kind == "{":
            value = self.container("{", "}", self.dict_items)
        elif kind == "word" and self.i + 1 < len(self.tokens) and self.tokens[self.i + 1][0] == "(":
            name = self.tokens[self.i][1]
            known = name in _FUNCTIONS
            raise OverrideError(
                f"{name}(...) is {'a Hydra function' if known else 'no Hydra function'}"
                + (
                    ", which only NeMo-RL's own loader evaluates here: run check where NeMo-RL is importable, or "
                    "write the value itself"
                    if known and _ID.fullmatch(name)
                    else f" (Hydra's are {', '.join(_FUNCTIONS)})"
                )
            )
        elif kind == "quoted":
            value = self.take("quoted")
        else:
            return self.primitive(stops)  # its trailing whitespace is its own (stripped)
        if stops != ",":
            self.skip_ws()
        return value

    def primitive(self, stops: str) -> Any:
        parts: list[tuple[str, str]] = []
        while self.peek() in ("word", "ws", "esc", "interp") or (self.peek() == ":" and ":" not in stops):
            parts.append(self.tokens[self.i])
            self.i += 1
        while parts and parts[-1][0] == "ws":  # consumed, not part of the value
            parts.pop()
        if not parts:
            found = "the end" if self.peek() == "end" else repr(self.tokens[self.i][1])
            raise OverrideError(f"the value does not parse as Hydra parses it: expected a value, found {found}")
        if len(parts) == 1 and parts[0][0] == "word":
            return _scalar(parts[0][1])
        return "".join(text for _, text in parts)

    def container(self, open_: str, close: str, items: Any) -> Any:
        self.take(open_)
        self.skip_ws()
        value = items()
        self.take(close)
        return value

    def list_items(self) -> list:
        out: list = []
        if self.peek() == "]":
            return out
        out.append(self.element(",]"))
        while self.peek() == ",":
            self.take(",")
            out.append(self.element(",]"))
        return out

    def dict_items(self) -> dict:
        out: dict = {}
        if self.peek() == "}":
            return out
        while True:
            self.skip_ws()
            if self.peek() not in ("word", "esc", "ws"):
                self.take("word")  # the error: a dict key is unquoted
            key = self.primitive(":")
            self.take(":")
            out[key] = self.element(",}")
            if self.peek() != ",":
                return out
            self.take(",")


def parse_override_value(text: str) -> Any:
    """The value of an override (what follows ``=``) as Hydra's override parser reads it.

    Raises:
        OverrideError: what Hydra would refuse (a character it does not allow unquoted, an unclosed
            bracket), a sweep (``a,b``: NeMo-RL's loader refuses sweeps), or a Hydra function.
    """
    parser = _Parser(text)
    if parser.peek() == "end" or all(kind == "ws" for kind, _ in parser.tokens):
        return ""
    value = parser.element(",")
    if parser.peek() == ",":
        raise OverrideError(
            f"{text!r} is a Hydra sweep (values separated by commas), which NeMo-RL's loader refuses; a list is "
            f"written [{text}], a string with a comma quoted ('{text}') or escaped (\\,)"
        )
    if parser.peek() != "end":
        raise OverrideError(f"the value does not parse as Hydra parses it: {parser.tokens[parser.i][1]!r} after it")
    return value
