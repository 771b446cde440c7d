#include "tokenizer.h"

#include <algorithm>
#include <cstdio>
#include <functional>
#include <queue>
#include <stdexcept>

#include <unicode/uchar.h>

#include "gguf.h"

namespace kvllm {

namespace {

/// One code point of the input: its bytes [begin, begin + len) and class.
struct CodePoint {
    size_t begin;
    int len;
    char32_t cp; ///< U+FFFD for an invalid byte
    enum Class { letter, number, space, other } cls;
};

CodePoint::Class classify(char32_t c, bool valid) {
    if (!valid) {
        return CodePoint::other;
    }
    if (u_isUWhiteSpace(UChar32(c))) {
        return CodePoint::space;
    }
    switch (u_charType(UChar32(c))) {
        case U_UPPERCASE_LETTER:
        case U_LOWERCASE_LETTER:
        case U_TITLECASE_LETTER:
        case U_MODIFIER_LETTER:
        case U_OTHER_LETTER:
            return CodePoint::letter;
        case U_DECIMAL_DIGIT_NUMBER:
        case U_LETTER_NUMBER:
        case U_OTHER_NUMBER:
            return CodePoint::number;
        default:
            return CodePoint::other;
    }
}

/// Decodes UTF-8; each byte of an invalid or truncated sequence is one
/// code point of class other.
std::vector<CodePoint> decode_utf8(const std::string& s, size_t begin, size_t end) {
    std::vector<CodePoint> out;
    size_t i = begin;
    while (i < end) {
        unsigned char b = s[i];
        int len = b < 0x80 ? 1 : (b >> 5) == 0x6 ? 2 : (b >> 4) == 0xe ? 3 : (b >> 3) == 0x1e ? 4 : 0;
        char32_t cp = 0;
        bool valid = len > 0 && i + len <= end;
        if (valid) {
            cp = len == 1 ? b : len == 2 ? (b & 0x1f) : len == 3 ? (b & 0x0f) : (b & 0x07);
            for (int j = 1; j < len; j++) {
                unsigned char c = s[i + j];
                if ((c & 0xc0) != 0x80) {
                    valid = false;
                    break;
                }
                cp = (cp << 6) | (c & 0x3f);
            }
            // overlong forms and surrogates are invalid too
            static const char32_t min_cp[5] = {0, 0, 0x80, 0x800, 0x10000};
            if (valid && (cp < min_cp[len] || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff))) {
                valid = false;
            }
        }
        if (!valid) {
            len = 1;
            cp = 0xfffd;
        }
        out.push_back({i, len, cp, classify(cp, valid)});
        i += len;
    }
    return out;
}

bool is_contraction_at(const std::vector<CodePoint>& c, size_t i, size_t& end) {
    // 's 't 're 've 'm 'll 'd, lower case only, as in GPT-2's pattern
    static const char* suffixes[] = {"s", "t", "re", "ve", "m", "ll", "d"};
    if (c[i].cp != U'\'') {
        return false;
    }
    for (const char* suf : suffixes) {
        size_t j = i + 1;
        const char* p = suf;
        while (*p && j < c.size() && c[j].cp == char32_t(*p)) {
            p++;
            j++;
        }
        if (!*p) {
            end = j;
            return true;
        }
    }
    return false;
}

/// End of the GPT-2 pattern's match starting at code point i.
size_t gpt2_match_end(const std::vector<CodePoint>& c, size_t i) {
    size_t n = c.size();
    size_t end;
    if (is_contraction_at(c, i, end)) {
        return end;
    }
    // ' ?X+' for X = letters, numbers, others (not space, letter or number)
    size_t j = i;
    if (c[j].cp == U' ' && j + 1 < n && c[j + 1].cls != CodePoint::space) {
        j++;
    }
    if (c[j].cls != CodePoint::space) {
        auto cls = c[j].cls;
        while (j < n && c[j].cls == cls) {
            j++;
        }
        return j;
    }
    // \s+(?!\S): a whitespace run, less its last character when a
    // non-space follows and the run is longer than one; else \s+
    size_t e = i;
    while (e < n && c[e].cls == CodePoint::space) {
        e++;
    }
    if (e < n && e - i >= 2) {
        return e - 1;
    }
    return e;
}

void split_gpt2(const std::string& text, size_t begin, size_t end, std::vector<std::string>& out) {
    std::vector<CodePoint> c = decode_utf8(text, begin, end);
    size_t i = 0;
    while (i < c.size()) {
        size_t e = gpt2_match_end(c, i);
        size_t b0 = c[i].begin;
        size_t b1 = e < c.size() ? c[e].begin : end;
        out.push_back(text.substr(b0, b1 - b0));
        i = e;
    }
}

/// GPT-2's reversible byte -> code point map: printable Latin-1 bytes map
/// to themselves, the others to 256, 257, ... in byte order.
char32_t byte_code_point(int b) {
    auto printable = [](int x) { return (x >= 33 && x <= 126) || (x >= 161 && x <= 172) || (x >= 174 && x <= 255); };
    if (printable(b)) {
        return char32_t(b);
    }
    int k = 0;
    for (int x = 0; x < b; x++) {
        k += !printable(x);
    }
    return char32_t(256 + k);
}

std::string utf8_of(char32_t cp) {
    std::string s;
    if (cp < 0x80) {
        s += char(cp);
    } else if (cp < 0x800) {
        s += char(0xc0 | (cp >> 6));
        s += char(0x80 | (cp & 0x3f));
    } else {
        s += char(0xe0 | (cp >> 12));
        s += char(0x80 | ((cp >> 6) & 0x3f));
        s += char(0x80 | (cp & 0x3f));
    }
    return s;
}

constexpr int kControlToken = 3;

/// A symbol of a piece during BPE, indexed by its first byte: len bytes
/// (0 once merged into its left neighbour), the live symbols around it.
struct BpeSymbol {
    int len;
    int prev;
    int next;
};

/// A ranked pair of adjacent symbols as queued: the pair is still there
/// when both symbols have kept their lengths (a symbol only grows by
/// absorbing its right neighbour).
struct BpePair {
    int rank;
    int left;
    int left_len;
    int right_len;
    /// the queue's order: lowest rank first, then leftmost, the order in
    /// which a rescan of every pair would merge them
    bool operator>(const BpePair& o) const {
        return rank != o.rank ? rank > o.rank : left > o.left;
    }
};

} // namespace

