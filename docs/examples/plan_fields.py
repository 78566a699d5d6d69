"""Print the fields of a routing plan as the code defines them: the plan contract.

Run: ``python docs/examples/plan_fields.py`` (docs/concepts.md shows its output).
"""

from __future__ import annotations

import textwrap
import types
import typing

from pydantic import BaseModel

from knapformer.contract.plan import READABLE_SCHEMA_VERSIONS, SCHEMA_VERSION, RoutingPlan

NAME_WIDTH = 22
TYPE_WIDTH = 22


def type_name(annotation: typing.Any, metadata: list[typing.Any]) -> str:
    """``int | None``, ``list[int]``, ``1 | 2``, ``int[]`` for a column of integers."""
    for item in metadata:  # columns carry the JSON Schema of their items
        schema = getattr(item, "json_schema", None)
        if schema and schema.get("type") == "array":
            return {"integer": "int", "number": "float"}[schema["items"]["type"]] + "[]"
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:  # checked text and the like: the type they annotate
        return type_name(args[0], list(args[1:]))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a, []) for a in args)
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in args)
    if origin is not None:
        return f"{origin.__name__}[{', '.join(type_name(a, []) for a in args)}]"
    if annotation is type(None):
        return "None"
    if annotation is typing.Any:
        return "Any"
    return annotation.__name__


def nested_model(annotation: typing.Any) -> type[BaseModel] | None:
    """The model inside ``annotation`` (``Sequences``, ``Measurements | None``), if any."""
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def field_lines(model: type[BaseModel], prefix: str = "") -> list[str]:
    """One line per field (nested models indented under their field), descriptions
    wrapped under the line."""
    lines = []
    for name, info in model.model_fields.items():
        kind = type_name(info.annotation, info.metadata)
        head = f"  {prefix}{name}".ljust(NAME_WIDTH) + " " + kind.ljust(TYPE_WIDTH)
        text = info.description or ""
        wrapped = textwrap.wrap(text, 100 - len(head) - 1) or [""]
        lines.append(f"{head} {wrapped[0]}".rstrip())
        lines += [" " * (len(head) + 1) + more for more in wrapped[1:]]
        inner = nested_model(info.annotation)
        if inner is not None:
            lines += field_lines(inner, prefix + "  ")
    return lines


def main() -> None:
    readable = ", ".join(str(v) for v in READABLE_SCHEMA_VERSIONS)
    print(f"RoutingPlan, schema version {SCHEMA_VERSION} (readers accept versions {readable})")
    print("\n".join(field_lines(RoutingPlan)))


if __name__ == "__main__":
    main()
