// index_cpu_to_gpu / index_gpu_to_cpu, the GPU registry rows, "GPU,"
// factory strings and io (a GPU index writes its CPU twin's record). The
// tests without KVINDEX_REQUIRE_GPU run on every machine: they check what
// must hold without a device (clear errors, the rows, forged records).

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <kvindex/IndexSinkWindow.h>
#include <kvindex/gpu/GpuCloner.h>
#include <kvindex/gpu/GpuIndexKVFlat.h>
#include <kvindex/gpu/GpuIndexTopK.h>
#include <kvindex/index_factory.h>
#include <kvindex/index_io.h>
#include <kvindex/parameters.h>
#include <kvindex/registry.h>

#include "expect_throw.h"
#include "forge.h"
#include "gpu_test.h"

using namespace kvindex;
using kvtest::gaussian;

TEST(GpuRegistry, RowsAreRegisteredOnce) {
    register_gpu_index_types();
    register_gpu_index_types(); // a second call adds nothing
    int found = 0;
    for (const IndexTypeInfo& t : index_types()) {
        found += t.name == "GpuIndexKVFlat" || t.name == "GpuIndexTopK";
    }
    EXPECT_EQ(found, 2);
    EXPECT_EQ(index_type("GpuIndexTopK").fourcc, fourcc("KGtk"));
}

TEST(GpuFactory, ChainsWithoutTwinAreRefusedByName) {
    register_gpu_index_types();
    EXPECT_THROW_MSG(index_factory(64, "GPU,RoarGraph16"), "IndexRoarGraph");
    EXPECT_THROW_MSG(index_factory(64, "GPU,TopK(HNSW32)"), "no GPU twin");
    EXPECT_THROW_MSG(index_factory(64, "GPU"), "GPU");
    auto cpu = index_factory(64, "Sink4,Window8,RoarGraph16");
    EXPECT_THROW_MSG(index_cpu_to_gpu(nullptr, cpu.get()), "TopK(Flat)");
    EXPECT_THROW_MSG(index_gpu_to_cpu(cpu.get()), "not a GPU index");
}

TEST(GpuFactory, WithoutDeviceTheErrorSaysSo) {
    if (gpu_device_count() > 0) {
        GTEST_SKIP() << "a CUDA device is present";
    }
    register_gpu_index_types();
    EXPECT_THROW_MSG(index_factory(64, "GPU,Flat"), "no CUDA device");
    EXPECT_THROW_MSG(GpuResources(0), "no CUDA device");
}

TEST(GpuIo, ForgedGpuRecordIsRefused) {
    // read_index never makes a GPU index: a record tagged with a GPU fourcc
    // is forged, and says so (no device needed to refuse it)
    register_gpu_index_types();
    auto cpu = index_factory(64, "Flat");
    auto x = gaussian(5, 64, 1);
    cpu->add_kv(5, x.data(), x.data());
    std::vector<uint8_t> buf;
    write_index(cpu.get(), &buf);
    uint32_t tag = fourcc("KGfl");
    std::memcpy(buf.data() + kvtest::kIndexHeaderSize, &tag, 4);
    kvtest::forge_header(buf);
    EXPECT_THROW_MSG(read_index(buf), "forged");
}

TEST(GpuFactory, StringsRoundTripAndKnobsApply) {
    KVINDEX_REQUIRE_GPU();
    register_gpu_index_types(); // index_factory alone does not link the GPU rows in
    for (const char* s : {"GPU,Flat", "BF16,GPU,Sink4,Window64,TopK(Flat)", "FP16,GPU,TopK(Flat)",
                          "GPU,Window16,TopK(Flat)"}) {
        auto index = index_factory(128, s);
        EXPECT_EQ(index_factory_string(index.get()), s);
    }
    auto t = index_factory(128, "GPU,Sink4,Window64,TopK(Flat)|k=20");
    EXPECT_STREQ(t->type_name(), "GpuIndexTopK");
    EXPECT_EQ(t->k, 20);
    EXPECT_EQ(get_index_parameter(t.get(), "k"), 20.0);
    EXPECT_THROW_MSG(index_factory(96, "GPU,Flat"), "d=96");
}

TEST(GpuCloner, RoundTripKeepsTokensKnobsAndFiles) {
    KVINDEX_REQUIRE_GPU();
    const int d = 64;
    const idx_t n = 1000;
    auto keys = gaussian(n, d, 1, 1.0f, 0.5f), values = gaussian(n, d, 2);
    for (const char* s : {"BF16,Sink4,Window64,TopK(Flat)", "Flat", "FP16,TopK(Flat)"}) {
        auto cpu = index_factory(d, s);
        const bool has_k = cpu->reads_search_knob("k"); // not Flat
        if (has_k) {
            set_index_parameter(cpu.get(), "k", 33);
        }
        PrefillInput in;
        in.n_tokens = n;
        in.keys = keys.data();
        in.values = values.data();
        in.rope.theta = 12345;
        cpu->prefill(in);

        auto gpu = index_cpu_to_gpu(nullptr, cpu.get());
        const std::string str = s;
        const std::string prefix = kv_type_prefix(cpu->kv_type);
        EXPECT_EQ(index_factory_string(gpu.get()), prefix + "GPU," + str.substr(prefix.size()));
        EXPECT_EQ(gpu->ntotal, n);
        EXPECT_EQ(gpu->top_k_budget() > 0 ? gpu->top_k_budget() : gpu->k, has_k ? 33 : 100);
        EXPECT_EQ(gpu->reads_search_knob("k"), has_k);
        EXPECT_TRUE(gpu->has_rope);
        EXPECT_EQ(gpu->rope.theta, 12345);

        auto back = index_gpu_to_cpu(gpu.get());
        EXPECT_EQ(index_factory_string(back.get()), index_factory_string(cpu.get()));
        std::vector<float> a(d), b(d);
        for (idx_t i = 0; i < n; i += 97) {
            cpu->reconstruct(i, a.data());
            back->reconstruct(i, b.data());
            ASSERT_EQ(a, b) << s << " token " << i;
            cpu->reconstruct_value(i, a.data());
            back->reconstruct_value(i, b.data());
            ASSERT_EQ(a, b) << s << " token " << i;
        }
        // io of the GPU index = io of its CPU twin, byte for byte
        std::vector<uint8_t> from_gpu, from_cpu;
        write_index(gpu.get(), &from_gpu);
        write_index(cpu.get(), &from_cpu);
        EXPECT_EQ(from_gpu, from_cpu) << s;
        auto read = read_index(from_gpu);
        EXPECT_STREQ(read->type_name(), cpu->type_name());
    }
}
