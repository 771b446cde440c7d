#pragma once

#include <memory>
#include <string>

#include <kvindex/KVIndex.h>
#include <kvindex/gpu/GpuIndexKV.h>
#include <kvindex/gpu/GpuResources.h>

/* Moving indexes between the CPU and the GPU (faiss/gpu's GpuCloner), and
 * the GPU side of the registry.
 *
 * Each GPU type names the CPU indexes it is the twin of (a GpuTwinInfo
 * row): index_cpu_to_gpu asks the rows in order and converts with the
 * first that accepts, so a new GPU type plugs in with one row
 * (register_gpu_twin), not a branch here. index_gpu_to_cpu is the GPU
 * index's own to_cpu.
 */

namespace kvindex {

/// One GPU type as the converters know it.
struct GpuTwinInfo {
    std::string name;                         ///< the GPU type's type_name()
    std::string cpu_chains;                   ///< the CPU chains it twins, for errors
    bool (*accepts)(const KVIndex& cpu) = nullptr;
    std::unique_ptr<GpuIndexKV> (*make)(
            const KVIndex& cpu, std::shared_ptr<GpuResources> resources) = nullptr;
};

/// Adds a GPU type's row (tried after the earlier ones); throws if its
/// name is taken or a field is missing.
void register_gpu_twin(const GpuTwinInfo& row);

/** Adds the GPU types to the index registry (registry.h), once per process
 * (later calls do nothing): rows GpuIndexKVFlat and GpuIndexTopK, so that
 * index_factory builds "GPU,<chain>" (the GPU twin of the chain, on device
 * 0's default resources) and the tools list them. GPU indexes write their
 * CPU twin's records, so read_index never makes one. Called by
 * index_cpu_to_gpu and GpuKVCache; call it before index_factory when
 * neither has run. */
void register_gpu_index_types();

/** The GPU twin of a CPU index, with its tokens, knobs and RoPE record.
 * Throws naming the type when it has no GPU twin (listing those that do),
 * and when no device exists.
 * @param resources  nullptr: default_gpu_resources(0)
 */
std::unique_ptr<GpuIndexKV> index_cpu_to_gpu(
        std::shared_ptr<GpuResources> resources, const KVIndex* index);

/// The same on device `device`'s default resources.
std::unique_ptr<GpuIndexKV> index_cpu_to_gpu(int device, const KVIndex* index);

/// The CPU twin of a GPU index (GpuIndexKV::to_cpu); throws for a CPU index.
std::unique_ptr<KVIndex> index_gpu_to_cpu(const KVIndex* index);

} // namespace kvindex
