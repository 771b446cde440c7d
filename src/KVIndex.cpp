#include <kvindex/KVIndex.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <string>
#include <typeinfo>
#include <utility>
#include <vector>

#include <faiss/impl/FaissAssert.h>

#include <kvindex/KVStorage.h>
#include <kvindex/attention.h>
#include <kvindex/kernels.h>

#include "checks.h"
#include "parallel.h"

namespace kvindex {

KVIndex::KVIndex(int d, int d_value, KVType kv_type)
        : faiss::Index(d, faiss::METRIC_INNER_PRODUCT),
          d_value(d_value < 0 ? d : d_value),
          kv_type(kv_type) {
    // d = 0 is the empty index read_index fills in
    FAISS_THROW_IF_NOT_FMT(d >= 0, "KVIndex: key dimension d=%d must be >= 0", d);
    stamp_tokens();
}

KVIndex::~KVIndex() = default;

// ---- the thread-safety contract --------------------------------------------

ReadScope::ReadScope(const KVIndex& index, const char* what)
        : ReadScope(index.access_, what, "this index") {}

ReadScope::ReadScope(AccessCount& calls, const char* what, const char* where) : calls_(calls) {
    std::atomic<int64_t>& state = calls.state;
    int64_t s = state.load(std::memory_order_relaxed);
    do {
        if (s < 0) {
            KVINDEX_THROW_FMT(
                    CallRefused,
                    "%s: refused, a write (add_kv, prefill, reset or a knob change) is "
                    "running on %s in another thread; writes must not overlap "
                    "other calls on one index (KVIndex.h, thread safety)",
                    what,
                    where);
        }
    } while (!state.compare_exchange_weak(s, s + 1, std::memory_order_acquire));
}

ReadScope::~ReadScope() {
    calls_.state.fetch_sub(1, std::memory_order_release);
}

WriteScope::WriteScope(KVIndex& index, const char* what)
        : WriteScope(index.access_, what, "this index") {}

WriteScope::WriteScope(KVIndex& index, const char* what, const char* where)
        : WriteScope(index.access_, what, where) {}

WriteScope::WriteScope(AccessCount& calls, const char* what, const char* where) : calls_(calls) {
    int64_t s = 0;
    if (!calls.state.compare_exchange_strong(s, -1, std::memory_order_acquire)) {
        std::string running = s < 0
                ? std::string("another write is")
                : std::to_string(s) + " const calls (search, attend, ...) are";
        KVINDEX_THROW_FMT(
                CallRefused,
                "%s: refused, %s running on %s in another thread; writes "
                "must not overlap other calls on one index (KVIndex.h, thread safety)",
                what,
                running.c_str(),
                where);
    }
}

WriteScope::~WriteScope() {
    calls_.state.store(0, std::memory_order_release);
}

// ---- children written behind a wrapper's back -----------------------------

namespace {
std::atomic<uint64_t> last_token_stamp{0};
} // namespace

void KVIndex::stamp_tokens() noexcept {
    token_stamp_ = last_token_stamp.fetch_add(1, std::memory_order_relaxed) + 1;
}

void KVIndex::record_children_stamps() {
    children_stamps_.clear();
    for (const KVIndex* c : children()) {
        children_stamps_.push_back(c ? c->token_stamp() : 0);
    }
}

void KVIndex::mark_failed(const char* what, const char* why) noexcept {
    std::snprintf(failed_write_, sizeof(failed_write_), "%s: %s", what, bare_error_text(why));
}

void KVIndex::write_tokens(const char* what, const std::function<void()>& core) {
    forget_undo(); // after another write the last append cannot be taken back
    try {
        core();
    } catch (const std::exception& e) {
        after_failed_write(what, e.what());
        throw;
    } catch (...) {
        after_failed_write(what, "an exception not derived from std::exception");
        throw;
    }
    failed_write_[0] = 0;
    stamp_after_write();
}

void KVIndex::after_failed_write(const char* what, const char* why) noexcept {
    if (!(std::strcmp(what, "add_kv") == 0 ? appends_roll_back() : writes_roll_back())) {
        mark_failed(what, why);
    }
    stamp_after_write(); // it may have written part
}

void KVIndex::stamp_after_write() noexcept {
    stamp_tokens();
    try {
        record_children_stamps(); // allocates (children())
    } catch (...) {
        // out of memory after the write is done: it stands (a throw now would
        // report a write that happened as failed); without stamps,
        // check_children compares the children's counts only
        children_stamps_.clear();
    }
}

void KVIndex::check_children() const {
    FAISS_THROW_IF_NOT_FMT(
            !failed_write(),
            "%s: an earlier write threw part-way and left it inconsistent (%s): reset() it, "
            "or read back a saved copy, to use it again",
            type_name(),
            failed_write_);
    check_children_in_step(); // a count that differs: the type names the child
    if (children_stamps_.empty()) {
        return; // not written yet: the counts say all there is
    }
    const std::vector<const KVIndex*> now = children();
    FAISS_THROW_IF_NOT_FMT(
            now.size() == children_stamps_.size(),
            "%s: it has %zu inner indexes where its last write left %zu: they were changed "
            "through a reference, which the %s cannot follow (reset() it to start over)",
            type_name(),
            now.size(),
            children_stamps_.size(),
            type_name());
    for (size_t i = 0; i < now.size(); i++) {
        FAISS_THROW_IF_NOT_FMT(
                now[i] && now[i]->token_stamp() == children_stamps_[i],
                "%s: its inner index %zu (%s) was written through a reference to it, or replaced, "
                "since the %s last wrote it, which the %s cannot follow (add through the %s; "
                "reset() it to start over)",
                type_name(),
                i,
                now[i] ? now[i]->type_name() : "missing",
                type_name(),
                type_name(),
                type_name());
    }
}

// ---- adding tokens ---------------------------------------------------------

void KVIndex::add(idx_t, const float*) {
    FAISS_THROW_MSG(
            "KVIndex::add: values missing; a KV index stores keys with their "
            "values, use add_kv(n, keys, values); in a Faiss container (IndexShards, "
            "IndexReplicas), fill each index through kvindex (prefill, add_kv) before "
            "add_shard / add_replica");
}

void KVIndex::add_kv(idx_t n, const float* keys, const float* values) {
    WriteScope scope(*this, "add_kv");
    add_kv_in_scope(n, keys, values);
}

void KVIndex::add_kv_in_scope(idx_t n, const float* keys, const float* values) {
    add_kv_in_scope(n, keys, values, false);
}

void KVIndex::add_kv_undoable(idx_t n, const float* keys, const float* values) {
    WriteScope scope(*this, "add_kv");
    add_kv_in_scope(n, keys, values, true);
}

void KVIndex::add_kv_in_scope(idx_t n, const float* keys, const float* values, bool undoable) {
    FAISS_THROW_IF_NOT_MSG(
            access_.state.load(std::memory_order_relaxed) < 0,
            "add_kv_in_scope: the caller holds no write scope on this index (use add_kv)");
    check_add_kv(n, keys, values);
    FAISS_THROW_IF_NOT_FMT(
            !undoable || can_undo_add(),
            "add_kv_undoable: %s (%s) cannot take an append back (can_undo_add)",
            type_name(),
            factory_string().c_str());
    forget_undo(); // a new write: the last append can no longer be taken back
    if (n > 0) {
        undoable_add_ = undoable;
        try {
            write_tokens("add_kv", [&] {
                add_kv_impl(n, keys, values);
                ntotal += n;
            });
        } catch (...) {
            undoable_add_ = false;
            forget_undo_impl();
            throw;
        }
        undoable_add_ = false;
    }
    undo_n_ = undoable ? n : -1;
}

void KVIndex::add_kv_to(KVIndex& child, idx_t n, const float* keys, const float* values) const {
    if (undoable_add_) {
        child.add_kv_undoable(n, keys, values);
    } else {
        child.add_kv(n, keys, values);
    }
}

void KVIndex::undo_add_kv() {
    WriteScope scope(*this, "undo_add_kv");
    undo_add_kv_in_scope();
}

void KVIndex::undo_add_kv_in_scope() {
    FAISS_THROW_IF_NOT_MSG(
            access_.state.load(std::memory_order_relaxed) < 0,
            "undo_add_kv_in_scope: the caller holds no write scope on this index (use undo_add_kv)");
    FAISS_THROW_IF_NOT_FMT(
            undo_n_ >= 0,
            "undo_add_kv: %s has no append to take back (only the last add_kv_undoable, "
            "before any other write)",
            type_name());
    const idx_t n = undo_n_;
    undo_n_ = -1;
    if (n > 0) {
        try {
            undo_add_kv_impl(n);
            ntotal -= n;
        } catch (const std::exception& e) {
            mark_failed("undo_add_kv", e.what());
            forget_undo_impl();
            stamp_after_write();
            throw;
        }
    }
    forget_undo_impl();
    stamp_after_write();
}

void KVIndex::undo_add_kv_impl(idx_t) {
    FAISS_THROW_FMT("undo_add_kv: %s cannot take an append back", type_name());
}

void KVIndex::forget_undo() noexcept {
    if (undo_n_ < 0) {
        return;
    }
    undo_n_ = -1;
    forget_undo_impl();
    try {
        for (KVIndex* c : mutable_children()) {
            c->forget_undo();
        }
    } catch (...) {
        // out of memory listing the children: what they keep is freed at
        // their next write
    }
}

void KVIndex::check_add_kv(idx_t n, const float* keys, const float* values) const {
    // literal names: a decode step's append builds no message strings
    check_add_kv(n, keys, values, "add_kv", "add_kv: keys", "add_kv: values");
}

void KVIndex::check_add_kv(
        idx_t n,
        const float* keys,
        const float* values,
        const char* what,
        const char* keys_what,
        const char* values_what) const {
    check_children();
    KVINDEX_CHECK_ARG(n >= 0, "%s: n=%zd must be >= 0", what, size_t(n));
    if (n == 0) {
        return;
    }
    FAISS_THROW_IF_NOT_FMT(
            d > 0 && d_value > 0,
            "%s: index has invalid dimensions d=%d d_value=%d",
            what,
            d,
            d_value);
    check_not_null(keys, keys_what);
    check_not_null(values, values_what);
    check_input(keys, n, d, keys_what);
    check_input(values, n, d_value, values_what);
    check_kv_type_fits(kv_type, keys, size_t(n) * d, d, keys_what);
    check_kv_type_fits(kv_type, values, size_t(n) * d_value, d_value, values_what);
    // a count (or an eviction index's position) near the top would wrap
    KVINDEX_CHECK_ARG(
            ntotal <= kMaxPosition && n <= kMaxPosition - ntotal,
            "%s: ntotal=%zd + n=%zd tokens is more than an index counts (2^62)",
            what,
            ssize_t(ntotal),
            ssize_t(n));
}

void KVIndex::add_queries(idx_t n, const float* queries) {
    WriteScope scope(*this, "add_queries");
    check_children();
    KVINDEX_CHECK_ARG(n >= 0, "add_queries: n=%zd must be >= 0", size_t(n));
    if (n == 0) {
        return;
    }
    FAISS_THROW_IF_NOT_FMT(d > 0, "add_queries: index has invalid dimension d=%d", d);
    check_not_null(queries, "add_queries: queries");
    check_input(queries, n, d, "add_queries: queries");
    forget_undo();
    add_queries_impl(n, queries);
}

void KVIndex::add_queries_impl(idx_t n, const float* queries) {
    for (KVIndex* c : mutable_children()) {
        c->add_queries(n, queries);
    }
}

void check_prompt(const PrefillInput& in, int d, const char* what) {
    KVINDEX_CHECK_ARG(in.n_tokens >= 0, "%s: n_tokens=%zd must be >= 0", what, ssize_t(in.n_tokens));
    KVINDEX_CHECK_ARG(
            in.first_position >= 0, "%s: first_position=%zd must be >= 0", what, ssize_t(in.first_position));
    KVINDEX_CHECK_ARG(in.n_after >= 0, "%s: n_after=%zd must be >= 0", what, ssize_t(in.n_after));
    // every position (first_position + j, + n_after) must be representable:
    // checked by subtraction, the sum itself could overflow
    KVINDEX_CHECK_ARG(
            in.first_position <= kMaxPosition && in.n_after <= kMaxPosition &&
                    in.n_tokens <= kMaxPosition - in.first_position - in.n_after,
            "%s: first_position=%zd + n_tokens=%zd + n_after=%zd must be <= 2^62",
            what,
            size_t(in.first_position),
            size_t(in.n_tokens),
            size_t(in.n_after));
    KVINDEX_CHECK_ARG(in.n_queries >= 0, "%s: n_queries=%zd must be >= 0", what, ssize_t(in.n_queries));
    if (in.n_queries == 0) {
        return;
    }
    KVINDEX_CHECK_ARG(in.n_query_heads >= 1, "%s: n_query_heads=%d must be >= 1", what, in.n_query_heads);
    const std::string queries = std::string(what) + ": queries";
    check_not_null(in.queries, queries.c_str());
    check_input_size(in.n_queries, size_t(in.n_query_heads) * d, queries.c_str());
    check_input(in.queries, in.n_queries * in.n_query_heads, d, queries.c_str());
    if (in.query_positions) {
        for (idx_t i = 0; i < in.n_queries; i++) {
            KVINDEX_CHECK_ARG(
                    in.query_positions[i] >= 0,
                    "%s: query_positions[%zd]=%zd must be >= 0",
                    what,
                    size_t(i),
                    ssize_t(in.query_positions[i]));
        }
    } else {
        KVINDEX_CHECK_ARG(
                in.n_queries <= in.first_position + in.n_tokens,
                "%s: %zd queries without positions, but the prompt has only %zd tokens",
                what,
                size_t(in.n_queries),
                size_t(in.first_position + in.n_tokens));
    }
}

namespace {

void check_empty_for_prefill(idx_t ntotal) {
    FAISS_THROW_IF_NOT_FMT(
            ntotal == 0,
            "prefill: the index already holds %zd tokens; prefill starts an "
            "empty cache (use add_kv to append)",
            size_t(ntotal));
}

} // namespace

void KVIndex::check_prefill(const PrefillInput& in) const {
    check_empty_for_prefill(ntotal);
    check_rope_params(in.rope, d);
    KVINDEX_CHECK_ARG(
            !has_rope || in.rope == rope,
            "prefill: RoPE parameters mismatch: index has theta=%g style=%s, "
            "prefill has theta=%g style=%s",
            rope.theta,
            rope_style_name(rope.style),
            in.rope.theta,
            rope_style_name(in.rope.style));
    check_prompt(in, d, "prefill");
    if (in.n_tokens > 0) {
        check_not_null(in.keys, "prefill: keys");
        check_not_null(in.values, "prefill: values");
        check_input(in.keys, in.n_tokens, d, "prefill: keys");
        check_input(in.values, in.n_tokens, d_value, "prefill: values");
        check_kv_type_fits(kv_type, in.keys, size_t(in.n_tokens) * d, d, "prefill: keys");
        check_kv_type_fits(kv_type, in.values, size_t(in.n_tokens) * d_value, d_value, "prefill: values");
    }
}

void KVIndex::prefill(const PrefillInput& in) {
    WriteScope scope(*this, "prefill");
    check_children();
    // here as well as in check_prefill (which the types' cores run): a
    // prefill that throws empties the index again, so it must start empty
    check_empty_for_prefill(ntotal);
    // a prefill that throws fixes no RoPE, whatever part of it ran (a
    // wrapper's core records it before it fills its children)
    const bool had_rope = has_rope;
    const RopeParams old_rope = rope;
    try {
        write_tokens("prefill", [&] { prefill_impl(in); });
    } catch (...) {
        has_rope = had_rope;
        rope = old_rope;
        if (failed_write()) {
            // prefill starts from an empty index, and the types check their
            // prompt inside their cores: an index that threw part-way is
            // emptied again, as reset() would, instead of staying marked
            // (it stays marked if that throws too)
            try {
                write_tokens("reset", [&] { reset_after(true); });
            } catch (...) {
            }
        }
        throw;
    }
}

void KVIndex::reset() {
    WriteScope scope(*this, "reset");
    // no check: reset is the way back for a wrapper whose child was written,
    // and for an index marked failed
    const bool was_failed = failed_write() != nullptr;
    write_tokens("reset", [&] { reset_after(was_failed); });
}

void KVIndex::reset_after(bool failed) {
    reset_impl();
    if (failed && !has_rope) {
        // a failed prefill fixes nothing: children it prefilled before it
        // threw forget their RoPE too, as if they had never been filled
        unfix_rope_below();
    }
}

void KVIndex::unfix_rope_below() {
    for (KVIndex* c : mutable_children()) {
        if (c) {
            if (!c->rope_fixed_by_models()) {
                c->has_rope = false;
                c->rope = RopeParams();
            }
            c->unfix_rope_below();
        }
    }
}

void KVIndex::prefill_impl(const PrefillInput& in) {
    check_prefill(in); // checks the tokens too: append them directly
    if (in.n_tokens > 0) {
        add_kv_impl(in.n_tokens, in.keys, in.values);
        ntotal += in.n_tokens;
    }
    // recorded only now, so that a refused prefill fixes nothing
    rope = in.rope;
    has_rope = true;
}

// ---- argument checks -------------------------------------------------------

void KVIndex::check_params(const faiss::SearchParameters* params) const {
    if (!params) {
        return;
    }
    KVINDEX_CHECK_ARG(
            params->sel == nullptr, "%s", "search parameters: IDSelector is not supported by KV indexes");
    // Faiss's own subclasses (SearchParametersIVF, ...HNSW) carry knobs no
    // KV index reads: silently ignoring their nprobe would mislead
    KVINDEX_CHECK_ARG(
            dynamic_cast<const SearchParametersKV*>(params) ||
                    typeid(*params) == typeid(faiss::SearchParameters),
            "%s",
            "search parameters: a Faiss SearchParameters subclass is not read by KV indexes; "
            "pass kvindex::SearchParametersKV, or SearchParametersTopK for nprobe / efSearch");
    if (auto p = dynamic_cast<const SearchParametersKV*>(params)) {
        KVINDEX_CHECK_ARG(
                p->k >= 0,
                "search parameters: k=%zd must be > 0 (0: index default)",
                size_t(p->k));
        KVINDEX_CHECK_ARG(
                p->k == 0 || reads_search_knob("k"),
                "search parameters: k=%zd does not apply to %s (no index of it reads a "
                "top-k budget)",
                size_t(p->k),
                factory_string().c_str());
        // a knob of another retriever would be ignored: refused, so that a
        // sweep over nprobe on a chain without IVF does not measure nothing
        for (const SearchKnob& knob : p->set_knobs()) {
            KVINDEX_CHECK_ARG(
                    reads_search_knob(knob.name),
                    "search parameters: %s=%g does not apply to %s (no index of it reads %s)",
                    knob.name,
                    knob.value,
                    factory_string().c_str(),
                    knob.name);
        }
    }
}

std::unique_ptr<SearchParametersKV> SearchParametersKV::without_knob(const std::string& name) const {
    if (name == "k") {
        // a subclass listing no knobs of its own (a user's carrier of a
        // tag) is copied as its SearchParametersKV part: no index reads
        // more of it
        auto copy = std::make_unique<SearchParametersKV>(*this);
        copy->k = 0;
        return copy;
    }
    FAISS_THROW_FMT(
            "SearchParametersKV::without_knob: %s is not a knob of %s (a subclass listing "
            "knobs in set_knobs must drop them in without_knob)",
            name.c_str(),
            typeid(*this).name());
}

bool KVIndex::reads_search_knob(const std::string& name) const {
    for (const KVIndex* held : held_indexes()) {
        if (held->reads_search_knob(name)) {
            return true;
        }
    }
    return false;
}

namespace {

/// `params` without the knobs it sets (its k, then its subclass's) that
/// `drop(name)` picks; a copy, held in `copy`, when one is dropped.
template <class Drop>
const faiss::SearchParameters* without_knobs(
        const faiss::SearchParameters* params,
        std::unique_ptr<SearchParametersKV>& copy,
        Drop drop) {
    auto p = dynamic_cast<const SearchParametersKV*>(params);
    if (!p) {
        return params; // the reader checks what it is
    }
    std::vector<std::string> names;
    if (p->k > 0) {
        names.push_back("k");
    }
    for (const SearchKnob& knob : p->set_knobs()) {
        names.push_back(knob.name);
    }
    const SearchParametersKV* out = p;
    for (const std::string& name : names) {
        if (drop(name)) {
            copy = out->without_knob(name);
            out = copy.get();
        }
    }
    return out;
}

} // namespace

const faiss::SearchParameters* KVIndex::params_for(
        const KVIndex& reader,
        const faiss::SearchParameters* params,
        std::unique_ptr<SearchParametersKV>& copy) {
    return without_knobs(params, copy, [&](const std::string& name) {
        return !reader.reads_search_knob(name);
    });
}

const faiss::SearchParameters* KVIndex::params_among(
        const KVIndex& reader,
        const std::vector<const KVIndex*>& peers,
        const faiss::SearchParameters* params,
        std::unique_ptr<SearchParametersKV>& copy) {
    // drop what only a peer reads; a knob no peer reads stays, for the
    // reader's check_params to refuse naming it
    return without_knobs(params, copy, [&](const std::string& name) {
        return !reader.reads_search_knob(name) &&
                std::any_of(peers.begin(), peers.end(), [&](const KVIndex* peer) {
                    return peer->reads_search_knob(name);
                });
    });
}

idx_t KVIndex::effective_k(const faiss::SearchParameters* params) const {
    check_params(params);
    idx_t kk = k;
    if (auto p = dynamic_cast<const SearchParametersKV*>(params)) {
        if (p->k > 0) {
            kk = p->k;
        }
    }
    KVINDEX_CHECK_ARG(kk > 0, "top-k budget k=%zd must be > 0", size_t(kk));
    return kk;
}

void KVIndex::check_query_args(idx_t n, const float* q, const char* what) const {
    KVINDEX_CHECK_ARG(n >= 0, "%s: n=%zd must be >= 0", what, size_t(n));
    if (n == 0) {
        return;
    }
    check_not_null(q, what);
    check_input(q, n, d, what);
}

float KVIndex::score_scale() const {
    return float(1.0 / std::sqrt(double(d)));
}

// ---- the public calls: checks, the empty index, then the type's core ------

void KVIndex::search(
        idx_t n,
        const float* q,
        idx_t k,
        float* distances,
        idx_t* labels,
        const faiss::SearchParameters* params) const {
    ReadScope scope(*this, "search");
    check_children();
    KVINDEX_CHECK_ARG(k > 0, "search: k=%zd must be > 0", size_t(k));
    check_query_args(n, q, "search: queries");
    check_params(params);
    if (n == 0) {
        return;
    }
    check_not_null(distances, "search: distances");
    check_not_null(labels, "search: labels");
    if (ntotal == 0) {
        // nothing to find: padding as Faiss does for inner product
        std::fill(distances, distances + n * k, std::numeric_limits<float>::lowest());
        std::fill(labels, labels + n * k, idx_t(-1));
        return;
    }
    search_batch(n, q, k, distances, labels, params);
}

void KVIndex::select(
        idx_t n,
        const float* q,
        Selection* sel,
        const faiss::SearchParameters* params) const {
    ReadScope scope(*this, "select");
    check_children();
    check_query_args(n, q, "select: queries");
    check_params(params);
    if (n == 0) {
        return;
    }
    check_not_null(sel, "select: selections");
    if (ntotal == 0) {
        for (idx_t i = 0; i < n; i++) {
            sel[i].clear();
        }
        return;
    }
    select_batch(n, q, sel, params);
}

void KVIndex::select_outside(
        const float* q,
        const idx_t* excluded,
        size_t n_excluded,
        Selection& sel,
        const faiss::SearchParameters* params) const {
    ReadScope scope(*this, "select_outside");
    check_children();
    check_query_args(1, q, "select_outside: query");
    check_params(params);
    check_excluded(excluded, n_excluded, ntotal, "select_outside");
    sel.clear();
    if (ntotal == 0) {
        return;
    }
    select_outside_one(q, excluded, n_excluded, sel, params);
}

void KVIndex::select_outside_one(
        const float* q,
        const idx_t* excluded,
        size_t n_excluded,
        Selection& sel,
        const faiss::SearchParameters* params) const {
    Selection all;
    select_batch(1, q, &all, params);
    std::vector<size_t> order(all.size());
    std::iota(order.begin(), order.end(), size_t(0));
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
        return all.ids[a] < all.ids[b];
    });
    sel.clear();
    sel.n_scanned = all.n_scanned;
    const idx_t* end = excluded + n_excluded;
    for (size_t j : order) {
        idx_t id = all.ids[j];
        if (!std::binary_search(excluded, end, id)) {
            sel.push_back(id, all.inclusion[j]);
        }
    }
}

