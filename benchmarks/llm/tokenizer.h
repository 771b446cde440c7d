#pragma once

// Byte-level BPE (GPT-2 family) from a GGUF file's own vocabulary and
// merges: tokenizer.ggml.model "gpt2". Pre-tokenization follows the file's
// tokenizer.ggml.pre; "smollm" (also StarCoder's) isolates every digit, then
// applies the GPT-2 split
//   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

namespace kvllm {

struct GgufFile;

/** Splits UTF-8 text into pre-tokens (byte strings whose concatenation is
 * the text). Invalid UTF-8 bytes count as one symbol each of the class
 * "other", so any byte string round-trips.
 * @param isolate_digits  whether every \p{N} code point is its own piece
 */
std::vector<std::string> pretokenize(const std::string& text, bool isolate_digits);

/// GPT-2's symbol of a byte in the vocabulary (UTF-8 of its code point in
/// the reversible byte map: printable Latin-1 bytes stand for themselves).
std::string byte_symbol(uint8_t b);

struct BpeTokenizer {
    std::vector<std::string> tokens; ///< size n_vocab, byte-level encoded text of each token
    std::vector<int> token_types;    ///< size n_vocab, GGUF token types (1 normal, 3 control, ...)
    int bos_id = -1;
    int eos_id = -1;
    bool isolate_digits = true;

    explicit BpeTokenizer(const GgufFile& file);

    int n_vocab() const {
        return int(tokens.size());
    }
    /** Token ids of UTF-8 text (no BOS added).
     * @param parse_special  control tokens written in the text (e.g.
     *        "<|im_start|>") become their ids; otherwise they are plain text */
    std::vector<int> encode(const std::string& text, bool parse_special) const;
    /// Text of token ids; control tokens render as their text. Throws on an
    /// id outside [0, n_vocab).
    std::string decode(const std::vector<int>& ids) const;
    /// Raw bytes of one token.
    std::string token_bytes(int id) const;
    /// Id of a token by its (encoded) text, or -1.
    int find(const std::string& token_text) const;

   private:
    std::unordered_map<std::string, int> token_to_id_;
    std::unordered_map<std::string, int> merge_rank_; ///< "left right" -> rank
    std::vector<int> special_ids_;                     ///< control tokens, longest first
    std::string byte_to_symbol_[256];                  ///< GPT-2 byte -> UTF-8 of its code point
    std::unordered_map<std::string, int> symbol_to_byte_;

    /// `offset`: the piece's byte offset in the text, for messages
    void encode_piece(const std::string& piece, size_t offset, std::vector<int>& out) const;
};

} // namespace kvllm
