#include <kvindex/IndexChoose.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>

#include <faiss/impl/FaissAssert.h>
#include <faiss/impl/FaissException.h>

#include <kvindex/attention.h>
#include <kvindex/impl/io.h>
#include <kvindex/index_factory.h>
#include <kvindex/index_io.h>
#include <kvindex/parameters.h>

#include "checks.h"
#include "parallel.h"
#include "query_rows.h"
#include "random.h"

namespace kvindex {

namespace {

constexpr const char* kChooseGrammar = "Choose(<chain>;<chain>[;...]) or Auto";

/// Splits the body of "Choose(...)" at the ';' outside parentheses.
std::vector<std::string> split_candidates(const std::string& body, const std::string& element) {
    std::vector<std::string> parts;
    std::string cur;
    int depth = 0;
    for (char c : body) {
        if (c == '(') {
            depth++;
        } else if (c == ')') {
            FAISS_THROW_IF_NOT_FMT(
                    depth > 0, "index_factory: unbalanced ')' in '%s'", element.c_str());
            depth--;
        }
        if (c == ';' && depth == 0) {
            parts.push_back(cur);
            cur.clear();
        } else {
            cur += c;
        }
    }
    FAISS_THROW_IF_NOT_FMT(depth == 0, "index_factory: unbalanced '(' in '%s'", element.c_str());
    parts.push_back(cur);
    return parts;
}

/// Empties a candidate for good: reset, then a copy, so that the memory
/// its tokens took is given back (reset keeps the vectors' capacity) while
/// its knobs, stream and adopted models stay.
void empty_for_good(std::unique_ptr<KVIndex>& c) {
    c->reset();
    c = clone_index(c.get()); // replaced only once the copy is whole
}

/// Whether an index of the chain rooted at `index` has the knob; *prefill
/// tells whether one of them reads it at prefill.
bool chain_has(const KVIndex* index, const std::string& name, bool* prefill) {
    bool found = false;
    for (const ParameterInfo& p : index->parameter_info()) {
        if (p.name == name) {
            found = true;
            *prefill = *prefill || p.prefill_time;
        }
    }
    for (const KVIndex* c : index->children()) {
        found = chain_has(c, name, prefill) || found;
    }
    return found;
}

/// Whether error a beats error b: lower, and a NaN (a candidate whose
/// output was not finite) never wins.
bool better(double a, double b) {
    return !std::isnan(a) && (std::isnan(b) || a < b);
}

/// Candidate i exists and has the index's d, d_value and storage type.
void check_candidate_shape(const KVIndex& index, const KVIndex* c, size_t i) {
    FAISS_THROW_IF_NOT_FMT(c, "IndexChoose: candidate %zu missing (nullptr)", i);
    FAISS_THROW_IF_NOT_FMT(
            c->d == index.d && c->d_value == index.d_value && c->kv_type == index.kv_type,
            "IndexChoose: candidate %zu has d=%d d_value=%d %s, the index d=%d d_value=%d %s",
            i,
            c->d,
            c->d_value,
            kv_type_name(c->kv_type),
            index.d,
            index.d_value,
            kv_type_name(index.kv_type));
}

} // namespace

// The fast families, each reading a few percent of a long prompt's keys at
// its defaults (IVFAsym128 for short prompts, IVFAsym512 for long ones);
// the eviction candidate keeps `budget` tokens once set. Left out for their
// prefill: RoarGraph's build, and the evictions that score the prompt with
// its own queries, H2O and NaCl (their time grows as the prompt squared:
// 228 s and 115 s for two 64k heads here, where TOVA takes 0.05 s and
// errs less).
const char* const IndexChoose::kAutoCandidates =
        "Sink4,Window64,LSHSample10x150;Sink1,Window63,IVFAsym128;Sink1,Window63,IVFAsym512;"
        "ProxyEvict20_TOVA";

int IndexChoose::choice(
        const std::vector<double>& errors,
        const std::vector<double>& reads,
        idx_t budget) {
    const bool limited = budget > 0 && reads.size() == errors.size();
    auto within = [&](size_t c) { return !limited || reads[c] <= double(budget); };
    int best = -1;
    for (size_t c = 0; c < errors.size(); c++) {
        if (within(c) && (best < 0 || better(errors[c], errors[best]))) {
            best = int(c);
        }
    }
    if (best >= 0 || errors.empty()) {
        return std::max(best, 0);
    }
    // every candidate reads more than the budget: the one reading least
    best = 0;
    for (size_t c = 1; c < errors.size(); c++) {
        if (reads[c] < reads[best] || (reads[c] == reads[best] && better(errors[c], errors[best]))) {
            best = int(c);
        }
    }
    return best;
}

IndexChoose::IndexChoose() : KVIndex(0, 0) {}

IndexChoose::IndexChoose(std::vector<std::unique_ptr<KVIndex>> cands)
        : KVIndex(!cands.empty() && cands[0] ? cands[0]->d : 0,
                  !cands.empty() && cands[0] ? cands[0]->d_value : 0,
                  !cands.empty() && cands[0] ? cands[0]->kv_type : KVType::f32),
          candidates(std::move(cands)) {
    FAISS_THROW_IF_NOT_FMT(
            candidates.size() >= 2 && candidates.size() <= size_t(kMaxCandidates),
            "IndexChoose: %zu candidates, needs 2 to %d",
            candidates.size(),
            kMaxCandidates);
    for (size_t i = 0; i < candidates.size(); i++) {
        const KVIndex* c = candidates[i].get();
        check_candidate_shape(*this, c, i);
        FAISS_THROW_IF_NOT_FMT(
                c->ntotal == 0,
                "IndexChoose: candidate %zu must be empty, holds %zd tokens",
                i,
                size_t(c->ntotal));
    }
}

// ---- factory -------------------------------------------------------------------

std::unique_ptr<KVIndex> IndexChoose::from_factory(FactoryChain& chain) {
    const std::string e = chain.peek();
    const std::string open = "Choose(";
    const bool is_auto = e == "Auto";
    if (!is_auto && e.compare(0, open.size(), open) != 0) {
        return nullptr;
    }
    FAISS_THROW_IF_NOT_FMT(
            is_auto || (e.size() > open.size() && e.back() == ')'),
            "index_factory: '%s' in '%s': expected %s",
            e.c_str(),
            chain.description().c_str(),
            kChooseGrammar);
    chain.take();
    std::vector<std::string> parts = is_auto
            ? split_candidates(kAutoCandidates, e)
            : split_candidates(e.substr(open.size(), e.size() - open.size() - 1), e);
    FAISS_THROW_IF_NOT_FMT(
            parts.size() >= 2 && parts.size() <= size_t(kMaxCandidates),
            "index_factory: '%s': Choose needs 2 to %d candidates separated by ';', got %zu "
            "(%s)",
            e.c_str(),
            kMaxCandidates,
            parts.size(),
            kChooseGrammar);
    std::vector<std::unique_ptr<KVIndex>> cands;
    for (size_t i = 0; i < parts.size(); i++) {
        FAISS_THROW_IF_NOT_FMT(
                !parts[i].empty(),
                "index_factory: '%s': candidate %zu is empty (%s)",
                e.c_str(),
                i + 1,
                kChooseGrammar);
        try {
            cands.push_back(chain.parse_nested(parts[i]));
        } catch (const faiss::FaissException& ex) {
            FAISS_THROW_FMT(
                    "index_factory: '%s': candidate %zu '%s': %s",
                    e.c_str(),
                    i + 1,
                    parts[i].c_str(),
                    bare_error_message(ex).c_str());
        }
    }
    return std::make_unique<IndexChoose>(std::move(cands));
}

std::string IndexChoose::factory_string() const {
    std::string s = "Choose(";
    for (size_t i = 0; i < candidates.size(); i++) {
        s += (i ? ";" : "") + candidates[i]->factory_string();
    }
    return s + ")";
}

std::vector<std::string> IndexChoose::candidate_strings() const {
    std::vector<std::string> s;
    for (const auto& c : candidates) {
        s.push_back(c->factory_string());
    }
    return s;
}

std::string IndexChoose::chosen_string() const {
    return chosen >= 0 ? candidates[chosen]->factory_string() : std::string();
}

const KVIndex* IndexChoose::chosen_index() const {
    return chosen >= 0 ? candidates[chosen].get() : nullptr;
}

std::vector<const KVIndex*> IndexChoose::held_indexes() const {
    std::vector<const KVIndex*> all;
    for (const auto& c : candidates) {
        all.push_back(c.get());
    }
    return all;
}

std::vector<const KVIndex*> IndexChoose::children() const {
    if (chosen >= 0 && size_t(chosen) < candidates.size()) {
        return {candidates[chosen].get()};
    }
    // (an out-of-range choice, read from a forged file, is refused by
    // check_invariants: every candidate is checked meanwhile)
    return held_indexes();
}

// ---- prefill: the choice ---------------------------------------------------------

std::vector<idx_t> IndexChoose::choose_holdout(const PrefillInput& in) const {
    idx_t nq = in.n_queries;
    if (in.n_tokens <= 0 || nq <= 0) {
        return {};
    }
    auto position = [&](idx_t i) { return in.query_position(i); };
    // by position (ties by index); the queries at the last position are
    // never held back: eviction policies score with them (TOVA: only them)
    std::vector<idx_t> order(nq);
    std::iota(order.begin(), order.end(), idx_t(0));
    std::stable_sort(order.begin(), order.end(), [&](idx_t a, idx_t b) {
        return position(a) < position(b);
    });
    idx_t last = position(order.back());
    while (!order.empty() && position(order.back()) == last) {
        order.pop_back();
    }
    // the later half of the others, of which at most half are held back:
    // the candidates keep three quarters of the queries, the late ones too
    size_t half = order.size() / 2;
    std::vector<idx_t> pool(order.end() - half, order.end());
    size_t m = std::min<size_t>(size_t(n_holdout), pool.size() / 2);
    if (recent_holdout) {
        // the latest m, already by position (ties by index: a stable sort)
        return std::vector<idx_t>(pool.end() - m, pool.end());
    }
    // a partial Fisher-Yates shuffle on raw mt19937_64 draws: the same
    // sample with every standard library
    std::mt19937_64 rng(stream_seed(seed, stream));
    for (size_t j = 0; j < m; j++) {
        size_t r = j + size_t(rng() % uint64_t(pool.size() - j));
        std::swap(pool[j], pool[r]);
    }
    pool.resize(m);
    std::sort(pool.begin(), pool.end(), [&](idx_t a, idx_t b) {
        return position(a) < position(b) || (position(a) == position(b) && a < b);
    });
    return pool;
}

double IndexChoose::holdout_reads(
        const KVIndex& candidate,
        const float* held_queries,
        idx_t n_held) const {
    std::vector<Selection> sel(n_held);
    SearchParametersKV count;
    count.count_scanned = true;
    candidate.select(n_held, held_queries, sel.data(), &count);
    double total = 0;
    for (const Selection& s : sel) {
        total += s.tokens_read();
    }
    return total / double(std::max<idx_t>(n_held, 1));
}

double IndexChoose::holdout_error(
        const KVIndex& candidate,
        const float* held_queries,
        const float* exact,
        idx_t n_held) const {
    std::vector<float> out(size_t(n_held) * d_value), lse(n_held);
    candidate.attend(n_held, held_queries, out.data(), lse.data());
    return mean_relative_error(out.data(), exact, size_t(n_held), size_t(d_value));
}

void IndexChoose::prefill_impl(const PrefillInput& in) {
    check_prefill(in);
    std::vector<idx_t> held = choose_holdout(in);
    try {
        if (held.empty()) {
            // nothing to measure with: the first candidate, unmeasured
            candidates[0]->prefill(in);
            chosen = 0;
            errors.clear();
            reads.clear();
            holdout_positions.clear();
        } else {
            const idx_t nq = in.n_queries;
            const int n_heads = in.n_query_heads;
            const idx_t nh = idx_t(held.size());
            auto position = [&](idx_t i) { return in.query_position(i); };
            std::vector<char> is_held(nq, 0);
            for (idx_t i : held) {
                is_held[i] = 1;
            }
            // the candidates learn from the other queries, positions explicit
            std::vector<idx_t> rest, rest_pos;
            for (idx_t i = 0; i < nq; i++) {
                if (!is_held[i]) {
                    rest.push_back(i);
                    rest_pos.push_back(position(i));
                }
            }
            const idx_t nr = idx_t(rest.size());
            std::vector<float> rest_q = gather_query_rows(in.queries, n_heads, nq, rest, d);
            std::vector<float> held_q = gather_query_rows(in.queries, n_heads, nq, held, d);
            // exact attention of each held-back query over every token held
            const idx_t n_eval = idx_t(n_heads) * nh;
            std::vector<float> exact(size_t(n_eval) * d_value);
            parallel_for(n_eval, [&](idx_t i) {
                exact_attention(held_q.data() + size_t(i) * d, in.keys, in.values, d, d_value,
                                size_t(in.n_tokens), exact.data() + size_t(i) * d_value);
            });
            PrefillInput sub = in;
            sub.n_queries = nr;
            sub.queries = rest_q.data();
            sub.query_positions = rest_pos.data();
            // one candidate at a time, the best so far kept: at most two
            // copies of the prompt are held at once
            std::vector<double> errs, rds;
            int best = -1;
            for (size_t c = 0; c < candidates.size(); c++) {
                candidates[c]->prefill(sub);
                errs.push_back(holdout_error(*candidates[c], held_q.data(), exact.data(), n_eval));
                if (budget > 0) {
                    rds.push_back(holdout_reads(*candidates[c], held_q.data(), n_eval));
                }
                const int now = choice(errs, rds, budget);
                if (now == int(c)) {
                    if (best >= 0) {
                        empty_for_good(candidates[best]);
                    }
                    best = int(c);
                } else {
                    empty_for_good(candidates[c]);
                }
            }
            chosen = best;
            errors = std::move(errs);
            reads = std::move(rds);
            holdout_positions.clear();
            for (idx_t i : held) {
                holdout_positions.push_back(position(i));
            }
        }
    } catch (...) {
        // a refused prefill leaves the index empty and unchosen
        for (auto& c : candidates) {
            try {
                empty_for_good(c);
            } catch (...) {
            }
        }
        chosen = -1;
        errors.clear();
        reads.clear();
        holdout_positions.clear();
        throw;
    }
    ntotal = in.n_tokens;
    rope = in.rope;
    has_rope = true;
}

// ---- tokens and queries: the chosen index --------------------------------------

void IndexChoose::add_kv_impl(idx_t n, const float* keys, const float* values) {
    // appends without a prefill: the first candidate, unmeasured
    int c = chosen >= 0 ? chosen : 0;
    add_kv_to(*candidates[c], n, keys, values);
    chosen_before_add = chosen;
    chosen = c;
}

void IndexChoose::undo_add_kv_impl(idx_t) {
    candidates[chosen]->undo_add_kv();
    chosen = chosen_before_add;
}

bool IndexChoose::appends_roll_back() const {
    return !candidates.empty() && candidates[chosen >= 0 ? chosen : 0]->appends_roll_back();
}

bool IndexChoose::can_undo_add() const {
    return !candidates.empty() && candidates[chosen >= 0 ? chosen : 0]->can_undo_add();
}

void IndexChoose::reset_impl() {
    for (auto& c : candidates) {
        c->reset(); // the knobs (and adopted models) stay
    }
    chosen = -1;
    errors.clear();
    reads.clear();
    holdout_positions.clear();
    ntotal = 0;
}

void IndexChoose::search_batch(
        idx_t n,
        const float* q,
        idx_t k,
        float* distances,
        idx_t* labels,
        const faiss::SearchParameters* params) const {
    std::unique_ptr<SearchParametersKV> copy; // the knobs the chosen one reads
    candidates[chosen]->search(n, q, k, distances, labels, params_for(*candidates[chosen], params, copy));
}

void IndexChoose::select_batch(
        idx_t n,
        const float* q,
        Selection* sel,
        const faiss::SearchParameters* params) const {
    std::unique_ptr<SearchParametersKV> copy; // the knobs the chosen one reads
    candidates[chosen]->select(n, q, sel, params_for(*candidates[chosen], params, copy));
}

void IndexChoose::attend_batch(
        idx_t n,
        const float* q,
        float* out,
        float* lse,
        const faiss::SearchParameters* params) const {
    std::unique_ptr<SearchParametersKV> copy; // the knobs the chosen one reads
    candidates[chosen]->attend(n, q, out, lse, params_for(*candidates[chosen], params, copy));
}

void IndexChoose::select_outside_one(
        const float* q,
        const idx_t* excluded,
        size_t n_excluded,
        Selection& sel,
        const faiss::SearchParameters* params) const {
    std::unique_ptr<SearchParametersKV> copy; // the knobs the chosen one reads
    candidates[chosen]->select_outside(q, excluded, n_excluded, sel, params_for(*candidates[chosen], params, copy));
}

void IndexChoose::reconstruct_impl(idx_t key, float* recons) const {
    candidates[chosen]->reconstruct(key, recons);
}

void IndexChoose::reconstruct_value_impl(idx_t key, float* value) const {
    candidates[chosen]->reconstruct_value(key, value);
}

size_t IndexChoose::memory_bytes() const {
    size_t b = (errors.capacity() + reads.capacity()) * sizeof(double) +
            holdout_positions.capacity() * sizeof(idx_t);
    for (const auto& c : candidates) {
        b += c->memory_bytes(); // the unchosen ones are empty
    }
    return b;
}

// ---- parameters ------------------------------------------------------------------

std::vector<ParameterInfo> IndexChoose::parameter_info() const {
    // no "k" of its own: the candidates' budgets are theirs
    std::vector<ParameterInfo> info = {
            ParameterInfo::integer("n_holdout", 1, double(kMaxHoldout),
                                   "prefill queries held back to measure each candidate's error (at most half of "
                                   "the queries)")
                    .prefill(),
            ParameterInfo::integer("seed", 0, ParameterInfo::kNoBound, "seed of the holdout sample when recent_holdout=0 (with the per-head stream)")
                    .prefill(),
            ParameterInfo::flag("recent_holdout",
                                "1: hold back the latest queries (those just before the last position); 0: a "
                                "seeded sample of the later half")
                    .prefill(),
            ParameterInfo::integer("budget", 0, ParameterInfo::kNoBound,
                                   "tokens (keys and values) a candidate may read per query, measured on the "
                                   "held-back queries; also a ProxyEvict or Hybrid candidate's budget; 0: no limit")
                    .prefill()
                    .tokens(),
            ParameterInfo::reported("chosen", "the candidate prefill chose (0-based, in string order), -1 before a choice")};
    // after a choice the chain walk sees the chosen index only: the dormant
    // candidates' knobs are listed here (set_parameter and get_parameter
    // take them)
    for (size_t c = 0; chosen >= 0 && c < candidates.size(); c++) {
        if (int(c) == chosen) {
            continue;
        }
        for (const ParameterInfo& p : index_parameter_info(candidates[c].get())) {
            bool seen = std::any_of(info.begin(), info.end(), [&](const ParameterInfo& q) {
                return q.name == p.name;
            });
            if (!seen) {
                info.push_back(p);
            }
        }
    }
    return info;
}

bool IndexChoose::set_parameter(const std::string& name, double value) {
    bool own = false;
    if (name == "k") {
        // the candidates' budget (they report it); the own field mirrors it
        // for readers of KVIndex::k
        KVIndex::set_parameter(name, value);
    }
    if (name == "chosen") {
        FAISS_THROW_MSG(
                "parameter chosen is read-only: prefill chooses the candidate (it reads "
                "the chosen candidate's number, -1 before a choice)");
    } else if (name == "n_holdout") {
        FAISS_THROW_IF_NOT_FMT(
                is_positive_integer(value) && value <= double(kMaxHoldout),
                "parameter n_holdout=%g must be an integer in [1, %zd]",
                value,
                size_t(kMaxHoldout));
        n_holdout = idx_t(value);
        own = true;
    } else if (name == "seed") {
        seed = count_parameter(name, value);
        own = true;
    } else if (name == "budget") {
        budget = idx_t(count_parameter(name, value));
        own = true;
    } else if (name == "recent_holdout") {
        recent_holdout = flag_parameter(name, value);
        own = true;
    }
    if (chosen < 0) {
        return own; // the children are every candidate: the chain walk sets them
    }
    // After a choice the chain walk reaches the chosen index only: the
    // dormant candidates get the knob here, so that it holds for the next
    // prefill. Checked on all of them before any is changed.
    std::vector<KVIndex*> dormant;
    for (size_t c = 0; c < candidates.size(); c++) {
        bool prefill = false;
        if (int(c) == chosen || !chain_has(candidates[c].get(), name, &prefill)) {
            continue;
        }
        // what the chain walk refuses on an index holding tokens
        FAISS_THROW_IF_NOT_FMT(
                !prefill || ntotal == 0,
                "parameter '%s' is prefill-time: set it before prefill (%s already "
                "holds %zd tokens)",
                name.c_str(),
                factory_string().c_str(),
                size_t(ntotal));
        dormant.push_back(candidates[c].get());
    }
    for (KVIndex* c : dormant) {
        set_index_parameter(c, name, value);
    }
    return own || !dormant.empty();
}

bool IndexChoose::get_parameter(const std::string& name, double* value) const {
    if (name == "n_holdout") {
        *value = double(n_holdout);
        return true;
    } else if (name == "seed") {
        *value = double(seed);
        return true;
    } else if (name == "chosen") {
        *value = double(chosen);
        return true;
    } else if (name == "budget") {
        *value = double(budget);
        return true;
    } else if (name == "recent_holdout") {
        *value = recent_holdout ? 1.0 : 0.0;
        return true;
    }
    if (chosen < 0 || size_t(chosen) >= candidates.size()) {
        return false; // the chain walk reads the candidates, in order
    }
    // the chosen index's value, else the first dormant candidate's
    std::vector<const KVIndex*> order = {candidates[chosen].get()};
    for (size_t c = 0; c < candidates.size(); c++) {
        if (int(c) != chosen) {
            order.push_back(candidates[c].get());
        }
    }
    for (const KVIndex* c : order) {
        bool prefill = false;
        if (chain_has(c, name, &prefill)) {
            *value = get_index_parameter(c, name);
            return true;
        }
    }
    return false;
}

void IndexChoose::set_stream(uint64_t s) {
    stream = s;
    for (auto& c : candidates) {
        c->set_stream(s);
    }
}

void IndexChoose::check_adopt_trained(const KVIndex& trained) const {
    auto src = dynamic_cast<const IndexChoose*>(&trained);
    std::string theirs = src ? "IndexChoose of " + std::to_string(src->candidates.size()) +
                    " candidates"
                             : std::string(trained.type_name());
    FAISS_THROW_IF_NOT_FMT(
            src && src->candidates.size() == candidates.size(),
            "adopt_trained: the trained index is a %s, this one an IndexChoose of %zu "
            "candidates: build both from the same factory string",
            theirs.c_str(),
            candidates.size());
    for (size_t i = 0; i < candidates.size(); i++) {
        candidates[i]->check_adopt_trained(*src->candidates[i]);
    }
}

int IndexChoose::adopt_trained(const KVIndex& trained) {
    check_adopt_trained(trained); // every candidate before any adopts
    auto& src = static_cast<const IndexChoose&>(trained);
    int adopted = 0;
    for (size_t i = 0; i < candidates.size(); i++) {
        adopted += candidates[i]->adopt_trained(*src.candidates[i]);
    }
    return adopted;
}

// ---- io --------------------------------------------------------------------------

void IndexChoose::write_fields(BufferWriter& w) const {
    w.value<int64_t>(n_holdout);
    w.value<uint64_t>(seed);
    w.value<uint64_t>(stream);
    w.value<int32_t>(chosen);
    w.vector(errors);
    w.vector(holdout_positions);
    w.value<int64_t>(budget); // version 2
    w.vector(reads);
    w.value<uint8_t>(recent_holdout ? 1 : 0);
    // every candidate, the unchosen ones empty: their knobs (and adopted
    // models) survive the round trip and the next reset
    w.value<uint32_t>(uint32_t(candidates.size()));
    for (const auto& c : candidates) {
        write_index_record(c.get(), w);
    }
}

void IndexChoose::read_fields(BufferReader& r, uint32_t version) {
    n_holdout = r.value<int64_t>("n_holdout");
    seed = r.value<uint64_t>("seed");
    stream = r.value<uint64_t>("stream");
    chosen = r.value<int32_t>("chosen candidate");
    errors = r.vector<double>("candidate errors");
    holdout_positions = r.vector<idx_t>("holdout positions");
    budget = version >= 2 ? r.value<int64_t>("budget") : 0;
    reads = version >= 2 ? r.vector<double>("candidate reads") : std::vector<double>();
    recent_holdout = false; // version 1 held back a sample
    if (version >= 2) {
        uint8_t recent = r.value<uint8_t>("recent_holdout");
        FAISS_THROW_IF_NOT_FMT(recent <= 1, "read_index: invalid recent_holdout %d", int(recent));
        recent_holdout = recent == 1;
    }
    uint32_t n = r.value<uint32_t>("candidate count");
    FAISS_THROW_IF_NOT_FMT(
            n >= 2 && n <= uint32_t(kMaxCandidates),
            "read_index: IndexChoose has %u candidates, expected 2 to %d",
            n,
            kMaxCandidates);
    candidates.clear();
    for (uint32_t i = 0; i < n; i++) {
        candidates.push_back(read_index_record(r));
    }
}

void IndexChoose::check_children_in_step() const {
    for (size_t i = 0; i < candidates.size(); i++) {
        // the chosen candidate holds every token, the others none
        const idx_t expected = int(i) == chosen ? ntotal : 0;
        if (!candidates[i] || candidates[i]->ntotal != expected) { // the name only when it throws
            const std::string what = "candidate " + std::to_string(i);
            check_child_in_step(candidates[i].get(), expected, "IndexChoose", what.c_str());
        }
    }
}

void IndexChoose::check_invariants() const {
    KVIndex::check_invariants();
    check_seed_knob(seed, "IndexChoose");
    size_t n = candidates.size();
    FAISS_THROW_IF_NOT_FMT(
            n >= 2 && n <= size_t(kMaxCandidates),
            "IndexChoose: %zu candidates, expected 2 to %d",
            n,
            kMaxCandidates);
    FAISS_THROW_IF_NOT_FMT(
            chosen >= -1 && chosen < int(n) && (chosen >= 0 || ntotal == 0),
            "IndexChoose: chosen candidate %d invalid (%zu candidates, %zd tokens)",
            chosen,
            n,
            size_t(ntotal));
    for (size_t i = 0; i < n; i++) {
        const KVIndex* c = candidates[i].get();
        check_candidate_shape(*this, c, i);
        FAISS_THROW_IF_NOT_FMT(
                int(i) == chosen ? c->ntotal == ntotal : c->ntotal == 0,
                "IndexChoose: candidate %zu holds %zd tokens, expected %zd (chosen: %d, "
                "ntotal %zd)",
                i,
                size_t(c->ntotal),
                size_t(int(i) == chosen ? ntotal : 0),
                chosen,
                size_t(ntotal));
    }
    FAISS_THROW_IF_NOT_FMT(
            n_holdout >= 1 && n_holdout <= kMaxHoldout,
            "IndexChoose: n_holdout=%zd not in [1, %zd]",
            size_t(n_holdout),
            size_t(kMaxHoldout));
    // a measurement: one error per candidate, the holdout it used, and the
    // choice it implies
    bool measured = !errors.empty();
    FAISS_THROW_IF_NOT_FMT(
            (!measured || (errors.size() == n && chosen >= 0)) &&
                    measured == !holdout_positions.empty() &&
                    idx_t(holdout_positions.size()) <= n_holdout,
            "IndexChoose: %zu errors and %zu holdout positions for %zu candidates "
            "(n_holdout %zd, chosen %d)",
            errors.size(),
            holdout_positions.size(),
            n,
            size_t(n_holdout),
            chosen);
    for (size_t i = 0; i < holdout_positions.size(); i++) {
        FAISS_THROW_IF_NOT_FMT(
                holdout_positions[i] >= 0 &&
                        (i == 0 || holdout_positions[i] >= holdout_positions[i - 1]),
                "IndexChoose: holdout position %zd at %zu decreasing or negative",
                size_t(holdout_positions[i]),
                i);
    }
    for (double e : errors) {
        FAISS_THROW_IF_NOT_FMT(!(e < 0), "IndexChoose: negative candidate error %g", e);
    }
    FAISS_THROW_IF_NOT_FMT(budget >= 0, "IndexChoose: negative budget %zd", size_t(budget));
    FAISS_THROW_IF_NOT_FMT(
            reads.empty() || (reads.size() == n && measured && budget > 0),
            "IndexChoose: %zu candidate reads for %zu candidates (%zu errors, budget %zd)",
            reads.size(),
            n,
            errors.size(),
            size_t(budget));
    for (double x : reads) {
        FAISS_THROW_IF_NOT_FMT(
                std::isfinite(x) && x >= 0, "IndexChoose: candidate reads %g not finite and >= 0", x);
    }
    FAISS_THROW_IF_NOT_FMT(
            !measured || chosen == choice(errors, reads, budget),
            "IndexChoose: chosen candidate %d is not the one of lowest error within the budget "
            "(%d)",
            chosen,
            measured ? choice(errors, reads, budget) : -1);
}

} // namespace kvindex
