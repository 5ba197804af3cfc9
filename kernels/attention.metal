// Decode attention: split-KV partials over a paged or a contiguous cache, and
// the reduce that merges the splits.
//
// File layout (read by kvmetal/backends/metal_specs.py): everything before the first
// `//@kernel` line is this family's helper section, appended to
// kvmetal_common.h and passed as `header=`; each `//@kernel NAME` line starts
// the body of one mx.fast.metal_kernel (MLX writes the signature).
//
// Design (docs/kernels.md has the why and the measured costs):
// - One threadgroup per (split, kv head, sequence) serves the R = G * L query
//   rows of its kv head, so every K/V row leaves device memory once.
// - Lanes are cut into key groups of LPK lanes; a pass scores KPP = 32 / LPK
//   keys at once. A lane holds "atoms" of a row (4 elements of a float cache,
//   or KAW/VAW whole packed words) in registers, in their storage type until
//   the dot product or the accumulation widens them (KvAtom); the partial dot
//   products meet through simd_shuffle_xor inside the key group.
// - Registers (issue 41, P1; metal_layout.estimated_registers): the query share
//   stays in the query's type (16-bit: half the registers), K/V atoms stay 16-bit
//   or packed, the accumulator o is float32; the layout keeps every lane's
//   estimate within the 128 registers an Apple GPU thread has.
// - Scores are in log2 units (scale * log2 e applied to q . k): one exp2 per
//   (pass, row) for the probabilities, and the running state is rescaled once
//   per pass, only when the pass raises the running max.
// - Quantized K is scored from the packed words, centred (w - mid, mid = 2^(bits - 1),
//   built as exact halves from the bits, kvmetal_common.h): q.(s*w + b) =
//   s*(q.(w - mid)) + (b + s*mid)*sum(q) per group; V accumulates p*s*(w - mid) per
//   element plus p*(b + s*mid) per atom. Each scale and bias is loaded by one lane
//   of the key group and shuffled to the others.
// - Register mode (RPS == R): each simdgroup owns a contiguous token range of
//   the split and every row; the simdgroups merge their states at the end
//   through threadgroup memory (kv_softmax_merge), a chunk of rows per barrier
//   (one barrier up to G 4 at D 128, 3 at G 8). No barrier in the token loop.
// - Shared mode (RPS < R: more rows than registers hold): simdgroups split the
//   rows and share each tile of TT tokens through a double-buffered threadgroup
//   tile (one barrier per tile): a float cache's rows in their storage type, a
//   quantized cache's unpacked once per threadgroup to centred halves (KvTileFill),
//   which every simdgroup reads instead of unpacking the packed words itself.
// - Sparse V (template SV = 1, threshold KvAttnParams.sparse_v): V is read after
//   its key's scores, only where some row's weight exp2(s - m_running) >= tau
//   (kv_pass_sparse), with m_running seeded by 32 real scores (kv_seed_rows);
//   SV = 0 is the exact path, unchanged.

// Where one cache row starts: element offsets into its data, scales and biases,
// and the element step along the row (1 unless a strided view says otherwise).
struct KvAt {
  size_t data;
  size_t scale;
  size_t bias;
};

// Paged cache [N, Hkv, BS, W]: token t is row (block_tables[t / BS] * Hkv + kvh)
// * BS + t % BS. A block id outside [0, N) is padding: the row is never read,
// and so is a token past the table (t / BS >= M: the table entry is not read).
// The 64-bit block base is computed once per block; offsets inside a block are 32-bit.
template <int BS, int KW, int KNG, int VW, int VNG, typename PT>
struct KvPagedRows {
  PT table;
  int max_blocks;  // M: entries in this sequence's table row
  int num_blocks;
  int kv_rows;  // Hkv * BS: rows per block
  int kvh;
  int cached_index;  // t / BS of the last lookup
  bool cached_ok;
  size_t block_row;  // first row of the cached block
  // Sequence `seq`'s table row, kv head `head`, under the launch's parameters.
  void init(PT tables, int seq, int head, const device KvAttnParams& p) {
    table = tables + size_t(seq) * p.max_blocks;
    max_blocks = p.max_blocks;
    num_blocks = p.num_blocks;
    kv_rows = p.num_kv_heads * BS;
    kvh = head;
    cached_index = -1;
    cached_ok = false;
    block_row = 0;
  }
  bool locate(int t, thread KvAt& k, thread KvAt& v) {
    const int index = t / BS;
    if (index != cached_index) {
      const int block = index < max_blocks ? table[index] : -1;
      cached_index = index;
      cached_ok = uint(block) < uint(num_blocks);
      block_row = size_t(cached_ok ? block : 0) * uint(kv_rows);
    }
    const uint row = uint(kvh * BS + t % BS);
    k.data = block_row * KW + row * KW;
    k.scale = block_row * KNG + row * KNG;
    k.bias = k.scale;
    v.data = block_row * VW + row * VW;
    v.scale = block_row * VNG + row * VNG;
    v.bias = v.scale;
    return cached_ok;
  }
  // From one row to the next inside a block (tiles never straddle blocks).
  KvAt step_k() const {
    KvAt s;
    s.data = KW;
    s.scale = KNG;
    s.bias = KNG;
    return s;
  }
  KvAt step_v() const {
    KvAt s;
    s.data = VW;
    s.scale = VNG;
    s.bias = VNG;
    return s;
  }
};

// One side's (K or V) arrays of a contiguous cache [B, Hkv, T, W], from their
// element strides (MLX's <name>_strides): where row (batch, kvh, t = 0) starts,
// and the stride along dimension `dim`.
template <typename PS>
inline KvAt kv_strided_origin(PS data, PS scales, PS biases, int batch, int kvh) {
  KvAt at;
  at.data = size_t(batch) * data[0] + size_t(kvh) * data[1];
  at.scale = size_t(batch) * scales[0] + size_t(kvh) * scales[1];
  at.bias = size_t(batch) * biases[0] + size_t(kvh) * biases[1];
  return at;
}

template <typename PS>
inline KvAt kv_strided_dim(PS data, PS scales, PS biases, int dim) {
  KvAt at;
  at.data = data[dim];
  at.scale = scales[dim];
  at.bias = biases[dim];
  return at;
}

// Contiguous cache [B, Hkv, T, W] read in place through its element strides.
struct KvStridedRows {
  KvAt k0;  // (b, kvh, t = 0)
  KvAt kt;  // stride along t
  KvAt v0;
  KvAt vt;
  template <typename PS>
  void init(int batch, int kvh, PS kd, PS ks, PS kb, PS vd, PS vs, PS vb) {
    k0 = kv_strided_origin(kd, ks, kb, batch, kvh);
    kt = kv_strided_dim(kd, ks, kb, 2);
    v0 = kv_strided_origin(vd, vs, vb, batch, kvh);
    vt = kv_strided_dim(vd, vs, vb, 2);
  }
  bool locate(int t, thread KvAt& k, thread KvAt& v) {
    k.data = k0.data + size_t(t) * kt.data;
    k.scale = k0.scale + size_t(t) * kt.scale;
    k.bias = k0.bias + size_t(t) * kt.bias;
    v.data = v0.data + size_t(t) * vt.data;
    v.scale = v0.scale + size_t(t) * vt.scale;
    v.bias = v0.bias + size_t(t) * vt.bias;
    return true;
  }
  KvAt step_k() const { return kt; }
  KvAt step_v() const { return vt; }
};

// One tile of the shared mode: rows [t0, t0 + TT) in threadgroup memory, KW / VW
// tile elements a row (D: a float cache's elements, or a quantized one's centred
// halves, KvTileSide), and a quantized side's KNG / VNG (scale, bias) pairs a row,
// side by side (kv_tile_copy_pairs): `scale` is the row's first pair, `bias` its
// second element.
template <int KW, int KNG, int VW, int VNG>
struct KvTileRows {
  int t0;
  int buffer;  // 0 or 1
  const threadgroup int* ok;  // [2 * TT]
  int tt;
  bool locate(int t, thread KvAt& k, thread KvAt& v) {
    const int r = buffer * tt + (t - t0);
    k.data = uint(r * KW);
    k.scale = uint(r * 2 * KNG);
    k.bias = k.scale + 1;
    v.data = uint(r * VW);
    v.scale = uint(r * 2 * VNG);
    v.bias = v.scale + 1;
    return ok[r] != 0;
  }
};

// The element steps of one cache array family (data, scales, biases): all 1
// with `vec` set, except for strided views.
struct KvSteps {
  size_t data;
  size_t scale;
  size_t bias;
  bool vec;    // vector loads allowed (unit data step, strides keep atoms aligned)
  bool vec16;  // 16-byte tile copies allowed (unit data step, strides keep rows 16-byte aligned)
};

// A paged cache's steps, and a threadgroup tile's: every step 1, vector loads allowed.
inline KvSteps kv_unit_steps() {
  KvSteps s;
  s.data = 1;
  s.scale = 1;
  s.bias = 1;
  s.vec = true;
  s.vec16 = true;
  return s;
}

// One side's steps in a strided view (element strides [B, Hkv, T, W]). Alignment
// guards: vector loads of VEC elements only with a unit element step and strides
// that keep every row start on a vector boundary (else the scalar path); the
// shared-mode tile copy moves 16-byte units (VEC16 elements), its own, stricter check.
template <int VEC, int VEC16, typename PS>
inline KvSteps kv_strided_steps(PS data, PS scales, PS biases) {
  KvSteps s;
  s.data = data[3];
  s.scale = scales[3];
  s.bias = biases[3];
  s.vec = data[3] == 1 && data[0] % VEC == 0 && data[1] % VEC == 0 && data[2] % VEC == 0;
  s.vec16 = data[3] == 1 && data[0] % VEC16 == 0 && data[1] % VEC16 == 0 && data[2] % VEC16 == 0;
  return s;
}

// One atom of a row as a lane holds it from its load to its use (issue 41, P1): a
// float cache's 4 elements in their storage type (KvVec4: half4, bfloat as ushort4,
// float4), or a quantized cache's AW packed words. `centred(u, x)` gives unpack unit u's
// U4 groups of 4 elements (groups u * U4 .. u * U4 + U4 - 1 of the atom) where the dot
// product or the accumulation takes them: a float cache's group widened to float4; a
// quantized cache's elements minus mid = 2^(BITS - 1) as exact halves (kvmetal_common.h:
// one unit is one packed word of 2/4/8-bit values, or a group of 4 values of 3/5/6 bits),
// which the float32 products take as operands. A 16-bit atom costs 2 registers and a
// packed one AW, not AE floats.
template <int BITS, int AW, typename T>
struct KvAtom {
  typedef half4 unit;
  static constant constexpr const int U4 = KvPacked<BITS>::WORDS ? 8 / BITS : 1;
  uint w[AW];
  void clear() {
    for (int i = 0; i < AW; i++) {
      w[i] = 0u;
    }
  }
  template <typename PD>
  void read(PD data, size_t row, size_t step, bool vec, int a) {
    if (vec) {
      kv_words<AW>(data + row + a * AW, w);
    } else {
      kv_words_strided<AW>(data + row + size_t(a * AW) * step, step, w);
    }
  }
  void centred(int u, thread half4* x) const {
    if (KvPacked<BITS>::WORDS) {
      kv_centred_word<BITS>(w[u], x);
    } else {
      x[0] = KvVec4<half>::pack(kv_centred<BITS>(w, 4 * u), kv_centred<BITS>(w, 4 * u + 1),
                                kv_centred<BITS>(w, 4 * u + 2), kv_centred<BITS>(w, 4 * u + 3));
    }
  }
};
template <int AW, typename T>
struct KvAtom<0, AW, T> {
  typedef float4 unit;
  static constant constexpr const int U4 = 1;
  typename KvVec4<T>::type x;
  void clear() {
    x = KvVec4<T>::pack(static_cast<T>(0.0f), static_cast<T>(0.0f), static_cast<T>(0.0f), static_cast<T>(0.0f));
  }
  template <typename PD>
  void read(PD data, size_t row, size_t step, bool vec, int a) {
    x = vec ? kv_raw4(data + row + a * 4) : kv_raw4_strided<T>(data + row + size_t(a * 4) * step, step);
  }
  void centred(int u, thread float4* v) const {
    v[0] = KvVec4<T>::widen(x);
  }
};

