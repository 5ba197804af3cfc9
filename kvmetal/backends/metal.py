"""The metal backend: hand-written kernels in ``kernels/*.metal``, launched with
``mx.fast.metal_kernel``; and the sim backend: the very same launches built with
``kvmetal.sim.metal_kernel`` and run on the CPU.

Every kernel is described once below (:data:`SPECS`: name, family file, inputs,
outputs, template parameters, and grid/threadgroup as a function of the shapes).
A :class:`KernelBackend` turns the descriptions into kernel objects with one
``make_kernel`` function (MLX's or the simulator's), builds each specialisation
once per process and implements the five contract functions of
``kvmetal.backends``. Arguments arrive checked and normalised by ``kvmetal.ops``.

Dimension glossary: S sequences, B batch, H query heads, Hkv kv heads, G = H / Hkv,
D head_dim, N cache blocks, BS block size, M block-table width, T tokens.
"""
from __future__ import annotations

import functools
import math
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import mlx.core as mx

from .. import chips
from ..quant import QuantizedKV

# ----------------------------------------------------------------------------- tuning

SIMDGROUPS = 4                      # simdgroups per attention threadgroup (128 threads)
TILE_BYTES_BUDGET = 24 * 1024       # K + V float tiles in threadgroup memory
THREADGROUP_MEMORY_LIMIT = 32 * 1024
THREADS_PER_THREADGROUP_LIMIT = 1024
FALLBACK_GPU_CORES = 10             # base M-series GPU; used where Metal reports nothing
THREADGROUPS_PER_CORE = 8           # split-KV target occupancy
MIN_TOKENS_PER_SPLIT = 256          # below this a split costs more than it saves
MAX_SPLITS = 64

DTYPE_TAGS = {mx.float16: "f16", mx.bfloat16: "bf16", mx.float32: "f32", mx.uint32: "u32", mx.int32: "i32"}


def gpu_core_count() -> int:
    """GPU cores from ``mx.metal.device_info()`` (by chip name), else FALLBACK_GPU_CORES."""
    if not mx.metal.is_available():
        return FALLBACK_GPU_CORES
    info = mx.metal.device_info()
    for key in ("gpu_core_count", "num_gpu_cores", "core_count"):
        if isinstance(info.get(key), int) and info[key] > 0:
            return info[key]
    chip = chips.from_device_name(info.get("device_name", ""))
    return chip.gpu_cores if chip is not None else FALLBACK_GPU_CORES


def choose_num_splits(work_tokens: int, parallel_groups: int, *, cores: int | None = None) -> int:
    """KV splits per (sequence, kv head) so that the launch fills the GPU.

    Aims at THREADGROUPS_PER_CORE threadgroups per core across the
    ``parallel_groups`` (sequences x kv heads), but never gives a split fewer
    than MIN_TOKENS_PER_SPLIT of the ``work_tokens`` (an upper bound of the
    tokens one sequence attends to).
    """
    cores = gpu_core_count() if cores is None else cores
    wanted = math.ceil(THREADGROUPS_PER_CORE * cores / max(1, parallel_groups))
    useful = math.ceil(work_tokens / MIN_TOKENS_PER_SPLIT)
    return max(1, min(wanted, useful, MAX_SPLITS))


def tile_tokens(head_dim: int, block_size: int = 32) -> int:
    """Tokens per threadgroup tile: the K and V float tiles fit TILE_BYTES_BUDGET.

    A power of two no larger than the block size, so tiles never straddle blocks.
    """
    tokens = block_size
    while tokens > 1 and 2 * tokens * head_dim * 4 > TILE_BYTES_BUDGET:
        tokens //= 2
    return tokens


# ----------------------------------------------------------------------------- descriptions

