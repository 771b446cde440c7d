// Validation of a serialized Faiss retriever before faiss::read_index sees it.
//
// Why: Faiss 1.7.3's reader allocates each index with a raw `new` and throws
// from the middle of filling it, so any malformed blob leaks (and some, like
// a PQ with M = 0, divide by zero before throwing). The walk below mirrors
// faiss/impl/index_read.cpp of v1.7.3 field by field for the families kvindex
// accepts, and checks everything that reader would otherwise throw on or
// trust blindly: each size against the bytes left, each code size against the
// one Faiss derives, every nested index. A blob it accepts reads without an
// exception; check_faiss_retriever then checks what the object means.

#include "faiss_checks.h"

#include <string>
#include <vector>

#include <faiss/impl/FaissAssert.h>

#include <kvindex/impl/io.h>

namespace kvindex {

namespace {

constexpr uint32_t fourcc(const char (&s)[5]) {
    return uint32_t(uint8_t(s[0])) | uint32_t(uint8_t(s[1])) << 8 |
            uint32_t(uint8_t(s[2])) << 16 | uint32_t(uint8_t(s[3])) << 24;
}

std::string printable(uint32_t h) {
    std::string s;
    for (int i = 0; i < 4; i++) {
        char c = char((h >> (8 * i)) & 0xff);
        s += (c >= 32 && c < 127) ? c : '?';
    }
    return s;
}

/// The fields of faiss::Index that read_index_header fills.
struct Header {
    int32_t d = 0;
    int64_t ntotal = 0;
    bool is_trained = false;
};

/// What a nested reader tells its caller about the index it walked.
struct Walked {
    uint32_t fourcc = 0;
    Header header;
    size_t code_size = 0; ///< bytes per vector of the codes it stores
};

enum class Role { top, quantizer, hnsw_storage };

class BlobWalker {
   public:
    BlobWalker(const uint8_t* data, size_t size, int d, std::vector<std::pair<size_t, size_t>>* arrays)
            : in_(data, size), d_(d), arrays_(arrays) {}

    void walk_all() {
        walk_index(Role::top, 0);
        if (in_.remaining() != 0) {
            fail(std::to_string(in_.remaining()) + " trailing bytes");
        }
    }

   private:
    BufferReader in_; ///< every read checked against the bytes left
    const int d_;
    /// where the arrays of 64 bytes or more are, when asked (nullptr)
    std::vector<std::pair<size_t, size_t>>* arrays_;

    [[noreturn]] void fail(const std::string& what) const {
        FAISS_THROW_MSG(what);
    }

    template <typename T>
    T value(const char* what) {
        return in_.value<T>(what);
    }

    bool boolean(const char* what) {
        uint8_t b = value<uint8_t>(what);
        if (b > 1) {
            fail(std::string(what) + " is not a boolean");
        }
        return b == 1;
    }

    /// READVECTOR: a size_t count, then count elements, skipped. Returns
    /// the count.
    size_t vector_skip(size_t elem_size, const char* what) {
        size_t count = value<uint64_t>(what);
        if (count >= (uint64_t(1) << 40) || count > in_.remaining() / elem_size) {
            fail(std::string(what) + " holds " + std::to_string(count) +
                 " elements, more than the bytes left");
        }
        if (arrays_ && count * elem_size >= BufferWriter::kArrayBytes) {
            arrays_->emplace_back(in_.pos, in_.pos + count * elem_size);
        }
        in_.skip(count * elem_size, what);
        return count;
    }

    Header header(const char* what) {
        Header h;
        h.d = value<int32_t>(what);
        h.ntotal = value<int64_t>(what);
        value<int64_t>(what); // two unused fields
        value<int64_t>(what);
        h.is_trained = boolean("is_trained");
        int32_t metric = value<int32_t>(what);
        // 0 = inner product, 1 = L2: the metrics without a metric_arg
        if (metric != 0 && metric != 1) {
            fail(std::string(what) + " has metric " + std::to_string(metric));
        }
        if (h.d != d_ || h.ntotal < 0) {
            fail(std::string(what) + " has d=" + std::to_string(h.d) + " and ntotal=" +
                 std::to_string(h.ntotal) + "; expected d=" + std::to_string(d_));
        }
        return h;
    }

    void expect_codes(const Header& h, size_t code_size, size_t n_bytes, const char* what) {
        if (n_bytes != size_t(h.ntotal) * code_size) {
            fail(std::string(what) + " holds " + std::to_string(n_bytes) + " code bytes for " +
                 std::to_string(h.ntotal) + " vectors of " + std::to_string(code_size));
        }
    }

