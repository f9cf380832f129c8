"""kubectl's JSONPath templates (`-o jsonpath='{.items[*].metadata.name}'`), the subset kubectl documents.

Text outside braces is copied; inside braces: an expression (`.a.b`, `['a.b']`, `[0]`, `[-1]`, `[1:3]`,
`[*]`, `.*`, `..name`, `[?(@.x == "y")]`, `$` the root, `@` the current object), a string literal
(`{"\\n"}`), or `{range EXPR}...{end}` which evaluates its body once per result with that result as the
current object. As with `kubectl get -o jsonpath`, missing keys print nothing; several results are
joined by a space; maps and lists print as JSON.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from kubectl_snapshot.core.errors import InvalidArgument

_HINT = "see https://kubernetes.io/docs/reference/kubectl/jsonpath/ (e.g. -o jsonpath='{.metadata.name}')"


@dataclass(frozen=True)
class _Node:
    kind: str  # text | expr | range
    text: str = ""
    steps: tuple[tuple[str, Any], ...] = ()
    body: tuple[_Node, ...] = ()


def _actions(template: str) -> Iterator[tuple[str, str]]:
    """('text', s) and ('action', s) pieces; braces inside quoted strings do not count."""
    i, n = 0, len(template)
    while i < n:
        start = template.find("{", i)
        if start < 0:
            yield "text", template[i:]
            return
        if start > i:
            yield "text", template[i:start]
        j, quote = start + 1, ""
        while j < n:
            c = template[j]
            if quote:
                if c == "\\":
                    j += 1
                elif c == quote:
                    quote = ""
            elif c in "\"'":
                quote = c
            elif c == "}":
                break
            j += 1
        if j >= n:
            raise InvalidArgument(f"jsonpath template {template!r}: unclosed '{{'", hint=_HINT)
        yield "action", template[start + 1 : j].strip()
        i = j + 1


_STEP = re.compile(
    r"""\.\.(?P<rec>[A-Za-z0-9_\-$]+|\*)      # ..name
      | \.(?P<field>[A-Za-z0-9_\-$/]+)          # .name
      | \.(?P<wild>\*)                          # .*
      | \[\s*(?P<q>'(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*")\s*\]   # ['name']
      | \[\s*(?P<star>\*)\s*\]                  # [*]
      | \[\s*(?P<slice>-?\d*\s*:\s*-?\d*)\s*\]  # [a:b]
      | \[\s*(?P<index>-?\d+)\s*\]              # [n]
      | \[\s*\?\((?P<filter>.*?)\)\s*\]         # [?(...)]
    """,
    re.VERBOSE,
)
_FILTER = re.compile(r"^\s*(?P<path>@[^=!<>]*?)\s*(?:(?P<op>==|!=|<=|>=|<|>)\s*(?P<value>.+?))?\s*$")


def _unquote(text: str) -> str:
    try:
        value = json.loads('"' + text[1:-1].replace('\\"', '"').replace('"', '\\"') + '"')
    except ValueError:
        value = text[1:-1]
    return str(value)


def _steps(expr: str, template: str) -> tuple[tuple[str, Any], ...]:
    text = expr.strip()
    steps: list[tuple[str, Any]] = []
    if text.startswith("$"):
        steps.append(("root", None))
        text = text[1:]
    elif text.startswith("@"):
        text = text[1:]
    elif text and text[0] not in ".[":
        text = "." + text
    pos = 0
    while pos < len(text):
        m = _STEP.match(text, pos)
        if not m:
            raise InvalidArgument(f"jsonpath template {template!r}: cannot parse {text[pos:]!r}", hint=_HINT)
        if m.group("rec") is not None:
            steps.append(("recursive", m.group("rec")))
        elif m.group("field") is not None:
            steps.append(("field", m.group("field")))
        elif m.group("wild") is not None or m.group("star") is not None:
            steps.append(("all", None))
        elif m.group("q") is not None:
            steps.append(("field", _unquote(m.group("q"))))
        elif m.group("slice") is not None:
            a, b = (p.strip() for p in m.group("slice").split(":"))
            steps.append(("slice", (int(a) if a else None, int(b) if b else None)))
        elif m.group("index") is not None:
            steps.append(("index", int(m.group("index"))))
        else:
            fm = _FILTER.match(m.group("filter"))
            if not fm:
                raise InvalidArgument(f"jsonpath template {template!r}: bad filter {m.group('filter')!r}", hint=_HINT)
            value: Any = None
            if fm.group("value") is not None:
                raw = fm.group("value").strip()
                value = _unquote(raw) if raw[:1] in "\"'" else json.loads(raw) if _is_json(raw) else raw
            steps.append(("filter", (_steps(fm.group("path"), template), fm.group("op"), value)))
        pos = m.end()
    return tuple(steps)


def _is_json(raw: str) -> bool:
    try:
        json.loads(raw)
    except ValueError:
        return False
    return True


def parse(template: str) -> tuple[_Node, ...]:
    stack: list[list[_Node]] = [[]]
    ranges: list[tuple[tuple[str, Any], ...]] = []
    for kind, piece in _actions(template):
        if kind == "text":
            stack[-1].append(_Node("text", text=piece))
        elif piece.startswith("range ") or piece == "range":
            ranges.append(_steps(piece[len("range") :], template))
            stack.append([])
        elif piece == "end":
            if not ranges:
                raise InvalidArgument(f"jsonpath template {template!r}: {{end}} without {{range}}", hint=_HINT)
            body = stack.pop()
            stack[-1].append(_Node("range", steps=ranges.pop(), body=tuple(body)))
        elif piece[:1] in "\"'" and piece[-1:] == piece[:1] and len(piece) >= 2:
            stack[-1].append(_Node("text", text=_unquote(piece)))
        elif piece == "":
            continue
        else:
            stack[-1].append(_Node("expr", steps=_steps(piece, template)))
    if ranges:
        raise InvalidArgument(f"jsonpath template {template!r}: {{range}} without {{end}}", hint=_HINT)
    return tuple(stack[0])


def _walk(values: list[Any], steps: tuple[tuple[str, Any], ...], root: Any) -> list[Any]:
    for op, arg in steps:
        out: list[Any] = []
        for v in values:
            if op == "root":
                out.append(root)
            elif op == "field":
                if isinstance(v, dict) and arg in v:
                    out.append(v[arg])
            elif op == "all":
                out.extend(v.values() if isinstance(v, dict) else v if isinstance(v, list) else [])
            elif op == "index":
                if isinstance(v, list) and -len(v) <= arg < len(v):
                    out.append(v[arg])
            elif op == "slice":
                if isinstance(v, list):
                    out.extend(v[arg[0] : arg[1]])
            elif op == "recursive":
                out.extend(_descend(v, arg))
            elif op == "filter":
                path, cmp, want = arg
                for item in v if isinstance(v, list) else v.values() if isinstance(v, dict) else []:
                    got = _walk([item], path, root)
                    if (cmp is None and got) or (got and _compare(got[0], cmp, want)):
                        out.append(item)
        values = out
    return values


def _descend(v: Any, name: str) -> Iterator[Any]:
    if isinstance(v, dict):
        if name == "*":
            yield from v.values()
        elif name in v:
            yield v[name]
        for child in v.values():
            yield from _descend(child, name)
    elif isinstance(v, list):
        for child in v:
            if name == "*":
                yield child
            yield from _descend(child, name)


def _compare(got: Any, op: str, want: Any) -> bool:
    try:
        if op == "==":
            return bool(got == want)
        if op == "!=":
            return bool(got != want)
        if op == "<":
            return bool(got < want)
        if op == ">":
            return bool(got > want)
        if op == "<=":
            return bool(got <= want)
        return bool(got >= want)
    except TypeError:
        return False


def _text(v: Any) -> str:
    if isinstance(v, str):
        return v
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return ""
    if isinstance(v, dict | list):
        return json.dumps(v, separators=(",", ":"))
    return str(v)


def _render(nodes: tuple[_Node, ...], current: Any, root: Any) -> str:
    out: list[str] = []
    for node in nodes:
        if node.kind == "text":
            out.append(node.text)
        elif node.kind == "expr":
            out.append(" ".join(_text(v) for v in _walk([current], node.steps, root)))
        else:
            for item in _walk([current], node.steps, root):
                out.append(_render(node.body, item, root))
    return "".join(out)


def render(template: str, data: Any) -> str:
    """Evaluate a kubectl JSONPath template against `data` (a JSON-like object)."""
    return _render(parse(template), data, data)


def values(template: str, data: Any) -> list[Any]:
    """The results of a template's expressions as JSON values (`-o jsonpath-as-json=...`)."""
    out: list[Any] = []

    def collect(nodes: tuple[_Node, ...], current: Any) -> None:
        for node in nodes:
            if node.kind == "expr":
                out.extend(_walk([current], node.steps, data))
            elif node.kind == "range":
                for item in _walk([current], node.steps, data):
                    collect(node.body, item)

    collect(parse(template), data)
    return out