// A quantized side's atom in the shared mode's tile (issue 41): the tile holds the
// row's values already centred, as halves (KvTileFill unpacks each element once per
// threadgroup, with KvAtom::centred: the halves a lane built itself before), so the
// atom keeps only where its AE halves start in threadgroup memory; centred(u, x) reads
// unit u's U4 half4s from there (zeros for a cleared atom: a row outside the tile's
// valid rows is never read). The products take the same halves: results unchanged.
// A unit is two half4s, one 16-byte threadgroup load (the tile is uint4s, its rows D
// halves, an atom AE4 half4s from its row's start), wherever the atom's AE4 is even;
// else one half4 (8 bytes). cost_model.shared_tile_accesses counts the loads so.
struct KvCentredTile {};
template <int BITS, int AW>
struct KvAtom<BITS, AW, KvCentredTile> {
  typedef half4 unit;
  static constant constexpr const int AE4 = AW * 8 / BITS;
  static constant constexpr const int U4 = AE4 % 2 == 0 ? 2 : 1;
  const threadgroup half4* x;
  bool on;
  void clear() {
    x = nullptr;
    on = false;
  }
  template <typename PD>
  void read(PD data, size_t row, size_t, bool, int a) {
    x = reinterpret_cast<const threadgroup half4*>(data + row) + a * AE4;
    on = true;
  }
  void centred(int u, thread half4* y) const {
    if (U4 == 2) {
      const uint4 w = on ? reinterpret_cast<const threadgroup uint4*>(x)[u] : uint4(0u);
      y[0] = as_type<half4>(w.xy);
      y[U4 - 1] = as_type<half4>(w.zw);
    } else {
      y[0] = on ? x[u] : half4(static_cast<half>(0.0f));
    }
  }
};

// What one side of a row is in the shared mode's tile: `elem`, the tile's element type
// (a float cache's own; half for a quantized cache, its values centred), and `atom`,
// the KvAtom type parameter a lane reads it through. D elements a row either way.
template <int BITS, typename TD>
struct KvTileSide {
  typedef half elem;
  typedef KvCentredTile atom;
};
template <typename TD>
struct KvTileSide<0, TD> {
  typedef TD elem;
  typedef TD atom;
};

// The registers of one key (or value) row a lane holds: NA atoms (KvAtom, T the
// data array's element type), and each atom's (scale, bias) for a quantized cache.
template <int NA, int BITS, int AW, typename T>
struct KvAtoms {
  typedef KvAtom<BITS, AW, T> atom;
  KvAtom<BITS, AW, T> a[NA];
  float2 sb[NA];
};

// Each of a lane's NA atoms' (scale, bias), into sb. From device memory (T, the
// cache's word type): the lanes whose atoms share a group form an aligned run of RUN
// lanes of the key group (AE, GS and LPK are powers of two); its first lane loads the
// pair and log2(RUN) xor shuffles double it across the run, so each group's bytes are
// loaded once per key group and every shuffle has one mask for all lanes. (Before, lane
// g % LPK loaded group g and simd_shuffle sent it to the lanes that need it: a shuffle
// whose lanes read different lanes, which Apple GPUs run as an instruction sequence of
// ~32 cycles a 32-bit word, metal-benchmarks' SHUFFLE_RANDOM_DIFF32; two an atom.)
template <typename T>
struct KvGroupScales {
  template <int D, int LPK, int BITS, int GS, int AW, int NA, typename PS>
  static void fetch(thread float2* sb, PS scales, PS biases, KvAt at, KvSteps step, bool ok, int kl, int) {
    constexpr int AE = BITS ? AW * 32 / (BITS ? BITS : 1) : 4;  // (BITS 0 compiles, never runs)
    constexpr int NAR = D / AE;
    constexpr int RUN = GS / AE < LPK ? GS / AE : LPK;  // lanes of a key group sharing an atom's group
    for (int c = 0; c < NA; c++) {
      const int a = kl + LPK * c;
      const size_t g = size_t(a * AE / GS);
      float2 x = float2(0.0f);
      if (ok && a < NAR && kl % RUN == 0) {
        x = kv_float2(static_cast<float>(scales[at.scale + g * step.scale]),
                      static_cast<float>(biases[at.bias + g * step.bias]));
      }
      for (int bit = 1; bit < RUN; bit <<= 1) {  // uniform: every lane shuffles
        const float2 from = simd_shuffle_xor(x, ushort(bit));
        x = (kl & bit) ? from : x;
      }
      sb[c] = ok && a < NAR ? x : float2(0.0f);
    }
  }
};
// From the shared mode's tile, whose rows hold each group's (scale, bias) side by
// side (kv_tile_copy_pairs; KvTileRows::locate points at.scale at the row's first
// pair): each lane loads its own atoms' pairs, one 2-element threadgroup load an
// atom (issue 41: before, the shuffles of the pairs were 14% of G 8 K8/V4's issue).
// Where a key group's LPK atoms span exactly one group (LPK x AE == GS, e.g. K8 at
// G 8: LPK 4, AE 16, GS 64), a lane's atom c is the row's group c, so its pairs are
// the row's 2 x NA elements in order: two pairs a 4-element load (the row starts at
// a multiple of 2 x NA elements of a 16-byte aligned array, so the load is aligned).
template <>
struct KvGroupScales<KvCentredTile> {
  template <int D, int LPK, int BITS, int GS, int AW, int NA, typename TS>
  static void fetch(thread float2* sb, const threadgroup TS* scales, const threadgroup TS*, KvAt at, KvSteps,
                    bool ok, int kl, int) {
    constexpr int AE = BITS ? AW * 32 / (BITS ? BITS : 1) : 4;  // (BITS 0 compiles, never runs)
    constexpr int NAR = D / AE;
    constexpr bool ROW_PAIRS = LPK * AE == GS && NAR == LPK * NA && NA % 2 == 0;
    if (ROW_PAIRS) {
      typedef typename KvVec4<TS>::type P4;
      for (int c = 0; c < NA; c += 2) {
        const float4 p = ok ? KvVec4<TS>::widen(*reinterpret_cast<const threadgroup P4*>(scales + at.scale + 2 * c))
                            : float4(0.0f);
        sb[c] = p.xy;
        sb[c + 1] = p.zw;
      }
      return;
    }
    for (int c = 0; c < NA; c++) {
      const int a = kl + LPK * c;
      sb[c] = ok && a < NAR ? KvVec2<TS>::load(scales + at.scale + 2 * (a * AE / GS)) : float2(0.0f);
    }
  }
};

// Read this lane's atoms of one row. BITS == 0: a float cache (atoms of 4
// elements). Else AW packed words per atom, and each atom's (scale, bias)
// (KvGroupScales: from device rows, or from the shared tile's pairs).
template <int D, int LPK, int BITS, int GS, int AW, typename T, typename PD, typename PS>
inline KvAtoms<(((BITS ? D / (AW * 32 / BITS) : D / 4) + LPK - 1) / LPK), BITS, AW, T>
kv_fetch(PD data, PS scales, PS biases, KvAt at, KvSteps step, bool ok, int kl, int kg) {
  constexpr int AE = BITS ? AW * 32 / BITS : 4;
  constexpr int NAR = D / AE;                 // atoms per row
  constexpr int NA = (NAR + LPK - 1) / LPK;  // atoms per lane
  KvAtoms<NA, BITS, AW, T> r;
  for (int c = 0; c < NA; c++) {
    const int a = kl + LPK * c;
    r.a[c].clear();
    r.sb[c] = float2(0.0f);
    if (!ok || a >= NAR) {
      continue;
    }
    r.a[c].read(data, at.data, step.data, step.vec, a);
  }
  if (BITS != 0) {
    KvGroupScales<T>::template fetch<D, LPK, BITS, GS, AW, NA>(r.sb, scales, biases, at, step, ok, kl, kg);
  }
  return r;
}

// The running state of RPS query rows in one lane. The query share stays in the
// query's type TQ (KvVec4<TQ>: a float16 / bfloat16 query costs half the registers,
// without rounding); scale * log2 e is applied to q . k (kv_score_rows).
template <int RPS, int KNA, int KAE4, int VNA, int VAE4, typename TQ>
struct KvRowState {
  typename KvVec4<TQ>::type q[RPS][KNA][KAE4];  // the query as given, this lane's K atoms
  float qsum[RPS][KNA];      // sum of each q atom (quantized K)
  float4 o[RPS][VNA][VAE4];  // sum of p * s * w (or p * v), this lane's V atoms
  float ob[RPS][VNA];        // sum of p * b (quantized V)
  float m[RPS];              // running max, log2 units, uniform in the simdgroup
  float l[RPS];              // this key group's sum of p
  int pos[RPS];              // the row's position; -1 for padding rows
};

// log2 of a power-of-two lane count (1 .. 32).
template <int LANES>
struct KvLog2 {
  static constant constexpr const int value = LANES >= 32 ? 5 : LANES == 16 ? 4 : LANES == 8 ? 3 : LANES == 4 ? 2
                                            : LANES == 2 ? 1 : 0;
};

// A sum of COUNT values over STEPS xor steps, as a reduce-scatter (issue 41; the rows of
// a pass in kv_score_rows, over a key group's lanes; a row's accumulator float4s in
// kv_reduce_key_groups, over the key groups): the first H steps halve what a lane holds
// (while steps remain and the count is even), so a lane ends with N values, indices
// base(bits) .. base(bits) + N - 1, where bit s of `bits` is the lane's bit at step s
// (step s kept the upper half where it is set). Past H steps the N values are summed
// whole, so the lanes that differ only in bits past H hold the same values; `owner`
// picks one of them.
template <int STEPS, int COUNT>
struct KvScatter {
  static constant constexpr const int TZ = COUNT % 2 ? 0 : COUNT % 4 ? 1 : COUNT % 8 ? 2 : COUNT % 16 ? 3
                                         : COUNT % 32 ? 4 : 5;
  static constant constexpr const int H = STEPS < TZ ? STEPS : TZ;
  static constant constexpr const int N = COUNT >> H;
  static int base(int bits) {
    int b = 0;
    for (int s = 0; s < H; s++) {
      b += (bits >> s) & 1 ? COUNT >> (s + 1) : 0;
    }
    return b;
  }
  static bool owner(int bits) { return (bits >> H) == 0; }
};

