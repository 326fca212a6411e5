"""The label_fields column of label.json_schema: a struct of the schema's top-level properties,
each typed from the schema, so that every part of a job has the same Arrow schema.

    string -> string    integer -> int64    number -> float64    boolean -> bool
    array  -> list of its items' type       object with properties -> struct of them
    enum / const -> the type all their values share     anyOf / a list of types -> the one
    non-null type they share. Anything else (mixed types, no type) -> string holding JSON text.

A required property is a non-nullable field unless its schema admits null (a "null" type, an
alternative, enum value or const that is null); an optional one is nullable; the whole struct is
null when the row failed. $ref into #/$defs (or #/definitions) is followed; a recursive one (a
tree whose nodes hold nodes) is typed as JSON text where it refers back to itself.
"""
from __future__ import annotations

import json
from functools import lru_cache

import pyarrow as pa

INT64 = (-(1 << 63), (1 << 63) - 1)
_SIMPLE = {"string": pa.string(), "integer": pa.int64(), "number": pa.float64(), "boolean": pa.bool_()}


def fields_type(schema: dict) -> pa.StructType:
    """The Arrow struct type of `schema`'s top-level properties, in their order."""
    return _cached(json.dumps(schema))  # not sorted: the fields keep the order of the properties


@lru_cache(maxsize=32)
def _cached(text: str) -> pa.StructType:
    schema = json.loads(text)
    return _struct(schema, schema)


def _struct(node: dict, root: dict, active: frozenset = frozenset()) -> pa.StructType:
    required = set(node.get("required") or [])
    return pa.struct([pa.field(name, arrow_type(prop, root, active),
                               nullable=name not in required or admits_null(prop, root))
                      for name, prop in node["properties"].items()])


def admits_null(node, root: dict, active: frozenset = frozenset()) -> bool:
    """Whether a (sub)schema accepts null: a null type, or an alternative, enum value or const null."""
    node, active = _deref(node, root, active)
    if not isinstance(node, dict):
        return False
    if "const" in node:
        return node["const"] is None
    if "enum" in node:
        return None in node["enum"]
    kind = node.get("type")
    if kind == "null" or (isinstance(kind, list) and "null" in kind):
        return True
    return any(admits_null(a, root, active) for a in node.get("anyOf") or node.get("oneOf") or [])


def arrow_type(node, root: dict, active: frozenset = frozenset()) -> pa.DataType:
    """The Arrow type of the values a (sub)schema accepts; pa.string() (JSON text) when mixed, or
    where a $ref refers back to a schema it is inside (`active`: the references being followed)."""
    node, active = _deref(node, root, active)
    if not isinstance(node, dict):
        return pa.string()
    if "const" in node:
        return _value_type([node["const"]])
    if "enum" in node:
        return _value_type(node["enum"])
    alternatives = node.get("anyOf") or node.get("oneOf")
    if alternatives:
        return _shared([arrow_type(a, root, active) for a in alternatives
                        if _deref(a, root, active)[0].get("type") != "null"])
    kind = node.get("type")
    if isinstance(kind, list):
        return _shared([arrow_type({**node, "type": k}, root, active) for k in kind if k != "null"])
    if kind in _SIMPLE:
        return _SIMPLE[kind]
    if kind == "array":
        items = node.get("items")
        if isinstance(items, dict):
            return pa.list_(arrow_type(items, root, active))
        prefix = node.get("prefixItems")
        return pa.list_(_shared([arrow_type(p, root, active) for p in prefix]) if prefix else pa.string())
    if kind == "object" or "properties" in node:
        return (_struct(node, root, active) if isinstance(node.get("properties"), dict) and node["properties"]
                else pa.string())
    return pa.string()


def _deref(node, root: dict, active: frozenset = frozenset()) -> tuple:
    """(the schema `node` refers to, the references followed so far); a reference already being
    followed resolves to {} (any JSON: typed as text)."""
    seen = 0
    while isinstance(node, dict) and isinstance(node.get("$ref"), str) and seen < 32:
        ref = node["$ref"]
        if ref in active:
            return {}, active
        active = active | {ref}
        parts = ref.removeprefix("#/").split("/") if ref.startswith("#/") else None
        target = root if ref == "#" else None if parts is None else root
        for part in parts or []:
            target = target.get(part) if isinstance(target, dict) else None
        if not isinstance(target, dict):
            return {}, active
        node, seen = target, seen + 1
    return node, active


def _value_type(values: list) -> pa.DataType:
    if values and all(isinstance(v, bool) for v in values):
        return pa.bool_()
    if values and all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        return pa.int64()
    if values and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        return pa.float64()
    return pa.string()


def _shared(types: list[pa.DataType]) -> pa.DataType:
    if types and all(t == types[0] for t in types):
        return types[0]
    if types and all(t in (pa.int64(), pa.float64()) for t in types):
        return pa.float64()
    return pa.string()


def field_values(obj: dict | None, dtype: pa.StructType) -> dict | None:
    """`obj`'s properties converted to `dtype` (JSON text where the type is string and the value is
    not). ValueError naming the property when a value does not fit (an integer beyond int64)."""
    if obj is None:
        return None
    return {f.name: _convert(obj.get(f.name), f.type, f.name) for f in dtype}


def _convert(value, dtype: pa.DataType, where: str):
    if value is None:
        return None
    if pa.types.is_string(dtype):
        return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))
    if pa.types.is_int64(dtype):
        if not isinstance(value, int) or isinstance(value, bool) or not INT64[0] <= value <= INT64[1]:
            raise ValueError(f"label_fields.{where}: {value!r} does not fit int64")
        return value
    if pa.types.is_float64(dtype):
        return float(value)
    if pa.types.is_boolean(dtype):
        return bool(value)
    if pa.types.is_list(dtype):
        return [_convert(v, dtype.value_type, f"{where}[{i}]") for i, v in enumerate(value)]
    if pa.types.is_struct(dtype):
        return {f.name: _convert(value.get(f.name), f.type, f"{where}.{f.name}") for f in dtype}
    return value
