#include <kvindex/IndexKVShards.h>

#include <algorithm>
#include <cctype>
#include <limits>
#include <utility>

#include <faiss/impl/FaissAssert.h>
#include <faiss/impl/FaissException.h>

#include <kvindex/attention.h>
#include <kvindex/impl/io.h>
#include <kvindex/index_factory.h>
#include <kvindex/index_io.h>

#include "checks.h"
#include "parallel.h"
#include "query_rows.h"
#include "random.h"

namespace kvindex {

namespace {

constexpr const char* kShardsGrammar = "Shards<T>(<chain>)";

/// Shards of T tokens that n tokens fill.
idx_t shard_count(idx_t n, idx_t T) {
    return T > 0 ? (n + T - 1) / T : 0;
}

} // namespace

IndexKVShards::IndexKVShards() : KVIndex(0, 0) {}

IndexKVShards::IndexKVShards(idx_t shard_tokens, std::unique_ptr<KVIndex> empty)
        : KVIndex(empty ? empty->d : 0, empty ? empty->d_value : 0, empty ? empty->kv_type : KVType::f32),
          shard_tokens(shard_tokens),
          empty_shard(std::move(empty)) {
    FAISS_THROW_IF_NOT_MSG(empty_shard, "IndexKVShards: the shards' chain is missing (nullptr)");
    FAISS_THROW_IF_NOT_FMT(
            shard_tokens >= 1 && shard_tokens <= kMaxPosition,
            "IndexKVShards: shard_tokens=%zd must be in [1, 2^62]",
            ssize_t(shard_tokens));
    FAISS_THROW_IF_NOT_FMT(
            empty_shard->ntotal == 0,
            "IndexKVShards: the shards' chain must be empty, holds %zd tokens",
            size_t(empty_shard->ntotal));
}

std::unique_ptr<KVIndex> IndexKVShards::from_factory(FactoryChain& chain) {
    const std::string e = chain.peek();
    const std::string prefix = "Shards";
    if (e.compare(0, prefix.size(), prefix) != 0) {
        return nullptr;
    }
    const size_t open = e.find('(');
    FAISS_THROW_IF_NOT_FMT(
            open != std::string::npos && open > prefix.size() && e.back() == ')' &&
                    open + 2 < e.size() && open - prefix.size() <= 12 &&
                    std::all_of(e.begin() + prefix.size(), e.begin() + open,
                                [](char c) { return std::isdigit(static_cast<unsigned char>(c)); }),
            "index_factory: '%s' in '%s': expected %s, T tokens per shard (>= 1) and the shards' chain",
            e.c_str(),
            chain.description().c_str(),
            kShardsGrammar);
    const idx_t T = std::stoll(e.substr(prefix.size(), open - prefix.size()));
    FAISS_THROW_IF_NOT_FMT(
            T >= 1, "index_factory: '%s': T=%zd tokens per shard must be >= 1", e.c_str(), ssize_t(T));
    chain.take();
    std::unique_ptr<KVIndex> inner;
    try {
        inner = chain.parse_nested(e.substr(open + 1, e.size() - open - 2));
    } catch (const faiss::FaissException& ex) {
        FAISS_THROW_FMT("index_factory: '%s': %s", e.c_str(), bare_error_message(ex).c_str());
    }
    return std::make_unique<IndexKVShards>(T, std::move(inner));
}

std::string IndexKVShards::factory_string() const {
    return "Shards" + std::to_string(shard_tokens) + "(" + empty_shard->factory_string() + ")";
}

std::vector<const KVIndex*> IndexKVShards::children() const {
    std::vector<const KVIndex*> c;
    c.reserve(1 + shards.size());
    c.push_back(empty_shard.get());
    for (const auto& s : shards) {
        c.push_back(s.get());
    }
    return c;
}

uint64_t IndexKVShards::shard_stream(size_t s) const {
    if (s == 0) {
        return stream;
    }
    uint64_t state = stream_seed(stream, s);
    return splitmix64(state);
}

void IndexKVShards::set_stream(uint64_t s) {
    stream = s;
    empty_shard->set_stream(s);
    for (size_t i = 0; i < shards.size(); i++) {
        shards[i]->set_stream(shard_stream(i));
    }
}

std::unique_ptr<KVIndex> IndexKVShards::open_shard(size_t s) const {
    // a copy through io: the chain's knobs and adopted models come along
    std::unique_ptr<KVIndex> shard = clone_index(empty_shard.get());
    shard->set_stream(shard_stream(s));
    return shard;
}

void IndexKVShards::fill_shard(
        KVIndex& shard, size_t s, idx_t m, idx_t after, const float* keys, const float* values) const {
    if (!has_rope) {
        shard.add_kv(m, keys, values); // this index was never prefilled: neither are its shards
        return;
    }
    PrefillInput in;
    in.n_tokens = m;
    in.keys = keys;
    in.values = values;
    in.first_position = first_position + idx_t(s) * shard_tokens;
    in.n_after = n_after + after;
    in.rope = rope;
    shard.prefill(in);
}

namespace {

/// The prompt's queries a shard starting at `first` learns from: those at
/// positions >= first, which can see some of its tokens (every query for
/// shard 0, so that one shard is its chain alone). Holds their copy when
/// some are left out.
struct ShardQueries {
    std::vector<float> queries;    ///< n_query_heads * n_queries * d, head-major
    std::vector<idx_t> positions;  ///< n_queries

