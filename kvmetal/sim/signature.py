"""The Metal source MLX generates for an mx.fast.metal_kernel call.

A port of the signature writer of MLX 0.32 (mlx/fast.cpp, ``write_signature``),
so the simulator runs exactly the function a Mac would compile: same buffer
order, ``constant`` for inputs with fewer than 8 elements, ``&`` for scalars,
``<name>_shape/_strides/_ndim`` found by substring search of the body, and the
thread-position attributes found the same way (in MLX's order).
"""
from __future__ import annotations

import dataclasses
import re

import mlx.core as mx

MAX_CONSTANT_ARRAY_SIZE = 8

# (attribute, MSL type), in the order MLX writes them.
METAL_ATTRIBUTES = (
    ("dispatch_quadgroups_per_threadgroup", "uint"),
    ("dispatch_simdgroups_per_threadgroup", "uint"),
    ("dispatch_threads_per_threadgroup", "uint3"),
    ("grid_origin", "uint3"),
    ("grid_size", "uint3"),
    ("quadgroup_index_in_threadgroup", "uint"),
    ("quadgroups_per_threadgroup", "uint"),
    ("simdgroup_index_in_threadgroup", "uint"),
    ("simdgroups_per_threadgroup", "uint"),
    ("thread_execution_width", "uint"),
    ("thread_index_in_quadgroup", "uint"),
    ("thread_index_in_simdgroup", "uint"),
    ("thread_index_in_threadgroup", "uint"),
    ("thread_position_in_grid", "uint3"),
    ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"),
    ("threadgroups_per_grid", "uint3"),
    ("threads_per_grid", "uint3"),
    ("threads_per_simdgroup", "uint"),
    ("threads_per_threadgroup", "uint3"),
)

TYPE_STRINGS = {
    mx.bool_: "bool",
    mx.uint8: "uint8_t",
    mx.uint16: "uint16_t",
    mx.uint32: "uint32_t",
    mx.uint64: "uint64_t",
    mx.int8: "int8_t",
    mx.int16: "int16_t",
    mx.int32: "int32_t",
    mx.int64: "int64_t",
    mx.float16: "float16_t",
    mx.bfloat16: "bfloat16_t",
    mx.float32: "float",
    mx.complex64: "complex64_t",
}


def type_string(dtype) -> str:
    try:
        return TYPE_STRINGS[dtype]
    except KeyError:
        raise TypeError(f"[metal_kernel] unsupported dtype {dtype}") from None


@dataclasses.dataclass(frozen=True)
class InputSpec:
    """How one input is passed: what MLX's signature depends on."""

    name: str
    dtype: object
    ndim: int
    size: int

    @property
    def is_scalar(self) -> bool:
        return self.ndim == 0

    @property
    def is_constant(self) -> bool:
        return self.size < MAX_CONSTANT_ARRAY_SIZE


def shape_infos(source: str, input_names) -> list:
    """(has _shape, has _strides, has _ndim) per input: plain substring search, like MLX."""
    return [(f"{n}_shape" in source, f"{n}_strides" in source, f"{n}_ndim" in source) for n in input_names]


def attributes(source: str) -> list:
    """Thread-position attributes the body mentions (substring search, like MLX)."""
    return [(a, t) for a, t in METAL_ATTRIBUTES if a in source]


def template_value_string(value) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    return type_string(value)


def kernel_name(name: str, inputs, output_dtypes, template) -> str:
    """MLX's mangled name: custom_kernel_<name>[_<template>]_<input types>_<output types>."""
    out = "custom_kernel_" + name
    if template:
        tdef = "<" + ", ".join(template_value_string(v) for _, v in template) + ">"
        out += "_" + re.sub(r"<|>|, ", "_", tdef)[:-1]
    for spec in inputs:
        out += "_" + type_string(spec.dtype)
        if spec.is_scalar:
            out += "s"
        elif spec.is_constant:
            out += "c"
    for dt in output_dtypes:
        out += "_" + type_string(dt)
    return out


def template_param_kind(value) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    return "typename"


def write_source(func_name, header, source, inputs, output_names, output_dtypes, template, attrs, infos,
                 atomic_outputs) -> str:
    """The exact text MLX prints under verbose=True (header, signature, body, instantiation)."""
    s = header
    if template:
        s += "template <" + ", ".join(f"{template_param_kind(v)} {n}" for n, v in template) + ">\n"
    s += "[[kernel]] void " + func_name + "(\n"
    index = 0
    for spec, info in zip(inputs, infos):
        location = "constant" if spec.is_constant else "device"
        ref = "&" if spec.is_scalar else "*"
        s += f"  const {location} {type_string(spec.dtype)}{ref} {spec.name} [[buffer({index})]],\n"
        index += 1
        if spec.ndim > 0:
            if info[0]:
                s += f"  const constant int* {spec.name}_shape [[buffer({index})]],\n"
                index += 1
            if info[1]:
                s += f"  const constant int64_t* {spec.name}_strides [[buffer({index})]],\n"
                index += 1
            if info[2]:
                s += f"  const constant int& {spec.name}_ndim [[buffer({index})]],\n"
                index += 1
    for i, (oname, odt) in enumerate(zip(output_names, output_dtypes)):
        t = type_string(odt)
        if atomic_outputs:
            t = f"atomic<{t}>"
        s += f"  device {t}* {oname} [[buffer({index})]]"
        # MLX compares the running buffer index with len(inputs) + len(outputs) - 1.
        if index < len(inputs) + len(output_names) - 1 or attrs:
            s += ",\n"
        else:
            s += ") {\n"
        index += 1
    for k, (a, t) in enumerate(attrs):
        s += f"  {t} {a} [[{a}]]"
        s += ",\n" if k < len(attrs) - 1 else ") {\n"
    s += source
    s += "\n}\n"
    if template:
        tdef = func_name + "<" + ", ".join(template_value_string(v) for _, v in template) + ">"
        s += f'\ntemplate [[host_name("{func_name}")]] [[kernel]] decltype({tdef}) {tdef};\n'
    return s
