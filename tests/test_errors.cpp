// What a user reads of an error (errors.h): the message without the C++
// location, and the class that says whose mistake it is.

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include <csignal>
#include <filesystem>

#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <faiss/impl/FaissAssert.h>

#include <kvindex/KVCache.h>
#include <kvindex/errors.h>
#include <kvindex/index_factory.h>
#include <kvindex/index_io.h>
#include <kvindex/parameters.h>
#include <kvindex/trace.h>

#include "expect_throw.h"

namespace test_errors {

using namespace kvindex;

namespace {

/// The exception f throws, which must be an E; its user message.
template <class E, class F>
std::string user_message(F&& f) {
    try {
        f();
    } catch (const E& e) {
        return error_message(e);
    } catch (const std::exception& e) {
        ADD_FAILURE() << "expected " << typeid(E).name() << ", got " << typeid(e).name() << ": " << e.what();
        return "";
    }
    ADD_FAILURE() << "expected " << typeid(E).name() << ", nothing was thrown";
    return "";
}

/// Whether s shows C++ internals: a source path, a signature, a condition.
bool shows_internals(const std::string& s) {
    return s.find(".cpp:") != std::string::npos || s.find(".h:") != std::string::npos ||
            s.find("Error in ") != std::string::npos || s.find("' failed") != std::string::npos ||
            s.find("kvindex::") != std::string::npos;
}

std::string temp_path(const char* name) {
    return ::testing::TempDir() + "kvindex_errors_" + std::to_string(::getpid()) + "_" + name;
}

} // namespace

TEST(Errors, MessageDropsLocationAndCondition) {
    int line = 0;
    try {
        line = __LINE__ + 1;
        FAISS_THROW_FMT("n_ctx=%d must be in [1, n_tokens=%d]", -5, 200);
    } catch (const std::exception& e) {
        ASSERT_NE(std::string(e.what()).find(":" + std::to_string(line) + ": "), std::string::npos) << e.what();
        EXPECT_EQ(bare_error_message(e), "n_ctx=-5 must be in [1, n_tokens=200]");
        EXPECT_NE(error_location(e).find("test_errors.cpp:" + std::to_string(line)), std::string::npos)
                << error_location(e);
    }
    try {
        const int n = -5;
        FAISS_THROW_IF_NOT_MSG(n > 0, "n must be > 0");
    } catch (const std::exception& e) {
        ASSERT_NE(std::string(e.what()).find("Error: 'n > 0' failed: "), std::string::npos) << e.what();
        EXPECT_EQ(bare_error_message(e), "n must be > 0");
    }
    // other errors, and messages that only look like the prefixes, stand as they are
    EXPECT_EQ(bare_error_message(std::invalid_argument("bad list element \"x\"")), "bad list element \"x\"");
    EXPECT_EQ(bare_error_message(std::runtime_error("Error in the prompt at token 7")),
              "Error in the prompt at token 7");
    EXPECT_EQ(error_location(std::runtime_error("Error in the prompt at token 7")), "");
    EXPECT_EQ(bare_error_message(std::runtime_error("Error in f at a.cpp:12: Error in g at b.cpp:3: inner")),
              "inner");
    EXPECT_EQ(bare_error_message(std::runtime_error("Error: 'x' was not found")), "Error: 'x' was not found");
}

TEST(Errors, LocationOnRequest) {
    InvalidArgument e("Error in void f() at src/x.cpp:12: k=0 must be > 0");
    ::unsetenv("KVINDEX_ERROR_LOCATION");
    EXPECT_EQ(error_message(e), "k=0 must be > 0");
    ::setenv("KVINDEX_ERROR_LOCATION", "1", 1);
    EXPECT_EQ(error_message(e), "k=0 must be > 0 [void f() at src/x.cpp:12]");
    ::unsetenv("KVINDEX_ERROR_LOCATION");
    EXPECT_EQ(error_location(e), "void f() at src/x.cpp:12");
}

TEST(Errors, BadArgumentsAreInvalidArgument) {
    // a factory string: the part that fails is named
    std::string m = user_message<InvalidArgument>([] { index_factory(64, "NoSuch"); });
    EXPECT_NE(m.find("cannot parse 'NoSuch'"), std::string::npos) << m;
    EXPECT_FALSE(shows_internals(m)) << m;
    // a Faiss string inside TopK: Faiss's own error, classed as the string's
    m = user_message<InvalidArgument>([] { index_factory(64, "TopK(IVFx,Flat)"); });
    EXPECT_FALSE(shows_internals(m)) << m;
    // a knob: unknown, out of range (the type's own check), not a number
    auto index = index_factory(64, "TopK(Flat)");
    m = user_message<InvalidArgument>([&] { set_index_parameters(index.get(), "nprobe=3"); });
    EXPECT_NE(m.find("unknown parameter 'nprobe'"), std::string::npos) << m;
    m = user_message<InvalidArgument>([&] { set_index_parameters(index.get(), "k=-2"); });
    EXPECT_NE(m.find("k"), std::string::npos) << m;
    EXPECT_FALSE(shows_internals(m)) << m;
    m = user_message<InvalidArgument>([&] { set_index_parameters(index.get(), "k=abc"); });
    EXPECT_EQ(m, "parameter 'k': value 'abc' is not a decimal number");
    m = user_message<InvalidArgument>([] { index_factory(64, "IVFAsym4|nprobe=9"); });
    EXPECT_NE(m.find("nprobe=9"), std::string::npos) << m;
    // values: NaN, and a count that is negative
    std::vector<float> kv(64, 1.0f);
    kv[3] = std::nanf("");
    m = user_message<InvalidArgument>([&] { index->add_kv(1, kv.data(), kv.data()); });
    EXPECT_EQ(m, "add_kv: keys: non-finite value nan at row 0, column 3");
    m = user_message<InvalidArgument>([&] { index->add_kv(-1, kv.data(), kv.data()); });
    EXPECT_EQ(m, "add_kv: n=-1 must be >= 0");
    // k in a search, shapes of a cache
    kv[3] = 0;
    index->add_kv(1, kv.data(), kv.data());
    std::vector<float> dist(1);
    std::vector<idx_t> ids(1);
    m = user_message<InvalidArgument>([&] { index->search(1, kv.data(), 0, dist.data(), ids.data()); });
    EXPECT_EQ(m, "search: k=0 must be > 0");
    m = user_message<InvalidArgument>([] { KVCache(2, 9, 2, 64, 64, "Flat"); });
    EXPECT_EQ(m, "KVCache: n_q_heads=9 is not a multiple of n_kv_heads=2 (GQA)");
}

TEST(Errors, RefusalsAndStateAreNotArgumentErrors) {
    // a write overlapping a call is refused (the thread-safety contract)
    auto index = index_factory(8, "Flat");
    {
        ReadScope running(*index, "attend");
        std::vector<float> kv(8, 1.0f);
        std::string m = user_message<CallRefused>([&] { index->add_kv(1, kv.data(), kv.data()); });
        EXPECT_NE(m.find("add_kv: refused"), std::string::npos) << m;
    }
    // attending an empty index is the state's problem: not InvalidArgument
    std::vector<float> q(8, 1.0f), out(8);
    try {
        index->attend(1, q.data(), out.data(), nullptr);
    } catch (const InvalidArgument& e) {
        ADD_FAILURE() << "an empty index is not an argument error: " << e.what();
    } catch (const faiss::FaissException& e) {
        EXPECT_NE(error_message(e).find("empty"), std::string::npos) << e.what();
    }
}

TEST(Errors, CorruptFilesAndBuffersAreInvalidDataNamingThem) {
    auto index = index_factory(8, "Flat");
    std::vector<float> kv(8 * 5, 0.5f);
    index->add_kv(5, kv.data(), kv.data());
    std::vector<uint8_t> buf;
    write_index(index.get(), &buf);

    std::vector<uint8_t> garbage(100, 7);
    std::string m = user_message<InvalidData>([&] { read_index(garbage); });
    EXPECT_EQ(m, "read_index: buffer of 100 bytes: not a kvindex file (bad magic)");

    std::vector<uint8_t> cut(buf.begin(), buf.end() - 3);
    m = user_message<InvalidData>([&] { read_index(cut); });
    EXPECT_NE(m.find("read_index: buffer of " + std::to_string(cut.size()) + " bytes: "), std::string::npos) << m;

    const std::string path = temp_path("flipped.kvix");
    buf[buf.size() - 2] ^= 0x55;
    {
        std::ofstream f(path, std::ios::binary);
        f.write(reinterpret_cast<const char*>(buf.data()), std::streamsize(buf.size()));
    }
    m = user_message<InvalidData>([&] { read_index(path); });
    EXPECT_EQ(m, "read_index: '" + path + "': checksum mismatch (corrupt file)");
    m = user_message<InvalidData>([&] { read_cache(path); });
    EXPECT_EQ(m, "read_cache: '" + path + "': this is a kvindex index file, not a cache (use read_index)");
    ::unlink(path.c_str());
}

TEST(Errors, FilesTheSystemRefusesAreFileErrors) {
    try {
        read_index(temp_path("missing.kvix"));
        ADD_FAILURE() << "a missing file was read";
    } catch (const FileError& e) {
        EXPECT_EQ(e.errno_value, ENOENT);
        EXPECT_EQ(e.path, temp_path("missing.kvix"));
        EXPECT_EQ(error_message(e),
                  "read_index: cannot open '" + temp_path("missing.kvix") + "': No such file or directory");
    }
    // a FIFO would block a reader for ever, /dev/zero never ends: both are
    // refused at once, before a byte is read
    const std::string fifo = temp_path("fifo");
    ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
    const auto t0 = std::chrono::steady_clock::now();
    for (const std::string& special : {fifo, std::string("/dev/zero")}) {
        std::string m = user_message<FileError>([&] { read_index(special); });
        EXPECT_EQ(m, "read_index: '" + special + "' is not a regular file (a FIFO, a device or a directory)");
        m = user_message<FileError>([&] { read_cache(special); });
        EXPECT_NE(m.find("is not a regular file"), std::string::npos) << m;
        m = user_message<FileError>([&] { read_npy(special); });
        EXPECT_NE(m.find("is not a regular file"), std::string::npos) << m;
    }
    // a trace whose meta.json is a FIFO
    const std::string trace_dir = temp_path("trace");
    ::mkdir(trace_dir.c_str(), 0700);
    ASSERT_EQ(::mkfifo((trace_dir + "/meta.json").c_str(), 0600), 0);
    std::string m = user_message<FileError>([&] { read_trace_meta(trace_dir); });
    EXPECT_NE(m.find("meta.json' is not a regular file"), std::string::npos) << m;
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 1.0);
    ::unlink((trace_dir + "/meta.json").c_str());
    ::rmdir(trace_dir.c_str());
    ::unlink(fifo.c_str());

