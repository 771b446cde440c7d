#pragma once

#include <cstdio>
#include <exception>
#include <string>
#include <utility>

#include <faiss/impl/FaissException.h>

/* The errors kvindex throws, and what a user reads of them.
 *
 * Every error is a faiss::FaissException, whose what() Faiss formats as
 * "Error in <function> at <file>:<line>: <message>", so that code catching
 * Faiss's errors catches ours. The class says whose mistake it is; the
 * tools and the Python package print error_message(e), the message alone,
 * and map the class to an exception type:
 *
 *   class             meaning                                    Python
 *   InvalidArgument   the caller's arguments: a factory string,  ValueError
 *                     a knob, a shape, a value (NaN, Inf, out
 *                     of range), k, a position
 *   InvalidData       a file or buffer a reader refuses:         ValueError, naming
 *                     truncated, corrupt, another format, a      the file or buffer
 *                     newer version
 *   FileError         the system refused to open, read or        OSError (errno,
 *                     write a file                               filename)
 *   (any other)       a failure inside a computation, or a call  RuntimeError
 *                     refused by the thread-safety contract
 *                     (KVIndex.h), or an index left failed
 *
 * The source location stays available for debugging: error_location(e),
 * the Python exception's `kvindex_location` attribute, and
 * KVINDEX_ERROR_LOCATION=1 in the environment, which makes the tools and
 * the Python package print it after the message.
 */

namespace kvindex {

/// The caller's arguments are wrong (see above).
struct InvalidArgument : faiss::FaissException {
    using faiss::FaissException::FaissException;
};

/// A file or buffer that a reader refuses (see above).
struct InvalidData : faiss::FaissException {
    using faiss::FaissException::FaissException;
};

/** The system refused a file operation. The message is "<reason>" with
 * the path inserted where it reads best ("read_index: cannot open 'f':
 * No such file or directory"); Python's OSError prints the reason and the
 * path itself. */
struct FileError : faiss::FaissException {
    int errno_value = 0; ///< errno at the time (EINVAL for a file not regular)
    std::string path;    ///< the file
    std::string reason;  ///< the message without the path
    FileError(const std::string& msg,
              int errno_value,
              std::string path,
              std::string reason,
              const char* func,
              const char* file,
              int line)
            : faiss::FaissException(msg, func, file, line),
              errno_value(errno_value),
              path(std::move(path)),
              reason(std::move(reason)) {}
};

/** What a user reads of an exception: its message without the location
 * Faiss puts first ("Error in <function> at <file>:<line>: ") and without
 * the condition FAISS_THROW_IF_NOT_* adds ("Error: '<expression>'
 * failed: "), which are our code's, not the user's mistake. With
 * KVINDEX_ERROR_LOCATION=1 in the environment, the location follows the
 * message in brackets. */
std::string error_message(const std::exception& e);

/// The message alone (error_message without the environment switch).
std::string bare_error_message(const std::exception& e);

/// The same within a what() string, without allocating: a pointer into it.
const char* bare_error_text(const char* what) noexcept;

/// "<function> at <file>:<line>" where what() holds one, else "".
std::string error_location(const std::exception& e);

/** f(), with a faiss::FaissException of no kvindex class that it throws
 * turned into E (same message and location): for a boundary where every
 * such error is of one class, such as a factory string's parser (all
 * InvalidArgument) or a file's reader (InvalidData). Errors already of a
 * kvindex class, and the thread-safety refusals, pass unchanged. */
template <class E, class F>
decltype(auto) classify_errors(F&& f);

/** f(), a reader of a file or buffer: an error it throws, but for a
 * FileError, a CallRefused or one not from Faiss (bad_alloc), becomes
 * InvalidData saying "<reader>: <source>: <message>" (the message without
 * its own "<reader>: "), the location kept. source names what was read:
 * "'path'" or "buffer of N bytes". */
template <class F>
decltype(auto) read_data(const char* reader, const std::string& source, F&& f);

/// The thread-safety contract's refusal (KVIndex.h): a call overlapping a
/// write, or a write overlapping any call. Python: RuntimeError.
struct CallRefused : faiss::FaissException {
    using faiss::FaissException::FaissException;
};

template <class E, class F>
decltype(auto) classify_errors(F&& f) {
    try {
        return f();
    } catch (const InvalidArgument&) {
        throw;
    } catch (const InvalidData&) {
        throw;
    } catch (const FileError&) {
        throw;
    } catch (const CallRefused&) {
        throw;
    } catch (const faiss::FaissException& e) {
        E classified(e.msg);
        throw classified;
    }
}

namespace detail {
[[noreturn]] void throw_invalid_data(const faiss::FaissException& e, const char* reader, const std::string& source);
} // namespace detail

template <class F>
decltype(auto) read_data(const char* reader, const std::string& source, F&& f) {
    try {
        return f();
    } catch (const FileError&) {
        throw;
    } catch (const CallRefused&) {
        throw;
    } catch (const faiss::FaissException& e) {
        detail::throw_invalid_data(e, reader, source);
    }
}

} // namespace kvindex

/// Throws EXC (a kvindex error class) with a printf-style message and the
/// source location, as FAISS_THROW_FMT does for FaissException.
#define KVINDEX_THROW_FMT(EXC, FMT, ...)                                     \
    do {                                                                     \
        std::string __kv_s;                                                  \
        int __kv_n = std::snprintf(nullptr, 0, FMT, __VA_ARGS__);            \
        __kv_s.resize(size_t(__kv_n) + 1);                                   \
        std::snprintf(&__kv_s[0], __kv_s.size(), FMT, __VA_ARGS__);          \
        __kv_s.resize(size_t(__kv_n));                                       \
        throw EXC(__kv_s, __PRETTY_FUNCTION__, __FILE__, __LINE__);          \
    } while (false)

/// Throws kvindex::InvalidArgument unless X holds.
#define KVINDEX_CHECK_ARG(X, FMT, ...)                                         \
    do {                                                                       \
        if (!(X)) {                                                            \
            KVINDEX_THROW_FMT(::kvindex::InvalidArgument, FMT, __VA_ARGS__);   \
        }                                                                      \
    } while (false)