void KVIndex::attend(
        idx_t n,
        const float* q,
        float* out,
        float* lse,
        const faiss::SearchParameters* params) const {
    ReadScope scope(*this, "attend");
    check_children();
    check_query_args(n, q, "attend: queries");
    FAISS_THROW_IF_NOT_MSG(ntotal > 0, "attend: the index is empty (ntotal=0)");
    check_not_null(out, "attend: out");
    check_params(params);
    if (n == 0) {
        return;
    }
    // the cores always write an lse: it is how partial results merge
    std::vector<float> lse_buffer;
    if (!lse) {
        lse_buffer.resize(n);
        lse = lse_buffer.data();
    }
    attend_batch(n, q, out, lse, params);
}

// ---- default cores: per query, in parallel ---------------------------------

void KVIndex::search_batch(
        idx_t n,
        const float* q,
        idx_t k,
        float* distances,
        idx_t* labels,
        const faiss::SearchParameters* params) const {
    parallel_for(n, [&](idx_t i) {
        search_one(q + i * d, k, distances + i * k, labels + i * k, params);
    });
}

void KVIndex::select_batch(
        idx_t n,
        const float* q,
        Selection* sel,
        const faiss::SearchParameters* params) const {
    parallel_for(n, [&](idx_t i) { select_one(q + i * d, sel[i], params); });
}

