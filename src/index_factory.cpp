#include <kvindex/index_factory.h>

#include <cctype>
#include <string>
#include <vector>

#include <faiss/impl/FaissAssert.h>

#include <kvindex/parameters.h>
#include <kvindex/registry.h>

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

/// "Sink<n>, Window<n>, Flat, ..." from the registry, for error messages.
std::string known_elements() {
    std::string s;
    for (const IndexTypeInfo& t : index_types()) {
        s += (s.empty() ? "" : ", ") + t.grammar;
    }
    return s;
}

/// Strips a leading "BF16," / "FP16," and returns the type it selects.
KVType take_kv_type_prefix(std::string& s) {
    for (KVType t : {KVType::bf16, KVType::f16}) {
        std::string p = kv_type_prefix(t);
        if (s.compare(0, p.size(), p) == 0) {
            s = s.substr(p.size());
            return t;
        }
    }
    return KVType::f32;
}

/// Every index of the tree stores `t`; names the first that does not.
void check_chain_type(const KVIndex* index, KVType t, const std::string& description) {
    FAISS_THROW_IF_NOT_FMT(
            index->kv_type == t,
            "index_factory: '%s': %s does not support %s storage",
            description.c_str(),
            index->type_name(),
            kv_type_name(t));
    for (const KVIndex* c : index->children()) {
        check_chain_type(c, t, description);
    }
}

} // namespace

bool parse_factory_count(const std::string& s, const char* prefix, idx_t* count) {
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

FactoryChain::FactoryChain(
        int d, int d_value, const std::string& description, KVType kv_type)
        : d(d),
          d_value(d_value),
          kv_type(kv_type),
          description_(description),
          elements_(split_chain(description)) {}

const std::string& FactoryChain::peek() const {
    FAISS_THROW_IF_NOT_FMT(
            !at_end(), "index_factory: '%s' ends too early", description_.c_str());
    return elements_[pos_];
}

std::string FactoryChain::take() {
    std::string e = peek();
    pos_++;
    return e;
}

std::unique_ptr<KVIndex> FactoryChain::build_rest(const std::string& owner) {
    FAISS_THROW_IF_NOT_FMT(
            !at_end(),
            "index_factory: '%s' needs an index after it in '%s'",
            owner.c_str(),
            description_.c_str());
    return parse_next();
}

std::unique_ptr<KVIndex> FactoryChain::parse_next() {
    const std::string element = peek();
    size_t start = pos_;
    for (const IndexTypeInfo& t : index_types()) {
        if (!t.parse) {
            continue;
        }
        if (std::unique_ptr<KVIndex> index = t.parse(*this)) {
            return index;
        }
        FAISS_THROW_IF_NOT_FMT(
                pos_ == start,
                "index_factory: the %s parser consumed '%s' and built nothing",
                t.name.c_str(),
                element.c_str());
    }
    FAISS_THROW_FMT(
            "index_factory: cannot parse '%s' in '%s' (expected one of: %s)",
            element.c_str(),
            description_.c_str(),
            known_elements().c_str());
}

std::unique_ptr<KVIndex> FactoryChain::parse_nested(const std::string& chain) const {
    FactoryChain sub(d, d_value, chain, kv_type);
    std::unique_ptr<KVIndex> index = sub.parse_next();
    FAISS_THROW_IF_NOT_FMT(
            sub.at_end(),
            "cannot parse '%s': nothing may follow %s",
            sub.peek().c_str(),
            index->factory_string().c_str());
    return index;
}

namespace {

/// index_factory's body.
std::unique_ptr<KVIndex> build_index(int d, const std::string& description, int d_value) {
    FAISS_THROW_IF_NOT_FMT(
            d > 0 && d <= kMaxDimension,
            "index_factory: key dimension d=%d must be in [1, %d]",
            d,
            kMaxDimension);
    FAISS_THROW_IF_NOT_FMT(
            d_value == -1 || (d_value > 0 && d_value <= kMaxDimension),
            "index_factory: value dimension d_value=%d must be in [1, %d] (or -1 for d)",
            d_value,
            kMaxDimension);
    IndexSpec spec = parse_index_spec(description);
    std::string body = spec.factory;
    KVType kv_type = take_kv_type_prefix(body);
    FactoryChain chain(d, d_value < 0 ? d : d_value, body, kv_type);
    std::unique_ptr<KVIndex> index = chain.parse_next();
    FAISS_THROW_IF_NOT_FMT(
            chain.at_end(),
            "index_factory: cannot parse '%s' in '%s': nothing may follow %s",
            chain.peek().c_str(),
            spec.factory.c_str(),
            index->factory_string().c_str());
    check_chain_type(index.get(), kv_type, spec.factory);
    if (!spec.params.empty()) {
        set_index_parameters(index.get(), spec.params);
    }
    return index;
}

} // namespace

std::unique_ptr<KVIndex> index_factory(int d, const std::string& description, int d_value) {
    // every error of a string's parse, or of its parameters, is the string's
    return classify_errors<InvalidArgument>([&] { return build_index(d, description, d_value); });
}

std::string index_factory_string(const KVIndex* index) {
    FAISS_THROW_IF_NOT_MSG(index, "index_factory_string: index is nullptr");
    return kv_type_prefix(index->kv_type) + index->factory_string();
}

} // namespace kvindex