    /// read_ProductQuantizer; returns its code size.
    size_t product_quantizer() {
        uint64_t d = value<uint64_t>("PQ d");
        uint64_t M = value<uint64_t>("PQ M");
        uint64_t nbits = value<uint64_t>("PQ nbits");
        // set_derived_values divides by M and shifts by nbits
        if (d != uint64_t(d_) || M < 1 || d % M != 0 || nbits < 1 || nbits > 16) {
            fail("PQ with d=" + std::to_string(d) + ", M=" + std::to_string(M) +
                 ", nbits=" + std::to_string(nbits));
        }
        size_t n = vector_skip(sizeof(float), "PQ centroids");
        if (n != d << nbits) {
            fail("PQ centroids hold " + std::to_string(n) + " floats");
        }
        return (nbits * M + 7) / 8;
    }

    /// read_ScalarQuantizer; returns its code size.
    size_t scalar_quantizer(bool trained) {
        int32_t qtype = value<int32_t>("SQ qtype");
        int32_t rangestat = value<int32_t>("SQ rangestat");
        value<float>("SQ rangestat_arg");
        uint64_t d = value<uint64_t>("SQ d");
        value<uint64_t>("SQ code_size"); // recomputed by set_derived_sizes
        size_t n_trained = vector_skip(sizeof(float), "SQ trained");
        // 1.7.3's types: 8bit, 4bit, 8bit_uniform, 4bit_uniform, fp16,
        // 8bit_direct, 6bit; set_derived_sizes leaves code_size stale on any other
        if (qtype < 0 || qtype > 6 || rangestat < 0 || rangestat > 3 || d != uint64_t(d_)) {
            fail("SQ with qtype=" + std::to_string(qtype) + ", d=" + std::to_string(d));
        }
        const size_t needs[] = {2 * d, 2 * d, 2, 2, 0, 0, 2 * d};
        if (trained && n_trained < needs[qtype]) {
            fail("SQ holds " + std::to_string(n_trained) + " trained values");
        }
        switch (qtype) {
            case 1:
            case 3:
                return (d + 1) / 2;
            case 4:
                return d * 2;
            case 6:
                return (d * 6 + 7) / 8;
            default:
                return d;
        }
    }

    /// read_InvertedLists, ArrayInvertedLists only.
    void array_inverted_lists(uint64_t nlist, size_t code_size) {
        uint32_t h = value<uint32_t>("inverted lists");
        if (h != fourcc("ilar")) {
            fail("inverted lists of type '" + printable(h) + "' (kvindex reads 'ilar')");
        }
        uint64_t n = value<uint64_t>("inverted lists nlist");
        uint64_t cs = value<uint64_t>("inverted lists code_size");
        if (n != nlist || cs != code_size) {
            fail("inverted lists with nlist=" + std::to_string(n) + ", code_size=" +
                 std::to_string(cs) + " in an IVF of " + std::to_string(nlist) + " lists of " +
                 std::to_string(code_size));
        }
        std::vector<uint64_t> sizes(nlist, 0);
        uint32_t list_type = value<uint32_t>("list sizes");
        if (list_type == fourcc("full")) {
            sizes = in_.vector<uint64_t>("list sizes");
            if (sizes.size() != nlist) {
                fail("list sizes for " + std::to_string(sizes.size()) + " lists");
            }
        } else if (list_type == fourcc("sprs")) {
            auto pairs = in_.vector<uint64_t>("sparse list sizes");
            if (pairs.size() % 2 != 0) {
                fail("sparse list sizes of odd length");
            }
            for (size_t j = 0; j < pairs.size(); j += 2) {
                if (pairs[j] >= nlist) {
                    fail("sparse list sizes name list " + std::to_string(pairs[j]));
                }
                sizes[pairs[j]] = pairs[j + 1];
            }
        } else {
            fail("list sizes of type '" + printable(list_type) + "'");
        }
        const size_t entry = code_size + sizeof(int64_t);
        for (uint64_t s : sizes) {
            if (s > in_.remaining() / entry) {
                fail("an inverted list of " + std::to_string(s) + " entries, more than the bytes left");
            }
            // the list's codes, then its ids (Faiss writes each whole)
            for (size_t bytes : {s * code_size, s * sizeof(int64_t)}) {
                if (arrays_ && bytes >= BufferWriter::kArrayBytes) {
                    arrays_->emplace_back(in_.pos, in_.pos + bytes);
                }
                in_.skip(bytes, "inverted list");
            }
        }
    }