void KVIndex::attend_batch(
        idx_t n,
        const float* q,
        float* out,
        float* lse,
        const faiss::SearchParameters* params) const {
    parallel_for(n, [&](idx_t i) { lse[i] = attend_one(q + i * d, out + i * d_value, params); });
}

void KVIndex::select_one(const float*, Selection&, const faiss::SearchParameters*) const {
    FAISS_THROW_FMT("%s defines neither select_one nor select_batch", type_name());
}

namespace {

const KVStorage& storage_of(const KVIndex* index, const KVStorage* st, const char* what) {
    FAISS_THROW_IF_NOT_FMT(
            st, "%s: %s keeps no token storage and must define it", what, index->type_name());
    return *st;
}

} // namespace

void KVIndex::search_one(
        const float* q,
        idx_t k,
        float* distances,
        idx_t* labels,
        const faiss::SearchParameters* params) const {
    const KVStorage& st = storage_of(this, token_storage(), "search_one");
    Selection sel;
    select_one(q, sel, params);
    size_t m = sel.size();
    std::vector<float> s(m);
    inner_products_by_ids(q, st.key_rows(), sel.ids.data(), m, 1.0f, s.data());
    std::vector<size_t> order(m);
    std::iota(order.begin(), order.end(), size_t(0));
    size_t kk = std::min<size_t>(k, m);
    // larger score first; ties by smaller id, so results are deterministic
    std::partial_sort(order.begin(), order.begin() + kk, order.end(), [&](size_t a, size_t b) {
        return s[a] > s[b] || (s[a] == s[b] && sel.ids[a] < sel.ids[b]);
    });
    for (idx_t j = 0; j < k; j++) {
        bool found = size_t(j) < kk;
        distances[j] = found ? s[order[j]] : std::numeric_limits<float>::lowest();
        labels[j] = found ? sel.ids[order[j]] : -1;
    }
}

