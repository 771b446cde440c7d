#include <kvindex/errors.h>

#include <cctype>
#include <cstdlib>
#include <cstring>

namespace kvindex {

namespace {

/** Length of the "Error in <function> at <file>:<line>: " head at m's
 * start (the path holds no ':'), 0 when there is none; at and line_end
 * (when given) receive the positions of " at " and of the line's end.
 * No allocation: mark_failed runs it after an allocation failed. */
size_t location_head(const char* m, size_t* at_pos = nullptr, size_t* line_end = nullptr) noexcept {
    static const char head[] = "Error in ";
    if (std::strncmp(m, head, sizeof(head) - 1) != 0) {
        return 0;
    }
    for (const char* at = std::strstr(m, " at "); at; at = std::strstr(at + 4, " at ")) {
        const char* colon = std::strchr(at + 4, ':');
        if (!colon) {
            return 0;
        }
        const char* end = colon + 1;
        while (std::isdigit(static_cast<unsigned char>(*end))) {
            end++;
        }
        if (end > colon + 1 && end[0] == ':' && end[1] == ' ') {
            if (at_pos) {
                *at_pos = size_t(at - m);
            }
            if (line_end) {
                *line_end = size_t(end - m);
            }
            return size_t(end - m) + 2;
        }
    }
    return 0;
}

} // namespace

const char* bare_error_text(const char* what) noexcept {
    // a message re-thrown through another Faiss call may carry two heads
    for (size_t n; (n = location_head(what)) > 0;) {
        what += n;
    }
    // FAISS_THROW_IF_NOT_* put the condition first: "Error: 'x' failed: "
    static const char cond[] = "Error: '";
    static const char failed[] = "' failed: ";
    if (std::strncmp(what, cond, sizeof(cond) - 1) == 0) {
        const char* end = std::strstr(what + sizeof(cond) - 1, failed);
        if (end) {
            what = end + sizeof(failed) - 1;
        }
    }
    return what;
}

std::string bare_error_message(const std::exception& e) {
    return bare_error_text(e.what());
}

std::string error_location(const std::exception& e) {
    const std::string m = e.what();
    size_t at = 0, line_end = 0;
    if (location_head(m.c_str(), &at, &line_end) == 0) {
        return "";
    }
    static const char head[] = "Error in ";
    return m.substr(sizeof(head) - 1, at - (sizeof(head) - 1)) + " at " +
            m.substr(at + 4, line_end - at - 4);
}

std::string error_message(const std::exception& e) {
    std::string m = bare_error_message(e);
    const char* flag = std::getenv("KVINDEX_ERROR_LOCATION");
    if (flag && std::strcmp(flag, "1") == 0) {
        std::string where = error_location(e);
        if (!where.empty()) {
            m += " [" + where + "]";
        }
    }
    return m;
}

namespace detail {

void throw_invalid_data(const faiss::FaissException& e, const char* reader, const std::string& source) {
    std::string m = bare_error_message(e);
    const std::string prefix = std::string(reader) + ": ";
    if (m.compare(0, prefix.size(), prefix) == 0) {
        m.erase(0, prefix.size());
    }
    m = prefix + source + ": " + m;
    const std::string where = error_location(e);
    throw InvalidData(where.empty() ? m : "Error in " + where + ": " + m);
}

} // namespace detail

} // namespace kvindex