// Score key t (this lane's key group holds it) for every row and fold the pass
// maximum into each row's running state (rescaling o and l when it rises).
// p[r] is the key's weight relative to row r's running maximum, p = exp2(s - m)
// with s and m in log2 units (= exp(score - max) in natural units); 0 when the
// key is not visible to the row. Each element group of the key is widened (or
// unpacked) once and dotted with every row's query: its floats live only here.
template <int D, int RPS, int LPK, int KBITS, int KNA, int KAE4, int VNA, int VAE4, typename TQ, typename KA>
inline void kv_score_rows(thread KvRowState<RPS, KNA, KAE4, VNA, VAE4, TQ>& st, thread const KA& k,
                          thread float* p, int t, bool ok, KvVariant var, int kl) {
  constexpr int KAE = KAE4 * 4;
  constexpr int KNAR = D / KAE;
  float s[RPS];
  for (int r = 0; r < RPS; r++) {
    s[r] = 0.0f;
  }
  for (int c = 0; c < KNA; c++) {
    if (kl + LPK * c < KNAR) {
      float d[RPS];
      for (int r = 0; r < RPS; r++) {
        d[r] = 0.0f;
      }
      // A quantized key's integers centred on 0 (exact, KvAtom::centred): q . k = scale (q . (k - mid))
      // + (bias + scale mid) sum(q), whose two terms no longer cancel (uncentred, scale
      // q . k and bias sum(q) are each many times the score at large |q|).
      typedef typename KA::atom KT;
      for (int u = 0; u < KAE4 / KT::U4; u++) {
        typename KT::unit kx[KT::U4];
        k.a[c].centred(u, kx);
        for (int i = 0; i < KT::U4; i++) {
          const float4 kf = kv_widen(kx[i]);
          for (int r = 0; r < RPS; r++) {
            d[r] += dot(KvVec4<TQ>::widen(st.q[r][c][u * KT::U4 + i]), kf);
          }
        }
      }
      const float mid_bias = KBITS ? k.sb[c].y + k.sb[c].x * float(1 << (KBITS - 1)) : 0.0f;
      for (int r = 0; r < RPS; r++) {
        s[r] += KBITS ? k.sb[c].x * d[r] + mid_bias * st.qsum[r][c] : d[r];
      }
    }
  }
  // The dot's sum over the key group's LPK lanes, rows split (issue 41): the first H steps
  // (xor 1, 2, ..) halve the rows a lane holds (KvScatter over its bits of kl), the rest
  // sum its N rows, so a lane ends with the scores of rows base .. base + N - 1 (the same
  // tree of additions as summing every row on every lane: the same bits), and its logit,
  // mask and exp2 run on those rows only; the weights of the other rows come back by xor
  // shuffles. A row's pass max spans the H row bits and the key groups' bits.
  typedef KvScatter<KvLog2<LPK>::value, RPS> RSP;
  constexpr int MAX_STEPS = RSP::H + 5 - KvLog2<LPK>::value;
  const int base = RSP::base(kl);
  for (int s2 = 0; s2 < RSP::H; s2++) {
    const int h = RPS >> (s2 + 1);
    const bool up = (kl >> s2) & 1;
    for (int i = 0; i < h; i++) {
      const float lo = s[i];
      const float hi = s[h + i];
      s[i] = (up ? hi : lo) + simd_shuffle_xor(up ? lo : hi, ushort(1 << s2));
    }
  }
  float sr[RSP::N];
  bool visible[RSP::N];
  for (int i = 0; i < RSP::N; i++) {
    float x = s[i];
    for (int off = 1 << RSP::H; off < LPK; off <<= 1) {
      x += simd_shuffle_xor(x, ushort(off));
    }
    int pos = st.pos[0];
    for (int r = 1; r < RPS; r++) {
      pos = base + i == r ? st.pos[r] : pos;
    }
    visible[i] = ok && var.visible(t, pos);
    sr[i] = visible[i] ? var.logit(x * var.q_scale) : KV_NEG_BIG;
  }
  for (int r = 0; r < RPS; r++) {
    // This lane's score of row r, if it holds row r (else below every score).
    float mine = KV_NEG_BIG;
    for (int i = 0; i < RSP::N; i++) {
      mine = base + i == r ? sr[i] : mine;
    }
    // The pass maximum over the lanes that hold row r, only when some key raises the row's
    // max: one vote (a ballot, 2 cycles) a pass instead of the MAX_STEPS shuffles, where
    // that is 2 or more. Uniform either way; the same m_pass, so the same bits.
    const bool rises = MAX_STEPS >= 2 ? simd_any(mine > st.m[r]) : true;
    float m_pass = st.m[r];
    if (rises) {
      m_pass = mine;
      for (int off = 1; off < (1 << RSP::H); off <<= 1) {
        m_pass = max(m_pass, simd_shuffle_xor(m_pass, ushort(off)));
      }
      for (int off = LPK; off < 32; off <<= 1) {
        m_pass = max(m_pass, simd_shuffle_xor(m_pass, ushort(off)));
      }
    }
    if (m_pass > st.m[r]) {  // uniform: rescale only when the pass raises the max
      const float correction = kv_weight(st.m[r], m_pass);
      st.l[r] *= correction;
      for (int c = 0; c < VNA; c++) {
        for (int j = 0; j < VAE4; j++) {
          st.o[r][c][j] *= correction;
        }
        st.ob[r][c] *= correction;
      }
      st.m[r] = m_pass;
    }
  }
  float mine_p[RSP::N];
  for (int i = 0; i < RSP::N; i++) {
    float m = st.m[0];
    for (int r = 1; r < RPS; r++) {
      m = base + i == r ? st.m[r] : m;
    }
    mine_p[i] = visible[i] ? kv_weight(sr[i], m) : 0.0f;
  }
  for (int r = 0; r < RPS; r++) {
    p[r] = 0.0f;
  }
  for (int x = 0; x < (1 << RSP::H); x++) {  // x = 0: this lane's own rows
    const int from = RSP::base(kl ^ x);
    for (int i = 0; i < RSP::N; i++) {
      const float w = x ? simd_shuffle_xor(mine_p[i], ushort(x)) : mine_p[i];
      for (int r = 0; r < RPS; r++) {
        p[r] = from + i == r ? w : p[r];
      }
    }
  }
}

// Add p[r] * v (this lane's V atoms) to every row's accumulator; with SPARSE only
// the rows whose weight reaches tau. Each element group of the value row is
// widened (or unpacked) once for all rows.
template <int D, int RPS, int LPK, int VBITS, bool SPARSE, int KNA, int KAE4, int VNA, int VAE4, typename TQ,
          typename VA>
inline void kv_accumulate_rows(thread KvRowState<RPS, KNA, KAE4, VNA, VAE4, TQ>& st, thread const VA& v,
                               thread const float* p, float tau, int kl) {
  constexpr int VAE = VAE4 * 4;
  constexpr int VNAR = D / VAE;
  for (int c = 0; c < VNA; c++) {
    if (kl + LPK * c < VNAR) {
      // A quantized value centred as K is (exact, KvAtom::centred): p (s v + b) = p s (v - mid)
      // + p (b + s mid), so o and ob no longer carry p s mid and -p s mid that cancel in o + ob.
      typedef typename VA::atom VT;
      for (int u = 0; u < VAE4 / VT::U4; u++) {
        typename VT::unit vx[VT::U4];
        v.a[c].centred(u, vx);
        for (int i = 0; i < VT::U4; i++) {
          const float4 vf = kv_widen(vx[i]);
          for (int r = 0; r < RPS; r++) {
            if (!SPARSE || p[r] >= tau) {
              const float ps = VBITS ? p[r] * v.sb[c].x : p[r];
              st.o[r][c][u * VT::U4 + i] += ps * vf;
            }
          }
        }
      }
      if (VBITS) {
        const float v_mid_bias = VBITS ? v.sb[c].y + v.sb[c].x * float(1 << (VBITS - 1)) : 0.0f;
        for (int r = 0; r < RPS; r++) {
          if (!SPARSE || p[r] >= tau) {
            st.ob[r][c] += p[r] * v_mid_bias;
          }
        }
      }
    }
  }
}

// Score one pass of keys (this lane's key group holds key t) and fold it into
// the running state of every row. The exact path: V was loaded with K.
template <int D, int RPS, int LPK, int KBITS, int VBITS, int KNA, int KAE4, int VNA, int VAE4, typename TQ,
          typename KA, typename VA>
inline void kv_pass(thread KvRowState<RPS, KNA, KAE4, VNA, VAE4, TQ>& st, thread const KA& k, thread const VA& v,
                    int t, bool ok, KvVariant var, int kl) {
  float p[RPS];
  kv_score_rows<D, RPS, LPK, KBITS>(st, k, p, t, ok, var, kl);
  for (int r = 0; r < RPS; r++) {
    st.l[r] += p[r];
  }
  kv_accumulate_rows<D, RPS, LPK, VBITS, false>(st, v, p, 0.0f, kl);
}

// Sparse V (SV = 1): the same pass, but V is read only after the scores of the
// pass are known. A row whose weight p = exp2(s - m_running) is below `tau`
// does not accumulate the key's V row (p still joins the denominator l), and a
// key group whose key is below tau for every row of this simdgroup loads no V
// at all: no data words, no scales or biases (kv_fetch with ok = false). The
// running max (seeded by kv_seed_rows) is always a score the row sees, so the
// skipped weight relative to the final max is below tau too: the error bound
// of docs/kernels.md. `va` locates key t's V
// row in `vdata` (device memory in register mode, the tile in shared mode).
template <int D, int RPS, int LPK, int KBITS, int VBITS, int VGS, int VAW, typename TVD, int KNA, int KAE4, int VNA,
          int VAE4, typename TQ, typename KA, typename PVD, typename PVS>
inline void kv_pass_sparse(thread KvRowState<RPS, KNA, KAE4, VNA, VAE4, TQ>& st, thread const KA& k, PVD vdata,
                           PVS vscales, PVS vbiases, KvAt va, KvSteps vsteps, int t, bool ok, KvVariant var,
                           float tau, int kl, int kg) {
  float p[RPS];
  kv_score_rows<D, RPS, LPK, KBITS>(st, k, p, t, ok, var, kl);
  bool need = false;
  for (int r = 0; r < RPS; r++) {
    st.l[r] += p[r];
    need = need || p[r] >= tau;
  }
  // Every lane calls kv_fetch; only the key groups that need their row load it.
  const KvAtoms<VNA, VBITS, VAW, TVD> v =
      kv_fetch<D, LPK, VBITS, VGS, VAW, TVD>(vdata, vscales, vbiases, va, vsteps, ok && need, kl, kg);
  if (need) {
    kv_accumulate_rows<D, RPS, LPK, VBITS, true>(st, v, p, tau, kl);
  }
}

// Sparse V's seeds (reference.sparse_v_seeds): seed 0 is the first live key
// (`first`: an attention sink in most models), seed j >= 1 the key newest - (j - 1)
// (`newest` = len - L, the newest key every row sees): a decode row's largest
// scores sit mostly among its newest keys. 32 seeds reach 0.97 of the final-max
// skip rate on Gemma-3-270M at 8K, 2 seeds 0.49.
static constant constexpr const int KV_SEEDS = 32;  // 1 + reference.SPARSE_V_RECENT_SEEDS

// Start every row's running max at the best seed score, so that the skip test
// has a reference from a run's first key on (from -inf, every simdgroup's and
// split's first keys were never skipped). This simdgroup scores seeds
// [seed0, KV_SEEDS) in steps of `step` (KPP per pass); a seed a row does not
// see is masked, so m stays a score the row sees: never above its final max,
// and the error bound holds. The seeds' weights are not added here (l and o
// stay 0): they join where their tokens are walked. K loads only, no V.
template <int D, int RPS, int LPK, int KBITS, int KGS, int KAW, typename TKD, int KNA, int KAE4, int VNA, int VAE4,
          typename TQ, typename SRC, typename PKD, typename PKS>
