#include <kvindex/parameters.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <string>

#include <faiss/impl/FaissAssert.h>

#include <kvindex/IndexLSHSample.h>
#include <kvindex/IndexProxyEvict.h>
#include <kvindex/IndexSinkWindow.h>
#include <kvindex/IndexTopK.h>
#include <kvindex/index_factory.h>

#include "checks.h"

namespace kvindex {

namespace {

/// Parses a decimal number, refusing what strtod would also take but a
/// parameter string should not (spaces, hex, inf, nan, trailing junk).
bool parse_decimal(const std::string& text, double* value) {
    if (text.empty()) {
        return false;
    }
    for (char c : text) {
        if (!std::isdigit(static_cast<unsigned char>(c)) && c != '.' && c != 'e' &&
            c != 'E' && c != '-' && c != '+') {
            return false;
        }
    }
    char* stop = nullptr;
    *value = std::strtod(text.c_str(), &stop);
    return stop && *stop == '\0' && std::isfinite(*value);
}

/// Prefill-time knobs of the eviction layer; false if `name` is not one.
bool set_evict_parameter(IndexProxyEvict* e, const std::string& name, double value) {
    if (name == "budget" || name == "n_sink" || name == "seed") {
        FAISS_THROW_IF_NOT_FMT(
                is_positive_integer(value) || (name != "budget" && value == 0),
                "parameter %s=%g must be a non-negative integer",
                name.c_str(),
                value);
        if (name == "budget") {
            e->budget_tokens = idx_t(value);
        } else if (name == "n_sink") {
            e->n_sink = idx_t(value);
        } else {
            e->seed = uint64_t(value);
        }
        return true;
    }
    double* pct = name == "protect"        ? &e->protect_percent
            : name == "proxy_keep"   ? &e->proxy_keep_percent
            : name == "proxy_window" ? &e->proxy_window_percent
                                     : nullptr;
    if (!pct) {
        return false;
    }
    FAISS_THROW_IF_NOT_FMT(
            value >= 0 && value <= 100, "parameter %s=%g must be a percent in [0, 100]",
            name.c_str(), value);
    *pct = value;
    return true;
}

/// Sets the parameter on this index and the ones it wraps; returns whether
/// any of them has it.
bool set_in_chain(KVIndex* index, const std::string& name, double value) {
    bool found = false;
    if (auto w = dynamic_cast<IndexSinkWindow*>(index)) {
        found = set_in_chain(w->inner.get(), name, value);
    }
    if (auto e = dynamic_cast<IndexProxyEvict*>(index)) {
        found = set_in_chain(e->inner.get(), name, value);
        if (set_evict_parameter(e, name, value)) {
            return true;
        }
    }
    if (name == "k") {
        FAISS_THROW_IF_NOT_FMT(
                is_positive_integer(value), "parameter k=%g must be a positive integer", value);
        index->k = idx_t(value);
        return true;
    }
    if (auto h = dynamic_cast<IndexLSHSample*>(index)) {
        if (name == "min_hits" || name == "max_sample") {
            FAISS_THROW_IF_NOT_FMT(
                    value == 0 || is_positive_integer(value),
                    "parameter %s=%g must be a non-negative integer", name.c_str(), value);
            FAISS_THROW_IF_NOT_FMT(
                    name != "min_hits" || value <= h->L,
                    "parameter min_hits=%g exceeds the %d tables", value, h->L);
            (name == "min_hits" ? void(h->min_hits = int(value)) : void(h->max_sample = idx_t(value)));
            return true;
        }
    }
    if (auto t = dynamic_cast<IndexTopK*>(index)) {
        if ((name == "nprobe" || name == "efSearch")) {
            t->set_retriever_parameter(name, value); // throws if not this retriever's
            return true;
        }
    }
    return found;
}

} // namespace

void set_index_parameter(KVIndex* index, const std::string& name, double value) {
    FAISS_THROW_IF_NOT_MSG(index, "set_index_parameter: index is nullptr");
    FAISS_THROW_IF_NOT_FMT(
            set_in_chain(index, name, value),
            "unknown parameter '%s' for index %s",
            name.c_str(),
            index_factory_string(index).c_str());
}

void set_index_parameters(KVIndex* index, const std::string& description) {
    size_t pos = 0;
    while (true) {
        size_t end = std::min(description.find(',', pos), description.size());
        std::string item = description.substr(pos, end - pos);
        size_t eq = item.find('=');
        FAISS_THROW_IF_NOT_FMT(
                eq != std::string::npos && eq > 0 && eq + 1 < item.size(),
                "cannot parse parameter '%s' in '%s' (expected name=value)",
                item.c_str(),
                description.c_str());
        std::string name = item.substr(0, eq), text = item.substr(eq + 1);
        double value;
        FAISS_THROW_IF_NOT_FMT(
                parse_decimal(text, &value),
                "parameter '%s': value '%s' is not a decimal number",
                name.c_str(),
                text.c_str());
        set_index_parameter(index, name, value);
        if (end == description.size()) {
            break;
        }
        pos = end + 1;
    }
}

} // namespace kvindex