    auto index = index_factory(8, "Flat");
    m = user_message<FileError>([&] { write_index(index.get(), "/nonexistent-dir/x.kvix"); });
    EXPECT_NE(m.find("write_index: cannot create a temporary file beside '/nonexistent-dir/x.kvix'"),
              std::string::npos)
            << m;
}

TEST(Errors, AFailedSaveLeavesTheFileAsItWas) {
    // the second save hits a size limit (a full disk fails the same way):
    // it throws, and the first file still reads, with no temporary left
    namespace fs = std::filesystem;
    const std::string dir = temp_path("saves");
    fs::create_directories(dir);
    auto small = index_factory(8, "Flat");
    auto big = index_factory(8, "Flat");
    std::vector<float> kv(8 * 4000, 0.25f);
    small->add_kv(3, kv.data(), kv.data());
    big->add_kv(4000, kv.data(), kv.data());
    KVCache small_cache(1, 2, 1, 8, 8, "Flat");
    KVCache big_cache(1, 2, 1, 8, 8, "Flat");
    big_cache.append(0, 4000, kv.data(), kv.data());
    const std::string index_path = dir + "/index.kvix", cache_path = dir + "/cache.kvc";
    write_index(small.get(), index_path);
    write_cache(small_cache, cache_path);

    struct rlimit old_limit;
    ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old_limit), 0);
    auto old_handler = std::signal(SIGXFSZ, SIG_IGN); // the write returns EFBIG instead
    struct rlimit limit = old_limit;
    limit.rlim_cur = 16384;
    ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &limit), 0);
    std::string m1 = user_message<FileError>([&] { write_index(big.get(), index_path); });
    std::string m2 = user_message<FileError>([&] { write_cache(big_cache, cache_path); });
    ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &old_limit), 0);
    std::signal(SIGXFSZ, old_handler);
    EXPECT_EQ(m1, "write_index: cannot write '" + index_path + "': File too large");
    EXPECT_EQ(m2, "write_cache: cannot write '" + cache_path + "': File too large");

    EXPECT_EQ(read_index(index_path)->ntotal, 3);
    EXPECT_EQ(read_cache(cache_path)->n_tokens(0), 0);
    size_t n_files = 0;
    for (const auto& entry : fs::directory_iterator(dir)) {
        (void)entry;
        n_files++;
    }
    EXPECT_EQ(n_files, 2u) << "a temporary file was left beside the targets";
    fs::remove_all(dir);
}

TEST(Errors, ASaveToAStreamWritesInPlaceAndNeverReplacesIt) {
    // /dev/null and /dev/full are not files to rename over (as root, a
    // temporary beside them would replace the device): written in place,
    // a failed write reported
    auto index = index_factory(8, "Flat");
    std::vector<float> kv(8 * 3, 0.25f);
    index->add_kv(3, kv.data(), kv.data());
    write_index(index.get(), "/dev/null");
    std::string m = user_message<FileError>([&] { write_index(index.get(), "/dev/full"); });
    EXPECT_EQ(m, "write_index: cannot write '/dev/full': No space left on device");
    struct stat st;
    for (const char* dev : {"/dev/null", "/dev/full"}) {
        ASSERT_EQ(::stat(dev, &st), 0);
        EXPECT_TRUE(S_ISCHR(st.st_mode)) << dev << " was replaced";
    }
}

}  // namespace test_errors