    /// read_ivf_header, then the family's fields and lists.
    Walked ivf(uint32_t h) {
        Walked w{h, header("IVF header"), 0};
        uint64_t nlist = value<uint64_t>("IVF nlist");
        uint64_t nprobe = value<uint64_t>("IVF nprobe");
        if (nlist < 1 || nlist > uint64_t(kMaxRetrieverLists) || nprobe < 1 || nprobe > nlist) {
            fail("IVF with nlist=" + std::to_string(nlist) + ", nprobe=" + std::to_string(nprobe));
        }
        Walked q = walk_index(Role::quantizer, 0);
        // IVFPQ's reader builds its residual tables from nlist centroids
        if (w.header.is_trained && uint64_t(q.header.ntotal) != nlist) {
            fail("IVF quantizer holds " + std::to_string(q.header.ntotal) + " centroids for " +
                 std::to_string(nlist) + " lists");
        }
        int8_t direct_map = value<int8_t>("IVF direct map");
        size_t n_map = vector_skip(sizeof(int64_t), "IVF direct map");
        if (direct_map != 0 || n_map != 0) {
            fail("IVF with a direct map (kvindex never builds one)");
        }
        if (h == fourcc("IwFl")) {
            w.code_size = size_t(d_) * sizeof(float);
        } else if (h == fourcc("IwSQ") || h == fourcc("IwSq")) {
            w.code_size = scalar_quantizer(w.header.is_trained);
            uint64_t cs = value<uint64_t>("IVFSQ code_size");
            if (h == fourcc("IwSq")) {
                boolean("IVFSQ by_residual");
            }
            if (cs != w.code_size) {
                fail("IVFSQ code_size " + std::to_string(cs));
            }
        } else { // IwPQ
            boolean("IVFPQ by_residual");
            uint64_t cs = value<uint64_t>("IVFPQ code_size");
            w.code_size = product_quantizer();
            if (cs != w.code_size) {
                fail("IVFPQ code_size " + std::to_string(cs));
            }
        }
        array_inverted_lists(nlist, w.code_size);
        return w;
    }

    Walked hnsw(uint32_t h, int depth) {
        Walked w{h, header("HNSW header"), 0};
        vector_skip(sizeof(double), "HNSW assign_probas");
        vector_skip(sizeof(int32_t), "HNSW cum_nneighbor_per_level");
        vector_skip(sizeof(int32_t), "HNSW levels");
        vector_skip(sizeof(uint64_t), "HNSW offsets");
        vector_skip(sizeof(int32_t), "HNSW neighbors");
        for (int i = 0; i < 5; i++) { // entry point, max level, efConstruction, efSearch, upper beam
            value<int32_t>("HNSW fields");
        }
        Walked storage = walk_index(Role::hnsw_storage, depth + 1);
        const bool matches = (h == fourcc("IHNf") && storage.fourcc == fourcc("IxFI")) ||
                (h == fourcc("IHNf") && storage.fourcc == fourcc("IxF2")) ||
                (h == fourcc("IHNf") && storage.fourcc == fourcc("IxFl")) ||
                (h == fourcc("IHNs") && storage.fourcc == fourcc("IxSQ"));
        if (!matches) {
            fail("HNSW '" + printable(h) + "' over storage '" + printable(storage.fourcc) + "'");
        }
        return w;
    }

    Walked walk_index(Role role, int depth) {
        if (depth > 2) {
            fail("indexes nested too deep");
        }
        uint32_t h = value<uint32_t>("index type");
        const bool top = role == Role::top;
        if (h == fourcc("IxFI") || h == fourcc("IxF2") || h == fourcc("IxFl")) {
            Walked w{h, header("Flat header"), size_t(d_) * sizeof(float)};
            size_t n = vector_skip(4, "Flat codes"); // READXBVECTOR counts floats
            expect_codes(w.header, w.code_size, n * 4, "Flat");
            return w;
        }
        if (h == fourcc("IxSQ") && role != Role::quantizer) {
            Walked w{h, header("SQ header"), 0};
            w.code_size = scalar_quantizer(w.header.is_trained);
            size_t n = vector_skip(1, "SQ codes");
            expect_codes(w.header, w.code_size, n, "SQ");
            return w;
        }
        if (h == fourcc("IxPq") && role != Role::quantizer) {
            Walked w{h, header("PQ header"), 0};
            w.code_size = product_quantizer();
            size_t n = vector_skip(1, "PQ codes");
            expect_codes(w.header, w.code_size, n, "PQ");
            value<int32_t>("PQ search_type");
            boolean("PQ encode_signs");
            value<int32_t>("PQ polysemous_ht");
            return w;
        }
        if ((h == fourcc("IwFl") || h == fourcc("IwSQ") || h == fourcc("IwSq") ||
             h == fourcc("IwPQ")) &&
            top) {
            return ivf(h);
        }
        if ((h == fourcc("IHNf") || h == fourcc("IHNs")) &&
            role != Role::hnsw_storage) {
            return hnsw(h, depth);
        }
        fail("Faiss index type '" + printable(h) +
             "' is not one kvindex reads back (Flat, SQ, PQ, IVF with Flat, SQ or PQ lists over "
             "a Flat or HNSW quantizer, HNSW over Flat or SQ)");
    }
};

} // namespace

void check_faiss_blob(const uint8_t* data, size_t size, int d) {
    BlobWalker(data, size, d, nullptr).walk_all();
}

void check_faiss_blob(
        const uint8_t* data,
        size_t size,
        int d,
        std::vector<std::pair<size_t, size_t>>* arrays) {
    BlobWalker(data, size, d, arrays).walk_all();
}

} // namespace kvindex