float KVIndex::attend_one(const float* q, float* out, const faiss::SearchParameters* params)
        const {
    const KVStorage& st = storage_of(this, token_storage(), "attend_one");
    Selection sel;
    select_one(q, sel, params);
    return estimate_attention(estimator, q, st.key_rows(), st.value_rows(), sel, out);
}

void KVIndex::estimate_batch(
        idx_t n,
        const float* q,
        const Selection* sel,
        float* out,
        float* lse) const {
    const KVStorage& st = storage_of(this, token_storage(), "estimate_batch");
    parallel_for(n, [&](idx_t i) {
        lse[i] = estimate_attention(
                estimator, q + i * d, st.key_rows(), st.value_rows(), sel[i], out + i * d_value);
    });
}

// ---- tokens ----------------------------------------------------------------

namespace {

void check_token_id(const KVIndex* index, idx_t key, const char* what) {
    FAISS_THROW_IF_NOT_FMT(
            key >= 0 && key < index->ntotal,
            "%s: id %zd out of [0, %zd)",
            what,
            size_t(key),
            size_t(index->ntotal));
}

} // namespace

void KVIndex::reconstruct(idx_t key, float* recons) const {
    ReadScope scope(*this, "reconstruct");
    check_children();
    check_token_id(this, key, "reconstruct");
    check_not_null(recons, "reconstruct: output");
    reconstruct_impl(key, recons);
}

