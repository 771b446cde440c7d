#include <kvindex/parameters.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>

#include <faiss/impl/FaissAssert.h>

#include <kvindex/errors.h>
#include <kvindex/index_factory.h>

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

/// Calls f(name, value text) for each "name=value" of a parameter string;
/// throws naming an item that is not of that shape.
template <class F>
void for_each_item(const std::string& description, F&& f) {
    for (const std::string& item : parameter_items(description)) {
        size_t eq = item.find('=');
        KVINDEX_CHECK_ARG(
                eq != std::string::npos && eq > 0 && eq + 1 < item.size(),
                "cannot parse parameter '%s' in '%s' (expected name=value)",
                item.c_str(),
                description.c_str());
        f(item.substr(0, eq), item.substr(eq + 1));
    }
}

/// Sets the parameter on this index and the ones it holds; returns whether
/// any of them has it.
bool set_in_chain(KVIndex* index, const std::string& name, double value) {
    WriteScope scope(*index, "set_index_parameter");
    // a prefill-time knob shapes what prefill builds: once the index holds
    // tokens it would be accepted without effect, so it is refused
    if (index->ntotal > 0) {
        for (const ParameterInfo& p : index->parameter_info()) {
            KVINDEX_CHECK_ARG(
                    p.name != name || !p.prefill_time,
                    "parameter '%s' is prefill-time: set it before prefill (%s "
                    "already holds %zd tokens)",
                    name.c_str(),
                    index->factory_string().c_str(),
                    size_t(index->ntotal));
        }
    }
    bool found = index->set_parameter(name, value);
    for (KVIndex* child : index->mutable_children()) {
        found = set_in_chain(child, name, value) || found;
    }
    return found;
}

bool get_in_chain(const KVIndex* index, const std::string& name, double* value) {
    if (index->get_parameter(name, value)) {
        return true;
    }
    for (const KVIndex* child : index->children()) {
        if (get_in_chain(child, name, value)) {
            return true;
        }
    }
    return false;
}

void collect_info(const KVIndex* index, std::vector<ParameterInfo>& out) {
    for (ParameterInfo& p : index->parameter_info()) {
        bool seen = std::any_of(out.begin(), out.end(), [&](const ParameterInfo& q) {
            return q.name == p.name;
        });
        if (!seen) {
            out.push_back(std::move(p));
        }
    }
    for (const KVIndex* child : index->children()) {
        collect_info(child, out);
    }
}

/// The values a parameter has on each index of a chain that has it, to be
/// set back when setting parameters fails part-way (a value one candidate
/// of a Choose accepts and the next refuses).
struct ParameterSnapshot {
    struct Entry {
        KVIndex* index;
        std::string name;
        double value;
    };
    std::vector<Entry> entries;

    /// Records, for each index of the chain, the value its part of the
    /// chain reports: a wrapper that mirrors a child's knob (Hybrid's k)
    /// gets its mirror back too. Dormant indexes are recorded as well
    /// (held_indexes): a Choose hands a knob to its unchosen candidates,
    /// and setting its own entry back gives them the chosen one's value.
    void take(KVIndex* index, const std::string& name) {
        double value;
        if (get_in_chain(index, name, &value)) {
            entries.push_back({index, name, value});
        }
        for (const KVIndex* held : std::as_const(*index).held_indexes()) {
            take(const_cast<KVIndex*>(held), name); // held by the mutable `index`
        }
    }

    /// Sets every recorded value back, outermost first, so that each index
    /// ends with its own; a value an index reports but does not take
    /// (read-only, or a child's) is skipped.
    void restore() noexcept {
        for (const Entry& e : entries) {
            try {
                e.index->set_parameter(e.name, e.value);
            } catch (...) {
            }
        }
    }
};

/// Sets each (name, value) in order, all or nothing.
void set_all(KVIndex* index, const std::vector<std::pair<std::string, double>>& items) {
    KVINDEX_CHECK_ARG(index, "%s", "set_index_parameter: index is nullptr");
    ParameterSnapshot before;
    for (const auto& item : items) {
        before.take(index, item.first);
    }
    try {
        for (const auto& item : items) {
            const std::string& name = item.first;
            // a type's set_parameter refuses a value with a plain Faiss
            // error: the value is the caller's
            bool found = classify_errors<InvalidArgument>([&] { return set_in_chain(index, name, item.second); });
            KVINDEX_CHECK_ARG(
                    found,
                    "unknown parameter '%s' for index %s",
                    name.c_str(),
                    index_factory_string(index).c_str());
        }
    } catch (...) {
        before.restore();
        throw;
    }
}

} // namespace

