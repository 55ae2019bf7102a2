// The int8 GEMM kernels of qgemm.cpp, once per instruction set: qgemm.cpp includes this file in
// a namespace per target (no include guard on purpose), after defining in that namespace
//   constexpr bool kOffset;  // packed products take x + 128 as unsigned bytes, then subtract 128·Σw
//   __m256i dot_packed(__m256i acc, __m256i x_aux, __m256i x_q, __m256i w);  // acc + Σ of 4 products a lane
//   __m256i dot_sign(__m256i acc, __m256i x_abs, __m256i x_q, __m256i w);    // the same, from |x| and sign(w, x)
// where x_aux is |x| (kOffset false) or x + 128 (kOffset true). Every variant sums the same
// products exactly in int32, so all give the same results bit for bit.

// C[XR rows, NR panels of 8 columns (the last cut at `width`)]: per 4 k, x's 4 bytes broadcast
// against each panel's [8][4] bytes, so each int32 lane sums one output (no horizontal sums).
// wsum: the panels' row sums (qgemm_pack), for the offset's correction.
template <int NR, int XR>
void packed_kernel(const RowsX& qx, int64_t r0, const int8_t* w, int64_t panel_bytes, int64_t groups,
                   const int32_t* wsum, const float* scale, int64_t width, float beta, float* C, int64_t ldc) {
  __m256i acc[XR][NR];
  for (int r = 0; r < XR; ++r)
    for (int i = 0; i < NR; ++i) acc[r][i] = _mm256_setzero_si256();
  const int8_t* xq = qx.q + r0 * qx.ld;
  for (int64_t g = 0; g < groups; ++g) {
    __m256i wv[NR];
    for (int i = 0; i < NR; ++i)
      wv[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + i * panel_bytes + 32 * g));
    for (int r = 0; r < XR; ++r) {
      const __m256i xs = broadcast4(xq + r * qx.ld + 4 * g);
      const __m256i xa = broadcast4(xq + r * qx.ld + qx.abs_off + 4 * g);
      for (int i = 0; i < NR; ++i) acc[r][i] = dot_packed(acc[r][i], xa, xs, wv[i]);
    }
  }
  if (kOffset) {  // Σ (x + 128)·w = Σ x·w + 128·Σ w
    for (int i = 0; i < NR; ++i) {
      const __m256i correction =
          _mm256_slli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wsum + kPanel * i)), 7);
      for (int r = 0; r < XR; ++r) acc[r][i] = _mm256_sub_epi32(acc[r][i], correction);
    }
  }
  for (int r = 0; r < XR; ++r) {
    const float sx = qx.sx[r0 + r];
    float* c = C + (r0 + r) * ldc;
    for (int i = 0; i < NR; ++i) {
      const int64_t n = kPanel * i;
      put_outputs8(acc[r][i], sx, scale + n, width - n, beta, c + n);
    }
  }
}

template <int NR>
inline void packed_rows(int xr, const RowsX& qx, int64_t r0, const int8_t* w, int64_t panel_bytes, int64_t groups,
                        const int32_t* wsum, const float* scale, int64_t width, float beta, float* C, int64_t ldc) {
  switch (xr) {
    case 1: return packed_kernel<NR, 1>(qx, r0, w, panel_bytes, groups, wsum, scale, width, beta, C, ldc);
    case 2: return packed_kernel<NR, 2>(qx, r0, w, panel_bytes, groups, wsum, scale, width, beta, C, ldc);
    case 3: return packed_kernel<NR, 3>(qx, r0, w, panel_bytes, groups, wsum, scale, width, beta, C, ldc);
    case 4: return packed_kernel<NR, 4>(qx, r0, w, panel_bytes, groups, wsum, scale, width, beta, C, ldc);
    default: return;
  }
}

// Columns [0, width) of rows [r0, r0 + xr) from panels w, w + panel_bytes, ...: np ≤ kNR panels.
inline void packed_block(int np, int xr, const RowsX& qx, int64_t r0, const int8_t* w, int64_t panel_bytes,
                         int64_t groups, const int32_t* wsum, const float* scale, int64_t width, float beta, float* C,
                         int64_t ldc) {
  switch (np) {
    case 1: return packed_rows<1>(xr, qx, r0, w, panel_bytes, groups, wsum, scale, width, beta, C, ldc);
    case 2: return packed_rows<2>(xr, qx, r0, w, panel_bytes, groups, wsum, scale, width, beta, C, ldc);
    case 3: return packed_rows<3>(xr, qx, r0, w, panel_bytes, groups, wsum, scale, width, beta, C, ldc);
    default: return;
  }
}

// One row of X (a batch of one) against np ≤ NP panels: each accumulator takes one product per
// group, so kNR panels would wait on vpdpbusd's latency; kOneRowPanels keep that many chains going.
template <int NP = kOneRowPanels>
inline void one_row_block(int np, const RowsX& qx, const int8_t* w, int64_t panel_bytes, int64_t groups,
                          const int32_t* wsum, const float* scale, int64_t width, float beta, float* C, int64_t ldc) {
  if (np == NP) return packed_kernel<NP, 1>(qx, 0, w, panel_bytes, groups, wsum, scale, width, beta, C, ldc);
  if constexpr (NP > 1) one_row_block<NP - 1>(np, qx, w, panel_bytes, groups, wsum, scale, width, beta, C, ldc);
}