void KVIndex::reconstruct_value(idx_t key, float* value) const {
    ReadScope scope(*this, "reconstruct_value");
    check_children();
    check_token_id(this, key, "reconstruct_value");
    check_not_null(value, "reconstruct_value: output");
    reconstruct_value_impl(key, value);
}

bool KVIndex::share_tokens(const KVStorage*) {
    return false;
}

void KVIndex::reconstruct_impl(idx_t key, float* recons) const {
    const KVStorage& st = storage_of(this, token_storage(), "reconstruct");
    st.key(key, recons);
}

void KVIndex::reconstruct_value_impl(idx_t key, float* value) const {
    const KVStorage& st = storage_of(this, token_storage(), "reconstruct_value");
    st.value(key, value);
}

// ---- self-description defaults -------------------------------------------

std::vector<const KVIndex*> KVIndex::children() const {
    return {};
}

std::vector<KVIndex*> KVIndex::mutable_children() {
    std::vector<KVIndex*> out;
    for (const KVIndex* c : std::as_const(*this).children()) {
        out.push_back(const_cast<KVIndex*>(c)); // this index owns them
    }
    return out;
}

size_t KVIndex::key_equivalents(size_t bytes) const {
    size_t key = size_t(d) * kv_type_size(kv_type);
    return key == 0 ? 0 : (bytes + key - 1) / key;
}