@dataclass(frozen=True)
class Geometry:
    grid: tuple                 # threads, as mx.fast.metal_kernel counts them
    threadgroup: tuple
    threadgroup_bytes: int = 0  # static threadgroup memory the body declares

    @property
    def threads_per_threadgroup(self) -> int:
        return math.prod(self.threadgroup)

    @property
    def threadgroups(self) -> int:
        return math.prod(-(-g // t) for g, t in zip(self.grid, self.threadgroup))


@dataclass(frozen=True)
class KernelSpec:
    """One kernel, described once for the metal backend and the simulator."""

    name: str
    family: str                 # kernels/<family>.metal
    inputs: tuple
    outputs: tuple
    template: tuple             # template parameter names, in order
    geometry: Callable          # (**shape) -> Geometry
    row_contiguous: bool = True  # False: the body reads <input>_strides

    def variant(self, template_values: dict) -> str:
        """The kernel name spelled with its specialisation (shown by verbose=True and GPU captures)."""
        parts = []
        for key in self.template:
            value = template_values[key]
            if isinstance(value, mx.Dtype):
                parts.append(f"{key.lower()}{DTYPE_TAGS[value]}")
            else:
                parts.append(f"{key.lower()}{int(value)}")
        return "kvmetal_" + self.name + "_" + "_".join(parts)


def _attention_geometry(*, splits, num_kv_heads, num_seqs, head_dim, tile):
    return Geometry(grid=(splits * SIMDGROUPS * 32, num_kv_heads, num_seqs),
                    threadgroup=(SIMDGROUPS * 32, 1, 1),
                    threadgroup_bytes=4 * (2 * tile * head_dim + SIMDGROUPS * (head_dim + 4)))


_ATTENTION_TEMPLATE = ("TK", "TV", "D", "G", "TT", "NSG", "KBITS", "KGS", "VBITS", "VGS")
_KV_INPUTS = ("key_data", "key_scales", "key_biases", "value_data", "value_scales", "value_biases")
_PARTIALS = ("part_max", "part_sum", "part_acc")

SPECS = {
    spec.name: spec
    for spec in (
        KernelSpec("paged_attention_partials", "attention",
                   ("query",) + _KV_INPUTS + ("block_tables", "seq_lens", "scalars", "dims"), _PARTIALS,
                   _ATTENTION_TEMPLATE[:4] + ("BS",) + _ATTENTION_TEMPLATE[4:], _attention_geometry),
        KernelSpec("decode_attention_partials", "attention",
                   ("query",) + _KV_INPUTS + ("scalars", "dims"), _PARTIALS,
                   _ATTENTION_TEMPLATE, _attention_geometry, row_contiguous=False),
        KernelSpec("attention_reduce", "attention",
                   _PARTIALS + ("sinks", "dims"), ("out",), ("TQ", "D", "HAS_SINKS"),
                   lambda *, rows: Geometry(grid=(rows * 32, 1, 1), threadgroup=(32, 1, 1))),
        KernelSpec("cache_rows_convert", "cache_write", ("new_rows", "src_token"), ("rows_out",),
                   ("TC", "D"),
                   lambda *, tokens, num_kv_heads, head_dim: Geometry(
                       grid=(head_dim // 4, num_kv_heads, tokens), threadgroup=(head_dim // 4, 1, 1))),
        KernelSpec("cache_rows_quantize", "cache_write", ("new_rows", "src_token"),
                   ("words_out", "scales_out", "biases_out"), ("TC", "D", "BITS", "GS"),
                   lambda *, tokens, num_kv_heads, groups: Geometry(
                       grid=(groups, num_kv_heads, tokens), threadgroup=(groups, 1, 1))),
        KernelSpec("gather_kv_rows", "cache_copy",
                   ("cache_data", "cache_scales", "cache_biases", "block_tables", "seq_lens", "dims"),
                   ("rows_out",), ("TE", "D", "BS", "BITS", "GS"),
                   lambda *, tasks, max_len, num_rows: Geometry(
                       grid=(tasks, max_len, num_rows), threadgroup=(tasks, 1, 1))),
        KernelSpec("copy_blocks_gather", "cache_copy", ("blocks", "src"), ("blocks_out",), ("T",),
                   lambda *, width, count: Geometry(grid=(width, count, 1),
                                                    threadgroup=(_largest_pow2_divisor(width, 256), 1, 1))),
    )
}


def _largest_pow2_divisor(n: int, cap: int) -> int:
    d = 1
    while d * 2 <= cap and n % (d * 2) == 0:
        d *= 2
    return d


# ----------------------------------------------------------------------------- sources

def kernel_dirs() -> list:
    """Where the .metal files live: inside the installed package, then the source tree."""
    here = Path(__file__).resolve().parent.parent
    return [here / "kernels", here.parent / "kernels"]


def _find(filename: str) -> Path:
    for directory in kernel_dirs():
        if (directory / filename).is_file():
            return directory / filename
    raise FileNotFoundError(f"[metal] {filename} not found in {[str(d) for d in kernel_dirs()]}")


_KERNEL_MARK = re.compile(r"^//@kernel\s+(\w+)\s*$", re.M)


@functools.lru_cache(maxsize=None)
def family_source(family: str) -> tuple:
    """(helper section, {kernel name: body}) of ``kernels/<family>.metal``."""
    text = _find(f"{family}.metal").read_text()
    marks = list(_KERNEL_MARK.finditer(text))
    helpers = text[: marks[0].start()] if marks else text
    bodies = {}
    for i, mark in enumerate(marks):
        end = marks[i + 1].start() if i + 1 < len(marks) else len(text)
        bodies[mark.group(1)] = text[mark.end():end].strip("\n") + "\n"
    return helpers, bodies


@functools.lru_cache(maxsize=None)
def kernel_text(name: str) -> tuple:
    """(header, body) handed to metal_kernel for the kernel ``name``."""
    spec = SPECS[name]
    helpers, bodies = family_source(spec.family)
    if name not in bodies:
        raise KeyError(f"[metal] kernels/{spec.family}.metal has no '//@kernel {name}' body")
    common = _find("kvmetal_common.h").read_text()
    return common + "\n" + helpers, bodies[name]


# ----------------------------------------------------------------------------- helpers

def _cache_parts(cache):
    """(data, scales, biases, element dtype, bits, group size) of one K or V cache.

    A float cache gets 8-element placeholders for scales/biases: never read, and
    large enough that MLX binds them as `device` buffers like real ones (inputs
    under 8 elements go to `constant`). They are 4-D so that `<name>_strides`
    has the four entries the strided kernels index.
    """
    if isinstance(cache, QuantizedKV):
        return cache.data, cache.scales, cache.biases, cache.scales.dtype, cache.bits, cache.group_size
    placeholder = _placeholder(cache.dtype)
    return cache, placeholder, placeholder, cache.dtype, 0, 32


@functools.lru_cache(maxsize=None)
def _placeholder_cached(dtype_tag: str):
    dtype = {v: k for k, v in DTYPE_TAGS.items()}[dtype_tag]
    return mx.zeros((1, 1, 1, 8), dtype=dtype)


def _placeholder(dtype):
    return _placeholder_cached(DTYPE_TAGS[dtype])


def _int_params(*values) -> mx.array:
    """An int32 parameter vector padded to 8 entries (a `device` buffer, as above)."""
    return mx.array(list(values) + [0] * (8 - len(values)), dtype=mx.int32)


def _float_params(*values) -> mx.array:
    return mx.array(list(values) + [0.0] * (8 - len(values)), dtype=mx.float32)


def _logical_shape(cache) -> tuple:
    return tuple(cache.shape)


def _scatter_rows(array: mx.array, row_index: mx.array, rows: mx.array) -> mx.array:
    """``array`` viewed as [rows, width] with ``rows`` written at ``row_index``.

    An MLX scatter: it runs in place (buffer donation) when ``array`` has no other
    reference by the time it is evaluated, i.e. when the caller rebinds the result.
    """
    width = array.shape[-1]
    flat = array.reshape(-1, width)
    flat[row_index] = rows.reshape(-1, width)
    return flat.reshape(array.shape)


# ----------------------------------------------------------------------------- backend

class KernelBackend:
    """The five contract functions over SPECS, with kernels made by ``make_kernel``."""

    def __init__(self, name: str, make_kernel: Callable, *, call_options: Callable | None = None):
        self.name = name
        self._make_kernel = make_kernel
        self._call_options = call_options or (lambda: {})
        self._kernels = {}
        self._lock = threading.Lock()

    # -- building and launching

    def kernel(self, spec: KernelSpec, template_values: dict):
        """The kernel object of one specialisation, built once per process."""
        variant = spec.variant(template_values)
        with self._lock:
            if variant not in self._kernels:
                header, body = kernel_text(spec.name)
                self._kernels[variant] = self._make_kernel(
                    name=variant, input_names=list(spec.inputs), output_names=list(spec.outputs),
                    source=body, header=header, ensure_row_contiguous=spec.row_contiguous)
            return self._kernels[variant]

    def launch(self, name: str, inputs: list, template_values: dict, geometry: Geometry,
               output_shapes: list, output_dtypes: list) -> list:
        spec = SPECS[name]
        kernel = self.kernel(spec, template_values)
        return kernel(inputs=inputs, template=[(k, template_values[k]) for k in spec.template],
                      grid=geometry.grid, threadgroup=geometry.threadgroup,
                      output_shapes=output_shapes, output_dtypes=output_dtypes, **self._call_options())

    # -- writes

    def reshape_and_cache(self, key, value, key_cache, value_cache, slot_mapping):
        num_tokens = key.shape[0]
        # Padding tokens repeat the first real token's row and slot, so the scatter
        # needs no mask. ops.reshape_and_cache returns early when no slot is real (or,
        # with validate=False, its caller promises one is): no host sync here.
        if num_tokens == 0:
            return key_cache, value_cache
        valid = slot_mapping >= 0
        first = mx.argmax(valid.astype(mx.int32))
        src_token = mx.where(valid, mx.arange(num_tokens, dtype=mx.int32), first.astype(mx.int32))
        slots = mx.where(valid, slot_mapping, slot_mapping[first])
        _, num_kv_heads, block_size, _ = _logical_shape(key_cache)
        block, offset = slots // block_size, slots % block_size
        heads = mx.arange(num_kv_heads, dtype=mx.int32)
        row_index = ((block[:, None] * num_kv_heads + heads[None, :]) * block_size + offset[:, None]).reshape(-1)
        return (self._write_rows(key, key_cache, src_token, row_index),
                self._write_rows(value, value_cache, src_token, row_index))

    def _write_rows(self, rows, cache, src_token, row_index):
        num_tokens, num_kv_heads, head_dim = rows.shape
        if not isinstance(cache, QuantizedKV):
            template = dict(TC=cache.dtype, D=head_dim)
            geometry = SPECS["cache_rows_convert"].geometry(tokens=num_tokens, num_kv_heads=num_kv_heads,
                                                            head_dim=head_dim)
            (converted,) = self.launch("cache_rows_convert", [rows, src_token], template, geometry,
                                       [rows.shape], [cache.dtype])
            return _scatter_rows(cache, row_index, converted)
        groups = head_dim // cache.group_size
        template = dict(TC=cache.dtype, D=head_dim, BITS=cache.bits, GS=cache.group_size)
        geometry = SPECS["cache_rows_quantize"].geometry(tokens=num_tokens, num_kv_heads=num_kv_heads,
                                                         groups=groups)
        words, scales, biases = self.launch(
            "cache_rows_quantize", [rows, src_token], template, geometry,
            [(num_tokens, num_kv_heads, head_dim * cache.bits // 32), (num_tokens, num_kv_heads, groups),
             (num_tokens, num_kv_heads, groups)],
            [mx.uint32, cache.dtype, cache.dtype])
        return cache.replace(_scatter_rows(cache.data, row_index, words),
                             _scatter_rows(cache.scales, row_index, scales),
                             _scatter_rows(cache.biases, row_index, biases))

    def copy_blocks(self, key_cache, value_cache, src, dst):
        return self._copy(key_cache, src, dst), self._copy(value_cache, src, dst)

    def _copy(self, cache, src, dst):
        if isinstance(cache, QuantizedKV):
            return cache.replace(*(self._copy(part, src, dst) for part in cache.arrays()))
        if src.shape[0] == 0:
            return cache
        blocks = cache.reshape(cache.shape[0], -1)
        width = blocks.shape[1]
        geometry = SPECS["copy_blocks_gather"].geometry(width=width, count=src.shape[0])
        (copied,) = self.launch("copy_blocks_gather", [blocks, src], dict(T=cache.dtype), geometry,
                                [(src.shape[0], width)], [cache.dtype])
        return _scatter_rows(blocks, dst, copied).reshape(cache.shape)

    # -- reads

    def gather_kv_cache(self, key_cache, value_cache, block_tables, seq_lens, *, max_len):
        return (self._gather(key_cache, block_tables, seq_lens, max_len),
                self._gather(value_cache, block_tables, seq_lens, max_len))

    def _gather(self, cache, block_tables, seq_lens, max_len):
        _, num_kv_heads, block_size, head_dim = _logical_shape(cache)
        data, scales, biases, dtype, bits, group_size = _cache_parts(cache)
        num_seqs, max_blocks = block_tables.shape
        tasks = head_dim // group_size if bits else head_dim // 4
        template = dict(TE=dtype, D=head_dim, BS=block_size, BITS=bits, GS=group_size)
        geometry = SPECS["gather_kv_rows"].geometry(tasks=tasks, max_len=max_len,
                                                    num_rows=num_seqs * num_kv_heads)
        (rows,) = self.launch("gather_kv_rows",
                              [data, scales, biases, block_tables, seq_lens,
                               _int_params(num_kv_heads, max_blocks, max_len)],
                              template, geometry, [(num_seqs, num_kv_heads, max_len, head_dim)], [dtype])
        return rows

    # -- attention

    def paged_attention(self, query, key_cache, value_cache, block_tables, seq_lens, *, scale, softcap,
                        sliding_window, sinks, num_splits):
        num_seqs, num_heads, head_dim = query.shape
        _, num_kv_heads, block_size, _ = _logical_shape(key_cache)
        max_blocks = block_tables.shape[1]
        tile = tile_tokens(head_dim, block_size)
        work = max_blocks * block_size
        if sliding_window is not None:
            work = min(work, sliding_window + block_size)
        splits = self._splits(num_splits, work, num_seqs * num_kv_heads, tile)
        kd, ks, kb, kdt, kbits, kgs = _cache_parts(key_cache)
        vd, vs, vb, vdt, vbits, vgs = _cache_parts(value_cache)
        template = dict(TK=kdt, TV=vdt, D=head_dim, G=num_heads // num_kv_heads, BS=block_size, TT=tile,
                        NSG=SIMDGROUPS, KBITS=kbits, KGS=kgs, VBITS=vbits, VGS=vgs)
        dims = _int_params(num_kv_heads, max_blocks, sliding_window or 0, splits, num_heads)
        geometry = SPECS["paged_attention_partials"].geometry(
            splits=splits, num_kv_heads=num_kv_heads, num_seqs=num_seqs, head_dim=head_dim, tile=tile)
        partials = self.launch("paged_attention_partials",
                               [query, kd, ks, kb, vd, vs, vb, block_tables, seq_lens,
                                _float_params(scale, softcap or 0.0), dims],
                               template, geometry, *self._partial_outputs(num_seqs, num_heads, splits, head_dim))
        return self._reduce(partials, sinks, dims, query.dtype, (num_seqs, num_heads, head_dim))

    def decode_attention(self, query, keys, values, *, scale, softcap, sinks, num_splits):
        batch, num_heads, _, head_dim = query.shape
        _, num_kv_heads, num_tokens, _ = _logical_shape(keys)
        tile = tile_tokens(head_dim)
        splits = self._splits(num_splits, num_tokens, batch * num_kv_heads, tile)
        kd, ks, kb, kdt, kbits, kgs = _cache_parts(keys)
        vd, vs, vb, vdt, vbits, vgs = _cache_parts(values)
        template = dict(TK=kdt, TV=vdt, D=head_dim, G=num_heads // num_kv_heads, TT=tile,
                        NSG=SIMDGROUPS, KBITS=kbits, KGS=kgs, VBITS=vbits, VGS=vgs)
        dims = _int_params(num_kv_heads, num_tokens, 0, splits, num_heads)
        geometry = SPECS["decode_attention_partials"].geometry(
            splits=splits, num_kv_heads=num_kv_heads, num_seqs=batch, head_dim=head_dim, tile=tile)
        # The kernel reads K/V views in place through their strides; the small
        # query is made row-contiguous here instead.
        partials = self.launch("decode_attention_partials",
                               [mx.contiguous(query), kd, ks, kb, vd, vs, vb,
                                _float_params(scale, softcap or 0.0), dims],
                               template, geometry, *self._partial_outputs(batch, num_heads, splits, head_dim))
        return self._reduce(partials, sinks, dims, query.dtype, tuple(query.shape))

    @staticmethod
    def _splits(requested, work_tokens, parallel_groups, tile):
        if requested is not None:
            return requested
        return max(1, min(choose_num_splits(work_tokens, parallel_groups), -(-work_tokens // tile)))

    @staticmethod
    def _partial_outputs(rows, num_heads, splits, head_dim):
        return ([(rows, num_heads, splits), (rows, num_heads, splits), (rows, num_heads, splits, head_dim)],
                [mx.float32, mx.float32, mx.float32])

    def _reduce(self, partials, sinks, dims, dtype, out_shape):
        rows = out_shape[0] * out_shape[1]
        head_dim = out_shape[-1]
        template = dict(TQ=dtype, D=head_dim, HAS_SINKS=sinks is not None)
        geometry = SPECS["attention_reduce"].geometry(rows=rows)
        sink_input = sinks if sinks is not None else _placeholder(mx.float32)
        (out,) = self.launch("attention_reduce", [*partials, sink_input, dims], template, geometry,
                             [(rows, head_dim)], [dtype])
        return out.reshape(out_shape)


# ----------------------------------------------------------------------------- entry points

_backends = {}
_backends_lock = threading.Lock()


def metal_backend() -> KernelBackend:
    """The kernels compiled by MLX for the Apple GPU (built once per process)."""
    with _backends_lock:
        if "metal" not in _backends:
            _backends["metal"] = KernelBackend("metal", mx.fast.metal_kernel)
        return _backends["metal"]


def sim_backend() -> KernelBackend:
    """The same kernel descriptions run by the CPU simulator (``kvmetal.sim``)."""
    with _backends_lock:
        if "sim" not in _backends:
            from .. import sim

            _backends["sim"] = KernelBackend("sim", sim.metal_kernel)
        return _backends["sim"]
