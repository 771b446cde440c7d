// The C interface of the decode kernels (gpu/capi.cu), as
// benchmarks/gpu/bench_decode.py calls it through ctypes: its argument
// checks, which run before any device call, so these tests need no GPU.

#include <cstdint>
#include <string>

#include <gtest/gtest.h>

extern "C" {
const char* kvgpu_last_error();
int kvgpu_dense_attention(const void* keys, const void* values, int64_t head_stride,
                          int64_t n_tokens, int n_heads, int d, int type, const float* q,
                          int rows_per_head, float* out, float* lse, void* workspace,
                          int64_t workspace_bytes, void* stream);
int kvgpu_topk_attention(const void* keys, const void* values, int64_t head_stride,
                         int64_t n_tokens, int n_heads, int d, int type, const float* q,
                         int rows_per_head, int64_t n_sink, int64_t n_window, int64_t k,
                         float* out, float* lse, void* workspace, int64_t workspace_bytes,
                         void* stream);
}

namespace {

std::string last_error() {
    return kvgpu_last_error();
}

} // namespace

TEST(GpuCApi, ANullOrNegativeWorkspaceIsRefused) {
    // a NULL workspace put the kernels in sizing mode: nothing launched and
    // the call returned 0 with out untouched; a negative size wrapped to
    // 2^64 and turned the overflow check off
    char buffer[16];
    EXPECT_EQ(kvgpu_dense_attention(nullptr, nullptr, 1024, 1024, 2, 128, 0, nullptr, 1, nullptr,
                                    nullptr, nullptr, 1 << 20, nullptr),
              -1);
    EXPECT_NE(last_error().find("workspace is NULL"), std::string::npos) << last_error();
    EXPECT_EQ(kvgpu_dense_attention(nullptr, nullptr, 1024, 1024, 2, 128, 0, nullptr, 1, nullptr,
                                    nullptr, buffer, -5, nullptr),
              -1);
    EXPECT_NE(last_error().find("workspace_bytes=-5 is negative"), std::string::npos) << last_error();
    EXPECT_EQ(kvgpu_topk_attention(nullptr, nullptr, 1024, 1024, 2, 128, 0, nullptr, 1, 4, 64, 100,
                                   nullptr, nullptr, nullptr, 1 << 20, nullptr),
              -1);
    EXPECT_NE(last_error().find("workspace is NULL"), std::string::npos) << last_error();
}
