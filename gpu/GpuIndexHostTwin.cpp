#include <kvindex/gpu/GpuIndexHostTwin.h>

#include <faiss/impl/FaissAssert.h>

#include <kvindex/parameters.h>

#include "twin_chain.h"

namespace kvindex {

const KVIndex& GpuIndexHostTwin::twin() const {
    FAISS_THROW_IF_NOT_FMT(
            host, "%s: no CPU twin (an index made empty for the reader)", type_name());
    return *host;
}

std::string GpuIndexHostTwin::cpu_factory_string() const {
    return twin().factory_string();
}

std::unique_ptr<KVIndex> GpuIndexHostTwin::to_cpu() const {
    return clone_index(twin());
}

void GpuIndexHostTwin::copy_knobs_to(KVIndex* cpu) const {
    for (const ParameterInfo& p : index_parameter_info(&twin())) {
        if (!p.prefill_time) {
            set_index_parameter(cpu, p.name, get_index_parameter(&twin(), p.name));
        }
    }
}

idx_t GpuIndexHostTwin::top_k_budget() const {
    return host ? host->top_k_budget() : 0;
}

bool GpuIndexHostTwin::reads_search_knob(const std::string& name) const {
    return host && host->reads_search_knob(name);
}

std::vector<ParameterInfo> GpuIndexHostTwin::parameter_info() const {
    return host ? index_parameter_info(host.get()) : KVIndex::parameter_info();
}

bool GpuIndexHostTwin::set_parameter(const std::string& name, double value) {
    if (!host) {
        return KVIndex::set_parameter(name, value);
    }
    for (const ParameterInfo& p : parameter_info()) {
        if (p.name == name) {
            check_device_knob(name, value);
            set_index_parameter(host.get(), name, value);
            if (name == "k") {
                k = idx_t(value);
            }
            return true;
        }
    }
    return false;
}

bool GpuIndexHostTwin::get_parameter(const std::string& name, double* value) const {
    if (!host) {
        return KVIndex::get_parameter(name, value);
    }
    for (const ParameterInfo& p : parameter_info()) {
        if (p.name == name) {
            *value = get_index_parameter(host.get(), name);
            return true;
        }
    }
    return false;
}

void GpuIndexHostTwin::set_stream(uint64_t s) {
    if (host) {
        host->set_stream(s);
    }
}

void GpuIndexHostTwin::check_device_knob(const std::string&, double) const {}

} // namespace kvindex