ParameterInfo ParameterInfo::integer(std::string name, double min_value, double max_value, std::string doc) {
    ParameterInfo p;
    p.name = std::move(name);
    p.doc = std::move(doc);
    p.kind = ParameterKind::integer;
    p.min_value = min_value;
    p.max_value = max_value;
    return p;
}

ParameterInfo ParameterInfo::real(std::string name, double min_value, double max_value, std::string doc) {
    ParameterInfo p = integer(std::move(name), min_value, max_value, std::move(doc));
    p.kind = ParameterKind::real;
    return p;
}

ParameterInfo ParameterInfo::flag(std::string name, std::string doc) {
    ParameterInfo p = integer(std::move(name), 0, 1, std::move(doc));
    p.kind = ParameterKind::flag;
    return p;
}

ParameterInfo ParameterInfo::reported(std::string name, std::string doc) {
    ParameterInfo p = integer(std::move(name), -HUGE_VAL, HUGE_VAL, std::move(doc));
    p.read_only = true;
    return p;
}

namespace {

/// A bound as the reference prints it: integers in full, 2^53 as such.
std::string number_text(double x) {
    if (x == ParameterInfo::kNoBound) {
        return "2^53";
    }
    if (x == ParameterInfo::kNoBound - 1) {
        return "2^53 - 1";
    }
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%.10g", x);
    return buf;
}

} // namespace

std::string ParameterInfo::range() const {
    if (read_only) {
        return "read-only";
    }
    if (kind == ParameterKind::flag) {
        return "0 or 1";
    }
    if (kind == ParameterKind::integer && min_value == max_value) {
        std::string r = number_text(min_value); // a set of values ("0 or 8")
        for (size_t i = 0; i < also_values.size(); i++) {
            r += (i + 1 == also_values.size() ? " or " : ", ") + number_text(also_values[i]);
        }
        return r;
    }
    std::string r;
    const bool no_max = std::isinf(max_value) || (kind == ParameterKind::integer && max_value == kNoBound);
    if (kind == ParameterKind::integer) {
        r = std::string(odd_only ? "odd " : "") +
                (no_max ? ">= " + number_text(min_value) : number_text(min_value) + ".." + number_text(max_value));
    } else if (no_max && !std::isinf(min_value)) {
        r = (min_open ? "> " : ">= ") + number_text(min_value);
    } else {
        r = std::string(min_open ? "(" : "[") + number_text(min_value) + ", " + number_text(max_value) +
                (max_open ? ")" : "]");
    }
    if (!also_values.empty()) {
        std::string also;
        for (double v : also_values) {
            also += number_text(v) + ", ";
        }
        r = also + "or " + r;
    }
    return r;
}

bool ParameterInfo::accepts(double value) const {
    if (read_only || !std::isfinite(value)) {
        return false;
    }
    if (std::find(also_values.begin(), also_values.end(), value) != also_values.end()) {
        return true;
    }
    if (kind != ParameterKind::real && value != std::floor(value)) {
        return false;
    }
    if (odd_only && std::fmod(value, 2) != 1) {
        return false;
    }
    const bool above_min = min_open ? value > min_value : value >= min_value;
    const bool below_max = max_open ? value < max_value : value <= max_value;
    return above_min && below_max;
}

std::vector<std::string> parameter_items(const std::string& description) {
    std::vector<std::string> items;
    if (description.empty()) {
        return items;
    }
    size_t pos = 0;
    while (true) {
        const size_t end = std::min(description.find(',', pos), description.size());
        items.push_back(description.substr(pos, end - pos));
        if (end == description.size()) {
            return items;
        }
        pos = end + 1;
    }
}

void set_index_parameter(KVIndex* index, const std::string& name, double value) {
    set_all(index, {{name, value}});
}

