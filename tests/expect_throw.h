#pragma once

// Checks that a call throws faiss::FaissException (the library) or another
// std::exception (the tools) with a message naming the problem: the
// contract for bad input (DESIGN.md §5).

#include <exception>
#include <string>
#include <typeinfo>

#include <gtest/gtest.h>

#include <faiss/impl/FaissAssert.h>

namespace kvtest {

/// Runs f, which must throw an E (or a type derived from it); returns its
/// message.
template <class E, class F>
std::string error_message(F&& f) {
    try {
        f();
    } catch (const std::exception& e) {
        if (dynamic_cast<const E*>(&e) != nullptr) {
            return e.what();
        }
        ADD_FAILURE() << "expected " << typeid(E).name() << ", got another std::exception: " << e.what();
        return "";
    }
    ADD_FAILURE() << "expected " << typeid(E).name() << ", nothing was thrown";
    return "";
}

/// Runs f, which must throw a FaissException; returns its message.
template <class F>
std::string faiss_error(F&& f) {
    return error_message<faiss::FaissException>(f);
}

} // namespace kvtest

/// stmt throws an E whose message contains part.
#define EXPECT_THROW_MSG_AS(E, stmt, part)                                        \
    do {                                                                          \
        std::string msg_ = kvtest::error_message<E>([&]() { stmt; });             \
        EXPECT_NE(msg_.find(part), std::string::npos)                             \
                << "message '" << msg_ << "' does not name '" << (part) << "'";   \
    } while (0)

/// stmt throws a faiss::FaissException (the library's errors) whose message
/// contains part.
#define EXPECT_THROW_MSG(stmt, part) EXPECT_THROW_MSG_AS(faiss::FaissException, stmt, part)
