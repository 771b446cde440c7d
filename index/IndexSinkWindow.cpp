#include <kvindex/IndexSinkWindow.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

#include <faiss/impl/FaissAssert.h>

#include <kvindex/attention.h>
#include <kvindex/impl/io.h>
#include <kvindex/index_factory.h>
#include <kvindex/index_io.h>
#include <kvindex/kernels.h>

#include "checks.h"
#include "parallel.h"

namespace kvindex {

IndexSinkWindow::IndexSinkWindow() : KVIndex(0, 0) {}

IndexSinkWindow::IndexSinkWindow(
        idx_t n_sink, idx_t n_window, std::unique_ptr<KVIndex> inner_index)
        : KVIndex(inner_index ? inner_index->d : 0,
                  inner_index ? inner_index->d_value : 0,
                  inner_index ? inner_index->kv_type : KVType::f32),
          n_sink(n_sink),
          n_window(n_window),
          inner(std::move(inner_index)),
          sink(d, d_value, kv_type),
          window(d, d_value, kv_type) {
    FAISS_THROW_IF_NOT_MSG(inner, "IndexSinkWindow: inner index missing (nullptr)");
    FAISS_THROW_IF_NOT_FMT(
            n_sink >= 0 && n_window >= 0,
            "IndexSinkWindow: n_sink=%zd and n_window=%zd must be >= 0",
            size_t(n_sink),
            size_t(n_window));
    FAISS_THROW_IF_NOT_FMT(
            inner->ntotal == 0,
            "IndexSinkWindow: inner index must be empty, holds %zd tokens",
            size_t(inner->ntotal));
}

std::unique_ptr<KVIndex> IndexSinkWindow::from_factory(FactoryChain& chain) {
    // "Sink<n>" and "Window<m>", at most one of each, in either order
    idx_t counts[2] = {-1, -1};
    const char* names[2] = {"Sink", "Window"};
    std::string taken;
    while (!chain.at_end()) {
        int which = -1;
        idx_t c;
        for (int i = 0; i < 2; i++) {
            if (parse_factory_count(chain.peek(), names[i], &c)) {
                which = i;
            }
        }
        if (which < 0) {
            break;
        }
        FAISS_THROW_IF_NOT_FMT(
                counts[which] < 0,
                "index_factory: '%s' in '%s': %s given twice",
                chain.peek().c_str(),
                chain.description().c_str(),
                names[which]);
        counts[which] = c;
        taken += (taken.empty() ? "" : ",") + chain.take();
    }
    if (taken.empty()) {
        return nullptr;
    }
    std::unique_ptr<KVIndex> inner = chain.build_rest(taken);
    return std::make_unique<IndexSinkWindow>(
            std::max<idx_t>(counts[0], 0), std::max<idx_t>(counts[1], 0), std::move(inner));
}

std::string IndexSinkWindow::factory_string() const {
    std::string s;
    if (n_sink > 0) {
        s += "Sink" + std::to_string(n_sink) + ",";
    }
    if (n_window > 0) {
        s += "Window" + std::to_string(n_window) + ",";
    }
    if (s.empty()) {
        s = "Sink0,"; // keep the wrapper visible in the round trip
    }
    return s + inner->factory_string();
}

idx_t IndexSinkWindow::window_start() const {
    return sink.size() + inner->ntotal;
}

void IndexSinkWindow::window_to_float(
        idx_t j0, idx_t n, std::vector<float>* k, std::vector<float>* v) const {
    // at most two runs of slots: from window_slot(j0) to the end, then from 0
    const idx_t s0 = n > 0 ? window_slot(j0) : 0;
    const idx_t first = std::min(n, window.size() - s0);
    window.to_float(s0, first, k, v);
    if (first < n) {
        std::vector<float> k2, v2;
        window.to_float(0, n - first, &k2, &v2);
        k->insert(k->end(), k2.begin(), k2.end());
        v->insert(v->end(), v2.begin(), v2.end());
    }
}

void IndexSinkWindow::push_window(idx_t m, const float* keys, const float* values) {
    const idx_t appended = std::min(m, n_window - window.size());
    window.append(appended, keys, values);
    for (idx_t done = appended; done < m;) {
        const idx_t run = std::min(m - done, n_window - window_head);
        window.assign(window_head, run, keys + done * d, values + done * d_value);
        window_head = (window_head + run) % n_window;
        done += run;
    }
}

void IndexSinkWindow::add_kv_impl(idx_t n, const float* keys, const float* values) {
    const idx_t to_sink = std::min(n, n_sink - sink.size());
    const idx_t rest = n - to_sink;
    const float* rest_keys = keys + to_sink * d;
    const float* rest_values = values + to_sink * d_value;
    const idx_t overflow = std::max<idx_t>(0, window.size() + rest - n_window);
    // The oldest `overflow` tokens of (window, new tokens after the sink)
    // leave the window for the inner index. Gather them first and add them
    // in one call, so that a failure in the inner index changes nothing here.
    const idx_t from_window = std::min(overflow, window.size());
    const idx_t from_new = overflow - from_window;
    // Room for the sink's and the window's new rows first: after the inner
    // index has taken its tokens nothing here may fail (writes_roll_back).
    const idx_t to_window = rest - from_new;
    sink.reserve(sink.size() + to_sink);
    window.reserve(window.size() + std::min(to_window, n_window - window.size()));
    if (keeping_undo()) {
        // where the sink and window stand now (a throw below forgets it)
        undo.sink_size = sink.size();
        undo.window_size = window.size();
        undo.window_head = window_head;
        undo.inner_added = overflow > 0;
        undo.n_left = from_window;
    }
    if (overflow > 0) {
        // as floats: the window's stored values convert back exactly
        std::vector<float> mk, mv;
        window_to_float(0, from_window, &mk, &mv);
        mk.insert(mk.end(), rest_keys, rest_keys + from_new * d);
        mv.insert(mv.end(), rest_values, rest_values + from_new * d_value);
        add_kv_to(*inner, overflow, mk.data(), mv.data());
        if (keeping_undo()) {
            // the rows the new ones overwrite below: kept, not copied
            undo.keys.swap(mk);
            undo.values.swap(mv);
        }
    }
    sink.append(to_sink, keys, values);
    // the others enter the window, in the slots of the tokens that left it
    push_window(to_window, rest_keys + from_new * d, rest_values + from_new * d_value);
}

void IndexSinkWindow::undo_add_kv_impl(idx_t) {
    if (undo.inner_added) {
        inner->undo_add_kv();
    }
    sink.truncate(undo.sink_size);
    window.truncate(undo.window_size);
    // the rows that left take back the slots the new ones took: the
    // oldest's first, from the old head on
    for (idx_t j = 0; j < undo.n_left; j++) {
        idx_t slot = undo.window_head + j;
        slot = slot < undo.window_size ? slot : slot - undo.window_size;
        window.assign(slot, 1, undo.keys.data() + size_t(j) * d, undo.values.data() + size_t(j) * d_value);
    }
    window_head = undo.window_head;
}

void IndexSinkWindow::forget_undo_impl() noexcept {
    undo = Undo();
}

bool IndexSinkWindow::can_undo_add() const {
    return inner && inner->can_undo_add();
}

void IndexSinkWindow::prefill_impl(const PrefillInput& in) {
    check_prefill(in);
    // The inner index gets the middle of the prompt and every query, with
    // absolute positions so that position-aware indexes stay correct.
    idx_t n_s = std::min(in.n_tokens, n_sink);
    idx_t n_mid = std::max<idx_t>(0, in.n_tokens - n_s - n_window);
    std::vector<idx_t> positions = in.implicit_query_positions(); // the inner keys start later
    PrefillInput mid = in;
    if (!positions.empty()) {
        mid.query_positions = positions.data();
    }
    mid.n_tokens = n_mid;
    mid.keys = in.keys + n_s * d;
    mid.values = in.values + n_s * d_value;
    // the inner index's first key follows a full sink, even when this
    // prompt is shorter than the sink (its first key then comes later)
    mid.first_position = in.first_position + n_sink;
    // the inner index gets tokens only once the window is full
    mid.n_after = in.n_after + n_window;
    idx_t n_w = in.n_tokens - n_s - n_mid;
    sink.reserve(n_s); // first, as in add_kv_impl
    window.reserve(n_w);
    inner->prefill(mid);
    sink.append(n_s, in.keys, in.values);
    window.append(n_w, in.keys + (n_s + n_mid) * d, in.values + (n_s + n_mid) * d_value);
    ntotal = in.n_tokens;
    rope = in.rope;
    has_rope = true;
}

void IndexSinkWindow::search_batch(
        idx_t n,
        const float* q,
        idx_t k,
        float* distances,
        idx_t* labels,
        const faiss::SearchParameters* params) const {
    std::vector<float> inner_dis;
    std::vector<idx_t> inner_ids;
    if (inner->ntotal > 0) {
        inner_dis.resize(n * k);
        inner_ids.resize(n * k);
        inner->search(n, q, k, inner_dis.data(), inner_ids.data(), params);
    }
    idx_t w0 = window_start();
    parallel_for(n, [&](idx_t i) {
        // candidates: every static token, scored exactly, and the inner top-k
        std::vector<std::pair<float, idx_t>> cand;
        std::vector<float> s(std::max(sink.size(), window.size()));
        const float* qi = q + i * d;
        inner_products_scaled(qi, sink.key_rows(), sink.size(), 1.0f, s.data());
        for (idx_t j = 0; j < sink.size(); j++) {
            cand.emplace_back(s[j], j);
        }
        // the window's slots from window_head hold its oldest tokens
        const idx_t n_old = window.size() - window_head;
        inner_products_scaled(qi, window.key_rows().from(window_head), n_old, 1.0f, s.data());
        inner_products_scaled(qi, window.key_rows(), window_head, 1.0f, s.data() + n_old);
        for (idx_t j = 0; j < window.size(); j++) {
            cand.emplace_back(s[j], w0 + j);
        }
        idx_t n_inner = inner_ids.empty() ? 0 : k;
        for (idx_t j = 0; j < n_inner; j++) {
            idx_t id = inner_ids[i * k + j];
            if (id >= 0) {
                cand.emplace_back(inner_dis[i * k + j], id + sink.size());
            }
        }
        idx_t kk = std::min<idx_t>(k, cand.size());
        std::partial_sort(
                cand.begin(), cand.begin() + kk, cand.end(), [](auto& a, auto& b) {
                    return a.first > b.first || (a.first == b.first && a.second < b.second);
                });
        for (idx_t j = 0; j < k; j++) {
            distances[i * k + j] = j < kk ? cand[j].first : std::numeric_limits<float>::lowest();
            labels[i * k + j] = j < kk ? cand[j].second : -1;
        }
    });
}

void IndexSinkWindow::select_batch(
        idx_t n,
        const float* q,
        Selection* sel,
        const faiss::SearchParameters* params) const {
    if (inner->ntotal > 0) {
        inner->select(n, q, sel, params);
    }
    idx_t w0 = window_start();
    for (idx_t i = 0; i < n; i++) {
        Selection all;
        for (idx_t j = 0; j < sink.size(); j++) {
            all.push_back(j);
        }
        if (inner->ntotal > 0) {
            for (size_t j = 0; j < sel[i].size(); j++) {
                all.push_back(sel[i].ids[j] + sink.size(), sel[i].inclusion[j]);
            }
            all.n_scanned = sel[i].n_scanned;
        }
        for (idx_t j = 0; j < window.size(); j++) {
            all.push_back(w0 + j);
        }
        sel[i] = std::move(all);
    }
}

void IndexSinkWindow::attend_batch(
        idx_t n,
        const float* q,
        float* out,
        float* lse,
        const faiss::SearchParameters* params) const {
    // the inner index gets all the queries in one call (a GQA group: one
    // pass over its tokens where its type batches, e.g. Flat)
    std::vector<float> inner_out, inner_lse;
    if (inner->ntotal > 0) {
        inner_out.resize(n * d_value);
        inner_lse.resize(n);
        inner->attend(n, q, inner_out.data(), inner_lse.data(), params);
    }
    // the static tokens: one pass over sink and window per chunk of
    // queries, then a merge per query
    constexpr idx_t chunk = 8;
    idx_t n_chunks = (n + chunk - 1) / chunk;
    float scale = score_scale();
    parallel_for(n_chunks, [&](idx_t ch) {
        idx_t i0 = ch * chunk;
        idx_t nc = std::min(chunk, n - i0);
        const float* qc = q + i0 * d;
        // parts: the sink, the window's two runs of slots (from window_head
        // to the end, then from 0), the inner index
        std::vector<float> parts(3 * nc * d_value);
        float* sink_out = parts.data();
        float* old_out = parts.data() + nc * d_value;
        float* new_out = parts.data() + 2 * nc * d_value;
        float sink_lse[chunk], old_lse[chunk], new_lse[chunk];
        dense_attention_group(
                qc, size_t(nc), sink.key_rows(), sink.value_rows(), size_t(sink.size()),
                scale, sink_out, sink_lse);
        dense_attention_group(
                qc, size_t(nc), window.key_rows().from(window_head),
                window.value_rows().from(window_head), size_t(window.size() - window_head),
                scale, old_out, old_lse);
        dense_attention_group(
                qc, size_t(nc), window.key_rows(), window.value_rows(), size_t(window_head),
                scale, new_out, new_lse);
        for (idx_t c = 0; c < nc; c++) {
            idx_t i = i0 + c;
            float lses[4] = {sink_lse[c], old_lse[c], new_lse[c], 0.0f};
            const float* outs[4] = {
                    sink_out + c * d_value, old_out + c * d_value, new_out + c * d_value, nullptr};
            size_t n_parts = 3;
            if (inner->ntotal > 0) {
                outs[3] = inner_out.data() + i * d_value;
                lses[3] = inner_lse[i];
                n_parts = 4;
            }
            lse[i] = merge_attention(n_parts, outs, lses, d_value, out + i * d_value);
        }
    });
}

void IndexSinkWindow::reset_impl() {
    inner->reset(); // first: the only part that can throw
    sink.clear();
    window.clear();
    window_head = 0;
    ntotal = 0;
}

bool IndexSinkWindow::writes_roll_back() const {
    // its own rows are reserved before the inner index is written
    return inner && inner->writes_roll_back();
}

void IndexSinkWindow::reconstruct_impl(idx_t key, float* recons) const {
    if (key < sink.size()) {
        sink.key(key, recons);
    } else if (key >= window_start()) {
        window.key(window_slot(key - window_start()), recons);
    } else {
        inner->reconstruct(key - sink.size(), recons);
    }
}

void IndexSinkWindow::reconstruct_value_impl(idx_t key, float* value) const {
    if (key < sink.size()) {
        sink.value(key, value);
    } else if (key >= window_start()) {
        window.value(window_slot(key - window_start()), value);
    } else {
        inner->reconstruct_value(key - sink.size(), value);
    }
}

size_t IndexSinkWindow::memory_bytes() const {
    return sink.memory_bytes() + window.memory_bytes() + inner->memory_bytes();
}

void IndexSinkWindow::write_fields(BufferWriter& w) const {
    w.value<int64_t>(n_sink);
    w.value<int64_t>(n_window);
    sink.write(w);
    // the slots as they are, and the ring's head: a read index sums the
    // window's two runs as this one does, so that its answers are the same bits
    window.write(w);
    w.value<int64_t>(window_head); // from record version 2
    write_index_record(inner.get(), w);
}

void IndexSinkWindow::read_fields(BufferReader& r, uint32_t version) {
    n_sink = r.value<int64_t>("n_sink");
    n_window = r.value<int64_t>("n_window");
    sink = KVStorage(d, d_value, kv_type);
    window = KVStorage(d, d_value, kv_type);
    sink.read(r, "sink tokens");
    window.read(r, "window tokens");
    // version 1 moved the window down at every append: its oldest token at slot 0
    window_head = version >= 2 ? r.value<int64_t>("window head") : 0;
    inner = read_index_record(r);
}

void IndexSinkWindow::check_children_in_step() const {
    check_child_in_step(inner.get(), ntotal - sink.size() - window.size(), "IndexSinkWindow", "inner");
}

void IndexSinkWindow::check_invariants() const {
    KVIndex::check_invariants();
    FAISS_THROW_IF_NOT_MSG(inner, "IndexSinkWindow: inner index missing");
    bool full_sink = sink.size() == n_sink;
    FAISS_THROW_IF_NOT_MSG(
            n_sink >= 0 && n_window >= 0 && sink.d == size_t(d) && window.d == size_t(d) &&
                    sink.type == kv_type && window.type == kv_type &&
                    sink.d_value == size_t(d_value) && window.d_value == size_t(d_value) &&
                    sink.size() <= n_sink && window.size() <= n_window &&
                    (full_sink || (inner->ntotal == 0 && window.size() == 0)) &&
                    (inner->ntotal == 0 || window.size() == n_window) &&
                    sink.size() + inner->ntotal + window.size() == ntotal &&
                    window_head >= 0 &&
                    (window_head == 0 || (window.size() == n_window && window_head < n_window)),
            "IndexSinkWindow: sink/window split inconsistent with ntotal");
}

} // namespace kvindex