// qgemm_nt_packed for rows, N, K > 0.
void packed(const float* X, int64_t rows, int64_t ldx, const int8_t* packed, const float* scale, int64_t N, int64_t K,
            float beta, float* C, int64_t ldc) {
  thread_local Scratch scratch;
  RowsX qx;
  quantize_rows<kOffset>(X, rows, ldx, K, scratch, qx);
  const int64_t groups = groups_of(K), panel_bytes = groups * 4 * kPanel;
  const int64_t panels = (N + kPanel - 1) / kPanel;
  const int32_t* wsum = packed_sums(packed, N, K);
  const int64_t tile = std::max<int64_t>(kNR, kTileBytes / panel_bytes);  // panels per N tile (L2)
  const int64_t grain = std::max<int64_t>(1, kGrain / (kPanel * K * rows));
  at::parallel_for(0, panels, grain, [&](int64_t begin, int64_t end) {
    if (rows == 1) {
      for (int64_t p = begin; p < end; p += kOneRowPanels) {
        const int np = int(std::min<int64_t>(kOneRowPanels, end - p));
        const int64_t n = kPanel * p;
        one_row_block(np, qx, packed + p * panel_bytes, panel_bytes, groups, wsum + n, scale + n,
                      std::min(kPanel * np, N - n), beta, C + n, ldc);
      }
      return;
    }
    for (int64_t t0 = begin; t0 < end; t0 += tile) {
      const int64_t t1 = std::min(end, t0 + tile);
      for (int64_t r0 = 0; r0 < rows; r0 += kXR) {
        const int xr = int(std::min<int64_t>(kXR, rows - r0));
        for (int64_t p = t0; p < t1; p += kNR) {
          const int np = int(std::min<int64_t>(kNR, t1 - p));
          const int64_t n = kPanel * p;
          packed_block(np, xr, qx, r0, packed + p * panel_bytes, panel_bytes, groups, wsum + n, scale + n,
                       std::min(kPanel * np, N - n), beta, C + n, ldc);
        }
      }
    }
  });
}

// Horizontal sum of 8 int32 lanes.
inline int32_t lane_sum(__m256i v) {
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
  return _mm_cvtsi128_si32(t);
}

// Rows [r0, r0 + XR) of the quantized X against row-major M (no packing), MR rows of M at a time:
// each 32 bytes of M read once for the XR rows, one horizontal sum per output; M's last partial
// 32 bytes go through a zeroed copy (never read past K).
template <int MR, int XR>
void unpacked_rows(const RowsX& qx, int64_t r0, const QuantizedRows& M, int64_t N, int64_t K, float beta, float* C,
                   int64_t ldc) {
  const int64_t chunks = (K + 31) / 32, full = K / 32, tail = K - 32 * full;
  at::parallel_for(0, (N + MR - 1) / MR, std::max<int64_t>(1, kGrain / (MR * XR * K)), [&](int64_t begin, int64_t end) {
    for (int64_t n = MR * begin; n < std::min(N, MR * end); n += MR) {
      const int rows_m = int(std::min<int64_t>(MR, N - n));
      __m256i acc[MR][XR];
      for (int j = 0; j < MR; ++j)
        for (int r = 0; r < XR; ++r) acc[j][r] = _mm256_setzero_si256();
      for (int64_t c = 0; c < chunks; ++c) {
        __m256i w[MR];
        for (int j = 0; j < MR; ++j) {
          const int8_t* row = M.data + (n + std::min(j, rows_m - 1)) * M.ld + 32 * c;  // past N: a repeat, unused
          if (c < full) {
            w[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row));
          } else {
            alignas(32) int8_t part[32] = {};
            std::memcpy(part, row, tail);
            w[j] = _mm256_load_si256(reinterpret_cast<const __m256i*>(part));
          }
        }
        for (int r = 0; r < XR; ++r) {
          const int8_t* xq = qx.q + (r0 + r) * qx.ld + 32 * c;
          const __m256i q = _mm256_load_si256(reinterpret_cast<const __m256i*>(xq));
          const __m256i a = _mm256_load_si256(reinterpret_cast<const __m256i*>(xq + qx.abs_off));
          for (int j = 0; j < MR; ++j) acc[j][r] = dot_sign(acc[j][r], a, q, w[j]);
        }
      }
      for (int r = 0; r < XR; ++r) {
        const float sx = qx.sx[r0 + r];
        float* out = C + (r0 + r) * ldc;
        for (int j = 0; j < rows_m; ++j) put_output(sx, M.scale[n + j], lane_sum(acc[j][r]), beta, out + n + j);
      }
    }
  });
}

// qgemm_unpacked for rows, N, K > 0: one row four rows of M at a time; more, up to four rows of X
// against two rows of M at a time (the accumulators fit the registers).
void unpacked(const float* X, int64_t rows, int64_t ldx, const QuantizedRows& M, int64_t N, int64_t K, float beta,
              float* C, int64_t ldc) {
  thread_local Scratch scratch;
  RowsX qx;
  quantize_rows<false>(X, rows, ldx, K, scratch, qx);
  for (int64_t r0 = 0; r0 < rows; r0 += 4) {
    switch (std::min<int64_t>(4, rows - r0)) {
      case 1: unpacked_rows<4, 1>(qx, r0, M, N, K, beta, C, ldc); break;
      case 2: unpacked_rows<2, 2>(qx, r0, M, N, K, beta, C, ldc); break;
      case 3: unpacked_rows<2, 3>(qx, r0, M, N, K, beta, C, ldc); break;
      default: unpacked_rows<2, 4>(qx, r0, M, N, K, beta, C, ldc); break;
    }
  }
}