std::string byte_symbol(uint8_t b) {
    return utf8_of(byte_code_point(b));
}

std::vector<std::string> pretokenize(const std::string& text, bool isolate_digits) {
    std::vector<std::string> out;
    if (!isolate_digits) {
        split_gpt2(text, 0, text.size(), out);
        return out;
    }
    std::vector<CodePoint> c = decode_utf8(text, 0, text.size());
    size_t seg = 0; // byte start of the current non-digit segment
    for (const CodePoint& p : c) {
        if (p.cls == CodePoint::number) {
            split_gpt2(text, seg, p.begin, out);
            out.push_back(text.substr(p.begin, p.len));
            seg = p.begin + p.len;
        }
    }
    split_gpt2(text, seg, text.size(), out);
    return out;
}

BpeTokenizer::BpeTokenizer(const GgufFile& f) {
    const std::string& model = f.get_string("tokenizer.ggml.model");
    if (model != "gpt2") {
        throw std::runtime_error(f.path + ": tokenizer.ggml.model is \"" + model +
                                 "\", only byte-level BPE (\"gpt2\") is supported");
    }
    std::string pre = f.has("tokenizer.ggml.pre") ? f.get_string("tokenizer.ggml.pre") : "default";
    if (pre == "smollm" || pre == "starcoder" || pre == "refact") {
        isolate_digits = true;
    } else if (pre == "gpt2" || pre == "default") {
        isolate_digits = false;
    } else {
        throw std::runtime_error(f.path + ": pre-tokenizer \"" + pre + "\" is not supported");
    }
    tokens = f.get_strings("tokenizer.ggml.tokens");
    const std::vector<int64_t>& types = f.get_ints("tokenizer.ggml.token_type");
    if (types.size() != tokens.size()) {
        throw std::runtime_error(f.path + ": token_type has " + std::to_string(types.size()) +
                                 " entries for " + std::to_string(tokens.size()) + " tokens");
    }
    token_types.assign(types.begin(), types.end());
    const int64_t last = int64_t(tokens.size()) - 1;
    bos_id = f.has("tokenizer.ggml.bos_token_id") ? int(f.get_int("tokenizer.ggml.bos_token_id", 0, last)) : -1;
    eos_id = f.has("tokenizer.ggml.eos_token_id") ? int(f.get_int("tokenizer.ggml.eos_token_id", 0, last)) : -1;
    for (size_t i = 0; i < tokens.size(); i++) {
        token_to_id_.emplace(tokens[i], int(i));
        if (token_types[i] == kControlToken && !tokens[i].empty()) {
            special_ids_.push_back(int(i));
        }
    }
    std::stable_sort(special_ids_.begin(), special_ids_.end(),
                     [&](int a, int b) { return tokens[a].size() > tokens[b].size(); });
    const std::vector<std::string>& merges = f.get_strings("tokenizer.ggml.merges");
    for (size_t r = 0; r < merges.size(); r++) {
        if (merges[r].find(' ') == std::string::npos) {
            throw std::runtime_error(f.path + ": merge " + std::to_string(r) + " has no space: \"" +
                                     merges[r] + "\"");
        }
        merge_rank_.emplace(merges[r], int(r));
    }
    for (int b = 0; b < 256; b++) {
        byte_to_symbol_[b] = byte_symbol(uint8_t(b));
        symbol_to_byte_[byte_to_symbol_[b]] = b;
    }
}

int BpeTokenizer::find(const std::string& token_text) const {
    auto it = token_to_id_.find(token_text);
    return it == token_to_id_.end() ? -1 : it->second;
}