inline void kv_seed_rows(thread KvRowState<RPS, KNA, KAE4, VNA, VAE4, TQ>& st, thread SRC& src, PKD kdata,
                         PKS kscales, PKS kbiases, KvSteps ksteps, int first, int newest, int len, KvVariant var,
                         int kl, int kg, int seed0, int step) {
  for (int i = seed0; i < KV_SEEDS; i += step) {  // uniform in the simdgroup
    const int seed = i + kg;
    const int t = seed == 0 ? first : newest - (seed - 1);
    KvAt ka;
    KvAt va;
    const bool ok = seed < KV_SEEDS && t >= 0 && t < len && src.locate(t, ka, va);
    const KvAtoms<KNA, KBITS, KAW, TKD> k =
        kv_fetch<D, LPK, KBITS, KGS, KAW, TKD>(kdata, kscales, kbiases, ka, ksteps, ok, kl, kg);
    float p[RPS];
    kv_score_rows<D, RPS, LPK, KBITS>(st, k, p, t, ok, var, kl);
  }
}

// Register mode's threadgroup scratch (KV_ATTN_THREADGROUP_ARRAYS; metal_layout.py's
// REGISTER_MERGE_FLOATS and attention_threadgroup_bytes mirror these): the merge's
// accumulators of simdgroups 1.. for a chunk of KV_MERGE_ROWS rows take at most
// KV_MERGE_FLOATS floats (6 KiB); merge_stats holds their (m, l), then from
// KV_MERGE_SEEDS on the NSG * RPS seed maxima.
#define KV_MERGE_FLOATS 1536
#define KV_MERGE_FIT(D, NSG) (KV_MERGE_FLOATS / (((NSG) > 1 ? (NSG) - 1 : 1) * (D)))
#define KV_MERGE_ROWS(D, NSG, RPS) \
  ((NSG) <= 1 || KV_MERGE_FIT(D, NSG) < 1 ? 1 : KV_MERGE_FIT(D, NSG) > (RPS) ? (RPS) : KV_MERGE_FIT(D, NSG))
#define KV_MERGE_SEEDS(NSG, RPS) (((NSG) - 1) * (RPS) * 2)

// Register mode (every simdgroup holds every row): the NSG simdgroups score a
// share of the seeds each (one pass of KPP keys apiece covers NSG * KPP seeds)
// and take the max of their maxima through `stats` (NSG * RPS floats of their
// own, KV_MERGE_SEEDS: the merge never writes them). One barrier, once per split.
template <int D, int NSG, int RPS, int LPK, int KBITS, int KGS, int KAW, typename TKD, int KNA, int KAE4, int VNA,
          int VAE4, typename TQ, typename SRC, typename PKD, typename PKS>
