#include <kvindex/IndexSampleBase.h>

#include <faiss/impl/FaissAssert.h>

#include <kvindex/impl/io.h>

#include "checks.h"
#include "random.h"

namespace kvindex {

IndexSampleBase::IndexSampleBase() : KVIndex(0, 0) {}

IndexSampleBase::IndexSampleBase(int d, int d_value, KVType kv_type)
        : KVIndex(d, d_value, kv_type), storage(d, this->d_value, kv_type) {}

uint64_t IndexSampleBase::draw_state(const float* q, idx_t n) const {
    return stream_seed(seed, stream) ^ hash_query(q, d) ^ (uint64_t(n) << 1);
}

void IndexSampleBase::select_one(
        const float* q, Selection& sel, const faiss::SearchParameters* params) const {
    select_outside_one(q, nullptr, 0, sel, params);
}

bool IndexSampleBase::share_tokens(const KVStorage* lent) {
    FAISS_THROW_IF_NOT_FMT(lent, "%s::share_tokens: no tokens (nullptr)", type_name());
    drop_for_shared(storage, *lent, ntotal, type_name());
    shared_tokens = lent;
    return true;
}

void IndexSampleBase::add_kv_impl(idx_t n, const float* keys, const float* values) {
    append_or_check_shared(storage, shared_tokens, ntotal, n, keys, values, type_name());
}

void IndexSampleBase::undo_add_kv_impl(idx_t n) {
    if (!shared_tokens) {
        storage.truncate(ntotal - n); // lent tokens are their owner's to take back
    }
}

void IndexSampleBase::reset_impl() {
    storage.clear(); // lent tokens are the owner's to clear
    ntotal = 0;
}

size_t IndexSampleBase::memory_bytes() const {
    return storage.memory_bytes();
}

std::vector<ParameterInfo> IndexSampleBase::parameter_info() const {
    std::vector<ParameterInfo> info = KVIndex::parameter_info();
    info.push_back(ParameterInfo::integer("seed", 0, ParameterInfo::kNoBound, "seed of the draws (with the per-head stream)"));
    return info;
}

bool IndexSampleBase::set_parameter(const std::string& name, double value) {
    if (name != "seed") {
        return KVIndex::set_parameter(name, value);
    }
    seed = count_parameter(name, value);
    return true;
}

bool IndexSampleBase::get_parameter(const std::string& name, double* value) const {
    if (name != "seed") {
        return KVIndex::get_parameter(name, value);
    }
    *value = double(seed);
    return true;
}

void IndexSampleBase::set_stream(uint64_t s) {
    stream = s;
}

void IndexSampleBase::write_fields(BufferWriter& w) const {
    w.value<uint64_t>(seed);
    w.value<uint64_t>(stream);
    tokens().write(w);
}

void IndexSampleBase::read_fields(BufferReader& r, uint32_t) {
    seed = r.value<uint64_t>("seed");
    stream = r.value<uint64_t>("stream");
    shared_tokens = nullptr;
    storage = KVStorage(d, d_value, kv_type);
    storage.read(r, (factory_string() + " storage").c_str());
}

void IndexSampleBase::check_invariants() const {
    KVIndex::check_invariants();
    check_seed_knob(seed, type_name());
    const KVStorage& st = tokens();
    FAISS_THROW_IF_NOT_FMT(
            st.d == size_t(d) && st.d_value == size_t(d_value) && st.type == kv_type &&
                    st.size() == ntotal && (!shared_tokens || storage.size() == 0),
            "%s: storage holds %zd tokens (%s), ntotal is %zd",
            type_name(),
            size_t(st.size()),
            shared_tokens ? "lent" : "its own",
            size_t(ntotal));
}

} // namespace kvindex
