#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <kvindex/KVIndex.h>
#include <kvindex/rope.h>

/* Trace files: a language-neutral record of the attention
 * inputs of a model, so that kvbench can replay them against any index.
 *
 *   DIR/meta.json
 *   DIR/layer_<l>/keys.npy     [n_kv_heads, n_tokens, head_dim]
 *   DIR/layer_<l>/values.npy   [n_kv_heads, n_tokens, head_dim]
 *   DIR/layer_<l>/queries.npy  [n_q_heads,  n_tokens, head_dim]
 *
 * Arrays are little-endian, C order, float32 or float16, post-RoPE. The
 * index is built from tokens [0, n_ctx) with their queries as prefill
 * queries; every query at position p >= n_ctx is an evaluation query over
 * tokens [0, p], tokens n_ctx..p (its own key included) appended before it.
 * Every reader error names the file and the problem.
 */

namespace kvindex {

/// The contents of meta.json.
struct TraceMeta {
    std::string format = "kvindex-trace-v1"; ///< format tag, checked on read
    int n_layers = 0;
    int n_q_heads = 0;
    int n_kv_heads = 0;      ///< divides n_q_heads (GQA)
    int head_dim = 0;        ///< d of queries, keys and values
    idx_t n_tokens = 0;
    idx_t n_ctx = 0;         ///< 1 <= n_ctx <= n_tokens
    double rope_theta = 10000.0;
    RopeStyle rope_style = RopeStyle::half;
    std::string source;      ///< free text: generator preset or model name
    std::string dtype = "float32"; ///< "float32" or "float16": how arrays are stored
    /// set on read when meta.json has no dtype: each .npy then says its own
    /// (a declared dtype must match every array)
    bool dtype_from_arrays = false;

    /// Throws naming the first inconsistent field.
    void check() const;
};

/// One layer of a trace, converted to float32 in memory.
struct TraceLayer {
    std::vector<float> keys;    ///< size n_kv_heads * n_tokens * head_dim
    std::vector<float> values;  ///< size n_kv_heads * n_tokens * head_dim
    std::vector<float> queries; ///< size n_q_heads * n_tokens * head_dim
};

TraceMeta read_trace_meta(const std::string& dir);
void write_trace_meta(const std::string& dir, const TraceMeta& meta);

/// Reads layer `layer`, checking shapes against meta, dtype and finiteness.
TraceLayer read_trace_layer(const std::string& dir, const TraceMeta& meta, int layer);
/// Throws, naming the array (`what` + "['keys']", ...), unless
/// write_trace_layer would write `data` under meta: shapes, finite
/// values, float16 range. Writes nothing.
void check_trace_layer(const TraceMeta& meta, const TraceLayer& data, const std::string& what);
/// Writes layer `layer` in meta.dtype (creates DIR/layer_<l>).
void write_trace_layer(
        const std::string& dir, const TraceMeta& meta, int layer, const TraceLayer& data);

/// A .npy array as stored: dtype string ("<f4", "<f2", "<i8"), shape, raw bytes.
struct NpyArray {
    std::string dtype;
    std::vector<size_t> shape;
    std::vector<uint8_t> data; ///< C order, little-endian
};

/// Reads a .npy file (versions 1.0-3.0, C order, little-endian dtypes only).
NpyArray read_npy(const std::string& path);
/// Writes a .npy file, version 1.0.
void write_npy(
        const std::string& path,
        const std::string& dtype,
        const std::vector<size_t>& shape,
        const void* data);

/// IEEE half <-> float conversions used for float16 traces.
float half_to_float(uint16_t h);
uint16_t float_to_half(float f);

} // namespace kvindex