std::vector<std::pair<std::string, double>> parse_parameters(const std::string& description) {
    std::vector<std::pair<std::string, double>> items;
    if (description.empty()) {
        return items; // nothing to set, as faiss::ParameterSpace
    }
    for_each_item(description, [&](const std::string& name, const std::string& text) {
        double value;
        KVINDEX_CHECK_ARG(
                text.back() != '%',
                "parameter '%s': value '%s' is a percentage of the context "
                "length: resolve it first (resolve_percentages)",
                name.c_str(),
                text.c_str());
        KVINDEX_CHECK_ARG(
                parse_decimal(text, &value),
                "parameter '%s': value '%s' is not a decimal number",
                name.c_str(),
                text.c_str());
        // an integer a double cannot hold would be echoed as another one
        // (2^63 - 1 as ...808): refused here, by its own digits
        KVINDEX_CHECK_ARG(
                std::fabs(value) <= 9007199254740992.0 ||
                        text.find_first_not_of("+-0123456789") != std::string::npos,
                "parameter '%s': value '%s' is above 2^53 = 9007199254740992, the largest integer a "
                "parameter holds exactly",
                name.c_str(),
                text.c_str());
        for (const auto& item : items) {
            KVINDEX_CHECK_ARG(
                    item.first != name,
                    "parameter '%s' given twice in '%s'",
                    name.c_str(),
                    description.c_str());
        }
        items.emplace_back(name, value);
    });
    return items;
}

void set_index_parameters(KVIndex* index, const std::string& description) {
    // every item is parsed before any is set
    set_all(index, parse_parameters(description));
}

double get_index_parameter(const KVIndex* index, const std::string& name) {
    KVINDEX_CHECK_ARG(index, "%s", "get_index_parameter: index is nullptr");
    double value = 0;
    KVINDEX_CHECK_ARG(
            get_in_chain(index, name, &value),
            "unknown parameter '%s' for index %s",
            name.c_str(),
            index_factory_string(index).c_str());
    return value;
}

std::vector<ParameterInfo> index_parameter_info(const KVIndex* index) {
    KVINDEX_CHECK_ARG(index, "%s", "index_parameter_info: index is nullptr");
    std::vector<ParameterInfo> out;
    collect_info(index, out);
    return out;
}

IndexSpec parse_index_spec(const std::string& s) {
    IndexSpec spec;
    size_t bar = s.find('|');
    spec.factory = s.substr(0, bar);
    KVINDEX_CHECK_ARG(
            !spec.factory.empty() || bar == std::string::npos,
            "index spec '%s': empty factory string before '|'",
            s.c_str());
    // a '|' inside "Choose(TopK(Flat)|k=3;...)": the factory parser would
    // name the cut-off string's parentheses, not the '|'
    KVINDEX_CHECK_ARG(
            bar == std::string::npos ||
                    std::count(spec.factory.begin(), spec.factory.end(), '(') ==
                            std::count(spec.factory.begin(), spec.factory.end(), ')'),
            "index spec '%s': '|' inside parentheses: parameters follow the whole "
            "factory string (\"STRING|name=value,...\")",
            s.c_str());
    if (bar != std::string::npos) {
        spec.params = s.substr(bar + 1);
        KVINDEX_CHECK_ARG(
                !spec.params.empty(), "index spec '%s': no parameters after '|'", s.c_str());
    }
    return spec;
}

std::string resolve_percentages(const std::string& params, idx_t n_context, const KVIndex* index) {
    if (params.empty()) {
        return params;
    }
    std::vector<ParameterInfo> info;
    if (index) {
        info = index_parameter_info(index);
    }
    std::string out;
    for_each_item(params, [&](const std::string& name, const std::string& text) {
        std::string value = text;
        if (text.back() == '%') {
            // a name the chain lacks is named by set_index_parameters
            for (const ParameterInfo& p : info) {
                KVINDEX_CHECK_ARG(
                        p.name != name || p.in_tokens,
                        "parameter '%s=%s': %s of %s is not a count of tokens, so it "
                        "cannot be a share of the context (%s); give its value",
                        name.c_str(),
                        text.c_str(),
                        name.c_str(),
                        index_factory_string(index).c_str(),
                        p.doc.c_str());
            }
            double pct;
            KVINDEX_CHECK_ARG(
                    parse_decimal(text.substr(0, text.size() - 1), &pct) && pct > 0 &&
                            pct <= 100,
                    "parameter '%s=%s': a percentage must be in (0, 100]",
                    name.c_str(),
                    text.c_str());
            // above 2^53 the share would not convert back to an integer
            KVINDEX_CHECK_ARG(
                    n_context > 0 && n_context <= (idx_t(1) << 53),
                    "parameter '%s=%s': a percentage needs a context length in [1, 2^53], "
                    "got %zd",
                    name.c_str(),
                    text.c_str(),
                    size_t(n_context));
            idx_t v = std::max<idx_t>(1, idx_t(std::ceil(pct / 100.0 * double(n_context))));
            value = std::to_string(v);
        }
        out += (out.empty() ? "" : ",") + name + "=" + value;
    });
    return out;
}

} // namespace kvindex