std::vector<ParameterInfo> KVIndex::parameter_info() const {
    if (!reads_search_knob("k")) {
        return {};
    }
    return {ParameterInfo::integer("k", 1, ParameterInfo::kNoBound, "top-k budget: keys selected per query").tokens()};
}

bool KVIndex::set_parameter(const std::string& name, double value) {
    if (name != "k" || !reads_search_knob("k")) {
        return false;
    }
    FAISS_THROW_IF_NOT_FMT(
            is_positive_integer(value), "parameter k=%g must be a positive integer", value);
    k = idx_t(value);
    return true;
}

bool KVIndex::get_parameter(const std::string& name, double* value) const {
    if (name != "k" || !reads_search_knob("k")) {
        return false;
    }
    *value = double(k);
    return true;
}

std::unique_ptr<KVIndex> KVIndex::io_twin() const {
    return nullptr;
}

void KVIndex::set_stream(uint64_t stream) {
    for (KVIndex* c : mutable_children()) {
        c->set_stream(stream);
    }
}

void KVIndex::check_adopt_trained(const KVIndex& trained) const {
    std::vector<const KVIndex*> mine = children();
    std::vector<const KVIndex*> theirs = trained.children();
    FAISS_THROW_IF_NOT_FMT(
            std::string(type_name()) == trained.type_name() && mine.size() == theirs.size(),
            "adopt_trained: the trained index is a %s with %zu children, this one a %s "
            "with %zu: build both from the same factory string",
            trained.type_name(),
            theirs.size(),
            type_name(),
            mine.size());
    for (size_t i = 0; i < mine.size(); i++) {
        mine[i]->check_adopt_trained(*theirs[i]);
    }
}

