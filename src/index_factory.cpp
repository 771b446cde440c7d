#include <kvindex/index_factory.h>

#include <cctype>
#include <cstdio>
#include <string>
#include <vector>

#include <faiss/impl/FaissAssert.h>

#include <kvindex/IndexKVFlat.h>
#include <kvindex/IndexLSHSample.h>
#include <kvindex/IndexProxyEvict.h>
#include <kvindex/IndexSinkWindow.h>
#include <kvindex/IndexTopK.h>

namespace kvindex {

namespace {

/// Splits "a,b(c,d),e" at the commas outside parentheses; throws on
/// unbalanced parentheses.
std::vector<std::string> split_chain(const std::string& s) {
    std::vector<std::string> parts;
    std::string cur;
    int depth = 0;
    for (char c : s) {
        if (c == '(') {
            depth++;
        } else if (c == ')') {
            FAISS_THROW_IF_NOT_FMT(
                    depth > 0, "index_factory: unbalanced ')' in '%s'", s.c_str());
            depth--;
        }
        if (c == ',' && depth == 0) {
            parts.push_back(cur);
            cur.clear();
        } else {
            cur += c;
        }
    }
    FAISS_THROW_IF_NOT_FMT(depth == 0, "index_factory: unbalanced '(' in '%s'", s.c_str());
    parts.push_back(cur);
    return parts;
}

/// If s is prefix followed by a decimal count, stores it and returns true.
bool parse_count(const std::string& s, const char* prefix, idx_t* count) {
    std::string p(prefix);
    if (s.size() <= p.size() || s.compare(0, p.size(), p) != 0 || s.size() - p.size() > 12) {
        return false;
    }
    for (size_t i = p.size(); i < s.size(); i++) {
        if (!std::isdigit(static_cast<unsigned char>(s[i]))) {
            return false;
        }
    }
    *count = std::stoll(s.substr(p.size()));
    return true;
}

// One parse_X per family: each returns nullptr when the part is not its own.

std::unique_ptr<KVIndex> parse_flat(const std::string& s, int d, int dv) {
    if (s != "Flat") {
        return nullptr;
    }
    return std::make_unique<IndexKVFlat>(d, dv);
}

std::unique_ptr<KVIndex> parse_topk(const std::string& s, int d, int dv) {
    const std::string head = "TopK(";
    if (s.size() <= head.size() + 1 || s.compare(0, head.size(), head) != 0 ||
        s.back() != ')') {
        return nullptr;
    }
    return std::make_unique<IndexTopK>(d, dv, s.substr(head.size(), s.size() - head.size() - 1));
}

std::unique_ptr<KVIndex> parse_lsh_sample(const std::string& s, int d, int dv) {
    const std::string head = "LSHSample";
    size_t x = s.find('x');
    if (s.compare(0, head.size(), head) != 0 || x == std::string::npos) {
        return nullptr;
    }
    std::string ks = s.substr(head.size(), x - head.size()), ls = s.substr(x + 1);
    auto digits = [](const std::string& t) {
        return !t.empty() && t.size() <= 6 && t.find_first_not_of("0123456789") == std::string::npos;
    };
    if (!digits(ks) || !digits(ls)) {
        return nullptr;
    }
    return std::make_unique<IndexLSHSample>(d, dv, std::stoi(ks), std::stoi(ls));
}

std::unique_ptr<KVIndex> parse_inner(const std::string& s, int d, int dv) {
    for (auto parse : {parse_flat, parse_topk, parse_lsh_sample}) {
        if (auto index = parse(s, d, dv)) {
            return index;
        }
    }
    return nullptr;
}

/// "ProxyEvict<P>[_Policy]": stores the policy and percent, returns true.
bool parse_proxy_evict(const std::string& s, EvictPolicy* policy, double* percent) {
    const std::string head = "ProxyEvict";
    if (s.compare(0, head.size(), head) != 0) {
        return false;
    }
    size_t us = s.find('_');
    std::string num = s.substr(head.size(), us == std::string::npos ? std::string::npos : us - head.size());
    if (num.empty() || num.size() > 8 || num.find_first_not_of("0123456789.") != std::string::npos) {
        return false;
    }
    *percent = std::stod(num);
    std::string name = us == std::string::npos ? "" : s.substr(us + 1);
    const std::pair<const char*, EvictPolicy> names[] = {
            {"", EvictPolicy::nacl},           {"H2O", EvictPolicy::h2o},
            {"TOVA", EvictPolicy::tova},       {"StreamingLLM", EvictPolicy::streaming},
            {"Random", EvictPolicy::random}};
    for (auto& [n, p] : names) {
        if (name == n) {
            *policy = p;
            return true;
        }
    }
    return false;
}

/// parts[i..] as one index: [Sink,][Window,] then an eviction layer over
/// the rest of the chain, or an inner index.
std::unique_ptr<KVIndex> parse_chain(
        const std::vector<std::string>& parts, size_t i, int d, int dv, const std::string& all) {
    idx_t n_sink = -1, n_window = -1;
    for (; i + 1 < parts.size(); i++) {
        idx_t c;
        if (n_sink < 0 && parse_count(parts[i], "Sink", &c)) {
            n_sink = c;
        } else if (n_window < 0 && parse_count(parts[i], "Window", &c)) {
            n_window = c;
        } else {
            break;
        }
    }
    std::unique_ptr<KVIndex> body;
    EvictPolicy policy;
    double percent;
    if (parse_proxy_evict(parts[i], &policy, &percent)) {
        auto kept = i + 1 < parts.size() ? parse_chain(parts, i + 1, d, dv, all)
                                         : std::make_unique<IndexKVFlat>(d, dv);
        body = std::make_unique<IndexProxyEvict>(policy, percent, std::move(kept));
    } else if (i + 1 == parts.size()) {
        body = parse_inner(parts[i], d, dv);
    }
    FAISS_THROW_IF_NOT_FMT(
            body,
            "index_factory: cannot parse '%s' in '%s' (expected [Sink<n>,][Window<n>,] "
            "then Flat, TopK(<faiss string>), LSHSample<K>x<L> or ProxyEvict<P>[_Policy][,<index>])",
            parts[i].c_str(),
            all.c_str());
    if (n_sink < 0 && n_window < 0) {
        return body;
    }
    return std::make_unique<IndexSinkWindow>(
            std::max<idx_t>(n_sink, 0), std::max<idx_t>(n_window, 0), std::move(body));
}

} // namespace

std::unique_ptr<KVIndex> index_factory(int d, const std::string& description, int d_value) {
    FAISS_THROW_IF_NOT_FMT(d > 0, "index_factory: key dimension d=%d must be > 0", d);
    FAISS_THROW_IF_NOT_FMT(
            d_value == -1 || d_value > 0,
            "index_factory: value dimension d_value=%d must be > 0 (or -1 for d)",
            d_value);
    int dv = d_value < 0 ? d : d_value;
    return parse_chain(split_chain(description), 0, d, dv, description);
}

std::string index_factory_string(const KVIndex* index) {
    FAISS_THROW_IF_NOT_MSG(index, "index_factory_string: index is nullptr");
    if (dynamic_cast<const IndexKVFlat*>(index)) {
        return "Flat";
    }
    if (auto t = dynamic_cast<const IndexTopK*>(index)) {
        return "TopK(" + t->retriever_string + ")";
    }
    if (auto h = dynamic_cast<const IndexLSHSample*>(index)) {
        return "LSHSample" + std::to_string(h->K) + "x" + std::to_string(h->L);
    }
    if (auto e = dynamic_cast<const IndexProxyEvict*>(index)) {
        char pct[32];
        std::snprintf(pct, sizeof(pct), "%g", e->keep_percent);
        std::string s = std::string("ProxyEvict") + pct;
        if (e->policy != EvictPolicy::nacl) {
            s += std::string("_") + evict_policy_name(e->policy);
        }
        if (!dynamic_cast<const IndexKVFlat*>(e->inner.get())) {
            s += "," + index_factory_string(e->inner.get());
        }
        return s;
    }
    if (auto w = dynamic_cast<const IndexSinkWindow*>(index)) {
        std::string s;
        if (w->n_sink > 0) {
            s += "Sink" + std::to_string(w->n_sink) + ",";
        }
        if (w->n_window > 0) {
            s += "Window" + std::to_string(w->n_window) + ",";
        }
        if (s.empty()) {
            s = "Sink0,"; // keep the wrapper visible in the round trip
        }
        return s + index_factory_string(w->inner.get());
    }
    FAISS_THROW_MSG("index_factory_string: index type has no factory string");
}

} // namespace kvindex
