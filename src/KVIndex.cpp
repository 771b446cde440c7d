#include <kvindex/KVIndex.h>

#include <cmath>
#include <cstring>
#include <vector>

#include <faiss/impl/FaissAssert.h>

#include <kvindex/KVStorage.h>
#include <kvindex/attention.h>

#include "checks.h"
#include "parallel.h"

namespace kvindex {

KVIndex::KVIndex(int d, int d_value)
        : faiss::Index(d, faiss::METRIC_INNER_PRODUCT),
          d_value(d_value < 0 ? d : d_value) {
    FAISS_THROW_IF_NOT_FMT(d >= 0, "KVIndex: key dimension d=%d must be > 0", d);
}

KVIndex::~KVIndex() = default;

void KVIndex::add(idx_t, const float*) {
    FAISS_THROW_MSG(
            "KVIndex::add: values missing; a KV index stores keys with their "
            "values, use add_kv(n, keys, values)");
}

void KVIndex::add_kv(idx_t n, const float* keys, const float* values) {
    FAISS_THROW_IF_NOT_FMT(n >= 0, "add_kv: n=%zd must be >= 0", size_t(n));
    if (n == 0) {
        return;
    }
    FAISS_THROW_IF_NOT_FMT(
            d > 0 && d_value > 0,
            "add_kv: index has invalid dimensions d=%d d_value=%d",
            d,
            d_value);
    check_not_null(keys, "add_kv: keys");
    check_not_null(values, "add_kv: values");
    check_finite(keys, n, d, "add_kv: keys");
    check_finite(values, n, d_value, "add_kv: values");
    add_kv_impl(n, keys, values);
    ntotal += n;
}

void KVIndex::check_prefill(const PrefillInput& in) const {
    FAISS_THROW_IF_NOT_FMT(
            ntotal == 0,
            "prefill: the index already holds %zd tokens; prefill starts an "
            "empty cache (use add_kv to append)",
            size_t(ntotal));
    check_rope_params(in.rope, d);
    FAISS_THROW_IF_NOT_FMT(
            !has_rope || in.rope == rope,
            "prefill: RoPE parameters mismatch: index has theta=%g style=%s, "
            "prefill has theta=%g style=%s",
            rope.theta,
            rope_style_name(rope.style),
            in.rope.theta,
            rope_style_name(in.rope.style));
    FAISS_THROW_IF_NOT_FMT(
            in.n_tokens >= 0, "prefill: n_tokens=%zd must be >= 0", size_t(in.n_tokens));
    FAISS_THROW_IF_NOT_FMT(
            in.first_position >= 0,
            "prefill: first_position=%zd must be >= 0",
            size_t(in.first_position));
    if (in.n_tokens > 0) {
        check_not_null(in.keys, "prefill: keys");
        check_not_null(in.values, "prefill: values");
        check_finite(in.keys, in.n_tokens, d, "prefill: keys");
        check_finite(in.values, in.n_tokens, d_value, "prefill: values");
    }
    FAISS_THROW_IF_NOT_FMT(
            in.n_queries >= 0, "prefill: n_queries=%zd must be >= 0", size_t(in.n_queries));
    if (in.n_queries > 0) {
        FAISS_THROW_IF_NOT_FMT(
                in.n_query_heads >= 1,
                "prefill: n_query_heads=%d must be >= 1",
                in.n_query_heads);
        check_not_null(in.queries, "prefill: queries");
        check_finite(in.queries, in.n_queries * in.n_query_heads, d, "prefill: queries");
        if (in.query_positions) {
            for (idx_t i = 0; i < in.n_queries; i++) {
                FAISS_THROW_IF_NOT_FMT(
                        in.query_positions[i] >= 0,
                        "prefill: query_positions[%zd]=%zd must be >= 0",
                        size_t(i),
                        size_t(in.query_positions[i]));
            }
        } else {
            FAISS_THROW_IF_NOT_FMT(
                    in.n_queries <= in.first_position + in.n_tokens,
                    "prefill: %zd queries without positions, but the prompt "
                    "has only %zd tokens",
                    size_t(in.n_queries),
                    size_t(in.first_position + in.n_tokens));
        }
    }
}

void KVIndex::prefill(const PrefillInput& in) {
    check_prefill(in); // checks the tokens too: append them directly
    if (in.n_tokens > 0) {
        add_kv_impl(in.n_tokens, in.keys, in.values);
        ntotal += in.n_tokens;
    }
    // recorded only now, so that a refused prefill fixes nothing
    rope = in.rope;
    has_rope = true;
}

void KVIndex::check_params(const faiss::SearchParameters* params) const {
    if (!params) {
        return;
    }
    FAISS_THROW_IF_NOT_MSG(
            params->sel == nullptr, "search parameters: IDSelector is not supported by KV indexes");
    if (auto p = dynamic_cast<const SearchParametersKV*>(params)) {
        FAISS_THROW_IF_NOT_FMT(
                p->k >= 0,
                "search parameters: k=%zd must be > 0 (0: index default)",
                size_t(p->k));
    }
}

idx_t KVIndex::effective_k(const faiss::SearchParameters* params) const {
    check_params(params);
    idx_t kk = k;
    if (auto p = dynamic_cast<const SearchParametersKV*>(params)) {
        if (p->k > 0) {
            kk = p->k;
        }
    }
    FAISS_THROW_IF_NOT_FMT(kk > 0, "top-k budget k=%zd must be > 0", size_t(kk));
    return kk;
}

namespace {

const KVStorage& storage_for(const KVIndex* index, const KVStorage* st, idx_t key, const char* what) {
    FAISS_THROW_IF_NOT_FMT(st, "%s: not supported by this index type", what);
    FAISS_THROW_IF_NOT_FMT(
            key >= 0 && key < index->ntotal,
            "%s: id %zd out of [0, %zd)",
            what,
            size_t(key),
            size_t(index->ntotal));
    return *st;
}

} // namespace

void KVIndex::reconstruct(idx_t key, float* recons) const {
    const KVStorage& st = storage_for(this, token_storage(), key, "reconstruct");
    std::memcpy(recons, st.key(key), sizeof(float) * d);
}

void KVIndex::reconstruct_value(idx_t key, float* value) const {
    const KVStorage& st = storage_for(this, token_storage(), key, "reconstruct_value");
    std::memcpy(value, st.value(key), sizeof(float) * d_value);
}

float KVIndex::score_scale() const {
    return float(1.0 / std::sqrt(double(d)));
}

void KVIndex::check_query_args(idx_t n, const float* q, const char* what) const {
    FAISS_THROW_IF_NOT_FMT(n >= 0, "%s: n=%zd must be >= 0", what, size_t(n));
    if (n == 0) {
        return;
    }
    check_not_null(q, what);
    check_finite(q, n, d, what);
}

void KVIndex::check_search_args(
        idx_t n, const float* q, idx_t k, const faiss::SearchParameters* params) const {
    FAISS_THROW_IF_NOT_FMT(k > 0, "search: k=%zd must be > 0", size_t(k));
    check_query_args(n, q, "search: queries");
    check_params(params);
}

void KVIndex::check_attend_args(idx_t n, const float* q, const float* out) const {
    check_query_args(n, q, "attend: queries");
    FAISS_THROW_IF_NOT_MSG(ntotal > 0, "attend: the index is empty (ntotal=0)");
    check_not_null(out, "attend: out");
}

void KVIndex::attend(
        idx_t n,
        const float* q,
        float* out,
        float* lse,
        const faiss::SearchParameters* params) const {
    check_attend_args(n, q, out);
    const KVStorage* st = token_storage();
    FAISS_THROW_IF_NOT_MSG(st, "attend: this index type must override attend");
    std::vector<Selection> sel(n);
    select(n, q, sel.data(), params);
    parallel_for(n, [&](idx_t i) {
        float l = estimate_attention(
                estimator,
                q + i * d,
                st->keys.data(),
                st->values.data(),
                d,
                d_value,
                sel[i],
                out + i * d_value);
        if (lse) {
            lse[i] = l;
        }
    });
}

} // namespace kvindex
