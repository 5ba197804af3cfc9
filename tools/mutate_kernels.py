#!/usr/bin/env python3
"""Kernel mutation score: apply one-token mutations to kernels/*.metal, one at a time,
and run the simulator kernel tests against each; a mutant is killed when a test fails.

    python tools/mutate_kernels.py                      # every mutant, table on stdout
    python tools/mutate_kernels.py --write report.md    # also write the table
    python tools/mutate_kernels.py --only causal- --list

Each mutant replaces one snippet of one kernel file (off-by-ones in the causal, window
and split bounds, a dropped rescale, swapped K/V scale and bias, a wrong shuffle offset,
a skipped merge term, a wrong group index, a bare fast-math tanh, quantizer and packing
slips...). The mutated copy of kernels/ goes to a temporary directory and a small pytest
plugin points ``kvmetal.backends.metal_specs.kernel_dirs`` at it, so the installed package is
untouched.

A mutant is run against every kernel family its file reaches, each on its own: the
families are those of ``kvmetal.backends.metal_specs.SPECS`` (a kernel's family is its file
in kernels/; a family whose kernels ``use`` another's helper section is reached by that
file too; kvmetal_common.h reaches them all), so a new kernel family gets mutants' runs
without editing a list here. The tests are tests/test_sim_kernel_mutants.py and
tests/test_metal_rules.py, narrowed with ``-k <family>``, run with ``-x``: the first
failure kills the mutant for that family. The table gives a mutation score per family.
A mutant no test can kill is a survivor: kill it with a new test, or list it in
EQUIVALENT with the reason it cannot change any output.

Run it from the repository root with kvmetal installed (``pip install .``); it needs
g++ (the simulator) and takes about 20-60 s per mutant on a quiet 2-core machine.
Not part of CI.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEST_MODULES = ["tests/test_sim_kernel_mutants.py", "tests/test_metal_rules.py"]
COMMON_HEADER = "kvmetal_common.h"


def families_reached(file: str) -> list:
    """The kernel families (kernels/<family>.metal) whose kernels a mutation of ``file`` reaches."""
    sys.path.insert(0, str(ROOT))
    from kvmetal.backends.metal_specs import SPECS

    families = sorted({spec.family for spec in SPECS.values()})
    if file == COMMON_HEADER:
        return families
    family = file.rsplit(".", 1)[0]
    users = {spec.family for spec in SPECS.values() if family in spec.uses}
    return sorted({family} | users)


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str
    old: str
    new: str
    what: str


M = Mutant
MUTANTS = [
    # --- attention.metal: bounds
    M("window-first", "attention.metal", "kv_first_visible(len - L, window)", "kv_first_visible(len - L + 1, window)",
      "split range starts one token inside the window"),
    M("tile-unit-halves", "attention.metal", "y[U4 - 1] = as_type<half4>(w.zw);", "y[U4 - 1] = as_type<half4>(w.xy);",
      "shared tile atom: a 16-byte unit's second half4 read as its first"),
    M("tile-unit-odd", "attention.metal", "y[0] = on ? x[u] : half4(static_cast<half>(0.0f));",
      "y[0] = on ? x[u + 1] : half4(static_cast<half>(0.0f));", "shared tile atom: a one-half4 unit read one ahead"),
    M("window-grow-short", "attention.metal", "div = split_div * split_grow;", "div = split_div * split_grow * 2;",
      "grown windows shorter than the host's split count covers (keys dropped)"),
    M("window-grow-none", "attention.metal", "div = split_div * split_grow;", "div = split_div;",
      "windows never take the growth (longer than the host's rule: fewer, longer windows)"),
    M("split-hi", "attention.metal", "r.hi = min(len, begin + per);", "r.hi = min(len - 1, begin + per);",
      "split range drops the last token"),
    M("split-per", "attention.metal", "(units + num_splits - 1) / num_splits * 32", "units / num_splits * 32",
      "split length rounds down (tokens fall between splits)"),
    M("len-clamp", "attention.metal", "clamp(seq_lens[seq], 0, p.max_blocks * BS)",
      "clamp(seq_lens[seq], 1, p.max_blocks * BS)", "an empty sequence reads one token"),
    M("decode-len", "attention.metal", "const int len = p.num_tokens;", "const int len = p.num_tokens - 1;",
      "contiguous decode drops the last key"),
    # --- attention.metal: online softmax and merges
    M("rescale-l", "attention.metal", "st.l[r] *= correction;", ";", "dropped rescale of the running sum"),
    M("rescale-o", "attention.metal", "st.o[r][c][j] *= correction;", ";",
      "dropped rescale of the accumulator"),
    M("rescale-ob", "attention.metal", "st.ob[r][c] *= correction;", ";",
      "dropped rescale of the V-bias accumulator"),
    M("k-scale-bias", "attention.metal", "k.sb[c].x * d[r] + mid_bias * st.qsum[r][c]",
      "k.sb[c].y * d[r] + mid_bias * st.qsum[r][c]", "K scale read from the bias"),
    M("k-mid-bias", "attention.metal", "k.sb[c].y + k.sb[c].x * float(1 << (KBITS - 1))",
      "k.sb[c].x + k.sb[c].y * float(1 << (KBITS - 1))", "centred K's bias built with scale and bias swapped"),
    M("v-scale", "attention.metal", "p[r] * v.sb[c].x : p[r];", "p[r] * v.sb[c].y : p[r];",
      "V scale read from the bias"),
    M("v-bias", "attention.metal", "VBITS ? v.sb[c].y + v.sb[c].x * float(1 << (VBITS - 1))",
      "VBITS ? v.sb[c].x + v.sb[c].y * float(1 << (VBITS - 1))", "V bias read from the scale (centred V's bias)"),
    M("v-mid-bias", "attention.metal", "v.sb[c].x * float(1 << (VBITS - 1)) : 0.0f;",
      "v.sb[c].x * float(1 << VBITS) : 0.0f;", "centred V's bias adds twice the mid it took off"),
    M("dot-shuffle", "attention.metal", "for (int off = 1 << RSP::H; off < LPK; off <<= 1) {\n      x +=",
      "for (int off = 2 << RSP::H; off < LPK; off <<= 1) {\n      x +=", "dot-product sum skips its first step past the row split"),
    M("rowsplit-keep", "attention.metal", "s[i] = (up ? hi : lo) + simd_shuffle_xor(up ? lo : hi, ushort(1 << s2));",
      "s[i] = (up ? lo : hi) + simd_shuffle_xor(up ? hi : lo, ushort(1 << s2));",
      "row split: a lane keeps the rows KvScatter does not say it scores"),
    M("rowsplit-pos", "attention.metal", "pos = base + i == r ? st.pos[r] : pos;", "pos = i == r ? st.pos[r] : pos;",
      "row split: a row masked at another row's position"),
    M("rowsplit-gather", "attention.metal", "const float w = x ? simd_shuffle_xor(mine_p[i], ushort(x)) : mine_p[i];",
      "const float w = mine_p[i];", "row split: the other rows' weights are not fetched"),
    M("rowsplit-max", "attention.metal", "for (int off = 1; off < (1 << RSP::H); off <<= 1) {",
      "for (int off = 2; off < (1 << RSP::H); off <<= 1) {", "row split: the pass max misses the lanes across the first row bit"),
    M("max-shuffle", "attention.metal", "for (int off = LPK; off < 32; off <<= 1) {\n        m_pass",
      "for (int off = LPK; off < 16; off <<= 1) {\n        m_pass", "pass max misses the far key groups"),
    M("max-vote", "attention.metal", "simd_any(mine > st.m[r])", "simd_all(mine > st.m[r])",
      "the pass max is taken only when every key group's key rises: a rise is missed"),
    M("scale-run", "attention.metal", "for (int bit = 1; bit < RUN; bit <<= 1) {", "for (int bit = 2; bit < RUN; bit <<= 1) {",
      "register mode: a group's (scale, bias) misses the odd lanes of its run"),
    M("scale-run-first", "attention.metal", "kl % RUN == 0) {", "kl % RUN == RUN - 1) {",
      "register mode: the run's last lane loads its group's (scale, bias), the doubling spreads zeros"),
    M("tile-pair", "attention.metal", "KvVec2<TS>::load(scales + at.scale + 2 * (a * AE / GS))",
      "KvVec2<TS>::load(scales + at.scale + 2 * (a * AE / GS / 2))", "shared mode: an atom reads another group's pair"),
    M("row-pairs-second", "attention.metal", "        sb[c + 1] = p.zw;", "        sb[c + 1] = p.xy;",
      "shared mode, ROW_PAIRS: a lane's second atom takes the first group's pair"),
    M("row-pairs-cond", "attention.metal", "ROW_PAIRS = LPK * AE == GS", "ROW_PAIRS = LPK * AE >= GS",
      "shared mode: a key group over two groups takes a lane's atoms as consecutive groups"),
    M("tile-pair-copy", "attention.metal", "dst[((buffer_row0 + r) * W + e) * 2 + 1] = biases[",
      "dst[((buffer_row0 + r) * W + e) * 2 + 1] = scales[", "shared mode: the tile's pairs hold the scale twice"),
    M("sum-shuffle", "attention.metal", "for (int s = 0; LPK << s < 32; s++) {", "for (int s = 0; LPK << s < 16; s++) {",
      "key-group sums miss half the groups"),
    M("slice-keep", "attention.metal", "kv_o(st, r, i) = (up ? hi : lo) + simd_shuffle_xor(up ? lo : hi, off);",
      "kv_o(st, r, i) = (up ? lo : hi) + simd_shuffle_xor(up ? hi : lo, off);",
      "reduce-scatter: a lane keeps the half KvScatter does not say it holds"),
    M("scatter-base", "attention.metal", "b += (bits >> s) & 1 ? COUNT >> (s + 1) : 0;",
      "b += (bits >> s) & 1 ? COUNT >> s : 0;",
      "KvScatter: a lane's rows (row split) and float4s (key-group sums) taken for others'"),
    M("slice-owner", "attention.metal", "static bool owner(int bits) { return (bits >> H) == 0; }",
      "static bool owner(int bits) { return bits == 0; }", "reduce-scatter: only key group 0 writes (its slice alone)"),
    M("slice-all", "attention.metal", "  } else {\n        for (int i = 0; i < SL::N; i++) {\n          kv_o(st, r, i) +=",
      "  } else if (false) {\n        for (int i = 0; i < SL::N; i++) {\n          kv_o(st, r, i) +=",
      "reduce-scatter: the steps past the halvings are skipped"),
    M("slice-ob", "attention.metal", "        st.o[r][c][j] += st.ob[r][c];\n", "",
      "key-group sums drop quantized V's bias term"),
    M("merge-sum", "attention.metal", "merge_stats[((s - 1) * RPS + r) * 2 + 1] * mg.scale_b",
      "merge_stats[((s - 1) * RPS + r) * 2 + 1] * mg.scale_a", "simdgroup merge scales a sum by the wrong max"),
    M("merge-mine", "attention.metal", "const float mine = kv_weight(st.m[r], m);",
      "const float mine = kv_weight(m, st.m[r]);", "simdgroup merge rescale inverted"),
    M("merge-skip", "attention.metal", "for (int s = 1; s < NSG; s++) {\n                  for (int e",
      "for (int s = 2; s < NSG; s++) {\n                  for (int e", "simdgroup merge skips a term"),
    M("reduce-skip", "attention.metal", "for (int j = 0; j < count; j++) {", "for (int j = 1; j < count; j++) {",
      "split reduce skips the first split of each block of 32"),
    M("reduce-sum", "attention.metal", "kv_weight_to_max(sp.part_max(mine), m)",
      "kv_weight_to_max(sp.part_max(mine), sp.part_max(mine))", "split reduce weighs a split by its own max, not the row's"),
    M("sink-denom", "attention.metal", "float denom = has_sink ? kv_weight_to_max(sink_logit, m) : 0.0f;",
      "float denom = 0.0f;", "sink dropped from the denominator"),
    M("sink-head", "attention.metal", "const int head = (row / p.head_div) % p.num_heads;",
      "const int head = row % p.num_heads;", "reduce reads the wrong head's sink"),
    M("empty-row", "attention.metal", "denom > 0.0f ? 1.0f / denom : 0.0f", "denom >= 0.0f ? 1.0f / denom : 0.0f",
      "a row that sees nothing divides by zero"),
    M("partials-fold-l", "attention.metal", "const float wa = sizeof(TP) < 4 ? l * w : w;", "const float wa = w;",
      "16-bit (normalized) partials folded without their sums"),
    M("partials-norm", "attention.metal", "kv_store4<TP>(dst, o * inv_l);", "kv_store4<TP>(dst, o);",
      "16-bit partials stored unnormalized"),
    M("gqa-head0", "attention.metal", "kvh * G, D, p.num_heads * D", "kvh, D, p.num_heads * D",
      "paged kernel reads the wrong query heads (group index)"),
    M("gqa-row", "attention.metal", "const int g = row / L;", "const int g = row % L;",
      "query row mapped to the wrong head of the group"),
    M("tile-barrier", "attention.metal", "threadgroup_barrier(mem_flags::mem_threadgroup);\n        buffer ^= 1;",
      "buffer ^= 1;", "shared mode: tile reused before every simdgroup is done with it"),
    M("tile-buffer", "attention.metal", "buffer ^= 1;", "buffer ^= 0;", "shared mode: double buffer never flips"),
    M("tile-fill-unit", "attention.metal", "const int at = (buffer_row0 + r) * (D / 4) + a * AE4 + u * A::U4;",
      "const int at = (buffer_row0 + r) * (D / 4) + a * AE4 + u;",
      "shared mode: the tile fill writes a 2/4-value unit's half4s over the next unit's"),
    M("tile-fill-join", "attention.metal", "kv_join16(x[j], x[min(j + 1, A::U4 * UN - 1)])", "kv_join16(x[j], x[j])",
      "shared mode: the tile fill's 16-byte store repeats a unit's first half4"),
    M("tile-atom-offset", "attention.metal", "(data + row) + a * AE4;", "(data + row) + a * (AE4 / 2);",
      "shared mode: a lane reads its quantized atom's centred halves from the wrong place in the tile"),
    # --- cache_write.metal
    M("q-low-edge", "cache_write.metal", "fabs(w_min) > fabs(w_max)", "fabs(w_min) >= fabs(w_max)",
      "quantizer picks the low edge on a tie"),
    M("q-min-scale", "cache_write.metal", "1e-7f);", "1e-6f);", "quantizer's scale floor"),
    M("q-edge-round", "cache_write.metal", "rint(edge / scale)", "floor(edge / scale)",
      "quantizer rounds the edge code down"),
    M("q-clamp", "cache_write.metal", "0.0f, n_bins);", "0.0f, n_bins - 1.0f);", "quantizer drops the top code"),
    M("q-pack-flush", "cache_write.metal", "if (have >= 32) {", "if (have > 32) {",
      "packer misses a word that fills exactly"),
    M("q-scale-out", "cache_write.metal", "scale_out[0] = static_cast<TS>(scale);",
      "scale_out[0] = static_cast<TS>(bias);", "scale written as the bias"),
    M("convert-chunk", "cache_write.metal", "* D + chunk * 4;", "* D + chunk * 2;",
      "conversion writes the wrong elements"),
    # --- cache_copy.metal
    M("gather-len", "cache_copy.metal", "if (tok < len &&", "if (tok <= len &&", "gather reads one row past seq_len"),
    M("gather-zero", "cache_copy.metal", "static_cast<TE>(0.0f);", "static_cast<TE>(1.0f);",
      "rows past seq_len are not zero"),
    M("copy-src", "cache_copy.metal", "blocks[size_t(src[i]) * width + elem]", "blocks[size_t(src[i]) * width]",
      "block copy repeats one element"),
    M("pf0-bound", "attention.metal", "const bool ok = t < s_hi && src.locate(t, ka, va);",
      "const bool ok = t <= s_hi && src.locate(t, ka, va);",
      "register mode's in-pass loads (PF 0) take one key past the simdgroup's run"),
    # --- varlen.metal
    M("varlen-rescale-l", "varlen.metal", "l[f] = l[f] * factor[f] + tile_sum;", "l[f] = l[f] + tile_sum;",
      "varlen: running sum not rescaled"),
    M("varlen-rescale-o", "varlen.metal", "of[f][j].thread_elements()[0] *= factor[f];", ";",
      "varlen: accumulator (even column) not rescaled"),
    M("varlen-max-shuffle", "varlen.metal", "tile_max = max(tile_max, simd_shuffle_xor(tile_max, ushort(8)));",
      "tile_max = max(tile_max, simd_shuffle_xor(tile_max, ushort(2)));", "varlen: row max from the wrong lanes"),
    M("varlen-sum-shuffle", "varlen.metal", "tile_sum += simd_shuffle_xor(tile_sum, ushort(1));", ";",
      "varlen: row sum misses its odd columns"),
    M("varlen-hi", "varlen.metal", "const int hi = r_end > r0 ? pos_last + 1 : 0;",
      "const int hi = r_end > r0 ? pos_last : 0;", "varlen: the tile's last key is never loaded"),
    M("varlen-pos", "varlen.metal", "pos[f] = len - n + pos_i;", "pos[f] = len - n + pos_i - 1;",
      "varlen: a row's position one early (misses its own token)"),
    M("varlen-head", "varlen.metal", "head[f] = kvh * G + r % G;", "head[f] = kvh * G + r / G % G;",
      "varlen: rows mapped to the wrong query head"),
    M("varlen-split", "varlen.metal", ": (n_tiles + num_splits - 1) / num_splits;",
      ": n_tiles / num_splits;", "varlen: split length rounds down (tiles fall between splits)"),
    M("varlen-zero-row", "varlen.metal", "dst[e] = TT(0.0f);", "dst[e] = TT(1.0f);",
      "varlen: rows outside the range are not zero in the tile"),
    M("varlen-qscale", "varlen.metal", "const float qscale = var.q_scale;", "const float qscale = p.scale;",
      "varlen: query not pre-scaled to log2 units"),
    M("varlen-ds4-sum", "varlen.metal", "for (int d = 1; d < DS; d++) {", "for (int d = 1; d < 2; d++) {",
      "varlen split-D 4: the scores miss two simdgroups' dims"),
    M("varlen-skv-barrier", "varlen.metal", "if (DS == 1) {\n      threadgroup_barrier",
      "if (DS == 0) {\n      threadgroup_barrier", "varlen sequential K/V: V overwrites K while it is read"),
    M("varlen-skv-ids", "varlen.metal",
      "    if (t0 + BK < t_end) {\n      kv_varlen_load_blocks<BK, BS>(table, t0 + BK, lo",
      "    if (t0 + BK < t_end) {\n      kv_varlen_load_blocks<BK, BS>(table, t0, lo",
      "varlen sequential K/V: the next tile reads this tile's blocks"),
    # --- cascade.metal
    M("cascade-rows-past", "cascade.metal", "len + QL - 1, range", "len - 1, range",
      "cascade: member rows placed inside the prefix (causal cut of the shared prefix)"),
    M("cascade-slot", "cascade.metal", "const bool has_prefix = slot >= 0 && slot < p.prefix_slots;",
      "const bool has_prefix = slot > 0 && slot < p.prefix_slots;", "cascade: member slot 0 loses its prefix"),
    M("cascade-own-at", "cascade.metal", "sp.n1 = p.own_splits;", "sp.n1 = p.own_splits - 1;",
      "cascade: the last own split left out of the fold"),
    M("cascade-sum", "cascade.metal", "sp.at0 = has_prefix ? (size_t(slot) * p.num_heads + head) * p.prefix_splits : 0;",
      "sp.at0 = has_prefix ? size_t(slot) * p.prefix_splits : 0;", "cascade reduce reads another head's prefix partials"),
    M("cascade-sink", "cascade.metal", "HAS_SINKS ? kv_sink_logit(sinks[head]) : KV_NEG_BIG",
      "HAS_SINKS ? sinks[head] : KV_NEG_BIG",
      "cascade reduce: sink logit left in natural-log units"),
    # --- kvmetal_common.h: the attention variant (every attention family)
    M("causal-lt", "kvmetal_common.h", "return t <= pos && (window", "return t < pos && (window",
      "causal bound off by one (a row misses its own token)"),
    M("causal-plus1", "kvmetal_common.h", "return t <= pos && (window", "return t <= pos + 1 && (window",
      "causal bound off by one (a row sees the next token)"),
    M("window-ge", "kvmetal_common.h", "t > pos - window);", "t >= pos - window);",
      "window bound off by one (one token too many)"),
    M("window-start", "kvmetal_common.h", "max(0, pos - window + 1)", "max(0, pos - window + 2)",
      "window start one token late"),
    M("softcap-log2e", "kvmetal_common.h", "v.cap_log2 = v.softcap * KV_LOG2E;", "v.cap_log2 = v.softcap;",
      "softcap score left in natural-log units"),
    M("softcap-bare-tanh", "kvmetal_common.h", "cap_log2 * kv_tanh(s / softcap)", "cap_log2 * tanh(s / softcap)",
      "softcap through fast-math tanh (NaN past |x| ~ 44: the issue-30 defect)"),
    M("qscale", "kvmetal_common.h", "v.softcap > 0.0f ? scale : scale * KV_LOG2E", "v.softcap > 0.0f ? scale : scale",
      "scores not scaled to log2 units"),
    M("sink-log2e", "kvmetal_common.h", "return sink * KV_LOG2E;", "return sink;", "sink logit left in natural-log units"),
    M("weight-sign", "kvmetal_common.h", "return kv_exp2(s - m);", "return kv_exp2(m - s);",
      "a key's weight against the max inverted"),
    M("merge-helper", "kvmetal_common.h", "r.scale_b = kv_weight(m_b, r.m);", "r.scale_b = kv_weight(m_a, r.m);",
      "softmax merge scales the second state by the first max"),
    M("unpack-straddle", "kvmetal_common.h", "if (sh + BITS > 32) {", "if (sh + BITS >= 32) {",
      "unpack joins the next word when a code ends on a word boundary"),
    M("unpack-mask", "kvmetal_common.h", "ushort((v & ((1u << BITS) - 1u)) | KV_HALF_MAGIC)",
      "ushort((v & (1u << BITS)) | KV_HALF_MAGIC)", "unpack mask keeps the wrong bit (3/5/6 bits)"),
    M("unpack-word-high", "kvmetal_common.h", "x[(e + HALF) / 4][(e + HALF) % 4] = c.y;",
      "x[(e + HALF) / 4][(e + HALF) % 4] = c.x;", "word unpack takes a high half's value from the low half"),
    M("unpack-word-mid", "kvmetal_common.h", "float((1024 >> p) + (1 << (BITS - 1)))",
      "float((1024 >> p) + (1 << BITS))", "word unpack centres on the wrong mid (2/4/8 bits)"),
    M("unpack-word-place", "kvmetal_common.h", "h * static_cast<half>(1.0f / float(1 << p))",
      "h * static_cast<half>(1.0f / float(1 << (p + 1)))", "word unpack mis-scales a field masked in place"),
    M("dequant-shift", "kvmetal_common.h", "window >>= BITS;", "window >>= BITS - 1;",
      "gather dequantizer steps by one bit too few"),
]

# Survivors that no simulator test can kill, with the reason. The other survivors of the
# first run (sink-head) were killed by new tests in tests/test_sim_kernel_mutants.py.
EQUIVALENT = {
    "unpack-straddle": "equivalent: when a code ends on a word boundary the next word is shifted up by BITS, "
                       "and the final mask clears those bits (the value cannot change)",
    "tile-barrier": "not observable on the simulator: its scheduler runs simdgroups in lockstep rounds (one "
                    "collective per round) and every simdgroup meets the same collectives per tile, so the last "
                    "tile read always precedes the next load; on a GPU this is a real race (a Mac run decides)",
    "varlen-skv-barrier": "not observable on the simulator, as tile-barrier: its simdgroups meet the same MMA "
                          "collectives of the scores in lockstep rounds before the V fill, so every read of the K "
                          "tile precedes the fill that overwrites it; on a GPU this is a real race (a Mac run decides)",
    "varlen-zero-row": "equivalent: rows outside the key range are masked (weight 0, and 0 x 1.0 = 0); the zero "
                       "fill only keeps NaN out of the MMA, and 1.0 is as finite",
    # name@family: equivalent for that family only. The cascade places every row past its
    # table's last token (len + QL - 1) and has no window, so the causal and window
    # bounds cannot cut any key there (nor can a row masked at another row's position).
    **{f"{name}@cascade": "equivalent for the cascade: no window, and every row sits past the last token, so "
                          "this bound never cuts a key" for name in ("causal-plus1", "window-ge", "window-start",
                                                                     "window-first", "rowsplit-pos")},
    # The cache-copy and cache-write kernels never call the attention kernels' unpack
    # (kv_centred / kv_centred_word): gather_kv_rows dequantizes with kv_dequant_group and the
    # writes pack codes, so a mutant of the unpack cannot reach their outputs.
    **{f"{name}@{family}": "equivalent for this family: its kernels never call kv_centred / kv_centred_word "
                           "(gather dequantizes with kv_dequant_group)"
       for name in ("unpack-mask", "unpack-word-high", "unpack-word-mid", "unpack-word-place")
       for family in ("cache_copy", "cache_write")},
    # The cache kernels compute no attention: kvmetal_common.h's masks, softcap, weights, sinks
    # and merge compile into them (the header is shared) but are never called there (stop 51's
    # full run; cache_copy.metal and cache_write.metal name none of KvVariant, kv_weight,
    # kv_sink_logit, kv_softmax_merge).
    **{f"{name}@{family}": "equivalent for this family: its kernels compute no attention and never call the "
                           "mutated mask / softcap / weight / sink / merge helper"
       for name in ("causal-lt", "causal-plus1", "window-ge", "window-start", "softcap-log2e", "softcap-bare-tanh",
                    "qscale", "sink-log2e", "weight-sign", "merge-helper")
       for family in ("cache_copy", "cache_write")},
    # kv_dequant_group (the gather's and varlen's dequantizer) is called by cache_copy's
    # RowsSelect rows and varlen.metal only.
    **{f"dequant-shift@{family}": "equivalent for this family: its kernels never call kv_dequant_group"
       for family in ("attention", "cascade", "cache_write")},
    # Snippets in the bodies of attention.metal's own kernels (paged / decode partials, attention
    # reduce): the cascade family runs cascade.metal's bodies and only attention.metal's helpers.
    **{f"{name}@cascade": "equivalent for the cascade: the snippet is in the body of one of attention.metal's "
                          "kernels, which the cascade's kernels (cascade.metal) do not run"
       for name in ("len-clamp", "decode-len", "sink-head", "gqa-head0")},
}


def equivalent_reason(name: str, family: str) -> str | None:
    return EQUIVALENT.get(f"{name}@{family}") or EQUIVALENT.get(name)

PLUGIN = '''
"""pytest plugin (written by tools/mutate_kernels.py): read kernels from KVMETAL_MUTANT_KERNELS."""
import os
from pathlib import Path


def pytest_configure(config):
    from kvmetal.backends import metal_specs

    directory = Path(os.environ["KVMETAL_MUTANT_KERNELS"])
    metal_specs.kernel_dirs = lambda: [directory]
    metal_specs.family_source.cache_clear()
    metal_specs.kernel_text.cache_clear()
'''


def apply(mutant: Mutant, source: Path, target: Path) -> bool:
    """Copy kernels/ to ``target`` with ``mutant`` applied; False if its snippet is gone."""
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(source, target)
    path = target / mutant.file
    text = path.read_text()
    if mutant.old not in text:
        return False
    path.write_text(text.replace(mutant.old, mutant.new, 1))
    return True


def run_tests(kernels: Path, plugin_dir: Path, cache: Path, keyword: str, timeout: float) -> tuple:
    """(returncode, first failing test or '', seconds)."""
    env = dict(os.environ, KVMETAL_MUTANT_KERNELS=str(kernels), KVMETAL_SIM_CACHE=str(cache),
               PYTHONPATH=os.pathsep.join(filter(None, [str(plugin_dir), os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-p", "kvmetal_mutant_plugin",
           *TEST_MODULES]
    if keyword:
        cmd += ["-k", keyword]
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return -1, "timeout (a hang counts as killed)", time.monotonic() - start
    first = next((line.split(" - ")[0] for line in proc.stdout.splitlines()
                  if line.startswith(("FAILED", "ERROR"))), "")
    for module in TEST_MODULES:
        first = first.replace(module + "::", "")
    return proc.returncode, first, time.monotonic() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="run the mutants whose name starts with one of these (comma-separated)")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--write", help="also write the markdown table to this file")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per mutant (a hang is a kill)")
    parser.add_argument("--cache", help="simulator build cache (default: a fresh temporary directory)")
    parser.add_argument("--families", default="", help="only these kernel families (comma-separated)")
    args = parser.parse_args(argv)
    mutants = [m for m in MUTANTS if any(m.name.startswith(p) for p in args.only.split(","))]
    wanted = set(filter(None, args.families.split(",")))
    plan = [(m, f) for m in mutants for f in families_reached(m.file) if not wanted or f in wanted]
    if args.list:
        for m, family in plan:
            print(f"{m.name:18s} {m.file:18s} {family:12s} {m.what}")
        return 0
    work = Path(tempfile.mkdtemp(prefix="kvmetal-mutants-"))
    (work / "kvmetal_mutant_plugin.py").write_text(PLUGIN)
    cache = Path(args.cache) if args.cache else work / "sim-cache"
    source = ROOT / "kernels"
    rows = []

    def report(line: str):
        print(line, flush=True)

    # The unmutated kernels must pass, or every "kill" would mean nothing.
    apply(Mutant("baseline", COMMON_HEADER, "", "", ""), source, work / "kernels")
    code, first, seconds = run_tests(work / "kernels", work, cache, "", args.timeout)
    if code != 0:
        report(f"baseline FAILS ({first}); fix the tests first")
        return 1
    report(f"baseline passes ({seconds:.0f} s)")
    for m, family in plan:
        if not apply(m, source, work / "kernels"):
            rows.append((m, family, "not applicable", "snippet not in the kernel (the kernel changed)", 0.0))
            report(f"{m.name:18s} {family:12s} not applicable")
            continue
        code, first, seconds = run_tests(work / "kernels", work, cache, family, args.timeout)
        if code == 5:  # the family has no test selected: a gap, never a pass
            status, first = "NO TESTS", f"no test matches -k {family}"
        elif code == 0:
            reason = equivalent_reason(m.name, family)
            status = "equivalent" if reason else "SURVIVED"
            first = reason or "no test failed"
        else:
            status = "killed"
        rows.append((m, family, status, first, seconds))
        report(f"{m.name:18s} {family:12s} {status:10s} {seconds:5.0f} s  {first}")
    shutil.rmtree(work, ignore_errors=True)
    lines = ["| mutant | file | family | mutation | result | first failing test |", "|---|---|---|---|---|---|"]
    lines += [f"| {m.name} | {m.file} | {fam} | {m.what} | {status} | {first} |" for m, fam, status, first, _ in rows]
    lines += ["", "| family | applied | killed | survived | equivalent | score |", "|---|---|---|---|---|---|"]
    failing = False
    for family in sorted({r[1] for r in rows}):
        mine = [r for r in rows if r[1] == family and r[2] != "not applicable"]
        killed = sum(r[2] == "killed" for r in mine)
        equivalent = sum(r[2] == "equivalent" for r in mine)
        survived = len(mine) - killed - equivalent
        failing = failing or survived > 0
        score = killed / max(len(mine) - equivalent, 1)
        lines.append(f"| {family} | {len(mine)} | {killed} | {survived} | {equivalent} | {score:.0%} |")
    table = "\n".join(lines)
    print("\n" + table)
    if args.write:
        Path(args.write).write_text(table + "\n")
    return 3 if failing else 0


if __name__ == "__main__":
    sys.exit(main())