    /// Points `sub` (a copy of `in`) at the queries that can see [first, ..).
    void select(const PrefillInput& in, const std::vector<idx_t>& all_positions, idx_t first,
                bool every, int d, PrefillInput& sub) {
        if (in.n_queries == 0) {
            return;
        }
        auto position = [&](idx_t i) { return all_positions.empty() ? in.query_positions[i] : all_positions[i]; };
        sub.query_positions = all_positions.empty() ? in.query_positions : all_positions.data();
        idx_t seen = 0;
        for (idx_t i = 0; i < in.n_queries; i++) {
            seen += every || position(i) >= first;
        }
        if (seen == in.n_queries) {
            return;
        }
        positions.clear();
        std::vector<idx_t> rows;
        for (idx_t i = 0; i < in.n_queries; i++) {
            if (position(i) >= first) {
                rows.push_back(i);
                positions.push_back(position(i));
            }
        }
        queries = gather_query_rows(in.queries, in.n_query_heads, in.n_queries, rows, d);
        sub.n_queries = seen;
        sub.queries = seen > 0 ? queries.data() : nullptr;
        sub.query_positions = seen > 0 ? positions.data() : nullptr;
    }
};

} // namespace

void IndexKVShards::prefill_impl(const PrefillInput& in) {
    check_prefill(in);
    const idx_t T = shard_tokens, n = in.n_tokens;
    const std::vector<idx_t> positions = in.implicit_query_positions(); // the shards' keys start later
    std::vector<std::unique_ptr<KVIndex>> made;
    for (idx_t s = 0; s < shard_count(n, T); s++) {
        PrefillInput sub = in;
        const idx_t i0 = s * T;
        sub.n_tokens = std::min(T, n - i0);
        sub.keys = in.keys + size_t(i0) * d;
        sub.values = in.values + size_t(i0) * d_value;
        sub.first_position = in.first_position + i0;
        sub.n_after = in.n_after + (n - i0 - sub.n_tokens);
        ShardQueries sq;
        sq.select(in, positions, sub.first_position, s == 0, d, sub);
        std::unique_ptr<KVIndex> shard = open_shard(size_t(s));
        shard->prefill(sub);
        made.push_back(std::move(shard));
    }
    // built aside: a failure above leaves this index empty
    shards = std::move(made);
    ntotal = n;
    first_position = in.first_position;
    n_after = in.n_after;
    rope = in.rope;
    has_rope = true;
}

namespace {

/// Every index of the tree under `index`, itself first.
void collect_tree(KVIndex* index, std::vector<KVIndex*>& out) {
    out.push_back(index);
    for (KVIndex* c : index->mutable_children()) {
        collect_tree(c, out);
    }
}

} // namespace

void IndexKVShards::followers(bool last_takes, std::vector<KVIndex*>& full, std::vector<KVIndex*>& last) {
    if (!find_position_reader(empty_shard.get())) {
        return; // no index of the chain reads the decode query's position
    }
    for (size_t s = 0; s + (last_takes ? 1 : 0) < shards.size(); s++) {
        collect_tree(shards[s].get(), full);
    }
    if (last_takes) {
        collect_tree(shards.back().get(), last);
    }
}

void IndexKVShards::add_kv_impl(idx_t n, const float* keys, const float* values) {
    const idx_t T = shard_tokens;
    const idx_t to_last = shards.empty() ? 0 : std::min(n, T - shards.back()->ntotal);
    // the shards this append opens are built and filled aside first, the
    // last shard written only then: a failure before its write changes
    // nothing here, and its write rolls back where its type's do
    std::vector<std::unique_ptr<KVIndex>> made;
    for (idx_t i = to_last; i < n; i += T) {
        const size_t s = shards.size() + made.size();
        const idx_t m = std::min(T, n - i);
        std::unique_ptr<KVIndex> shard = open_shard(s);
        fill_shard(*shard, s, m, n - i - m, keys + size_t(i) * d, values + size_t(i) * d_value);
        made.push_back(std::move(shard));
    }
    // the indexes the new tokens follow, gathered before anything changes:
    // the full shards by n, the last by what it does not take itself
    std::vector<KVIndex*> full, last;
    followers(to_last > 0, full, last);
    shards.reserve(shards.size() + made.size());
    if (to_last > 0) {
        add_kv_to(*shards.back(), to_last, keys, values);
    }
    undo_opened = made.size();
    undo_to_last = to_last;
    // nothing below throws
    for (KVIndex* x : full) {
        x->tokens_appended_after(n);
    }
    for (KVIndex* x : last) {
        x->tokens_appended_after(n - to_last);
    }
    for (auto& shard : made) {
        shards.push_back(std::move(shard)); // reserved
    }
}

void IndexKVShards::undo_add_kv_impl(idx_t n) {
    shards.resize(shards.size() - undo_opened); // the shards it opened
    std::vector<KVIndex*> full, last;
    followers(undo_to_last > 0, full, last);
    if (undo_to_last > 0) {
        shards.back()->undo_add_kv();
    }
    // the decode query moves back (as add_kv_impl moved it)
    for (KVIndex* x : full) {
        x->tokens_appended_after(-n);
    }
    for (KVIndex* x : last) {
        x->tokens_appended_after(-(n - undo_to_last));
    }
}

bool IndexKVShards::can_undo_add() const {
    return empty_shard && empty_shard->can_undo_add();
}

void IndexKVShards::add_queries_impl(idx_t n, const float* queries) {
    for (auto& shard : shards) {
        shard->add_queries(n, queries);
    }
}

void IndexKVShards::reset_impl() {
    shards.clear();
    ntotal = 0;
    first_position = 0;
    n_after = 0;
}

bool IndexKVShards::writes_roll_back() const {
    return empty_shard && empty_shard->writes_roll_back();
}

bool IndexKVShards::needs_contiguous_positions() const {
    return empty_shard && empty_shard->needs_contiguous_positions();
}

void IndexKVShards::reconstruct_impl(idx_t key, float* recons) const {
    shards[key / shard_tokens]->reconstruct(key % shard_tokens, recons);
}

void IndexKVShards::reconstruct_value_impl(idx_t key, float* value) const {
    shards[key / shard_tokens]->reconstruct_value(key % shard_tokens, value);
}

size_t IndexKVShards::memory_bytes() const {
    size_t b = sizeof(*this) + empty_shard->memory_bytes() + shards.capacity() * sizeof(shards[0]);
    for (const auto& s : shards) {
        b += s->memory_bytes();
    }
    return b;
}

// ---- answers: each shard's, merged -----------------------------------------

void IndexKVShards::attend_batch(
        idx_t n,
        const float* q,
        float* out,
        float* lse,
        const faiss::SearchParameters* params) const {
    const size_t S = shards.size();
    if (S == 1) {
        shards[0]->attend(n, q, out, lse, params);
        return;
    }
    // every shard answers all the queries (one call: a GQA group is one
    // pass over its tokens where the chain batches), then a merge per query
    std::vector<float> outs(S * size_t(n) * d_value), lses(S * size_t(n));
    for (size_t s = 0; s < S; s++) {
        shards[s]->attend(n, q, outs.data() + s * n * d_value, lses.data() + s * n, params);
    }
    // a merge reads S floats and S rows per query: in parallel only for
    // many queries
    parallel_for(n, [&](idx_t i) {
        std::vector<const float*> parts(S);
        std::vector<float> part_lse(S);
        for (size_t s = 0; s < S; s++) {
            parts[s] = outs.data() + (s * n + i) * d_value;
            part_lse[s] = lses[s * n + i];
        }
        lse[i] = merge_attention(S, parts.data(), part_lse.data(), d_value, out + i * d_value);
    }, n >= 256);
}

void IndexKVShards::search_batch(
        idx_t n,
        const float* q,
        idx_t k,
        float* distances,
        idx_t* labels,
        const faiss::SearchParameters* params) const {
    const size_t S = shards.size();
    std::vector<float> dis(S * size_t(n) * k);
    std::vector<idx_t> ids(S * size_t(n) * k);
    for (size_t s = 0; s < S; s++) {
        shards[s]->search(n, q, k, dis.data() + s * n * k, ids.data() + s * n * k, params);
    }
    parallel_for(n, [&](idx_t i) {
        std::vector<std::pair<float, idx_t>> cand;
        cand.reserve(S * k);
        for (size_t s = 0; s < S; s++) {
            const idx_t base = idx_t(s) * shard_tokens;
            for (idx_t j = 0; j < k; j++) {
                const size_t at = (s * n + i) * k + j;
                if (ids[at] >= 0) {
                    cand.emplace_back(dis[at], ids[at] + base);
                }
            }
        }
        const idx_t kk = std::min<idx_t>(k, cand.size());
        std::partial_sort(cand.begin(), cand.begin() + kk, cand.end(), [](const auto& a, const auto& b) {
            return a.first > b.first || (a.first == b.first && a.second < b.second);
        });
        for (idx_t j = 0; j < k; j++) {
            distances[i * k + j] = j < kk ? cand[j].first : std::numeric_limits<float>::lowest();
            labels[i * k + j] = j < kk ? cand[j].second : -1;
        }
    }, n >= 64);
}

void IndexKVShards::select_batch(
        idx_t n,
        const float* q,
        Selection* sel,
        const faiss::SearchParameters* params) const {
    std::vector<Selection> part(n);
    for (size_t s = 0; s < shards.size(); s++) {
        shards[s]->select(n, q, part.data(), params);
        const idx_t base = idx_t(s) * shard_tokens;
        for (idx_t i = 0; i < n; i++) {
            if (s == 0) {
                sel[i].clear();
            }
            for (size_t j = 0; j < part[i].size(); j++) {
                sel[i].push_back(part[i].ids[j] + base, part[i].inclusion[j]);
            }
            sel[i].n_scanned += part[i].n_scanned;
        }
    }
}

// ---- offline-trained models ------------------------------------------------

namespace {

/// The index of `trained` whose models the empty shard takes: its first
/// shard, or its empty shard when it holds no tokens.
const KVIndex& trained_source(const IndexKVShards& trained) {
    return trained.shards.empty() ? *trained.empty_shard : *trained.shards[0];
}

} // namespace

void IndexKVShards::check_adopt_trained(const KVIndex& trained) const {
    auto src = dynamic_cast<const IndexKVShards*>(&trained);
    FAISS_THROW_IF_NOT_FMT(
            src && src->shard_tokens == shard_tokens && src->empty_shard,
            "adopt_trained: %s cannot take the models of %s (another type or T)",
            factory_string().c_str(),
            src ? src->factory_string().c_str() : trained.type_name());
    FAISS_THROW_IF_NOT_FMT(
            ntotal == 0,
            "adopt_trained: %s already holds %zd tokens; adopt models before prefill",
            factory_string().c_str(),
            size_t(ntotal));
    empty_shard->check_adopt_trained(trained_source(*src));
}

int IndexKVShards::adopt_trained(const KVIndex& trained) {
    check_adopt_trained(trained);
    return empty_shard->adopt_trained(trained_source(dynamic_cast<const IndexKVShards&>(trained)));
}

// ---- io and invariants -----------------------------------------------------

void IndexKVShards::write_fields(BufferWriter& w) const {
    w.value<int64_t>(shard_tokens);
    w.value<uint64_t>(stream);
    w.value<int64_t>(first_position);
    w.value<int64_t>(n_after);
    write_index_record(empty_shard.get(), w);
    w.value<uint64_t>(uint64_t(shards.size()));
    for (const auto& s : shards) {
        write_index_record(s.get(), w);
    }
}

void IndexKVShards::read_fields(BufferReader& r, uint32_t) {
    shard_tokens = r.value<int64_t>("Shards shard_tokens");
    stream = r.value<uint64_t>("Shards stream");
    first_position = r.value<int64_t>("Shards first_position");
    n_after = r.value<int64_t>("Shards n_after");
    FAISS_THROW_IF_NOT_FMT(
            shard_tokens >= 1 && shard_tokens <= kMaxPosition,
            "read_index: IndexKVShards has shard_tokens=%zd, expected 1 .. 2^62",
            ssize_t(shard_tokens));
    empty_shard = read_index_record(r);
    const uint64_t count = r.value<uint64_t>("Shards count");
    FAISS_THROW_IF_NOT_FMT(
            count == uint64_t(shard_count(ntotal, shard_tokens)),
            "read_index: IndexKVShards holds %zd tokens in shards of %zd, but the file has %llu shards",
            size_t(ntotal),
            size_t(shard_tokens),
            (unsigned long long)count);
    shards.clear(); // no reserve: a forged count meets the end of the file first
    for (uint64_t s = 0; s < count; s++) {
        shards.push_back(read_index_record(r));
    }
}

void IndexKVShards::check_children_in_step() const {
    FAISS_THROW_IF_NOT_MSG(empty_shard, "IndexKVShards: the shards' chain is missing");
    if (empty_shard->ntotal != 0) {
        check_child_in_step(empty_shard.get(), 0, "IndexKVShards", "empty shard");
    }
    FAISS_THROW_IF_NOT_FMT(
            idx_t(shards.size()) == shard_count(ntotal, shard_tokens),
            "IndexKVShards: %zu shards for %zd tokens in shards of %zd (reset() it to start over)",
            shards.size(),
            size_t(ntotal),
            size_t(shard_tokens));
    for (size_t s = 0; s < shards.size(); s++) {
        const idx_t expected = std::min(shard_tokens, ntotal - idx_t(s) * shard_tokens);
        if (!shards[s] || shards[s]->ntotal != expected) { // the name only when it throws
            const std::string what = "shard " + std::to_string(s);
            check_child_in_step(shards[s].get(), expected, "IndexKVShards", what.c_str());
        }
    }
}

void IndexKVShards::check_invariants() const {
    KVIndex::check_invariants();
    FAISS_THROW_IF_NOT_FMT(
            shard_tokens >= 1 && shard_tokens <= kMaxPosition,
            "IndexKVShards: shard_tokens=%zd must be in [1, 2^62]",
            ssize_t(shard_tokens));
    FAISS_THROW_IF_NOT_FMT(
            first_position >= 0 && n_after >= 0 && first_position <= kMaxPosition &&
                    n_after <= kMaxPosition && ntotal <= kMaxPosition - first_position - n_after,
            "IndexKVShards: first_position=%zd + ntotal=%zd + n_after=%zd must be in [0, 2^62]",
            ssize_t(first_position),
            ssize_t(ntotal),
            ssize_t(n_after));
    check_children_in_step(); // each shard was checked as it was read
    const std::string chain = empty_shard->factory_string();
    for (size_t s = 0; s < shards.size(); s++) {
        FAISS_THROW_IF_NOT_FMT(
                shards[s]->factory_string() == chain,
                "IndexKVShards: shard %zu is %s, the shards' chain %s",
                s,
                index_factory_string(shards[s].get()).c_str(),
                index_factory_string(empty_shard.get()).c_str());
    }
}

} // namespace kvindex
