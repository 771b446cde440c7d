// kvindex_gpu's errors are the library's: faiss::FaissException (gpu_error.h).

#include "gpu_error.h"

#include <faiss/impl/FaissAssert.h>

namespace kvindex {
namespace gpu {

void throw_gpu_error(const std::string& msg) {
    FAISS_THROW_MSG(msg);
}

} // namespace gpu
} // namespace kvindex
