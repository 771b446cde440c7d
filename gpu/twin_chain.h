#pragma once

// What the GPU types share to recognise and copy their CPU twins: the
// chains "X" and "Sink<n>,Window<m>,X" of an inner CPU type X, and a copy
// of a CPU index through its record. Private to gpu/.

#include <cstdint>
#include <memory>
#include <vector>

#include <kvindex/IndexSinkWindow.h>
#include <kvindex/KVIndex.h>
#include <kvindex/index_io.h>

namespace kvindex {

/** The Inner of "X" or "Sink<n>,Window<m>,X" (X an Inner), or nullptr;
 * the wrapper's counts in n_sink / n_window (0 without one). */
template <class Inner>
const Inner* static_chain_inner(const KVIndex& cpu, idx_t* n_sink, idx_t* n_window) {
    const KVIndex* inner = &cpu;
    *n_sink = *n_window = 0;
    if (auto sw = dynamic_cast<const IndexSinkWindow*>(&cpu)) {
        *n_sink = sw->n_sink;
        *n_window = sw->n_window;
        inner = sw->inner.get();
    }
    return dynamic_cast<const Inner*>(inner);
}

/// A copy of a CPU index through its record: every field, bit for bit
/// (a GPU type keeps its CPU twin so, and gives it back so).
inline std::unique_ptr<KVIndex> clone_index(const KVIndex& index) {
    std::vector<uint8_t> buf;
    write_index(&index, &buf);
    return read_index(buf);
}

} // namespace kvindex
