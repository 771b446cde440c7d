// dense_attention_group: fused dense attention of a group of queries (the
// query heads of one GQA group, or a batch of queries) over the same keys
// and values, one pass over them. Included by kernels_body.h inside the
// per-instruction-set namespace, after the helpers it reuses (load, store,
// splat, dot, axpy, axpy4, max_of, exp_shift_sum, prefetch_lines).
//
// Why a kernel of its own: dense attention of one query reads 4 bytes of
// key and 4 of value per multiply-add, so it runs at the read bandwidth;
// a GQA group of g query heads calling it g times reads the same keys and
// values g times. Here each tile of keys is read from memory once and
// scored against every query of the group while it sits in L1, and each
// block of values is read once and accumulated into every query's output.
//
// Scores: W keys against one query at a time, W accumulators (one per key)
// reduced together by a transposing fold (about 3 shuffles and adds per
// score instead of a full horizontal sum each), so that the extra queries
// cost arithmetic on data already in L1, not memory traffic.

namespace {

/// 0, 1, ..., N - 1 as a pack (std::index_sequence without including
/// <utility> inside this namespace).
template <size_t... K>
struct lane_seq {};
template <size_t N, size_t... K>
struct make_lane_seq : make_lane_seq<N - 1, N - 1, K...> {};
template <size_t... K>
struct make_lane_seq<0, K...> {
    using type = lane_seq<K...>;
};

/// Half of one fold step: x and y each hold W / S accumulators of S lanes;
/// lane K of the result takes, for accumulator K / (S / 2) of the
/// concatenation x || y, its lane Off + K % (S / 2). (__builtin_shufflevector
/// with constant lanes: GCC 12 and clang both have it, GCC's
/// __builtin_shuffle clang has not.)
template <size_t S, size_t Off, size_t... K>
inline vf fold_half(vf x, vf y, lane_seq<K...>) {
    return __builtin_shufflevector(x, y, int((K / (S / 2)) * S + K % (S / 2) + Off)...);
}

/// One fold step: W / S accumulators of S lanes in each of x and y become
/// 2W / S accumulators of S / 2 lanes in the result (x's first, in order).
template <size_t S>
inline vf fold_pair(vf x, vf y) {
    using lanes = typename make_lane_seq<W>::type;
    return fold_half<S, 0>(x, y, lanes{}) + fold_half<S, S / 2>(x, y, lanes{});
}

/// Folds N vectors of W / N accumulators of S lanes each, until one vector
/// holds W single-lane sums.
template <size_t S, size_t N>
inline void fold_levels(vf* a) {
    if constexpr (S > 1) {
        for (size_t i = 0; i < N / 2; i++) {
            a[i] = fold_pair<S>(a[2 * i], a[2 * i + 1]);
        }
        fold_levels<S / 2, N / 2>(a);
    }
}

/// All lanes x. (splat's vf{} + x costs an addition: x + 0 is not x for
/// x = -0; x - 0 is, so the compiler drops the subtraction.)
inline vf bcast(float x) {
    return x - vf{};
}

/// s[r] = scale * <q, x_r> for the W rows x_r = x + r * D, D a multiple
/// of W known at compile time (the row addresses are constant offsets).
template <size_t D, class T>
inline void dot_tile_fixed(const float* q, const T* x, float scale, float* s) {
    static_assert(D % W == 0, "whole vectors");
    vf acc[W];
    vf q0 = load(q);
    for (size_t r = 0; r < W; r++) {
        acc[r] = q0 * load(x + r * D);
    }
    for (size_t j = W; j < D; j += W) {
        vf qv = load(q + j);
        for (size_t r = 0; r < W; r++) {
            acc[r] += qv * load(x + r * D + j);
        }
    }
    fold_levels<W, W>(acc);
    store(s, acc[0] * bcast(scale));
}

/// dot_tile_fixed for any d.
template <class T>
inline void dot_tile(const float* q, const T* x, size_t d, float scale, float* s) {
    vf acc[W];
    for (size_t r = 0; r < W; r++) {
        acc[r] = vf{};
    }
    size_t j = 0;
    for (; j + W <= d; j += W) {
        vf qv = load(q + j);
        for (size_t r = 0; r < W; r++) {
            acc[r] += qv * load(x + r * d + j);
        }
    }
    fold_levels<W, W>(acc);
    vf sv = acc[0];
    if (j < d) {
        // d not a multiple of the width: the last coordinates one by one
        for (size_t r = 0; r < W; r++) {
            float t = 0;
            for (size_t jj = j; jj < d; jj++) {
                t += q[jj] * to_float(x[r * d + jj]);
            }
            sv[r] += t;
        }
    }
    store(s, sv * bcast(scale));
}

/// Queries served by one pass of the group kernel: their score blocks
/// (kGroupChunk x kBlock floats, 8 KiB) stay in L1 with the tile of keys.
constexpr size_t kGroupChunk = 8;
/// Prefetch distance of the group kernel, in stored elements (2 KiB of
/// float32: 8 rows of d = 64). It
/// computes g times more per byte than dense_attention, so it needs its
/// lines sooner; longer distances measured slower (8k and 128k tokens).
constexpr size_t kGroupPrefetchFloats = 512;
/// Tokens per block of the online softmax, as dense_attention.
constexpr size_t kBlock = 256;

/// out_c[j0 .. j0 + V W) += sum_i s[c][i] * v_i[j0 .. j0 + V W) for the G
/// queries c, rows v_i = vb + i * dv, i < nb: the G x V accumulators stay
/// in registers over the block, so each value row is loaded once for all
/// the queries. Each output element sums its rows in order, whatever G
/// and V are (a query's result does not depend on its chunk).
template <size_t G, size_t V, class T>
inline void accumulate_strip(
        const float (*s)[kBlock], const T* vb, size_t dv, size_t nb, size_t j0, float* out) {
    vf o[G][V];
    for (size_t c = 0; c < G; c++) {
        for (size_t k = 0; k < V; k++) {
            o[c][k] = load(out + c * dv + j0 + k * W);
        }
    }
    for (size_t i = 0; i < nb; i++) {
        const T* row = vb + i * dv + j0;
        if (j0 == 0) {
            prefetch_lines(row + kGroupPrefetchFloats, dv * sizeof(T));
        }
        vf v[V];
        for (size_t k = 0; k < V; k++) {
            v[k] = load(row + k * W);
        }
        for (size_t c = 0; c < G; c++) {
            vf w = bcast(s[c][i]);
            for (size_t k = 0; k < V; k++) {
                o[c][k] += w * v[k];
            }
        }
    }
    for (size_t c = 0; c < G; c++) {
        for (size_t k = 0; k < V; k++) {
            store(out + c * dv + j0 + k * W, o[c][k]);
        }
    }
}

/// accumulate_strip over all of dv: strips of V vectors as wide as the
/// registers allow for G queries, then single vectors, then the last
/// dv % W coordinates one by one.
template <size_t G, class T>
inline void accumulate_group_g(
        const float (*s)[kBlock], const T* vb, size_t dv, size_t nb, float* out) {
    // accumulators G x V plus V loaded rows must fit the register file
    // (32 vectors with AVX-512, 16 otherwise)
    constexpr size_t regs = W == 16 ? 28 : 14;
    constexpr size_t V0 = (regs - 1) / (G + 1);
    // (whole cache lines per strip: 1, 2 or 4 vectors)
    constexpr size_t V = V0 >= 4 ? 4 : V0 >= 2 ? 2 : 1;
    size_t j = 0;
    for (; j + V * W <= dv; j += V * W) {
        accumulate_strip<G, V>(s, vb, dv, nb, j, out);
    }
    for (; j + W <= dv; j += W) {
        accumulate_strip<G, 1>(s, vb, dv, nb, j, out);
    }
    for (; j < dv; j++) {
        for (size_t c = 0; c < G; c++) {
            float o = out[c * dv + j];
            for (size_t i = 0; i < nb; i++) {
                o += s[c][i] * to_float(vb[i * dv + j]);
            }
            out[c * dv + j] = o;
        }
    }
}

template <class T>
inline void accumulate_group(
        const float (*s)[kBlock], size_t g, const T* vb, size_t dv, size_t nb, float* out) {
    switch (g) {
        case 1: accumulate_group_g<1>(s, vb, dv, nb, out); break;
        case 2: accumulate_group_g<2>(s, vb, dv, nb, out); break;
        case 3: accumulate_group_g<3>(s, vb, dv, nb, out); break;
        case 4: accumulate_group_g<4>(s, vb, dv, nb, out); break;
        case 5: accumulate_group_g<5>(s, vb, dv, nb, out); break;
        case 6: accumulate_group_g<6>(s, vb, dv, nb, out); break;
        case 7: accumulate_group_g<7>(s, vb, dv, nb, out); break;
        default: accumulate_group_g<8>(s, vb, dv, nb, out); break;
    }
}

/// The group kernel for g <= kGroupChunk queries, rows stored as T.
template <class T>
inline void dense_attention_group_chunk(
        const float* q,
        size_t g,
        const T* keys,
        const T* values,
        size_t d,
        size_t dv,
        size_t n,
        float scale,
        float* out,
        float* lse) {
    constexpr size_t B = kBlock;
    alignas(64) float s[kGroupChunk][B];
    float m[kGroupChunk], sum[kGroupChunk];
    for (size_t c = 0; c < g; c++) {
        m[c] = -std::numeric_limits<float>::infinity();
        sum[c] = 0;
    }
    std::memset(out, 0, sizeof(float) * g * dv);
    for (size_t i0 = 0; i0 < n; i0 += B) {
        size_t nb = n - i0 < B ? n - i0 : B;
        const T* kb = keys + i0 * d;
        // scores: each tile of W keys comes from memory once, then serves
        // every query from L1
        size_t i = 0;
        for (; i + W <= nb; i += W) {
            const T* kt = kb + i * d;
            prefetch_lines(kt + kGroupPrefetchFloats, W * d * sizeof(T));
            // the head dimensions of the models we serve get constant offsets
            if (d == 64) {
                for (size_t c = 0; c < g; c++) {
                    dot_tile_fixed<64>(q + c * d, kt, scale, s[c] + i);
                }
            } else if (d == 128) {
                for (size_t c = 0; c < g; c++) {
                    dot_tile_fixed<128>(q + c * d, kt, scale, s[c] + i);
                }
            } else {
                for (size_t c = 0; c < g; c++) {
                    dot_tile(q + c * d, kt, d, scale, s[c] + i);
                }
            }
        }
        for (; i < nb; i++) {
            for (size_t c = 0; c < g; c++) {
                s[c][i] = scale * dot(q + c * d, kb + i * d, d);
            }
        }
        // online softmax, per query as in dense_attention
        for (size_t c = 0; c < g; c++) {
            float mb = max_of(s[c], nb);
            if (mb > m[c]) {
                float r = exp_s(m[c] - mb);
                sum[c] *= r;
                if (r != 1.0f) {
                    float* oc = out + c * dv;
                    for (size_t j = 0; j < dv; j++) {
                        oc[j] *= r;
                    }
                }
                m[c] = mb;
            }
            sum[c] += exp_shift_sum(s[c], nb, m[c]);
        }
        // values: each row read once, accumulated into every output
        accumulate_group(s, g, values + i0 * dv, dv, nb, out);
    }
    for (size_t c = 0; c < g; c++) {
        if (n == 0) {
            lse[c] = m[c];
            continue;
        }
        float inv = 1.0f / sum[c];
        float* oc = out + c * dv;
        for (size_t j = 0; j < dv; j++) {
            oc[j] *= inv;
        }
        lse[c] = m[c] + std::log(sum[c]);
    }
}

template <class T>
void dense_attention_group_t(
        const float* q,
        size_t g,
        const void* keys_v,
        const void* values_v,
        size_t d,
        size_t dv,
        size_t n,
        float scale,
        float* out,
        float* lse) {
    const T* keys = static_cast<const T*>(keys_v);
    const T* values = static_cast<const T*>(values_v);
    for (size_t c0 = 0; c0 < g; c0 += kGroupChunk) {
        size_t gc = g - c0 < kGroupChunk ? g - c0 : kGroupChunk;
        dense_attention_group_chunk(
                q + c0 * d, gc, keys, values, d, dv, n, scale, out + c0 * dv, lse + c0);
    }
}

} // namespace
