#pragma once

// Checks that a call throws faiss::FaissException with a message naming the
// problem: the contract for bad input (DESIGN.md §5).

#include <exception>
#include <string>

#include <gtest/gtest.h>

#include <faiss/impl/FaissAssert.h>

namespace kvtest {

/// Runs f, which must throw a FaissException; returns its message.
template <class F>
std::string faiss_error(F&& f) {
    try {
        f();
    } catch (const faiss::FaissException& e) {
        return e.what();
    } catch (const std::exception& e) {
        ADD_FAILURE() << "expected faiss::FaissException, got std::exception: " << e.what();
        return "";
    }
    ADD_FAILURE() << "expected faiss::FaissException, nothing was thrown";
    return "";
}

} // namespace kvtest

#define EXPECT_THROW_MSG(stmt, part)                                              \
    do {                                                                          \
        std::string msg_ = kvtest::faiss_error([&]() { stmt; });                  \
        EXPECT_NE(msg_.find(part), std::string::npos)                             \
                << "message '" << msg_ << "' does not name '" << (part) << "'";   \
    } while (0)