inline void kv_seed_rows_cooperative(thread KvRowState<RPS, KNA, KAE4, VNA, VAE4, TQ>& st, thread SRC& src,
                                     PKD kdata, PKS kscales, PKS kbiases, KvSteps ksteps, int first, int newest,
                                     int len, KvVariant var, int kl, int kg, int sg, int lane,
                                     threadgroup float* stats) {
  constexpr int KPP = 32 / LPK;
  kv_seed_rows<D, RPS, LPK, KBITS, KGS, KAW, TKD>(st, src, kdata, kscales, kbiases, ksteps, first, newest, len, var,
                                                   kl, kg, sg * KPP, NSG * KPP);
  if (NSG > 1) {
    for (int r = 0; r < RPS; r++) {
      if (lane == 0) {
        stats[sg * RPS + r] = st.m[r];
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (int r = 0; r < RPS; r++) {
      float m = st.m[r];
      for (int s = 0; s < NSG; s++) {
        m = max(m, stats[s * RPS + r]);
      }
      st.m[r] = m;  // l and o are still 0: nothing to rescale
    }
  }
}

// Row r's accumulator float4 at flat index f of st.o[r] flattened ([VNA][VAE4]: f = c *
// VAE4 + j, atom kl + LPK * c, elements 4 j ..). Once the key groups are summed
// (kv_reduce_key_groups) a lane holds the first KvScatter::N of them, flat indices
// base(kg) .. base(kg) + N - 1.
template <int RPS, int KNA, int KAE4, int VNA, int VAE4, typename TQ>
inline thread float4& kv_o(thread KvRowState<RPS, KNA, KAE4, VNA, VAE4, TQ>& st, int r, int f) {
  return st.o[r][f / VAE4][f % VAE4];
}
template <int RPS, int KNA, int KAE4, int VNA, int VAE4, typename TQ>
inline float4 kv_o(thread const KvRowState<RPS, KNA, KAE4, VNA, VAE4, TQ>& st, int r, int f) {
  return st.o[r][f / VAE4][f % VAE4];
}

// Sum the key groups' sums: l on every lane, o (with ob folded in) reduce-scattered
// (issue 41): at a halving step a lane keeps the upper half of what it holds where its
// key group's bit is set, the lower half else, and sends the other half to the lane
// across, so step s moves N4 / 2^(s+1) float4s instead of all N4 (KvScatter over
// the key-group bits says which float4s a lane ends with). Every float4's sum is the same tree of additions
// as the all-reduce's, whichever lane computes it.
template <int RPS, int LPK, int KNA, int KAE4, int VNA, int VAE4, typename TQ>
inline void kv_reduce_key_groups(thread KvRowState<RPS, KNA, KAE4, VNA, VAE4, TQ>& st, int kg) {
  typedef KvScatter<5 - KvLog2<LPK>::value, VNA * VAE4> SL;
  for (int r = 0; r < RPS; r++) {
    for (int c = 0; c < VNA; c++) {
      for (int j = 0; j < VAE4; j++) {
        st.o[r][c][j] += st.ob[r][c];
      }
      st.ob[r][c] = 0.0f;
    }
  }
  for (int s = 0; LPK << s < 32; s++) {
    const ushort off = ushort(LPK << s);
    const bool up = (kg >> s) & 1;
    for (int r = 0; r < RPS; r++) {
      st.l[r] += simd_shuffle_xor(st.l[r], off);
      if (s < SL::H) {
        const int h = (VNA * VAE4) >> (s + 1);
        for (int i = 0; i < h; i++) {
          const float4 lo = kv_o(st, r, i);
          const float4 hi = kv_o(st, r, h + i);
          kv_o(st, r, i) = (up ? hi : lo) + simd_shuffle_xor(up ? lo : hi, off);
        }
      } else {
        for (int i = 0; i < SL::N; i++) {
          kv_o(st, r, i) += simd_shuffle_xor(kv_o(st, r, i), off);
        }
      }
    }
  }
}

// Load the query rows [row0, row0 + RPS) of this kv head (row = g * L + l,
// query row index q_index(g, l)) as given (no scale: it joins q . k), and reset
// the state. A padding row's query is 0.
template <int D, int RPS, int LPK, int KBITS, int KNA, int KAE4, int VNA, int VAE4, typename TQ, typename PQ>
inline void kv_init_rows(thread KvRowState<RPS, KNA, KAE4, VNA, VAE4, TQ>& st, PQ q, int row0, int rows, int L,
                         int len, int head0, int head_stride, int token_stride, int kl) {
  constexpr int KAE = KAE4 * 4;
  constexpr int KNAR = D / KAE;
  const TQ zero = static_cast<TQ>(0.0f);
  for (int r = 0; r < RPS; r++) {
    const int row = row0 + r;
    const int g = row / L;
    const int l = row % L;
    const bool live = row < rows;
    st.pos[r] = live ? len - L + l : -1;
    const size_t base = size_t(head0 + g) * head_stride + size_t(l) * token_stride;
    for (int c = 0; c < KNA; c++) {
      const int a = kl + LPK * c;
      float sum = 0.0f;
      for (int j = 0; j < KAE4; j++) {
        typename KvVec4<TQ>::type x = KvVec4<TQ>::pack(zero, zero, zero, zero);
        if (live && a < KNAR) {
          const size_t e = base + a * KAE + 4 * j;
          x = KvVec4<TQ>::pack(static_cast<TQ>(q[e]), static_cast<TQ>(q[e + 1]), static_cast<TQ>(q[e + 2]),
                               static_cast<TQ>(q[e + 3]));
        }
        st.q[r][c][j] = x;
        const float4 xf = KvVec4<TQ>::widen(x);
        sum += xf.x + xf.y + xf.z + xf.w;
      }
      st.qsum[r][c] = sum;
    }
    for (int c = 0; c < VNA; c++) {
      for (int j = 0; j < VAE4; j++) {
        st.o[r][c][j] = float4(0.0f);
      }
      st.ob[r][c] = 0.0f;
    }
    st.m[r] = KV_NEG_BIG;
    st.l[r] = 0.0f;
  }
}

// The token range [lo, hi) of one split. With split_tokens > 0 (the backend's
// default) split k is the k-th window of the live range [first, len) cut at the
// multiples of split_tokens: a sequence's windows, and so its partials and their
// fold, depend on its own length only, never on the launch's split count (which
// follows the batch); splits past its last window are empty. With split_tokens =
// 0 the live range is cut into num_splits equal runs of whole 32-token units (an
// explicit num_splits). Either way tiles of TT | 32 tokens never straddle a split,
// and a sliding window never assigns out-of-window blocks.
// With split_div > 0 (issue 41, P4) the window is a function of the sequence's
// length alone, kv_split_window: clamp(pow2ceil(len) / div, split_tokens,
// split_max) (powers of two), div = split_div while the window is split_tokens and
// split_div * split_grow once it has doubled, so long sequences get longer windows
// (fewer partials), sequences of a few thousand tokens more of them (more
// threadgroups), and batch invariance holds as with fixed windows.
inline int kv_split_window(int len, int split_tokens, int split_max, int split_div, int split_grow) {
  int w = split_tokens;
  int div = split_div;
  while (split_div > 0 && w < split_max && w * div < len) {
    w *= 2;
    div = split_div * split_grow;
  }
  return w;
}

struct KvSplitRange {
  int lo;
  int hi;
  int begin;  // unit-aligned start (<= lo)
};

inline KvSplitRange kv_split_range(int len, int L, int window, int split, int num_splits, int split_tokens,
                                   int split_max, int split_div, int split_grow) {
  const int first = kv_first_visible(len - L, window);
  int begin;
  int per;
  if (split_tokens > 0) {
    per = kv_split_window(len, split_tokens, split_max, split_div, split_grow);
    begin = (first / per + split) * per;
  } else {
    const int start = (first / 32) * 32;
    const int units = (len - start + 31) / 32;
    per = (units + num_splits - 1) / num_splits * 32;
    begin = start + split * per;
  }
  KvSplitRange r;
  r.lo = max(first, begin);
  r.hi = min(len, begin + per);
  r.begin = begin;
  return r;
}

// Copy rows [r_lo, r_hi) of one tile (token t0 + r, starting at element
// offset row0 + r * row_step, elements `estep` apart) of one array into
// threadgroup rows buffer_row0 + r, in their storage type: 16-byte units where
// the caller vouches for 16-byte aligned rows (`vec16`), else element by element.
template <int W, typename TD, typename PD, typename PT>
inline void kv_tile_copy(PD src, PT dst, size_t row0, size_t row_step, size_t estep, bool vec16, int buffer_row0,
                         int r_lo, int r_hi, int tid, int nthreads) {
  constexpr int RB = W * int(sizeof(TD));  // bytes per row
  const int n = max(0, r_hi - r_lo);
  if (vec16 && RB % 16 == 0) {
    constexpr int U = RB / 16;
    constexpr int UE = 16 / int(sizeof(TD));  // elements per unit
    for (int i = tid; i < n * U; i += nthreads) {
      const int r = r_lo + i / U;
      const int u = i % U;
      kv_copy16(src + row0 + size_t(r) * row_step + u * UE, dst + (buffer_row0 + r) * W + u * UE);
    }
  } else {
    for (int i = tid; i < n * W; i += nthreads) {
      const int r = r_lo + i / W;
      const int e = i % W;
      dst[(buffer_row0 + r) * W + e] = src[row0 + size_t(r) * row_step + size_t(e) * estep];
    }
  }
}

// Rows [r_lo, r_hi) of a quantized side's W scales and W biases (as kv_tile_copy's
// arguments) into threadgroup rows buffer_row0 + r of W (scale, bias) pairs, side by
// side, so that a lane reads its atom's pair in one load (KvGroupScales<KvCentredTile>).
template <int W, typename TS, typename PS, typename PT>
inline void kv_tile_copy_pairs(PS scales, PS biases, PT dst, size_t scale0, size_t bias0, size_t scale_row_step,
                               size_t bias_row_step, size_t estep_scale, size_t estep_bias, int buffer_row0, int r_lo,
                               int r_hi, int tid, int nthreads) {
  const int n = max(0, r_hi - r_lo);
  for (int i = tid; i < n * W; i += nthreads) {
    const int r = r_lo + i / W;
    const int e = i % W;
    dst[((buffer_row0 + r) * W + e) * 2] = scales[scale0 + size_t(r) * scale_row_step + size_t(e) * estep_scale];
    dst[((buffer_row0 + r) * W + e) * 2 + 1] = biases[bias0 + size_t(r) * bias_row_step + size_t(e) * estep_bias];
  }
}

// One side's data rows [r_lo, r_hi) of a tile (as kv_tile_copy's arguments) into
// threadgroup rows buffer_row0 + r of D elements (KvTileSide). A float cache's rows
// are copied as stored (kv_tile_copy). A quantized cache's rows are unpacked here,
// once per threadgroup (issue 41): each thread reads whole atoms of AW packed words
// (as kv_fetch reads them) and writes their AE values centred, as halves
// (KvAtom::centred), so the simdgroups that share the tile read halves and none
// unpacks (before, each unpacked every element of the tile itself).
template <int D, int BITS, int AW, typename TD>
struct KvTileFill {
  template <typename PD>
  static void rows(PD src, threadgroup uint4* tile, size_t row0, size_t row_step, KvSteps steps, int buffer_row0,
                   int r_lo, int r_hi, int tid, int nthreads) {
    typedef KvAtom<BITS, AW, TD> A;
    constexpr int AE4 = AW * 8 / BITS;  // half4s an atom
    constexpr int NAR = D / (4 * AE4);  // atoms a row
    threadgroup half4* dst = reinterpret_cast<threadgroup half4*>(tile);
    const int n = max(0, r_hi - r_lo);
    for (int i = tid; i < n * NAR; i += nthreads) {
      const int r = r_lo + i / NAR;
      const int a = i % NAR;
      A atom;
      atom.read(src, row0 + size_t(r) * row_step, steps.data, steps.vec, a);
      // Where the simdgroups read the atom in 16-byte units (KvAtom<.., KvCentredTile>, AE4
      // even) it is written in them too: two half4s a store, from UN units of the unpack.
      constexpr bool PAIRS = AE4 % 2 == 0;
      constexpr int UN = PAIRS && A::U4 % 2 != 0 ? 2 : 1;
      for (int u = 0; u < AE4 / A::U4; u += UN) {
        half4 x[A::U4 * UN];
        for (int k = 0; k < UN; k++) {
          atom.centred(u + k, x + k * A::U4);
        }
        const int at = (buffer_row0 + r) * (D / 4) + a * AE4 + u * A::U4;  // even with PAIRS
        for (int j = 0; j < A::U4 * UN; j += PAIRS ? 2 : 1) {
          if (PAIRS) {
            reinterpret_cast<threadgroup uint4*>(dst)[(at + j) / 2] = kv_join16(x[j], x[min(j + 1, A::U4 * UN - 1)]);
          } else {
            dst[at + j] = x[j];
          }
        }
      }
    }
  }
};
template <int D, int AW, typename TD>
struct KvTileFill<D, 0, AW, TD> {
  template <typename PD>
  static void rows(PD src, threadgroup uint4* tile, size_t row0, size_t row_step, KvSteps steps, int buffer_row0,
                   int r_lo, int r_hi, int tid, int nthreads) {
    kv_tile_copy<D, TD>(src, reinterpret_cast<threadgroup TD*>(tile), row0, row_step, steps.data, steps.vec16,
                        buffer_row0, r_lo, r_hi, tid, nthreads);
  }
};

// Load the tile of tokens [t0, t0 + TT) into threadgroup buffer `buffer`: only
// rows inside [lo, hi) of a valid block; tile_ok marks them. Data through KvTileFill
// (a quantized side unpacked to centred halves), scales and biases as stored, in
// pairs (kv_tile_copy_pairs).
template <int TT, int D, int KBITS, int KAW, int VBITS, int VAW, int KNG, int VNG, typename TKD, typename TKS,
          typename TVD, typename TVS, typename SRC, typename PKD, typename PKS, typename PVD, typename PVS>
inline void kv_load_tile(thread SRC& src, int t0, int buffer, int lo, int hi, PKD kdata, PKS kscales,
                         PKS kbiases, PVD vdata, PVS vscales, PVS vbiases, KvSteps ks, KvSteps vs,
                         threadgroup uint4* tile_k, threadgroup uint4* tile_ks, threadgroup uint4* tile_v,
                         threadgroup uint4* tile_vs, threadgroup int* tile_ok, int tid, int nthreads) {
  KvAt ka;
  KvAt va;
  // The tile lies in one block. One wholly outside [lo, hi) (an empty split's
  // first tile may start past the table) is not located at all.
  const bool ok = t0 < hi && t0 + TT > lo && src.locate(t0, ka, va);
  const KvAt sk = src.step_k();
  const KvAt sv = src.step_v();
  const int r_lo = ok ? max(0, lo - t0) : 0;
  const int r_hi = ok ? min(TT, hi - t0) : 0;
  for (int r = tid; r < TT; r += nthreads) {
    tile_ok[buffer * TT + r] = (r >= r_lo && r < r_hi) ? 1 : 0;
  }
  const int b0 = buffer * TT;
  KvTileFill<D, KBITS, KAW, TKD>::rows(kdata, tile_k, ka.data, sk.data, ks, b0, r_lo, r_hi, tid, nthreads);
  KvTileFill<D, VBITS, VAW, TVD>::rows(vdata, tile_v, va.data, sv.data, vs, b0, r_lo, r_hi, tid, nthreads);
  if (KBITS) {
    kv_tile_copy_pairs<KNG, TKS>(kscales, kbiases, reinterpret_cast<threadgroup TKS*>(tile_ks), ka.scale, ka.bias,
                                 sk.scale, sk.bias, ks.scale, ks.bias, b0, r_lo, r_hi, tid, nthreads);
  }
  if (VBITS) {
    kv_tile_copy_pairs<VNG, TVS>(vscales, vbiases, reinterpret_cast<threadgroup TVS*>(tile_vs), va.scale, va.bias,
                                 sv.scale, sv.bias, vs.scale, vs.bias, b0, r_lo, r_hi, tid, nthreads);
  }
}

// Four elements of a partial accumulator (issue 41, P4's partials goal). TP float32:
// the accumulator o as summed (unnormalized, one float4 store). A 16-bit TP (half,
// bfloat; the host picks it, metal_layout.partials_dtype): o / l, normalized, a convex
// combination of the window's V rows, so it stays within max |V| and the type's range
// (half only over a float16 V); the reduces weight it by l (kv_fold_splits).
template <typename TP>
inline void kv_store_partial4(device TP* dst, float4 o, float inv_l) {
  kv_store4<TP>(dst, o * inv_l);
}
inline void kv_store_partial4(device float* dst, float4 o, float) {
  *reinterpret_cast<device float4*>(dst) = o;
}

// Write the partials (max, sum, accumulator in TP: kv_store_partial4) of rows
// [row0, row0 + RPS); rows past R are padding (uniform in the simdgroup) and write nothing.
template <int D, int R, int QL, int RPS, int LPK, int VAE4, int VNA, int KNA, int KAE4, typename TQ, typename TP>
inline void kv_write_partials(thread const KvRowState<RPS, KNA, KAE4, VNA, VAE4, TQ>& st, int row0, int lane,
                              device float* part_max, device float* part_sum, device TP* part_acc,
                              size_t part_row0, int row_stride_g, int row_stride_l, int num_splits, int split) {
  typedef KvScatter<5 - KvLog2<LPK>::value, VNA * VAE4> SL;
  constexpr int VAE = VAE4 * 4;
  const int kl = lane % LPK;
  const int kg = lane / LPK;
  const int base = SL::base(kg);
  for (int r = 0; r < RPS; r++) {
    const int row = row0 + r;
    if (row >= R) {
      continue;
    }
    const size_t at = (part_row0 + size_t(row / QL) * row_stride_g + size_t(row % QL) * row_stride_l) * num_splits +
                      split;
    if (lane == 0) {
      part_max[at] = st.m[r];
      part_sum[at] = st.l[r];
    }
    if (SL::owner(kg)) {
      const float inv_l = st.l[r] > 0.0f ? 1.0f / st.l[r] : 0.0f;  // read by a 16-bit TP only
      for (int i = 0; i < SL::N; i++) {
        const int f = base + i;
        const int a = kl + LPK * (f / VAE4);
        if (a < D / VAE) {
          kv_store_partial4(part_acc + at * D + a * VAE + 4 * (f % VAE4), kv_o(st, r, i), inv_l);
        }
      }
    }
  }
}

// kv_attend's arguments, grouped. The pointer types are template parameters:
// MLX binds an input of fewer than 8 elements as `constant`, others as `device`.

// The query rows of one kv head: row (g, l) of its G x QL rows starts at
// q + (head0 + g) * head_stride + l * token_stride.
template <typename PQ>
struct KvQueryView {
  PQ q;
  int head0;
  int head_stride;
  int token_stride;
};

template <typename PQ>
inline KvQueryView<PQ> kv_query_view(PQ q, int head0, int head_stride, int token_stride) {
  KvQueryView<PQ> v;
  v.q = q;
  v.head0 = head0;
  v.head_stride = head_stride;
  v.token_stride = token_stride;
  return v;
}

// The K and V cache arrays (data, and scales / biases of a quantized cache) and
// their element steps.
template <typename PKD, typename PKS, typename PVD, typename PVS>
struct KvCacheArrays {
  PKD kdata;
  PKS kscales;
  PKS kbiases;
  PVD vdata;
  PVS vscales;
  PVS vbiases;
  KvSteps ksteps;
  KvSteps vsteps;
};

template <typename PKD, typename PKS, typename PVD, typename PVS>
inline KvCacheArrays<PKD, PKS, PVD, PVS> kv_cache_arrays(PKD kdata, PKS kscales, PKS kbiases, PVD vdata,
                                                        PVS vscales, PVS vbiases, KvSteps ksteps,
                                                        KvSteps vsteps) {
  KvCacheArrays<PKD, PKS, PVD, PVS> c;
  c.kdata = kdata;
  c.kscales = kscales;
  c.kbiases = kbiases;
  c.vdata = vdata;
  c.vscales = vscales;
  c.vbiases = vbiases;
  c.ksteps = ksteps;
  c.vsteps = vsteps;
  return c;
}

// How keys are scored and which a row sees (kv_variant), and sparse V's threshold.
struct KvScoring {
  float scale;
  float softcap;   // 0 = off
  int window;      // sliding window, 0 = off
  float sparse_v;  // tau; 0 with SV = 0, where nothing reads it
};

template <int SV>
inline KvScoring kv_scoring(const device KvAttnParams& p, int window) {
  KvScoring s;
  s.scale = p.scale;
  s.softcap = p.softcap;
  s.window = window;
  s.sparse_v = SV ? p.sparse_v : 0.0f;
  return s;
}

// This thread's place in the threadgroup.
struct KvThreadIds {
  int sg;    // simdgroup
  int lane;  // lane in the simdgroup
  int tid;   // thread in the threadgroup
};

inline KvThreadIds kv_thread_ids(uint sg, uint lane, uint tid) {
  KvThreadIds ids;
  ids.sg = int(sg);
  ids.lane = int(lane);
  ids.tid = int(tid);
  return ids;
}

// The threadgroup memory KV_ATTN_THREADGROUP_ARRAYS declares: the register mode's
// merge buffers and the shared mode's double-buffered K/V tiles.
struct KvAttnScratch {
  threadgroup float* merge_stats;
  threadgroup float* merge_acc;
  threadgroup uint4* tile_k;
  threadgroup uint4* tile_ks;  // a quantized side's (scale, bias) pairs (kv_tile_copy_pairs)
  threadgroup uint4* tile_v;
  threadgroup uint4* tile_vs;
  threadgroup int* tile_ok;
};

// Where the partials go: query row (g, l) of this kv head is partial row
// row0 + g * row_stride_g + l * row_stride_l, its entry `split` of num_splits; the
// accumulator in TP (the part_acc output's type: kv_store_partial4).
template <typename TP>
struct KvPartialsOut {
  device float* part_max;
  device float* part_sum;
  device TP* part_acc;
  size_t row0;
  int row_stride_g;
  int row_stride_l;
  int num_splits;
  int split;
};

template <typename TP>
inline KvPartialsOut<TP> kv_partials_out(device float* part_max, device float* part_sum, device TP* part_acc,
                                         size_t row0, int row_stride_g, int row_stride_l, int num_splits, int split) {
  KvPartialsOut<TP> o;
  o.part_max = part_max;
  o.part_sum = part_sum;
  o.part_acc = part_acc;
  o.row0 = row0;
  o.row_stride_g = row_stride_g;
  o.row_stride_l = row_stride_l;
  o.num_splits = num_splits;
  o.split = split;
  return o;
}

// The whole partial kernel for one (split, kv head, sequence), any row source.
// Register mode when RPS >= R, else shared mode with tiles of TT tokens.
// SV = 1 compiles sparse V (kv_pass_sparse, threshold `sparse_v`); SV = 0 is
// the exact path, and `sparse_v` is then unused. PF (register mode): 1 loads the
// next pass's K/V a pass ahead, 0 in the pass (fewer registers: one row at D 512).
template <int D, int G, int QL, int NSG, int RPS, int LPK, int TT, int KBITS, int KGS, int KAW, int VBITS,
          int VGS, int VAW, int PF, int SV, typename TKD, typename TVD, typename TKS, typename TVS, typename TQ,
          typename SRC, typename PQ, typename PKD, typename PKS, typename PVD, typename PVS, typename TP>
inline void kv_attend(thread SRC& src, KvQueryView<PQ> query, KvCacheArrays<PKD, PKS, PVD, PVS> cache, int len,
                      KvSplitRange range, KvScoring scoring, KvThreadIds ids, KvAttnScratch scratch,
                      KvPartialsOut<TP> out) {
  // The grouped arguments under the names the code below uses.
  const PQ q = query.q;
  const int head0 = query.head0;
  const int head_stride = query.head_stride;
  const int token_stride = query.token_stride;
  const PKD kdata = cache.kdata;
  const PKS kscales = cache.kscales;
  const PKS kbiases = cache.kbiases;
  const PVD vdata = cache.vdata;
  const PVS vscales = cache.vscales;
  const PVS vbiases = cache.vbiases;
  const KvSteps ksteps = cache.ksteps;
  const KvSteps vsteps = cache.vsteps;
  const float scale = scoring.scale;
  const float softcap = scoring.softcap;
  const int window = scoring.window;
  const float sparse_v = scoring.sparse_v;
  const int sg = ids.sg;
  const int lane = ids.lane;
  const int tid = ids.tid;
  threadgroup float* merge_stats = scratch.merge_stats;
  threadgroup float* merge_acc = scratch.merge_acc;
  threadgroup uint4* tile_k = scratch.tile_k;
  threadgroup uint4* tile_ks = scratch.tile_ks;
  threadgroup uint4* tile_v = scratch.tile_v;
  threadgroup uint4* tile_vs = scratch.tile_vs;
  threadgroup int* tile_ok = scratch.tile_ok;
  device float* part_max = out.part_max;
  device float* part_sum = out.part_sum;
  device TP* part_acc = out.part_acc;
  const size_t part_row0 = out.row0;
  const int row_stride_g = out.row_stride_g;
  const int row_stride_l = out.row_stride_l;
  const int num_splits = out.num_splits;
  const int split = out.split;
  constexpr int R = G * QL;
  constexpr bool SHARED = RPS < R;
  constexpr int KPP = 32 / LPK;
  constexpr int KAE = KBITS ? KAW * 32 / KBITS : 4;
  constexpr int VAE = VBITS ? VAW * 32 / VBITS : 4;
  constexpr int KNA = (D / KAE + LPK - 1) / LPK;
  constexpr int VNA = (D / VAE + LPK - 1) / LPK;
  constexpr int KAE4 = KAE / 4;
  constexpr int VAE4 = VAE / 4;
  constexpr int KNG = KBITS ? D / KGS : 1;
  constexpr int VNG = VBITS ? D / VGS : 1;
  const int kl = lane % LPK;
  const int kg = lane / LPK;
  const KvVariant var = kv_variant(scale, softcap, window);
  const int seed_first = kv_first_visible(len - QL, window);  // sparse V's first seed (kv_seed_rows)

  // An empty split (past the sequence's last window: a sequence shorter than the
  // launch's longest) writes (m, l) = (-big, 0) for its rows and returns (issue 41,
  // P3): no q load, no sparse-V seeds, no merge barriers, no accumulator. The reduces
  // skip a split whose sum is 0 and never read its accumulator. `range` is the same
  // for the whole threadgroup, so the return is uniform.
  if (range.hi <= range.lo) {
    for (int row = tid; row < R; row += NSG * 32) {
      const size_t at =
          (part_row0 + size_t(row / QL) * row_stride_g + size_t(row % QL) * row_stride_l) * num_splits + split;
      part_max[at] = KV_NEG_BIG;
      part_sum[at] = 0.0f;
    }
    return;
  }

  KvRowState<RPS, KNA, KAE4, VNA, VAE4, TQ> st;

  if (!SHARED) {
    kv_init_rows<D, RPS, LPK, KBITS>(st, q, 0, R, QL, len, head0, head_stride, token_stride, kl);
    if (SV) {
      kv_seed_rows_cooperative<D, NSG, RPS, LPK, KBITS, KGS, KAW, TKD>(st, src, kdata, kscales, kbiases, ksteps,
                                                                  seed_first, len - QL, len, var, kl, kg, sg, lane,
                                                                  merge_stats + KV_MERGE_SEEDS(NSG, RPS));
    }
    // Register mode: this simdgroup's contiguous run of the split, KPP keys per pass.
    const int n = max(0, range.hi - range.lo);
    const int per = ((n + NSG - 1) / NSG + KPP - 1) / KPP * KPP;
    const int s_lo = range.lo + sg * per;
    const int s_hi = min(range.hi, s_lo + per);
    if (!PF) {
      // PF 0 (one row whose pipelined atoms would pass the register budget, D 512):
      // each pass loads its own K/V, nothing a pass ahead.
      for (int t0 = s_lo; t0 < s_hi; t0 += KPP) {
        const int t = t0 + kg;
        KvAt ka;
        KvAt va;
        const bool ok = t < s_hi && src.locate(t, ka, va);
        const KvAtoms<KNA, KBITS, KAW, TKD> k =
            kv_fetch<D, LPK, KBITS, KGS, KAW, TKD>(kdata, kscales, kbiases, ka, ksteps, ok, kl, kg);
        if (SV) {
          kv_pass_sparse<D, RPS, LPK, KBITS, VBITS, VGS, VAW, TVD>(st, k, vdata, vscales, vbiases, va, vsteps, t, ok,
                                                              var, sparse_v, kl, kg);
        } else {
          const KvAtoms<VNA, VBITS, VAW, TVD> v =
              kv_fetch<D, LPK, VBITS, VGS, VAW, TVD>(vdata, vscales, vbiases, va, vsteps, ok, kl, kg);
          kv_pass<D, RPS, LPK, KBITS, VBITS>(st, k, v, t, ok, var, kl);
        }
      }
      kv_reduce_key_groups<RPS, LPK>(st, kg);
    } else {
      // Software pipeline (PF 1): the next pass's K/V loads are issued before this
      // pass is scored, so memory latency overlaps the math.
      KvAt ka;
      KvAt va;
      int t = s_lo + kg;
      bool ok = t < s_hi && src.locate(t, ka, va);
      KvAtoms<KNA, KBITS, KAW, TKD> k =
          kv_fetch<D, LPK, KBITS, KGS, KAW, TKD>(kdata, kscales, kbiases, ka, ksteps, ok, kl, kg);
      if (SV) {
        // Sparse V: K stays a pass ahead; V is read in the pass, once its
        // scores are known (kv_pass_sparse), and only where a row needs it.
        for (int t0 = s_lo; t0 < s_hi; t0 += KPP) {
          const KvAt va_now = va;
          const int t_next = t0 + KPP + kg;
          const bool ok_next = t_next < s_hi && src.locate(t_next, ka, va);
          const KvAtoms<KNA, KBITS, KAW, TKD> k_next =
              kv_fetch<D, LPK, KBITS, KGS, KAW, TKD>(kdata, kscales, kbiases, ka, ksteps, ok_next, kl, kg);
          kv_pass_sparse<D, RPS, LPK, KBITS, VBITS, VGS, VAW, TVD>(st, k, vdata, vscales, vbiases, va_now, vsteps, t,
                                                              ok, var, sparse_v, kl, kg);
          k = k_next;
          t = t_next;
          ok = ok_next;
        }
      } else {
        KvAtoms<VNA, VBITS, VAW, TVD> v =
            kv_fetch<D, LPK, VBITS, VGS, VAW, TVD>(vdata, vscales, vbiases, va, vsteps, ok, kl, kg);
        for (int t0 = s_lo; t0 < s_hi; t0 += KPP) {
          const int t_next = t0 + KPP + kg;
          const bool ok_next = t_next < s_hi && src.locate(t_next, ka, va);
          const KvAtoms<KNA, KBITS, KAW, TKD> k_next =
              kv_fetch<D, LPK, KBITS, KGS, KAW, TKD>(kdata, kscales, kbiases, ka, ksteps, ok_next, kl, kg);
          const KvAtoms<VNA, VBITS, VAW, TVD> v_next =
              kv_fetch<D, LPK, VBITS, VGS, VAW, TVD>(vdata, vscales, vbiases, va, vsteps, ok_next, kl, kg);
          kv_pass<D, RPS, LPK, KBITS, VBITS>(st, k, v, t, ok, var, kl);
          k = k_next;
          v = v_next;
          t = t_next;
          ok = ok_next;
        }
      }
      kv_reduce_key_groups<RPS, LPK>(st, kg);
    }
  } else {
    // Shared mode: all threads copy each tile once (double-buffered, one
    // barrier per tile); simdgroup sg scores its own rows from the tile. The
    // threadgroup is capped (metal.MAX_SHARED_SIMDGROUPS), so with more than
    // NSG * RPS rows the split is walked once per block of NSG * RPS rows
    // (ROW_PASSES, uniform: every simdgroup takes part in every tile).
    constexpr int NT = NSG * 32;
    constexpr int ROW_PASSES = (R + NSG * RPS - 1) / (NSG * RPS);
    // The tile's data: D elements a row, a quantized side's as centred halves read
    // through KvAtom<BITS, AW, KvCentredTile> (KvTileSide).
    typedef typename KvTileSide<KBITS, TKD>::elem TKE;
    typedef typename KvTileSide<KBITS, TKD>::atom TKA;
    typedef typename KvTileSide<VBITS, TVD>::elem TVE;
    typedef typename KvTileSide<VBITS, TVD>::atom TVA;
    KvTileRows<D, KNG, D, VNG> tile;
    tile.ok = tile_ok;
    tile.tt = TT;
    const threadgroup TKE* tkd = reinterpret_cast<const threadgroup TKE*>(tile_k);
    const threadgroup TKS* tks = reinterpret_cast<const threadgroup TKS*>(tile_ks);
    const threadgroup TVE* tvd = reinterpret_cast<const threadgroup TVE*>(tile_v);
    const threadgroup TVS* tvs = reinterpret_cast<const threadgroup TVS*>(tile_vs);
    const KvSteps unit = kv_unit_steps();
    for (int pass = 0; pass < ROW_PASSES; pass++) {
      const int row0 = (pass * NSG + sg) * RPS;
      kv_init_rows<D, RPS, LPK, KBITS>(st, q, row0, R, QL, len, head0, head_stride, token_stride, kl);
      if (SV) {  // from device memory (rarely in this split's tiles); each simdgroup owns its rows
        kv_seed_rows<D, RPS, LPK, KBITS, KGS, KAW, TKD>(st, src, kdata, kscales, kbiases, ksteps, seed_first, len - QL,
                                                    len, var, kl, kg, 0, KPP);
      }
      kv_load_tile<TT, D, KBITS, KAW, VBITS, VAW, KNG, VNG, TKD, TKS, TVD, TVS>(
          src, range.begin, 0, range.lo, range.hi, kdata, kscales, kbiases, vdata, vscales, vbiases, ksteps, vsteps,
          tile_k, tile_ks, tile_v, tile_vs, tile_ok, tid, NT);
      threadgroup_barrier(mem_flags::mem_threadgroup);
      int buffer = 0;
      for (int t0 = range.begin; t0 < range.hi; t0 += TT) {
        if (t0 + TT < range.hi) {
          kv_load_tile<TT, D, KBITS, KAW, VBITS, VAW, KNG, VNG, TKD, TKS, TVD, TVS>(
              src, t0 + TT, buffer ^ 1, range.lo, range.hi, kdata, kscales, kbiases, vdata, vscales, vbiases, ksteps,
              vsteps, tile_k, tile_ks, tile_v, tile_vs, tile_ok, tid, NT);
        }
        tile.t0 = t0;
        tile.buffer = buffer;
        for (int p0 = t0; p0 < t0 + TT; p0 += KPP) {
          const int t = p0 + kg;
          KvAt ka;
          KvAt va;
          const bool ok = t < t0 + TT && tile.locate(t, ka, va);
          const KvAtoms<KNA, KBITS, KAW, TKA> k =
              kv_fetch<D, LPK, KBITS, KGS, KAW, TKA>(tkd, tks, tks, ka, unit, ok, kl, kg);
          if (SV) {
            // The tile already holds V (copied with K): sparse V skips the
            // accumulation and the tile reads, not the device loads.
            kv_pass_sparse<D, RPS, LPK, KBITS, VBITS, VGS, VAW, TVA>(st, k, tvd, tvs, tvs, va, unit, t, ok, var,
                                                                sparse_v, kl, kg);
          } else {
            const KvAtoms<VNA, VBITS, VAW, TVA> v =
                kv_fetch<D, LPK, VBITS, VGS, VAW, TVA>(tvd, tvs, tvs, va, unit, ok, kl, kg);
            kv_pass<D, RPS, LPK, KBITS, VBITS>(st, k, v, t, ok, var, kl);
          }
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        buffer ^= 1;
      }
      kv_reduce_key_groups<RPS, LPK>(st, kg);
      kv_write_partials<D, R, QL, RPS, LPK, VAE4, VNA>(st, row0, lane, part_max, part_sum, part_acc, part_row0,
                                                       row_stride_g, row_stride_l, num_splits, split);
    }
    return;
  }

  // Register mode: merge the simdgroups' states, then simdgroup 0 writes the partials
  // (issue 41, P5). Simdgroups 1.. publish (m, l) and their unscaled accumulators for
  // a chunk of MC rows at once (KV_MERGE_ROWS: as many rows as KV_MERGE_FLOATS of
  // threadgroup memory hold: all 4 of G 4 at D 128), one barrier, and
  // simdgroup 0 folds them: 2 * ceil(RPS / MC) - 1 barriers a split (before: 1 + 2 RPS).
  // The fold is the same arithmetic in the same order as a merge row by row: s = 0,
  // 1, .. for (m, l), then each accumulator scaled by exp2(m_s - m) and added in order.
  if (NSG > 1) {
    constexpr int MC = KV_MERGE_ROWS(D, NSG, RPS);
    typedef KvScatter<5 - KvLog2<LPK>::value, VNA * VAE4> SL;  // the float4s each lane holds (kv_reduce_key_groups)
    const int slice0 = SL::base(kg);
    for (int c0 = 0; c0 < RPS; c0 += MC) {
      if (c0 > 0) {
        threadgroup_barrier(mem_flags::mem_threadgroup);  // simdgroup 0 has read the last chunk
      }
      if (sg > 0) {
        for (int i = 0; i < MC && c0 + i < RPS; i++) {
          const int r = c0 + i;
          if (lane == 0) {
            merge_stats[((sg - 1) * RPS + r) * 2] = st.m[r];
            merge_stats[((sg - 1) * RPS + r) * 2 + 1] = st.l[r];
          }
          if (SL::owner(kg)) {
            for (int u = 0; u < SL::N; u++) {
              const int f = slice0 + u;
              const int a = kl + LPK * (f / VAE4);
              if (a < D / VAE) {
                const float4 x = kv_o(st, r, u);
                for (int e = 0; e < 4; e++) {
                  merge_acc[((sg - 1) * MC + i) * D + a * VAE + 4 * (f % VAE4) + e] = x[e];
                }
              }
            }
          }
        }
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
      if (sg == 0) {
        for (int i = 0; i < MC && c0 + i < RPS; i++) {
          const int r = c0 + i;
          float m = st.m[r];
          float l = st.l[r];
          for (int s = 1; s < NSG; s++) {
            const KvSoftmaxMerge mg = kv_softmax_merge(m, merge_stats[((s - 1) * RPS + r) * 2]);
            l = l * mg.scale_a + merge_stats[((s - 1) * RPS + r) * 2 + 1] * mg.scale_b;
            m = mg.m;
          }
          // Only the lanes that write the partials (kv_write_partials) fold their float4s.
          if (SL::owner(kg)) {
            const float mine = kv_weight(st.m[r], m);
            float w[NSG];
            for (int s = 1; s < NSG; s++) {
              w[s] = kv_weight(merge_stats[((s - 1) * RPS + r) * 2], m);
            }
            for (int u = 0; u < SL::N; u++) {
              const int f = slice0 + u;
              const int a = kl + LPK * (f / VAE4);
              float4 x = kv_o(st, r, u) * mine;
              if (a < D / VAE) {
                for (int s = 1; s < NSG; s++) {
                  for (int e = 0; e < 4; e++) {
                    x[e] += merge_acc[((s - 1) * MC + i) * D + a * VAE + 4 * (f % VAE4) + e] * w[s];
                  }
                }
              }
              kv_o(st, r, u) = x;
            }
          }
          st.m[r] = m;
          st.l[r] = l;
        }
      }
    }
  }
  if (sg == 0) {
    kv_write_partials<D, R, QL, RPS, LPK, VAE4, VNA>(st, 0, lane, part_max, part_sum, part_acc, part_row0,
                                                     row_stride_g, row_stride_l, num_splits, split);
  }
}

// The split partials of one output row, for the reduces: splits [0, n0) at rows
// at0 + s of (max0, sum0, acc0), then splits [n0, n0 + n1) at at1 + s - n0 of
// (max1, sum1, acc1) (attention_reduce: n1 = 0; cascade_reduce: prefix, then own).
// The accumulators are in TP (kv_store_partial4): float32 as summed, or 16-bit and
// normalized by their sums (kv_fold_splits weights those by l).
template <int D, typename TP>
struct KvSplitParts {
  const device float* max0;
  const device float* sum0;
  const device TP* acc0;
  const device float* max1;
  const device float* sum1;
  const device TP* acc1;
  size_t at0;
  size_t at1;
  int n0;
  int n1;

  float part_max(int s) const {
    return s < n0 ? max0[at0 + s] : max1[at1 + (s - n0)];
  }
  float part_sum(int s) const {
    return s < n0 ? sum0[at0 + s] : sum1[at1 + (s - n0)];
  }
  float4 acc(int s, int chunk) const {
    return s < n0 ? kv_load4(acc0 + (at0 + s) * D + chunk * 4) : kv_load4(acc1 + (at1 + (s - n0)) * D + chunk * 4);
  }
};

// The reduce of one row's split partials and its sink (32 lanes; lane owns the D / 4
// chunks lane + 32 c of the accumulator, c < CPL), in two phases (issue 41, P2):
// 1. the row max M over the sink and the splits that saw a key (sum != 0), lanes
//    taking splits lane, lane + 32, ... in parallel, then one simd_max;
// 2. lane j takes split base + j of each block of 32: its sum l and weight w =
//    exp2(m - M) (exactly 1 for the split that holds M), one load of each and one
//    exp2 per lane; then every lane walks the block in order j = 0, 1, ..., taking
//    (l, w) by simd_shuffle: denominator += l w, its chunks += acc w (acc l w for a
//    16-bit TP, whose accumulators are normalized; float32 as before). The walk loads
//    only the accumulators, whose addresses depend on nothing it computes (before:
//    every lane loaded and weighted every split's max and sum), and the sum's order
//    is fixed: splits past a row's last window are skipped, so the result does
//    not depend on the launch's split count (batch invariance). A split with sum 0 is
//    never read further (an empty split writes no accumulator, P3); a NaN sum or max
//    propagates. Returns the denominator; o[c] holds the unnormalized output.
inline float kv_weight_to_max(float x, float m) {
  return x == m ? 1.0f : kv_weight(x, m);
}

template <int D, int CPL, typename TP>
inline float kv_fold_splits(thread const KvSplitParts<D, TP>& sp, int lane, bool has_sink, float sink_logit,
                            thread float4* o) {
  const int n = sp.n0 + sp.n1;
  float m = has_sink ? sink_logit : KV_NEG_BIG;
  for (int s = lane; s < n; s += 32) {
    if (sp.part_sum(s) != 0.0f) {
      m = max(m, sp.part_max(s));
    }
  }
  m = simd_max(m);
  float denom = has_sink ? kv_weight_to_max(sink_logit, m) : 0.0f;
  for (int c = 0; c < CPL; c++) {
    o[c] = float4(0.0f);
  }
  for (int base = 0; base < n; base += 32) {  // uniform
    const int mine = base + lane;
    const float l_mine = mine < n ? sp.part_sum(mine) : 0.0f;
    const float w_mine = l_mine != 0.0f ? kv_weight_to_max(sp.part_max(mine), m) : 0.0f;
    const int count = min(32, n - base);
    for (int j = 0; j < count; j++) {
      const float l = simd_shuffle(l_mine, ushort(j));
      if (l == 0.0f) {
        continue;  // a split that saw no key (uniform)
      }
      const float w = simd_shuffle(w_mine, ushort(j));
      denom += l * w;
      const float wa = sizeof(TP) < 4 ? l * w : w;  // the accumulator's weight (16-bit: normalized)
      for (int c = 0; c < CPL; c++) {
        const int chunk = lane + 32 * c;
        if (chunk < D / 4) {
          o[c] += sp.acc(base + j, chunk) * wa;
        }
      }
    }
  }
  return denom;
}

// The reduces' whole work on one row: fold its splits and sink (kv_fold_splits),
// then store this lane's chunks of the row, divided by the denominator (zeros
// for a row that saw no token), at `dst` in the output type TQ.
template <typename TQ, int D, typename TP, typename PO>
inline void kv_reduce_row(thread const KvSplitParts<D, TP>& sp, int lane, bool has_sink, float sink_logit, PO dst) {
  constexpr int CPL = (D / 4 + 31) / 32;
  float4 o[CPL];
  const float denom = kv_fold_splits<D, CPL, TP>(sp, lane, has_sink, sink_logit, o);
  const float inv_denom = denom > 0.0f ? 1.0f / denom : 0.0f;
  for (int c = 0; c < CPL; c++) {
    const int chunk = lane + 32 * c;
    if (chunk < D / 4) {
      kv_store4<TQ>(dst + chunk * 4, o[c] * inv_denom);
    }
  }
}

// The data element type of a cache array: the float type, or uint32 words.
template <int BITS, typename T>
struct KvDataType {
  typedef uint32_t type;
};
template <typename T>
struct KvDataType<0, T> {
  typedef T type;
};

// Threadgroup memory of the partial kernels, in uint4 / float / int units
// (kvmetal/backends/metal_layout.py mirrors these sizes in attention_threadgroup_bytes),
// declared at kernel scope (the only place MSL allows threadgroup variables, hence
// a macro) and gathered in `scratch` for kv_attend. Also names the cache's data
// types TKD / TVD and its row widths KW_ .. VNG_ for the body. Last in the helper
// section: the simulator bounds-checks `name[i]` of these arrays from here on.
#define KV_ATTN_SHARED (RPS < G * QL)
#define KV_TILE16(W, T) (KV_ATTN_SHARED ? (2 * TT * (W) * int(sizeof(T)) + 15) / 16 : 1)
#define KV_ATTN_THREADGROUP_ARRAYS                                                                              \
  typedef typename KvDataType<KBITS, TK>::type TKD;                                                           \
  typedef typename KvDataType<VBITS, TV>::type TVD;                                                           \
  constexpr int KW_ = KBITS ? D * KBITS / 32 : D;                                                             \
  constexpr int VW_ = VBITS ? D * VBITS / 32 : D;                                                             \
  constexpr int KNG_ = KBITS ? D / KGS : 1;                                                                   \
  constexpr int VNG_ = VBITS ? D / VGS : 1;                                                                   \
  constexpr int MERGE_STATS = KV_ATTN_SHARED || NSG == 1 ? 1 : KV_MERGE_SEEDS(NSG, RPS) + NSG * RPS;          \
  constexpr int MERGE_ACC = KV_ATTN_SHARED || NSG == 1 ? 1 : (NSG - 1) * KV_MERGE_ROWS(D, NSG, RPS) * D;      \
  typedef typename KvTileSide<KBITS, TKD>::elem TKE_;                                                        \
  typedef typename KvTileSide<VBITS, TVD>::elem TVE_;                                                        \
  constexpr int TILE_K = KV_TILE16(D, TKE_);                                                                  \
  constexpr int TILE_V = KV_TILE16(D, TVE_);                                                                  \
  constexpr int TILE_KS = KBITS ? KV_TILE16(2 * KNG_, TK) : 1;                                                \
  constexpr int TILE_VS = VBITS ? KV_TILE16(2 * VNG_, TV) : 1;                                                \
  constexpr int TILE_OK = KV_ATTN_SHARED ? 2 * TT : 1;                                                        \
  threadgroup float merge_stats[MERGE_STATS];                                                                 \
  threadgroup float merge_acc[MERGE_ACC];                                                                     \
  threadgroup uint4 tile_k[TILE_K];                                                                           \
  threadgroup uint4 tile_ks[TILE_KS];                                                                         \
  threadgroup uint4 tile_v[TILE_V];                                                                           \
  threadgroup uint4 tile_vs[TILE_VS];                                                                         \
  threadgroup int tile_ok[TILE_OK];                                                                           \
  const KvAttnScratch scratch = {merge_stats, merge_acc, tile_k, tile_ks, tile_v, tile_vs, tile_ok};

//@kernel paged_attention_partials
// Inputs:  query [S, L, H, D]; key_data [N, Hkv, BS, WK] (TK, or uint32 packed);
//          key_scales/key_biases [N, Hkv, BS, D/KGS] TK (8-element placeholders
//          for a float cache); value_* likewise; block_tables int32 [S, M];
//          seq_lens int32 [S]; params int32 KvAttnParams
// Outputs: part_max, part_sum float32 [S * L * H, splits]; part_acc TP [S * L * H, splits, D]
//          (float32 unnormalized, or 16-bit normalized: kv_store_partial4)
// Grid:    threadgroups (splits, Hkv, S), NSG * 32 threads each.
const device KvAttnParams& p = kv_params<KvAttnParams>(params);
const int split = int(threadgroup_position_in_grid.x);
const int kvh = int(threadgroup_position_in_grid.y);
const int seq = int(threadgroup_position_in_grid.z);
// Index guards: a length beyond the block table is cut to it; a negative one is 0.
const int len = clamp(seq_lens[seq], 0, p.max_blocks * BS);
const KvSplitRange range =
    kv_split_range(len, QL, p.window, split, p.num_splits, p.split_tokens, p.split_max, p.split_div, p.split_grow);
KV_ATTN_THREADGROUP_ARRAYS
KvPagedRows<BS, KW_, KNG_, VW_, VNG_, decltype(block_tables)> src;
src.init(block_tables, seq, kvh, p);
const KvSteps unit = kv_unit_steps();
kv_attend<D, G, QL, NSG, RPS, LPK, TT, KBITS, KGS, KAW, VBITS, VGS, VAW, PF, SV, TKD, TVD, TK, TV, TQ>(
    src, kv_query_view(query + size_t(seq) * QL * p.num_heads * D, kvh * G, D, p.num_heads * D),
    kv_cache_arrays(key_data, key_scales, key_biases, value_data, value_scales, value_biases, unit, unit), len,
    range, kv_scoring<SV>(p, p.window),
    kv_thread_ids(simdgroup_index_in_threadgroup, thread_index_in_simdgroup, thread_index_in_threadgroup), scratch,
    kv_partials_out(part_max, part_sum, part_acc, size_t(seq) * QL * p.num_heads + kvh * G, 1, p.num_heads,
                    p.num_splits, split));

//@kernel decode_attention_partials
// Inputs:  query [B, H, L, D] (row-contiguous); key_data [B, Hkv, T, WK] (TK, or
//          uint32 packed) read in place through key_data_strides (any view);
//          key_scales/key_biases [B, Hkv, T, D/KGS] (4-D placeholders for a float
//          cache); value_* likewise; params int32 KvAttnParams
// Outputs: part_max, part_sum float32 [B * H * L, splits]; part_acc TP [B * H * L, splits, D]
//          (float32 unnormalized, or 16-bit normalized: kv_store_partial4)
// Grid:    threadgroups (splits, Hkv, B), NSG * 32 threads each.
const device KvAttnParams& p = kv_params<KvAttnParams>(params);
const int split = int(threadgroup_position_in_grid.x);
const int kvh = int(threadgroup_position_in_grid.y);
const int batch = int(threadgroup_position_in_grid.z);
const int len = p.num_tokens;
const KvSplitRange range = kv_split_range(len, QL, 0, split, p.num_splits, p.split_tokens, p.split_max, p.split_div, p.split_grow);
KV_ATTN_THREADGROUP_ARRAYS
KvStridedRows src;
src.init(batch, kvh, key_data_strides, key_scales_strides, key_biases_strides, value_data_strides,
         value_scales_strides, value_biases_strides);
// The alignment guards' units: an atom (KAW words, or 4 elements) and 16 bytes.
const KvSteps ksteps = kv_strided_steps<KBITS ? KAW : 4, 16 / int(sizeof(TKD))>(
    key_data_strides, key_scales_strides, key_biases_strides);
const KvSteps vsteps = kv_strided_steps<VBITS ? VAW : 4, 16 / int(sizeof(TVD))>(
    value_data_strides, value_scales_strides, value_biases_strides);
kv_attend<D, G, QL, NSG, RPS, LPK, TT, KBITS, KGS, KAW, VBITS, VGS, VAW, PF, SV, TKD, TVD, TK, TV, TQ>(
    src, kv_query_view(query + size_t(batch) * p.num_heads * QL * D, kvh * G, QL * D, D),
    kv_cache_arrays(key_data, key_scales, key_biases, value_data, value_scales, value_biases, ksteps, vsteps), len,
    range, kv_scoring<SV>(p, 0),
    kv_thread_ids(simdgroup_index_in_threadgroup, thread_index_in_simdgroup, thread_index_in_threadgroup), scratch,
    kv_partials_out(part_max, part_sum, part_acc, size_t(batch) * p.num_heads * QL + kvh * G * QL, QL, 1,
                    p.num_splits, split));

//@kernel attention_reduce
// Inputs:  part_max, part_sum float32 [R, splits] (max in log2 units); part_acc
//          TP [R, splits, D] (16-bit: normalized); sinks float32 [H] (ignored unless HAS_SINKS);
//          params int32 KvAttnParams
// Outputs: out [R, D] TQ (the caller reshapes it); a row that saw no token is 0.
// Grid:    one threadgroup of 32 threads per row r; its head is (r / head_div) % H.
const device KvAttnParams& p = kv_params<KvAttnParams>(params);
const int row = int(threadgroup_position_in_grid.x);
const int lane = int(thread_index_in_threadgroup);
const int num_splits = p.num_splits;
const int head = (row / p.head_div) % p.num_heads;
// The splits and the sink (a logit with no value), in kv_fold_splits' two phases.
KvSplitParts<D, TP> sp;
sp.max0 = part_max;
sp.sum0 = part_sum;
sp.acc0 = part_acc;
sp.max1 = part_max;
sp.sum1 = part_sum;
sp.acc1 = part_acc;
sp.at0 = size_t(row) * num_splits;
sp.at1 = 0;
sp.n0 = num_splits;
sp.n1 = 0;
kv_reduce_row<TQ, D>(sp, lane, HAS_SINKS, HAS_SINKS ? kv_sink_logit(sinks[head]) : KV_NEG_BIG,
                     out + size_t(row) * D);