void BpeTokenizer::encode_piece(const std::string& piece, size_t offset, std::vector<int>& out) const {
    // The piece's text in byte symbols; a symbol of the merge is the bytes
    // [i, i + len) of the piece, that is enc[at[i], at[i + len]).
    const int n = int(piece.size());
    std::string enc;
    std::vector<size_t> at(size_t(n) + 1);
    for (int i = 0; i < n; i++) {
        at[i] = enc.size();
        enc += byte_to_symbol_[uint8_t(piece[i])];
    }
    at[n] = enc.size();
    std::vector<BpeSymbol> sym(n);
    for (int i = 0; i < n; i++) {
        sym[i] = {1, i - 1, i + 1 < n ? i + 1 : -1};
    }
    auto text = [&](int i) { return enc.substr(at[i], at[i + sym[i].len] - at[i]); };
    // Merge the adjacent pair of lowest rank, leftmost on ties, until none
    // has a rank. A queue of the ranked pairs makes this O(n log n) where
    // rescanning every pair after each merge was quadratic (34 s for 20000
    // repeated letters); a merge leaves stale entries behind, skipped when
    // popped.
    std::priority_queue<BpePair, std::vector<BpePair>, std::greater<BpePair>> queue;
    auto push_pair = [&](int left) {
        const int right = left < 0 ? -1 : sym[left].next;
        if (right < 0) {
            return;
        }
        auto it = merge_rank_.find(text(left) + " " + text(right));
        if (it != merge_rank_.end()) {
            queue.push({it->second, left, sym[left].len, sym[right].len});
        }
    };
    for (int i = 0; i + 1 < n; i++) {
        push_pair(i);
    }
    while (!queue.empty()) {
        const BpePair p = queue.top();
        queue.pop();
        const int right = p.left + p.left_len;
        if (sym[p.left].len != p.left_len || sym[right].len != p.right_len) {
            continue; // a symbol of the pair has merged since it was queued
        }
        BpeSymbol& l = sym[p.left];
        l.len += sym[right].len;
        sym[right].len = 0;
        l.next = sym[right].next;
        if (l.next >= 0) {
            sym[l.next].prev = p.left;
        }
        push_pair(l.prev);
        push_pair(p.left);
    }
    for (int i = n > 0 ? 0 : -1; i >= 0; i = sym[i].next) {
        const std::string s = text(i);
        int id = find(s);
        if (id >= 0) {
            out.push_back(id);
            continue;
        }
        // a symbol missing from the vocabulary: fall back to its bytes
        for (int b = i; b < i + sym[i].len; b++) {
            const std::string& bs = byte_to_symbol_[uint8_t(piece[b])];
            int id_b = find(bs);
            if (id_b < 0) {
                char what[96];
                std::snprintf(what, sizeof(what), "byte 0x%02x at offset %zu of the text has no token",
                              unsigned(uint8_t(piece[b])), offset + size_t(b));
                throw std::runtime_error(std::string(what) + " (its symbol " + bs + " is not in the vocabulary)");
            }
            out.push_back(id_b);
        }
    }
}

std::vector<int> BpeTokenizer::encode(const std::string& text, bool parse_special) const {
    std::vector<int> out;
    auto encode_plain = [&](size_t b, size_t e) {
        for (const std::string& piece : pretokenize(text.substr(b, e - b), isolate_digits)) {
            encode_piece(piece, b, out);
            b += piece.size(); // the pieces partition the text
        }
    };
    size_t start = 0;
    if (parse_special) {
        for (size_t i = 0; i < text.size();) {
            int hit = -1;
            for (int id : special_ids_) {
                if (text.compare(i, tokens[id].size(), tokens[id]) == 0) {
                    hit = id;
                    break;
                }
            }
            if (hit < 0) {
                i++;
                continue;
            }
            encode_plain(start, i);
            out.push_back(hit);
            i += tokens[hit].size();
            start = i;
        }
    }
    encode_plain(start, text.size());
    return out;
}

std::string BpeTokenizer::token_bytes(int id) const {
    if (id < 0 || id >= n_vocab()) {
        throw std::out_of_range("token id " + std::to_string(id) + " outside [0, " +
                                std::to_string(n_vocab()) + ")");
    }
    const std::string& t = tokens[id];
    if (token_types[id] == kControlToken) {
        return t;
    }
    std::string out;
    std::vector<CodePoint> cps = decode_utf8(t, 0, t.size());
    for (const CodePoint& c : cps) {
        auto it = symbol_to_byte_.find(t.substr(c.begin, c.len));
        if (it == symbol_to_byte_.end()) { // not a byte symbol: keep its text
            out += t.substr(c.begin, c.len);
        } else {
            out += char(it->second);
        }
    }
    return out;
}

std::string BpeTokenizer::decode(const std::vector<int>& ids) const {
    std::string out;
    for (int id : ids) {
        out += token_bytes(id);
    }
    return out;
}

} // namespace kvllm
