#include <kvindex/KVStorage.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include <faiss/impl/FaissAssert.h>

#include <kvindex/impl/growth.h>
#include <kvindex/impl/io.h>

#include "checks.h"

namespace kvindex {

namespace {

/// Refuses stored values add_kv would have refused: non-finite ones, and
/// |x| > kMaxInputMagnitude (a 16-bit value is widened first; fp16 cannot
/// hold such magnitudes, bf16 can).
void check_stored_input(KVType t, const RowBytes& bytes, size_t dim, const char* what) {
    if (t == KVType::f32) {
        check_input(reinterpret_cast<const float*>(bytes.data()), idx_t(bytes.size() / (dim * 4)), dim, what);
        return;
    }
    size_t n = bytes.size() / 2;
    for (size_t i = 0; i < n; i++) {
        uint16_t h;
        std::memcpy(&h, bytes.data() + 2 * i, 2);
        float v = t == KVType::bf16 ? to_float(bf16_t{h}) : to_float(f16_t{h});
        if (!(std::fabs(v) <= kMaxInputMagnitude)) { // also NaN
            std::string named = std::string(what) + " (" + kv_type_name(t) + ")";
            throw_out_of_bounds(v, i / dim, i % dim, named.c_str(), kMaxInputMagnitude);
        }
    }
}

} // namespace

void KVStorage::check_range(idx_t i0, idx_t n, const char* what) const {
    FAISS_THROW_IF_NOT_FMT(
            i0 >= 0 && n >= 0 && i0 <= size() && n <= size() - i0,
            "KVStorage::%s: tokens [%zd, %zd + %zd) outside the %zd stored",
            what,
            ssize_t(i0),
            ssize_t(i0),
            ssize_t(n),
            ssize_t(size()));
}

void KVStorage::key(idx_t i, float* out) const {
    check_range(i, 1, "key");
    convert_to_float(type, keys.data() + i * key_bytes(), d, out);
}

void KVStorage::value(idx_t i, float* out) const {
    check_range(i, 1, "value");
    convert_to_float(type, values.data() + i * value_bytes(), d_value, out);
}

void KVStorage::append(idx_t n, const float* k, const float* v) {
    check_input_size(n, std::max(d, d_value), "KVStorage::append"); // n >= 0 too
    size_t nk = keys.size(), nv = values.size();
    reserve(size() + n); // both arrays first: a failed allocation adds nothing
    keys.resize(nk + n * key_bytes());
    values.resize(nv + n * value_bytes());
    try {
        convert_from_float(type, k, n * d, d, keys.data() + nk, "add_kv: keys");
        convert_from_float(type, v, n * d_value, d_value, values.data() + nv, "add_kv: values");
    } catch (...) {
        keys.resize(nk);
        values.resize(nv);
        throw;
    }
}

void KVStorage::reserve(idx_t rows) {
    check_input_size(rows, std::max(d, d_value), "KVStorage::reserve");
    reserve_for_growth(keys, size_t(rows) * key_bytes());
    reserve_for_growth(values, size_t(rows) * value_bytes());
}

void KVStorage::assign(idx_t i0, idx_t n, const float* k, const float* v) {
    check_range(i0, n, "assign");
    // both checked before either is written: a refused value changes nothing
    check_kv_type_fits(type, k, n * d, d, "add_kv: keys");
    check_kv_type_fits(type, v, n * d_value, d_value, "add_kv: values");
    convert_from_float(type, k, n * d, d, keys.data() + i0 * key_bytes(), "add_kv: keys");
    convert_from_float(type, v, n * d_value, d_value, values.data() + i0 * value_bytes(), "add_kv: values");
}

void KVStorage::append_from(const KVStorage& other, idx_t i0, idx_t n) {
    FAISS_THROW_IF_NOT_MSG(
            other.d == d && other.d_value == d_value && other.type == type,
            "KVStorage::append_from: storages differ in dimensions or type");
    other.check_range(i0, n, "append_from");
    reserve_for_growth(keys, keys.size() + n * key_bytes());
    reserve_for_growth(values, values.size() + n * value_bytes());
    keys.insert(keys.end(), other.keys.begin() + i0 * key_bytes(),
                other.keys.begin() + (i0 + n) * key_bytes());
    values.insert(values.end(), other.values.begin() + i0 * value_bytes(),
                  other.values.begin() + (i0 + n) * value_bytes());
}

void KVStorage::to_float(idx_t i0, idx_t n, std::vector<float>* k, std::vector<float>* v) const {
    check_range(i0, n, "to_float");
    if (k) {
        k->resize(n * d);
        convert_to_float(type, keys.data() + i0 * key_bytes(), n * d, k->data());
    }
    if (v) {
        v->resize(n * d_value);
        convert_to_float(type, values.data() + i0 * value_bytes(), n * d_value, v->data());
    }
}

void KVStorage::erase_front(idx_t n) {
    check_range(0, n, "erase_front");
    keys.erase(keys.begin(), keys.begin() + n * key_bytes());
    values.erase(values.begin(), values.begin() + n * value_bytes());
}

void KVStorage::truncate(idx_t n) {
    FAISS_THROW_IF_NOT_FMT(n >= 0, "KVStorage::truncate: n=%zd must be >= 0", ssize_t(n));
    // n above size() keeps everything; capped first, n * bytes could wrap
    n = std::min(n, size());
    keys.resize(size_t(n) * key_bytes());
    values.resize(size_t(n) * value_bytes());
}

void KVStorage::clear() {
    keys.clear();
    values.clear();
}

size_t KVStorage::memory_bytes() const {
    return keys.capacity() + values.capacity();
}

void KVStorage::write(BufferWriter& w) const {
    size_t es = kv_type_size(type);
    w.value<uint64_t>(keys.size() / es);
    w.bytes(keys.data(), keys.size());
    w.value<uint64_t>(values.size() / es);
    w.bytes(values.data(), values.size());
}

void KVStorage::read(BufferReader& r, const char* what) {
    FAISS_THROW_IF_NOT_FMT(d > 0 && d_value > 0, "read_index: %s: dimensions not set", what);
    FAISS_THROW_IF_NOT_FMT(
            unsigned(type) < unsigned(kNumKVTypes), // type is read as a byte: any value
            "read_index: %s: invalid storage type %d",
            what,
            int(type));
    size_t es = kv_type_size(type);
    for (RowBytes* v : {&keys, &values}) {
        uint64_t n = r.value<uint64_t>(what);
        FAISS_THROW_IF_NOT_FMT(
                n <= r.remaining() / es,
                "read_index: %s claims %zd elements, only %zd bytes left",
                what,
                size_t(n),
                r.remaining());
        v->resize(n * es);
        r.bytes(v->data(), n * es, what);
    }
    size_t n_keys = keys.size() / es, n_values = values.size() / es;
    FAISS_THROW_IF_NOT_FMT(
            n_keys % d == 0 && n_values == n_keys / d * d_value,
            "read_index: %s: %zd key elements and %zd value elements do not make "
            "whole tokens of d=%zd, d_value=%zd",
            what,
            n_keys,
            n_values,
            d,
            d_value);
    // refuse what add_kv would refuse
    check_stored_input(type, keys, d, "read_index: keys");
    check_stored_input(type, values, d_value, "read_index: values");
}

void drop_for_shared(KVStorage& own, const KVStorage& shared, idx_t ntotal, const char* who) {
    FAISS_THROW_IF_NOT_FMT(
            shared.d == own.d && shared.d_value == own.d_value && shared.type == own.type &&
                    shared.size() == ntotal,
            "%s: the tokens lent (%zd of d=%zd, d_value=%zd, %s) are not its %zd tokens of "
            "d=%zd, d_value=%zd, %s",
            who,
            ssize_t(shared.size()),
            shared.d,
            shared.d_value,
            kv_type_name(shared.type),
            ssize_t(ntotal),
            own.d,
            own.d_value,
            kv_type_name(own.type));
    // a read index holds its own copy until then: the two must agree
    FAISS_THROW_IF_NOT_FMT(
            own.size() == 0 || (own.keys == shared.keys && own.values == shared.values),
            "%s: the tokens lent differ from its own",
            who);
    own = KVStorage(own.d, own.d_value, own.type);
}

void append_or_check_shared(
        KVStorage& own,
        const KVStorage* shared,
        idx_t ntotal,
        idx_t n,
        const float* keys,
        const float* values,
        const char* who) {
    if (!shared) {
        own.append(n, keys, values);
        return;
    }
    FAISS_THROW_IF_NOT_FMT(
            shared->size() == ntotal + n,
            "%s: its tokens are lent by the index that owns them, which holds %zd, not %zd: "
            "add tokens through the owner (the IndexHybrid)",
            who,
            ssize_t(shared->size()),
            ssize_t(ntotal + n));
}

} // namespace kvindex
