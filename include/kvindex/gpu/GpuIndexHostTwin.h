#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <kvindex/gpu/GpuIndexKV.h>

namespace kvindex {

/** The base of the GPU types that keep their CPU twin on the host as the
 * record of the index (GpuIndexIVFAsym, GpuIndexLSHSample): the twin
 * chain "X" or "Sink<n>,Window<m>,X" builds, by the CPU code, what runs
 * once per token or per prompt (training, assignment, hash tables), and
 * the type mirrors on the device what a decode step reads.
 *
 * What follows from the twin being the record, written once here: the
 * factory chain and io are the twin's (to_cpu copies it through its
 * record), the knobs are the twin's (get / set / list forward to its
 * chain, so set_index_parameter on the GPU index reaches it; a type
 * refuses the values its device path cannot run in check_device_knob),
 * set_stream seeds the twin. Per-head state: shares_layer_storage() is
 * false (GpuKVCache refuses these types; KVCache with the GPU string runs
 * one index per head).
 */
struct GpuIndexHostTwin : GpuIndexKV {
    idx_t n_sink = 0;   ///< first tokens attended exactly (the twin's wrapper)
    idx_t n_window = 0; ///< last tokens attended exactly
    /// the CPU twin: "X" or "Sink<n>,Window<m>,X"; nullptr only in an
    /// index made empty for the reader (which refuses GPU records)
    std::unique_ptr<KVIndex> host;

    using GpuIndexKV::GpuIndexKV;

    /// The twin's chain (without the storage prefix).
    std::string cpu_factory_string() const override;
    bool shares_layer_storage() const override {
        return false;
    }
    /// A copy of the twin, through its record.
    std::unique_ptr<KVIndex> to_cpu() const override;
    /// The twin's search-time knobs (the prefill-time ones shaped what it built).
    void copy_knobs_to(KVIndex* cpu) const override;
    idx_t top_k_budget() const override;

    /// The twin's per-call knobs (a type refuses the values its device
    /// path cannot run when it reads them).
    bool reads_search_knob(const std::string& name) const override;
    std::vector<ParameterInfo> parameter_info() const override;
    bool set_parameter(const std::string& name, double value) override;
    bool get_parameter(const std::string& name, double* value) const override;
    void set_stream(uint64_t stream) override;

   protected:
    /// Throws for a knob value the device path cannot run (set_parameter
    /// calls it before the twin changes); the default accepts all.
    virtual void check_device_knob(const std::string& name, double value) const;
    /// The twin, or an exception naming the type (an index made empty for
    /// the reader has none).
    const KVIndex& twin() const;
};

} // namespace kvindex