int KVIndex::adopt_trained(const KVIndex& trained) {
    // the whole chain first: a mismatch in a later child would otherwise
    // leave the earlier ones with the new models
    classify_errors<InvalidArgument>([&] { check_adopt_trained(trained); });
    std::vector<KVIndex*> mine = mutable_children();
    std::vector<const KVIndex*> theirs = trained.children();
    int adopted = 0;
    for (size_t i = 0; i < mine.size(); i++) {
        adopted += mine[i]->adopt_trained(*theirs[i]);
    }
    return adopted;
}

bool KVIndex::selects_deterministically() const {
    for (const KVIndex* held : held_indexes()) {
        if (!held->selects_deterministically()) {
            return false;
        }
    }
    return true;
}

idx_t KVIndex::top_k_budget() const {
    for (const KVIndex* c : children()) {
        if (idx_t kk = c->top_k_budget()) {
            return kk;
        }
    }
    return 0;
}

void KVIndex::check_fields(const char* what) const {
    FAISS_THROW_IF_NOT_FMT(
            d > 0 && d_value > 0 && d <= (1 << 16) && d_value <= (1 << 16),
            "%s: invalid dimensions d=%d d_value=%d",
            what,
            d,
            d_value);
    FAISS_THROW_IF_NOT_FMT(
            ntotal >= 0 && ntotal <= kMaxPosition,
            "%s: invalid ntotal %zd (must be in [0, 2^62])",
            what,
            ssize_t(ntotal));
    FAISS_THROW_IF_NOT_FMT(k > 0, "%s: invalid k %zd", what, ssize_t(k));
    FAISS_THROW_IF_NOT_FMT(
            estimator == Estimator::topk || estimator == Estimator::unbiased,
            "%s: invalid estimator %d",
            what,
            int(estimator));
    FAISS_THROW_IF_NOT_FMT(
            std::isfinite(rope.theta) && rope.theta > 0 &&
                    (rope.style == RopeStyle::half || rope.style == RopeStyle::interleaved),
            "%s: invalid RoPE theta=%g style=%d",
            what,
            rope.theta,
            int(rope.style));
    FAISS_THROW_IF_NOT_FMT(
            metric_type == faiss::METRIC_INNER_PRODUCT, "%s: metric must be inner product", what);
    FAISS_THROW_IF_NOT_FMT(
            unsigned(kv_type) < unsigned(kNumKVTypes),
            "%s: invalid storage type %d",
            what,
            int(kv_type));
}

void KVIndex::check_invariants() const {
    check_fields(type_name());
    for (const KVIndex* c : children()) {
        FAISS_THROW_IF_NOT_FMT(
                c && c->kv_type == kv_type,
                "%s: inner index stores %s, the index %s (one type per chain)",
                type_name(),
                c ? kv_type_name(c->kv_type) : "nothing",
                kv_type_name(kv_type));
        FAISS_THROW_IF_NOT_FMT(
                c && c->d == d && c->d_value == d_value,
                "%s: inner index has d=%d d_value=%d, the index d=%d d_value=%d",
                type_name(),
                c ? c->d : -1,
                c ? c->d_value : -1,
                d,
                d_value);
    }
}

} // namespace kvindex
